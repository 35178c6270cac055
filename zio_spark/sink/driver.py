"""The sink's driver side: which consumers a writer sends to, and the commit and abort
of a batch at each of them (the Spark hooks in :mod:`zio_spark.spark.sink` call it).

A command BOT goes only to an endpoint known to be a zio-spark consumer: a plain ZIO
taker would take it for a new flow (and a reference server would end the flow in
progress for it). What an endpoint is, the tasks' reports tell (a flow's EOT echo
carries ``rows`` from a consumer only); a :class:`SinkDriver` remembers it across
batches. An endpoint that no flow has reached yet (every partition towards it was
empty) gets no command: an all-empty batch is then not recorded there, which loses
nothing (it published nothing).

Spark makes a new writer object for every micro-batch and runs commit/abort on yet
another, so what must outlive a batch (what each endpoint is, the ZRE nodes) lives in a
driver object the process keeps (:mod:`zio_spark.spark.sink` holds one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from zio_spark.errors import ConfigError, ZioSparkError
from zio_spark.options import SinkOptions
from zio_spark.protocol.sink import BatchId
from zio_spark.sink.client import send_command
from zio_spark.transport.discovery import NodeCache, Target, resolve_targets

__all__ = ["Command", "SinkDriver", "TaskReport", "configured_mode"]

log = logging.getLogger("zio_spark.sink")


class TaskReport(Protocol):
    """What one task reports of its partition (the Spark commit message)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def plain(self) -> bool: ...
    @property
    def query(self) -> str | None: ...
    @property
    def mode(self) -> str | None: ...


Command = Callable[..., Any]
"""Sends one command to a consumer (:func:`~zio_spark.sink.client.send_command`)."""


def configured_mode(opts: SinkOptions) -> str | None:
    """The socket mode of the ``socket`` option (None: ``auto``)."""
    return None if opts.socket == "auto" else opts.socket


@dataclass
class _Endpoint:
    plain: bool | None  # a plain ZIO taker; None: not known (no flow told yet)
    query: str | None
    mode: str | None
    parts: list[tuple[int, int, int]] = field(default_factory=list)


def _why_not(endpoint: str, plain: bool | None) -> str:
    if plain:
        return f"{endpoint} is a plain ZIO taker (nothing staged there)"
    return (
        f"no flow of this batch reached {endpoint} (its partitions were empty) and it is "
        "not known to be a zio-spark consumer (a plain ZIO taker would take the "
        "command's BOT for a new flow)"
    )


