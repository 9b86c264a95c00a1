"""Data time per training step and padding share, today's input pipeline against the one before it.

    python scripts/bench_data.py [--sizes 100000 800000] [--work outputs/bench/data] [--steps 40]

On synthetic responses (log-normal prompt and reply lengths, the long tail of chat replies) written
once into --work: per size, the time to read the responses folder (jsonl parsed into Python lists
before; the Arrow cache built once, then memory-mapped), the resident memory that adds, the data
time of one rank's optimizer step at the qwen3_8b overlay's batch (8 ranks x batch 8 x accumulation
4, max_len 3072, 32 anchors, block 16) and the padding share of its packed micro-batches. The
"before" functions are the main branch's (`git show <--before>:src/d3d/training.py` and its
objective.pack), run over the same set. The goal (docs/design.md, Training): data time <= 5 % of an estimated H100 step,
padding <= 15 %. Writes docs/results/data_pipeline_<cpu>.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from d3d.examples import StepBatches, StepLoader, load_examples
from d3d.objective import ObjectiveConfig, PackedBatch

# the qwen3_8b overlay (conf/experiment/qwen3_8b.yaml; drafter qwen3_1p7b, block 16) on one 8-GPU node
OVERLAY = {"ranks": 8, "batch_size": 8, "grad_accum": 4, "max_len": 3072, "anchors_per_seq": 32, "block_size": 16}
DRAFTER_PARAMS = 1.7e9  # Qwen3-1.7B
H100_BF16_FLOPS = 400e12  # effective dense bf16 throughput of an H100 SXM in a training step (~40 % of peak)
# synthetic lengths: log-normal (median, sigma) of prompt and reply, replies capped at generate.max_new_tokens
PROMPT, REPLY, MAX_NEW = (120, 0.8), (350, 1.0), 2048


def synthetic_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(PROMPT[0]), PROMPT[1], n), 4, 1024).astype(int)
    reply = np.clip(rng.lognormal(np.log(REPLY[0]), REPLY[1], n), 2, MAX_NEW).astype(int)
    return prompt, reply


def write_synthetic_responses(folder: Path, n: int, seed: int = 0, shards: int = 2) -> Path:
    """A responses folder as d3d.generate writes it (`responses.rank<r>.jsonl`), with n rows of
    random token ids at synthetic lengths; kept if already complete."""
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "complete"
    if done.is_file() and done.read_text() == str(n):
        return folder
    prompt, reply = synthetic_lengths(n, seed)
    rng = np.random.default_rng(seed + 1)
    for r in range(shards):
        with open(folder / f"responses.rank{r}.jsonl", "w", encoding="utf-8") as f:
            for i in range(r, n, shards):
                toks = rng.integers(0, 150_000, prompt[i] + reply[i]).tolist()
                f.write(json.dumps({"id": f"s{i:07d}", "prompt_ids": toks[: prompt[i]], "response_ids": toks[prompt[i]:],
                                    "settings": {"backend": "hf"}}) + "\n")
    done.write_text(str(n))
    return folder


def padding_share(batches: list[PackedBatch]) -> float:
    """Share of the packed rows' slots that are padding (the forward's wasted tokens)."""
    slots = sum(b.input_ids.numel() for b in batches)
    return 1 - sum(b.n_tokens for b in batches) / slots


def rss_gib() -> float:
    """This process's anonymous resident memory now (Linux), GiB: the set held as Python objects
    counts, the memory-mapped cache's pages (the page cache, shared by every rank) do not."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 2**20


def module_at(ref: str, path: str):
    """A module of d3d as it is at git `ref` (the functions before this change), by its file path."""
    source = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True).stdout
    name = Path(path).stem + "_before"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def h100_step_s(tokens_per_rank: float) -> float:
    """6 x params x tokens of one rank's step (forward and backward, attention and the recompute of
    gradient checkpointing left out: a shorter step, so a stricter goal) at H100_BF16_FLOPS."""
    return 6 * DRAFTER_PARAMS * tokens_per_rank / H100_BF16_FLOPS


