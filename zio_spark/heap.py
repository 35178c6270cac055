"""The process's memory settings for the data paths, each once per process: glibc's
allocator tuned for large buffers (:func:`tune`) and, in Spark's Python workers, the
objects that outlive every task kept out of Python's collections (:func:`freeze_gc`).

Every DAT on the read paths is a fresh buffer of ~0.5 MiB (4,096 records of 100 B):
libzmq's message, the bytes it becomes in Python, a producer's encoded payload. glibc
serves blocks this large with ``mmap`` (its threshold starts at 128 KiB and rises only
when such a block is freed) and gives the top of its heap back to the kernel once 2x
that threshold is free there. Either way each new DAT lands on fresh pages: a page
fault and a zeroed page per 4 KiB, in the kernel's time. Measured on this project's
2-core machine, reading a range of 2M records of 100 B from a producer process
(``bench/README.md``, "glibc's heap"): the reader's CPU per million rows 0.25-0.31 s
(of which the kernel 0.10-0.14) with glibc's defaults, 0.13 s (kernel 0.01) with the
two settings below, and the producer served the range 3-4x faster.

:func:`tune` sets ``M_MMAP_THRESHOLD`` to 16 MiB (blocks below it come from the heap,
where freed blocks are reused) and ``M_TRIM_THRESHOLD`` to 64 MiB (up to that much
free memory stays with the process instead of going back to the kernel and faulting
in again). The cost: a process keeps up to ~64 MiB more than it uses at the moment,
and glibc's own adjusting of the mmap threshold stops. It is called where zio-spark
runs a data path in a process: a Spark task reading (the Python worker), the source's
runner, a :class:`~zio_spark.source.producer.Producer`. Setting the environment
variable ``ZIO_SPARK_HEAP=default`` leaves glibc as it is (e.g. in a process whose
own allocator settings must win). On another C library (musl, macOS) it does nothing.

:func:`freeze_gc` is for Spark's Python workers: a reused worker (PySpark's daemon, the
default) runs ``gc.collect()`` after every task, and a full collection visits every
object the process tracks: PySpark, pandas, pyarrow, pyzmq and zio-spark's modules,
~85k objects, 25 ms on a quiet core and 40-65 ms in a loaded worker (profiled in a
steady query: 28 % of the workers' CPU, for the synthetic source as for ours). It calls
``gc.freeze()`` once per process, where a task enters zio-spark (the source's readers'
``read``, the sink's writers' ``write``; never in a process that only calls their
helpers, such as a test's): what exists then (the modules,
almost all of it) moves to the collector's permanent generation, which collections
skip. Those objects are still freed when nothing refers to them; only a reference cycle
among them that becomes garbage later is never collected (a one-time cost, the size
of what the first task made before its read). pyarrow's lazy import of pandas is made
first, so pandas is frozen too. ``ZIO_SPARK_GC=default`` leaves the collector as it is.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "freeze_gc", "tune"]

log = logging.getLogger("zio_spark.heap")

MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20
# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# What was set in which process: "heap" (tune) and "gc" (freeze_gc) by the pid that set
# it (a forked child sets it again).
_done: dict[str, int] = {}


def _settled(what: str, env: str) -> bool | None:
    """True if ``what`` is set in this process already, False if the environment
    variable ``env`` says ``default`` (leave it), None if it is to be set now."""
    if _done.get(what) == os.getpid():
        return True
    if os.environ.get(env, "").strip().lower() == "default":
        return False
    return None


def tune() -> bool:
    """Set glibc's mmap and trim thresholds for this process, once (a forked child,
    such as a PySpark worker from its daemon, sets them again: the check is by pid).

    Returns whether they are set: False with ``ZIO_SPARK_HEAP=default``, on a C
    library without glibc's ``mallopt``, or if glibc refused a value.
    """
    settled = _settled("heap", "ZIO_SPARK_HEAP")
    if settled is not None:
        return settled
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:  # pragma: no cover - glibc accepts both values
        log.info("zio_spark.heap: glibc refused mallopt; its defaults stay")
        return False
    _done["heap"] = os.getpid()
    return True


def freeze_gc() -> bool:
    """Move every object this process tracks now into the collector's permanent
    generation (``gc.freeze()``), once per process (by pid, as :func:`tune`).

    Returns whether it froze them (now or earlier): False with ``ZIO_SPARK_GC=default``.
    """
    settled = _settled("gc", "ZIO_SPARK_GC")
    if settled is not None:
        return settled
    _load_pandas_shim()
    gc.freeze()
    _done["gc"] = os.getpid()
    return True


def _load_pandas_shim() -> None:
    """Have pyarrow import pandas now, if it is installed, so that its objects are
    frozen with the rest.

    pyarrow imports pandas lazily (its pandas shim), on the first call that might be
    handed a pandas object: ``pa.scalar``, ``pa.array`` of a Python sequence,
    ``Array.to_numpy``. Every read and write of zio-spark makes such a call, so a worker
    imports pandas during its first task anyway; imported after the freeze, its ~33k
    objects were visited by every later collection (14 % of the workers' CPU,
    profiled). A pandas-free install imports nothing here.
    """
    import pyarrow as pa

    pa.scalar(0)
