"""Engine rows of d3d.bench (`bench.engines`): the same prompts, greedy, served by vLLM, the engine a
user deploys, beside d3d's rows.

Each row is one vLLM engine on the bench's target, with a speculative configuration or none:
`null` (the engine's own baseline, no speculation), `export` (the `d3d.export` folder that
`bench.engine.export` names, with its speculative_config.json: parallel drafting, the drafter as
trained), or a `speculative_config` as vLLM takes it (n-gram, a PARD-style draft model, EAGLE-3 ...
where the installed vLLM has them).

Timed as an engine is used, not as d3d's loop is: every row in a process of its own (a fresh engine
and fresh counters; its startup is reported apart), one warm-up request, then all the bench's prompts
submitted at once to the engine's scheduler (continuous batching) and timed to the last one's end:
tokens/s is all new tokens over that wall time. d3d's rows are single calls, one prompt at a time,
in the bench's own process, so the two are different programs and their ratio is a user's choice
between them, not a kernel comparison; the summary says so beside the engine rows.

Checked: every row's outputs against the engine's own non-speculative row on each prompt (equal_rate,
as d3d's rows report theirs against `generate`), and against the bench's reference row. Reported: the
engine's spec-decode counters (`vllm:spec_decode_*` from `LLM.get_metrics()`, the warm-up's
subtracted): mean acceptance length 1 + accepted / drafts and, per draft position k, cumulative
accepted_k / drafts = P(at least k drafts accepted) (vLLM counts position k when drafts 1..k were all
accepted) and conditional accepted_k / accepted_(k-1), the conventions of d3d.acceptance; beside them,
for an export row, d3d's prediction for that export (its speculation_profile.json, d3d.export).

A row that vLLM cannot run here (no such method in this build, a failed start) is kept as
unavailable with the engine's reason, never dropped. vLLM is imported only in the rows' processes,
which run this module (`python -m d3d.bench_engines <job.json> <result.json>`) with the bench's own
interpreter: the bench runs in vLLM's environment (`make vllm-env`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from d3d.errors import ConfigError
from d3d.utils.io import resolve_path

EXPORT = "export"  # a row's value that serves bench.engine.export
SPECULATIVE_CONFIG = "speculative_config.json"  # what d3d.export writes for vLLM
PROFILE = "speculation_profile.json"  # d3d.export's prediction per draft position
TIMING = ("each row a vLLM engine in a process of its own: one warm-up request, then all {n} prompts submitted "
          "at once to the engine's scheduler (continuous batching), greedy; tokens/s = all new tokens / the "
          "batch's wall time (engine startup apart). d3d's rows above are single calls, one prompt at a time, in "
          "the bench's process: a different program, so the ratio between the two is not a kernel comparison")


@dataclass
class EngineSettings:
    """`bench.engine.*` (conf/bench.yaml): how the rows of `bench.engines` run."""

    export: Optional[str]  # the d3d.export folder that rows valued `export` serve
    options: dict[str, Any]  # vLLM's LLM(...) keyword arguments for every row (enforce_eager, max_model_len, ...)
    env: dict[str, str]  # variables each row's process starts with unless already set (VLLM_CPU_KVCACHE_SPACE, ...)


def check_engines(rows: dict, engine: EngineSettings, names: list[str]) -> None:
    """One line, before any model loads, for engine rows that cannot run: vLLM absent from this
    environment, no row without speculation to check the others against, a row's value of the wrong
    kind, an export row without an export folder, or a label that a d3d row already uses."""
    if not rows:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"bench.engines names engine rows ({', '.join(rows)}), and vLLM is not installed in this "
                          f"environment ({sys.executable}). Fix: run the bench with vLLM's environment "
                          f"(make vllm-env; .venv-vllm/bin/python -m d3d.bench ...), or set bench.engines={{}}.")
    if not any(v is None for v in rows.values()):
        raise ConfigError(f"bench.engines={dict(rows)}: no row without speculation, the engine's own baseline its other "
                          f"rows are checked against. Fix: add one, e.g. +bench.engines.vllm=null.")
    for label, value in rows.items():
        if label in names:
            raise ConfigError(f"bench.engines.{label}: a d3d row of the bench has that name. Fix: name the engine row "
                              f"otherwise, e.g. vllm_{label}.")
        if not (value is None or value == EXPORT or (isinstance(value, dict) and value.get("method"))):
            raise ConfigError(f"bench.engines.{label}={value!r}: a row is null (no speculation), {EXPORT} (serve "
                              f"bench.engine.export) or a vLLM speculative_config with a method. Fix: e.g. "
                              f"bench.engines.{label}={{method:ngram,num_speculative_tokens:4}}.")
    if EXPORT in rows.values():
        if not engine.export:
            raise ConfigError("bench.engine.export: unset, and a row of bench.engines serves it. Fix: pass "
                              "bench.engine.export=<a d3d.export folder>, or drop that row.")
        folder = resolve_path(engine.export)
        if not (folder / SPECULATIVE_CONFIG).is_file():
            raise ConfigError(f"bench.engine.export={engine.export}: no {SPECULATIVE_CONFIG} there, so it is not a "
                              f"folder d3d.export wrote. Fix: pass the export.out_dir of a d3d.export run.")


def speculative_config(value, engine: EngineSettings) -> dict | None:
    """The speculative_config a row passes to vLLM: the export's own file (its model is the folder,
    wherever it lies now) for `export`, the row's mapping as it is, or None."""
    if value == EXPORT:
        folder = resolve_path(engine.export)
        return {**json.loads((folder / SPECULATIVE_CONFIG).read_text()), "model": str(folder)}
    return dict(value) if value else None


