"""zio_spark.heap: glibc's thresholds set once per process, observed through glibc's own
count of mmapped blocks (``mallinfo2().hblks``), in fresh processes."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from typing import Any

import pytest

from zio_spark import heap

_GLIBC = hasattr(ctypes.CDLL(None), "mallinfo2")

# A fresh interpreter: the mmapped blocks glibc holds before and after allocating a
# 1 MiB bytearray (above glibc's initial 128 KiB mmap threshold), with or without
# heap.tune() first.
_PROBE = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
from zio_spark import heap
tuned = heap.tune() if sys.argv[1] == "tune" else None
before = libc.mallinfo2().hblks
block = bytearray(1 << 20)
after = libc.mallinfo2().hblks
print(tuned, after - before)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not _GLIBC, reason="glibc >= 2.33 (mallinfo2) only")
def test_tuned_a_large_block_comes_from_the_heap_not_a_fresh_mmap() -> None:
    assert _probe("plain") == ("None", 1)  # glibc's default: a 1 MiB block is mmapped
    assert _probe("tune") == ("True", 0)  # tuned: from the heap, reused when freed
    # The escape hatch leaves glibc as it is.
    assert _probe("tune", ZIO_SPARK_HEAP="default") == ("False", 1)


def test_tune_is_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_done", {})
    monkeypatch.delenv("ZIO_SPARK_HEAP", raising=False)
    first = heap.tune()
    assert first == (heap._done.get("heap") == os.getpid())
    if first:
        # Another pid (a forked worker) sets them again; this one does not.
        monkeypatch.setenv("ZIO_SPARK_HEAP", "default")
        assert heap.tune() is True  # already set here: the env var is read once
        monkeypatch.setattr(heap, "_done", {"heap": os.getpid() + 1})
        assert heap.tune() is False  # "another process" honours the env var


# A fresh interpreter: how many objects the collector's permanent generation holds
# after heap.freeze_gc() (twice, then in a forked child), and whether a full collection
# still visits the objects that existed before.
_FREEZE_PROBE = """
import gc, os, sys
from zio_spark import heap
keep = [[i] for i in range(10_000)]  # tracked objects that outlive the "task"
had_pandas = "pandas" in sys.modules
first = heap.freeze_gc()
frozen = gc.get_freeze_count()
# pyarrow's lazy pandas import came before the freeze: a later read imports nothing.
import pyarrow as pa
pa.scalar(1)
pandas_frozen = not had_pandas and "pandas" in sys.modules and len(gc.get_objects()) < 5_000
again = heap.freeze_gc()
same = gc.get_freeze_count() == frozen
after = [[i] for i in range(10)]
# Collections skip the frozen ones: only what was made after is tracked in generations.
tracked = len(gc.get_objects())
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    more = [[i] for i in range(1000)]
    os.write(w, str(heap.freeze_gc() and gc.get_freeze_count() >= frozen + 1000).encode())
    os._exit(0)
os.waitpid(pid, 0)
child = os.read(r, 16).decode()
print(first, frozen >= 10_000, again, same, tracked < 5_000, child, pandas_frozen)
"""


def test_freeze_gc_once_per_process_and_again_in_a_forked_child() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE],
        env={k: v for k, v in os.environ.items() if k != "ZIO_SPARK_GC"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    # pandas is installed here (pyspark's Arrow paths use it): it is frozen too.
    assert importlib.util.find_spec("pandas") is not None
    assert out == ["True"] * 7


def test_freeze_gc_escape_hatch_leaves_the_collector_as_it_is() -> None:
    probe = "import gc; from zio_spark import heap; print(heap.freeze_gc(), gc.get_freeze_count())"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "ZIO_SPARK_GC": "default"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out == ["False", "0"]


def test_the_sources_and_sinks_task_entry_points_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark's workers enter zio-spark through the readers' read() and the writers'
    write(): each freezes the worker's objects first (tests call _read_any and
    write_partition directly, and their process is left alone)."""
    from pyspark.sql.datasource import InputPartition

    from zio_spark.spark import sink, source

    calls: list[str] = []

    def freeze() -> bool:
        calls.append("freeze")
        return True

    monkeypatch.setattr(heap, "freeze_gc", freeze)
    readers: tuple[type[Any], ...] = (source.ZioStreamReader, source.ZioBatchReader)
    for cls in readers:
        reader = object.__new__(cls)
        assert list(reader.read(InputPartition(None))) == []  # a task with nothing planned
    monkeypatch.setattr(sink, "_task_ids", lambda: (0, 0, "7", None))
    monkeypatch.setattr(sink, "write_partition", lambda *a, **k: "sent")
    writers: tuple[type[Any], ...] = (sink.ZioStreamWriter, sink.ZioBatchWriter)
    for wcls in writers:
        writer = object.__new__(wcls)
        writer.opts = writer.cols = writer.batch_id = None
        writer.targets = [("tcp://127.0.0.1:1", None)]
        assert writer.write(iter(())) == "sent"
    assert calls == ["freeze"] * 4
