"""`python -m d3d.pipeline`: generate -> train -> prune -> eval in one command, every stage resumable.

    python -m d3d.pipeline +experiment=pipeline_cpu     # the README's main command (CPU default)
    python -m d3d.pipeline +experiment=pipeline_fast    # a first look in minutes
    python -m d3d.pipeline +experiment=smoke --stages generate train
    python -m d3d.pipeline --demo                       # `make demo`: the overlay this CPU suits

Each stage is the ordinary job (d3d.generate, d3d.train, d3d.prune, d3d.eval) composed with the same
overrides; an override whose top-level key a stage does not have (e.g. `prune.num_layers=2` for the
generate stage) is passed only to the stages that have it. The pipeline wires the stages together:
the trained drafter (`<train.out_dir>/final`) is what prune starts from, and the pruned drafter
(`<prune.out_dir>/final`) is what eval measures, beside the unpruned one (rows `<method>@unpruned`,
eval.also_drafters). Because every stage resumes (finished rows, steps
and checkpoints are skipped), rerunning the command after a kill continues where it stopped.
Stage wall times go to `<outputs>/pipeline/<run_name>/pipeline.json`, which a later invocation on
the same run extends rather than replaces: `stages` holds each stage's latest record (with the
invocation it came from) and `invocations` one entry per command, so a demo run stage by stage
(`--stages prune`, then `--stages eval`) keeps every stage's time. A stage killed and resumed
counts its resumed invocation only.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from d3d.config import USER_ERRORS, ConfigError, compose, quoted, resolve_path, stage_overrides, verbose
from d3d.settings import bind_config
from d3d.utils.io import write_json

STAGES = ("generate", "train", "prune", "eval")


def demo_choice() -> dict:
    """`make demo` shows the method where this CPU allows: with native bf16 (AVX512-BF16 / AMX) a
    16-token pass costs ~1.3x a 1-token one, so the Qwen2.5-Coder pair's speculative decoding beats
    plain decoding (pipeline_qwen, pruned by the tree's τ);
    on AVX2-only CPUs the same pass costs 2-4x a step, nothing speculative beats plain decoding, and
    the SmolLM2 default (pipeline_cpu) shows the whole pipeline in under an hour."""
    from d3d.utils.hardware import cpu_info, cpu_prefers_bf16

    if cpu_prefers_bf16():
        experiment, stages = "pipeline_qwen", list(STAGES)
        why = "native bf16 on this CPU: the Qwen2.5-Coder-1.5B/0.5B pair in bf16, where speculation pays"
    else:
        experiment, stages = "pipeline_cpu", list(STAGES)
        why = "no native bf16 on this CPU (fp32): the SmolLM2 default; a wide verify pass costs 2-4 steps here"
    return {"experiment": experiment, "stages": stages, "why": why, "cpu": cpu_info()}


def stage_config(stage: str, overrides: list[str], wiring: dict[str, str]):
    """One stage's config: the user's overrides that apply to it, then the paths that wire it to the
    stages before it (quoted: a path may hold any character)."""
    extra = [f"{k}={quoted(v)}" for k, v in wiring.items()]
    return compose(stage, stage_overrides(stage, overrides) + extra)


def wire_stages(overrides: list[str], stages: list[str]):
    """The bound train config and each stage's wiring: prune reads train's final drafter, eval the
    pruned one where there is or will be one (beside the one it was pruned from), else the trained one."""
    # bound (d3d.settings) as the stages will bind them: a bad key fails here, before any stage runs
    train_cfg = bind_config(stage_config("train", overrides, {}), "train")
    trained = resolve_path(train_cfg.train.out_dir) / "final"
    prune_cfg = bind_config(stage_config("prune", overrides, {"drafter.checkpoint": str(trained)}), "prune")
    pruned = resolve_path(prune_cfg.prune.out_dir) / "final"
    drafter_for_eval = pruned if "prune" in stages or pruned.is_dir() else trained
    # a pruned drafter is measured beside the one it was pruned from: rows <method>@unpruned
    beside = {"++eval.also_drafters.unpruned": str(trained)} if drafter_for_eval == pruned else {}
    return train_cfg, {"generate": {}, "train": {}, "prune": {"drafter.checkpoint": str(trained)},
                       "eval": {"drafter.checkpoint": str(drafter_for_eval), **beside}}


def run_pipeline(overrides: list[str], stages: list[str] = list(STAGES), demo: dict | None = None) -> dict:
    from d3d.eval import run_eval
    from d3d.generate import run_generate
    from d3d.prune import run_prune
    from d3d.train import run_train

    runners = {"generate": run_generate, "train": run_train, "prune": run_prune, "eval": run_eval}
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage(s) {', '.join(unknown)}. Fix: choose from {' '.join(STAGES)}.")
    train_cfg, wiring = wire_stages(overrides, stages)
    # The other stages' settings too (train's and prune's are bound above), with ranges and eval's
    # decode files, before the first stage runs: a bad decode.block_size used to fail after
    # generate, train and prune had run (~45 minutes on the CPU default).
    if "generate" in stages:  # the backend and the thinking switch too
        run_generate(stage_config("generate", overrides, wiring["generate"]), check_only=True)
    if "eval" in stages:
        run_eval(stage_config("eval", overrides, wiring["eval"]), check_only=True)
    record_dir = resolve_path(train_cfg.paths.output_dir) / "pipeline" / train_cfg.run_name
    record_dir.mkdir(parents=True, exist_ok=True)
    record = earlier_record(record_dir / "pipeline.json")
    this = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "overrides": overrides,
            **({"demo": demo} if demo else {}), "stages": list(stages)}
    record["invocations"].append(this)
    total = time.perf_counter()
    for stage in stages:
        print(f"\n[d3d.pipeline] ===== {stage} =====", flush=True)
        cfg = stage_config(stage, overrides, wiring[stage])
        start = time.perf_counter()
        out = runners[stage](cfg)
        # the process's peak resident memory so far (a stage's peak is where it first rises)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        record["stages"][stage] = {"wall_s": round(time.perf_counter() - start, 1), "output": str(out),
                                   "peak_rss_gb_so_far": round(peak, 2), "invocation": len(record["invocations"])}
        write_json(record_dir / "pipeline.json", record)
    this["wall_s"] = round(time.perf_counter() - total, 1)
    record["stages"] = {s: record["stages"][s] for s in STAGES if s in record["stages"]}  # pipeline order
    record["stages_wall_s"] = round(sum(v["wall_s"] for v in record["stages"].values()), 1)
    write_json(record_dir / "pipeline.json", record)
    print("\n[d3d.pipeline] stage wall times: " + ", ".join(
        f"{s} {record['stages'][s]['wall_s'] / 60:.1f} min" for s in stages) + f"; total {this['wall_s'] / 60:.1f} min")
    if len(record["stages"]) > len(stages):  # earlier invocations' stages too
        print("[d3d.pipeline] with the earlier invocations' stages (pipeline.json): " + ", ".join(
            f"{s} {v['wall_s'] / 60:.1f} min" for s, v in record["stages"].items())
            + f"; {record['stages_wall_s'] / 60:.1f} min of stages in all")
    if "eval" in stages:
        summary = Path(record["stages"]["eval"]["output"]) / "summary.md"
        print(f"\n{summary}:\n{summary.read_text()}")
    print(f"[d3d.pipeline] record: {record_dir / 'pipeline.json'}")
    return record


def earlier_record(path: Path) -> dict:
    """pipeline.json as earlier invocations on this run left it (a record of an older layout, with
    one invocation's `overrides` at the top, becomes that invocation); a fresh one if none."""
    import json

    if not path.is_file():
        return {"stages": {}, "invocations": []}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:  # written atomically, so only a hand edit gets here: keep it beside
        path.replace(path.with_suffix(".unreadable.json"))
        print(f"[d3d.pipeline] {path} could not be read ({err}); moved to {path.with_suffix('.unreadable.json')}, "
              f"starting a new record", file=sys.stderr)
        return {"stages": {}, "invocations": []}
    if "invocations" not in old:  # the layout before invocations were kept
        first = {k: old[k] for k in ("overrides", "demo", "wall_s") if k in old} | {"stages": list(old.get("stages", {}))}
        old = {"stages": {s: {**v, "invocation": 1} for s, v in old.get("stages", {}).items()}, "invocations": [first]}
    return old


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except USER_ERRORS as err:  # the jobs' one-line form (d3d.config.hydra_job): the message has the fix
        if verbose():
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="python -m d3d.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every stage, e.g. +experiment=pipeline_cpu")
    parser.add_argument("--stages", nargs="+", default=None, help=f"subset of {' '.join(STAGES)}")
    parser.add_argument("--demo", action="store_true",
                        help="the demo this CPU suits (pipeline_qwen with native bf16, else pipeline_cpu); recorded")
    args = parser.parse_args(argv)
    if args.demo:
        demo = demo_choice()
        print(f"[d3d.pipeline] --demo: +experiment={demo['experiment']} ({demo['why']})", flush=True)
        run_pipeline([f"+experiment={demo['experiment']}", *args.overrides], args.stages or demo["stages"], demo)
    else:
        run_pipeline(args.overrides, args.stages or list(STAGES))


if __name__ == "__main__":
    main()
