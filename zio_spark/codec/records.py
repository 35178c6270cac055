"""Record batches on the wire: how a zio-spark producer packs many records into one DAT.

Python pays per frame and per object, so a DAT from our own producer carries many
records in one payload frame: an Arrow IPC *stream* holding one record batch with the
columns of :data:`WIRE_SCHEMA`. The producer announces this in its BOT
(``"encoding": "arrow"``); a plain ZIO giver sends one record per DAT, its payload being
the record's value (see :func:`plain_value`).

Decoding checks everything a hostile peer could get wrong (not Arrow, wrong schema, null
or non-contiguous sequence numbers) and raises
:class:`~zio_spark.errors.RemoteProtocolError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol.message import join_single

__all__ = ["WIRE_SCHEMA", "decode_batch", "encode_batch", "encode_records", "plain_value"]

WIRE_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("value", pa.binary()),
        pa.field("key", pa.binary()),
        pa.field("granule", pa.int64()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
    ]
)
ENCODING = "arrow"


def encode_batch(batch: pa.RecordBatch) -> bytes:
    """Serialise a batch of :data:`WIRE_SCHEMA` as one Arrow IPC stream.

    Raises
    ------
    LocalProtocolError
        If the batch's schema is not :data:`WIRE_SCHEMA`.
    """
    if not batch.schema.equals(WIRE_SCHEMA):
        raise LocalProtocolError(
            f"record batch schema must be {WIRE_SCHEMA}, got {batch.schema}", field="schema"
        )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, WIRE_SCHEMA) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def encode_records(
    first_seq: int,
    values: Sequence[bytes],
    keys: Sequence[bytes | None] | None = None,
    granules: Sequence[int | None] | None = None,
    headers: Sequence[Mapping[str, str] | None] | None = None,
) -> bytes:
    """Pack ``values`` (and optional keys, granules, headers) numbered from ``first_seq``.

    Raises
    ------
    LocalProtocolError
        If the optional columns do not have one entry per value.
    """
    n = len(values)
    for name, col in (("keys", keys), ("granules", granules), ("headers", headers)):
        if col is not None and len(col) != n:
            raise LocalProtocolError(
                f"{name} has {len(col)} entries for {n} values", field=name, value=len(col)
            )
    hdrs = None if headers is None else [None if h is None else list(h.items()) for h in headers]
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(range(first_seq, first_seq + n), pa.int64()),
            pa.array(values, pa.binary()),
            pa.nulls(n, pa.binary()) if keys is None else pa.array(keys, pa.binary()),
            pa.nulls(n, pa.int64()) if granules is None else pa.array(granules, pa.int64()),
            pa.nulls(n, WIRE_SCHEMA.field("headers").type)
            if hdrs is None
            else pa.array(hdrs, WIRE_SCHEMA.field("headers").type),
        ],
        schema=WIRE_SCHEMA,
    )
    return encode_batch(batch)


def decode_batch(data: bytes, expected_first: int | None = None) -> pa.RecordBatch:
    """Decode one DAT payload frame into a batch of :data:`WIRE_SCHEMA`.

    ``expected_first``, if given, is the sequence number the first record may have at
    most; records below it are duplicates the caller drops, so only ``seq`` being
    contiguous and increasing is checked here.

    Raises
    ------
    RemoteProtocolError
        ``field="payload"`` if the bytes are not one Arrow IPC stream with one batch,
        ``field="schema"`` if the schema differs, ``field="seq"`` if sequence numbers are
        null, not contiguous, or start after ``expected_first`` (a gap).
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as e:
        raise RemoteProtocolError(
            f"DAT payload is not an Arrow IPC stream: {e}", field="payload"
        ) from None
    if len(batches) != 1:
        raise RemoteProtocolError(
            f"DAT payload must hold exactly one record batch, got {len(batches)}",
            field="payload",
            value=len(batches),
        )
    batch = batches[0]
    if not batch.schema.equals(WIRE_SCHEMA):
        raise RemoteProtocolError(
            f"DAT record schema must be {WIRE_SCHEMA}, got {batch.schema}", field="schema"
        )
    n = batch.num_rows
    if n == 0:
        raise RemoteProtocolError("DAT record batch is empty", field="payload", value=0)
    seq = batch.column(0)
    if seq.null_count:
        raise RemoteProtocolError("DAT record seq has nulls", field="seq")
    first = seq[0].as_py()
    last = seq[n - 1].as_py()
    if first < 1 or last - first != n - 1 or (n > 1 and not _increasing_by_one(seq)):
        raise RemoteProtocolError(
            f"DAT record seq must run contiguously from >= 1, got {first}..{last} for {n} rows",
            field="seq",
            value=(first, last),
        )
    if expected_first is not None and first > expected_first:
        raise RemoteProtocolError(
            f"DAT record seq starts at {first}, expected at most {expected_first} (a gap)",
            field="seq",
            value=first,
        )
    return batch


def _increasing_by_one(seq: pa.Array) -> bool:
    diffs = pc.pairwise_diff(seq)
    return bool(pc.all(pc.equal(diffs.slice(1), 1)).as_py())


def plain_value(payload: tuple[bytes, ...]) -> tuple[bytes, int]:
    """The record value of a plain ZIO DAT and the number of payload frames.

    One frame is the value itself; none is an empty value; several are kept whole in
    czmq's length-prefixed framing (the count goes into the ``zio.frames`` header).
    """
    if len(payload) == 1:
        return payload[0], 1
    if not payload:
        return b"", 0
    return join_single(payload), len(payload)
