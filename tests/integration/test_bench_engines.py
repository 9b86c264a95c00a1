"""`python -m d3d.bench bench=engines` end to end in vLLM's environment, on the CPU default's target
(SmolLM2-135M, fp32; vLLM's CPU attention needs a head size it knows, which the tiny models' is not):
vLLM without speculation, with n-gram and serving a d3d.export folder (an untrained causal copy of
the target: a harness test, τ is not the point), beside generate, sync and tree.

- every engine row ran or is kept as unavailable with vLLM's reason;
- every row's outputs equal its reference: the engine's rows the engine's own non-speculative output
  (speculative decoding is lossless, fp32 on both sides), d3d's rows generate's (a difference only at
  a near-tie); the engine's baseline and generate mostly agree (two fp32 kernels: near-ties flip);
- the export row carries the engine's acceptance per draft position beside d3d's prediction from the
  export's speculation_profile.json, K positions each, 1 + Σ cumulative = the engine's mean
  acceptance length.

vLLM lives in its own environment (`make vllm-env`, or D3D_VLLM_PYTHON); without it this skips and says
how to get it. Slow (minutes: three engines start): `pytest -m slow tests/integration/test_bench_engines.py`.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import CACHE_DIR, FIXTURES, ROOT, compose
from tests.integration.test_engines import VLLM_PYTHON, needs_vllm

pytestmark = pytest.mark.slow

N, NEW, B = 3, 32, 4  # timed prompts, new tokens each, the drafter's block (K = B - 1 drafts a step)
DATA = ["data=local", f"data.local_file={FIXTURES / 'prompts.jsonl'}", "target.dtype=float32"]


@needs_vllm
def test_the_engines_preset_runs_every_row_against_its_reference(tmp_path):
    from d3d.export import run_export
    from d3d.generate import run_generate
    from d3d.models.drafter import build_drafter, save_drafter
    from d3d.settings import bind_config

    paths = [f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    drafter_keys = [f"drafter.block_size={B}", "drafter.block_attention=causal", "train.val_size=2", "train.max_len=160"]
    # held-out responses for the export to measure its speculation profile on
    run_generate(compose("generate", [*DATA, "generate.max_new_tokens=48", "generate.progress=false", *paths]))
    cfg = bind_config(compose("train", [*DATA, *drafter_keys, *paths]), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    folder = save_drafter(model, tok, tmp_path / "drafter")
    served = run_export(compose("export", [*DATA, *drafter_keys, *paths, f"drafter.checkpoint={folder}",
                                           f"export.out_dir={tmp_path}/served"]))
    assert (served / "speculation_profile.json").is_file()

    out = tmp_path / "bench"
    args = [str(VLLM_PYTHON), "-m", "d3d.bench", "bench=engines", "target.dtype=float32", f"bench.n_prompts={N}",
            f"bench.max_new_tokens={NEW}", "bench.progress=false", f"drafter.checkpoint={folder}",
            f"methods.sync.block_size={B}", f"methods.tree.block_size={B}", "methods.tree.tree_nodes=3",
            f"drafter.block_size={B}", "drafter.block_attention=causal", f"bench.engine.export={served}",
            f"bench.out_dir={out}", *paths]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "D3D_CONFIG_DIR": str(ROOT / "conf")}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    engines = {e["row"]: e for e in summary["engines"]["rows"]}
    assert list(engines) == ["vllm", "vllm_ngram", "vllm_d3d"] and summary["engines"]["baseline"] == "vllm"
    ran = {label: e for label, e in engines.items() if "unavailable" not in e}
    print({label: e.get("unavailable") or (e["equal_rate"], e["tokens_per_s"]) for label, e in engines.items()})
    assert {"vllm", "vllm_d3d"} <= set(ran), engines  # the baseline and the export serve on vLLM's CPU build
    assert all(e["unavailable"] for e in engines.values() if e not in ran.values())  # a reason, never a blank
    for label, e in ran.items():
        assert e["prompts"] == N and e["new_tokens"] > 0
        assert e["equal_rate"] == 1.0, (label, e)  # lossless: the engine's own non-speculative output
    assert ran["vllm"]["equal_to_reference_rate"] >= (N - 1) / N  # vLLM against generate: two fp32 kernels
    d3d_rows = {e["method"]: e for e in summary["methods"]}
    assert set(d3d_rows) == {"generate", "sync", "tree"}
    for e in d3d_rows.values():  # d3d's rows against generate: equal, or differing only at a near-tie
        assert e["equal_rate"] + (e["near_tie_rate"] or 0) == 1.0, e

    export_row = ran["vllm_d3d"]
    acc, predicted = export_row["acceptance"], export_row["predicted"]
    assert len(acc["cumulative"]) == len(acc["conditional"]) == len(predicted["cumulative"]) == B - 1
    assert acc["drafts"] > 0 and acc["mean_acceptance_length"] == pytest.approx(1 + sum(acc["cumulative"]))
    assert predicted["mean_acceptance_length"] == pytest.approx(1 + sum(predicted["cumulative"]))
    text = (out / "summary.md").read_text()
    assert "submitted at once to the engine's scheduler (continuous batching)" in text
    assert "| vllm_d3d |" in text and "predicted cumulative by k" in text
