"""`python -m d3d.bench bench=<preset>`: decoding speed of rows of the method table beside the peers a
user would pick instead (transformers' `generate`, assisted generation, prompt-lookup decoding).

Every method decodes the same prompts (the first turns of `bench.benchmark`, chat template applied)
with the same target in the same dtype, in this one process, greedy, batch 1:

- one warm-up call per method on a prompt outside the timed set, before any timed call (a static
  backend warms up on the longest prompt for the full token count, so no timed call compiles);
- then interleaved: every method on prompt i (`bench.repeats` times each, methods taking turns)
  before any method on prompt i+1, so a change in the machine's load lands on all methods alike;
- wall time of the whole call (prefill included, as `generate` reports it), new tokens, and for our
  loops τ, hit rate and where a round's time goes, including the drafter's share of a round (time in
  drafter passes, the synchronous draft and the tray pass, over the round's wall time: what a
  cheaper, pruned drafter can win back);
- every call's tokens against the baseline's on that prompt (`generate` when it runs, else `ar`); a
  call that differs has its first difference classified as `d3d.eval` classifies one (the target's
  logit margin there, d3d.decoding.divergence): a near-tie that bf16 rounding can flip, or a real
  difference. The summary gives each row's shares: equal, near-tie flip, real.

Rows go to rows.jsonl as each prompt finishes (a killed run resumes at the next prompt, refused if
the settings or the CPU/GPU differ); summary.json and summary.md are recomputed from all rows: medians
per method, ratios to each baseline that ran, and the τ each of our methods would need to match the
first baseline here. The presets (conf/bench/*.yaml) are the project's benchmarks; `make bench` runs
the one the README's figures come from.

Engine rows (`bench.engines`, d3d.bench_engines): a serving engine (vLLM) on the same prompts after
d3d's rows, each row in a process of its own and timed as the engine is used (all prompts at once),
summarised apart with its equality to the engine's own baseline and its acceptance per position.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from d3d.bench_engines import EngineSettings, bench_engines, check_engines, engines_markdown
from d3d.config import hydra_job, refuse_mixed_run, to_plain
from d3d.errors import ConfigError
from d3d.utils.io import JsonlWriter, job_folder, read_jsonl, resolve_path, write_json
from d3d.data.benchmarks import first_turn_messages, load_benchmark
from d3d.data.chat import chat_prompt_ids
from d3d.decoding.divergence import classify
from d3d.models.drafter import SavedDrafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.settings import EVERY_SECTION, bind, bind_decode, check_checkpoint_settings, decode_keys, shipped_benchmark
from d3d.decoding.cost import check_decode_cost
from d3d.specs import DrafterSpec, PathsSpec, TargetSpec
from d3d.utils.hardware import cpu_label
from d3d.utils.runinfo import gpu_name, run_info

# transformers' decoders a user would run instead of ours: bench.methods names them beside `methods.*`
PEERS = ("generate", "assisted", "prompt_lookup")
# speedups are quoted against each of these that ran; the first that ran is the reference for equality
BASELINES = ("generate", "ar")


@dataclass
class BenchSettings:
    """`bench.*` (conf/bench.yaml, a preset of conf/bench/ on top)."""

    name: str  # the preset: names the output folder
    methods: list[str]  # PEERS and names under `methods` (conf/decode/<name>.yaml, or a preset's own rows)
    backends: list[str]  # our loops once per decode.backend their row supports; rows of others end [backend]
    benchmark: str  # the prompts: this shipped benchmark's items, first turns
    n_prompts: int  # timed prompts (one more, the first, is the warm-up prompt)
    max_new_tokens: int
    repeats: int  # timed calls per method on each prompt, methods taking turns
    exact_tokens: bool  # true: EOS ignored, every call makes max_new_tokens (per-token timing of plain decoding)
    assistant: Optional[str]  # `assisted`'s assistant: a conf/target/<name>; null = an AR copy of the target
    prompt_lookup_tokens: int  # `prompt_lookup`'s n-gram continuation length
    pass_cost: bool  # also time one cached pass of 1, 2, 4, 8, 16 tokens per model (the break-even τ's inputs)
    engines: dict[str, Any]  # engine rows (d3d.bench_engines): label -> null | export | a vLLM speculative_config
    engine: EngineSettings  # how the engine rows run
    also_drafters: dict[str, str] = field(default_factory=dict)  # label -> checkpoint: rows <method>@<label>
    out_dir: Optional[str] = None  # null = outputs/bench/<preset>-<target> (a rerun resumes there)
    progress: bool = True


@dataclass
class BenchConfig:
    task_name: str
    run_name: str
    paths: PathsSpec
    target: TargetSpec
    drafter: DrafterSpec
    bench: BenchSettings


def bind_bench(cfg: DictConfig) -> tuple[BenchConfig, dict]:
    """The typed config and {row name: DecodeConfig} of our methods, before any model loads: an unknown
    top-level key, a method name with no row, a peer's bad setting or a decode key a method does not
    read fails here in one line."""
    own = {f.name for f in fields(BenchConfig)}
    unknown = sorted(set(cfg) - own - EVERY_SECTION)
    if unknown:
        raise ConfigError(f"{unknown[0]}: d3d.bench has no such top-level key. Fix: check its spelling, or put it "
                          f"in a section ({', '.join(sorted(own))}).")
    typed = bind(BenchConfig, {k: cfg[k] for k in own if k in cfg}, "")
    check_checkpoint_settings(typed.drafter)  # a trained drafter runs as it was trained
    b = typed.bench
    for key, least in [("n_prompts", 1), ("max_new_tokens", 1), ("repeats", 1), ("prompt_lookup_tokens", 1)]:
        if getattr(b, key) < least:
            raise ConfigError(f"bench.{key}={getattr(b, key)!r}: an integer >= {least}. Fix: set bench.{key} to "
                              f"{least} or more.")
    if not any(m in BASELINES for m in b.methods):
        raise ConfigError(f"bench.methods={b.methods}: no baseline ({' or '.join(BASELINES)}) to quote speedups and "
                          f"equality against. Fix: add ar (our plain loop) or generate to bench.methods.")
    from d3d.decoding.kv import BACKENDS

    bad = [x for x in b.backends if x not in BACKENDS]
    if bad or not b.backends:
        raise ConfigError(f"bench.backends={b.backends}: use one or more of {', '.join(BACKENDS)}. Fix: e.g. "
                          f"bench.backends=[eager,compiled].")
    ours = {}
    for name in b.methods:
        if name in PEERS:
            continue
        if "methods" not in cfg or name not in cfg.methods:
            raise ConfigError(f"bench.methods names {name!r}, which is neither a peer ({', '.join(PEERS)}) nor a row "
                              f"under `methods` ({', '.join(cfg.get('methods', {}))}). Fix: check its spelling, or add "
                              f"methods.{name}: {{method: ..., ...}} to the preset.")
        ours[name] = replace(bind_decode(cfg.methods[name], f"methods.{name}"), max_new_tokens=b.max_new_tokens)
        if ours[name].auto_budget:  # d3d.eval chooses a budget by measurement; a benchmark times given ones
            knobs = " ".join(f"methods.{name}.{k}=<n>" for k in ("C", "F", "tree_trays") if getattr(ours[name], k) is None)
            raise ConfigError(f"methods.{name}: its tray budget is left to measurement (null), which d3d.bench does not "
                              f"do: it times given budgets. Fix: set {knobs} (e.g. a budget d3d.eval or "
                              f"scripts/choose_budget.py chose).")
        if ours[name].temperature != 0:  # equality with the baseline and a fair speed both need greedy decoding
            raise ConfigError(f"methods.{name}.temperature={ours[name].temperature}: d3d.bench times greedy decoding, "
                              f"as generate runs beside it. Fix: set methods.{name}.temperature=0.")
    if "assisted" in b.methods and b.assistant is not None:
        from d3d.configdir import config_dir

        if not (config_dir() / "target" / f"{b.assistant}.yaml").is_file():
            raise ConfigError(f"bench.assistant={b.assistant}: no conf/target/{b.assistant}.yaml. Fix: name a target "
                              f"config, or null for a copy of the target.")
    for label in b.also_drafters:
        if not label or "@" in label or "/" in label:
            raise ConfigError(f"bench.also_drafters.{label}: a label names rows <method>@<label>. Fix: use a plain "
                              f"name such as `unpruned`.")
    return typed, ours


def output_dir(cfg: BenchConfig) -> Path:
    if cfg.bench.out_dir:
        return resolve_path(cfg.bench.out_dir)
    return resolve_path(cfg.paths.output_dir) / "bench" / cfg.run_name


# ---------------------------------------------------------------------------- the callables timed


@dataclass
class Timed:
    """One row of the bench: a call (prompt ids, max new tokens) -> (new token ids, our loop's extras)."""

    run: Callable[[list[int], int], tuple[list[int], dict]]
    settings: dict  # what run.json records of it
    static: bool = False  # a static backend: warmed up on the longest prompt for the full token count


def peer(target, tok, eos: list[int], exact: bool, **kw) -> Callable:
    def run(ids: list[int], n: int):
        x = torch.tensor([ids], device=target.device)
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None if exact else eos, pad_token_id=tok.pad_token_id,
                                  **({"min_new_tokens": n} if exact else {}), **kw)
        new = out[0, len(ids):].tolist()
        for i, t in enumerate(new):  # generate pads after EOS: cut there, EOS kept as our loop keeps it
            if not exact and t in eos:
                return new[: i + 1], {}
        return new, {}
    return run


