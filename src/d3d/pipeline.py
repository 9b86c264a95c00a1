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

Each stage runs in a process of its own (a fresh interpreter, multiprocessing's spawn), and so do
the up-front check of every stage's settings and `--demo`'s CPU choice (both import torch): the
command's own process composes configs and waits, so the memory a stage held (weights, allocator
caches, imported libraries) is returned when the stage ends, and each stage's peak resident memory
is its own (`peak_rss_gb` per stage in pipeline.json, and each invocation's `check`, where a fresh
cache converts the models; the run's peak is the largest of them).
docs/reliability.md (Round 7) says why a spawned child rather than `python -m d3d.<stage>`.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import re
import resource
import signal
import sys
import time
from pathlib import Path

from d3d.config import USER_ERRORS, compose, quoted, stage_overrides, verbose
from d3d.errors import ConfigError, UserError
from d3d.utils.io import output_folder, resolve_path, write_json
from d3d.settings import bind_config

STAGES = ("generate", "train", "prune", "eval")
# Each stage's entry point as "module:function", imported in the stage's own process (never here, so this
# process does not hold torch and the models' libraries while the stages run).
RUNNERS = {"generate": "d3d.generate:run_generate", "train": "d3d.train:run_train",
           "prune": "d3d.prune:run_prune", "eval": "d3d.eval:run_eval"}
# The up-front check of every stage's settings, run the same way. On a fresh cache it is the process
# that first resolves the target, so the GGUF conversion (a whole fp32 model) happens, and peaks, in it.
CHECK = "d3d.pipeline:check_stages"


class StageError(UserError):
    """A stage stopped on a user error (its one line, passed up from the stage's process)."""


class StageCrashed(RuntimeError):
    """A stage's process ended without a result: a bug (its traceback is above) or a signal."""


def peak_rss_gb() -> float:
    """This process's peak resident memory, in GiB (2**30 bytes: the `peak_rss_gb` keys of pipeline.json
    are GiB, record["peak_rss_unit"] says so). On Linux VmHWM, the high-water mark of this program's
    own memory: ru_maxrss of a spawned child starts at the parent's RSS (it is carried over the
    fork that precedes the exec), so it would count the pipeline's process in every stage."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 2**20
    except (OSError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB on Linux


def _die_with(parent: int) -> None:
    """A stage's process ends with the pipeline's (a killed pipeline used to take its stage with it, as
    one process): otherwise a rerun would meet the orphan's folder lock. Linux only (prctl)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the pipeline died before the line above
        os._exit(1)


def _child(conn, parent: int, runner: str, cfg, kwargs: dict) -> None:
    """The body of a stage's process: run `runner(cfg, **kwargs)` and send back its output folder, its
    one-line error if it stopped on a user error, and its own peak memory. A bug raises on (the
    traceback goes to stderr, and the pipeline sees no result)."""
    _die_with(parent)
    module, name = runner.split(":")
    try:
        out = getattr(importlib.import_module(module), name)(cfg, **kwargs)
        result = {"output": out if out is None or isinstance(out, dict) else str(out)}
    except USER_ERRORS as err:
        if verbose():
            raise
        result = {"error": " ".join(str(err).split())}
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal: the pipeline's says it once
        sys.exit(130)
    conn.send({**result, "pid": os.getpid(), "peak_rss_gb": round(peak_rss_gb(), 3)})
    conn.close()


def in_own_process(what: str, runner: str, cfg, **kwargs) -> dict:
    """Run one stage (or the up-front check) in a fresh interpreter and wait for it: {output, pid,
    peak_rss_gb}. Its user error is raised here as a StageError (the same one line); a process that
    ends with no result is a StageCrashed naming its exit status or signal."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's memory and locks
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, os.getpid(), runner, cfg, kwargs), name=f"d3d.pipeline {what}")
    proc.start()
    send.close()  # so that receive sees EOF when the child dies without a result
    try:
        try:
            result = receive.recv()
        except EOFError:
            result = None
        proc.join()
    finally:
        if proc.is_alive():  # interrupted here (Ctrl-C reaches the child too): do not leave it behind
            proc.terminate()
            proc.join()
    if result is None:
        code = proc.exitcode
        if code == 130:  # the stage was interrupted (Ctrl-C) before this process saw it
            raise KeyboardInterrupt
        named = {int(sig): sig.name for sig in signal.Signals}
        how = (f"was killed by signal {named.get(-code, -code)}" if code is not None and code < 0
               else f"ended with exit status {code}")
        if code == -signal.SIGKILL:
            how += " (the kernel's out-of-memory killer sends it when memory runs out)"
        raise StageCrashed(f"the {what} process {how} without a result (a traceback above is its own). Fix: if "
                           f"it was killed, rerun the same command: every stage resumes where it stopped.")
    if "error" in result:
        raise StageError(result["error"])
    return result


def demo_choice(_cfg=None) -> dict:
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
    extra = [f"{k}={quoted(v, k)}" for k, v in wiring.items()]
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


def check_stages(cfgs: dict) -> None:
    """The up-front check of the stages that bind more than their config (generate: the backend and
    the thinking switch; train: the draft vocabulary; eval: the decode files, the memory bound, the sandbox, the template), run
    in a process of its own like the stages: it imports torch and reads tokenizers."""
    from d3d.eval import run_eval
    from d3d.generate import run_generate

    checks = {"generate": run_generate, "train": check_train, "eval": run_eval}
    for stage, cfg in cfgs.items():
        checks[stage](cfg, check_only=True)


def check_train(cfg, check_only: bool = True) -> None:
    """train's settings that need the target's tokenizer and config.json: drafter.draft_vocab against
    its vocabulary (it used to fail when train started, after generation had run)."""
    from d3d.models.drafter import check_draft_vocab_spec

    typed = bind_config(cfg, "train")
    check_draft_vocab_spec(typed.drafter, typed.target, resolve_path(typed.paths.cache_dir), responses=True)


def run_pipeline(overrides: list[str], stages: list[str] = list(STAGES), demo: dict | None = None) -> dict:
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        hint = (" and put the overrides before --stages (`--stages` takes every word after it)"
                if any("=" in s for s in unknown) else "")
        raise ConfigError(f"unknown stage(s) {', '.join(unknown)}. Fix: choose from {' '.join(STAGES)}{hint}.")
    # in the pipeline's order, each once: `--stages eval prune` ran eval first, on a pruned drafter not made yet
    stages = [s for s in STAGES if s in stages]
    train_cfg, wiring = wire_stages(overrides, stages)
    record_dir = resolve_path(train_cfg.paths.output_dir) / "pipeline" / train_cfg.run_name
    output_folder(record_dir, "paths.output_dir")  # before any stage: it used to fail after the first one
    # The other stages' settings too (train's and prune's are bound above), with ranges and eval's
    # decode files, before the first stage runs: a bad decode.block_size used to fail after
    # generate, train and prune had run (~45 minutes on the CPU default).
    checked = {s: stage_config(s, overrides, wiring[s]) for s in ("generate", "train", "eval") if s in stages}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    check = {}
    if checked:
        start = time.perf_counter()
        ran = in_own_process("up-front check", CHECK, checked)
        check = {"check": {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_gb": ran["peak_rss_gb"],
                           "pid": ran["pid"]}}
    record = earlier_record(record_dir / "pipeline.json")
    this = {"started": started, "overrides": overrides, **({"demo": demo} if demo else {}), "stages": list(stages),
            **check}
    record["invocations"].append(this)
    total = time.perf_counter()
    for stage in stages:
        print(f"\n[d3d.pipeline] ===== {stage} =====", flush=True)
        cfg = stage_config(stage, overrides, wiring[stage])
        start = time.perf_counter()
        ran = in_own_process(f"{stage} stage", RUNNERS[stage], cfg)
        # the stage's own peak resident memory (its process's), and the process it ran in
        record["stages"][stage] = {"wall_s": round(time.perf_counter() - start, 1), "output": ran["output"],
                                   "peak_rss_gb": ran["peak_rss_gb"], "pid": ran["pid"],
                                   "invocation": len(record["invocations"])}
        write_json(record_dir / "pipeline.json", record)
    this["wall_s"] = round(time.perf_counter() - total, 1)
    # this process only composes and waits; it runs beside each stage, so the machine holds both
    this["pipeline_process_peak_rss_gb"] = round(peak_rss_gb(), 3)
    record["stages"] = {s: record["stages"][s] for s in STAGES if s in record["stages"]}  # pipeline order
    record["stages_wall_s"] = round(sum(v["wall_s"] for v in record["stages"].values()), 1)
    # older records lack them; the checks' too: the one that converted the models may be the largest
    peaks = [v["peak_rss_gb"] for v in [*record["stages"].values(), *(i.get("check", {}) for i in record["invocations"])]
             if "peak_rss_gb" in v]
    if peaks:
        record["peak_rss_gb"] = max(peaks)  # the run's peak: its largest process's
        record["peak_rss_unit"] = "GiB"  # 2**30 bytes (VmHWM's kB / 2**20); 12 GiB = 12.9 GB
    write_json(record_dir / "pipeline.json", record)
    print("\n[d3d.pipeline] stage wall times (peak memory): " + ", ".join(
        f"{s} {record['stages'][s]['wall_s'] / 60:.1f} min ({record['stages'][s]['peak_rss_gb']:.1f} GiB)" for s in stages)
        + f"; total {this['wall_s'] / 60:.1f} min"
        + (f"; the up-front check {check['check']['peak_rss_gb']:.1f} GiB" if check else ""))
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

    if path.is_dir():  # checked before any stage: writing the record came after the first one
        raise ConfigError(f"{path} is a folder, not the pipeline's record. Fix: move it away (the record is "
                          f"written there).")
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
    except StageCrashed as err:  # the stage printed its own traceback, if any; say which stage and what next
        if verbose():
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        if verbose():
            raise
        print("\n[d3d.pipeline] interrupted: rerun the same command to resume every stage where it stopped",
              file=sys.stderr, flush=True)
        sys.exit(130)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="python -m d3d.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every stage, e.g. +experiment=pipeline_cpu")
    parser.add_argument("--stages", nargs="+", default=None, help=f"subset of {' '.join(STAGES)}")
    parser.add_argument("--demo", action="store_true",
                        help="the demo this CPU suits (pipeline_qwen with native bf16, else pipeline_cpu); recorded")
    args = parser.parse_args(argv)
    if args.demo:
        # asked in a process of its own too: reading the CPU's capability imports torch
        demo = in_own_process("demo choice", "d3d.pipeline:demo_choice", None)["output"]
        print(f"[d3d.pipeline] --demo: +experiment={demo['experiment']} ({demo['why']})", flush=True)
        run_pipeline([f"+experiment={demo['experiment']}", *args.overrides], args.stages or demo["stages"], demo)
    else:
        run_pipeline(args.overrides, args.stages or list(STAGES))


if __name__ == "__main__":
    main()
