"""Pure protocol code: bytes and ``now`` in, messages and bytes out.

Nothing in this package may import zmq, pyspark, threading, socket or time: a test
imports it in a fresh interpreter and checks ``sys.modules``. One module per protocol:

- :mod:`.message` -- the ZIO message codec (multipart and czmq single-frame forms).
- :mod:`.flow` -- the ZIO flow state machine (BOT/PAY/DAT/EOT) and zio-spark profile.
- :mod:`.negotiate` -- the profile's handshake terms, read so that an echoed BOT means
  a plain peer.
- :mod:`.zre` -- 36/ZRE beacons, commands and peer bookkeeping.
- :mod:`.pzq` -- PZQ producer, consumer and monitor frames.
"""

from __future__ import annotations
