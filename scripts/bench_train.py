"""Training throughput of the packed D3D step against a plain causal-LM step, same batch, one run.

    python scripts/bench_train.py [--batch-size 4 --anchors 32 --max-len 512 --repeats 3] [hydra overrides]
    python scripts/bench_train.py --precisions no bf16 ...   # fp32 against bf16 autocast, interleaved

The D3D step is the real one (d3d.training.D3DTrainingStep: clean sequence + N noisy blocks, logits only at loss
rows); the baseline is `model(input_ids, labels=...)` of the same backbone on the same clean
sequences (full logits, causal mask). `--precisions` times each step in each precision (`no` = fp32;
`bf16` = bf16 autocast around fp32 weights, what `train.mixed_precision=bf16` runs), the repeats
interleaved so a change in machine load hits every precision alike. Prints medians, tokens/s and the
ratios; writes outputs/bench/train.json. Needs target responses (python -m d3d.generate) for real sequences.
"""

from __future__ import annotations

import argparse
import resource
import statistics
from pathlib import Path

import torch

from d3d.config import compose, resolve_path
from d3d.settings import bind_config
from d3d.models.drafter import build_drafter
from d3d.models.drafter_settings import DrafterSettings
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
    ap.add_argument("--precisions", nargs="+", default=["no"], choices=["no", "bf16"],
                    help="no = fp32; bf16 = bf16 autocast (train.mixed_precision=bf16)")
    ap.add_argument("--out", default="outputs/bench/train.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = bind_config(compose("train", args.overrides), "train")
    torch.manual_seed(0)
    model, tok = build_drafter(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir), dtype="float32")
    s = DrafterSettings.of(model)
    model.train()
    examples = load_examples(resolve_path(cfg.train.responses_dir), args.max_len)[: args.batch_size]
    ocfg = ObjectiveConfig.shipped(s.block_size, anchors_per_seq=args.anchors)
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

    def under(precision: str, fn):
        """fn inside the precision's autocast: accelerate's bf16 mode on a CPU is exactly this."""
        def run():
            if precision == "no":
                return fn()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn()
        return run

    cpu = torch.device("cpu")  # this benchmark builds its model on the CPU
    steps = {(p, kind): under(p, fn) for p in args.precisions for kind, fn in (("d3d", d3d_step), ("causal", causal_step))}
    times = {key: [] for key in steps}
    for _ in range(args.repeats):  # interleaved: every step of every precision once per repeat
        for key, fn in steps.items():
            times[key].append(timed(fn, cpu, 1) / 1000)  # seconds; timed() warms up once itself
    med = {key: statistics.median(v) for key, v in times.items()}
    clean_tokens = int(attn.sum())
    result = {
        "batch_size": len(examples), "anchors_per_seq": args.anchors, "block_size": s.block_size,
        "packed_tokens": batch.n_tokens, "clean_tokens": clean_tokens, "repeats": args.repeats,
        "weights_dtype": str(next(model.parameters()).dtype),
    }
    for p in args.precisions:
        t_d3d, t_ar = med[(p, "d3d")], med[(p, "causal")]
        result[p] = {"d3d_step_s": round(t_d3d, 3), "causal_step_s": round(t_ar, 3),
                     "d3d_packed_tokens_per_s": round(batch.n_tokens / t_d3d, 1),
                     "d3d_clean_tokens_per_s": round(clean_tokens / t_d3d, 1),
                     "causal_tokens_per_s": round(clean_tokens / t_ar, 1),
                     "step_time_ratio_d3d_over_causal": round(t_d3d / t_ar, 2)}
    if "no" in args.precisions and "bf16" in args.precisions:
        result["d3d_step_fp32_over_bf16"] = round(med[("no", "d3d")] / med[("bf16", "d3d")], 2)
    result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    result["run"] = run_info("cpu")
    for k, v in result.items():
        if k != "run":
            print(f"{k:>34}: {v}")
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
