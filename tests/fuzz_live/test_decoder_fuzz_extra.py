"""100k-case fuzz runs for the decoders the unit fuzz suites do not cover.

Already at >= 100k under ``-m fuzz`` elsewhere: the ZIO message codecs
(``tests/unit/test_message_fuzz.py``), the ZRE codecs (``tests/unit/test_zre_fuzz.py``)
and every PZQ codec (``tests/unit/test_pzq.py``). Here, seeded ``random.Random`` loops of
``CASES`` inputs each, half random bytes and half mutations of valid encodings:

- :func:`zio_spark.codec.records.decode_batch` (Arrow record batches in DATs, from a peer):
  only ``RemoteProtocolError``, and whatever decodes satisfies the documented checks;
- the spool's WAL record decoder ``_decode_wal_record`` (mutated payloads carrying a
  *valid* CRC, so the decoder behind the checksum is reached): ``None`` or a record,
  never an exception;
- the spool's sealed-segment reader :func:`~zio_spark.storage.spool.read_sealed` on
  corrupted segment files: ``CorruptSegmentError`` (a ``DataLossError``) or fully valid
  batches of exactly the requested sequence numbers;
- the queue store's record payload decoder ``store_format.parse_message``: only ``ValueError`` /
  ``struct.error`` (what its caller catches);
- the flow profile readers ``profile_bot`` / ``pay_ack`` and :meth:`Flow.receive` on
  random flow objects: only ``ProtocolError``.

A few hundred cases of each also run in the default suite (``SMOKE``).
"""

from __future__ import annotations

import contextlib
import json
import random
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.fuzz_live.live_fuzz_support import mutate, report
from zio_spark.codec.records import WIRE_SCHEMA, decode_batch, encode_batch, encode_records
from zio_spark.errors import DataLossError, ProtocolError, RemoteProtocolError
from zio_spark.protocol.flow import Direction, Flow, Role, pay_ack, profile_bot
from zio_spark.protocol.message import Message
from zio_spark.storage import spool as spool_mod
from zio_spark.storage import store_format as store_mod
from zio_spark.storage import wal as wal_mod
from zio_spark.storage.spool import Record, Spool, read_sealed

CASES = 100_000
SMOKE = 300


def cases() -> list[object]:
    return [
        pytest.param(SMOKE, id="smoke"),
        pytest.param(CASES, id="100k", marks=[pytest.mark.fuzz, pytest.mark.timeout(1800)]),
    ]


def _done(name: str, n: int, t0: float, **counts: int) -> None:
    extra = ", ".join(f"{k}={v}" for k, v in counts.items())
    report(f"decoder {name}: {n} cases in {time.monotonic() - t0:.1f} s ({extra})")


def _garbage_or_mutant(rng: random.Random, valid: list[bytes], max_len: int) -> bytes:
    """Up to ``max_len`` random bytes (30 % of the time) or a mutation of one of ``valid``."""
    if rng.random() < 0.3:
        return rng.randbytes(rng.randint(0, max_len))
    return mutate(rng.choice(valid), rng)


# ------------------------------------------------------------------ records.decode_batch


def _valid_batches(rng: random.Random) -> list[bytes]:
    out = [
        encode_records(1, [b"a", b"bb", b""]),
        encode_records(7, [b"v"] * 20, [b"k"] * 20, list(range(20)), [{"h": "x"}] * 20),
        encode_records(2**40, [rng.randbytes(30) for _ in range(5)]),
    ]
    other = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int64())], names=["seq"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, other.schema) as w:
        w.write_batch(other)
    out.append(sink.getvalue().to_pybytes())  # wrong schema
    gap = pa.RecordBatch.from_arrays(
        [
            pa.array([1, 3], pa.int64()),
            pa.array([b"a", b"b"]),
            pa.nulls(2, pa.binary()),
            pa.nulls(2, pa.int64()),
            pa.nulls(2, WIRE_SCHEMA.field("headers").type),
        ],
        schema=WIRE_SCHEMA,
    )
    out.append(encode_batch(gap))  # non-contiguous seq
    return out


