"""notebooks/quickstart.ipynb runs top to bottom on a CPU (small sizes, no install, offline) and
is stored without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
DONE_MARKER = "QUICKSTART_DONE"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(monkeypatch, tmp_path):
    # The kernel is a child process and inherits these: small sizes, skip the install cell,
    # and fail the hub cell at once instead of waiting on the network.
    monkeypatch.setenv("ORCA_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("ORCA_JAX_NOTEBOOK_SKIP_INSTALL", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the failing cell's traceback, on any error
    elapsed = time.perf_counter() - start

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert DONE_MARKER in _text(code_cells[-1]), "the last cell did not run"
    plot_cells = [c for c in code_cells if "plt.show()" in c.source]
    assert plot_cells and any("image/png" in o.get("data", {}) for c in plot_cells for o in c.outputs)
    assert "install skipped" in _text(next(c for c in code_cells if "%pip install" in c.source))
    assert elapsed < 240, f"the small notebook took {elapsed:.0f}s"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