def our_loop(gen) -> Callable:
    def run(ids: list[int], n: int):
        res = gen.generate([ids], max_new_tokens=n)
        total = lambda key: sum(getattr(r, key) or 0.0 for r in res.rounds)
        wall = total("wall_s")
        extra = {"tau": res.mean_tau, "hit_rate": res.hit_rate, "rounds": len(res.rounds),
                 "prefill_s": res.prefill_s, "decode_s": res.decode_s}
        if res.rounds and wall > 0:  # where a round's time goes, per round (ms)
            extra |= {f"{k}_ms": 1000 * total(f"{k}_s") / len(res.rounds) for k in ("wall", "draft", "verify", "tray",
                                                                                  "tray_wait")}
            extra["drafter_share"] = (total("draft_s") + total("tray_s")) / wall
        return res.token_ids[0], extra
    return run


def load_assistant(name: str | None, cfg: BenchConfig, target, target_path: str, cache: Path):
    """`assisted`'s assistant: conf/target/<name>.yaml's model, or an AR copy of the target (a full-copy
    drafter's cost), on the target's device in its dtype."""
    from d3d.configdir import config_dir
    from d3d.models import load_model, resolve_model_path

    if name is None:
        return load_model(target_path, cfg.target.dtype, str(target.device)), "copy"
    spec = bind(TargetSpec, OmegaConf.load(config_dir() / "target" / f"{name}.yaml"), f"bench.assistant({name})")
    return load_model(resolve_model_path(spec, cache), cfg.target.dtype, str(target.device)), name