def bench_size(n: int, work: Path, before, before_pack, steps: int, workers: int) -> dict:
    folder = write_synthetic_responses(work / f"n{n}", n)
    o = OVERLAY
    objective = ObjectiveConfig.shipped(o["block_size"], anchors_per_seq=o["anchors_per_seq"])
    per_step = o["ranks"] * o["batch_size"] * o["grad_accum"]
    out: dict = {"responses": n, "load_average_start": os.getloadavg()[0]}

    # reading the folder
    (folder / "examples.arrow").unlink(missing_ok=True)
    t0 = time.perf_counter()
    load_examples(folder, o["max_len"])
    out["load_new_first_s"] = time.perf_counter() - t0  # builds the Arrow cache
    gc.collect()
    rss0, t0 = rss_gib(), time.perf_counter()
    train = load_examples(folder, o["max_len"])
    out["load_new_s"], out["rss_new_gib"] = time.perf_counter() - t0, rss_gib() - rss0
    if n <= 200_000:  # the lists of ints before: ~36 bytes a token, too many for this machine at 800k
        gc.collect()
        rss0, t0 = rss_gib(), time.perf_counter()
        old = before.load_examples(folder, o["max_len"])
        out["load_before_s"], out["rss_before_gib"] = time.perf_counter() - t0, rss_gib() - rss0
        del old
        gc.collect()

    def rank0_step_before(step: int) -> list[PackedBatch]:  # main's TrainRecipe.micro_batches on rank 0
        return [before_pack(before.batch_at(train, step, m, per_step, o["batch_size"], 0, 0, o["ranks"]), objective, 1, 0,
                     torch.Generator().manual_seed(step * 4_099 + m * o["ranks"])) for m in range(o["grad_accum"])]

    def timed_steps(make, count: int) -> tuple[list[float], list[PackedBatch]]:
        times, batches = [], []
        for step in range(count):
            t0 = time.perf_counter()
            batches += make(step)
            times.append(time.perf_counter() - t0)
        return times, batches

    old_times, old_batches = timed_steps(rank0_step_before, max(2, steps // 10 if n > 200_000 else steps // 4))
    out["step_before_s"] = statistics.mean(old_times)
    out["padding_before"] = padding_share(old_batches)

    def new_batches(grouping: int) -> StepBatches:
        return StepBatches(train, objective, 1, 0, 0, o["batch_size"], o["grad_accum"], grouping, 10**6, 0, o["ranks"])

    grouped = new_batches(64)
    times, batches = timed_steps(lambda s: grouped[s], steps)
    out["step_new_first_s"], out["step_new_s"] = times[0], statistics.mean(times[1:])  # the first computes the epoch order
    out["padding_new"] = padding_share(batches)
    out["tokens_per_rank_step"] = sum(b.input_ids.numel() for b in batches) / steps
    out["h100_step_s"] = h100_step_s(out["tokens_per_rank_step"])

    # the loop's wait for data with `workers` DataLoader workers while a step "computes" for the estimate
    loader, waits = StepLoader(new_batches(64), 0, workers), []
    next(loader)  # the workers' start and the epoch order: once per run
    for _ in range(steps):
        time.sleep(out["h100_step_s"])
        t0 = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - t0)
    out["workers"], out["wait_new_s"] = workers, statistics.mean(waits)
    out["wait_share_of_h100_step"] = out["wait_new_s"] / out["h100_step_s"]
    out["before_share_of_h100_step"] = out["step_before_s"] / out["h100_step_s"]
    out["load_average_end"] = os.getloadavg()[0]
    return out


def cpu_name() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), platform.processor())
    return name


def write_report(rows: list[dict], args, path: Path) -> None:
    cpu = cpu_name()
    flags = open("/proc/cpuinfo").read()
    record = {"cpu": cpu, "cores": os.cpu_count(), "bf16_flags": [f for f in ("avx512_bf16", "amx_bf16") if f in flags],
              "overlay": OVERLAY, "lengths": {"prompt_lognormal": PROMPT, "reply_lognormal": REPLY, "reply_cap": MAX_NEW},
              "h100_estimate": {"params": DRAFTER_PARAMS, "flops_per_s": H100_BF16_FLOPS,
                                "formula": "6 x params x padded tokens of one rank's step"},
              "before": args.before, "rows": rows}
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    load = ", ".join(f"{r['load_average_start']:.0f}-{r['load_average_end']:.0f}" for r in rows)
    lines = [f"# Input pipeline: data time per step and padding ({cpu}, {os.cpu_count()} cores)", "",
             f"`python scripts/bench_data.py --sizes {' '.join(map(str, args.sizes))} --steps {args.steps}`; before = "
             f"d3d.training at `{args.before}`. One rank's step of the qwen3_8b overlay (8 ranks x batch 8 x accumulation 4, "
             f"max_len 3072, 32 anchors, block 16) on synthetic responses: prompt ~ lognormal(median {PROMPT[0]}, σ {PROMPT[1]}), "
             f"reply ~ lognormal(median {REPLY[0]}, σ {REPLY[1]}) capped at {MAX_NEW}. H100 step = 6 x {DRAFTER_PARAMS:.1e} params x "
             f"padded tokens per rank / {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s. Memory: anonymous resident memory the set adds "
             f"(the mapped file's pages are the shared page cache; 0.00 = below the noise of a few MB). Load average during the rows: {load} "
             f"(a shared machine: the workers' wait is the figure contention moves most).", "",
             "| responses | read before | read now (first: build cache) | memory before | memory now | data time / step before | "
             "now, in the loop (first step) | now, waited with workers | H100 step (est.) | share before | share now | padding before | padding now |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before_read = f"{r['load_before_s']:.1f} s" if "load_before_s" in r else "not run (memory)"
        before_mem = f"{r['rss_before_gib']:.2f} GiB" if "rss_before_gib" in r else "~8x the 100k row"
        lines.append(f"| {r['responses']:,} | {before_read} | {r['load_new_s']:.2f} s ({r['load_new_first_s']:.0f} s) | {before_mem} | "
                     f"{max(r['rss_new_gib'], 0):.2f} GiB | {r['step_before_s']:.2f} s | {r['step_new_s'] * 1e3:.0f} ms "
                     f"({r['step_new_first_s']:.2f} s) | {r['wait_new_s'] * 1e3:.1f} ms ({r['workers']} workers) | "
                     f"{r['h100_step_s']:.2f} s | {r['before_share_of_h100_step']:.0%} | {r['wait_share_of_h100_step']:.1%} | "
                     f"{r['padding_before']:.0%} | {r['padding_new']:.1%} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 800_000])
    ap.add_argument("--work", default="outputs/bench/data", help="where the synthetic responses are written (kept)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--before", default="9fcb4df", help="git ref of the pipeline to compare against (the last commit before this one)")
    ap.add_argument("--out", default=None, help="default docs/results/data_pipeline_<cpu>")
    args = ap.parse_args()
    before = module_at(args.before, "src/d3d/training.py")
    before_pack = module_at(args.before, "src/d3d/objective.py").pack
    rows = []
    for n in args.sizes:
        rows.append(bench_size(n, Path(args.work), before, before_pack, args.steps, args.workers))
        print(json.dumps(rows[-1]), flush=True)
    slug = "".join(c if c.isalnum() else "_" for c in cpu_name().lower()).strip("_")
    write_report(rows, args, Path(args.out or f"docs/results/data_pipeline_{slug}"))


if __name__ == "__main__":
    main()