class SinkDriver:
    """Targets, commit and abort of one process's sink writers.

    Keeps what the tasks' reports told of each endpoint (a zio-spark consumer or a plain
    ZIO taker) and the ZRE nodes of group targets (:class:`NodeCache`). ``send`` sends a
    command (tests pass a stand-in). Thread-safe.
    """

    def __init__(self, *, nodes: NodeCache | None = None, send: Command = send_command) -> None:
        self.nodes = NodeCache() if nodes is None else nodes
        self._send = send
        self._known: dict[str, bool] = {}
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Stop the ZRE nodes (best effort)."""
        self.nodes.stop()

    def known(self, endpoint: str) -> bool | None:
        """True for a plain ZIO taker, False for a zio-spark consumer, None: not known."""
        with self._lock:
            return self._known.get(endpoint)

    def targets(self, opts: SinkOptions) -> tuple[Target, ...]:
        """The consumers a writer sends to, sorted by endpoint (partition ``p`` goes to
        ``targets[p % len(targets)]``).

        With ``endpoint``: that one. With ``group``: the flow ports advertised in the ZRE
        group, each with the socket mode its advertised socket type needs; waits up to
        ``connectTimeout`` for at least one.

        Raises
        ------
        TransportError
            No usable consumer is advertised in the group within ``connectTimeout``.
        """
        if opts.zre is None:
            if opts.endpoint is None:  # pragma: no cover - parse_sink_options ensures one
                raise ConfigError("endpoint", None, "an 'endpoint' or a 'group'")
            return ((opts.endpoint, configured_mode(opts)),)
        return resolve_targets(
            self.nodes,
            opts.zre,
            requested_mode=configured_mode(opts),
            timeout=opts.connect_timeout,
        )

    def _learn(self, endpoint: str, plain: bool | None) -> bool | None:
        """Record what a batch told of ``endpoint``; returns what is known of it."""
        with self._lock:
            if plain is None:
                return self._known.get(endpoint)
            self._known[endpoint] = plain
            return plain

    def _endpoints(self, reports: Iterable[TaskReport], opts: SinkOptions) -> dict[str, _Endpoint]:
        """What the reports (and earlier batches' reports) say about each endpoint they
        name."""
        seen: dict[str, list[TaskReport]] = {}
        for m in reports:
            seen.setdefault(m.endpoint, []).append(m)
        out: dict[str, _Endpoint] = {}
        for ep, ms in seen.items():
            # Empty partitions opened no flow, so only a report with rows can tell.
            plain: bool | None = None
            if any(m.rows and not m.plain for m in ms):
                plain = False
            elif any(m.plain for m in ms):
                plain = True
            query = next((m.query for m in ms if m.query is not None), None)
            mode = next((m.mode for m in ms if m.mode is not None), configured_mode(opts))
            parts = sorted((m.partition, m.attempt, m.rows) for m in ms)
            out[ep] = _Endpoint(self._learn(ep, plain), query, mode, parts)
        return out

    def commit(self, opts: SinkOptions, reports: Sequence[TaskReport], batch: BatchId) -> None:
        """Tell each consumer to publish the staged partitions of ``batch``.

        The consumers are the ones the reports name (each partition's, empty ones
        included) and, with an explicit ``endpoint``, that one even with no reports (it
        records the batch id); each with the socket mode its reports name.

        Raises
        ------
        CommandError
            A consumer answered ``error`` (e.g. a partition is not staged).
        TransportError
            A consumer did not answer within ``connectTimeout``.
        """
        found = self._endpoints(reports, opts)
        if opts.endpoint is not None and opts.endpoint not in found:
            known = self._learn(opts.endpoint, None)
            found[opts.endpoint] = _Endpoint(known, None, configured_mode(opts))
        if not found:
            log.info("zio sink: batch %r has no partitions; nothing to commit", batch)
        for ep, t in sorted(found.items()):
            if t.plain is not False:
                log.info("zio sink: batch %r not committed: %s", batch, _why_not(ep, t.plain))
                continue
            self._send(
                ep,
                "commit",
                opts.stream,
                batch,
                t.parts,
                query=t.query,
                mode=t.mode,
                curve=opts.curve,
                timeout=opts.connect_timeout,
            )

    def abort(
        self,
        opts: SinkOptions,
        reports: Sequence[TaskReport],
        batch: BatchId,
        targets: Sequence[Target] = (),
    ) -> None:
        """Tell each consumer to discard the staging of ``batch``; best effort, never
        raises a :class:`~zio_spark.errors.ZioSparkError` (logged).

        Goes to the endpoints the reports name, the ``endpoint`` option and ``targets``
        (failed tasks report nothing, so reports cannot be relied on), each only if it
        is known to be a zio-spark consumer (from this batch's reports or an earlier
        batch's).
        """
        found = self._endpoints(reports, opts)
        modes: dict[str, str | None] = {ep: t.mode for ep, t in found.items()}
        for ep, mode in targets:
            modes.setdefault(ep, mode)
        if opts.endpoint is not None:
            modes.setdefault(opts.endpoint, configured_mode(opts))
        for ep, mode in sorted(modes.items()):
            plain = found[ep].plain if ep in found else self._learn(ep, None)
            if plain is not False:
                log.info("zio sink: no abort of batch %r sent: %s", batch, _why_not(ep, plain))
                continue
            try:
                self._send(
                    ep,
                    "abort",
                    opts.stream,
                    batch,
                    mode=mode,
                    curve=opts.curve,
                    timeout=min(opts.connect_timeout, 10.0),
                )
            except ZioSparkError as e:
                log.warning("zio sink: abort of batch %r at %s failed: %s", batch, ep, e)