def build_rows(cfg: BenchConfig, methods: dict, target, tok, drafter, also: dict, target_path: str,
               cache: Path) -> dict[str, Timed]:
    """Every timed row in the order they run: peers first, then our loops per backend, those with trays
    last (an overlap=thread run must not touch the timing of anything else in the process)."""
    from d3d.data.chat import eos_ids
    from d3d.decoding import SpecGenerator
    from d3d.decoding.methods import method_row

    b = cfg.bench
    eos = eos_ids(tok, target)
    loop_eos = [] if b.exact_tokens else eos
    rows: dict[str, Timed] = {}
    for name in b.methods:
        if name == "generate":
            rows[name] = Timed(peer(target, tok, eos, b.exact_tokens), {"peer": "transformers generate"})
        elif name == "assisted":
            assistant, label = load_assistant(b.assistant, cfg, target, target_path, cache)
            rows[name] = Timed(peer(target, tok, eos, b.exact_tokens, assistant_model=assistant),
                               {"peer": "transformers assisted generation", "assistant": label})
        elif name == "prompt_lookup":
            rows[name] = Timed(peer(target, tok, eos, b.exact_tokens, prompt_lookup_num_tokens=b.prompt_lookup_tokens),
                               {"peer": "transformers prompt lookup", "prompt_lookup_num_tokens": b.prompt_lookup_tokens})
    for backend in b.backends:
        tag = "" if backend == "eager" else f"[{backend}]"
        for name, dc in sorted(methods.items(), key=lambda kv: method_row(kv[1].method).trays):
            row = method_row(dc.method)
            if backend not in row.backends:
                continue
            dc = replace(dc, backend=backend)
            record = {**{k: getattr(dc, k) for k in decode_keys(dc.method)}, "budget": row.budget(dc)}
            static = backend != "eager"
            rows[f"{name}{tag}"] = Timed(our_loop(SpecGenerator(target, tok, drafter if row.needs_drafter else None, dc,
                                                            loop_eos)), record, static)
            for label, other in also.items():  # the same method with another drafter
                if row.needs_drafter:
                    rows[f"{name}{tag}@{label}"] = Timed(our_loop(SpecGenerator(target, tok, other, dc, loop_eos)),
                                                         {**record, "drafter": b.also_drafters[label]}, static)
    return rows


