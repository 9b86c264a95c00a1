"""τ of tree verification against the chain at equal verify width (docs/results/study_2026-12-02_trees_vs_chain.md).

    python scripts/tree_vs_chain.py [--widths 4 8 16] [--max-new-tokens 48] [--trays 23] [overrides of d3d.train's config]
    python scripts/tree_vs_chain.py --trays 8 23 drafter.checkpoint=<a trained drafter folder>

Loads the run's target and drafter as d3d.train builds them (the CPU default: SmolLM2-135M and an
untrained full copy of it, unless `drafter.*` overrides say otherwise), decodes the same prompts
greedily with sync (block = width) and with tree (the drafter's block, width - 1 nodes), and with
`--trays`, async_tree (the same tree, that many trays), and prints one JSON line per method: mean
τ, hit rate, rounds, whether its tokens equal the chain's, seconds (not a fair timing: methods run
one after another; scripts/bench_decode.py --trees times them interleaved).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from d3d.config import compose
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.models.drafter import build_drafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.settings import bind_config

QUESTIONS = [  # written for this script: short grade-school problems, as the CPU default's prompts are
    "A farmer has 12 cows and buys 7 more. Each cow gives 3 litres of milk a day. How much milk a day?",
    "Tom reads 15 pages a day. How many days does he need for a book of 240 pages?",
    "A shirt costs $20 and is sold at 25% off. What is the new price?",
    "Sara had 48 stickers. She gave a third to her brother and 5 to a friend. How many are left?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--trays", type=int, nargs="*", default=[],
                    help="also async_tree with these tray counts at each width (its τ is the tree's; the hit rate is new)")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if min(args.widths) < 2:
        ap.error(f"--widths {args.widths}: a verify width is the pending token + at least one draft (>= 2)")
    cfg = bind_config(compose("train", args.overrides), "train")
    target_path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    tok = load_tokenizer(target_path)
    target = load_model(target_path, "float32", "cpu")
    drafter, _ = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    block = DrafterSettings.of(drafter).block_size
    if max(args.widths) > block:
        ap.error(f"--widths {args.widths}: the chain's width is at most the drafter's block ({block})")
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    out = open(args.out, "w") if args.out else None
    for width in args.widths:
        chain = None
        runs = [("sync", DecodeConfig(method="sync", block_size=width)),
                ("tree", DecodeConfig(method="tree", block_size=block, tree_nodes=width - 1))]
        runs += [(f"async_tree_t{n}", DecodeConfig(method="async_tree", block_size=block, tree_nodes=width - 1,
                                                   tree_trays=n)) for n in args.trays]
        for method, dc in runs:
            t = time.perf_counter()
            res = SpecGenerator(target, tok, drafter, dc).generate(prompts, args.max_new_tokens)
            chain = res.token_ids if method == "sync" else chain
            line = json.dumps({"width": width, "method": method, "tau": round(res.mean_tau, 3),
                               "hit_rate": None if res.hit_rate is None else round(res.hit_rate, 3),
                               "rounds": len(res.taus()), "tokens_equal_chain": res.token_ids == chain,
                               "seconds": round(time.perf_counter() - t, 1), "threads": torch.get_num_threads(),
                               "cpu": cpu})
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()


if __name__ == "__main__":
    main()
