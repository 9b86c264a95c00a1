"""scripts/sweep.py: every claim's sweep runs end to end at smoke size and writes its table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from d3d.generate import run_generate
from d3d.train import run_train
from tests.conftest import CACHE_DIR, ROOT, compose

SMOKE = ["+experiment=smoke", "eval.max_new_tokens=8", "decode.block_size=4", "decode.C=3", "decode.F=1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep_root")
    run_generate(compose("generate", ["+experiment=smoke"], path))
    run_train(compose("train", ["+experiment=smoke", f"train.out_dir={path}/drafter"], path))
    return path


def run_claim(sweep, root, claim, monkeypatch, *flags):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(root)
    out = root / "results"
    extra = [f"paths.root_dir={root}", f"paths.cache_dir={CACHE_DIR}"]
    overrides = SMOKE + extra  # each command gets the keys its job has
    result = sweep.main([claim, "--preset", "quick", "--drafter", str(root / "drafter" / "final"), "--root", str(root),
                         "--out", str(out), *flags, *overrides])
    saved = json.loads((out / f"{claim}.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert (out / f"{claim}.md").read_text().count("\n") == 2 + len(result["rows"])
    assert (out / f"{claim}.png").stat().st_size > 1000
    return result["rows"]


@pytest.mark.heavy  # each sweep runs d3d.eval (and d3d.prune) in subprocesses: 5 to 40 s a claim on 2 cores
@pytest.mark.parametrize("claim", ["budget", "pruning", "async_vs_sync", "load"])
def test_eval_sweeps(sweep, root, claim, monkeypatch):
    rows = run_claim(sweep, root, claim, monkeypatch)
    if claim == "budget":
        # sync, 4x1, 8x2 at B = 4: C = 8 covers only the 3 draft slots there are
        assert [r["packed_tokens"] for r in rows] == [0, 4 * (3 * 1 + 2), 4 * (3 * 2 + 2)]
        assert all(0.0 <= r["hit_rate"] <= 1.0 for r in rows if r["packed_tokens"])
    if claim == "pruning":
        assert [r["layers"] for r in rows] == [2, 1] and rows[0]["retention"] == 1.0
    if claim == "load":
        assert {r["concurrency"] for r in rows} == {1, 2, 4}
    if claim == "async_vs_sync":
        assert rows[0]["benchmark"] == "gsm8k" and rows[0]["equal_to_ar"] == 1.0


@pytest.mark.slow  # seven trainings and seven evaluations in subprocesses: minutes
@pytest.mark.parametrize("claim", ["ar_loss", "block_size"])
def test_training_sweeps(sweep, root, claim, monkeypatch):
    rows = run_claim(sweep, root, claim, monkeypatch)
    key = "lambda" if claim == "ar_loss" else "B"
    assert [r[key] for r in rows] == ([0.0, 0.5, 1.0, 2.0] if claim == "ar_loss" else [4, 8, 16])
    assert all(r["val_tau"] >= 1.0 and r["steps"] == 10 for r in rows)  # the quick preset's fixed step count
    if claim == "block_size":  # each drafter is verified at the block size it was trained with
        for B in (4, 8, 16):
            run = json.loads((root / "outputs" / "sweeps" / "block_size" / "eval" / f"B{B}" / "run.json").read_text())
            assert run["methods"]["sync"]["block_size"] == B
    # --skip-eval: the finished trainings resume as they are and report their held-out τ, no benchmark columns
    held_out = run_claim(sweep, root, claim, monkeypatch, "--skip-eval")
    same = [key, "steps", "val_tau"]
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in held_out]
    assert all(set(r) == {key, "steps", "val_tau_first", "val_tau"} for r in held_out)


@pytest.mark.heavy  # four trainings in subprocesses: ~40 s on 2 cores
def test_recipe_sweep(sweep, root, monkeypatch):
    """Each arm trains its own drafter with its one change (read back from the arm's config.yaml), from
    the same initial drafter and held-out set (equal τ at step 0), under the quick preset's step cap."""
    from omegaconf import OmegaConf

    rows = run_claim(sweep, root, "recipe", monkeypatch)
    assert [r["arm"] for r in rows] == ["base", "train.lr=1e-4", "train.anchors_per_seq=8", "train.trainable_from_layer=1"]
    assert all(r["steps"] == 3 and r["s_per_step"] > 0 for r in rows)
    assert len({r["val_tau_first"] for r in rows}) == 1
    folders = root / "checkpoints" / "sweeps" / "recipe"
    cfg = {name: OmegaConf.load(folders / name / "config.yaml").train
           for name in ("base", "lr_1e-4", "anchors_per_seq_8", "trainable_from_layer_1")}
    assert cfg["lr_1e-4"].lr == 1e-4 != cfg["base"].lr
    assert cfg["anchors_per_seq_8"].anchors_per_seq == 8 != cfg["base"].anchors_per_seq
    assert cfg["trainable_from_layer_1"].trainable_from_layer == 1 and cfg["base"].trainable_from_layer is None


@pytest.mark.heavy  # a Hydra multirun through submitit: two jobs of two processes each, then one training here: ~60 s
def test_submitit_local_multirun_runs_each_job_as_one_distributed_training(root, tmp_path):
    """`python -m d3d.train -m hydra/launcher=local hydra.launcher.tasks_per_node=2 train.ar_weight=0,1`
    (conf/hydra/launcher/local.yaml: slurm.yaml's jobs on this machine): one job per value, each of two
    tasks that the launcher's callback joins into one DDP training, so its weights equal those of one
    process taking the same global batch as two micro-batches (contract 9), and the λ = 0 job differs."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e .[cluster]")
    import torch

    from d3d.models.drafter import load_drafter

    common = ["+experiment=smoke", f"paths.root_dir={root}", f"paths.cache_dir={CACHE_DIR}", "train.max_steps=3",
              "train.warmup_steps=1", "train.eval_every=0", "train.save_every=100", "train.batch_size=1", "train.lr=1e-3",
              "train.freeze_embeddings=false", "train.progress=false"]
    cmd = [sys.executable, "-m", "d3d.train", "-m", *common, "hydra/launcher=local", "hydra.launcher.tasks_per_node=2",
           f"hydra.sweep.dir={tmp_path}/multirun", "hydra.sweep.subdir=lam${train.ar_weight}",  # (the default, every
           f"train.out_dir={tmp_path}/lam${{train.ar_weight}}", "train.ar_weight=0,1"]  # override, passes 255 characters)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    logs = sorted((tmp_path / "multirun" / ".submitit").glob("*/*_log.*"))
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(p.read_text()[-1500:] for p in logs)
    assert len([p for p in logs if p.name.endswith("_log.out")]) == 4  # 2 jobs x 2 tasks

    run_train(compose("train", [*common[:1], *common[3:], "train.ar_weight=1", "train.grad_accum=2",
                                f"train.out_dir={tmp_path}/one"], root))
    weights = {name: load_drafter(tmp_path / name / "final", dtype="float32")[0].state_dict()
               for name in ("lam0", "lam1", "one")}
    assert max((weights["lam1"][k] - weights["lam0"][k]).abs().max().item() for k in weights["one"]) > 1e-4
    for k, w in weights["one"].items():
        torch.testing.assert_close(weights["lam1"][k], w, rtol=1e-5, atol=2e-6)