# ---------------------------------------------------------------------------- the run


def pass_costs(target, drafter, also: dict, prompt: list[int], widths: list[int]) -> dict:
    """Median ms of one cached forward of w new tokens after the warm-up prompt, lm_head excluded, per
    model: a sync round costs draft(B) + verify(B) and yields τ tokens, an AR step verify(1) and one.
    `drafter_block`: each drafter's own draft pass, one mask block at its trained block with its LM head
    (the head is what a draft vocabulary cuts, so it is timed here and not above), and the head's rows."""
    from d3d.decoding.budget import block_pass_ms, clean_pass_ms

    ids = torch.tensor([prompt], device=target.device)
    drafters = {**({"drafter": drafter} if drafter is not None else {}),
                **{f"drafter@{k}": d for k, d in also.items()}}
    models = {"target": target, **drafters}
    out = {name: {w: clean_pass_ms(m, ids, w, 5, logits=False) for w in widths} for name, m in models.items()}
    out["drafter_block"] = {name: {"ms": block_pass_ms(d, ids, 1, 5), "block": DrafterSettings.of(d).block_size,
                                   "head_rows": int(d.get_output_embeddings().weight.shape[0])}
                            for name, d in drafters.items()}
    return out


def resume_key(cfg: BenchConfig, rows: dict[str, Timed]) -> dict:
    """What a row depends on beyond its method, prompt and repeat: resuming with another value of any
    would mix two benchmarks (the hardware too: figures of two machines are not one table)."""
    from d3d.utils.hardware import cpu_info

    b = cfg.bench
    # which drafters by path and weights, as d3d.eval names them (a drafter retrained in place is another)
    drafter = (SavedDrafter.named(cfg.drafter.checkpoint).resume_record() if cfg.drafter.checkpoint
               else {"drafter": f"untrained {cfg.drafter.name}"})
    return {"target": cfg.target.name, "dtype": cfg.target.dtype, **drafter, "benchmark": b.benchmark,
            "max_new_tokens": b.max_new_tokens, "exact_tokens": b.exact_tokens, "cpu": cpu_info()["model"],
            "cuda": gpu_name(),
            "rows": {name: t.settings for name, t in rows.items()},
            **({"also_drafters": {label: SavedDrafter.named(p, f"bench.also_drafters.{label}").resume_record()
                                  for label, p in b.also_drafters.items()}} if b.also_drafters else {})}