def prediction(value, engine: EngineSettings) -> dict | None:
    """d3d's prediction of an export row's acceptance per position: the export's speculation_profile.json
    (None for other rows, or an export measured without held-out responses)."""
    if value != EXPORT:
        return None
    path = resolve_path(engine.export) / PROFILE
    return json.loads(path.read_text()) if path.is_file() else None


def engine_job(value, engine: EngineSettings, model_path: str, dtype: str, prompts: list[list[int]], warm: list[int],
               max_new_tokens: int, stop_ids: list[int]) -> dict:
    """What one row's process runs (`worker`)."""
    return {"model": model_path, "dtype": dtype, "speculative_config": speculative_config(value, engine),
            "options": dict(engine.options), "prompts": prompts, "warm": warm, "max_new_tokens": max_new_tokens,
            "stop_ids": stop_ids}


def run_engines(rows: dict, engine: EngineSettings, model_path: str, dtype: str, prompts: list[list[int]],
                warm: list[int], max_new_tokens: int, stop_ids: list[int], out: Path) -> dict[str, dict]:
    """Every row, one process after another (interpreter: this one), into out/engines/<label>.json;
    {label: the row's result + its speculative_config and prediction}."""
    from d3d.models.engines import prepare_start

    env = {**os.environ}
    prepare_start("vllm", env)  # spawn, NVML probe: the engine's children start safely
    for key, value in engine.env.items():
        env.setdefault(key, str(value))
    folder = out / "engines"
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, value in rows.items():
        job = engine_job(value, engine, model_path, dtype, prompts, warm, max_new_tokens, stop_ids)
        (folder / f"{label}.job.json").write_text(json.dumps(job))
        result_file = folder / f"{label}.json"
        result_file.unlink(missing_ok=True)
        print(f"[d3d.bench] engine row {label}: vLLM, speculative_config={job['speculative_config']}", flush=True)
        done = subprocess.run([sys.executable, "-m", "d3d.bench_engines", str(folder / f"{label}.job.json"),
                               str(result_file)], env=env, capture_output=True, text=True)
        if result_file.is_file():
            result = json.loads(result_file.read_text())
        else:  # the process died before it could say why itself: its last words are the reason
            tail = [line for line in (done.stderr or "").splitlines() if line.strip()][-1:] or ["no output"]
            result = {"unavailable": f"the engine's process exited with {done.returncode}: {tail[0][:300]}"}
        (folder / f"{label}.log").write_text(done.stderr or "")
        results[label] = {**result, "speculative_config": job["speculative_config"],
                          "prediction": prediction(value, engine)}
        if "unavailable" in result:
            print(f"[d3d.bench] engine row {label} unavailable: {result['unavailable']}", flush=True)
    return results


