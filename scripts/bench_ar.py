"""Plain decoding, ours against transformers' `generate`: interleaved repeats in one process.

    python scripts/bench_ar.py --backends eager compiled --tokens 48 --repeats 7
    python scripts/bench_ar.py target=qwen25_coder_15b --tokens 32

Whole-call time per token (prefill included on both sides) for `generate` (greedy, exactly
`--tokens` new tokens) and for d3d's AR loop on each `decode.backend`, one prompt, the methods
taking turns within every repeat, so a slow stretch of a shared machine hits all of them alike.
Every call's tokens must equal `generate`'s. Warm-up (compile time for `compiled`) is reported apart.
Prints a table of medians and ratios; writes outputs/bench/ar_<target>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from d3d.config import compose, resolve_path
from d3d.settings import bind_config, shipped_benchmark
from d3d.data.benchmarks import first_turn_messages, load_benchmark
from d3d.data.chat import chat_prompt_ids
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.kv import BACKENDS
from d3d.models import load_target
from d3d.utils.io import write_json
from d3d.utils.runinfo import run_info


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmark", default="gsm8k", help="the prompt: this benchmark's first item")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backends", nargs="+", default=["eager", "compiled"], choices=BACKENDS)
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = bind_config(compose("eval", args.overrides), "eval")
    cache = resolve_path(cfg.paths.cache_dir)
    _, tok, target = load_target(cfg.target, cache)
    spec = shipped_benchmark(args.benchmark)
    prompt = chat_prompt_ids(tok, first_turn_messages(spec, load_benchmark(spec, cache, n=1)[0]))
    ids = torch.tensor([prompt], device=target.device)

    def hf() -> list[int]:
        with torch.inference_mode():  # exactly --tokens new tokens: no EOS may end it early
            out = target.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
        return out[0, len(prompt):].tolist()

    calls = {"hf_generate": hf}
    for backend in args.backends:
        gen = SpecGenerator(target, tok, None, DecodeConfig(method="ar", backend=backend), eos_token_ids=[])
        calls[f"d3d_ar[{backend}]"] = lambda gen=gen: gen.generate([prompt], max_new_tokens=args.tokens).token_ids[0]

    warmup_s, times, equal = {}, {name: [] for name in calls}, {name: [] for name in calls}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        warmup_s[name] = time.perf_counter() - start
        print(f"warm-up {name}: {warmup_s[name]:.1f} s", flush=True)
    for rep in range(args.repeats):
        reference = None
        for name, call in calls.items():
            start = time.perf_counter()
            new = call()
            times[name].append(time.perf_counter() - start)
            reference = new if reference is None else reference
            equal[name].append(new == reference)
        print(f"repeat {rep + 1}/{args.repeats}", flush=True)

    ms = {name: 1000 * statistics.median(t) / args.tokens for name, t in times.items()}
    rows = [{"method": name, "ms_per_token": ms[name], "x_generate": ms["hf_generate"] / ms[name],
             "equal_rate": sum(equal[name]) / len(equal[name]), "warmup_s": warmup_s[name],
             "per_repeat_s": times[name]} for name in calls]
    table = [f"| method | ms/token (median of {args.repeats}) | × hf_generate | equal to generate | warm-up s |",
             "|---|---|---|---|---|"]
    table += [f"| {r['method']} | {r['ms_per_token']:.1f} | {r['x_generate']:.3f} | {r['equal_rate']:.2f} | "
              f"{r['warmup_s']:.1f} |" for r in rows]
    text = "\n".join(table)
    print(text)
    out = Path(args.out or f"outputs/bench/ar_{cfg.target.name}.json")
    write_json(out, {"rows": rows, "args": vars(args), "target": cfg.target.name, "dtype": str(target.dtype),
                     "prompt_tokens": len(prompt), "run": run_info(target.device)})
    out.with_suffix(".md").write_text(text + "\n")
    return {"rows": rows}


if __name__ == "__main__":
    main()
