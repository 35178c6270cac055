"""``notebooks/quickstart.ipynb`` runs top to bottom in a Jupyter kernel on this interpreter,
with a local session and through a Spark Connect session, on whatever pyspark this
interpreter has (the full suite's 4.3; the version matrix's venvs run it too).

The kernel is a kernelspec made for the test under ``tmp_path`` (found through
``JUPYTER_PATH``) whose argv is ``sys.executable``, so the notebook runs in the same
environment as the tests and not in whatever ``python3`` kernel the machine has. The
kernel's working folder and its ``TMPDIR`` are under ``tmp_path`` too, so the notebook's
temporary folder (spool, checkpoint, output, plot) is found there afterwards. Nothing is
added to ``PYTHONPATH``: Spark must find ``pyspark_zio`` as installed (setuptools' compat
editable mode, or a wheel).

The notebook is also what runs on Databricks, so the tests check what it must not do
there: no ``sparkContext`` (Spark Connect and serverless have none), the streaming write
with ``availableNow``, no session made when the notebook already has a ``spark``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import install as install_kernelspec
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "zio-spark-quickstart-test"
CELL_TIMEOUT = 180  # seconds; the whole notebook takes well under a minute


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    prefix = tmp_path / "jupyter"
    install_kernelspec(kernel_name=KERNEL, display_name=KERNEL, prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return KERNEL


def test_notebook_is_stored_clean() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} is stored with outputs"
            assert cell.execution_count is None, f"cell {i} is stored with an execution count"


def test_notebook_is_fit_for_databricks() -> None:
    """What Databricks needs, read from the cells (running there is not possible here)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    everything = "\n".join(c.source for c in nb.cells)
    assert "sparkContext" not in everything, "Spark Connect and serverless have no sparkContext"
    # The install is a code cell: the wheel from a volume, then a restart (commented out,
    # since %pip of a /Volumes path cannot run here).
    install = code[0].splitlines()
    assert re.fullmatch(
        r"# %pip install /Volumes/\S+/zio_spark-<version>-py3-none-any\.whl", install[0]
    )
    assert install[1] == "# dbutils.library.restartPython()"
    # Configuration in one cell: every path and endpoint the notebook uses is set there.
    config = [c for c in code if "WORK_DIR = " in c]
    assert len(config) == 1 and "PRODUCER_BIND = " in config[0]
    others = [re.sub(r"#.*", "", c) for c in code[1:] if c is not config[0]]  # no comments
    literal = re.compile(r"[\"'](?:/Volumes|/tmp|/data|tcp://)")
    assert not [c for c in others if literal.search(c)], "a path or endpoint outside the config"
    # The notebook's own session is used when there is one; the streaming write is one
    # Databricks serverless runs.
    assert any('globals().get("spark")' in c for c in code)
    assert any(".trigger(availableNow=True)" in c and "writeStream" in c for c in code)
    assert not any("processingTime" in c for c in code)


@pytest.mark.timeout(CELL_TIMEOUT * 3)  # let nbclient's per-cell timeout fire first
def test_quickstart_runs_top_to_bottom(kernel_name: str, tmp_path: Path) -> None:
    """No ``spark`` in the kernel: the notebook makes a local session and stops it."""
    _, code = _run_and_check(kernel_name, tmp_path, given=None)
    assert "(a local session made here)" in _session_line(code)


@pytest.mark.timeout(CELL_TIMEOUT * 3 + 240)
def test_quickstart_runs_with_a_given_spark_connect_session(
    kernel_name: str, tmp_path: Path, connect_server: str
) -> None:
    """As on Databricks serverless: the kernel already holds a Spark Connect ``spark``
    (a server from pyspark's own distribution on loopback, the run's ``connect_server``);
    the notebook uses it, and leaves it running."""
    given = (
        "from pyspark.sql import SparkSession\n"
        f"spark = SparkSession.builder.remote({connect_server!r}).getOrCreate()"
    )
    nb, code = _run_and_check(kernel_name, tmp_path, given=given)
    assert "(the notebook's session, Spark Connect)" in _session_line(code)
    assert _text(nb.cells[-1]).endswith("still 3"), "the notebook stopped its given session"


def _text(cell: nbformat.NotebookNode) -> str:
    if cell.cell_type != "code":
        return ""
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _session_line(code: list[nbformat.NotebookNode]) -> str:
    lines = [ln for c in code for ln in _text(c).splitlines() if ln.startswith("Spark ")]
    assert len(lines) == 1, lines
    return lines[0]


def _run_and_check(
    kernel_name: str, tmp_path: Path, given: str | None
) -> tuple[nbformat.NotebookNode, list[nbformat.NotebookNode]]:
    """Run the notebook (after ``given``, a cell standing for what a platform's notebook
    already holds); check its plot, its exactly-once cell and its clean-up; return the
    notebook as run and its own code cells."""
    run_dir = tmp_path / "run"
    temp = tmp_path / "tmp"
    run_dir.mkdir()
    temp.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    own = list(nb.cells)
    if given is not None:
        nb.cells.insert(0, new_code_cell(given))
    nb.cells.append(new_code_cell("import sys\nprint(sys.executable, end='')"))
    if given is not None:
        nb.cells.append(new_code_cell("print('still', spark.range(3).count(), end='')"))
    # The kernel and every process it starts get TMPDIR (the notebook's temporary folder
    # goes there); the pytest process keeps its own.
    env = dict(os.environ, TMPDIR=str(temp))
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(run_dir)}},
    )
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    text = _text

    executable = [c for c in nb.cells if text(c) == sys.executable]
    assert executable, "the kernel ran another interpreter"
    code = [c for c in own if c.cell_type == "code"]
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "no inline plot was displayed"
    assert any("every frame arrived exactly once" in text(c) for c in code)

    work = list(temp.glob("zio-quickstart-*"))
    assert len(work) == 1, f"expected one notebook folder under {temp}, found {work}"
    png = work[0] / "detector_rates.png"
    assert png.is_file(), f"{png} was not written"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((work[0] / "frames").glob("*.parquet")), "no parquet output"
    assert not (work[0] / "spool").exists(), "the clean-up cell did not remove the spool"
    assert not (work[0] / "checkpoint").exists(), "the clean-up cell kept the checkpoint"
    return nb, code
