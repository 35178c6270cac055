"""A replayable producer for the reliability suite, run as a child so it can be SIGKILLed.

Usage: ``python producer_child.py ENDPOINT PRODUCER_ID COUNT RATE [MODE]`` (records/s, 0:
no limit), ``MODE`` one of ``bind``, ``connect``, ``direct DIR``, ``volatile``.
``bind`` (default): the producer binds ENDPOINT and the source connects to it;
``connect``: the producer is a flow client of a source that binds ENDPOINT
(``Producer(connect=...)``), reconnecting after the source's driver dies; ``direct DIR``:
the producer binds ENDPOINT with its retention in folder ``DIR``
(``Producer(retention_dir=DIR)``) for a ``readMode=direct`` source, which never becomes
its taker (tasks read ranges, the driver acks on a control flow); ``volatile``: the same
without retention (records in memory only), and record ``s`` is ``b"r<s>@<incarnation>"``.

Record ``s`` (1-based) is always ``b"r<s>"`` (but ``volatile``), as from an instrument
that can re-read its data. The :class:`~zio_spark.source.producer.Producer` keeps
unacknowledged records in memory only, so a killed producer loses what it held; on restart
(same id, same endpoint) it waits for the taker's ``resume`` (in the taker's BOT, or in
the server taker's reply to ours), which moves its numbering on to the last record the
source holds, and produces from there: so the source decides where a restarted producer
resumes, and any gap or overlap would show in the output.

``direct``: a restart reopens the folder, so it keeps its records, its numbering and its
incarnation; it resumes after the last record the folder holds (``Producer.last_seq``: a
``send_many`` the kill cut short left a torn tail, cut off on reopen, so those records
are sent again under the same numbers). No taker's ``resume`` is involved: the folder
decides.

``volatile``: a restart is a new incarnation numbering from 1 again, whose records are
sent again from the first (tagged with the new incarnation, so that the output tells the
numberings apart); what the killed one held beyond the last commit is lost by design.

CURVE (a bound producer: ``bind``, ``direct``, ``volatile``): with ``ZIO_CHAOS_PRODUCER_SECRET``
in the environment (its server secret key, Z85), the producer serves over CURVE, and with
``ZIO_CHAOS_PRODUCER_ALLOW`` too (client public keys, comma-separated) it admits only those
keys and the run keys their control flows lease (``curve_allowed_client_keys``). Keys come
through the environment so that no secret is in a command line or a file. Such a
producer also waits for a run key to be leased before it produces, and prints ``RUN_KEY
<key>`` (a public key).

Prints ``ENDPOINT <ep>``, ``INCARNATION <inc>`` (``direct``, ``volatile``), ``RESUME
<seq>`` once a taker is attached (``direct``, ``volatile``: once the driver's control flow
is), ``RUN_KEY <key>`` (with an allow-list), ``SENT <count>`` when everything is queued,
then waits to be killed or terminated.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import zmq

from zio_spark.errors import TransportError
from zio_spark.source.producer import Producer

CHUNK = 1000
BIND_RETRY_S = 15.0
TAKER_WAIT_S = 600.0


def curve_settings() -> dict[str, object]:
    """The CURVE keywords of a bound producer from the environment (module docstring)."""
    secret = os.environ.get("ZIO_CHAOS_PRODUCER_SECRET")
    allow = os.environ.get("ZIO_CHAOS_PRODUCER_ALLOW")
    if secret is None:
        return {}
    out: dict[str, object] = {"curve_secret_key": secret}
    if allow:
        out["curve_allowed_client_keys"] = allow.split(",")
    return out


def bind(
    endpoint: str, producer_id: str, connect: bool = False, retention: str | None = None
) -> Producer:
    """The previous incarnation's listener may still be going away: retry briefly."""
    if connect:
        return Producer(connect=endpoint, producer_id=producer_id, linger_ms=0, max_unacked=200_000)
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return Producer(
                endpoint,
                producer_id=producer_id,
                linger_ms=0,
                max_unacked=200_000,
                retention_dir=retention,
                **curve_settings(),  # type: ignore[arg-type]
            )
        except (TransportError, zmq.ZMQError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> int:
    endpoint, producer_id = sys.argv[1:3]
    count, rate = int(sys.argv[3]), float(sys.argv[4])
    topology = sys.argv[5] if len(sys.argv) > 5 else "bind"
    if topology not in ("bind", "connect", "direct", "volatile") or (topology == "direct") != (
        len(sys.argv) > 6
    ):
        print(
            f"topology must be 'bind', 'connect', 'direct DIR' or 'volatile', got {sys.argv[5:]!r}",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    retention = sys.argv[6] if topology == "direct" else None
    direct = topology in ("direct", "volatile")
    prod = bind(endpoint, producer_id, connect=topology == "connect", retention=retention)
    print("ENDPOINT", prod.endpoint, flush=True)
    tag = b"@%s" % prod.incarnation.encode() if topology == "volatile" else b""
    if direct:
        print("INCARNATION", prod.incarnation, flush=True)
    deadline = time.monotonic() + TAKER_WAIT_S
    # ``direct``: the reader's driver is no taker; production starts once its control
    # flow is open (a restart: once the driver's next held query reopened it), so that
    # the records are produced while the query runs, as after a taker's BOT.
    while not (prod.stats["control_flows"] if direct else prod.connected):
        if time.monotonic() > deadline:
            print("NO_TAKER", flush=True)
            return 1
        time.sleep(0.02)
    # The taker's resume (0 on a fresh source), or the folder's last (0 when volatile).
    resume = prod.last_seq
    print("RESUME", resume, flush=True)
    if prod.curve_allowed_client_keys is not None:
        # The control flow registers the run key right after its BOT.
        while not prod.run_keys:
            if time.monotonic() > deadline:
                print("NO_RUN_KEY", flush=True)
                return 1
            time.sleep(0.02)
        print("RUN_KEY", min(prod.run_keys).decode(), flush=True)
    seq = resume + 1
    started = time.monotonic()
    while seq <= count:
        n = min(CHUNK, count - seq + 1)
        if rate > 0:  # paced, so that the stream spans the kills
            ahead = started + (seq - resume - 1 + n) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        last = prod.send_many([b"r%d%s" % (s, tag) for s in range(seq, seq + n)], timeout=None)
        if last != seq + n - 1:
            print(f"NUMBERING queued {seq}..{seq + n - 1} got last {last}", flush=True)
            return 1
        seq += n
    print("SENT", count, flush=True)
    while True:
        time.sleep(1.0)  # serve resends until killed or terminated


if __name__ == "__main__":
    sys.exit(main())
