"""The GPU check: one script to run whenever a GPU is lent (about 12 minutes on one H200 by its
estimate, printed at start, inputs in `Estimate` below; the budget guard keeps it inside the timeout;
`--budget-s 540` fits a 10-minute slot by leaving the last stages, compiled_equal and
compiled_timing, skipped).

    PYTHONPATH=src timeout 780 python3 scripts/gpu_check.py --out-dir $OUT   # on the GPU machine
    python scripts/gpu_check.py --device cpu --toy --out-dir /tmp/gc          # what the tests run

A runner: the contract checks are the `gpu`-marked tests of tests/integration/test_gpu.py, which it
runs with pytest in this process, one stage's tests at a time, between its own timing stages. It
needs torch, transformers, accelerate and pytest only (no Hydra, OmegaConf or datasets, which the
GPU machines lack) and builds every model from a config with random weights (no hub,
d3d.models.random_models). Every stage is recorded in <out-dir>/gpu_check.json as it starts, after
each of its sub-steps (a test, or a timing step) and when it ends, so a crash, a kill or a timeout
keeps every sub-step that finished (a failing stage is recorded and the next one runs). Each stage
ends with a status: ok, failed (its own checks failed) or skipped (no CUDA, or `--budget-s`: a
stage whose estimate does not fit in the time left is not started).

1. greedy          tests: ar / sync / async / tree greedy on the tiny random Qwen3 in fp32, batch 1 and
                   a ragged batch, against transformers' generate (no "real" divergence); sync /
                   async / tree again with a causal-block drafter and with a draft vocabulary
2. sampling        tests: contract 2 on the device (one verification step; the joint law of two
                   sampled tokens through each loop)
3. race            tests: the race check (async with its tray pass on a side stream against async
                   serial, bf16, bit for bit), the check failing on a broken stream hand-off, host
                   syncs per round counted exactly (one a round, one a retirement: every method,
                   eager and static)
4. async_sync      tests: async against sync, fp32 tokens and τ, bf16 tokens (docs/design.md#losslessness)
5. engine          tests: every method ragged at T = 0 and 1; flex BlockMask == dense SDPA
6. placement       tests: the target loaded by from_pretrained(device_map=...) (target.device_map),
                   its drafter on a device of its own (drafter.device): ar / sync / async greedy
                   against generate, sampled runs. One GPU: device_map={"": cuda:0} beside the
                   drafter on cuda:0 (the placement path and the explicit-copy code, copies no-ops);
                   two GPUs or more: the target split over cuda:0 and cuda:1, or whole on cuda:0, and
                   the drafter on cuda:1 (real copies each round; the tray pass must end while
                   cuda:0 is held before verification); skipped, said, with fewer
7. train           scripts/gpu_train_check.py: bf16 steps of a tiny Qwen3 through the training step
   dist            scripts/gpu_dist_check.py under torchrun --nproc_per_node 1: FSDP2 steps and the
                   in-training evaluation in an NCCL process group, dist.timeout_s in force (on the
                   CPU: two processes, gloo)
8. readiness       scripts/gpu_readiness.py at Qwen3-8B target / Qwen3-1.7B drafter shapes with
                   random weights: pass latencies with device time apart from host issue time, the
                   eager loops' rounds and the first async row's on the compiled backend (its tray
                   pass replaying CUDA graphs of its own pool on the side stream: its overlap, the
                   share hidden behind verification, must be >= 0.5, and its timed call may compile
                   nothing; every row compiled costs ~10 min of cold compiles: run it on its own),
                   projections from those rounds, the AR mask cost, the 1.7B drafter's one-block draft and 384-token tray
                   pass with its full head and a 32,000-row draft vocabulary; fails on its own
                   checks (gpu_readiness.problems)
9. compiled_equal  tests: decode.backend=compiled gives the eager loop's greedy tokens (tiny, fp32),
                   every method of the table; async's tray pass in graphs of its own pool, captured
                   in the warm-up, equal to async serial (bf16)
10. compiled_timing per-round wall time, eager against compiled, at Qwen3-8B shapes (bf16; the
                   warm-up's seconds, its compiles, reported apart; fails when dynamo compiles a
                   graph inside the timed call): AR by default; `--timing-methods ar sync` adds sync (and the
                   1.7B drafter's graphs, ~220 s more). Last, because compiling an 8B graph takes minutes
Exit status 0 when no stage failed (skipped stages are listed in the JSON's `skipped`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

# cuBLAS is bit-reproducible only while one stream is active, unless each stream has its own
# workspace: this setting gives them that (NVIDIA's cuBLAS guide, "Results reproducibility"). The
# race check compares async with a side stream against async serial bit for bit, so a different
# GEMM kernel choice under concurrency must not be what it sees. Read when cuBLAS starts: set first.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # d3d from this checkout, installed or not

from d3d.decoding import DecodeConfig  # noqa: E402
from d3d.decoding.methods import METHODS, ROLES  # noqa: E402
from d3d.models.drafter_settings import DrafterSettings  # noqa: E402
from d3d.models.random_models import as_drafter, random_model  # noqa: E402


def _script(name: str):
    """A sibling script as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readiness = _script("gpu_readiness")


