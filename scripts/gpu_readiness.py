"""GPU readiness: time the real shapes with random weights, then project speedup from measured τ.

Speed does not depend on weight values, so random-weight Qwen3-8B/32B-shaped targets and
Qwen3-1.7B-shaped drafters time like the trained ones. This script measures, on one device:
1. verify latency: one target pass over B tokens after a cached prefix, for each block size B;
2. packed-pass latency: one drafter pass over B * ((C-1)*F + 2) tokens (d3d's real tray mask),
   for each budget C x F, and the synchronous draft of one block;
3. achieved overlap: the async loop (d3d.decoding.SpecGenerator) run for real on random prompts;
   overlap = (verify alone + packed alone - (verify in the loop + tray wait)) / min(both alone):
   1 = the packed pass hides completely behind verification, 0 = the two run one after the other;
4. projected speedup over AR for sync and each async budget, from τ and hit rates measured
   elsewhere (flags), with the round-time model of DESIGN §5.

    python scripts/gpu_readiness.py --target qwen3_32b --drafter qwen3_1p7b --tau 6.5 --hit-rate 0.6
    python scripts/gpu_readiness.py --target toy --drafter toy --device cpu   # what the tests run

Results: a printed table and a JSON file (default outputs/bench/gpu_readiness_<target>.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from d3d.utils.timing import timed

# Published Qwen3 shapes (config.json of each hub repo); "toy" runs in seconds on a CPU.
SHAPES = {
    "qwen3_32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3_1p7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512),
}


def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with device:  # initialise on the device: a 32B model never passes through host memory
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def as_drafter(model, block_size: int):
    """Give a random model d3d drafter settings (mask token = the last id)."""
    from d3d.models.drafter import DrafterSettings

    vocab = model.config.vocab_size
    DrafterSettings(block_size=block_size, mask_token_id=vocab - 1, vocab_size=vocab,
                    kept_layers=list(range(model.config.num_hidden_layers)), init="random",
                    target="random").attach(model)
    return model


@torch.inference_mode()
def verify_latency(target, prefix: int, block: int, device, repeats: int) -> float:
    from transformers import DynamicCache

    from d3d.models.drafter import cache_kwarg

    ids = torch.randint(0, target.config.vocab_size - 2, (1, prefix + block), device=device)
    cache = DynamicCache(config=target.config)
    target(ids[:, :prefix], use_cache=True, **cache_kwarg(target, cache))

    def one():
        target(ids[:, prefix:], use_cache=True, **cache_kwarg(target, cache))
        cache.crop(-block)  # back to the prefix

    return timed(one, device, repeats)


@torch.inference_mode()
def draft_latency(drafter, prefix: int, blocks: int, device, repeats: int) -> float:
    """One drafter pass of `blocks` mask blocks after a cached prefix (1 = a sync draft)."""
    from transformers import DynamicCache

    from d3d.models.drafter import DrafterSettings, hidden_states
    from d3d.models.masks import block_layout, clean_layout

    s = DrafterSettings.of(drafter)
    ids = torch.randint(0, s.vocab_size - 2, (1, prefix), device=device)
    cache = DynamicCache(config=drafter.config)
    hidden_states(drafter, ids, clean_layout(prefix), cache=cache)
    block = torch.full((1, blocks * s.block_size), s.mask_token_id, device=device)
    layout = block_layout(torch.full((1, blocks), prefix), s.block_size)

    def one():
        h = hidden_states(drafter, block, layout, cache=cache, cache_len=prefix)
        drafter.lm_head(h)  # the loop reads logits at every block slot
        cache.crop(-block.shape[1])  # back to the prefix

    return timed(one, device, repeats)


def loop_overlap(target, drafter, block: int, C: int, F: int, prefix: int, new_tokens: int, device) -> dict:
    """Run the real async loop on a random prompt; median verify, tray wait, draft per round."""
    from d3d.decoding import DecodeConfig, SpecGenerator

    class NoText:  # random ids have no text; the loop only needs decode() and an EOS id
        eos_token_id = -1

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return ""

    cfg = DecodeConfig(method="async", block_size=block, C=C, F=F, max_new_tokens=new_tokens)
    gen = SpecGenerator(target, NoText(), drafter, cfg, eos_token_ids=[])
    prompt = torch.randint(0, target.config.vocab_size - 2, (prefix,)).tolist()
    gen.generate([prompt], max_new_tokens=2 * block)  # warm-up
    res = gen.generate([prompt])
    med = lambda k: 1000 * statistics.median([r[k] for r in res.rounds if k in r] or [0.0])  # noqa: E731
    return {"rounds": len(res.rounds), "verify_in_loop_ms": med("verify_s"), "tray_wait_ms": med("tray_wait_s"),
            "sync_draft_ms": med("draft_s"), "round_ms": med("wall_s"), "hit_rate": res.hit_rate}


def project(tau: float, hit: float, t_ar: float, t_verify: float, t_draft: float, t_packed: float | None,
            overlap: float) -> float:
    """Speedup over AR: τ tokens per round; sync round = draft + verify; async round = verify and
    packed pass overlapped by `overlap`, plus a synchronous draft on every miss."""
    if t_packed is None:
        return tau * t_ar / (t_draft + t_verify)
    both = t_verify + t_packed - overlap * min(t_verify, t_packed)
    return tau * t_ar / (both + (1 - hit) * t_draft)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen3_8b", choices=sorted(SHAPES))
    p.add_argument("--drafter", default="qwen3_1p7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=1024, help="cached context before the timed pass")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--block-size", type=int, default=16, help="block size of the drafter and of the projections")
    p.add_argument("--budgets", nargs="+", default=["4x1", "8x2", "12x2", "16x2", "16x5"], help="C x F")
    p.add_argument("--loop-budget", default="12x2", help="C x F of the real async loop run (overlap)")
    p.add_argument("--loop-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tau", type=float, default=7.88, help="τ measured elsewhere (paper: 7.88, Qwen3-8B)")
    p.add_argument("--hit-rate", type=float, nargs="+", default=[0.5], help="hit rate per budget (one = all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B = args.block_size
    target = random_model(args.target, device, dtype, seed=0)
    drafter = as_drafter(random_model(args.drafter, device, dtype, seed=1), B)
    budgets = [tuple(int(x) for x in b.lower().split("x")) for b in args.budgets]
    hits = args.hit_rate * len(budgets) if len(args.hit_rate) == 1 else args.hit_rate
    if len(hits) != len(budgets):
        p.error("--hit-rate takes one value or one per --budgets entry")

    verify = {b: verify_latency(target, args.prefix, b, device, args.repeats) for b in sorted({*args.block_sizes, 1, B})}
    t_draft = draft_latency(drafter, args.prefix, 1, device, args.repeats)
    packed = {f"{C}x{F}": draft_latency(drafter, args.prefix, (C - 1) * F + 2, device, args.repeats) for C, F in budgets}
    lc, lf = (int(x) for x in args.loop_budget.lower().split("x"))
    loop = loop_overlap(target, drafter, B, lc, lf, args.prefix, args.loop_tokens, device)
    t_pack_loop = draft_latency(drafter, args.prefix, (lc - 1) * lf + 2, device, args.repeats)
    saved = verify[B] + t_pack_loop - (loop["verify_in_loop_ms"] + loop["tray_wait_ms"])
    overlap = max(0.0, min(1.0, saved / min(verify[B], t_pack_loop)))

    rows = [{"method": "sync", "budget_tokens": B, "packed_ms": None, "hit_rate": None,
             "projected_speedup": project(args.tau, 0.0, verify[1], verify[B], t_draft, None, overlap)}]
    for (C, F), hit in zip(budgets, hits):
        t_p = packed[f"{C}x{F}"]
        rows.append({"method": f"async C={C} F={F}", "budget_tokens": B * ((C - 1) * F + 2), "packed_ms": t_p,
                     "hit_rate": hit, "projected_speedup": project(args.tau, hit, verify[1], verify[B], t_draft, t_p, overlap)})
    result = {"target": args.target, "drafter": args.drafter, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "prefix": args.prefix, "block_size": B, "tau_assumed": args.tau,
              "verify_ms": verify, "sync_draft_ms": t_draft, "packed_ms": packed, "loop": loop,
              "loop_budget": args.loop_budget, "packed_loop_ms": t_pack_loop, "overlap": overlap, "projection": rows}
    out = Path(args.out or f"outputs/bench/gpu_readiness_{args.target}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{args.target} target, {args.drafter} drafter, {result['device_name']}, {args.dtype}, prefix {args.prefix}")
    print("verify ms by block size: " + ", ".join(f"B={b}: {t:.2f}" for b, t in verify.items()))
    print(f"sync draft ms (one block of {B}): {t_draft:.2f}")
    print(f"async loop ({args.loop_budget}): verify {loop['verify_in_loop_ms']:.2f} ms in the loop vs "
          f"{verify[B]:.2f} alone, tray wait {loop['tray_wait_ms']:.2f} ms, packed alone {t_pack_loop:.2f} ms "
          f"-> overlap {overlap:.2f}")
    print(f"\n| method | packed tokens | packed ms | hit rate | projected speedup (τ = {args.tau}) |\n|---|---|---|---|---|")
    for r in rows:
        pm = "—" if r["packed_ms"] is None else f"{r['packed_ms']:.2f}"
        hr = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        print(f"| {r['method']} | {r['budget_tokens']} | {pm} | {hr} | {r['projected_speedup']:.2f}× |")
    print(f"\nwritten: {out}")
    return result


if __name__ == "__main__":
    main()
