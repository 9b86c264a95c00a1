"""`python -m d3d.eval benchmark=gsm8k`: speculative decoding on benchmarks, AR baseline alongside.

For every item (and every MT-Bench turn, whose history carries the method's own earlier answer),
each method in `eval.methods` (conf/decode/<name>.yaml; the `decode` group's choice overrides its
own method) decodes the prompt in this process after a warm-up, with decode time measured apart from
prefill. Rows are appended to rows.jsonl as they finish (a killed run resumes, skipping finished
rows); summary.json and summary.md are recomputed from the rows at the end.

Speedup = mean TPOT(ar) / mean TPOT(method), TPOT = decode time / new tokens. Token-weighted
aggregates divide totals (decode seconds / tokens); prompt-weighted ones average per-row values.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from d3d.config import config_dir, hydra_job, resolve_path, to_plain
from d3d.data.benchmarks import BenchmarkUnavailable, format_turn, iter_specs, load_benchmark
from d3d.data.chat import chat_prompt_ids, eos_ids
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.models.drafter import build_drafter, load_drafter
from d3d.utils.io import JsonlWriter, read_jsonl, write_json
from d3d.utils.runinfo import run_info

log = logging.getLogger("d3d.eval")


def method_configs(cfg: DictConfig) -> dict[str, DecodeConfig]:
    """Each method's decode config; the composed `decode` group replaces its own method's file."""
    out = {}
    for name in cfg.eval.methods:
        path = config_dir() / "decode" / f"{name}.yaml"
        if not path.is_file():
            raise KeyError(f"eval.methods names {name!r} but conf/decode/{name}.yaml does not exist")
        own = OmegaConf.load(path)
        dc = cfg.decode if cfg.decode.method == own.method else own
        dc = DecodeConfig.from_cfg(OmegaConf.to_container(dc, resolve=False))
        dc.max_new_tokens = int(cfg.eval.max_new_tokens)
        out[name] = dc
    if "ar" not in out:
        raise ValueError("eval.methods must include ar: speedups and equality are measured against it")
    return {"ar": out.pop("ar"), **out}


def output_dir(cfg: DictConfig) -> Path:
    if cfg.eval.out_dir:
        return resolve_path(cfg.eval.out_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # composed outside a Hydra app
        return resolve_path(cfg.paths.output_dir) / "eval" / cfg.run_name


def summarise(rows: list[dict]) -> dict:
    """Per benchmark and method: τ, TPOT, speedup, hit rate, equality with AR; plus the mean over benchmarks."""
    out: dict = {"benchmarks": {}}
    for bench in sorted({r["benchmark"] for r in rows}):
        per = {}
        for method in sorted({r["method"] for r in rows if r["benchmark"] == bench}):
            rs = [r for r in rows if r["benchmark"] == bench and r["method"] == method and r["new_tokens"] > 0]
            if not rs:
                continue
            tokens = sum(r["new_tokens"] for r in rs)
            per[method] = {
                "rows": len(rs), "new_tokens": tokens,
                "tpot_ms_token_weighted": 1000 * sum(r["decode_s"] for r in rs) / tokens,
                "tpot_ms_prompt_weighted": 1000 * statistics.mean(r["decode_s"] / r["new_tokens"] for r in rs),
                "tau_token_weighted": tokens / sum(r["rounds"] for r in rs),
                "tau_prompt_weighted": statistics.mean(r["new_tokens"] / r["rounds"] for r in rs),
                "hit_rate": (statistics.mean(r["hit_rate"] for r in rs if r["hit_rate"] is not None)
                             if any(r["hit_rate"] is not None for r in rs) else None),
                "prefill_ms": 1000 * statistics.mean(r["prefill_s"] for r in rs),
                "equal_to_ar": statistics.mean(1.0 if r["equal_to_ar"] else 0.0 for r in rs),
            }
        if "ar" in per:
            for m in per.values():
                m["speedup_token_weighted"] = per["ar"]["tpot_ms_token_weighted"] / m["tpot_ms_token_weighted"]
                m["speedup_prompt_weighted"] = per["ar"]["tpot_ms_prompt_weighted"] / m["tpot_ms_prompt_weighted"]
        out["benchmarks"][bench] = per
    methods = sorted({m for per in out["benchmarks"].values() for m in per})
    out["mean_over_benchmarks"] = {
        m: {k: statistics.mean(per[m][k] for per in out["benchmarks"].values() if m in per)
            for k in ("speedup_token_weighted", "tau_token_weighted")}
        for m in methods if all("speedup_token_weighted" in per.get(m, {"speedup_token_weighted": 0})
                                for per in out["benchmarks"].values())
    }
    return out


def summary_markdown(summary: dict) -> str:
    lines = ["| benchmark | method | speedup | τ | hit rate | TPOT ms | equal to AR | rows |", "|---|---|---|---|---|---|---|---|"]
    for bench, per in summary["benchmarks"].items():
        for method, m in per.items():
            hit = "—" if m["hit_rate"] is None else f"{m['hit_rate']:.2f}"
            lines.append(f"| {bench} | {method} | {m.get('speedup_token_weighted', float('nan')):.2f}× | "
                         f"{m['tau_token_weighted']:.2f} | {hit} | {m['tpot_ms_token_weighted']:.1f} | "
                         f"{m['equal_to_ar']:.2f} | {m['rows']} |")
    for method, m in summary["mean_over_benchmarks"].items():
        lines.append(f"| **mean** | {method} | {m['speedup_token_weighted']:.2f}× | {m['tau_token_weighted']:.2f} | | | | |")
    return "\n".join(lines) + "\n"


def run_eval(cfg: DictConfig) -> Path:
    torch.manual_seed(int(cfg.seed))
    out_dir = output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = resolve_path(cfg.paths.cache_dir)
    methods = method_configs(cfg)
    path = resolve_model_path(cfg.target, cache)
    tok, target = load_tokenizer(path), load_model(path, cfg.target.dtype, cfg.target.device)
    drafter = None
    if any(dc.method != "ar" for dc in methods.values()):
        if cfg.drafter.get("checkpoint"):
            drafter, _ = load_drafter(resolve_path(cfg.drafter.checkpoint), device=str(target.device), dtype=cfg.target.dtype)
        else:
            log.warning("no drafter.checkpoint given: evaluating an untrained drafter built from drafter.init")
            drafter, _ = build_drafter(cfg.drafter, cfg.target, cache, device=str(target.device), dtype=cfg.target.dtype)
    eos = eos_ids(tok, target)
    gens = {name: SpecGenerator(target, tok, None if dc.method == "ar" else drafter, dc, eos, seed=int(cfg.seed))
            for name, dc in methods.items()}
    warm = chat_prompt_ids(tok, [{"role": "user", "content": "Say hello."}])
    for gen in gens.values():
        for _ in range(int(cfg.eval.warmup)):
            gen.generate([warm], max_new_tokens=8)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    write_json(out_dir / "run.json", {"run": run_info(target.device), "dtype": str(target.dtype),
                                      "attn_implementation": target.config._attn_implementation})

    done = {(r["benchmark"], r["id"], r["turn"], r["method"]): r for r in read_jsonl(out_dir / "rows.jsonl")}
    with JsonlWriter(out_dir / "rows.jsonl") as writer:
        for spec in iter_specs(cfg.benchmark):
            try:
                records = load_benchmark(spec, cache, n=cfg.eval.n)
            except BenchmarkUnavailable as err:
                print(f"[d3d.eval] skipped {spec['name']}: {err}", flush=True)
                continue
            for rec in records:
                history = {name: [] for name in gens}
                for turn in range(len(rec.turns)):
                    ar_tokens = None
                    for name, gen in gens.items():
                        key = (spec["name"], rec.id, turn, name)
                        history[name].append({"role": "user", "content": format_turn(spec, rec, turn)})
                        if key in done:
                            row = done[key]
                        else:
                            ids = chat_prompt_ids(tok, history[name], bool(cfg.eval.enable_thinking))
                            res = gen.generate([ids])
                            row = {"benchmark": spec["name"], "id": rec.id, "turn": turn, "method": name,
                                   "prompt_tokens": len(ids), "new_tokens": len(res.token_ids[0]),
                                   "rounds": len(res.rounds), "prefill_s": res.prefill_s, "decode_s": res.decode_s,
                                   "hit_rate": res.hit_rate, "taus": res.taus(), "token_ids": res.token_ids[0],
                                   "text": res.texts[0], "finish_reason": res.finish_reasons[0]}
                            row["equal_to_ar"] = True if name == "ar" else row["token_ids"] == ar_tokens
                            writer.write([row])
                        if name == "ar":
                            ar_tokens = row["token_ids"]
                        history[name].append({"role": "assistant", "content": row["text"]})
            print(f"[d3d.eval] {spec['name']}: {len(records)} items done", flush=True)
    rows = list(read_jsonl(out_dir / "rows.jsonl"))
    summary = summarise(rows)
    summary["config"] = to_plain(cfg)
    write_json(out_dir / "summary.json", summary)
    (out_dir / "summary.md").write_text(summary_markdown(summary))
    print(summary_markdown(summary))
    return out_dir


@hydra_job("eval")
def main(cfg: DictConfig) -> None:
    run_eval(cfg)


if __name__ == "__main__":
    main()
