"""The receiver's writing side: DATs into the spool.

:class:`SpoolWriting` turns what a flow delivers into spool records: an Arrow DAT
(:func:`~zio_spark.codec.records.decode_batch`) into the spool's WAL columns
(:func:`~zio_spark.codec.records.wire_to_wal`; records the spool already holds, a
producer resending after ``resume``, are dropped by the spool); a plain DAT into
one record, its label attributes as headers. What one drain took in per producer is
appended in one go (:meth:`SpoolWriting._append_pending`). A mixin of
:class:`~zio_spark.source.receiver.Receiver`: it runs in the receiver's thread.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from zio_spark.codec.records import decode_batch, decode_plain, wire_to_wal
from zio_spark.errors import DataLossError, RemoteProtocolError, StorageError
from zio_spark.protocol.flow import (
    Data,
)
from zio_spark.protocol.message import (
    Message,
)
from zio_spark.source.receiver_peers import Peer, ReceiverParts
from zio_spark.storage.spool import Record

__all__ = ["SpoolWriting"]

log = logging.getLogger("zio_spark.source")


class SpoolWriting(ReceiverParts):
    """DATs into the spool (a mixin of :class:`~zio_spark.source.receiver.Receiver`)."""

    def _take_plain(self, peer: Peer, msg: Message) -> None:
        """A plain DAT without attributes: its one payload frame is the record's value;
        what :meth:`_on_data` makes of it, without looking for attributes."""
        producer = peer.producer
        assert producer is not None  # a flow takes DATs only after the BOT named it
        pend = peer.pending
        seq = (pend.last or self.spool.next_seq(producer) - 1) + 1
        value = msg.payload[0]
        pend.records.append(
            Record(seq, value, None, msg.origin, msg.granule, self.wall_clock_us(), None)
        )
        pend.bytes += len(value)
        pend.dats += 1
        pend.last = seq

    def _append_pending(self, peer: Peer, now: float) -> bool:
        """Append what the drain took in; True if anything new reached the spool."""
        pend = peer.pending
        batches, records = pend.batches, pend.records
        if not batches and not records:
            return False
        pend.batches, pend.records, pend.last = [], [], 0
        pend.bytes = pend.dats = 0
        producer = peer.producer
        assert producer is not None
        total = sum(b.num_rows for b in batches) + len(records)
        try:
            if batches:
                # One WAL record each: concatenating first costs a copy, and sealing
                # regroups rows into large segment batches anyway.
                new = sum(self.spool.append_batch(producer, b) for b in batches)
            else:
                new = self.spool.append(producer, records)
        except DataLossError as e:
            # A gap: the producer no longer has records the spool never got. Fatal
            # for the query when failOnDataLoss (the spool then raises); reported.
            self.stats["data_loss"] += 1
            self.fatal = e
            peer.status.state = "failed"
            peer.status.last_error = str(e)
            if peer.flow is not None:
                self._end_flow(peer, eot=True)
            peer.retry_at = float("inf")
            if peer.bound is not None:
                peer.status.state = "failed"  # _end_flow filed it as done
            return False
        except (StorageError, ValueError, pa.ArrowException) as e:
            # Records the spool cannot take (e.g. too large for one WAL record): this
            # peer's flow fails, as it would have on the DAT; the others go on.
            self.stats["dropped"] += 1
            self._fail(peer, f"cannot store records: {type(e).__name__}: {e}", now)
            return False
        peer.status.records += new
        peer.status.duplicates += total - new
        peer.status.last_data = now
        self.stats["records"] += new
        return new > 0

    def _on_data(self, peer: Peer, data: Data) -> None:
        """Take one DAT's records into the drain's pending append."""
        producer = peer.producer
        assert producer is not None
        pend = peer.pending
        held = pend.last or self.spool.next_seq(producer) - 1
        ts = self.wall_clock_us()
        origin = data.message.origin
        if peer.arrow:
            if data.attrs:  # now and then: the producer states its state
                self._on_state(peer, data.attrs)
            elif peer.said_idle:
                peer.said_idle = peer.status.idle = False
            if len(data.message.payload) != 1:
                raise RemoteProtocolError(
                    f"Arrow DAT must have 1 payload frame, got {len(data.message.payload)}",
                    field="payload",
                )
            batch = decode_batch(data.message.payload[0])
            if batch.num_rows > peer.dat_rows:
                if batch.num_rows > max(self.batch, peer.dat_rows):
                    # Valid records: failing the flow would refetch the same DAT forever.
                    log.warning(
                        "producer %s sends %d records per DAT, above the %d asked for in "
                        "BOT; credit is sized for %d",
                        peer.endpoint,
                        batch.num_rows,
                        self.batch,
                        batch.num_rows,
                    )
                peer.dat_rows = batch.num_rows
            first = int(batch.column(0)[0].as_py())
            if held == 0 and first > 1 and producer not in self.spool.producers():
                held = self._start_at(producer, first)
            # Records the spool holds already (a resend) are dropped there, counted by
            # _append_pending as duplicates.
            wal = wire_to_wal(batch, origin=origin, timestamp_us=ts)
            pend.batches.append(wal)
            pend.bytes += wal.nbytes
            pend.dats += 1
            pend.last = max(held, first + batch.num_rows - 1)
            return
        else:
            value, key, headers = decode_plain(data.message.payload, data.attrs)
            records = [Record(held + 1, value, key, origin, data.message.granule, ts, headers)]
        pend.records.extend(records)
        pend.bytes += len(value)
        pend.dats += 1
        pend.last = held + 1

    def _start_at(self, producer: str, first: int) -> int:
        """First contact with a producer whose records start at ``first > 1``.

        An ack-capable producer forgets a record only once a taker acknowledged it, so
        records below ``first`` were delivered elsewhere (an earlier batch read, another
        spool): the stream starts at ``first``, recorded as a commit, instead of a
        sequence gap that would fail the query as data loss.
        """
        log.info("producer %r: first records start at seq %d; starting there", producer, first)
        self.spool.commit({producer: first})
        return self.spool.next_seq(producer) - 1
