"""glibc's allocator tuned for the data paths' large buffers (one call per process).

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
"""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune"]

log = logging.getLogger("zio_spark.heap")

MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20
# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_tuned_pid: int | None = None


def tune() -> bool:
    """Set glibc's mmap and trim thresholds for this process, once (a forked child,
    such as a PySpark worker from its daemon, sets them again: the check is by pid).

    Returns whether they are set: False with ``ZIO_SPARK_HEAP=default``, on a C
    library without glibc's ``mallopt``, or if glibc refused a value.
    """
    global _tuned_pid
    pid = os.getpid()
    if _tuned_pid == pid:
        return True
    if os.environ.get("ZIO_SPARK_HEAP", "").strip().lower() == "default":
        return False
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
    _tuned_pid = pid
    return True
