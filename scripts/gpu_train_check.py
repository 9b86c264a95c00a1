"""The training stage of the GPU check: a few steps of a tiny random Qwen3 drafter through the prepared
training step (d3d.training.D3DTrainingStep under accelerate), bf16 on CUDA, fp32 on CPU.

    python scripts/gpu_train_check.py --device cuda --out outputs/gpu_check/train.json --steps 8

Writes JSON after every step (a crash still leaves the steps before it): loss per step, whether every
loss is finite and the last is below the first, peak memory, and what ran (precision, attention,
mixed precision seen on the matmuls). Exit status 1 when the loss is not finite or did not fall.
Needs torch, transformers and accelerate only: no Hydra, omegaconf, datasets or DeepSpeed (so it runs
on a bare GPU image). The same fixed batch is repeated, so a working step must lower its loss.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

from d3d.models.random_models import random_model, with_shape  # noqa: E402
from d3d.objective import Example, ObjectiveConfig, pack  # noqa: E402
from d3d.training import (  # noqa: E402
    D3DTrainingStep, enable_activation_checkpointing, freeze_embeddings_except_mask, make_optimizer, optimizer_step,
)


def peak_memory_mb(device: torch.device) -> dict:
    out = {"host_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.type == "cuda":
        out["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        out["cuda_peak_reserved_mb"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--attn", default=None, help="sdpa | flex_attention (default: flex on CUDA, sdpa on CPU)")
    args = ap.parse_args(argv)
    from accelerate import Accelerator

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    attn = args.attn or ("flex_attention" if args.device == "cuda" else "sdpa")
    precision = "bf16" if args.device == "cuda" else "no"
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    accelerator = Accelerator(mixed_precision=precision, cpu=args.device == "cpu")
    shape = with_shape("train_check", vocab_size=args.vocab, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden, head_dim=args.hidden // 4)
    model = random_model(shape, "cpu", torch.float32, seed=0, attn=attn)
    enable_activation_checkpointing(model)
    mask_id = args.vocab - 1
    # as d3d.train does: the hook is registered on the CPU model, before prepare moves it to the GPU
    freeze_embeddings_except_mask(model, mask_id)
    emb_before = model.get_input_embeddings().weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(1, mask_id, (args.seq_len,), generator=g).tolist(), args.seq_len // 4)
                for _ in range(args.batch_size)]
    objective = ObjectiveConfig.shipped(args.block_size, anchors_per_seq=args.anchors)
    batch = pack(examples, objective, mask_id, 0, g)
    step = D3DTrainingStep(model, args.vocab, objective.ar_weight, loss_chunk_rows=1024)
    # d3d.train's optimizer groups: no weight decay on the (frozen but for one row) embeddings
    optimizer = make_optimizer(step, lr=1e-3, weight_decay=0.01, betas=[0.9, 0.95])
    step, optimizer = accelerator.prepare(step, optimizer)
    step.train()

    # Which dtype the matmuls really ran in (autocast reaches them only through the prepared forward).
    seen: dict[str, str] = {}
    q_proj = model.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, i, o: seen.update(q_proj_output=str(o.dtype)))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "mixed_precision": precision, "attn_implementation": attn,
              "gradient_checkpointing": True, "shape": vars(args), "packed_tokens": batch.n_tokens,
              "losses": [], "step_s": []}
    for i in range(args.steps):
        t = time.perf_counter()
        m = optimizer_step(step, optimizer, [batch], clip=1.0, accelerator=accelerator)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report["step_s"].append(round(time.perf_counter() - t, 4))
        report["losses"].append(m["loss"])
        report["matmul_dtype"] = seen.get("q_proj_output")
        losses = report["losses"]
        report["finite"] = all(x == x and abs(x) != float("inf") for x in losses)
        report["falling"] = len(losses) > 1 and losses[-1] < losses[0]
        report.update(peak_memory_mb(device))
        out_path.write_text(json.dumps(report, indent=1))  # after every step: a crash keeps what ran
    hook.remove()
    emb_after = model.get_input_embeddings().weight.detach().to("cpu", torch.float32)
    moved = (emb_after - emb_before.to(torch.float32)).abs().amax(dim=1)
    report["frozen_rows_unchanged"] = bool((moved[:mask_id] == 0).all())  # only the mask row may learn
    report["mask_row_moved"] = bool(moved[mask_id] > 0)
    out_path.write_text(json.dumps(report, indent=1))
    ok = report["finite"] and report["falling"] and (precision == "no" or report["matmul_dtype"] == "torch.bfloat16") \
        and report["frozen_rows_unchanged"] and report["mask_row_moved"]
    print(f"[gpu_train_check] {device}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, matmuls "
          f"{report['matmul_dtype']}, peak {report.get('cuda_peak_allocated_mb', report['host_peak_rss_mb'])} MB: "
          f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
