"""One named sweep per claim of the paper: run it (resumable), then write a table and a plot.

    python scripts/sweep.py ar_loss        # λ in {0, 0.5, 1, 2} -> τ per benchmark
    python scripts/sweep.py budget         # C in {4,8,12,16} x F in {1,2,5} -> packed tokens, hit rate, speedup
    python scripts/sweep.py pruning        # layers removed -> τ retention and speedup
    python scripts/sweep.py async_vs_sync  # speedup and hit rate per benchmark
    python scripts/sweep.py load           # speedup and throughput against concurrency 1..16
    python scripts/sweep.py block_size     # B in {4, 8, 16} -> τ and speedup
    python scripts/sweep.py recipe +experiment=pipeline_cpu   # one train.* change per arm, equal wall
                                           # time -> held-out τ per CPU-minute (--arms to choose them)
    python scripts/sweep.py ar_loss --preset gpu             # the paper's sizes, each arm over this node's GPUs
    python scripts/sweep.py ar_loss --preset gpu --hydra-launcher slurm hydra.launcher.partition=gpu
                                           # each arm a SLURM job (conf/hydra/launcher/slurm.yaml), arms at once
    options: --preset quick|cpu|gpu (default cpu: the sizes docs/results.md reports; quick: minutes,
             rough; gpu: the paper's, under `accelerate launch`), --drafter <checkpoint> (default: the
             CPU default's), --dry-run (print the commands), --skip-eval (training sweeps: held-out τ
             only), --out <folder>, --publish (also copy the table, plot and data into docs/results/),
             and trailing Hydra overrides for every command (e.g. +experiment=smoke
             paths.root_dir=/tmp/x for a seconds-long test).

Each arm (one value of the swept key) is one command: training arms write checkpoints/sweeps/<claim>/<arm>,
evaluations outputs/sweeps/<claim>/eval/<arm>, Hydra's logs of each go to outputs/sweeps/<claim>/hydra/.
Every stage resumes, so rerunning a killed sweep continues it. The table (<claim>.md), plot (<claim>.png)
and data (<claim>.json) go to a new outputs/sweeps/<claim>/<date_time>/ (or --out); docs/results/ is the
curated record and changes only with --publish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from d3d.config import quoted, stage_overrides
from d3d.configdir import config_dir
from d3d.errors import ConfigError
from d3d.decoding.methods import METHODS, ROLES
from d3d.report import read_rows, summarise
from d3d.utils.plotting import pyplot, save_figure
from d3d.utils.io import output_folder, read_jsonl

# Sizes per preset; cpu = what docs/results.md reports (hours on 2 cores in all), quick = minutes, gpu = the
# paper's. Training sweeps run a fixed number of steps so every value sees the same batches whatever else the
# machine is doing; train_minutes is only a safety cap (a capped run shows fewer steps in the table).
# None leaves a key to the experiment overlay: the gpu preset composes +experiment=qwen3_8b (unless the
# command line names another), whose train.max_steps (20k) and eval.max_new_tokens (2048) are the paper's,
# and eval.n unset runs each benchmark's seeded subset of conf/benchmark/ (docs/design.md, Evaluation).
PRESETS = {
    "cpu": {"experiment": None, "train_steps": 80, "train_minutes": 60, "n": 6, "max_new": 96, "suite": "all", "suite_n": 2,
            "prune_layers": 2, "concurrency": "[1,2,4,8]", "load_n": 8, "load_suite": "gsm8k",
            # the paper's grid, C in {4, 8, 12, 16} x F in {1, 2, 5}: 12 async methods, so fewer, shorter items
            "budgets": [f"{C}x{F}" for C in (4, 8, 12, 16) for F in (1, 2, 5)], "budget_n": 2, "budget_max_new": 64,
            "budget_suite": "gsm8k",
            # the recipe study: equal wall time per arm (the axis is τ per CPU-minute, so run it alone on the
            # machine), steps uncapped; "base" is the recipe the trailing overrides compose, unchanged.
            # trainable_from_layer=15 is the upper half of SmolLM2's 30 layers (pass --arms for another model).
            "recipe_minutes": 10, "recipe_steps": 100_000, "recipe_val_tokens": 160,
            "arms": ["base", "train.lr=1e-4", "train.anchors_per_seq=32", "train.gamma=3", "train.trainable_from_layer=15"]},
    "quick": {"experiment": None, "train_steps": 10, "train_minutes": 3, "n": 2, "max_new": 48, "suite": "gsm8k", "suite_n": 2,
              "prune_layers": 1, "concurrency": "[1,2,4]", "load_n": 4, "load_suite": "gsm8k",
              "budgets": ["4x1", "8x2"], "budget_n": 2, "budget_max_new": 48, "budget_suite": "gsm8k",
              # a step cap: the quick preset's arms are compared at equal steps (deterministic, for tests)
              "recipe_minutes": 3, "recipe_steps": 3, "recipe_val_tokens": 16,
              "arms": ["base", "train.lr=1e-4", "train.anchors_per_seq=8", "train.trainable_from_layer=1"]},
    # the paper's setting: the budget study on AIME25 and the load test on MATH-500 (its figures), pruning
    # 5 layers (5 of 36 kept > 99 % of τ), concurrency up to 16 requests, every item of each subset
    "gpu": {"experiment": "qwen3_8b", "train_steps": None, "train_minutes": None, "n": None, "max_new": None,
            "suite": "all", "suite_n": None, "prune_layers": 5, "concurrency": "[1,2,4,8,16]", "load_n": None,
            "load_suite": "math500", "budgets": [f"{C}x{F}" for C in (4, 8, 12, 16) for F in (1, 2, 5)],
            "budget_n": None, "budget_max_new": None, "budget_suite": "aime25",
            # equal GPU wall time per arm; trainable_from_layer=14 is the upper half of Qwen3-1.7B's 28 layers
            "recipe_minutes": 120, "recipe_steps": 20_000, "recipe_val_tokens": None,
            "arms": ["base", "train.lr=1e-4", "train.anchors_per_seq=64", "train.gamma=3", "train.trainable_from_layer=14"]},
}
DEFAULT_DRAFTER = "checkpoints/cpu_default_lam1/final"
# The rows the claims evaluate, by role in the method table (d3d.decoding.methods.ROLES): the plain
# loop (the speedups' baseline), the drafted loop without trays, and the first row with trays; a
# claim's columns are named after them (e.g. <drafted>_speedup)
PLAIN, DRAFTED, TRAYS = (ROLES[role] for role in ("plain", "drafted", "trays"))
WITHOUT_TRAYS = f"eval.methods=[{PLAIN},{DRAFTED}]"
WITH_TRAYS = f"eval.methods=[{PLAIN},{DRAFTED},{TRAYS}]"


@dataclass(frozen=True)
class Launcher:
    """Where one arm's command runs. gpus = 0: one process here (the CPU presets); gpus > 0: `accelerate
    launch` over this node's GPUs, training and pruning under conf/accelerate/<accelerate>.yaml, evaluation
    under ddp.yaml (its ranks shard the items, docs/design.md); hydra_launcher: a one-job Hydra multirun
    through conf/hydra/launcher/<name>.yaml (a scheduler job that takes its GPUs from that file)."""
    gpus: int = 0
    accelerate: str = "ddp"
    hydra_launcher: str | None = None

    def argv(self, job: str, logs: Path, args: list[str]) -> list[str]:
        """The command of one arm of `job` (d3d.<job>), its Hydra folder `logs`, and its overrides."""
        if self.hydra_launcher:
            # one job: its folder is `logs` itself (the override-named subfolder would pass 255 characters);
            # its tasks are DDP's unless training and pruning shard otherwise (fsdp: each task gets FSDP2's variables)
            shard = [f"hydra.callbacks.distributed_tasks.accelerate={self.accelerate}"] \
                if job in ("train", "prune") and self.accelerate != "ddp" else []
            return [sys.executable, "-m", f"d3d.{job}", "-m", f"hydra/launcher={self.hydra_launcher}",
                    path_override("hydra.sweep.dir", logs), "hydra.sweep.subdir=job", *shard, *args]
        if self.gpus:
            config = self.accelerate if job in ("train", "prune") else "ddp"
            head = ["accelerate", "launch", "--config_file", str(Path(config_dir()) / "accelerate" / f"{config}.yaml"),
                    "--num_processes", str(self.gpus), "-m", f"d3d.{job}"]
        else:
            head = [sys.executable, "-m", f"d3d.{job}"]
        return [*head, path_override("hydra.run.dir", logs), *args]


def override_key(override: str) -> str:
    """The config key of a Hydra override: `++eval.n=3`, `+eval.n=3`, `~eval.n` and `eval.n=3` all
    name eval.n (so a prefixed override cannot slip past the sweep's own keys)."""
    return override.split("=", 1)[0].lstrip("+~")


class Sweep:
    def __init__(self, claim: str, preset: dict, drafter: str, extra: list[str], root: Path, dry: bool,
                 skip_eval: bool = False, launcher: Launcher = Launcher()):
        self.claim, self.p, self.drafter, self.extra, self.dry = claim, preset, drafter, extra, dry
        self.skip_eval = skip_eval  # training sweeps: held-out τ from training only, no benchmark runs
        self.launcher = launcher
        self.outputs = root / "outputs" / "sweeps" / claim
        self.ckpts = root / "checkpoints" / "sweeps" / claim
        self.commands: list[list[str]] = []  # every command, in order (what --dry-run prints)
        self.pending: list[list[str]] | None = None  # inside together(): the stage's commands, not yet run

    def run(self, job: str, name: str, *overrides: str, fixed: tuple[str, ...] = ()) -> None:
        """One arm, `name`, of `job`. `overrides` are defaults the trailing command-line overrides may
        change (eval.n=3 wins); `fixed` are what the sweep varies or where it writes: they come last, and
        an extra override of the same key is dropped with a note rather than silently measuring something else."""
        extra = stage_overrides(job, self.extra)  # only the keys this job has (as d3d.pipeline does)
        owned = {override_key(o) for o in fixed}
        for o in [o for o in extra if override_key(o) in owned]:
            print(f"note: the {self.claim} sweep sets {override_key(o)} itself; ignoring {o}", flush=True)
        extra = [o for o in extra if override_key(o) not in owned]
        cmd = self.launcher.argv(job, self.outputs / "hydra" / f"{job}_{name}", [*overrides, *extra, *fixed])
        self.commands.append(cmd)
        print("$ " + shlex.join("python" if c == sys.executable else c for c in cmd), flush=True)
        if self.dry:
            return
        if self.pending is not None:
            self.pending.append(cmd)
        else:
            subprocess.run(cmd, check=True)

    @contextlib.contextmanager
    def together(self):
        """The arms run inside are independent (one stage of the sweep). Here or on one node they run one
        after another; under a scheduler's Hydra launcher each command only waits for its job, so they are
        all submitted at once and the stage ends when every job has."""
        self.pending = []
        try:
            yield
            if self.launcher.hydra_launcher:
                procs = [subprocess.Popen(cmd) for cmd in self.pending]
                failed = [shlex.join(cmd[1:]) for cmd, proc in zip(self.pending, procs) if proc.wait() != 0]
                if failed:
                    raise subprocess.CalledProcessError(1, failed[0])
            else:
                for cmd in self.pending:
                    subprocess.run(cmd, check=True)
        finally:
            self.pending = None

    def train_budget(self) -> list[str]:
        return given(("train.max_steps", self.p["train_steps"]), ("train.max_minutes", self.p["train_minutes"]))

    def eval(self, name: str, drafter: str, *overrides: str, fixed: tuple[str, ...] = (), n: int | None = None,
             max_new: int | None = None, suite: str = "gsm8k") -> Path:
        out = self.outputs / "eval" / name
        self.run("eval", name, f"benchmark={suite}",
                 *given(("eval.n", n or self.p["n"]), ("eval.max_new_tokens", max_new or self.p["max_new"])),
                 *overrides, fixed=(path_override("drafter.checkpoint", drafter), path_override("eval.out_dir", out), *fixed))
        return out


def path_override(key: str, path: str | Path) -> str:
    """`key=<path>` read back by the job as exactly `path`, whatever the root holds (d3d.config.quoted)."""
    return f"{key}={quoted(str(path), key)}"


def given(*pairs: tuple[str, object]) -> list[str]:
    """`key=value` for the preset's sizes that are set; None leaves the key to the experiment overlay."""
    return [f"{k}={v}" for k, v in pairs if v is not None]


# ---------------------------------------------------------------------------- the six claims


def ar_loss(sw: Sweep) -> dict:
    lams = ["0.0", "0.5", "1.0", "2.0"]
    with sw.together():
        for lam in lams:
            sw.run("train", f"lam{lam}", *sw.train_budget(),
                   fixed=(f"train.ar_weight={lam}", path_override("train.out_dir", sw.ckpts / f"lam{lam}")))
    with sw.together():
        evs = {lam: None if sw.skip_eval else sw.eval(f"lam{lam}", f"{sw.ckpts}/lam{lam}/final", WITHOUT_TRAYS,
                                                      n=sw.p["suite_n"], suite=sw.p["suite"]) for lam in lams}
    rows = []
    for lam, ev in evs.items():
        if sw.dry:
            continue
        row = {"lambda": float(lam), **trained(sw.ckpts / f"lam{lam}")}
        if ev is not None:
            s = summarise(read_rows(ev))
            row.update({f"tau_{b}": per[DRAFTED]["tau_token_weighted"] for b, per in s["benchmarks"].items()})
        rows.append(row)
    return {"rows": rows, "x": "lambda", "plot": [k for k in (rows[0] if rows else {}) if k.startswith("tau_") or k == "val_tau"]}


def budget(sw: Sweep) -> dict:
    budgets = sw.p["budgets"]
    ev = sw.eval("budgets", sw.drafter, WITH_TRAYS, fixed=(f"eval.async_budgets=[{','.join(budgets)}]",),
                 n=sw.p["budget_n"], max_new=sw.p["budget_max_new"], suite=sw.p["budget_suite"])
    if sw.dry:
        return {"rows": []}
    s = summarise(read_rows(ev))
    methods = json.loads((ev / "run.json").read_text())["methods"]
    rows = []
    for name, info in methods.items():
        if not METHODS[info["method"]].needs_drafter:
            continue
        per = [b[name] for b in s["benchmarks"].values() if name in b]
        # run.json records the keys a method reads: sync has no trays (C = 1 covered slot, F = 0 alternatives)
        rows.append({"method": name, "C": info.get("C", 1), "F": info.get("F", 0),
                     "packed_tokens": info["budget"],
                     "hit_rate": per[0]["hit_rate"], "tau": per[0]["tau_token_weighted"],
                     "speedup": per[0]["speedup_token_weighted"]})
    # one line per F (F = 0 is the sync loop: no packed pass) over the packed tokens C sets
    return {"rows": sorted(rows, key=lambda r: (r["F"], r["packed_tokens"])), "x": "packed_tokens", "series": "F",
            "plot": ["speedup", "hit_rate"]}


def pruning(sw: Sweep) -> dict:
    out = sw.ckpts / "acceptance"
    sw.run("prune", "acceptance", f"prune.num_layers={sw.p['prune_layers']}", "prune.min_retention=0",
           fixed=(path_override("drafter.checkpoint", sw.drafter), path_override("prune.out_dir", out)))
    rows = []
    steps = [] if sw.dry else list(read_jsonl(out / "steps.jsonl"))
    removed = range(sw.p["prune_layers"] + 1)
    with sw.together():
        evs = [sw.eval(f"step{k}", sw.drafter if k == 0 else f"{out}/step_{k}", WITH_TRAYS)
               for k in removed]
    for k, ev in zip(removed, evs):
        if sw.dry:
            continue
        s = summarise(read_rows(ev))["benchmarks"]["gsm8k"]
        st = steps[k]
        held = {"holdout_tau": st["holdout_tau"]} if "holdout_tau" in st else {}  # with prune.holdout_size
        rows.append({"removed": k, "layers": st["layers"], "calib_tau": st["tau"], **held, "retention": st["retention"],
                     "draft_ms": st["draft_latency_ms"], "eval_tau": s[DRAFTED]["tau_token_weighted"],
                     **{f"{m}_speedup": s[m]["speedup_token_weighted"] for m in (DRAFTED, TRAYS)}})
    return {"rows": rows, "x": "removed", "plot": ["retention", f"{DRAFTED}_speedup", f"{TRAYS}_speedup"]}


def async_vs_sync(sw: Sweep) -> dict:
    ev = sw.eval("suite", sw.drafter, WITH_TRAYS, n=sw.p["suite_n"], suite=sw.p["suite"])
    if sw.dry:
        return {"rows": []}
    s = summarise(read_rows(ev))
    rows = [{"benchmark": b, "tau": per[DRAFTED]["tau_token_weighted"],
             **{f"{m}_speedup": per[m]["speedup_token_weighted"] for m in (DRAFTED, TRAYS)},
             "hit_rate": per[TRAYS]["hit_rate"], "equal_to_ar": min(per[m]["equal_to_ar"] for m in (DRAFTED, TRAYS))}
            for b, per in s["benchmarks"].items()]
    return {"rows": rows, "x": "benchmark", "plot": [f"{DRAFTED}_speedup", f"{TRAYS}_speedup"]}


def load(sw: Sweep) -> dict:
    ev = sw.eval("load", sw.drafter, WITH_TRAYS, fixed=(f"eval.concurrency={sw.p['concurrency']}",),
                 n=sw.p["load_n"], suite=sw.p["load_suite"])
    if sw.dry:
        return {"rows": []}
    table = summarise(read_rows(ev))["load"]
    rows = [{"concurrency": int(c), "method": m, "tokens_per_s": v["tokens_per_s"], "speedup": v["speedup_token_weighted"],
             "tau": v["tau_token_weighted"], "hit_rate": v["hit_rate"]} for c, per in table.items() for m, v in per.items()]
    return {"rows": rows, "x": "concurrency", "series": "method", "plot": ["speedup", "tokens_per_s"]}


def block_size(sw: Sweep) -> dict:
    sizes = [4, 8, 16]
    with sw.together():
        for B in sizes:
            sw.run("train", f"B{B}", *sw.train_budget(), fixed=(f"drafter.block_size={B}", path_override("train.out_dir", sw.ckpts / f"B{B}")))
    with sw.together():
        evs = {B: None if sw.skip_eval else sw.eval(f"B{B}", f"{sw.ckpts}/B{B}/final", WITHOUT_TRAYS,
                                                    fixed=(f"decode.block_size={B}",)) for B in sizes}
    rows = []
    for B, ev in evs.items():
        if sw.dry:
            continue
        row = {"B": B, **trained(sw.ckpts / f"B{B}")}
        if ev is not None:
            s = summarise(read_rows(ev))["benchmarks"]["gsm8k"][DRAFTED]
            row.update(tau=s["tau_token_weighted"], speedup=s["speedup_token_weighted"])
        rows.append(row)
    return {"rows": rows, "x": "B", "plot": ["val_tau"] if sw.skip_eval else ["tau", "speedup"]}


def recipe(sw: Sweep) -> dict:
    """What buys held-out τ per CPU-minute. Each arm trains from the same initial drafter on the same
    responses, batches and seed for the same wall time, changing one train.* key of the base recipe
    (the trailing overrides). τ is evaluated at step 0 and when the budget runs out only, so evaluation
    costs no arm training time; s/step is the arm's own (more anchors cost more per step)."""
    m, cap = sw.p["recipe_minutes"], sw.p["recipe_steps"]
    outs = {}
    with sw.together():
        for arm in sw.p["arms"]:
            change = () if arm == "base" else tuple(arm.split())
            # its folder: train.lr=1e-4 -> lr_1e-4 (a path Hydra's override grammar takes unquoted)
            name = "base" if arm == "base" else "__".join(override_key(c).split(".")[-1] + "_" + c.split("=", 1)[1]
                                                           for c in change)
            outs[arm] = out = sw.ckpts / name
            sw.run("train", name, *given(("train.val_max_new_tokens", sw.p["recipe_val_tokens"])),
                   fixed=(f"train.max_minutes={m}", f"train.max_steps={cap}", f"train.eval_every={cap}",
                          path_override("train.out_dir", out), *change))
    rows = []
    for arm, out in outs.items():
        if sw.dry:
            continue
        history = list(read_jsonl(out / "metrics.jsonl"))
        acc = [r for r in history if "val_tau" in r][-1]["val_slot_accuracy"]
        timed = [r for r in history if "elapsed_s" in r][-1]  # the last step's training wall time
        run = trained(out)
        rows.append({"arm": arm, **run, "s_per_step": round(timed["elapsed_s"] / timed["step"], 2),
                     "p_first": acc[0], "p_first_2": acc[1] if len(acc) > 1 else None,
                     "tau_gain": round(run["val_tau"] - run["val_tau_first"], 4)})
    return {"rows": rows, "x": "arm", "plot": ["val_tau", "s_per_step"]}


def trained(run: Path) -> dict:
    """What a training run of a sweep reports: steps done and held-out τ before and after."""
    summary = json.loads((run / "summary.json").read_text())
    return {"steps": summary["steps"], "val_tau_first": summary["val_tau_first"], "val_tau": summary["val_tau_last"]}


CLAIMS = {f.__name__: f for f in (ar_loss, budget, pruning, async_vs_sync, load, block_size, recipe)}

# ---------------------------------------------------------------------------- outputs


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    keys = list(rows[0])
    fmt = lambda v: "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path | None:
    rows, x, ys = result["rows"], result.get("x"), result.get("plot", [])
    if not rows or not ys:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ys), figsize=(4.2 * len(ys), 3.6), squeeze=False)
    series = result.get("series")
    groups = sorted({r[series] for r in rows}) if series else [None]
    for ax, y in zip(axes[0], ys):
        for g in groups:
            rs = [r for r in rows if series is None or r[series] == g]
            xs = [r[x] for r in rs]
            vals = [r.get(y) if r.get(y) is not None else float("nan") for r in rs]
            if isinstance(xs[0], str):
                ax.bar(range(len(xs)), vals)
                ax.set_xticks(range(len(xs)), xs, rotation=20)
            else:
                ax.plot(xs, vals, "o-", label=g)
        ax.set_title(y)
        ax.set_xlabel(x)
        if series:
            ax.legend(fontsize=7, title=series)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("claim", choices=sorted(CLAIMS))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="trained drafter checkpoint the eval sweeps use")
    ap.add_argument("--root", default=".", help="where outputs/ and checkpoints/ go (matches paths.root_dir)")
    ap.add_argument("--out", help="the table, plot and data (default: a new outputs/sweeps/<claim>/<date_time>/)")
    ap.add_argument("--publish", action="store_true", help="also copy them into docs/results/ (the curated record)")
    ap.add_argument("--gpus", type=int, help="gpu preset: processes per arm (default: the GPUs this machine sees)")
    ap.add_argument("--accelerate", default="ddp", help="gpu preset and --hydra-launcher: conf/accelerate/<name>.yaml "
                                                        "for training and pruning arms (fsdp for an 8B drafter; "
                                                        "evaluation uses ddp)")
    ap.add_argument("--hydra-launcher", help="run each arm as a job of conf/hydra/launcher/<name>.yaml (slurm, local), "
                                             "the arms of a stage at once")
    ap.add_argument("--budgets", nargs="+", help="budget sweep: C x F values instead of the preset's (e.g. 16x5)")
    ap.add_argument("--arms", nargs="+", help="recipe sweep: the arms instead of the preset's, each 'base' or "
                                              "space-separated train.* overrides (e.g. 'train.lr=1e-4' 'train.gamma=3')")
    ap.add_argument("--minutes", type=float, help="recipe sweep: each arm's wall-time budget instead of the preset's")
    ap.add_argument("--skip-eval", action="store_true",
                    help="ar_loss / block_size: train, then report the held-out τ of training only (no benchmark evals)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every command")
    args = ap.parse_intermixed_args(argv)
    if not args.dry_run and args.claim not in ("ar_loss", "block_size", "recipe") and not Path(args.drafter).is_dir():
        ap.error(f"--drafter {args.drafter} does not exist: train one first (python -m d3d.train) or pass --drafter")
    bad = [a for a in args.arms or [] if a != "base" and not all(c.startswith("train.") and "=" in c for c in a.split())]
    if bad:
        ap.error(f"--arms {bad[0]!r}: an arm is 'base' or train.<key>=<value> overrides (e.g. train.lr=1e-4)")
    preset = dict(PRESETS[args.preset], **({"budgets": args.budgets} if args.budgets else {}),
                  **({"arms": args.arms} if args.arms else {}), **({"recipe_minutes": args.minutes} if args.minutes else {}))
    overrides = list(args.overrides)
    if preset["experiment"] and not any(override_key(o) == "experiment" for o in overrides):
        overrides.insert(0, f"+experiment={preset['experiment']}")
    sw = Sweep(args.claim, preset, args.drafter, overrides, Path(args.root).resolve(), args.dry_run, args.skip_eval,
               launcher(ap, args))
    try:
        if not args.dry_run:  # a root that is a file, or read-only, failed in every arm's Hydra folder
            output_folder(sw.outputs.parents[2], "--root")
        result = CLAIMS[args.claim](sw)
    except ConfigError as err:  # a path the jobs' override grammar cannot carry: one line, as the jobs say it
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except subprocess.CalledProcessError as err:  # the arm said why above (its one line or its traceback)
        arm = shlex.join(["python" if c == sys.executable else c for c in err.cmd][:3])
        print(f"error: the arm `{arm} …` stopped with exit status {err.returncode} (its message is above). Fix: "
              f"correct what it says and rerun the same command: finished arms and steps are kept.", file=sys.stderr,
              flush=True)
        sys.exit(err.returncode if 0 < err.returncode < 128 else 1)
    if args.dry_run:
        return {**result, "commands": sw.commands}
    out = Path(args.out) if args.out else sw.outputs / time.strftime("%Y-%m-%d_%H-%M-%S")
    written = write_result(args.claim, result, out, {"preset": args.preset, "command": " ".join(sys.argv)})
    if args.publish:
        docs = Path("docs") / "results"
        docs.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy2(path, docs / path.name)
    print(f"\n{markdown(result['rows'])}\nwritten: " + ", ".join(map(str, written))
          + (f" (and copied into {Path('docs') / 'results'})" if args.publish else ""))
    return result


def launcher(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Launcher:
    """The CPU presets run each arm as one process; the gpu preset over every GPU of the node, or as
    scheduler jobs (which take their GPUs from the launcher's file, so --gpus does not apply)."""
    if not (Path(config_dir()) / "accelerate" / f"{args.accelerate}.yaml").is_file():
        ap.error(f"--accelerate {args.accelerate}: no conf/accelerate/{args.accelerate}.yaml. Fix: one of ddp, fsdp, "
                 "deepspeed_zero2, deepspeed_zero3")
    if args.hydra_launcher:
        return Launcher(accelerate=args.accelerate, hydra_launcher=args.hydra_launcher)
    if args.preset != "gpu":
        return Launcher()
    gpus = args.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < 1:
        ap.error("--preset gpu: no GPU visible here. Fix: run it on a GPU node, pass --gpus N, or submit the "
                 "arms with --hydra-launcher slurm")
    return Launcher(gpus=gpus, accelerate=args.accelerate)


def write_result(claim: str, result: dict, out: Path, how: dict) -> list[Path]:
    """<claim>.md, <claim>.json (with `how` it was run) and, when there is something to draw, <claim>.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{claim}.md").write_text(markdown(result["rows"]))
    (out / f"{claim}.json").write_text(json.dumps({"claim": claim, **how, **result}, indent=2))
    png = plot(result, out / f"{claim}.png")
    return [out / f"{claim}.md", out / f"{claim}.json", *([png] if png else [])]


if __name__ == "__main__":
    main()