def load_models(cfg: BenchConfig, methods: dict, cache: Path):
    from d3d.models import load_target
    from d3d.models.drafter import build_drafter
    from d3d.models.target import drafter_device
    from d3d.decoding.methods import method_row

    path, tok, target = load_target(cfg.target, cache)
    dtype, device = cfg.target.dtype, drafter_device(cfg.drafter.device, target)

    def trained(folder: str, where: str):  # as d3d.eval loads it: drafter.device, the configured attention
        return SavedDrafter.named(folder, where).load(
            cfg.drafter, cfg.target, target=target, target_tok=tok, decoding=True,
            warn=lambda warning: print(f"[d3d.bench] warning: {warning}", flush=True))[0]

    drafter = None
    if any(method_row(dc.method).needs_drafter for dc in methods.values()):
        if cfg.drafter.checkpoint:
            drafter = trained(cfg.drafter.checkpoint, "drafter.checkpoint")
        else:  # τ and speed of an untrained copy: what a drafter starts from (the tree against the chain)
            print("[d3d.bench] no drafter.checkpoint: timing an untrained drafter built from drafter.init", flush=True)
            drafter, _ = build_drafter(cfg.drafter, cfg.target, cache, device=device, dtype=dtype)
    also = {k: trained(v, f"bench.also_drafters.{k}") for k, v in cfg.bench.also_drafters.items()}
    return path, tok, target, drafter, also


def run_bench(raw: DictConfig) -> Path:
    """Bind, check, load, warm up, time every row interleaved per prompt, summarise: one run into
    output_dir(cfg), resumed where a killed one stopped."""
    cfg, methods = bind_bench(raw)
    b = cfg.bench
    cache = resolve_path(cfg.paths.cache_dir)
    spec = shipped_benchmark(b.benchmark)
    records = load_benchmark(spec, cache, n=b.n_prompts + 1)  # a benchmark that cannot load: said before the models
    # a missing path or a run folder, and a block rule the drafter was not trained with: said before anything loads
    if cfg.drafter.checkpoint:
        SavedDrafter.named(cfg.drafter.checkpoint, block_attention=cfg.drafter.block_attention)
    for k, v in b.also_drafters.items():
        SavedDrafter.named(v, f"bench.also_drafters.{k}")
    check_decode_cost(methods, cfg.target, cfg.drafter, cache)
    check_engines(b.engines, b.engine, b.methods)
    out = output_dir(cfg)
    with job_folder(out, "bench", "bench.out_dir"):
        path, tok, target, drafter, also = load_models(cfg, methods, cache)
        rows = build_rows(cfg, methods, target, tok, drafter, also, path, cache)
        prompts = [chat_prompt_ids(tok, first_turn_messages(spec, r)) for r in records]
        warm, prompts = prompts[0], prompts[1:]
        key = resume_key(cfg, rows)
        run_file, rows_file = out / "run.json", out / "rows.jsonl"
        previous = list(read_jsonl(rows_file, ("method", "prompt", "repeat"))) if rows_file.is_file() else []
        if previous and run_file.is_file():
            refuse_mixed_run(out, json.loads(run_file.read_text()).get("resume_key"), key, "holds rows made",
                             "pass a new bench.out_dir, or delete that folder to start over.")
        done_prompts = {r["prompt"] for r in previous}

        warmup_s = {}
        for name, t in rows.items():  # outside the timing; compile time of a static backend is said apart
            start = time.perf_counter()
            t.run(max(prompts + [warm], key=len), b.max_new_tokens) if t.static else t.run(warm, 16)
            warmup_s[name] = time.perf_counter() - start
        cost = pass_costs(target, drafter, also, warm, sorted({1, 2, 4, 8, 16, *(
            dc.block_size for dc in methods.values() if dc.method != "ar")})) if b.pass_cost else None
        write_json(run_file, {"run": run_info(target.device), "dtype": str(target.dtype), "resume_key": key,
                              "config": to_plain(raw), "warmup_s": warmup_s, "pass_cost": cost,
                              "prompt_tokens": [len(p) for p in prompts]})
        base = next(m for m in BASELINES if m in rows)
        with JsonlWriter(rows_file) as writer:
            for i, ids in enumerate(tqdm(prompts, desc="prompts", unit="prompt", disable=not b.progress)):
                if i in done_prompts:
                    continue
                batch, reference = [], None
                for rep in range(b.repeats):
                    for name, t in rows.items():  # every method on this prompt before the next prompt
                        start = time.perf_counter()
                        new, extra = t.run(ids, b.max_new_tokens)
                        wall = time.perf_counter() - start
                        reference = new if name == base and reference is None else reference
                        batch.append({"method": name, "prompt": i, "repeat": rep, "new_tokens": len(new),
                                      "wall_s": wall, "tokens_per_s": len(new) / wall, "token_ids": new, **extra})
                for r in batch:  # after the timing: one target pass per call that differs
                    r["equal_to_reference"] = r["token_ids"] == reference
                    r["divergence"] = classify(target, ids, reference, r["token_ids"])
                writer.write(batch)  # whole prompts only: a resumed run redoes a prompt it had not finished
        all_rows = list(read_jsonl(rows_file, ("method", "prompt", "repeat")))
        summary = summarise(all_rows, list(rows), warmup_s)
        from d3d.data.chat import eos_ids

        summary["engines"] = bench_engines(b, path, str(target.dtype).removeprefix("torch."), prompts, warm,
                                           eos_ids(tok, target), all_rows, base, out)
        summary |= {"target": cfg.target.name, "dtype": str(target.dtype), "preset": b.name,
                    "run": run_info(target.device), "pass_cost": cost}
        summary["best_with_drafts"] = {label: e["method"] for label, e in best_rows(summary).items()}
        write_json(out / "summary.json", summary)
        text = summary_markdown(summary)
        (out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"[d3d.bench] results: {out} (rows.jsonl, summary.json, summary.md)", flush=True)
    return out


