"""Precompile the ``pyspark.zip`` Spark puts on its Python workers' path, for this interpreter.

Spark starts every Python worker (a streaming query's data source runner among them) with
``$SPARK_HOME/python/lib/pyspark.zip`` on ``PYTHONPATH`` and gives it a fixed 10 s to
connect back (``PythonWorkerFactory``; not configurable in Spark 4.3). A zip holds no
bytecode cache, so every fresh worker compiles the pyspark modules it imports anew: about a
CPU-second, many seconds on a busy machine. This command adds to each zip a ``.pyc`` beside
each ``.py``, compiled by this interpreter, which ``zipimport`` then loads instead of
compiling.

The ``.pyc`` files are checked-hash pycs (PEP 552): ``zipimport`` compares each with the
hash of the ``.py`` beside it in the same zip and falls back to the source on a mismatch or
on another interpreter's magic number, so a stale or foreign ``.pyc`` costs time, never
correctness. Everything else in the zip is kept as it was (names, bytes, dates,
permissions); the new zip is written beside the old one and renamed over it. Running it
again changes nothing. Run it while no Spark job of that install is running (a live worker
that has the old zip's directory cached would read the new zip wrongly).

Zips handled: ``pyspark/python/lib/*.zip`` of the pyspark this interpreter imports (a pip
install) and, when ``SPARK_HOME`` is set to another Spark, ``$SPARK_HOME/python/lib/*.zip``.

    python -m zio_spark.cli.precompile            # precompile (exit 0, or 1 on a failure)
    python -m zio_spark.cli.precompile --check    # exit 0 if precompiled, 1 if not
    python -m zio_spark.cli.precompile --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import marshal
import os
import shutil
import stat
import sys
import tempfile
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ZipState", "check_zip", "find_zips", "main", "precompile_zip"]

# PEP 552 flags: bit 0 = hash-based, bit 1 = check the source.
_CHECKED_HASH = 0b11


@dataclass
class ZipState:
    """What one zip holds, for this interpreter."""

    path: str
    sources: int = 0  # .py entries
    compiled: int = 0  # .py entries with a valid .pyc of this interpreter beside them
    missing: int = 0  # .py entries with no .pyc beside them
    stale: int = 0  # a .pyc beside them that this interpreter would not use
    uncompilable: list[str] = field(default_factory=list)  # .py that do not compile here
    changed: bool = False  # set by precompile_zip when it wrote a new zip
    error: str | None = None

    @property
    def precompiled(self) -> bool:
        return self.error is None and self.missing == 0 and self.stale == 0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "precompiled": self.precompiled}


def find_zips() -> list[Path]:
    """The zips Spark puts on its workers' path for the pyspark this interpreter imports
    (``pyspark/python/lib/*.zip``), plus ``$SPARK_HOME/python/lib/*.zip`` when
    ``SPARK_HOME`` names another Spark. Does not import pyspark."""
    homes: list[Path] = []
    spec = importlib.util.find_spec("pyspark")
    if spec is not None and spec.submodule_search_locations:
        homes.extend(Path(p) for p in spec.submodule_search_locations)
    if os.environ.get("SPARK_HOME"):
        homes.append(Path(os.environ["SPARK_HOME"]))
    zips: list[Path] = []
    for home in homes:
        for z in sorted((home / "python" / "lib").glob("*.zip")):
            if z.resolve() not in {p.resolve() for p in zips}:
                zips.append(z)
    return zips


def _pyc_name(name: str) -> str:
    return name[: -len(".py")] + ".pyc"


def _pyc_valid(pyc: bytes, source: bytes) -> bool:
    """Would this interpreter's zipimport use ``pyc`` for ``source``?"""
    if len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(pyc[4:8], "little")
    if flags != _CHECKED_HASH:
        return False  # ours are all checked-hash; anything else we rebuild
    return pyc[8:16] == importlib.util.source_hash(source)


def _compile(source: bytes, filename: str) -> bytes:
    with warnings.catch_warnings():  # a SyntaxWarning in pyspark's own tests is not ours
        warnings.simplefilter("ignore")
        code = compile(source, filename, "exec", dont_inherit=True)
    header = importlib.util.MAGIC_NUMBER + _CHECKED_HASH.to_bytes(4, "little")
    return header + importlib.util.source_hash(source) + marshal.dumps(code)


def _compiles(source: bytes, filename: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _sources(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    return [i for i in zf.infolist() if not i.is_dir() and i.filename.endswith(".py")]


def check_zip(path: Path) -> ZipState:
    """Count, for each ``.py`` in the zip, whether a ``.pyc`` beside it is one this
    interpreter's zipimport would use."""
    state = ZipState(str(path))
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            for info in _sources(zf):
                state.sources += 1
                pyc = _pyc_name(info.filename)
                if pyc not in names:
                    # A .py this Python cannot compile can have no .pyc: not "missing". Tried
                    # only while none is missing (a zip never precompiled has ~1300).
                    if state.missing == 0 and not _compiles(zf.read(info), info.filename):
                        state.uncompilable.append(info.filename)
                    else:
                        state.missing += 1
                elif _pyc_valid(zf.read(pyc), zf.read(info)):
                    state.compiled += 1
                else:
                    state.stale += 1
    except (OSError, zipfile.BadZipFile) as e:
        state.error = f"cannot read {path}: {e}"
    return state


def precompile_zip(path: Path) -> ZipState:
    """Add a checked-hash ``.pyc`` beside every ``.py`` in the zip at ``path``. Does nothing
    if already done. Atomic: a temp file in the same folder, renamed over the zip.

    When the zip holds no ``.pyc`` this interpreter would reject, the temp file is a byte
    copy of the zip with the ``.pyc`` entries appended: every existing entry keeps its
    offset, so a running Python that has the old zip's directory cached still reads it
    right. Otherwise (another interpreter's ``.pyc``) the zip is rewritten without them.
    A ``.py`` that does not compile under this interpreter keeps no ``.pyc`` and is listed
    in ``uncompilable`` (importing it would fail with or without this command).
    """
    before = check_zip(path)
    if before.error is not None or before.precompiled:
        return before
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as e:
        before.error = f"cannot stat {path}: {e}"
        return before
    archive = str(path.resolve())
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if before.stale == 0:
            shutil.copyfile(path, tmp)
            _append_pycs(tmp, archive)
        else:
            _rewrite_with_pycs(path, tmp, archive)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        before.error = (
            f"cannot write {path}: {e}; run this command as the user that owns {path.parent} "
            f"(or unset SPARK_HOME if it names a Spark you do not own)"
        )
        return before
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    after = check_zip(path)
    after.changed = True
    return after


def _pyc_entry(info: zipfile.ZipInfo, source: bytes, archive: str) -> tuple[zipfile.ZipInfo, bytes]:
    """The .pyc entry for ``info``; raises SyntaxError/ValueError if it does not compile.
    zipimport names a module compiled from the zip ``<archive>/<name>.py``: the same file
    name here, so tracebacks read as they would without the .pyc."""
    pyc = _compile(source, f"{archive}{os.sep}{info.filename}")
    pinfo = zipfile.ZipInfo(_pyc_name(info.filename), info.date_time)
    pinfo.compress_type = zipfile.ZIP_DEFLATED
    pinfo.external_attr = info.external_attr
    pinfo.create_system = info.create_system
    return pinfo, pyc


def _append_pycs(tmp: Path, archive: str) -> None:
    """Append a .pyc for every .py of the zip at ``tmp`` that has none."""
    with zipfile.ZipFile(tmp, "a") as z:
        names = set(z.namelist())
        for info in _sources(z):
            if _pyc_name(info.filename) in names:
                continue
            with contextlib.suppress(SyntaxError, ValueError):  # listed by check_zip
                z.writestr(*_pyc_entry(info, z.read(info), archive))


def _rewrite_with_pycs(path: Path, tmp: Path, archive: str) -> None:
    """Copy every entry of ``path`` into ``tmp`` but the .pyc beside a .py, then add a
    .pyc of this interpreter for every .py (after all the original entries)."""
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w") as zout:
        zout.comment = zin.comment
        sources = _sources(zin)
        pycs = {_pyc_name(i.filename) for i in sources}
        for info in zin.infolist():
            if info.filename not in pycs:
                zout.writestr(info, zin.read(info))
        for info in sources:
            with contextlib.suppress(SyntaxError, ValueError):  # listed by check_zip
                zout.writestr(*_pyc_entry(info, zin.read(info), archive))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zio_spark.cli.precompile",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument(
        "--check", action="store_true", help="only report; exit 1 unless every zip is done"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "zips",
        nargs="*",
        type=Path,
        help="zips to handle (default: those of the pyspark this interpreter imports)",
    )
    args = p.parse_args(argv)
    zips = args.zips or find_zips()
    if not zips:
        msg = (
            f"no pyspark found for {sys.executable} and SPARK_HOME is not set: "
            f"nothing to precompile (pip install pyspark, or set SPARK_HOME)"
        )
        if args.json:
            print(json.dumps({"python": sys.executable, "zips": [], "error": msg}))
        print(f"precompile: {msg}", file=sys.stderr)
        return 1
    states = [check_zip(z) if args.check else precompile_zip(z) for z in zips]
    ok = all(s.precompiled for s in states)
    if args.json:
        print(
            json.dumps(
                {
                    "python": sys.executable,
                    "magic": importlib.util.MAGIC_NUMBER.hex(),
                    "precompiled": ok,
                    "zips": [s.as_dict() for s in states],
                }
            )
        )
    else:
        for s in states:
            if s.error:
                print(f"precompile: {s.error}", file=sys.stderr)
            elif s.precompiled:
                how = "precompiled now" if s.changed else "already precompiled"
                print(f"{s.path}: {how} ({s.compiled} modules for {sys.executable})")
            else:
                print(
                    f"{s.path}: NOT precompiled for {sys.executable}: {s.missing} modules "
                    f"without bytecode, {s.stale} with bytecode this Python does not use "
                    f"(run: {sys.executable} -m zio_spark.cli.precompile)"
                )
            if s.uncompilable:
                print(
                    f"{s.path}: {len(s.uncompilable)} files do not compile under this Python "
                    f"and keep no bytecode: {', '.join(s.uncompilable[:5])}",
                    file=sys.stderr,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