class Stage:
    """One stage's record in gpu_check.json. `step(name, value)` adds a finished sub-step and
    rewrites the file at once, so a kill or a timeout mid-stage keeps every sub-step before it.
    A stage function called on its own (the gpu tests) gets one that writes nothing."""

    def __init__(self, name: str = "", flush=None):
        self.name, self.flush = name, flush
        self.record: dict = {"status": "running", "steps": {}}

    def step(self, name: str, value):
        self.record["steps"][name] = value
        if self.flush is not None:
            self.flush()
            print(f"[gpu_check] step {self.name}/{name} written", flush=True)  # only once it is on disk
        return value


# The contract stages are tests in tests/integration/test_gpu.py, each stage the gpu-marked tests
# whose names start so (run in this order, with the timing stages between them)
TEST_STAGES = {"greedy": "test_greedy", "sampling": "test_sampling", "race": "test_race",
               "async_sync": "test_async_sync", "engine": "test_engine", "placement": "test_placement",
               "compiled_equal": "test_compiled"}
TESTS = ROOT / "tests" / "integration" / "test_gpu.py"


class Recorder:
    """A pytest plugin: each test's end becomes a sub-step of the stage (outcome, seconds, what
    the test recorded with `record_property`, the error's tail), written at once."""

    def __init__(self, st: Stage):
        self.st, self.outcomes = st, []

    def pytest_runtest_logreport(self, report):
        # a test's verdict: its call, or the setup that skipped or broke it, or a failed teardown
        if not (report.when == "call" or (report.when == "setup" and not report.passed) or
                (report.when == "teardown" and report.failed)):
            return
        rec = {"outcome": report.outcome, "seconds": round(report.duration, 2), **dict(report.user_properties)}
        if report.skipped and isinstance(report.longrepr, tuple):
            rec["reason"] = report.longrepr[2]
        elif report.failed:
            rec["error"] = str(report.longrepr)[-3000:]
            print(f"[gpu_check] FAILED {report.nodeid}:\n{rec['error'][-1500:]}", flush=True)
        self.outcomes.append(report.outcome)
        self.st.step(report.nodeid.split("::")[-1], rec)


def run_tests(stage: str, device: str, toy: bool, st: Stage) -> dict:
    """`pytest -m gpu` over one stage's tests, in this process, on `device` (the tests read it
    from D3D_CHECK_DEVICE). ok when none failed and at least one passed; skipped when every one
    skipped (no CUDA)."""
    import pytest

    os.environ["D3D_CHECK_DEVICE"], os.environ["D3D_CHECK_TOY"] = device, "1" if toy else "0"
    rec = Recorder(st)
    # no Hydra plugin (absent on the GPU machines, and a blocked import here), no cache folder, and
    # the runner its own reporter (the JSON and its step lines; pytest's progress dots would run into them)
    code = pytest.main(["-p", "no:terminal", "-o", "addopts=", "-m", "gpu", "-k", TEST_STAGES[stage], "-p", "no:cacheprovider",
                        "-p", "no:hydra_pytest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
                        str(TESTS)], plugins=[rec])
    n = {k: rec.outcomes.count(k) for k in ("passed", "failed", "skipped")}
    if rec.outcomes and n["skipped"] == len(rec.outcomes):
        return {"status": "skipped", "reason": "every test skipped (no CUDA)", "tests": n}
    return {"ok": int(code) == 0 and n["failed"] == 0 and n["passed"] > 0, "pytest_exit": int(code), "tests": n}


