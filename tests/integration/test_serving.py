"""A d3d drafter served by vLLM (docs/serving.md): the CPU default's target (SmolLM2-135M) with a causal
drafter trained for 2 steps on its responses (enough to move it off the target's copy; τ is not the
point), exported by d3d.export, run greedy by vLLM's CPU build with and without the draft.

- the outputs are equal (vLLM's speculative decoding is lossless with this draft);
- vLLM's mean acceptance length equals d3d's prediction of it from the exported folder (the estimator's
  match lengths under the causal block, counted as vLLM counts: d3d.serving.engine_tau) to 0.05. Both
  run fp32 and the same drafter and prompts, so they agree exactly unless a near-tie argmax flips
  between the two kernels: a larger gap means the two do not run the same drafter (a wrong mask id,
  a bidirectional pass, a shifted block).

vLLM lives in its own environment (`make vllm-env`, or D3D_VLLM_PYTHON); without it this skips and says
how to get it. Slow (minutes: two vLLM engines start): `pytest -m slow tests/integration/test_serving.py`.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import CACHE_DIR, FIXTURES, ROOT, compose
from tests.integration.test_engines import VLLM_PYTHON, needs_vllm

pytestmark = pytest.mark.slow

NEW, K = 48, 7  # tokens per prompt; drafts per step (the drafter's B - 1)
TOLERANCE = 0.05
DATA = ["data=local", f"data.local_file={FIXTURES / 'prompts.jsonl'}", "target.dtype=float32"]
DRAFTER = [f"drafter.block_size={K + 1}", "drafter.block_attention=causal", "train.val_size=2", "train.max_len=160",
           "train.anchors_per_seq=8"]


def vllm(tmp_path, name: str, job: dict) -> dict:
    """tests/vllm_spec_run.py in vLLM's environment: {"outputs", "metrics"}."""
    (tmp_path / f"{name}.in.json").write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    args = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_spec_run.py"), str(tmp_path / f"{name}.in.json"),
            str(tmp_path / f"{name}.out.json")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.out.json").read_text())


@needs_vllm
def test_vllm_serves_an_exported_drafter_losslessly_at_d3ds_tau(tmp_path):
    from d3d.data.responses import read_responses
    from d3d.export import run_export
    from d3d.serving import engine_tau
    from d3d.generate import run_generate
    from d3d.models.drafter import load_drafter
    from d3d.models.target import resolve_model_path
    from d3d.settings import bind_config
    from d3d.train import run_train

    paths = [f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    overrides = lambda *extra: [*DATA, *DRAFTER, *extra, *paths]  # noqa: E731
    run_generate(compose("generate", [*DATA, "generate.max_new_tokens=64", "generate.progress=false", *paths]))
    trained = run_train(compose("train", overrides("train.max_steps=2", "train.eval_every=2", "train.save_every=2",
                                                   "train.max_minutes=null", "train.progress=false")))
    served = run_export(compose("export", overrides(f"drafter.checkpoint={trained / 'final'}",
                                                    f"export.out_dir={tmp_path}/served")))
    spec = json.loads((served / "speculative_config.json").read_text())
    assert spec["num_speculative_tokens"] == K and spec["parallel_drafting"]

    cfg = bind_config(compose("train", overrides()), "train")
    rows = list(read_responses(tmp_path / "data" / "responses" / cfg.target.name / cfg.data.name))
    prompts = [r["prompt_ids"] for r in rows]
    job = {"target": str(resolve_model_path(cfg.target, CACHE_DIR)), "prompts": prompts, "dtype": "float32",
           "ignore_eos": True}  # every row runs the whole NEW tokens: rounds end where vLLM's do
    # the target alone, long enough to read every step's drafts against (engine_tau's continuations)
    plain = vllm(tmp_path, "plain", {**job, "max_tokens": NEW + K + 1, "speculative_config": None})
    drafted = vllm(tmp_path, "drafted", {**job, "max_tokens": NEW, "speculative_config": spec})
    assert drafted["outputs"] == [o[:NEW] for o in plain["outputs"]]  # lossless

    metrics = drafted["metrics"]
    vllm_tau = 1 + metrics["num_accepted_tokens"] / metrics["num_drafts"]
    model, _ = load_drafter(served, dtype="float32")
    d3d_tau = engine_tau(model, prompts, plain["outputs"], NEW, K)
    assert abs(vllm_tau - d3d_tau) <= TOLERANCE, (vllm_tau, d3d_tau, metrics)
    assert metrics["num_drafts"] >= len(prompts) and metrics["num_draft_tokens"] == K * metrics["num_drafts"]
