"""The process-group stage of the GPU check: FSDP2 training steps and the in-training evaluation of a
tiny random Qwen3 drafter in a real process group, started by torchrun, with d3d's process-group
timeout (conf/dist/default.yaml) in force. On CUDA one process and NCCL; on the CPU two and gloo
(accelerate forms no group for one CPU process).

    torchrun --nproc_per_node 1 scripts/gpu_dist_check.py --device cuda --out outputs/gpu_check/dist.json

The launch is what `accelerate launch --config_file conf/accelerate/fsdp.yaml` gives each process
(its variables, made by accelerate's own launcher code in `launch_env`), the Accelerator d3d.train's
(d3d.training.make_accelerator). Rank 0 writes JSON after every step: the backend, the timeout read
back from the group, whether the parameters are FSDP2 shards, the losses, and the held-out τ. Exit
status 1 when the group, the sharding, the loss or the evaluation is not what it should be. Needs
torch, transformers, accelerate and PyYAML only (no Hydra, OmegaConf, datasets or DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a checkout without `pip install -e .`

from d3d.estimator import estimate_acceptance  # noqa: E402
from d3d.models.random_models import as_drafter, random_model, with_shape  # noqa: E402
from d3d.objective import Example, ObjectiveConfig, pack  # noqa: E402
from d3d.specs import StepSettings  # noqa: E402
from d3d.training import (  # noqa: E402
    D3DTrainingStep, autocast, make_accelerator, make_optimizer, my_share, optimizer_step, plain_drafter,
    sum_over_processes,
)
from d3d.utils.process_group import group_timeout_s  # noqa: E402


def shipped(path: Path) -> dict:
    """A conf/ YAML file's values (no interpolation is read here), numbers YAML 1.1 leaves as text
    (3e-5) made numbers."""
    import yaml

    return {k: (float(v) if isinstance(v, str) and v.replace("e-", "").replace(".", "").isdigit() else v)
            for k, v in yaml.safe_load(path.read_text()).items()}


def launch_env(processes: int) -> dict[str, str]:
    """The ACCELERATE_* / FSDP_* variables `accelerate launch --config_file conf/accelerate/fsdp.yaml`
    gives each of `processes` processes (d3d.utils.process_group, as SLURM sweeps get them)."""
    from d3d.utils.process_group import accelerate_environment

    return accelerate_environment("fsdp", processes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=4)
    args = ap.parse_args(argv)
    from torch.distributed.tensor import DTensor

    # the training step's shipped train.* keys, and the process group's timeout, as d3d.train has them
    step_keys = {f.name for f in fields(StepSettings)}
    tc = StepSettings(**{k: v for k, v in shipped(ROOT / "conf" / "training" / "default.yaml").items() if k in step_keys}
                      | {"responses_dir": "", "batch_size": 2, "freeze_embeddings": False, "anchors_per_seq": 4})
    timeout_s = float(shipped(ROOT / "conf" / "dist" / "default.yaml")["timeout_s"])
    precision = "bf16" if args.device == "cuda" else "no"
    acc = make_accelerator(tc, timeout_s=timeout_s, cpu=args.device == "cpu", precision=precision)
    shape = with_shape("train_check", vocab_size=args.vocab, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden, head_dim=args.hidden // 4)
    model = as_drafter(random_model(shape, "cpu", torch.float32, seed=0), args.block_size)
    mask_id = args.vocab - 1
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(1, mask_id, (args.seq_len,), generator=g).tolist(), args.seq_len // 2)
                for _ in range(4)]
    batch = pack(examples[:2], ObjectiveConfig.shipped(args.block_size, anchors_per_seq=4), mask_id, 0, g)
    step = D3DTrainingStep(model, args.vocab, 1.0, loss_chunk_rows=1024)
    optimizer = make_optimizer(step, lr=1e-3, weight_decay=0.0, betas=[0.9, 0.95])
    step, optimizer = acc.prepare(step, optimizer)
    step.train()
    params = list(acc.unwrap_model(step).parameters())
    report = {"device": str(acc.device), "processes": acc.num_processes, "distributed_type": acc.distributed_type.value,
              "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
              "timeout_s_configured": timeout_s, "timeout_s_in_force": group_timeout_s(),
              "dtensor_params": sum(isinstance(p, DTensor) for p in params), "params": len(params),
              "losses": [], "step_s": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        if acc.is_main_process:
            out.write_text(json.dumps(report, indent=1))

    write()
    for _ in range(args.steps):
        t = time.perf_counter()
        report["losses"].append(optimizer_step(step, optimizer, [batch], clip=1.0, accelerator=acc)["loss"])
        report["step_s"].append(round(time.perf_counter() - t, 4))
        write()
    # the in-training evaluation as d3d.train.evaluate runs it: the sharded drafter gathered whole on
    # every process, each estimating its share of the held-out responses, the counts summed
    t = time.perf_counter()
    drafter = plain_drafter(acc, step)
    drafter.eval()
    with autocast(acc.mixed_precision, acc.device):
        stats = estimate_acceptance(drafter, my_share(examples[2:], acc), args.block_size, mask_id, args.vocab)
    tokens, rounds = sum_over_processes(acc, [sum(stats.taus), len(stats.taus)])
    step.train()
    report.update(val_tau=tokens / max(rounds, 1), val_rounds=int(rounds), eval_s=round(time.perf_counter() - t, 3))
    losses = report["losses"]
    report["ok"] = bool(report["backend"] == ("nccl" if args.device == "cuda" else "gloo")
                        and report["timeout_s_in_force"] == timeout_s
                        and report["distributed_type"] == "FSDP" and report["dtensor_params"] == report["params"]
                        and all(x == x for x in losses) and losses[-1] < losses[0]
                        and rounds > 0 and report["val_tau"] >= 1)
    write()
    if acc.is_main_process:
        print(f"[gpu_dist_check] {report['processes']} process(es), {report['backend']}, timeout "
              f"{report['timeout_s_in_force']} s, {report['dtensor_params']}/{report['params']} params sharded, loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}, τ {report['val_tau']:.2f}: {'ok' if report['ok'] else 'FAILED'}",
              flush=True)
    # every process at the same point before the group goes: a gloo peer torn down while the other
    # still tore down its pairs aborted one process (SIGABRT, exit -6) about one run in four on 2 CPU cores
    acc.wait_for_everyone()
    acc.end_training()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
