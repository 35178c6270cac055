"""zio_spark.protocol stays pure: no sockets, no Spark, no threads, no clocks, no randomness.

Two checks. At run time, a fresh interpreter imports every module of the package and
must not end up with zmq, pyspark or socket loaded (threading and time are not asserted
there: the interpreter or stdlib may load them on their own). Statically, no source file
under zio_spark/protocol may import a module that does I/O, concurrency, time or
randomness -- protocol code takes bytes and a ``now`` -- nor reach into the
socket-facing layers of zio_spark.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import zio_spark.protocol

PROTOCOL_DIR = Path(zio_spark.protocol.__file__).resolve().parent
IMPORT_ROOT = PROTOCOL_DIR.parents[1]  # the directory holding the zio_spark package
SOURCES = sorted(PROTOCOL_DIR.rglob("*.py"))

RUNTIME_FORBIDDEN = ("zmq", "pyspark", "socket")
STATIC_FORBIDDEN = frozenset(
    {
        "zmq",
        "pyspark",
        "threading",
        "socket",
        "time",
        "asyncio",
        "select",
        "selectors",
        "os",
        "random",
        "subprocess",
        "multiprocessing",
        "concurrent",
    }
)
# What protocol code may import from its own project.
ALLOWED_INTERNAL = ("zio_spark.errors", "zio_spark.protocol")

CHILD = """
import json, pkgutil, sys
sys.path.insert(0, sys.argv[1])
forbidden = json.loads(sys.argv[2])
preloaded = [m for m in forbidden if m in sys.modules]
import zio_spark.protocol, zio_spark.protocol.message
names = sorted(
    m.name for m in pkgutil.walk_packages(zio_spark.protocol.__path__, "zio_spark.protocol.")
)
for name in names:
    __import__(name)
print(json.dumps({
    "file": zio_spark.protocol.__file__,
    "modules": names,
    "preloaded": preloaded,
    "loaded": [m for m in forbidden if m in sys.modules],
}))
"""


def test_importing_protocol_loads_no_sockets_or_spark():
    # -I: no PYTHONPATH, no user site, no script directory; the package path is explicit.
    proc = subprocess.run(
        [sys.executable, "-I", "-c", CHILD, str(IMPORT_ROOT), json.dumps(RUNTIME_FORBIDDEN)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert Path(report["file"]).resolve().parent == PROTOCOL_DIR  # the tree under test
    assert "zio_spark.protocol.message" in report["modules"]
    assert report["preloaded"] == [], "interpreter startup already loads these; check is void"
    assert report["loaded"] == [], f"importing zio_spark.protocol loaded {report['loaded']}"


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """Absolute module names a source imports, with line numbers (incl. __import__ calls)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
            if node.module == "zio_spark":  # from zio_spark import errors
                found += [(f"zio_spark.{alias.name}", node.lineno) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, node.lineno))
    return found


def test_protocol_sources_are_found():
    assert PROTOCOL_DIR / "__init__.py" in SOURCES
    assert PROTOCOL_DIR / "message.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PROTOCOL_DIR)))
def test_no_io_concurrency_clock_or_randomness_imports(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [
        f"line {line}: {name}"
        for name, line in _imports(tree)
        if name.split(".")[0] in STATIC_FORBIDDEN
    ]
    assert bad == [], f"{path.name} imports what protocol code must not: {bad}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PROTOCOL_DIR)))
def test_no_imports_from_socket_facing_layers(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [
        f"line {line}: {name}"
        for name, line in _imports(tree)
        if name.split(".")[0] == "zio_spark"
        and name != "zio_spark"
        and not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_INTERNAL)
    ]
    assert bad == [], f"{path.name} imports outside errors/protocol: {bad}"