# ---------------------------------------------------------------------------- the summary


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def difference_shares(rows: list[dict]) -> dict:
    """The shares of calls equal to the baseline, differing first at a near-tie that rounding can flip
    (`near_tie_rate`) and differing otherwise (`real_rate`); the two are None where a differing row
    carries no classification (rows written before d3d.bench classified them)."""
    n = len(rows)
    differ = [r for r in rows if not r["equal_to_reference"]]
    shares = {"equal_rate": (n - len(differ)) / n, "near_tie_rate": None, "real_rate": None}
    if all("divergence" in r for r in differ):
        kinds = [r["divergence"]["kind"] for r in differ if r["divergence"]]
        shares |= {"near_tie_rate": kinds.count("numerical") / n, "real_rate": (len(differ) - kinds.count("numerical")) / n}
    return shares


def summarise(rows: list[dict], order: list[str], warmup_s: dict | None = None) -> dict:
    """Medians per method over its calls; ratios of median tokens/s to each baseline that ran; the τ a
    method would need to match the first baseline, per call against the baseline's call on the same
    prompt and repeat, median over calls (tokens/s = τ / round time, so τ_even = τ · base tok/s / its
    tok/s: a projection from measured rounds, assuming the round's cost does not move with τ)."""
    by = {m: [r for r in rows if r["method"] == m] for m in order}
    bases = [m for m in BASELINES if by.get(m)]
    first = {(r["prompt"], r["repeat"]): r["tokens_per_s"] for r in by[bases[0]]} if bases else {}
    out = []
    for m in order:
        rs = by[m]
        if not rs:
            continue
        tps = _median(rs, "tokens_per_s")
        entry = {"method": m, "calls": len(rs), "new_tokens": sum(r["new_tokens"] for r in rs), "tokens_per_s": tps,
                 **{f"x_{b}": tps / _median(by[b], "tokens_per_s") for b in bases}, **difference_shares(rs),
                 **{k: _median(rs, k) for k in ("tau", "hit_rate", "wall_ms", "draft_ms", "verify_ms", "tray_ms",
                                                "tray_wait_ms", "drafter_share")}}
        match = [r["tau"] * first[(r["prompt"], r["repeat"])] / r["tokens_per_s"] for r in rs
                 if r.get("tau") is not None and (r["prompt"], r["repeat"]) in first]
        entry["tau_to_match"] = statistics.median(match) if match and m not in BASELINES else None
        entry["warmup_s"] = (warmup_s or {}).get(m)
        out.append(entry)
    return {"baselines": bases, "prompts": len({r["prompt"] for r in rows}), "methods": out}