@pytest.mark.parametrize("n", cases())
def test_fuzz_decode_batch(n: int) -> None:
    rng = random.Random("records-decode-batch")
    valid = _valid_batches(rng)
    t0 = time.monotonic()
    decoded = 0
    for _ in range(n):
        data = _garbage_or_mutant(rng, valid, 300)
        expected_first = rng.choice([None, 1, 7, 2**40])
        try:
            batch = decode_batch(data, expected_first)
        except RemoteProtocolError as e:
            assert e.field in ("payload", "schema", "seq")
            continue
        decoded += 1
        assert batch.schema.equals(WIRE_SCHEMA)
        seqs = batch.column(0).to_pylist()
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] >= 1
    _done("records.decode_batch", n, t0, decoded=decoded)


# ------------------------------------------------------------------ spool WAL records


def _wal_record(rng: random.Random, tmp: Path) -> bytes:
    sp = Spool(tmp / "spool")
    try:
        sp.append("p", [Record(i, b"v%d" % i, None, 0, 0, 0, None) for i in range(1, 6)])
        sp.append("q-" + "x" * 13, [Record(1, None, b"k", 2**64 - 1, 5, 6, {"a": "b"})])
        sp.flush()
    finally:
        sp.close()
    wal = sorted((tmp / "spool" / "wal").glob("*.wal"))
    return b"".join(p.read_bytes() for p in wal)


def _reseal(record: bytes) -> bytes:
    """A WAL record with a correct length and CRC for whatever payload it now has."""
    payload = record[wal_mod._WAL_HEADER.size :]
    return wal_mod._WAL_HEADER.pack(wal_mod._WAL_MAGIC, len(payload), zlib.crc32(payload), 0) + (
        payload
    )


@pytest.mark.parametrize("n", cases())
def test_fuzz_spool_wal_record_decoder(n: int, tmp_path: Path) -> None:
    rng = random.Random("spool-wal")
    stream = _wal_record(rng, tmp_path)
    first = wal_mod._decode_wal_record(pa.py_buffer(stream), 0)
    assert first is not None
    records = [stream[: first[0]], stream[first[0] :]]
    t0 = time.monotonic()
    decoded = 0
    for _ in range(n):
        choice = rng.randrange(4)
        if choice == 0:
            data = rng.randbytes(rng.randint(0, 200))
        elif choice == 1:  # mutated anywhere (the CRC usually catches it)
            data = mutate(rng.choice(records), rng)
        else:  # mutated payload behind a valid CRC: the decoder proper
            rec = rng.choice(records)
            head = wal_mod._WAL_HEADER.size
            data = _reseal(rec[:head] + mutate(rec[head:], rng))
        off = 0 if rng.random() < 0.9 else rng.randint(0, len(data))
        got = wal_mod._decode_wal_record(pa.py_buffer(data), off)
        if got is not None:
            decoded += 1
            length, producer, _, batch = got
            assert 0 < length <= len(data) - off
            assert isinstance(producer, str)
            assert batch.schema.equals(wal_mod._WAL_SCHEMA)
            batch.validate(full=True)
            seqs = batch.column("seq").to_pylist()
            assert seqs == sorted(set(seqs)) and seqs[0] >= 1
    _done("spool._decode_wal_record", n, t0, decoded=decoded)


# ------------------------------------------------------------------ spool sealed segments


def _segment(tmp: Path) -> tuple[Path, bytes, list[pa.RecordBatch]]:
    sp = Spool(tmp / "spool")
    try:
        sp.append("p", [Record(i, b"value-%d" % i) for i in range(1, 41)])
        sp.flush()
        sp.seal()
        rows = list(sp.read("p", 1, 41))
    finally:
        sp.close()
    (seg,) = (tmp / "spool" / "producers").glob("*/*.arrow")
    return seg, seg.read_bytes(), rows


def _read_all(path: Path) -> list[pa.RecordBatch]:
    return list(read_sealed(path, "p", 1, 41))


