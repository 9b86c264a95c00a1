"""scripts/slurm/d3d.sbatch under stand-ins for srun and scontrol (tests/stand_ins/) on this machine:
2 nodes x 1 process, localhost, on the CPU (gloo). Each task must read its own node rank: the old
README's `srun accelerate launch ... --machine_rank "$SLURM_NODEID"` (expanded once by the batch shell,
to 0) starts two rank-0 nodes and never forms the group, under the same stand-in. Through the script,
d3d.train (FSDP2) and then d3d.prune (FSDP2) end with the checkpoints one process makes on the same
global batch."""

from __future__ import annotations

import pytest

from tests.conftest import CACHE_DIR, ROOT, compose
from tests.stand_ins import rendezvous_port, sbatch

pytestmark = pytest.mark.heavy  # accelerate launch on two stand-in nodes (torchrun, gloo)

SCRIPT = ROOT / "scripts" / "slurm" / "d3d.sbatch"
# the README's old multi-node lines, as a batch script
OLD_PATTERN = """#!/bin/bash
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun python -m accelerate.commands.launch --config_file "$1" --num_machines 2 --num_processes 2 \\
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_NODE" --main_process_port "$D3D_MAIN_PORT" -m "$2"
"""


def test_each_node_reads_its_own_rank_and_the_old_line_does_not(tmp_path):
    fsdp = ROOT / "conf" / "accelerate" / "fsdp.yaml"
    new = sbatch(SCRIPT, [fsdp, "tests.stand_ins.world"], nodes=2, gpus_per_node=1, port=rendezvous_port(), timeout=240)
    assert new.returncode == 0, new.stderr[-3000:]
    assert "d3d.sbatch: tests.stand_ins.world on 2 node(s) x 1 process(es), rendezvous localhost:" in new.stdout
    worlds = sorted(line for line in new.stdout.splitlines() if line.startswith("world: "))
    assert [w.split(",")[0] for w in worlds] == ["world: process 0 of 2 processes (gloo)",
                                                 "world: process 1 of 2 processes (gloo)"], new.stdout
    assert all(w.endswith("process-group timeout 120 s (dist.timeout_s), ranks [0, 1]") for w in worlds)

    old_script = tmp_path / "old.sbatch"
    old_script.write_text(OLD_PATTERN)
    old = sbatch(old_script, [fsdp, "tests.stand_ins.world"], nodes=2, gpus_per_node=1, port=rendezvous_port(), timeout=90)
    assert old.returncode != 0 and "world: " not in old.stdout, old.stdout  # two rank-0 nodes: no group


def test_refusals_name_the_fix(tmp_path):
    bad = sbatch(SCRIPT, [tmp_path / "none.yaml", "d3d.train"], nodes=2, gpus_per_node=1, port=rendezvous_port(), timeout=30)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Fix: " in bad.stderr
    cpu_only = sbatch(SCRIPT, [ROOT / "conf" / "accelerate" / "fsdp.yaml", "d3d.train"], nodes=1, gpus_per_node=1,
                      port=rendezvous_port(), timeout=30, env={"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": ""})
    assert cpu_only.returncode == 2 and "Fix: sbatch --gpus-per-node G" in cpu_only.stderr


def fp32_fsdp(tmp_path):
    """conf/accelerate/fsdp.yaml with mixed_precision no: the comparison with one process is in fp32
    (FSDP2's bf16 parameters would round differently from one process's fp32)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "conf" / "accelerate" / "fsdp.yaml").read_text())
    cfg["mixed_precision"] = "no"
    path = tmp_path / "fsdp_fp32.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_then_prune_over_two_nodes_equal_one_process(tmp_path, monkeypatch):
    import torch

    from d3d.generate import run_generate
    from d3d.models.drafter import load_drafter
    from d3d.prune import run_prune
    from d3d.train import TrainRecipe
    from d3d.utils.io import read_jsonl

    root = tmp_path / "root"
    base = ["+experiment=smoke", "target.tiny.num_hidden_layers=3", "target.name=tiny3", "data.limit=10",
            "generate.max_new_tokens=24", "train.val_size=3", f"paths.root_dir={root}", f"paths.cache_dir={CACHE_DIR}",
            "train.freeze_embeddings=false", "train.batch_size=1", "train.global_batch_size=2", "train.lr=1e-3",
            "dist.timeout_s=900"]
    monkeypatch.setenv("D3D_CPU_BF16", "0")  # prune's recovery in fp32 here and in the two nodes' processes
    run_generate(compose("generate", [o for o in base if not o.startswith(("train.", "dist."))]))
    config = fp32_fsdp(tmp_path)
    train = base + ["train.mixed_precision=no", "train.max_steps=3", "train.warmup_steps=1", "train.eval_every=3", "train.save_every=3",
                    "train.progress=false"]
    two = sbatch(SCRIPT, [config, "d3d.train", *train, f"train.out_dir={tmp_path}/two", f"hydra.run.dir={tmp_path}/h1"],
                 nodes=2, gpus_per_node=1, port=rendezvous_port())
    assert two.returncode == 0, two.stderr[-4000:]
    assert "[d3d] 2 processes (gloo), process-group timeout 900 s" in two.stdout
    TrainRecipe(compose("train", train + [f"train.out_dir={tmp_path}/one"])).train()
    w2, _ = load_drafter(tmp_path / "two" / "final", dtype="float32")
    w1, _ = load_drafter(tmp_path / "one" / "final", dtype="float32")
    for k, v in w1.state_dict().items():  # fp32: the two processes' gradients summed in another order
        torch.testing.assert_close(w2.state_dict()[k], v, rtol=1e-5, atol=2e-6)

    prune = base + ["prune.num_layers=2", "prune.recovery_steps=2", "prune.min_retention=0", "prune.calib_size=3",
                    "prune.progress=false", "prune.recovery_lr=1e-3", f"drafter.checkpoint={tmp_path}/two/final"]
    two = sbatch(SCRIPT, [config, "d3d.prune", *prune, f"prune.out_dir={tmp_path}/p2", f"hydra.run.dir={tmp_path}/h2"],
                 nodes=2, gpus_per_node=1, port=rendezvous_port())
    assert two.returncode == 0, two.stderr[-4000:]
    assert "[d3d.prune] 2 processes (FSDP): scoring split over them, recovery on a global batch of 2" in two.stdout
    one = run_prune(compose("prune", prune + [f"prune.out_dir={tmp_path}/p1"]))
    steps2, steps1 = list(read_jsonl(tmp_path / "p2" / "steps.jsonl")), list(read_jsonl(one / "steps.jsonl"))
    assert [r["removed"] for r in steps2] == [r["removed"] for r in steps1] and len(steps1) == 3
    p2, _ = load_drafter(tmp_path / "p2" / "final", dtype="float32")
    p1, _ = load_drafter(one / "final", dtype="float32")
    assert p1.config.num_hidden_layers == p2.config.num_hidden_layers == 1
    for k, v in p1.state_dict().items():
        torch.testing.assert_close(p2.state_dict()[k], v, rtol=1e-4, atol=1e-5)
