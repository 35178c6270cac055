"""The README's quick start runs as written, and the README's install advice holds.

The quick start is the first ```python block after the marker comment
``<!-- quickstart: ... -->`` in README.md. It runs in a fresh interpreter (this one, the
venv's) from an empty folder outside the project, with ``TMPDIR`` under ``tmp_path`` and
with neither ``PYSPARK_PYTHON`` nor ``PYSPARK_DRIVER_PYTHON`` set: the block must set
what Spark's Python workers need itself. To prove that it does, the ``python3`` on the
child's ``PATH`` is a Python that cannot import zio-spark (this interpreter with ``-S``:
no site-packages), which is what Spark runs when neither variable is set; the same block
without its ``PYSPARK_PYTHON`` line must then fail with ``DATA_SOURCE_NOT_FOUND``.

Loopback only: the child gets ``SPARK_LOCAL_IP`` and ``ZIO_SPOOL_SERVER_HOST`` =
127.0.0.1 from the environment (the block itself binds its producer on 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
MARKER = "<!-- quickstart:"
ENV_LINE = re.compile(r"^os\.environ\[\"PYSPARK_PYTHON\"\].*$", re.MULTILINE)
RUN_TIMEOUT = 240  # seconds for one run of the block; it takes ~35 s on a quiet machine

# A shell command installing zio-spark by its bare name (from PyPI, where it does not
# exist); `zio-spark @ git+...`, a wheel path or `-e .` are fine.
PYPI_INSTALL = re.compile(
    r"pip install\s+(?:-\S+\s+)*['\"]?zio-spark(?![\w.-])(?:\[[^\]]*\])?['\"]?(?!\s*@)"
)


def quickstart_block() -> str:
    text = README.read_text(encoding="utf-8")
    at = text.find(MARKER)
    assert at >= 0, f"README.md has no {MARKER!r} marker before the quick start block"
    m = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL).search(text, at)
    assert m is not None, "no ```python block after the quick start marker"
    return m.group(1)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    run_dir, temp, bad_bin = tmp_path / "run", tmp_path / "tmp", tmp_path / "bin"
    for d in (run_dir, temp, bad_bin):
        d.mkdir()
    script = run_dir / "quickstart.py"
    script.write_text(code, encoding="utf-8")
    # `python3` as Spark finds it when no variable names one: no zio-spark, no pyarrow.
    python3 = bad_bin / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        PATH=f"{bad_bin}{os.pathsep}{env.get('PATH', '')}",
        TMPDIR=str(temp),
        SPARK_LOCAL_IP="127.0.0.1",
        ZIO_SPOOL_SERVER_HOST="127.0.0.1",
    )
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )


def test_readme_starts_with_the_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# zio-spark"
    fence = lines.index("```bash")
    commands = [ln.split("#")[0].strip() for ln in lines[fence + 1 : fence + 3]]
    assert commands == ["./scripts/demo.sh", "./scripts/test.sh"]
    assert lines[fence + 3] == "```"
    assert all((ROOT / c).is_file() and os.access(ROOT / c, os.X_OK) for c in commands)


def test_quickstart_block_has_no_fixed_port_or_root_paths() -> None:
    code = quickstart_block()
    assert "SparkSession.builder" in code and ".getOrCreate()" in code
    assert ENV_LINE.search(code), "the block does not set PYSPARK_PYTHON"
    assert not re.search(r"tcp://[^\"']*:\d+", code), "a fixed port in the quick start"
    assert "/data" not in code and "/tmp/" not in code, "a fixed path in the quick start"
    assert "query.stop()" in code and "prod.close(" in code


def test_docs_never_install_from_pypi() -> None:
    notebook = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    pages += [ROOT / d / "README.md" for d in ("bench", "notebooks", "scripts", "tests")]
    assert (ROOT / "docs" / "running.md") in pages, "the install page is not checked"
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in pages} | {
        f"notebooks/quickstart.ipynb cell {i}": "".join(c["source"])
        for i, c in enumerate(notebook["cells"])
    }
    found = [
        (where, m.group(0)) for where, text in sources.items() for m in PYPI_INSTALL.finditer(text)
    ]
    assert not found, f"zio-spark is not on PyPI, yet these install it from there: {found}"


def test_pypi_install_pattern() -> None:
    """The pattern above catches the bare forms and spares the ones that work."""
    for bad in (
        "pip install zio-spark",
        "%pip install zio-spark\n",
        "pip install 'zio-spark[spark]'",
    ):
        assert PYPI_INSTALL.search(bad), bad
    for good in (
        "pip install 'zio-spark @ git+https://github.com/o/r.git'",
        "pip install dist/zio_spark-0.1.0-py3-none-any.whl",
        "pip install zio-spark-ng",
    ):
        assert not PYPI_INSTALL.search(good), good


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    done = _run(quickstart_block(), tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    rows = re.findall(r"^\|\s*(\S+)\|\s*(\S+)\|\s*(\S+)\|$", done.stdout, re.MULTILINE)
    assert rows == [
        ("producer", "seq", "value"),
        ("daq1", "1", "frame-1"),
        ("daq1", "2", "frame-2"),
        ("daq1", "3", "frame-3"),
    ], done.stdout
    # Its own temporary folder, under TMPDIR, holds the parquet output and the checkpoint.
    (work,) = (tmp_path / "tmp").glob("zio-quickstart-*")
    assert list((work / "out").glob("*.parquet")), f"no parquet files in {work / 'out'}"
    assert (work / "checkpoint" / "commits").is_dir()


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_quickstart_needs_its_pyspark_python_line(tmp_path: Path) -> None:
    """Without the line, Spark's workers run ``python3`` (no zio-spark): not found."""
    code, n = ENV_LINE.subn("pass", quickstart_block())
    assert n == 1
    done = _run(code, tmp_path)
    assert done.returncode != 0, done.stdout
    assert "DATA_SOURCE_NOT_FOUND" in done.stderr, done.stderr[-4000:]
