"""``python -m zio_spark.cli.precompile``: bytecode in pyspark.zip that zipimport uses.

Most tests run on a small synthetic zip (no pyspark needed); one copies the real venv's
pyspark.zip and imports Spark's streaming runner from the precompiled copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from zio_spark.cli import precompile

MOD_V1 = b"VALUE = 41\n\ndef boom():\n    raise ValueError('from mod')\n"
MOD_V2 = b"VALUE = 42\n\ndef boom():\n    raise ValueError('from mod v2')\n"


def _make_zip(path: Path, mod: bytes = MOD_V1) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.comment = b"synthetic"
        z.writestr(zipfile.ZipInfo("pkg/", (2020, 1, 2, 3, 4, 6)), b"")
        z.writestr(zipfile.ZipInfo("pkg/__init__.py", (2020, 1, 2, 3, 4, 6)), b"NAME = 'pkg'\n")
        z.writestr(zipfile.ZipInfo("pkg/mod.py", (2021, 5, 6, 7, 8, 10)), mod)
        z.writestr(zipfile.ZipInfo("pkg/data.txt", (2020, 1, 2, 3, 4, 6)), b"not python")
        # Python 2 syntax: does not compile; must keep working as before (an import error).
        z.writestr(zipfile.ZipInfo("pkg/py2.py", (2020, 1, 2, 3, 4, 6)), b"print 'old'\n")


def _entries(path: Path) -> dict[str, tuple[bytes, tuple[int, ...], int, int]]:
    with zipfile.ZipFile(path) as z:
        return {
            i.filename: (z.read(i), i.date_time, i.external_attr, i.header_offset)
            for i in z.infolist()
        }


def _import_from(zip_path: Path, code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter with only the zip added to its path; it sets
    ``out`` (a dict), printed as JSON."""
    prog = (
        f"import sys, json\nsys.path.insert(0, {str(zip_path)!r})\n{code}\nprint(json.dumps(out))"
    )
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])  # type: ignore[no-any-return]


IMPORT_MOD = """
import traceback
import pkg.mod as m
try:
    m.boom()
except ValueError:
    tb = traceback.format_exc()
try:
    import pkg.py2
    py2 = "imported"
except SyntaxError:
    py2 = "SyntaxError"
out = {"file": m.__file__, "value": m.VALUE, "tb": tb, "py2": py2}
"""


def test_precompile_adds_bytecode_that_zipimport_uses(tmp_path: Path) -> None:
    z = tmp_path / "lib.zip"
    _make_zip(z)
    z.chmod(0o640)
    before = _entries(z)
    plain = _import_from(z, IMPORT_MOD)
    assert str(plain["file"]).endswith("pkg/mod.py")

    state = precompile.precompile_zip(z)

    assert state.error is None and state.changed
    assert (state.sources, state.compiled, state.missing, state.stale) == (3, 2, 0, 0)
    assert state.uncompilable == ["pkg/py2.py"] and state.precompiled
    after = _entries(z)
    # Every original entry as it was: bytes, date, attributes and offset (so a running
    # Python with the old directory cached still reads it right).
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"pkg/__init__.pyc", "pkg/mod.pyc"}
    assert after["pkg/mod.pyc"][1] == before["pkg/mod.py"][1]
    with zipfile.ZipFile(z) as zf:
        assert zf.comment == b"synthetic"
        assert zf.testzip() is None
    assert z.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["lib.zip"]  # no temp file left

    used = _import_from(z, IMPORT_MOD)
    assert str(used["file"]).endswith("pkg/mod.pyc"), used  # zipimport took the bytecode
    assert used["value"] == 41
    # Tracebacks name the .py inside the zip, as they did when compiled from source.
    assert f"{z.resolve()}{os.sep}pkg/mod.py" in str(used["tb"]), used["tb"]
    assert "from mod" in str(used["tb"])
    assert used["py2"] == plain["py2"] == "SyntaxError"


def test_precompile_is_idempotent_and_check_reports_it(tmp_path: Path) -> None:
    z = tmp_path / "lib.zip"
    _make_zip(z)
    assert not precompile.check_zip(z).precompiled
    assert precompile.main(["--check", str(z)]) == 1
    assert precompile.main([str(z)]) == 0
    digest = hashlib.sha256(z.read_bytes()).hexdigest()
    mtime = z.stat().st_mtime_ns

    again = precompile.precompile_zip(z)
    assert again.precompiled and not again.changed
    assert hashlib.sha256(z.read_bytes()).hexdigest() == digest
    assert z.stat().st_mtime_ns == mtime  # not even rewritten
    assert precompile.main(["--check", str(z)]) == 0


