"""Exact greedy τ of a drafter on held-out target responses (the offline estimator, docs/design.md, Pruning).

    python scripts/estimate_tau.py --drafter checkpoints/cpu_default_lam1/final [--max-new-tokens 96] [--tree-nodes 15] [overrides]

Uses d3d.train's held-out split (d3d.examples.held_out: train.responses_dir, max_len, drop_looping, val_size, seed) and prints τ, per-slot accuracy
and the τ histogram; writes <drafter>/tau.json (tau_tree<N>.json for a tree of N drafts, decode.method=tree).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from d3d.config import compose
from d3d.settings import bind_config
from d3d.decoding.methods import scored_drafts
from d3d.estimator import estimate_acceptance
from d3d.models.drafter import SavedDrafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.examples import held_out
from d3d.training import cut_responses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="score the first N response tokens")
    ap.add_argument("--tree-nodes", type=int, default=None, help="τ of the drafts decode.tree_nodes=N verifies at once (d3d.decoding.methods.scored_drafts)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.tree_nodes is not None and args.tree_nodes < 1:
        ap.error(f"--tree-nodes {args.tree_nodes}: at least 1 draft node")
    cfg = bind_config(compose("train", args.overrides), "train")
    val = cut_responses(held_out(cfg.train, cfg.seed).val, args.max_new_tokens)
    model, _ = SavedDrafter.named(args.drafter, "--drafter").load(dtype="float32")
    s = DrafterSettings.of(model)
    stats = estimate_acceptance(model, val, s.block_size, s.mask_token_id, s.vocab_size,
                                drafts=scored_drafts(s.block_size, args.tree_nodes)).as_dict(s.block_size)
    stats["max_new_tokens"], stats["tree_nodes"] = args.max_new_tokens, args.tree_nodes
    print(json.dumps({k: v for k, v in stats.items()}, indent=None))
    name = "tau.json" if args.tree_nodes is None else f"tau_tree{args.tree_nodes}.json"
    (Path(args.drafter) / name).write_text(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
