"""notebooks/results.ipynb runs headless on real result folders and draws its figures."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from d3d.eval import run_eval
from d3d.generate import run_generate
from d3d.prune import run_prune
from tests.conftest import ROOT, compose

SMOKE = ["+experiment=smoke", "data.limit=10", "generate.max_new_tokens=24", "train.val_size=3"]


@pytest.mark.heavy  # a Jupyter kernel, after an eval and a pruning run: about 20 s on 2 cores
def test_notebook_executes_on_eval_and_prune_results(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ev = run_eval(compose("eval", ["+experiment=smoke", "eval.n=2", "eval.max_new_tokens=12", "decode.block_size=4",
                                   "decode.C=3", "decode.F=1", f"eval.out_dir={tmp_path}/ev"], tmp_path))
    # a pruning run of its own (one step of the smoke drafter's two layers) on the smoke responses
    run_generate(compose("generate", SMOKE, tmp_path))
    pruned = run_prune(compose("prune", SMOKE + ["prune.num_layers=1", "prune.recovery_steps=1", "prune.min_retention=0",
                                                 "prune.calib_size=3", f"prune.out_dir={tmp_path}/pruned"], tmp_path))
    monkeypatch.setenv("D3D_EVAL_DIRS", str(ev))
    monkeypatch.setenv("D3D_PRUNE_DIRS", str(pruned))
    monkeypatch.setenv("D3D_SWEEPS_DIR", str(tmp_path / "no_sweeps"))
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # speedup/τ bars, τ histogram, pruning curves
    text = "".join(o.get("text", "") for o in outputs)
    assert "1 eval folders, 1 pruning runs" in text
