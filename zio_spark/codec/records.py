"""Records in DAT payloads: the one Arrow DAT codec and the one plain-record codec.

**Arrow DATs.** Python pays per frame and per object, so a DAT from our own producer
carries many records in one payload frame: an Arrow IPC *stream* holding one record
batch of :data:`~zio_spark.codec.schema.WIRE_SCHEMA` (:func:`encode_records`,
:func:`decode_batch`); the producer announces it in its BOT (``"encoding": "arrow"``).
The sink's ``format=arrow`` DATs are the same kind of stream with the columns of
:data:`~zio_spark.codec.schema.SINK_SCHEMA` (:func:`encode_payload`,
:func:`decode_payload`). Both are :func:`encode_stream`/:func:`decode_stream` with their
schema.

**Plain records.** A plain ZIO giver (the reference's, or ours towards a plain taker)
sends one record per DAT: the payload is the value (:func:`plain_value`), the DAT label
may carry ``key`` (base64 text) and ``headers`` (an object of strings). The one reading
of such a DAT (:func:`decode_plain`), used by the source's receiver and the sink's
consumer alike, is what the user sees in the ``key`` and ``headers`` columns:

- ``key``, when it is valid base64 text, becomes the record's key;
- ``headers``, when it is an object, is the record's headers (a value that is not a
  string is kept as its JSON text);
- any other label attribute (a foreign peer's own, or a ``key`` that is not base64) is
  kept as a header of that name, its value as text (JSON text unless a string);
- a DAT with several payload frames keeps them whole in czmq's length-prefixed framing,
  with the frame count in the header ``zio.frames``.

So a row the sink writes to a plain taker, with its key and headers, reads back from the
source as the same row. :func:`plain_attrs` writes that label.

Decoding checks everything a hostile peer could get wrong (not Arrow, wrong schema, null
or non-contiguous sequence numbers) and raises
:class:`~zio_spark.errors.RemoteProtocolError` naming the field.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from zio_spark.codec.schema import SINK_SCHEMA, WAL_SCHEMA, WIRE_SCHEMA
from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol.message import join_single

__all__ = [
    "DAT_BYTES",
    "DAT_RECORDS",
    "ENCODING",
    "WIRE_SCHEMA",
    "PlainRecord",
    "decode_batch",
    "decode_payload",
    "decode_plain",
    "decode_stream",
    "encode_batch",
    "encode_payload",
    "encode_records",
    "encode_stream",
    "plain_attrs",
    "plain_value",
    "seq_array",
    "wire_to_wal",
]

ENCODING = "arrow"
"""The name of the Arrow DAT encoding in a BOT's ``encoding``."""

DAT_RECORDS = 4096
"""Default most records per Arrow DAT (the producer's ``batch``, the source's offer).
Per-DAT costs (decode, WAL record, CRC, syscalls) dominate below a few thousand
100-byte records: 4096 against 1000 halved the source runner's CPU per record."""

DAT_BYTES = 4 << 20
"""A producer's Arrow DAT holds about this many value bytes at most (at least one
record), so large records do not make ``DAT_RECORDS`` a huge message."""

_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker, length 0
_SCHEMA_MESSAGES: dict[int, tuple[pa.Schema, bytes]] = {}


def _schema_message(schema: pa.Schema) -> bytes:
    got = _SCHEMA_MESSAGES.get(id(schema))
    if got is None or got[0] is not schema:
        got = (schema, schema.serialize().to_pybytes())
        _SCHEMA_MESSAGES[id(schema)] = got
    return got[1]


# ------------------------------------------------------------------------- Arrow DATs


def encode_stream(batch: pa.RecordBatch, schema: pa.Schema) -> bytes:
    """One Arrow DAT payload: an Arrow IPC stream holding ``batch``, of ``schema``.

    Raises
    ------
    LocalProtocolError
        If the batch's schema is not ``schema``.
    """
    if not batch.schema.equals(schema):
        raise LocalProtocolError(
            f"record batch schema must be {schema}, got {batch.schema}", field="schema"
        )
    # schema message + record batch message + end-of-stream marker = an IPC stream; one
    # pre-sized copy instead of a growing output stream and a second copy out of it.
    return b"".join((_schema_message(schema), batch.serialize(), _IPC_EOS))


