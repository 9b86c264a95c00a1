"""How fast, and how faithfully, pruning's layer scores rank a drafter's layers (issue: pruning that pays).

    python scripts/prune_study.py --drafter checkpoints/pipeline_qwen/train/final \
        --fractions 1 0.5 0.25 --old-layers 2 train.responses_dir=data/responses/qwen25_coder_15b/cpu_math

On the held-out calibration responses (d3d.examples.held_out: the split d3d.train and d3d.prune use,
decided by the train.* overrides and seed): the one-sweep exact
scores (d3d.layer_scores, anchor_fraction 1), the sampled estimator at each fraction with its
Spearman rank agreement against the exact scores over all layers, and the old way (the estimator
once per skipped layer) timed on `--old-layers` layers and extrapolated. Writes --out (json + md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from d3d.config import compose
from d3d.decoding.methods import scored_drafts
from d3d.estimator import estimate_acceptance
from d3d.examples import held_out
from d3d.layer_scores import score_layers, spearman
from d3d.models.drafter import SavedDrafter, decoder_layers, skipping_layers
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.target import torch_dtype
from d3d.settings import bind_config
from d3d.training import cut_responses
from d3d.utils.hardware import cpu_info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--calib", type=int, default=6, help="calibration responses (the first of the held-out split)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--tree-nodes", type=int, default=None)
    p.add_argument("--old-layers", type=int, default=2, help="layers the per-layer estimator is timed on")
    p.add_argument("--out", default="docs/results/prune_scoring")
    p.add_argument("overrides", nargs="*", help="train.responses_dir=..., seed=...: what decides the held-out split")
    args = p.parse_args()
    cfg = bind_config(compose("train", args.overrides), "train")
    calib = cut_responses(held_out(cfg.train, cfg.seed).val[: args.calib], args.max_new_tokens)

    dtype = torch_dtype("auto", torch.device("cpu"))
    model, _ = SavedDrafter.named(args.drafter, "--drafter").load(dtype=str(dtype).split(".")[-1])
    model.eval()
    s = DrafterSettings.of(model)
    n = len(decoder_layers(model))
    print(f"{n} layers, {len(calib)} calibration responses x {args.max_new_tokens} tokens, {dtype}, "
          f"{torch.get_num_threads()} threads, {cpu_info()['model']}", flush=True)
    rows = {}
    for frac in args.fractions:
        start = time.perf_counter()
        sc = score_layers(model, calib, s.block_size, s.mask_token_id, s.vocab_size, drafts=scored_drafts(s.block_size, args.tree_nodes),
                          anchor_fraction=frac, seed=cfg.seed)
        rows[frac] = {"fraction": frac, "seconds": time.perf_counter() - start, "taus": sc.taus}
        print(f"fraction {frac}: {rows[frac]['seconds']:.1f} s, whole drafter {sc.taus[-1]:.3f}, best drop "
              f"{max(range(n), key=lambda i: sc.taus[i])} ({max(sc.taus[:n]):.3f})", flush=True)
    exact = rows[max(rows)]["taus"][:n]
    for r in rows.values():
        r["spearman_vs_exact"] = spearman(r["taus"][:n], exact)
        r["same_choice"] = max(range(n), key=lambda i: r["taus"][i]) == max(range(n), key=lambda i: exact[i])
    old = []
    for layer in range(min(args.old_layers, n)):
        start = time.perf_counter()
        with skipping_layers(model, [layer]):
            tau = estimate_acceptance(model, calib, s.block_size, s.mask_token_id, s.vocab_size,
                                      drafts=scored_drafts(s.block_size, args.tree_nodes)).tau
        old.append({"layer": layer, "seconds": time.perf_counter() - start, "tau": tau,
                    "one_sweep_tau": exact[layer]})
        print(f"per-layer estimator, layer {layer}: {old[-1]['seconds']:.1f} s, τ {tau:.3f} (one sweep {exact[layer]:.3f})",
              flush=True)
    old_total = sum(o["seconds"] for o in old) / max(len(old), 1) * n
    result = {"drafter": args.drafter, "layers": n, "calib": len(calib), "max_new_tokens": args.max_new_tokens,
              "dtype": str(dtype), "tree_nodes": args.tree_nodes, "cpu": cpu_info(), "threads": torch.get_num_threads(),
              "rows": list(rows.values()), "per_layer_estimator": old, "per_layer_estimator_all_layers_s": old_total}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"{n}-layer drafter, {len(calib)} calibration responses x {args.max_new_tokens} tokens, {dtype}, "
             f"{cpu_info()['model']}", "",
             "| scorer | seconds for all layers | Spearman vs exact | same layer chosen | whole drafter τ |",
             "|---|---|---|---|---|",
             f"| estimator once per layer (timed on {len(old)}, extrapolated) | {old_total:.0f} | — | — | — |"]
    for r in rows.values():
        name = "one sweep, exact" if r["fraction"] >= 1 else f"one sweep, {r['fraction']:.0%} of anchors sampled"
        lines.append(f"| {name} | {r['seconds']:.0f} | {r['spearman_vs_exact']:.3f} | {r['same_choice']} | "
                     f"{r['taus'][-1]:.3f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
