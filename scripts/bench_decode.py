"""Decoding speed on one CPU/GPU: our AR loop, sync, tree and async speculative decoding, against
transformers' generate (greedy), assisted generation and prompt-lookup decoding — same target,
same prompts, one process, greedy, batch 1.

    python scripts/bench_decode.py --drafter checkpoints/cpu_default_lam1/final \
        --n-prompts 8 --max-new-tokens 128 --budgets 4x1 8x2 12x2
    # trees of drafts at verify widths 8 and 16 beside the chain, and an async tree (15 nodes, 23 trays)
    python scripts/bench_decode.py --drafter <folder> --block-sizes 16 8 --trees 7 15 --async-trees 15x23
    # the cpu_qwen pair: 1.5B target, the 0.5B model as the assisted-generation assistant
    python scripts/bench_decode.py --drafter <trained 0.5B drafter> --assistant qwen25_coder_05b \
        --block-sizes 4 8 16 target=qwen25_coder_15b
    # our loops eager and compiled (static KV buffers + torch.compile), side by side
    python scripts/bench_decode.py --drafter checkpoints/cpu_default_lam1/final --backends eager compiled

Methods run interleaved: every method on one prompt, then the next prompt. Per method and prompt: wall time of the whole call (prefill included, as generate reports it
that way too), new tokens, τ and hit rate for our loops, and whether the tokens equal generate's.
One warm-up call per method on a prompt outside the set. Prints a markdown table of medians and
writes outputs/bench/decode_<target>.json (every row) and .md (the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from d3d.config import compose, resolve_path
from d3d.settings import bind_config, check_decode_cost, shipped_benchmark
from d3d.data.benchmarks import first_turn_messages, load_benchmark
from d3d.data.chat import chat_prompt_ids, eos_ids
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.kv import BACKENDS
from d3d.decoding.methods import method_row
from d3d.models import load_model, load_target, resolve_model_path
from d3d.models.drafter import check_fits_target, load_drafter
from d3d.utils.io import write_json
from d3d.utils.runinfo import run_info


def hf_call(target, tok, eos, **kw):
    def run(ids, n):
        out = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id, **kw)
        new = out[0, len(ids):].tolist()
        return new, {}
    return run


def our_call(gen: SpecGenerator):
    def run(ids, n):
        res = gen.generate([ids], max_new_tokens=n)
        mean = lambda key: statistics.mean(getattr(r, key) or 0.0 for r in res.rounds)
        # where a round's time goes: synchronous drafting, verification, waiting for the trays
        return res.token_ids[0], {"tau": res.mean_tau, "hit_rate": res.hit_rate, "prefill_s": res.prefill_s,
                                  "decode_s": res.decode_s, "rounds": len(res.rounds),
                                  "round_ms": 1000 * mean("wall_s"), "draft_ms": 1000 * mean("draft_s"),
                                  "verify_ms": 1000 * mean("verify_s"), "tray_ms": 1000 * mean("tray_s"),
                                  "tray_wait_ms": 1000 * mean("tray_wait_s")}
    return run


def pass_cost(model, prompt: list[int], widths: list[int], repeats: int = 5) -> dict[int, float]:
    """Median ms of one cached forward of `width` new tokens after `prompt`, lm_head excluded (the
    verify pass at B = width; for the drafter, its draft pass): on a CPU the price of a wider block
    decides the break-even τ (a sync round costs draft(B) + verify(B) and yields τ tokens, AR yields 1)."""
    from d3d.decoding.budget import clean_pass_ms

    ids = torch.tensor([prompt], device=model.device)
    return {w: clean_pass_ms(model, ids, w, repeats, logits=False) for w in widths}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a trained drafter folder (save_pretrained)")
    ap.add_argument("--also-drafters", nargs="*", default=[], metavar="LABEL=FOLDER",
                    help="more drafters (e.g. unpruned=<folder>) whose sync and tree rows run beside --drafter's, "
                         "interleaved on the same prompts; their rows are named <method>@<label>")
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16],
                    help="sync at each of these B; async uses the first")
    ap.add_argument("--assistant", default=None,
                    help="target config (conf/target/<name>) for hf_assisted; default: a copy of the target")
    ap.add_argument("--budgets", nargs="*", default=["4x1", "8x2", "12x2"], help="async C x F pairs")
    ap.add_argument("--trees", type=int, nargs="*", default=[],
                    help="decode.method=tree with these node counts (verify width = nodes + 1), on the first block size")
    ap.add_argument("--async-trees", nargs="*", default=[],
                    help="decode.method=async_tree as NODESxTRAYS pairs (e.g. 15x23), on the first block size")
    ap.add_argument("--overlap", default="auto", help="async overlap: auto (stream on GPU, serial on CPU), thread, none")
    ap.add_argument("--backends", nargs="+", default=["eager"], choices=BACKENDS,
                    help="our loops once per decode.backend (rows of the others are tagged [backend])")
    ap.add_argument("--no-hf-baselines", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="run only these method names (prefix match); d3d_ar always runs as the baseline")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = bind_config(compose("eval", args.overrides), "eval")
    cache = resolve_path(cfg.paths.cache_dir)
    budgets = [tuple(int(x) for x in b.split("x")) for b in args.budgets]
    async_trees = [tuple(int(x) for x in t.split("x")) for t in args.async_trees]
    # our speculative settings by row name, each checked against this device's memory before the models load
    B0, overlap = args.block_sizes[0], args.overlap
    ours = {**{f"d3d_sync_b{B}": DecodeConfig(method="sync", block_size=B) for B in args.block_sizes},
            **{f"d3d_tree_n{n}": DecodeConfig(method="tree", block_size=B0, tree_nodes=n) for n in args.trees},
            **{f"d3d_async_c{C}_f{F}": DecodeConfig(method="async", block_size=B0, C=C, F=F, overlap=overlap)
               for C, F in budgets},
            **{f"d3d_async_tree_n{n}_t{t}": DecodeConfig(method="async_tree", block_size=B0, tree_nodes=n, tree_trays=t,
                                                         overlap=overlap) for n, t in async_trees}}
    check_decode_cost({k: replace(dc, max_new_tokens=args.max_new_tokens) for k, dc in ours.items()},
                      cfg.target, replace(cfg.drafter, checkpoint=args.drafter), cache)
    path, tok, target = load_target(cfg.target, cache)
    drafter, drafter_tok = load_drafter(args.drafter, device=str(target.device), dtype=cfg.target.dtype)
    for warning in check_fits_target(drafter, drafter_tok, target, tok, cfg.target.name):
        print(f"warning: {warning}", flush=True)
    also = {}
    for item in args.also_drafters:
        label, _, folder = item.partition("=")
        if not folder:
            raise SystemExit(f"error: --also-drafters {item!r}: write LABEL=FOLDER, e.g. unpruned=checkpoints/x/final")
        also[label] = load_drafter(folder, device=str(target.device), dtype=cfg.target.dtype)[0]
    eos = eos_ids(tok, target)
    spec = shipped_benchmark(args.benchmark)
    records = load_benchmark(spec, cache, n=args.n_prompts + 1)
    prompts = [chat_prompt_ids(tok, first_turn_messages(spec, r)) for r in records]
    warm, prompts = prompts[0], prompts[1:]

    widths = sorted({1, 2, 4, 8, 16, *args.block_sizes})
    cost = {"target_ms": pass_cost(target, warm, widths), "drafter_ms": pass_cost(drafter, warm, widths),
            **{f"drafter_ms@{label}": pass_cost(d, warm, widths) for label, d in also.items()}}
    others = [k for k in cost if k.startswith("drafter_ms@")]
    cost_lines = ["| tokens in the pass | target ms | × target(1) | drafter ms | × target(1) |"
                  + "".join(f" {k[len('drafter_ms@'):]} drafter ms |" for k in others), "|---|---|---|---|---|" + "---|" * len(others)]
    t1 = cost["target_ms"][1]
    for w in widths:
        cost_lines.append(f"| {w} | {cost['target_ms'][w]:.0f} | {cost['target_ms'][w] / t1:.2f} | "
                          f"{cost['drafter_ms'][w]:.0f} | {cost['drafter_ms'][w] / t1:.2f} |"
                          + "".join(f" {cost[k][w]:.0f} |" for k in others))
    print("\n".join(cost_lines), flush=True)

    # transformers' baselines first, our loops after, async last: an overlap=thread run must not
    # touch the timing of anything else in the process
    methods = {}
    if not args.no_hf_baselines:
        methods["hf_generate"] = hf_call(target, tok, eos)
        if args.assistant:  # an AR assistant of about the drafter's cost (e.g. the 0.5B for the 1.5B)
            a_cfg = bind_config(compose("eval", [f"target={args.assistant}"]), "eval").target
            assistant, a_name = load_model(resolve_model_path(a_cfg, cache), a_cfg.dtype, "auto"), args.assistant
        else:  # an AR copy of the target: a full-copy drafter's cost
            assistant, a_name = load_model(path, cfg.target.dtype, "auto"), "copy"
        methods[f"hf_assisted({a_name})"] = hf_call(target, tok, eos, assistant_model=assistant)
        methods["hf_prompt_lookup"] = hf_call(target, tok, eos, prompt_lookup_num_tokens=10)
    for backend in args.backends:  # eager first: d3d_ar (eager) is the reference for the others
        tag = "" if backend == "eager" else f"[{backend}]"
        methods[f"d3d_ar{tag}"] = our_call(SpecGenerator(target, tok, None, DecodeConfig(method="ar", backend=backend), eos))
        # methods without trays first, those with trays last (see above); a tree runs on the eager backend only
        for name, dc in sorted(ours.items(), key=lambda kv: method_row(kv[1].method).trays):
            row = method_row(dc.method)
            if backend in row.backends:
                packed = f"({row.budget(dc)}tok)" if row.budget(dc) else ""
                methods[f"{name}{packed}{tag}"] = our_call(SpecGenerator(target, tok, drafter, replace(dc, backend=backend), eos))
                for label, other in also.items():  # the same method with another drafter (those without trays)
                    if not row.trays:
                        methods[f"{name}{packed}{tag}@{label}"] = our_call(
                            SpecGenerator(target, tok, other, replace(dc, backend=backend), eos))

    if args.only:  # d3d_ar always stays: ratios and the equality check need a baseline
        methods = {k: v for k, v in methods.items() if k == "d3d_ar" or any(k.startswith(p) for p in args.only)}
    out = Path(args.out or f"outputs/bench/decode_{cfg.target.name}.json")
    partial = out.with_suffix(".partial.json")
    rows, reference, warmup_s = [], {}, {}
    for name, run in methods.items():
        # warm-up, outside the timing. A static backend warms up on the longest prompt for as many
        # tokens as the timed calls: its buffers then fit every timed call (a pool keeps the largest),
        # so no timed call compiles; compile time is reported apart
        start = time.perf_counter()
        if "[" in name:
            run(max(prompts + [warm], key=len), args.max_new_tokens)
        else:
            run(warm, 16)
        warmup_s[name] = time.perf_counter() - start
    # interleaved: every method on prompt i before any on prompt i+1, so a change in the machine's
    # load (another process, a thermal step) lands on all methods alike, not on the last ones run
    for i, ids in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        for name, run in methods.items():
            start = time.perf_counter()
            new, extra = run(ids, args.max_new_tokens)
            wall = time.perf_counter() - start
            if name in ("hf_generate", "d3d_ar") and i not in reference:
                reference[i] = new
            rows.append({"method": name, "prompt": i, "new_tokens": len(new), "wall_s": wall,
                         "tokens_per_s": len(new) / wall, "equal_to_reference": new == reference.get(i), **extra})
        write_json(partial, {"rows": rows})  # a long run killed midway keeps its finished prompts

    def med(name, key):
        vals = [r[key] for r in rows if r["method"] == name and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    base = "hf_generate" if "hf_generate" in methods else "d3d_ar"
    base_tps = med(base, "tokens_per_s")
    # The τ a method would need to match the baseline, per prompt (the interleaved pair), median over
    # prompts: tokens/s = τ / round time, so τ_even = τ · base tok/s / method tok/s. It assumes the
    # round's cost does not move with τ (and, for async, that the hit rate does not either): a projection
    # from measured rounds, not a measurement; what a drafter must reach for speculation to pay here.
    base_by_prompt = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == base}
    for r in rows:
        if r.get("tau") is not None:
            r["tau_to_match_base"] = r["tau"] * base_by_prompt[r["prompt"]] / r["tokens_per_s"]
    table = [f"| method | tokens/s (median) | × {base} | τ | τ to match {base} | hit rate | equal to {base} "
             "| round ms (draft / verify / tray wait) | drafter share of the round | warm-up s (compile) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for name in methods:
        tps = med(name, "tokens_per_s")
        eq = [r["equal_to_reference"] for r in rows if r["method"] == name]
        entry = {"method": name, "tokens_per_s": tps, "ratio": tps / base_tps, "tau": med(name, "tau"),
                 "tau_to_match_base": med(name, "tau_to_match_base"), "base": base,
                 "hit_rate": med(name, "hit_rate"), "equal_rate": sum(eq) / len(eq), "warmup_s": warmup_s[name]}
        summary.append(entry)
        fmt = lambda v: "—" if v is None else f"{v:.2f}"
        split = "—" if med(name, "round_ms") is None else (
            f"{med(name, 'round_ms'):.0f} ({med(name, 'draft_ms'):.0f} / {med(name, 'verify_ms'):.0f} / "
            f"{med(name, 'tray_wait_ms'):.0f})")
        # the drafter's share of a round: what a cheaper (pruned) drafter can win back
        share = [r["draft_ms"] / r["round_ms"] for r in rows if r["method"] == name and r.get("round_ms")]
        entry["drafter_share"] = statistics.median(share) if share else None
        table.append(f"| {name} | {tps:.1f} | {entry['ratio']:.2f} | {fmt(entry['tau'])} | {fmt(entry['tau_to_match_base'])} "
                     f"| {fmt(entry['hit_rate'])} "
                     f"| {entry['equal_rate']:.2f} | {split} | {fmt(entry['drafter_share'])} | {warmup_s[name]:.1f} |")
    text = "\n".join(table) + "\n\nOne cached forward pass through the decoder layers, lm_head excluded (after the warm-up prompt, medians):\n\n" + "\n".join(cost_lines)
    print(text)
    write_json(out, {"summary": summary, "rows": rows, "args": vars(args), "target": cfg.target.name,
                     "dtype": str(target.dtype), "pass_cost": cost, "run": run_info(target.device)})
    out.with_suffix(".md").write_text(text + "\n")
    partial.unlink(missing_ok=True)
    return {"summary": summary, "rows": rows, "pass_cost": cost}


if __name__ == "__main__":
    main()