def shares(e: dict) -> str:
    """`equal / near-tie / real` of a summary row, over its calls and tokens."""
    if e.get("equal_rate") is None:
        return "—"
    split = ("not classified" if e.get("near_tie_rate") is None else
             f"{e['near_tie_rate']:.2f} / {e['real_rate']:.2f}")
    calls = e.get("calls", "?")
    return f"{e['equal_rate']:.2f} / {split} ({calls} call{'' if calls == 1 else 's'}, {e.get('new_tokens', '?')} tokens)"


def summary_markdown(summary: dict) -> str:
    fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)
    bases = summary["baselines"]
    head = (["method", "tokens/s (median)"] + [f"× {b}" for b in bases] +
            ["τ", f"τ to match {bases[0]}", "hit rate", f"equal to {bases[0]} / near-tie flip / real difference",
             "round ms (draft / verify / tray)", "drafter share of a round", "warm-up s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary["methods"]:
        split = "—" if e["wall_ms"] is None else (f"{e['wall_ms']:.0f} ({e['draft_ms']:.0f} / {e['verify_ms']:.0f} / "
                                                  f"{e['tray_ms']:.0f})")
        cells = ([e["method"], fmt(e["tokens_per_s"], ".1f")] + [fmt(e[f"x_{b}"]) for b in bases] +
                 [fmt(e["tau"]), fmt(e["tau_to_match"]), fmt(e["hit_rate"]), shares(e), split,
                  fmt(e["drafter_share"]), fmt(e["warmup_s"], ".1f")])
        lines.append("| " + " | ".join(cells) + " |")
    run = summary.get("run") or {}
    device = cpu_label(run.get("cpu"), run.get("cuda"))
    lines.append(f"\n{summary['prompts']} prompts, medians over calls; {summary.get('target')} in "
                 f"{summary.get('dtype')} on {device} ({run.get('cpu_threads')} threads).")
    best = best_rows(summary)
    if best:
        lines += ["", "Fastest row with drafts per drafter: " + "; ".join(
            f"{label}: {e['method']} {fmt(e['tokens_per_s'], '.1f')} tokens/s"
            + "".join(f", {fmt(e[f'x_{b}'])}x {b}" for b in bases) + f", drafter share {fmt(e['drafter_share'])}"
            for label, e in best.items()) + "."]
    cost = summary.get("pass_cost")
    if cost:
        blocks = cost.get("drafter_block") or {}
        models = [m for m in cost if m != "drafter_block"]
        lines += ["", "One cached forward pass, lm_head excluded (ms, median of 5 after the warm-up prompt):", "",
                  "| tokens in the pass | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
        for w in cost["target"]:
            lines.append(f"| {w} | " + " | ".join(f"{cost[m][w]:.1f}" for m in models) + " |")
        if blocks:
            lines += ["", "One drafter pass of one block with its head (ms, median of 5): " + "; ".join(
                f"{m}: {c['ms']:.1f} (B = {c['block']}, {c['head_rows']} head rows)" for m, c in blocks.items()) + "."]
    if summary.get("engines"):
        lines += engines_markdown(summary["engines"])
    return "\n".join(lines)


def best_rows(summary: dict) -> dict[str, dict]:
    """The fastest row that drafts (drafter share > 0), per drafter: rows `<method>@<label>` run the
    drafter bench.also_drafters.<label> names, the others the composed drafter ("drafter")."""
    best = {}
    for e in summary["methods"]:
        if not e.get("drafter_share"):
            continue
        label = e["method"].split("@", 1)[1] if "@" in e["method"] else "drafter"
        if label not in best or e["tokens_per_s"] > best[label]["tokens_per_s"]:
            best[label] = e
    return best


@hydra_job("bench")
def main(cfg: DictConfig) -> None:
    run_bench(cfg)


if __name__ == "__main__":
    main()