def stage_train(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    st = st or Stage()
    script = ROOT / "scripts" / "gpu_train_check.py"
    if not script.is_file():
        return {"ok": False, "error": "scripts/gpu_train_check.py is missing"}
    out = out_dir / "gpu_train_check.json"  # it writes its own JSON after every training step
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # toy: the CPU test's sizes (the default shape's 4 steps took over 300 s on 2 loaded cores)
    size = ["--steps", "4", "--layers", "2", "--hidden", "64", "--vocab", "512", "--seq-len", "96", "--block-size", "4",
            "--anchors", "4"] if toy else ["--steps", "20"]
    proc = subprocess.run([sys.executable, str(script), "--device", device.split(":")[0], "--out", str(out), *size],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900 if toy else 300)
    res = st.step("steps", json.loads(out.read_text()) if out.is_file() else {})
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "result": res,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


def stage_dist(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    """scripts/gpu_dist_check.py under torchrun with conf/accelerate/fsdp.yaml's launch variables: FSDP2
    steps and the in-training evaluation in a real process group with d3d's timeout (dist.timeout_s)
    in force. One process and NCCL on CUDA; on the CPU two and gloo (one CPU process forms no group)."""
    st = st or Stage()
    dist_check = _script("gpu_dist_check")
    out = out_dir / "gpu_dist_check.json"
    nproc = 1 if device.startswith("cuda") else 2
    env = {**os.environ, **dist_check.launch_env(nproc), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                           str(ROOT / "scripts" / "gpu_dist_check.py"), "--device", device.split(":")[0], "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900 if toy else 240)
    res = st.step("run", json.loads(out.read_text()) if out.is_file() else {})
    return {"ok": proc.returncode == 0 and bool(res.get("ok")), "returncode": proc.returncode, "result": res,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


# no paper hit rate fits the toy budgets: the toy preset's rows with trays get these
TOY_HIT_RATES = ["async_2x1=0.3", "async_3x2=0.6", "async_tree_3x2=0.5"]


def compiled_rows(toy: bool) -> list[str]:
    """readiness's backends: eager for every row, and compiled for the preset's first async row only
    (at full size the paper's 12x2 budget): its overlap on the compiled backend (the tray pass
    replaying graphs of its own pool beside the verify graphs) is the figure, and each row compiled
    costs cold compiles (Estimate.GRAPHS["overlap"] at 8B / 1.7B shapes; on 2 busy CPU cores the toy
    preset's every row compiled took over 10 minutes); other rows' compiled loops are left to a run
    of their own (gpu_readiness.py --backends eager compiled)."""
    rows = readiness.preset_rows("gpu_readiness_toy" if toy else "gpu_readiness", 4 if toy else 16)
    first = next(name for name, dc in rows.items() if dc.method == ROLES["trays"])
    return ["--backends", "eager", "compiled", "--compiled-rows", first]


def stage_readiness(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    st = st or Stage()
    out = str(out_dir / "gpu_readiness.json")
    if toy:
        # the toy preset's rows (conf/bench/gpu_readiness_toy.yaml), each row with trays its own hit rate
        argv = ["--preset", "gpu_readiness_toy", "--target", "toy", "--drafter", "toy", "--device", device, "--dtype",
                "float32", "--prefix", "32", "--block-size", "4", "--block-sizes", "1", "4", "--hit-rate", *TOY_HIT_RATES,
                "--loop-tokens", "12", "--repeats", "1", "--tray-tokens", "8", "--out", out, *compiled_rows(toy)]
    else:
        argv = ["--target", "qwen3_8b", "--drafter", "qwen3_1p7b", "--device", device, "--dtype", "bfloat16",
                "--prefix", "2048", "--loop-tokens", "32", "--out", out, *compiled_rows(toy)]
    res = readiness.main(argv, on_stage=st.step)  # each of its stages lands here too
    problems = res["problems"]
    return {"ok": not problems, "problems": problems, "result": res}


# the toy drafter differs from the toy target in structure, as 1.7B does from 8B, so no graph is
# shared between them (dynamo guards on a module's structure, not on which module it is)
TIMING_SHAPES = {True: ("toy", "toy_drafter", torch.float32, 32, 8), False: ("qwen3_8b", "qwen3_1p7b", torch.bfloat16, 512, 32)}


# compiled_timing's loops by role (d3d.decoding.methods.ROLES): the plain loop (AR), and the drafted
# one (sync) that --timing-methods adds
TIMED = {role: ROLES[role] for role in ("plain", "drafted")}


def role_of(method: str) -> str:
    return "drafted" if METHODS[method].needs_drafter else "plain"


def stage_compiled_timing(device: str, toy: bool, methods=(TIMED["plain"],), st: Stage | None = None,
                          room_s=lambda: float("inf")) -> dict:
    """Per-round wall time, eager against compiled (CUDA graphs on CUDA), at Qwen3-8B (target) /
    1.7B (drafter, only when a drafted loop is timed) shapes in bf16. Each compiled method costs
    cold compiles of the large graphs (ESTIMATE), so only the plain loop runs by default; a sub-step
    that `room_s()` (the budget left) cannot hold is recorded as skipped."""
    st = st or Stage()
    name_t, name_d, dtype, prefix, tokens = TIMING_SHAPES[toy]
    dev = torch.device(device)
    big_t = random_model(name_t, dev, dtype, seed=0)
    big_d = as_drafter(random_model(name_d, dev, dtype, seed=1), 16) if "drafted" in map(role_of, methods) else None
    out = {"target": name_t, "drafter": name_d if big_d is not None else None, "dtype": str(dtype), "prefix": prefix,
           "skipped": []}
    for method in methods:
        for backend in ("eager", "compiled"):
            need = 0.0 if toy else ESTIMATE.substep(method, backend)
            if need > room_s():
                out["skipped"].append(st.step(f"{method}_{backend}", {
                    "status": "skipped", "reason": f"budget: {need:.0f} s estimated, {room_s():.0f} s left"}))
                continue
            t0 = time.perf_counter()
            lp = readiness.loop_rounds(big_t, big_d, DecodeConfig(method=method, block_size=16, backend=backend),
                                       prefix, tokens, dev)
            lp["seconds_with_warmup"] = round(time.perf_counter() - t0, 1)
            st.step(f"{method}_{backend}", lp)
            print(f"[gpu_check] compiled_timing: {method} {backend} round {lp['round_wall_ms']:.2f} ms", flush=True)
    # a timing a reviewer accepts: every shape compiled in the warm-up (warmup_s, reported apart), none
    # inside the timed call (dynamo's graph count around it)
    out["ok"] = all(s.get("rounds") and s.get("compiles_in_timed") == 0
                    for s in st.record["steps"].values() if s.get("status") != "skipped")
    return out


class Estimate:
    """The default run's duration on one H200, stage by stage, from stated inputs (seconds).

    Inputs:
    - compile of one large graph, cold: 87 s for a 36-layer Qwen3-8B graph with inductor on these
      CPUs (docs/design.md#facts-about-the-stack; dynamo alone 7 s), pro rata by layers for the 28-layer 1.7B (68 s). On the
      GPU host inductor does the same tracing and lowering (Triton kernels are shared between the
      identical layers), so the CPU figure is taken as is;
    - compile of one tiny graph (2 layers): 2 s with inductor on CPU (docs/design.md, Backends),
      taken as 5 s on CUDA for Triton's kernel builds;
    - graphs per stage: counted with a counting torch.compile backend on the toy models
      (tests/integration/test_gpu_check.py checks these numbers against a count);
    - the tiny-model stages are host-bound on a GPU (a few hundred aten ops a pass): their time is
      bounded by their time on this project's 2-core CPU, one thread (measured, below);
    - an eager Qwen3-8B round costs ~20 ms of host time (2.6 k ops at 7.5 µs, docs/design.md#facts-about-the-stack), a
      1.7B-drafted sync or async round ~60-80 ms; readiness decodes 7 loops (ar, sync, 3 async
      budgets, a tree, an async tree) of 32 tokens after a 32-token warm-up, 64 rounds each at
      τ = 1 (random weights);
    - startup (imports, CUDA context) and model init (8B and 1.7B random weights made on the device).
    """

    TIMING_GRAPH_S = {"target": 87.0, "drafter": 87.0 * 28 / 36}  # Qwen3-8B, Qwen3-1.7B
    TINY_GRAPH_S = 5.0
    # graphs each compiled run makes, per role, counted on the toy models (count_graphs). The tiny
    # pair's target and drafter share a structure, so they share graphs of equal shapes: only the
    # total counts there; on CUDA async's side-stream drafter passes (no CUDA graphs) are compiled
    # apart, which can add one graph per shape they shared on CPU: TINY_CUDA_EXTRA
    # (compiled_equal's, and per role of a compiled_timing loop: TIMED)
    # compiled_equal: 3 + 6 counted for ar, sync and async; the tree's and the async tree's (verify
    # width tree_nodes + 1, their draft and tray passes) taken as 2 + 4 more until they run compiled.
    # "overlap": readiness's compiled async row at 8B / 1.7B shapes (its verify graph; its draft and
    # tray passes, captured on the side stream)
    GRAPHS = {"compiled_equal": {"target": 5, "drafter": 10}, "plain": {"target": 1}, "drafted": {"target": 1, "drafter": 2},
              "overlap": {"target": 1, "drafter": 2}}
    TINY_CUDA_EXTRA = 2
    STAGES_S = {  # stage: seconds on one H200, without its compiles. Tiny stages: their time on
        # this project's CPU (2-core AMD EPYC, one thread, default sizes, measured) rounded up
        "startup": 20,  # torch + transformers imports, the CUDA context, pytest's start
        "greedy": 25,  # 20 tiny runs + transformers' generate per prompt: 7 s on the CPU for all 20 (busy)
        "sampling": 10,  # 3 loops over 3,000 requests in one batch: 24 s on the CPU, compute-bound there
        "race": 30,  # 12 tiny async runs (4 of them async trees) in bf16: 5 s on the CPU for 8; + the broken hand-off's (each
        # round held back ~0.1 s on CUDA) and the host-sync counts (8 cases of 4 short calls, host-bound on a GPU)
        "async_sync": 5,  # 4 sync + 8 async tiny runs, fp32 and bf16: 2 s on the CPU
        "engine": 45,  # flex_attention's forward compile ~30 s, 6 short ragged runs
        "placement": 8,  # a tiny target saved and reloaded by device_map, 3 methods x (greedy + sampled) +
        # generate per prompt: 15 s on the CPU; the 2-GPU cases (skipped on one GPU) as many again
        "train": 45,  # accelerate start, flex_attention's forward and backward compiles, 20 tiny steps
        "dist": 20,  # torchrun and one worker's imports ~8 s, CUDA context and NCCL init ~4 s, 4 tiny FSDP2 steps
        # and one held-out τ in eager SDPA ~3 s: 95 s on the CPU with two gloo processes (busy 2 cores)
        "readiness": 70,  # 8B + 1.7B init ~10 s, 11 passes x 11 runs behind a 50 ms pre-queued sleep ~6 s,
        # the draft vocabulary's 12 more passes x 11 runs and a 1.7B copy ~6 s,
        # 7 eager loops of 64 rounds at 20-80 ms (the trees' ~100 more small ops per round), and the
        # compiled async loop's 128 rounds (warm-up twice, then timed) at a few ms, without its compiles
        "compiled_equal": 35,  # 5 tiny eager and compiled runs of 24 tokens, without their compiles; the side
        # stream's graphs test: async compiled serially and on its side stream, bf16 (~5 tiny graphs, their captures)
        "compiled_timing": 10,  # 8B init ~5 s, eager AR 64 rounds at ~20 ms, compiled AR's rounds and capture
    }

    def __init__(self, graphs: dict | None = None):
        self.graphs = graphs or self.GRAPHS

    def substep(self, method: str, backend: str) -> float:
        """A compiled_timing sub-step: its cold compiles, plus 64 rounds at eager speed."""
        compiles = sum(n * self.TIMING_GRAPH_S[model] for model, n in self.graphs[role_of(method)].items())
        return (compiles if backend == "compiled" else 0.0) + 5.0

    def stage(self, name: str, timing_methods=(TIMED["plain"],)) -> float:
        extra = 0.0
        if name == "readiness":  # its compiled async row's cold compiles (compiled_rows)
            extra = sum(n * self.TIMING_GRAPH_S[model] for model, n in self.graphs["overlap"].items())
        elif name == "compiled_equal":
            extra = (sum(self.graphs["compiled_equal"].values()) + self.TINY_CUDA_EXTRA) * self.TINY_GRAPH_S
        elif name == "compiled_timing":
            extra = sum(self.substep(m, "compiled") - 5.0 for m in timing_methods)
        return self.STAGES_S[name] + extra

    def table(self, stages, timing_methods=(TIMED["plain"],)) -> dict:
        rows = {"startup": self.STAGES_S["startup"], **{n: self.stage(n, timing_methods) for n in stages}}
        return {"seconds": rows, "total_s": sum(rows.values())}


ESTIMATE = Estimate()


def count_graphs(run) -> dict:
    """Graphs decode.backend=compiled makes while `run()` runs, per role (target, drafter), counted
    with a torch.compile backend that compiles nothing (it counts each graph dynamo hands it, then
    runs it as traced). What Estimate.GRAPHS says, checked by the tests on the toy models."""
    import collections

    import torch._dynamo
    from d3d.decoding import kv

    counts: collections.Counter = collections.Counter()
    role: list[str] = []

    def counter(gm, example_inputs):
        counts[role[-1]] += 1
        return gm.forward

    # as on CUDA, passes with and without CUDA graphs (async's side-stream drafter) are separate
    # compiled functions, which share no graph; on CPU every pass shares one
    per_kind: dict = {}

    def compiled_static_pass(device, graphs=True, frozen=False):
        if (graphs, frozen) not in per_kind:
            backend = lambda gm, example_inputs: counter(gm, example_inputs)  # noqa: E731 (one object per kind)
            compiled = torch.compile(kv.static_pass, backend=backend, dynamic=False)

            def counted(model, *args):
                role.append("drafter" if DrafterSettings.of(model, required=False) else "target")
                try:
                    return compiled(model, *args)
                finally:
                    role.pop()

            per_kind[(graphs, frozen)] = counted
        return per_kind[(graphs, frozen)]

    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    saved_limit, real = getattr(cfg, limit), kv.compiled_static_pass
    setattr(cfg, limit, max(saved_limit, 256))
    torch._dynamo.reset()  # graphs compiled before would be reused, not counted
    kv.compiled_static_pass = compiled_static_pass
    try:
        run()
    finally:
        kv.compiled_static_pass = real
        setattr(cfg, limit, saved_limit)
        torch._dynamo.reset()
    return dict(counts)
STAGES = ("greedy", "sampling", "race", "async_sync", "engine", "placement", "train", "dist", "readiness",
          "compiled_equal", "compiled_timing")


class Report:
    """gpu_check.json: rewritten (write, then rename, so a kill never leaves half a file) when a
    stage starts, after every sub-step and when a stage ends."""

    def __init__(self, path: Path, env: dict):
        self.path, self.data = path, {"env": env, "stages": {}}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def begin(self, name: str) -> Stage:
        st = Stage(name, self.flush)
        self.data["stages"][name] = st.record
        self.flush()
        return st


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--toy", action="store_true", help="toy sizes everywhere (the CPU test)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "outputs/gpu_check"))
    p.add_argument("--stages", nargs="+", default=None, choices=STAGES, help="run only these stages")
    p.add_argument("--budget-s", type=float, default=720.0,
                   help="a stage (or compiled_timing sub-step) whose estimate does not fit in what is left of this "
                        "is recorded as skipped, not started (the README wraps the run in `timeout 780`)")
    p.add_argument("--timing-methods", nargs="+", default=[TIMED["plain"]], choices=list(TIMED.values()),
                   help=f"loops compiled_timing times at 8B shapes ({TIMED['drafted']} adds ~220 s of cold compiles)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stages compare with generate in true fp32
    chosen = [n for n in STAGES if not args.stages or n in args.stages]
    plan = ESTIMATE.table(chosen, args.timing_methods)
    report = Report(out_dir / "gpu_check.json", {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "device": dev,
        "device_name": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor(),
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.startswith("cuda") else None,
        "toy": args.toy, "budget_s": args.budget_s, "h200_estimate": plan})
    sized = "these stages at full size (--toy runs them smaller)" if args.toy else "this run"
    print(f"[gpu_check] H200 estimate of {sized} (s): {plan['seconds']} = {plan['total_s']:.0f} s; "
          f"budget {args.budget_s:.0f} s", flush=True)
    room_s = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    runs = {name: (lambda st, name=name: run_tests(name, dev, args.toy, st)) for name in TEST_STAGES}
    runs.update({
        "train": lambda st: stage_train(dev, out_dir, args.toy, st=st),
        "dist": lambda st: stage_dist(dev, out_dir, args.toy, st=st),
        "readiness": lambda st: stage_readiness(dev, out_dir, args.toy, st=st),
        "compiled_timing": lambda st: stage_compiled_timing(dev, args.toy, tuple(args.timing_methods), st=st,
                                                            room_s=room_s),
    })
    for name in chosen:
        st = report.begin(name)
        # the toy run's stages are CPU-sized: only a budget already spent skips them
        # (compiled_timing guards each of its sub-steps: the plain loop may fit where the drafted does not)
        need = 0.0 if args.toy else ESTIMATE.STAGES_S[name] if name == "compiled_timing" else \
            ESTIMATE.stage(name, args.timing_methods)
        if need > room_s() or room_s() <= 0:
            st.record.update(status="skipped", reason=f"budget: {need:.0f} s estimated, {room_s():.0f} s of "
                                                      f"--budget-s {args.budget_s:.0f} left")
            report.flush()
            print(f"[gpu_check] {name}: skipped ({st.record['reason']})", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            res = runs[name](st)
        except Exception as err:  # recorded, and the next stage still runs
            res = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        res.setdefault("status", "ok" if res.get("ok") else "failed")
        res["seconds"] = round(time.perf_counter() - t0, 2)
        st.record.update(res)
        report.flush()
        print(f"[gpu_check] {name}: {res['status']} in {res['seconds']} s", flush=True)
        if res["status"] == "failed":
            print(json.dumps({k: v for k, v in res.items() if k not in ("result", "steps")}, indent=2,
                             default=str)[-3000:], flush=True)
    stages = report.data["stages"]
    report.data["ok"] = not any(s["status"] == "failed" for s in stages.values())
    report.data["skipped"] = [n for n, s in stages.items() if s["status"] == "skipped"]
    report.data["seconds"] = round(time.perf_counter() - t_start, 1)
    report.flush()
    verdict = "no stage failed" if report.data["ok"] else "SOME STAGES FAILED"
    print(f"[gpu_check] {verdict}; skipped: {report.data['skipped'] or 'none'}; written: {report.path}")
    return report.data


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
