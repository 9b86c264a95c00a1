"""GPU readiness: time the real shapes with random weights, then project speedup from measured τ.

Speed does not depend on weight values, so random-weight Qwen3-8B/32B-shaped targets and
Qwen3-1.7B-shaped drafters (tied embeddings, as the released 1.7B) time like the trained ones.
This script measures, on one device, at a 2k-token context by default:
1. verify latency: one target pass over B tokens after a cached prefix, for each block size B;
2. packed-pass latency: one drafter pass over B * ((C-1)*F + 2) tokens (d3d's real tray mask),
   for each budget C x F, and the synchronous draft of one block;
3. the real loops (d3d.decoding.SpecGenerator): AR, sync, and async at each budget, on a random
   prompt of the prefix length: per round, the host wall time next to the passes' CUDA-event
   times (the difference is the engine's per-round overhead);
4. projected speedup over AR for sync and each async budget from those *measured round times*:
   sync = τ · t_AR / t_sync; async = τ · t_AR / (h · t_hit + (1 − h) · t_miss) with the budget's
   own hit rate h (flags; defaults are the paper's AIME25 budget study), t_miss the measured
   async round (random weights: every round misses) and t_hit = t_miss − the draft pass it skips;
   overlap = (verify alone + packed alone − t_hit) / min(both alone), clipped to [0, 1].
The JSON file is rewritten after every stage, so a crash or a timeout keeps what finished.

    python scripts/gpu_readiness.py --target qwen3_8b --drafter qwen3_1p7b --tau 7.88
    python scripts/gpu_readiness.py --target toy --drafter toy --device cpu   # what the tests run

Results: a printed table and a JSON file (default outputs/bench/gpu_readiness_<target>.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

from d3d.models.random_models import SHAPES, NoText, as_drafter, random_model  # noqa: E402,F401 (the checks use them too)


def verify_latency(target, prefix: int, block: int, device, repeats: int) -> float:
    """One target pass over `block` tokens after a cached random prefix, logits included."""
    from d3d.decoding.budget import clean_pass_ms

    ids = torch.randint(0, target.config.vocab_size - 2, (1, prefix), device=device)
    return clean_pass_ms(target, ids, block, repeats)


def draft_latency(drafter, prefix: int, blocks: int, device, repeats: int) -> float:
    """One drafter pass of `blocks` mask blocks after a cached random prefix (1 = a sync draft)."""
    from d3d.decoding.budget import block_pass_ms

    ids = torch.randint(0, drafter.config.d3d["vocab_size"] - 2, (1, prefix), device=device)
    return block_pass_ms(drafter, ids, blocks, repeats)


def loop_rounds(target, drafter, cfg, prefix: int, new_tokens: int, device) -> dict:
    """Run one of the real loops on a random prompt: medians per round of the host wall time and
    of each pass's device time (CUDA events; wall time on CPU), and their difference."""
    from d3d.decoding import SpecGenerator

    gen = SpecGenerator(target, NoText(), None if cfg.method == "ar" else drafter, cfg, eos_token_ids=[])
    prompt = torch.randint(0, target.config.vocab_size - 2, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    # warm-up; a static backend's warm-up decodes as many tokens, so its buffers (and compiled
    # shapes) are the timed call's
    gen.generate([prompt], max_new_tokens=new_tokens if cfg.backend != "eager" else min(new_tokens, 2 * cfg.block_size))
    res = gen.generate([prompt], max_new_tokens=new_tokens)
    med = lambda k: 1000 * statistics.median([r[k] for r in res.rounds if k in r] or [0.0])  # noqa: E731
    out = {"rounds": len(res.rounds), "tau": res.mean_tau, "hit_rate": res.hit_rate, "round_wall_ms": med("wall_s"),
           "verify_ms": med("verify_s"), "draft_ms": med("draft_s"), "tray_ms": med("tray_s")}
    # the device's critical path of a round: draft, then verify (the tray pass runs beside verify)
    out["overhead_ms"] = out["round_wall_ms"] - out["draft_ms"] - out["verify_ms"]
    return out


def project(tau: float, hit: float | None, t_ar: float, t_sync: float | None = None, t_miss: float | None = None,
            t_hit: float | None = None) -> float:
    """Speedup over AR from measured round times (ms): τ tokens per round against one per AR round."""
    if hit is None:
        return tau * t_ar / t_sync
    return tau * t_ar / (hit * t_hit + (1 - hit) * t_miss)


class Results(dict):
    """The result dict, rewritten to its JSON file after every stage (and handed to `on_stage`,
    so the GPU check records each stage in its own JSON as it lands)."""

    def __init__(self, path: Path, on_stage=None, **kw):
        super().__init__(**kw)
        self.path, self.on_stage = path, on_stage
        path.parent.mkdir(parents=True, exist_ok=True)

    def stage(self, name: str, value) -> None:
        self[name] = value
        self.setdefault("stages_done", []).append(name)
        self.path.write_text(json.dumps(self, indent=2, default=str))
        if self.on_stage is not None:
            self.on_stage(name, value)
        print(f"[gpu_readiness] {name} done", flush=True)


def main(argv: list[str] | None = None, on_stage=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen3_8b", choices=sorted(SHAPES))
    p.add_argument("--drafter", default="qwen3_1p7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=2048, help="cached context before the timed passes (2-4k is typical)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--block-size", type=int, default=16, help="block size of the drafter and of the projections")
    p.add_argument("--budgets", nargs="+", default=["12x2", "16x2", "12x5"], help="C x F")
    p.add_argument("--loop-tokens", type=int, default=64, help="tokens each real loop decodes (random weights: τ = 1)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tau", type=float, default=7.88, help="τ measured elsewhere (paper: 7.88, Qwen3-8B)")
    p.add_argument("--hit-rate", type=float, nargs="+", default=[0.713, 0.783, 0.818],
                   help="one hit rate per --budgets entry (defaults: the paper's AIME25 study, B = 16)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B = args.block_size
    budgets = [tuple(int(x) for x in b.lower().split("x")) for b in args.budgets]
    if len(args.hit_rate) != len(budgets):  # a budget's hit rate is its own: never one for all
        p.error(f"--hit-rate takes one value per --budgets entry ({len(budgets)} budgets, {len(args.hit_rate)} rates)")
    from d3d.decoding import DecodeConfig
    from d3d.decoding.budget import packed_blocks

    res = Results(Path(args.out or f"outputs/bench/gpu_readiness_{args.target}.json"), on_stage,
                  target=args.target, drafter=args.drafter, device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, prefix=args.prefix, block_size=B, tau_assumed=args.tau,
                  budgets=args.budgets, hit_rates=args.hit_rate)
    target = random_model(args.target, device, dtype, seed=0)
    drafter = as_drafter(random_model(args.drafter, device, dtype, seed=1), B)
    res.stage("verify_ms", {b: verify_latency(target, args.prefix, b, device, args.repeats)
                            for b in sorted({*args.block_sizes, 1, B})})
    res.stage("sync_draft_ms", draft_latency(drafter, args.prefix, 1, device, args.repeats))
    res.stage("packed_ms", {f"{C}x{F}": draft_latency(drafter, args.prefix, packed_blocks(B, C, F), device, args.repeats)
                            for C, F in budgets})
    loops = {}
    for name, cfg in [("ar", DecodeConfig(method="ar")), ("sync", DecodeConfig(method="sync", block_size=B))] + \
            [(f"async_{C}x{F}", DecodeConfig(method="async", block_size=B, C=C, F=F)) for C, F in budgets]:
        loops[name] = loop_rounds(target, drafter, cfg, args.prefix, args.loop_tokens, device)
        res.stage("loops", loops)

    t_ar, t_sync = loops["ar"]["round_wall_ms"], loops["sync"]["round_wall_ms"]
    rows = [{"method": "sync", "budget_tokens": B, "hit_rate": None, "round_ms": t_sync, "hit_round_ms": None,
             "overlap": None, "projected_speedup": project(args.tau, None, t_ar, t_sync)}]
    for (C, F), hit in zip(budgets, args.hit_rate):
        lp = loops[f"async_{C}x{F}"]
        t_miss = lp["round_wall_ms"]
        t_hit = max(t_miss - lp["draft_ms"], 1e-9)  # a hit skips the synchronous draft
        v, pk = res["verify_ms"][B], res["packed_ms"][f"{C}x{F}"]
        overlap = max(0.0, min(1.0, (v + pk - t_hit) / min(v, pk)))
        rows.append({"method": f"async C={C} F={F}", "budget_tokens": B * packed_blocks(B, C, F), "hit_rate": hit,
                     "round_ms": t_miss, "hit_round_ms": t_hit, "overlap": overlap,
                     "projected_speedup": project(args.tau, hit, t_ar, t_miss=t_miss, t_hit=t_hit)})
    res.stage("projection", rows)

    print(f"{args.target} target, {args.drafter} drafter, {res['device_name']}, {args.dtype}, prefix {args.prefix}")
    print("verify ms by block size: " + ", ".join(f"B={b}: {t:.2f}" for b, t in res["verify_ms"].items()))
    print(f"sync draft ms (one block of {B}): {res['sync_draft_ms']:.2f}; packed ms: "
          + ", ".join(f"{k}: {t:.2f}" for k, t in res["packed_ms"].items()))
    print("\n| loop | round wall ms | draft ms | verify ms | tray ms | overhead ms |\n|---|---|---|---|---|---|")
    for name, lp in loops.items():
        print(f"| {name} | {lp['round_wall_ms']:.2f} | {lp['draft_ms']:.2f} | {lp['verify_ms']:.2f} | "
              f"{lp['tray_ms']:.2f} | {lp['overhead_ms']:.2f} |")
    print(f"\n| method | packed tokens | hit rate | round ms (miss / hit) | overlap | projected speedup (τ = {args.tau}) |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        hr = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        rt = f"{r['round_ms']:.2f}" + ("" if r["hit_round_ms"] is None else f" / {r['hit_round_ms']:.2f}")
        ov = "—" if r["overlap"] is None else f"{r['overlap']:.2f}"
        print(f"| {r['method']} | {r['budget_tokens']} | {hr} | {rt} | {ov} | {r['projected_speedup']:.2f}× |")
    print(f"\nwritten: {res.path}")
    return res


if __name__ == "__main__":
    main()