def decode_stream(data: bytes, schema: pa.Schema, *, one: bool = False) -> list[pa.RecordBatch]:
    """The record batches of one Arrow DAT payload, checked to be of ``schema``.

    ``one``: the stream must hold exactly one batch (checked before the schema).

    Raises
    ------
    RemoteProtocolError
        ``field="payload"`` if the bytes are not an Arrow IPC stream (or, with ``one``,
        hold another number of batches), ``field="schema"`` if its schema differs.
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        got = reader.schema
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise RemoteProtocolError(
            f"DAT payload is not an Arrow IPC stream: {e}", field="payload"
        ) from None
    if one and len(batches) != 1:
        raise RemoteProtocolError(
            f"DAT payload must hold exactly one record batch, got {len(batches)}",
            field="payload",
            value=len(batches),
        )
    if not got.equals(schema):
        raise RemoteProtocolError(f"DAT record schema must be {schema}, got {got}", field="schema")
    return batches


def encode_batch(batch: pa.RecordBatch) -> bytes:
    """Serialise a batch of :data:`WIRE_SCHEMA` as one Arrow IPC stream.

    Raises
    ------
    LocalProtocolError
        If the batch's schema is not :data:`WIRE_SCHEMA`.
    """
    return encode_stream(batch, WIRE_SCHEMA)


def seq_array(first: int, n: int) -> pa.Array:
    """``first, first + 1, ... first + n - 1`` as an int64 array: from numpy's arange
    (~4 us for 4,096), not a Python range (~530 us, most of a DAT's encoding)."""
    return pa.array(np.arange(first, first + n, dtype=np.int64))


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
            seq_array(first_seq, n),
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
    (batch,) = decode_stream(data, WIRE_SCHEMA, one=True)
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


_U64 = 1 << 64
_WAL_TIMESTAMP: Final = WAL_SCHEMA.field("timestamp").type


def wire_to_wal(
    batch: pa.RecordBatch,
    *,
    origin: int,
    timestamp_us: int,
    memory_pool: pa.MemoryPool | None = None,
) -> pa.RecordBatch:
    """A decoded Arrow DAT (:data:`WIRE_SCHEMA`, from :func:`decode_batch`) as the
    spool's :data:`~zio_spark.codec.schema.WAL_SCHEMA` columns, each taken by name.

    ``value``, ``key``, ``seq`` and ``headers`` are the wire's (no copy); ``granule``
    too, a null read as 0; ``origin`` (the DAT's, uint64 on the wire) is stored as its
    int64 two's complement; ``timestamp`` is ``timestamp_us`` (when the receiver took
    the DAT), the same for every record. Records the spool already holds are its to
    drop (:meth:`~zio_spark.storage.spool.Spool.append_batch`). The columns made here
    come from ``memory_pool`` (None: Arrow's default).

    Raises
    ------
    LocalProtocolError
        ``field="schema"`` if ``batch`` is not of :data:`WIRE_SCHEMA`, ``field="origin"``
        if ``origin`` is outside ``[-2**63, 2**64)``.
    """
    if not batch.schema.equals(WIRE_SCHEMA):
        raise LocalProtocolError(
            f"wire_to_wal needs a batch of {WIRE_SCHEMA}, got {batch.schema}", field="schema"
        )
    if not -(1 << 63) <= origin < _U64:
        raise LocalProtocolError(
            f"origin {origin} is outside [-2**63, 2**64)", field="origin", value=origin
        )
    n = batch.num_rows
    signed = origin - _U64 if origin >= 1 << 63 else origin
    granule = batch.column("granule")
    if granule.null_count:
        granule = pc.coalesce(granule, pa.scalar(0, pa.int64()), memory_pool=memory_pool)
    columns = {
        "value": batch.column("value"),
        "key": batch.column("key"),
        "seq": batch.column("seq"),
        "origin": pa.repeat(pa.scalar(signed, pa.int64()), n, memory_pool=memory_pool),
        "granule": granule,
        "timestamp": pa.repeat(pa.scalar(timestamp_us, _WAL_TIMESTAMP), n, memory_pool=memory_pool),
        "headers": batch.column("headers"),
    }
    return pa.RecordBatch.from_arrays(
        [columns[name] for name in WAL_SCHEMA.names], schema=WAL_SCHEMA
    )


def _increasing_by_one(seq: pa.Array) -> bool:
    # numpy on the (null-free, zero-copy) int64 buffer: ~5 us for a 1000-record DAT, where
    # three compute kernels cost ~60 us (13 % of the receiver thread's time, profiled).
    a = seq.to_numpy()
    return bool((np.diff(a) == 1).all())


def encode_payload(batch: pa.RecordBatch) -> bytes:
    """One DAT payload of the sink's ``format=arrow``: a batch of :data:`SINK_SCHEMA`.

    Raises
    ------
    LocalProtocolError
        If the batch is not of :data:`SINK_SCHEMA`.
    """
    return encode_stream(batch, SINK_SCHEMA)


def decode_payload(data: bytes) -> list[pa.RecordBatch]:
    """Decode one DAT payload of the sink's ``format=arrow`` (any number of batches).

    Raises
    ------
    RemoteProtocolError
        ``field="payload"`` if the bytes are not an Arrow IPC stream, ``field="schema"``
        if its schema is not :data:`SINK_SCHEMA`.
    """
    return decode_stream(data, SINK_SCHEMA)


# ---------------------------------------------------------------------- plain records


class PlainRecord(NamedTuple):
    """One record of a plain DAT, as the ``value``, ``key`` and ``headers`` columns."""

    value: bytes
    key: bytes | None
    headers: dict[str, str] | None


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


def _text(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def decode_plain(payload: tuple[bytes, ...], attrs: Mapping[str, Any]) -> PlainRecord:
    """The record a plain DAT carries: its payload and its label's extra attributes
    (``attrs``, without ``flow``), read as the module docstring says. Never raises on
    what a peer sends: every attribute ends up somewhere."""
    value, nframes = plain_value(payload)
    key: bytes | None = None
    headers: dict[str, str] = {}
    for name, v in attrs.items():
        if name == "key" and isinstance(v, str):
            try:
                key = base64.b64decode(v, validate=True)
                continue
            except ValueError:  # binascii.Error is one
                pass  # not base64: kept as a header, like any foreign attribute
        if name == "headers" and isinstance(v, Mapping):
            for hk, hv in v.items():
                headers[str(hk)] = _text(hv)
            continue
        headers[name] = _text(v)
    if nframes > 1:
        headers["zio.frames"] = str(nframes)
    return PlainRecord(value, key, headers or None)


def plain_attrs(
    key: bytes | None, headers: Mapping[str, str] | None, into: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The label attributes of a plain record's DAT: ``key`` (base64 text) and
    ``headers`` when present, added to ``into`` (returned; a new dict if None). A record
    with neither adds nothing, so its label stays the reference's bare ``{"flow": "DAT"}``."""
    attrs = {} if into is None else into
    if key is not None:
        attrs["key"] = base64.b64encode(key).decode("ascii")
    if headers:
        attrs["headers"] = dict(headers)
    return attrs
