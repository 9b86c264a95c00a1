"""Recovery after one pruning step, the D3D objective against distillation at equal steps.

    python scripts/recovery_study.py --drafter checkpoints/pipeline_qwen/train/final --remove 4 17 20 \
        --steps 8 +experiment=pipeline_qwen

Removes the same layers from the same drafter, recovers each way for the same steps with d3d.prune's
recovery (d3d.training.recover, as prune.recovery_loss chooses), and measures the exact greedy τ (chain) on the calibration and
the hold-out responses before and after. Writes --out (json).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from d3d.config import compose
from d3d.estimator import estimate_acceptance
from d3d.examples import held_out
from d3d.models.drafter import SavedDrafter, as_deployed, keep_layers
from d3d.models.drafter_settings import DrafterSettings
from d3d.settings import bind_config
from d3d.training import cut_responses, freeze_embeddings_except_mask, make_accelerator, recover
from d3d.utils.hardware import cpu_info


def measure(model, calib, holdout, s, suffix: str = "") -> dict:
    """Exact greedy τ (chain) of the deployed-dtype drafter on both response sets."""
    deployed = as_deployed(model)
    tau = lambda ex: estimate_acceptance(deployed, ex, s.block_size, s.mask_token_id, s.vocab_size).tau
    return {f"tau{suffix}": tau(calib), f"holdout_tau{suffix}": tau(holdout)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--remove", type=int, nargs="*", default=[],
                   help="layer indices to remove; none: the control (the whole drafter trained the same steps)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--losses", nargs="+", default=["objective", "distill"])
    p.add_argument("--out", default="docs/results/prune_recovery_qwen_zen4.json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = bind_config(compose("prune", args.overrides), "prune")
    tc, pc = cfg.train, cfg.prune
    _, train, val = held_out(tc, cfg.seed)
    calib = cut_responses(val[: pc.calib_size], tc.val_max_new_tokens)  # as d3d.prune splits them
    holdout = cut_responses(val[pc.calib_size : pc.calib_size + pc.holdout_size], tc.val_max_new_tokens)
    accelerator = make_accelerator(tc, timeout_s=cfg.dist.timeout_s, precision="auto")
    start, tok = SavedDrafter.named(args.drafter, "--drafter").load(dtype="float32")
    teacher = as_deployed(start).eval()
    results = {"cpu": cpu_info(), "drafter": args.drafter, "removed": args.remove, "steps": args.steps,
               "lr": pc.recovery_lr, "whole": measure(start, calib, holdout, DrafterSettings.of(start)), "runs": {}}
    print("whole drafter", results["whole"], flush=True)
    for loss in args.losses:
        model = copy.deepcopy(start)
        keep_layers(model, [i for i in range(len(model.base_model.layers)) if i not in args.remove])
        s = DrafterSettings.of(model)
        if tc.freeze_embeddings:
            freeze_embeddings_except_mask(model, s.mask_token_id)
        row = measure(model, calib, holdout, s, "_before_recovery")
        t = time.perf_counter()
        model = recover(accelerator, model, train, tc, s, args.steps, cfg.seed + 1, tok.pad_token_id,
                        teacher if loss == "distill" else None, pc.recovery_lr, pc.recovery_warmup_steps,
                        pc.recovery_schedule)
        row |= {"recovery_s": round(time.perf_counter() - t, 1), **measure(model, calib, holdout, s)}
        results["runs"][loss] = row
        print(loss, row, flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