def bench_engines(b, model_path: str, dtype: str, prompts: list[list[int]], warm: list[int], stop_ids: list[int],
                  bench_rows: list[dict], reference_name: str, out: Path) -> dict | None:
    """d3d.bench's hook: the rows of `b.engines` (a BenchSettings) on the bench's prompts, summarised
    against the engine's baseline row and the bench's reference row (`reference_name`, repeat 0);
    None when the bench names no engine row. With bench.exact_tokens every row runs max_new_tokens."""
    if not b.engines:
        return None
    results = run_engines(b.engines, b.engine, model_path, dtype, prompts, warm, b.max_new_tokens,
                          [] if b.exact_tokens else stop_ids, out)
    ref = {r["prompt"]: r["token_ids"] for r in bench_rows if r["method"] == reference_name and r["repeat"] == 0}
    reference = [ref.get(i) for i in range(len(prompts))]
    return engine_summary(results, reference if None not in reference else None, reference_name)


# ---------------------------------------------------------------------------- the summary


def cut_at_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """A response cut after its first stop id (kept), as d3d's rows end."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


def measured_acceptance(metrics: dict) -> dict | None:
    """The engine's acceptance from its spec-decode counters: mean acceptance length and, per draft
    position, cumulative (accepted_k / drafts) and conditional (accepted_k / accepted_(k-1)) rates."""
    drafts = metrics.get("num_drafts") or 0
    per_pos = metrics.get("num_accepted_tokens_per_pos")
    if not drafts:
        return None
    counts = [drafts, *(per_pos or [])]
    return {"drafts": drafts, "draft_tokens": metrics.get("num_draft_tokens"),
            "mean_acceptance_length": 1 + metrics.get("num_accepted_tokens", 0) / drafts,
            "cumulative": [c / drafts for c in counts[1:]],
            "conditional": [c / prev if prev else None for prev, c in zip(counts, counts[1:])]}


def engine_summary(results: dict[str, dict], reference: list[list[int]] | None, reference_name: str | None) -> dict:
    """summary.json's `engines`: per row its speed, its outputs' equality with the engine's baseline row
    (the first without speculation) and with the bench's reference row, and its acceptance per
    position beside d3d's prediction. `reference`: the bench's reference tokens per prompt."""
    base = next(label for label, r in results.items() if r["speculative_config"] is None)
    base_out = results[base].get("outputs")
    base_tps = results[base].get("tokens_per_s")
    rows = []
    for label, r in results.items():
        entry = {"row": label, "speculative_config": r["speculative_config"]}
        if "unavailable" in r:
            rows.append({**entry, "unavailable": r["unavailable"]})
            continue
        outs = r["outputs"]
        same = lambda ref: (sum(a == b for a, b in zip(outs, ref)) / len(outs)) if ref and len(ref) == len(outs) else None
        entry |= {"prompts": len(outs), "new_tokens": sum(map(len, outs)), "wall_s": r["wall_s"],
                  "tokens_per_s": r["tokens_per_s"], f"x_{base}": r["tokens_per_s"] / base_tps if base_tps else None,
                  "equal_rate": same(base_out), "equal_to_reference_rate": same(reference),
                  "startup_s": r.get("startup_s"), "warmup_s": r.get("warmup_s"),
                  "acceptance": measured_acceptance(r.get("metrics") or {})}
        profile = r.get("prediction")
        if profile:
            entry["predicted"] = {k: profile.get(k) for k in ("cumulative", "conditional", "mean_acceptance_length",
                                                              "steps", "measured_on")}
        rows.append(entry)
    version = next((r.get("version") for r in results.values() if r.get("version")), None)
    return {"engine": "vllm", "version": version, "baseline": base, "reference": reference_name,
            "timing": TIMING.format(n=len(base_out) if base_out else "the"), "rows": rows}


def _rates(values) -> str:
    return "—" if not values else " ".join("—" if v is None else f"{v:.2f}" for v in values)


def engines_markdown(engines: dict) -> list[str]:
    """summary.md's lines for the engine rows: their table, the timing said beside it, and the
    engine's acceptance per position beside d3d's prediction."""
    fmt = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    base, ref = engines["baseline"], engines.get("reference") or "the reference"
    lines = ["", f"Engine rows (vLLM {engines.get('version') or '?'}): {engines['timing']}.", "",
             f"| engine row | speculative config | tokens/s (all prompts at once) | × {base} | equal to {base} | "
             f"equal to {ref} | mean acceptance length | startup s | warm-up s |", "|" + "---|" * 9]
    for e in engines["rows"]:
        spec = "none" if e["speculative_config"] is None else json.dumps(e["speculative_config"], sort_keys=True)
        if "unavailable" in e:
            lines.append(f"| {e['row']} | {spec} | unavailable: {e['unavailable']} | | | | | | |")
            continue
        acc = e.get("acceptance") or {}
        lines.append(f"| {e['row']} | {spec} | {fmt(e['tokens_per_s'], '.1f')} | {fmt(e[f'x_{base}'])} | "
                     f"{fmt(e['equal_rate'])} ({e['prompts']} prompts) | {fmt(e['equal_to_reference_rate'])} | "
                     f"{fmt(acc.get('mean_acceptance_length'))} | {fmt(e['startup_s'], '.1f')} | "
                     f"{fmt(e['warmup_s'], '.1f')} |")
    drafting = [e for e in engines["rows"] if e.get("acceptance") or e.get("predicted")]
    if drafting:
        lines += ["", "The engine's acceptance per draft position k = 1, 2, … (its spec-decode counters over the "
                  "timed batch: cumulative P(≥ k accepted) = accepted at k / drafts, conditional P(k | k − 1)) beside "
                  "d3d's prediction for the export (its speculation_profile.json, same conventions):", "",
                  "| engine row | drafts | cumulative by k | conditional by k | predicted cumulative by k | "
                  "predicted conditional by k | predicted mean acceptance length |", "|" + "---|" * 7]
        for e in drafting:
            acc, pred = e.get("acceptance") or {}, e.get("predicted") or {}
            lines.append(f"| {e['row']} | {acc.get('drafts', '—')} | {_rates(acc.get('cumulative'))} | "
                         f"{_rates(acc.get('conditional'))} | {_rates(pred.get('cumulative'))} | "
                         f"{_rates(pred.get('conditional'))} | {fmt(pred.get('mean_acceptance_length'))} |")
    return lines


# ---------------------------------------------------------------------------- a row's process


def counters(llm) -> dict:
    """vLLM's spec-decode counters (`vllm:spec_decode_*`), summed over engines; per-position ones as lists."""
    out: dict = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        name = metric.name.removeprefix("vllm:spec_decode_")
        if hasattr(metric, "values"):  # a vector: one count per draft position
            prev = out.get(name, [0] * len(metric.values))
            out[name] = [a + b for a, b in zip(prev, metric.values)]
        elif hasattr(metric, "value"):
            out[name] = out.get(name, 0) + metric.value
    return out


