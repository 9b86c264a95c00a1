"""Exact greedy τ of a drafter on held-out target responses (the offline estimator, docs/design.md, Pruning).

    python scripts/estimate_tau.py --drafter checkpoints/cpu_default_lam1/final [--max-new-tokens 96] [overrides]

Uses the same held-out split as d3d.train (train.val_size, seed) and prints τ, per-slot accuracy
and the τ histogram; writes <drafter>/tau.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from d3d.config import compose, resolve_path
from d3d.settings import bind_config
from d3d.estimator import estimate_acceptance
from d3d.models.drafter import DrafterSettings, load_drafter
from d3d.training import cut_responses, load_examples, split_examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="score the first N response tokens")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = bind_config(compose("train", args.overrides), "train")
    examples = load_examples(resolve_path(cfg.train.responses_dir), cfg.train.max_len)
    _, val = split_examples(examples, cfg.train.val_size, cfg.seed)
    val = cut_responses(val, args.max_new_tokens)
    model, _ = load_drafter(args.drafter, dtype="float32")
    s = DrafterSettings.of(model)
    stats = estimate_acceptance(model, val, s.block_size, s.mask_token_id, s.vocab_size).as_dict(s.block_size)
    stats["max_new_tokens"] = args.max_new_tokens
    print(json.dumps({k: v for k, v in stats.items()}, indent=None))
    (Path(args.drafter) / "tau.json").write_text(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
