"""What a spool keeps about the producers that feed it, beyond their records.

Two small JSON files in the spool folder, each written whole and atomically (synced),
owned here and reached through :attr:`zio_spark.storage.spool.Spool.peers`:

- ``peers.json``: the producer id each endpoint stated in its BOT, so that the
  ``resume`` of the first BOT after a runner restart is right (the id names the
  records the spool holds);
- ``plain_flows.json``: the plain givers whose flow is open (BOT exchanged, no EOT
  either way), endpoint to producer id. A runner that was killed leaves its entries;
  the next one reads them (:attr:`SpoolPeers.left_open`) and must not send a new BOT
  into such a flow (a reference giver dies on one).

An unreadable file (not JSON, not an object) is logged and read as empty: losing it
costs a resend (``peers.json``) or a refusal not given (``plain_flows.json``), never
records. Used from one thread (the receiver's).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from zio_spark.storage.files import atomic_write

__all__ = ["PEERS_FILE", "PLAIN_FLOWS_FILE", "SpoolPeers"]

log = logging.getLogger("zio_spark.storage.spool")

PEERS_FILE = "peers.json"
PLAIN_FLOWS_FILE = "plain_flows.json"


class SpoolPeers:
    """The producer ids and open plain flows of the spool in ``root`` (see the module
    docstring)."""

    def __init__(self, root: Path) -> None:
        self.ids_path = root / PEERS_FILE
        self.plain_flows_path = root / PLAIN_FLOWS_FILE
        self._ids = _load(self.ids_path)
        self.left_open: dict[str, str] = _load(self.plain_flows_path)
        """Plain flows the previous runner left open (as read at open; not updated)."""
        self._open: dict[str, str] = {}

    def producer_of(self, endpoint: str) -> str | None:
        """The producer id ``endpoint`` last stated, or None."""
        return self._ids.get(endpoint)

    def remember(self, endpoint: str, producer: str) -> None:
        """``endpoint`` stated ``producer`` in its BOT: persisted if it is news."""
        if self._ids.get(endpoint) == producer:
            return
        self._ids[endpoint] = producer
        _save(self.ids_path, self._ids)

    def open_flows(self) -> dict[str, str]:
        """The plain flows recorded open by this runner, endpoint to producer id."""
        return dict(self._open)

    def keep_open(self, endpoint: str) -> None:
        """The flow to ``endpoint`` that the previous runner left open is still open:
        recorded again (with this runner's next write), not cleared."""
        if endpoint in self.left_open:
            self._open[endpoint] = self.left_open[endpoint]

    def mark_open(self, endpoint: str, producer: str) -> None:
        """A plain giver's flow to ``endpoint`` is open: persisted."""
        self._open[endpoint] = producer
        _save(self.plain_flows_path, self._open)

    def mark_closed(self, endpoint: str) -> None:
        """The plain flow to ``endpoint`` ended (an EOT either way, or its connection
        dropped): persisted, if it was recorded."""
        if self._open.pop(endpoint, None) is not None:
            _save(self.plain_flows_path, self._open)


def _load(path: Path) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _save(path: Path, data: dict[str, str]) -> None:
    raw = json.dumps(data, sort_keys=True).encode("utf-8")
    atomic_write(path, raw, sync=True, tmp=path.with_name(path.name + ".tmp"))
