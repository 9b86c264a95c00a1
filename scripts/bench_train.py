"""Training throughput of the packed D3D step against a plain causal-LM step, same batch, one run.

    python scripts/bench_train.py [--batch-size 4 --anchors 32 --max-len 512 --repeats 3] [hydra overrides]
    python scripts/bench_train.py --precisions no bf16 ...   # fp32 against bf16 autocast, interleaved
    python scripts/bench_train.py --draft-vocab 32000 ...    # the D3D step with a draft vocabulary's head, too

The D3D step is the real one (d3d.training.D3DTrainingStep: clean sequence + N noisy blocks, logits only at loss
rows); the baseline is `model(input_ids, labels=...)` of the same backbone on the same clean
sequences (full logits, causal mask). `--precisions` times each step in each precision (`no` = fp32;
`bf16` = bf16 autocast around fp32 weights, what `train.mixed_precision=bf16` runs), the repeats
interleaved so a change in machine load hits every precision alike. Prints medians, tokens/s and the
ratios; writes outputs/bench/train.json. Needs target responses (python -m d3d.generate) for real sequences.
`--draft-vocab N ...` adds the D3D step with the head over N tokens (drafter.draft_vocab: chosen from the
training split of the responses as d3d.train chooses it, the pretrained rows), swapped in place on the same backbone and
interleaved with the full head's step; forward and backward only, as every step here (the optimizer's
update of the head's rows is not timed).
"""

from __future__ import annotations

import argparse
import resource
import statistics
from pathlib import Path

import torch

from d3d.config import compose
from d3d.utils.io import resolve_path, write_json
from d3d.settings import bind_config
from d3d.models.drafter import build_drafter, choose_draft_vocab, draft_head_of, special_ids
from d3d.models.drafter_settings import DrafterSettings
from d3d.objective import ObjectiveConfig, pack
from d3d.examples import held_out, load_examples
from d3d.training import D3DTrainingStep
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
    ap.add_argument("--draft-vocab", nargs="*", type=int, default=[],
                    help="also time the D3D step with a draft vocabulary of N tokens (drafter.draft_vocab)")
    ap.add_argument("--out", default="outputs/bench/train.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = bind_config(compose("train", args.overrides), "train")
    train_set = held_out(cfg.train, cfg.seed).train  # d3d.train chooses a draft vocabulary from this split
    torch.manual_seed(0)
    model, tok = build_drafter(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir), dtype="float32")
    s = DrafterSettings.of(model)
    model.train()
    loaded = load_examples(resolve_path(cfg.train.responses_dir), args.max_len)
    examples = loaded[: args.batch_size]
    ocfg = ObjectiveConfig.shipped(s.block_size, anchors_per_seq=args.anchors)
    batch = pack(examples, ocfg, s.mask_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))

    step = D3DTrainingStep(model, s.vocab_size, 1.0)  # the module d3d.train runs
    heads = {"d3d": model.get_output_embeddings()}
    always = special_ids(tok, s.vocab_size, s.mask_token_id)
    coverage = {}
    for n in args.draft_vocab:
        d2t, coverage[n] = choose_draft_vocab([e.ids[e.prompt_len:] for e in train_set], n, s.vocab_size, always)
        heads[f"d3d_dv{n}"] = draft_head_of(model, d2t)  # swapped in on the same backbone, settings unchanged

    def d3d_step(head):
        def run():
            model.set_output_embeddings(heads[head])  # the step reads the head each forward
            loss, _ = step(batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, e in enumerate(examples):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        attn[r, : len(e.ids)] = 1
        labels[r, e.prompt_len : len(e.ids)] = torch.tensor(e.ids[e.prompt_len :])

    def causal_step():
        model.set_output_embeddings(heads["d3d"])
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
    kinds = [(head, d3d_step(head)) for head in heads] + [("causal", causal_step)]
    steps = {(p, kind): under(p, fn) for p in args.precisions for kind, fn in kinds}
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
        for n in args.draft_vocab:  # the same step with the draft head: steps a minute up by the ratio
            t_dv = med[(p, f"d3d_dv{n}")]
            result[p][f"d3d_dv{n}_step_s"] = round(t_dv, 3)
            result[p][f"d3d_step_full_over_dv{n}"] = round(t_d3d / t_dv, 3)
    if coverage:
        result["draft_vocab_coverage"] = {n: round(c, 5) for n, c in coverage.items()}  # of the training split
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