@pytest.mark.parametrize("n", cases())
def test_fuzz_spool_segment_reader(n: int, tmp_path: Path) -> None:
    """Corrupted segment files: ``CorruptSegmentError`` (a ``DataLossError``) naming the
    file and the field, or batches that validate fully and hold exactly the requested
    sequence numbers. Nothing else: no other exception, no invalid batch. The values may
    still differ (an Arrow IPC file has no checksum: a flipped value byte goes unnoticed);
    that is counted, not failed on.
    """
    rng = random.Random("spool-segment")
    path, original, rows = _segment(tmp_path)
    intact = pa.Table.from_batches(rows).combine_chunks()
    root = tmp_path / "spool"
    t0 = time.monotonic()
    counts = dict.fromkeys(("same", "values_differ", "data_loss"), 0)
    for _ in range(n):
        path.write_bytes(mutate(original, rng))
        try:
            batches = _read_all(root)
        except spool_mod.CorruptSegmentError as e:
            assert e.path == path and e.field and e.problem and str(path) in str(e)
            counts["data_loss"] += 1
            continue
        for b in batches:
            b.validate(full=True)
            assert b.schema.equals(intact.schema)
        got = pa.Table.from_batches(batches, intact.schema).combine_chunks()
        assert got.column("seq").to_pylist() == list(range(1, 41))
        if got.equals(intact):
            counts["same"] += 1
        else:
            counts["values_differ"] += 1
    _done("spool.read_sealed (corrupt segments)", n, t0, **counts)


def test_read_sealed_never_yields_an_invalid_batch(tmp_path: Path) -> None:
    rng = random.Random("spool-segment")
    path, original, _ = _segment(tmp_path)
    for _ in range(5000):
        path.write_bytes(mutate(original, rng))
        try:
            batches = _read_all(tmp_path / "spool")
        except DataLossError:
            continue
        for b in batches:
            try:
                b.validate(full=True)
            except pa.ArrowInvalid as e:
                pytest.fail(f"read_sealed yielded an invalid batch: {e}")


def _meta_segment(tmp: Path, **changes: str | None) -> Path:
    """The test segment, rewritten with schema metadata ``changes`` (None: removed)."""
    path, original, _ = _segment(tmp)
    reader = pa.ipc.open_file(pa.py_buffer(original))
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    for key, value in changes.items():
        if value is None:
            meta.pop(f"zio.{key}", None)
        else:
            meta[f"zio.{key}"] = value
    schema = reader.schema.with_metadata(meta)
    batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        for b in batches:
            w.write_batch(pa.RecordBatch.from_arrays(b.columns, schema=schema))
    path.write_bytes(sink.getvalue().to_pybytes())
    return path


