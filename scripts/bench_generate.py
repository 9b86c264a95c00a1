"""Generation throughput of the CPU default target: batch 1 against batch N, fp32 against bf16.

Same prompts, same process, greedy, a fixed number of new tokens (min = max, so every row costs the
same), one warm-up call per setting; reports the median of `--repeats` timed calls.

    python scripts/bench_generate.py --batch-sizes 1 16 --dtypes float32 bfloat16
Writes outputs/bench/generate.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from d3d.config import compose
from d3d.utils.io import resolve_path, write_json
from d3d.settings import bind_config, shipped_benchmark
from d3d.data.chat import chat_prompt_ids
from d3d.data.prompts import load_prompt_set
from d3d.models.generation import generate_batch
from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.utils.runinfo import run_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/bench/generate.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/generate.yaml")
    args = ap.parse_args()

    from transformers import GenerationConfig

    cfg = bind_config(compose("generate", args.overrides), "generate")
    cache = resolve_path(cfg.paths.cache_dir)
    path = resolve_model_path(cfg.target, cache)
    tok = load_tokenizer(path)
    prompts = load_prompt_set(cfg.data, cache, shipped_benchmark)[: max(args.batch_sizes)]
    batch_all = [(p, chat_prompt_ids(tok, p.messages)) for p in prompts]
    rows = []
    for dtype in args.dtypes:
        model = load_model(path, dtype, "cpu")
        gen = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for bs in args.batch_sizes:
            batch = batch_all[:bs]
            generate_batch(model, tok, batch, {"generation_config": GenerationConfig(
                max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)})  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                generate_batch(model, tok, batch, {"generation_config": gen})
                times.append(time.perf_counter() - start)
            med = statistics.median(times)
            rows.append({"dtype": dtype, "batch_size": bs, "median_s": round(med, 3),
                         "tokens_per_s": round(bs * args.new_tokens / med, 2)})
            print(rows[-1], flush=True)
    base = {r["dtype"]: r["tokens_per_s"] for r in rows if r["batch_size"] == min(args.batch_sizes)}
    for r in rows:
        r["ratio_to_batch1_same_dtype"] = round(r["tokens_per_s"] / base[r["dtype"]], 2)
    print(f"\n| dtype | batch | tokens/s | × batch {min(args.batch_sizes)} |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch_size']} | {r['tokens_per_s']} | {r['ratio_to_batch1_same_dtype']} |")
    write_json(Path(args.out), {"rows": rows, "new_tokens": args.new_tokens, "target": cfg.target.name,
                                "run": run_info("cpu")})


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
