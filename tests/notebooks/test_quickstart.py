"""``notebooks/quickstart.ipynb`` runs top to bottom in a Jupyter kernel on this interpreter.

The kernel is a kernelspec made for the test under ``tmp_path`` (found through
``JUPYTER_PATH``) whose argv is ``sys.executable``, so the notebook runs in the same
environment as the tests and not in whatever ``python3`` kernel the machine has. The
kernel's working folder and its ``TMPDIR`` are under ``tmp_path`` too, so the notebook's
temporary folder (spool, checkpoint, plot) is found there afterwards.

``PYTHONPATH`` gets the project root: Spark finds ``format("zio")`` by listing top-level
``pyspark_*`` modules with ``pkgutil.iter_modules()``, which sees a module installed into
site-packages but not one provided by the import hook of a setuptools editable install
(``pip install -e``). The tests under ``tests/spark`` only see it because Spark's Python
workers start in the project root; this kernel starts in a temporary folder.
"""

from __future__ import annotations

import os
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


@pytest.mark.timeout(CELL_TIMEOUT + 300)  # let nbclient's per-cell timeout fire first
def test_quickstart_runs_top_to_bottom(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZIO_QUICKSTART_REMOTE", raising=False)
    code = _run_and_check(kernel_name, tmp_path, monkeypatch)
    assert "(local)" in _text(code[0])


@pytest.mark.timeout(CELL_TIMEOUT + 420)
def test_quickstart_runs_through_spark_connect(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same cells through a Spark Connect session (the notebook's parameter), as on
    Databricks serverless: a server from pyspark's own distribution on loopback."""
    from tests.cluster.spark_procs import start_connect_server

    server, url = start_connect_server(tmp_path / "connect")
    try:
        monkeypatch.setenv("ZIO_QUICKSTART_REMOTE", url)
        code = _run_and_check(kernel_name, tmp_path, monkeypatch)
        assert f"(Connect {url})" in _text(code[0])
    finally:
        server.stop()


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _run_and_check(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[nbformat.NotebookNode]:
    """Run the notebook; check its plot, its exactly-once cell and its clean-up; return
    its code cells as run."""
    run_dir = tmp_path / "run"
    temp = tmp_path / "tmp"
    run_dir.mkdir()
    temp.mkdir()
    # Read by the kernel and the processes it starts (this process has its tempdir already).
    monkeypatch.setenv("TMPDIR", str(temp))
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    n_cells = len(nb.cells)
    nb.cells.append(new_code_cell("import sys\nprint(sys.executable, end='')"))
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(run_dir)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    text = _text

    assert text(nb.cells[n_cells]) == sys.executable, "the kernel ran another interpreter"
    code = [c for c in nb.cells[:n_cells] if c.cell_type == "code"]
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "no inline plot was displayed"
    assert any("every frame arrived exactly once" in text(c) for c in code)

    work = list(temp.glob("zio-quickstart-*"))
    assert len(work) == 1, f"expected one notebook folder under {temp}, found {work}"
    png = work[0] / "detector_rates.png"
    assert png.is_file(), f"{png} was not written"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (work[0] / "spool").exists(), "the clean-up cell did not remove the spool"
    return code
