"""Choose the tray budget of a method with trays (async: C x F; async_tree: tree_trays) for a drafter
on this device: offline hit rates on greedy responses of the target, measured pass costs, projected
speedup per budget (d3d.decoding.budget).

    python scripts/choose_budget.py --drafter checkpoints/cpu_default_lam1/final --n 6
    python scripts/choose_budget.py --drafter <ckpt> --method async_tree
    python scripts/choose_budget.py --drafter <ckpt> --held-out train.responses_dir=data/responses/<target>/<set> target=...

Calibration responses: with --held-out the first --n of d3d.train's held-out split (d3d.examples.held_out:
train.responses_dir, max_len, drop_looping, val_size and seed, as the overrides set them), responses
the drafter was not trained on; else greedy responses the target writes now to the last --n prompts
of the `data` prompt set. Prints the
table and writes outputs/bench/budget_<target>.json (the choice, every budget, costs, the CPU).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from d3d.config import compose, stage_overrides
from d3d.utils.io import resolve_path, write_json
from d3d.settings import bind_config, shipped_benchmark
from d3d.data.chat import chat_prompt_ids, eos_ids
from d3d.data.prompts import load_prompt_set
from d3d.decoding import DecodeConfig
from d3d.decoding.budget import calibrate, greedy_pairs
from d3d.decoding.methods import METHODS, ROLES, method_row
from d3d.models import load_target
from d3d.models.drafter import SavedDrafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.utils.runinfo import run_info


def calibration(args, cfg, target, tok) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) pairs of target greedy responses."""
    if args.held_out:
        from d3d.examples import held_out

        train = bind_config(compose("train", stage_overrides("train", args.overrides)), "train")
        examples = held_out(train.train, train.seed).val[: args.n]
        return [(ex.ids, ex.prompt_len) for ex in examples]
    prompts = load_prompt_set(cfg.data, resolve_path(cfg.paths.cache_dir), shipped_benchmark)[-args.n:]
    return greedy_pairs(target, tok, [chat_prompt_ids(tok, p.messages) for p in prompts], args.max_new_tokens,
                        eos_ids(tok, target))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--method", default=ROLES["trays"], choices=[n for n, r in METHODS.items() if r.trays],
                    help="a method with trays (its tray knobs are the budget's)")
    ap.add_argument("--held-out", action="store_true",
                    help="calibrate on d3d.train's held-out responses (train.* overrides say which), not new ones")
    ap.add_argument("--n", type=int, default=6, help="calibration responses")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overlap", choices=["auto", "serial", "stream"], default="auto",
                    help="auto: the packed pass overlaps verification on CUDA, runs serially on CPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = bind_config(compose("generate", stage_overrides("generate", args.overrides)), "generate")
    _, tok, target = load_target(cfg.target, resolve_path(cfg.paths.cache_dir))
    drafter, _ = SavedDrafter.named(args.drafter, "--drafter").load(device=str(target.device), dtype=cfg.target.dtype)
    s = DrafterSettings.of(drafter)
    pairs = calibration(args, cfg, target, tok)
    overlap = target.device.type == "cuda" if args.overlap == "auto" else args.overlap == "stream"
    row = method_row(args.method)
    drafts = row.drafts(DecodeConfig(method=args.method, block_size=s.block_size), s.block_size, None)
    knobs = tuple(drafts.tray_grid[0])
    best, basis = calibrate(target, drafter, pairs, drafts, overlap, repeats=args.repeats)
    tau, costs, rounds = basis["tau"], basis["costs"], basis["rounds"]

    print(f"{cfg.target.name} target, drafter {args.drafter} (B = {s.block_size}), {target.device} {target.dtype}; "
          f"{len(pairs)} calibration responses, {rounds} rounds, τ {tau:.3f}; packed pass "
          f"{'overlapped' if overlap else 'serial'}")
    print(f"costs ms: step {costs['step_ms']:.1f}, verify {costs['verify_ms']:.1f}, draft {costs['draft_ms']:.1f}; "
          f"{row.reference} projected {best.sync_speedup:.3f}×\n")
    print(f"| {' | '.join(knobs)} | packed tokens | packed ms | hit rate | round ms | projected speedup |\n"
          f"|{'---|' * (len(knobs) + 5)}")
    for r in sorted(best.table, key=lambda r: tuple(r[k] for k in knobs)):
        setting = {k: r[k] for k in knobs}
        mark = " **chosen**" if best.trays and setting == best.settings else ""
        print(f"| {' | '.join(str(v) for v in setting.values())} | {row.budget(replace(drafts.cfg, **setting))} | "
              f"{r['packed_ms']:.1f} | {r['hit_rate']:.3f} | {r['round_ms']:.1f} | {r['projected_speedup']:.3f}×{mark} |")
    print(f"| no trays ({row.reference}) |{' |' * len(knobs)} 0.0 | — | {costs['draft_ms'] + costs['verify_ms']:.1f} | "
          f"{best.sync_speedup:.3f}×{'' if best.trays else ' **chosen**'} |")
    result = {"target": cfg.target.name, "drafter": args.drafter, "method": args.method, "block_size": s.block_size, "tau": tau,
              "rounds": rounds, "responses": len(pairs), "overlap": overlap, "costs": costs,
              "choice": best.as_dict(), "dtype": str(target.dtype), "run": run_info(target.device)}
    out = Path(args.out or f"outputs/bench/budget_{cfg.target.name}.json")
    write_json(out, result)
    print(f"\nchosen: {best.why}; written: {out}")
    return result


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