def minus(after: dict, before: dict) -> dict:
    """The counters of the timed batch alone: the warm-up's subtracted."""
    out = {}
    for name, value in after.items():
        prev = before.get(name)
        if isinstance(value, list):
            prev = prev or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, prev)]
        else:
            out[name] = value - (prev or 0)
    return out


def worker(job: dict) -> dict:
    """One engine row, in vLLM's process: start, warm up, all prompts at once, counters."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    try:
        llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=0, disable_log_stats=False,
                  speculative_config=job["speculative_config"], **job["options"])
    except Exception as err:  # noqa: BLE001 - the engine's own reason is the row's record
        return {"unavailable": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}",
                "version": vllm.__version__}
    startup = time.perf_counter() - start
    # no stop ids: bench.exact_tokens, every request runs max_tokens (the model's own EOS too)
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=job["stop_ids"],  # noqa: E731
                                      ignore_eos=not job["stop_ids"], detokenize=False)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=job["warm"])], params(16), use_tqdm=False)
    warmup = time.perf_counter() - start
    before = counters(llm)
    start = time.perf_counter()
    done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params(job["max_new_tokens"]),
                        use_tqdm=False)
    wall = time.perf_counter() - start
    outputs = [cut_at_stop(list(r.outputs[0].token_ids), job["stop_ids"]) for r in done]
    return {"outputs": outputs, "wall_s": wall, "tokens_per_s": sum(map(len, outputs)) / wall, "startup_s": startup,
            "warmup_s": warmup, "metrics": minus(counters(llm), before), "version": vllm.__version__}


if __name__ == "__main__":
    job_file, result_file = sys.argv[1:3]
    Path(result_file).write_text(json.dumps(worker(json.loads(Path(job_file).read_text()))))
