"""Pure protocol code: bytes and ``now`` in, messages and bytes out.

Nothing in this package may import zmq, pyspark, threading, socket or time: a test
imports it in a fresh interpreter and checks ``sys.modules``. One module per protocol:

- :mod:`.message` -- the ZIO message codec (multipart and czmq single-frame forms).
- :mod:`.flow` -- the ZIO flow state machine (BOT/PAY/DAT/EOT) and zio-spark profile.
- :mod:`.negotiate` -- the profile's handshake terms, read so that an echoed BOT means
  a plain peer.
- :mod:`.ranges` -- range reads (direct mode): the capability, range and held requests
  on PAY, their answers on DAT, the giver's serving rule and the reader's checks.
- :mod:`.sink` -- the sink profile: data BOT (``spark_batch``), commit/abort commands and
  their replies, the EOT echo.
- :mod:`.zre` -- the 36/ZRE wire codec: beacons, identities, commands.
- :mod:`.zre_peers` -- the ZRE peer table (events, sequences, expiry), a state machine.
- :mod:`.zio_ports` -- the ``zio.port.*`` HELLO headers that advertise ZIO flow ports.
- :mod:`.pzq` -- PZQ producer, consumer and monitor frames.
- :mod:`.pzq_fields` -- the field checks and errors the PZQ modules share.
- :mod:`.pzq_inflight` -- the PZQ queue's table of deliveries awaiting an ack.
"""

from __future__ import annotations
