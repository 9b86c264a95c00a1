"""Training throughput of the packed D3D step against a plain causal-LM step, same batch, one run.

    python scripts/bench_train.py [--batch-size 4 --anchors 32 --max-len 512 --repeats 3] [hydra overrides]

The D3D step is the real one (d3d.training.D3DTrainingStep: clean sequence + N noisy blocks, logits only at loss
rows); the baseline is `model(input_ids, labels=...)` of the same backbone on the same clean
sequences (full logits, causal mask). Prints medians, tokens/s and the ratio; writes
outputs/bench/train.json. Needs target responses (python -m d3d.generate) for real sequences.
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

import torch

from d3d.config import compose, resolve_path
from d3d.models.drafter import DrafterSettings, build_drafter
from d3d.objective import ObjectiveConfig, pack
from d3d.training import D3DTrainingStep, load_examples
from d3d.utils.io import write_json
from d3d.utils.runinfo import run_info
from d3d.utils.timing import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/bench/train.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = compose("train", args.overrides)
    torch.manual_seed(0)
    model, tok = build_drafter(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir), dtype="float32")
    s = DrafterSettings.of(model)
    model.train()
    examples = load_examples(resolve_path(cfg.train.responses_dir), args.max_len)[: args.batch_size]
    ocfg = ObjectiveConfig(block_size=s.block_size, anchors_per_seq=args.anchors)
    batch = pack(examples, ocfg, s.mask_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))

    step = D3DTrainingStep(model, s.vocab_size, 1.0)  # the module d3d.train runs

    def d3d_step():
        loss, _ = step(batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, e in enumerate(examples):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        attn[r, : len(e.ids)] = 1
        labels[r, e.prompt_len : len(e.ids)] = torch.tensor(e.ids[e.prompt_len :])

    def causal_step():
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    cpu = torch.device("cpu")  # this benchmark builds its model on the CPU
    t_d3d = timed(d3d_step, cpu, args.repeats) / 1000  # seconds
    t_ar = timed(causal_step, cpu, args.repeats) / 1000
    clean_tokens = int(attn.sum())
    result = {
        "batch_size": len(examples), "anchors_per_seq": args.anchors, "block_size": s.block_size,
        "packed_tokens": batch.n_tokens, "clean_tokens": clean_tokens,
        "d3d_step_s": round(t_d3d, 3), "causal_step_s": round(t_ar, 3),
        "d3d_packed_tokens_per_s": round(batch.n_tokens / t_d3d, 1),
        "d3d_clean_tokens_per_s": round(clean_tokens / t_d3d, 1),
        "causal_tokens_per_s": round(clean_tokens / t_ar, 1),
        "step_time_ratio_d3d_over_causal": round(t_d3d / t_ar, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "dtype": str(next(model.parameters()).dtype), "run": run_info("cpu"),
    }
    for k, v in result.items():
        if k != "run":
            print(f"{k:>34}: {v}")
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