def _rewrite(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
    path.write_bytes(sink.getvalue().to_pybytes())


def _corrupt(tmp: Path, case: str) -> tuple[Path, str]:
    """A segment damaged in one way, and the field the error must name."""
    if case == "torn footer":
        path, original, _ = _segment(tmp)
        path.write_bytes(original[:-40])
        return path, "file"
    if case == "empty file":
        path, _, _ = _segment(tmp)
        path.write_bytes(b"")
        return path, "file"
    if case.startswith("meta "):
        key, _, value = case[5:].partition("=")
        return _meta_segment(tmp, **{key: None if value == "<none>" else value}), f"zio.{key}"
    path, original, rows = _segment(tmp)
    reader = pa.ipc.open_file(pa.py_buffer(original))
    schema = reader.schema
    batch = pa.Table.from_batches(rows).combine_chunks().to_batches()[0]
    seq = batch.column("seq").to_pylist()
    if case == "other schema":
        other = pa.schema([pa.field("seq", pa.int64())], metadata=schema.metadata)
        _rewrite(path, [pa.RecordBatch.from_arrays([batch.column("seq")], schema=other)], other)
        return path, "schema"
    if case == "null seq":
        seq[5] = None
    elif case == "seq gap":
        seq[5:] = [s + 1 for s in seq[5:]]
    elif case == "seq reordered":
        seq[5], seq[6] = seq[6], seq[5]
    elif case == "rows missing":
        batch, seq = batch.slice(0, 39), seq[:39]
    columns = batch.columns
    columns[batch.schema.get_field_index("seq")] = pa.array(seq, pa.int64())
    _rewrite(path, [pa.RecordBatch.from_arrays(columns, schema=schema)], schema)
    return path, "seq"


@pytest.mark.parametrize(
    "case",
    [
        "torn footer",
        "empty file",
        "other schema",
        "meta covers_from=x1",
        "meta covers_from=<none>",
        "meta covers_from= 1",
        "meta covers_from=99",
        "meta covers_from=-1",
        "meta rows=1_0",
        "meta rows=41",
        "meta producer=q",
        "meta producer=<none>",
        "meta format=2",
        "null seq",
        "seq gap",
        "seq reordered",
        "rows missing",
    ],
)
def test_read_sealed_reports_a_corrupt_segment_as_data_loss(tmp_path: Path, case: str) -> None:
    path, field = _corrupt(tmp_path, case)
    with pytest.raises(DataLossError) as info:
        _read_all(tmp_path / "spool")
    err = info.value
    assert isinstance(err, spool_mod.CorruptSegmentError)
    assert (err.path, err.field, err.producer) == (path, field, "p"), str(err)
    assert str(path) in str(err) and field in str(err)


def test_wal_record_with_valid_crc_and_short_arrow_body_is_torn(tmp_path: Path) -> None:
    stream = _wal_record(random.Random(0), tmp_path)
    first = wal_mod._decode_wal_record(pa.py_buffer(stream), 0)
    assert first is not None
    record = stream[: first[0]]
    data = _reseal(record[:-16])  # the CRC matches; the Arrow message is 16 bytes short
    assert wal_mod._decode_wal_record(pa.py_buffer(data), 0) is None


# ------------------------------------------------------------------ queue store records


@pytest.mark.parametrize("n", cases())
def test_fuzz_store_message_payload(n: int) -> None:
    rng = random.Random("store-payload")
    valid = [
        store_mod.message_payload(5, b"id-1", [b"body"]),
        store_mod.message_payload(2**63, b"x" * 255, [b"", b"a" * 100, b"c"]),
        store_mod.message_payload(9, b"moved", [b"b"], original=1234),
    ]
    t0 = time.monotonic()
    decoded = 0
    for _ in range(n):
        payload = _garbage_or_mutant(rng, valid, 80)
        kind = payload[0] if payload and rng.random() < 0.8 else rng.choice([1, 2])
        try:
            _, _, message_id, parts = store_mod.parse_message(payload, kind)
        except (ValueError, struct.error):
            continue
        decoded += 1
        assert message_id and isinstance(parts, tuple)
    _done("store_format.parse_message", n, t0, decoded=decoded)


# ------------------------------------------------------------------ flow objects


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return rng.choice([None, True, False])
    if choice == 1:
        return rng.choice([0, 1, -1, 2**63, 2**70, rng.randint(-10, 1000)])
    if choice == 2:
        return rng.choice([1.5, -0.0, 1e308])
    if choice in (3, 4, 5):
        return rng.choice(["DAT", "PAY", "BOT", "EOT", "extract", "inject", "", "x" * 10])
    if choice == 6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["flow", "credit", "direction", "ack", "resume", "stream", "batch", "encoding", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("n", cases())
def test_fuzz_flow_objects(n: int) -> None:
    rng = random.Random("flow-objects")
    t0 = time.monotonic()
    events = 0
    for _ in range(n):
        obj = _random_json(rng)
        if isinstance(obj, dict) and rng.random() < 0.7:
            obj["flow"] = rng.choice(["BOT", "PAY", "DAT", "EOT", "NOPE"])
        label = json.dumps(obj)
        attrs = obj if isinstance(obj, dict) else {"x": obj}
        for reader in (profile_bot, pay_ack):
            with contextlib.suppress(RemoteProtocolError):
                reader(attrs)
        # One flow per case, in a random state, fed the object as a message.
        flow = Flow(rng.choice([Role.SERVER, Role.CLIENT]))
        try:
            if flow.role is Role.CLIENT:
                flow.send_bot(rng.choice([Direction.EXTRACT, Direction.INJECT]), 5)
            elif rng.random() < 0.5:
                flow.receive(
                    Message("FLOW", '{"flow": "BOT", "direction": "extract", "credit": 3}')
                )
                flow.accept()
            flow.receive(Message("FLOW", label))
            events += 1
        except ProtocolError:
            pass
    _done("flow objects (profile_bot, pay_ack, Flow.receive)", n, t0, events=events)
