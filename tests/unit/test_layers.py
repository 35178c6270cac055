"""The package's layers, asserted: each module imports only its own package or layers
below it, and the layers without I/O import no I/O library.

Layers, lowest first (README "Layout"): ``errors`` < ``options`` = ``heap`` < ``protocol`` <
``codec`` < ``storage`` < ``transport`` < ``source`` = ``sink`` < ``pzq`` < ``spark`` < ``cli``. The
check reads every module's ``import`` statements with :mod:`ast`, those inside functions
too, so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zio_spark"

RANK = {
    "__init__": 0,
    "errors": 0,
    "options": 1,
    "heap": 1,
    "protocol": 2,
    "codec": 3,
    "storage": 4,
    "transport": 5,
    "source": 6,
    "sink": 6,
    "pzq": 7,
    "spark": 8,
    "cli": 9,
}

# What the layers without I/O must not import (top-level module names).
FORBIDDEN = {
    "protocol": {"zmq", "pyspark", "pyarrow", "threading", "time", "socket", "os", "asyncio"},
    "codec": {"zmq", "pyspark", "threading", "socket", "asyncio"},
    "storage": {"zmq", "pyspark", "socket", "asyncio"},
}


def _layer(rel: Path) -> str:
    """``storage/spool.py`` -> ``storage``; ``errors.py`` -> ``errors``."""
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (``root`` is the package)."""
    rel = path.relative_to(root.parent).with_suffix("").parts
    package = list(rel[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # ``from zio_spark.x import y``: y may be a module of x
            out.extend((node.lineno, f"{name}.{a.name}") for a in node.names)
    return out


def violations(root: Path) -> list[str]:
    """Every import in the package at ``root`` that breaks a layer rule."""
    bad: list[str] = []
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        rel = path.relative_to(root)
        own = _layer(rel)
        if own not in RANK:
            bad.append(f"{rel}: in no layer ({own!r}); add it to RANK and the README")
            continue
        seen: set[tuple[int, str]] = set()
        for line, name in _imports(path, root):
            parts = name.split(".")
            if own in FORBIDDEN and parts[0] in FORBIDDEN[own] and (line, parts[0]) not in seen:
                seen.add((line, parts[0]))
                bad.append(f"{rel}:{line}: {own}/ imports {name} (no I/O library here)")
            if parts[0] != root.name or len(parts) == 1 or parts[1] not in RANK:
                continue
            target = parts[1]
            if (line, target) in seen:
                continue
            seen.add((line, target))
            if target != own and RANK[target] >= RANK[own]:
                bad.append(
                    f"{rel}:{line}: {own} (rank {RANK[own]}) imports {name} "
                    f"({target}, rank {RANK[target]})"
                )
    return sorted(set(bad))


def test_layers_hold() -> None:
    assert violations(PACKAGE) == []


def test_every_layer_exists() -> None:
    for layer in RANK:
        if layer != "__init__":
            assert (PACKAGE / layer).is_dir() or (PACKAGE / f"{layer}.py").is_file(), layer


def test_the_check_catches_what_it_guards_against(tmp_path: Path) -> None:
    """An upward import inside a function, a relative one, a same-rank neighbour, an I/O
    library in a pure layer and a module outside every layer are all reported."""
    root = tmp_path / "zio_spark"
    for rel, text in {
        "__init__.py": "",
        "errors.py": "",
        "protocol/__init__.py": "",
        "protocol/flow.py": "import time\nfrom zio_spark.errors import X\n",
        "storage/__init__.py": "",
        "storage/spool.py": "def f():\n    from zio_spark.transport import port\n",
        "source/__init__.py": "",
        "source/receiver.py": "from ..sink.consumer import C\nfrom . import held\n",
        "sink/__init__.py": "",
        "sink/consumer.py": "from zio_spark.storage.spool import Spool\n",
        "misc/thing.py": "",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    found = violations(root)
    assert len(found) == 4, found
    assert any("protocol/flow.py:1: protocol/ imports time" in v for v in found)
    assert any(
        "storage/spool.py:2: storage (rank 4) imports zio_spark.transport" in v for v in found
    )
    assert any("source/receiver.py:1: source (rank 6) imports zio_spark.sink" in v for v in found)
    assert any("misc/thing.py: in no layer" in v for v in found)