def test_check_json_names_every_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    z = tmp_path / "lib.zip"
    _make_zip(z)
    assert precompile.main(["--check", "--json", str(z)]) == 1
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["precompiled"] is False and doc["python"] == sys.executable
    [entry] = doc["zips"]
    assert entry["path"] == str(z) and entry["sources"] == 3 and entry["missing"] >= 2
    assert precompile.main(["--json", str(z)]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["precompiled"] is True and doc["zips"][0]["changed"] is True


def test_stale_or_foreign_bytecode_is_replaced_and_never_used(tmp_path: Path) -> None:
    old = tmp_path / "old.zip"
    _make_zip(old, MOD_V1)
    precompile.precompile_zip(old)
    # The source changed after precompiling (its .pyc is the old one's): zipimport must
    # see the hash mismatch and compile the new source.
    z = tmp_path / "lib.zip"
    with zipfile.ZipFile(old) as zin, zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = MOD_V2 if info.filename == "pkg/mod.py" else zin.read(info)
            zout.writestr(info, data)
    stale = precompile.check_zip(z)
    assert (stale.stale, stale.compiled) == (1, 1) and not stale.precompiled
    got = _import_from(z, IMPORT_MOD)
    assert got["value"] == 42 and str(got["file"]).endswith("pkg/mod.py")

    # Another interpreter's magic number: not ours, counted stale too.
    foreign = tmp_path / "foreign.zip"
    with zipfile.ZipFile(old) as zin, zipfile.ZipFile(foreign, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "pkg/__init__.pyc":
                data = b"\x00\x00\r\n" + data[4:]
            zout.writestr(info, data)
    assert precompile.check_zip(foreign).stale == 1

    fixed = precompile.precompile_zip(z)
    assert fixed.precompiled and fixed.changed and fixed.stale == 0
    with zipfile.ZipFile(z) as zf:
        names = zf.namelist()
        assert names.count("pkg/mod.pyc") == 1 and zf.read("pkg/mod.py") == MOD_V2
    got = _import_from(z, IMPORT_MOD)
    assert got["value"] == 42 and str(got["file"]).endswith("pkg/mod.pyc")


def test_a_failed_write_leaves_the_zip_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    z = tmp_path / "lib.zip"
    _make_zip(z)
    data = z.read_bytes()

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(precompile.os, "replace", refuse)
    state = precompile.precompile_zip(z)
    assert state.error is not None and not state.precompiled
    assert f"cannot write {z}" in state.error and "Permission denied" in state.error
    assert "run this command as the user that owns" in state.error
    assert z.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["lib.zip"]


def test_no_pyspark_and_no_spark_home_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SPARK_HOME", raising=False)
    monkeypatch.setattr(precompile.importlib.util, "find_spec", lambda name: None)
    assert precompile.find_zips() == []
    assert precompile.main([]) == 1
    assert "nothing to precompile" in capsys.readouterr().err


def test_find_zips_adds_a_different_spark_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "spark" / "python" / "lib"
    lib.mkdir(parents=True)
    _make_zip(lib / "pyspark.zip")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark"))
    zips = precompile.find_zips()
    assert zips[-1] == lib / "pyspark.zip"
    assert len({p.resolve() for p in zips}) == len(zips)


@pytest.mark.timeout(600)
def test_real_pyspark_zip_precompiles_and_the_runner_imports_from_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pyspark")
    monkeypatch.delenv("SPARK_HOME", raising=False)
    zips = precompile.find_zips()
    real = [z for z in zips if z.name == "pyspark.zip"]
    assert real, f"no pyspark.zip among {zips}"
    assert precompile.check_zip(real[0]).sources > 1000
    # A copy: the venv's own zip is setup.sh's to change, not a test's.
    copy = tmp_path / "pyspark.zip"
    shutil.copyfile(real[0], copy)
    state = precompile.precompile_zip(copy)
    assert state.precompiled, state
    py4j = [str(z) for z in zips if z.name.startswith("py4j")]
    code = (
        f"sys.path[1:1] = {py4j!r}\n"
        "import pyspark.sql.streaming.python_streaming_source_runner as r\n"
        "import pyspark\n"
        "out = {'runner': r.__file__, 'pyspark': pyspark.__file__, 'main': hasattr(r, 'main')}"
    )
    got = _import_from(copy, code)
    assert str(got["runner"]).startswith(str(copy)) and str(got["runner"]).endswith(".pyc")
    assert str(got["pyspark"]).endswith("pyspark/__init__.pyc")
    assert got["main"] is True
