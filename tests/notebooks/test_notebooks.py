"""Every notebook runs top to bottom headless on small inputs and writes at least one figure."""
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_writes_figures(path, tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs must not be committed"
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    figures = list(tmp_path.rglob("*.png"))
    assert figures, f"{path.name} wrote no figure"
    assert all(f.stat().st_size > 1000 for f in figures)
