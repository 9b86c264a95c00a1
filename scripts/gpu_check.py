"""The GPU check: one script to run whenever a GPU is lent, in two parts of about 5 minutes each on
one H200 by its estimate (printed at start, inputs in `Estimate` below; a budget guard per part
keeps it inside its timeout), so the first part can be read and run again within one lent machine's
device time. Part 1 holds what matters first (the contracts, and async's overlap on the compiled
backend at the Qwen3-8B / 1.7B shapes); part 2 the rest. Both write one gpu_check.json in --out-dir
(part 2 merges into part 1's record when that is there: a folder new for each command keeps them
apart; copy the first's gpu_check.json into the second's folder before it runs).

    PYTHONPATH=src timeout 400 python3 scripts/gpu_check.py --part 1 --out-dir outputs/gpu_check   # on the GPU machine
    PYTHONPATH=src timeout 400 python3 scripts/gpu_check.py --part 2 --out-dir outputs/gpu_check
    python scripts/gpu_check.py --device cpu --toy --out-dir /tmp/gc          # every stage: what the tests run

A runner: the contract checks are the `gpu`-marked tests of tests/integration/test_gpu.py, which it
runs with pytest in this process, one stage's tests at a time, between its own timing stages. It
needs torch, transformers, accelerate and pytest only (no Hydra, OmegaConf or datasets, which the
GPU machines lack) and builds every model from a config with random weights (no hub,
d3d.models.random_models). Every stage is recorded in <out-dir>/gpu_check.json as it starts, after
each of its sub-steps (a test, or a timing step) and when it ends, so a crash, a kill or a timeout
keeps every sub-step that finished (a failing stage is recorded and the next one runs). Each stage
ends with a status: ok, failed (its own checks failed) or skipped (no CUDA, or `--budget-s`: a
stage whose estimate does not fit in the time left is not started).

Part 1
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
8. overlap         scripts/gpu_readiness.py's first async row (the paper's 12x2 budget) on the compiled
                   backend at Qwen3-8B target / Qwen3-1.7B drafter shapes, random weights: its tray
                   pass replaying CUDA graphs of its own pool on the side stream; its overlap (the
                   share hidden behind verification) must be >= 0.5 and its timed call may compile
                   nothing. Its cold compiles (~4 minutes) run in a worker process started with the
                   part, beside stages 1-7 (which time nothing); the worker then waits for them to
                   end and times the row alone, on the models and graphs it compiled (OverlapWorker)
Part 2
9. compiled_equal  tests: decode.backend=compiled gives the eager loop's greedy tokens (tiny, fp32),
                   every method of the table; async's tray pass in graphs of its own pool, captured
                   in the warm-up, equal to async serial (bf16)
10. readiness      scripts/gpu_readiness.py at the same shapes on the eager backend: pass latencies
                   with device time apart from host issue time, the preset's loops' rounds,
                   projections from those rounds, the AR mask cost, the 1.7B drafter's one-block
                   draft and 384-token tray pass with its full head and a 32,000-row draft
                   vocabulary; fails on its own checks (gpu_readiness.problems)
11. compiled_timing per-round wall time, eager against compiled, at Qwen3-8B shapes (bf16; the
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
from dataclasses import replace
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
from d3d.utils.runinfo import gpu_name  # noqa: E402


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

# readiness's shapes (overlap and readiness alike): the toy run's, and the paper's pair
READINESS = {True: {"preset": "gpu_readiness_toy", "target": "toy", "drafter": "toy", "dtype": "float32",
                    "prefix": 32, "block": 4, "tokens": 12},
             False: {"preset": "gpu_readiness", "target": "qwen3_8b", "drafter": "qwen3_1p7b", "dtype": "bfloat16",
                     "prefix": 2048, "block": 16, "tokens": 32}}


def readiness_argv(device: str, out: Path, toy: bool) -> list[str]:
    s = READINESS[toy]
    argv = ["--preset", s["preset"], "--target", s["target"], "--drafter", s["drafter"], "--device", device,
            "--dtype", s["dtype"], "--prefix", str(s["prefix"]), "--block-size", str(s["block"]),
            "--loop-tokens", str(s["tokens"]), "--out", str(out)]
    # the toy preset's rows, each row with trays its own hit rate
    return argv + (["--block-sizes", "1", "4", "--hit-rate", *TOY_HIT_RATES, "--repeats", "1", "--tray-tokens", "8"]
                   if toy else [])


def overlap_row(toy: bool) -> str:
    """The row the overlap stage times compiled: the preset's first async row (at full size the
    paper's 12x2 budget). Its overlap on the compiled backend (the tray pass replaying graphs of its
    own pool beside the verify graphs) is the figure; each row compiled costs cold compiles
    (Estimate.GRAPHS["overlap"] at 8B / 1.7B shapes), so other rows' compiled loops are left to a
    run of their own (gpu_readiness.py --backends eager compiled)."""
    rows = readiness.preset_rows(READINESS[toy]["preset"], READINESS[toy]["block"])
    return next(name for name, dc in rows.items() if dc.method == ROLES["trays"])


def overlap_argv(device: str, out_dir: Path, toy: bool) -> list[str]:
    """readiness on the compiled backend, the overlap row only; its pass latencies at the row's
    block size alone and no draft-vocabulary timing (the readiness stage times both)."""
    return [*readiness_argv(device, out_dir / "gpu_readiness_overlap.json", toy), "--backends", "compiled",
            "--compiled-rows", overlap_row(toy), "--block-sizes", str(READINESS[toy]["block"]), "--draft-vocab", "0"]


def stage_readiness(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    """readiness's eager rows (the compiled one is the overlap stage's)."""
    st = st or Stage()
    argv = [*readiness_argv(device, out_dir / "gpu_readiness.json", toy), "--backends", "eager"]
    res = readiness.main(argv, on_stage=st.step)  # each of its stages lands here too
    problems = res["problems"]
    return {"ok": not problems, "problems": problems, "result": res}


def overlap_worker(device: str, out_dir: Path, toy: bool) -> int:
    """The overlap stage's process (`--worker overlap`): build the models and run the overlap row's
    loop once (its cold compiles and CUDA graphs: what takes minutes), while the runner's other
    stages of the part run; then wait for the runner's "go" on stdin (those stages ended, the device
    is this process's) and run readiness on the same model objects, so its loop finds every graph
    compiled (dynamo's cache in this process) and every CUDA graph recorded (the same weights'
    addresses) and times the row alone. Its pre-run loop is recorded apart, timed beside the other
    stages (not a figure)."""
    s, dev = READINESS[toy], torch.device(device)
    dtype = getattr(torch, s["dtype"])
    built, make = {}, readiness.random_model

    def shared(shape, device, dtype, seed=0, **kw):  # what readiness.main builds: the models compiled here
        key = (shape, str(device), dtype, seed)
        if key not in built:
            built[key] = make(shape, device, dtype, seed=seed, **kw)
        return built[key]

    readiness.random_model = shared
    t0 = time.perf_counter()
    target = shared(s["target"], dev, dtype, seed=0)
    drafter = as_drafter(shared(s["drafter"], dev, dtype, seed=1), s["block"])
    row = overlap_row(toy)
    cfg = replace(readiness.preset_rows(s["preset"], s["block"])[row], backend="compiled")
    pre = readiness.loop_rounds(target, drafter, cfg, s["prefix"], s["tokens"], dev)
    (out_dir / "overlap_prewarm.json").write_text(json.dumps(
        {"row": row, "seconds": round(time.perf_counter() - t0, 1), "loop_beside_other_stages": pre}, default=str))
    print(f"[gpu_check] overlap worker: {row} compiled in {time.perf_counter() - t0:.0f} s; waiting", flush=True)
    if sys.stdin.readline().strip() != "go":  # the runner ended without its go: nothing to time
        return 3
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    res = readiness.main(overlap_argv(device, out_dir, toy))
    # 0 when the pre-run compiled every graph (the estimate's premise): said, not a failure of the row
    (out_dir / "overlap_after_go.json").write_text(json.dumps(
        {"graphs_compiled": counters["stats"]["unique_graphs"] - before}))
    return 0 if not res["problems"] else 1


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL when the runner dies (a kill or a `timeout` leaves no compile running)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class OverlapWorker:
    """The overlap stage's worker process, started with the run (overlap_worker): its compiles run
    beside the stages before it."""

    def __init__(self, device: str, out_dir: Path, toy: bool):
        self.out_dir, self.toy, self.t0 = out_dir, toy, time.perf_counter()
        self.log = out_dir / "overlap_worker.log"
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "overlap",
                                          "--device", device, "--out-dir", str(out_dir), *(["--toy"] if toy else [])],
                                         cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         text=True, preexec_fn=_die_with_parent)
        print(f"[gpu_check] overlap: its worker compiles beside the stages before it (log: {self.log})", flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def run(self, st: Stage, room_s) -> dict:
        """Give the go, then record readiness's stages as its JSON gains them, until the worker ends
        (or GRACE_S past the budget, what the README's `timeout` leaves: the worker is stopped)."""
        out = self.out_dir / "gpu_readiness_overlap.json"
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):  # it ended already: its log says why
            pass
        seen: set = set()

        def record():
            try:
                res = json.loads(out.read_text())
            except (OSError, ValueError):  # not written yet, or being rewritten
                return {}
            for name in res.get("stages_done", []):
                if name not in seen:
                    seen.add(name)
                    st.step(name, res[name])
            return res

        while self.proc.poll() is None and room_s() > -GRACE_S:
            record()
            time.sleep(1.0)
        self.stop()
        res = record()
        for step, name in (("prewarm", "overlap_prewarm.json"), ("after_go", "overlap_after_go.json")):
            if (self.out_dir / name).is_file():
                st.step(step, json.loads((self.out_dir / name).read_text()))
        tail = self.log.read_text()[-2000:] if self.log.is_file() else ""
        problems = res.get("problems")
        return {"ok": self.proc.returncode == 0 and problems == [], "returncode": self.proc.returncode,
                "problems": problems, "row": overlap_row(self.toy),
                "overlap": {k: lp.get("overlap") for k, lp in res.get("loops", {}).items()}, "tail": tail}


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
    """Each part's duration on one H200, stage by stage, from stated inputs (seconds).

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
    - startup (imports, CUDA context) and model init (8B and 1.7B random weights made on the device);
    - the overlap stage's worker (OverlapWorker) starts with the run and compiles while the stages
      before it run (the host has 16 cores; those stages time nothing): the stage waits only for
      what of the worker's pre-run is left when they end, then times the row (OVERLAP_AFTER_GO_S).
    """

    TIMING_GRAPH_S = {"target": 87.0, "drafter": 87.0 * 28 / 36}  # Qwen3-8B, Qwen3-1.7B
    TINY_GRAPH_S = 5.0
    # graphs each compiled run makes, per role, counted on the toy models (count_graphs). The tiny
    # pair's target and drafter share a structure, so they share graphs of equal shapes: only the
    # total counts there; on CUDA async's side-stream drafter passes (no CUDA graphs) are compiled
    # apart, which can add one graph per shape they shared on CPU: TINY_CUDA_EXTRA
    # (compiled_equal's, and per role of a compiled_timing loop: TIMED)
    # compiled_equal: every method of the table (ar, sync, async, the tree, the async tree) at its
    # COMPILED_CASES settings, batch 3: 11 counted (the trees run compiled: their verify of
    # tree_nodes + 1 and their draft and tray passes included; the tiny pair shares graphs of equal
    # shapes, so only the sum is bound). "overlap": the overlap row at 8B / 1.7B shapes (its verify
    # graph; its draft and tray passes, captured on the side stream)
    GRAPHS = {"compiled_equal": {"target": 4, "drafter": 7}, "plain": {"target": 1}, "drafted": {"target": 1, "drafter": 2},
              "overlap": {"target": 1, "drafter": 2}}
    TINY_CUDA_EXTRA = 2
    STAGES_S = {  # stage: seconds on one H200, without its compiles. Tiny stages: their time on
        # this project's CPU (2-core AMD EPYC, one thread, default sizes, measured) rounded up
        "startup": 20,  # torch + transformers imports, the CUDA context, pytest's start (once per part)
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
        "overlap": 15,  # after the go: 8 passes x 11 runs behind a 50 ms pre-queued sleep ~5 s, the row's
        # warm-up (graphs compiled and recorded already: replays, its buffers' captures) and 32 rounds at a
        # few ms, the worker's exit
        "compiled_equal": 35,  # 5 tiny eager and compiled runs of 24 tokens, without their compiles; the side
        # stream's graphs test: async compiled serially and on its side stream, bf16 (~5 tiny graphs, their captures)
        "readiness": 60,  # 8B + 1.7B init ~10 s, 11 passes x 11 runs behind a 50 ms pre-queued sleep ~6 s,
        # the draft vocabulary's 12 more passes x 11 runs and a 1.7B copy ~6 s, 7 eager loops of 64 rounds at
        # 20-80 ms (the trees' ~100 more small ops per round)
        "compiled_timing": 10,  # 8B init ~5 s, eager AR 64 rounds at ~20 ms, compiled AR's rounds and capture
    }
    # the overlap worker before its go, without its compiles: its own imports and CUDA context (20),
    # 8B + 1.7B init (10), the pre-run loop's rounds and captures (5)
    OVERLAP_PREWARM_S = 35

    def __init__(self, graphs: dict | None = None):
        self.graphs = graphs or self.GRAPHS

    def compiles(self, role: str) -> float:
        return sum(n * self.TIMING_GRAPH_S[model] for model, n in self.graphs[role].items())

    def substep(self, method: str, backend: str) -> float:
        """A compiled_timing sub-step: its cold compiles, plus 64 rounds at eager speed."""
        return (self.compiles(role_of(method)) if backend == "compiled" else 0.0) + 5.0

    def prewarm(self) -> float:
        """The overlap worker's seconds from its start to its go: startup, init and cold compiles."""
        return self.OVERLAP_PREWARM_S + self.compiles("overlap")

    def stage(self, name: str, timing_methods=(TIMED["plain"],), before_s: float = 0.0) -> float:
        """A stage's seconds; the overlap stage's after `before_s` seconds of other stages ran beside
        its worker (it waits for what is left of the worker's pre-run)."""
        extra = 0.0
        if name == "overlap":
            extra = max(0.0, self.prewarm() - before_s)
        elif name == "compiled_equal":
            extra = (sum(self.graphs["compiled_equal"].values()) + self.TINY_CUDA_EXTRA) * self.TINY_GRAPH_S
        elif name == "compiled_timing":
            extra = sum(self.substep(m, "compiled") - 5.0 for m in timing_methods)
        return self.STAGES_S[name] + extra

    def table(self, stages, timing_methods=(TIMED["plain"],)) -> dict:
        rows = {"startup": self.STAGES_S["startup"]}
        for n in stages:  # in run order: the overlap stage's wait depends on what ran before it
            rows[n] = self.stage(n, timing_methods, before_s=sum(rows.values()) - rows["startup"])
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


# The two parts, each one command on a lent GPU (Estimate: each about 5 minutes on one H200), in run
# order. Part 1 first: the contracts, and async's overlap at the paper's shapes (its worker compiles
# beside the contract, train and dist stages, which time nothing); part 2: the compiled backend's
# tokens, readiness's eager timings and compiled AR against eager. Without --part both run, in order.
PARTS = {1: ("greedy", "sampling", "race", "async_sync", "engine", "placement", "train", "dist", "overlap"),
         2: ("compiled_equal", "readiness", "compiled_timing")}
STAGES = PARTS[1] + PARTS[2]
PART_BUDGET_S = 340.0  # a part's --budget-s by default: inside the README's `timeout 400`
GRACE_S = 60.0  # what that timeout leaves past the budget: a started overlap stage may run into it
# a record in --out-dir from the same machine and versions is the other part's: this run merges into it
SAME_RUN = ("device", "device_name", "torch", "transformers", "toy")


class Report:
    """gpu_check.json: rewritten (write, then rename, so a kill never leaves half a file) when a
    stage starts, after every sub-step and when a stage ends. A record already there from the same
    machine and versions (SAME_RUN) keeps its stages: the parts of one check land in one file, a
    stage run again replacing its earlier record."""

    def __init__(self, path: Path, env: dict):
        self.path, self.data = path, {"env": env, "stages": {}}
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if old and all(old.get("env", {}).get(k) == env[k] for k in SAME_RUN):
            self.data["stages"] = old.get("stages", {})
            self.data["earlier_runs"] = [*old.get("earlier_runs", []), old["env"]]
            print(f"[gpu_check] merging into {path} (stages there: {', '.join(self.data['stages']) or 'none'})",
                  flush=True)
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
    p.add_argument("--part", type=int, choices=sorted(PARTS), default=None,
                   help="run one part (PARTS: 1 the contracts and the overlap, 2 the rest); default both")
    p.add_argument("--stages", nargs="+", default=None, choices=STAGES, help="run only these stages")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"a stage (or compiled_timing sub-step) whose estimate does not fit in what is left of this "
                        f"is recorded as skipped, not started (default {PART_BUDGET_S:.0f} a part: the README wraps each "
                        f"part in `timeout 400`)")
    p.add_argument("--timing-methods", nargs="+", default=[TIMED["plain"]], choices=list(TIMED.values()),
                   help=f"loops compiled_timing times at 8B shapes ({TIMED['drafted']} adds ~220 s of cold compiles)")
    p.add_argument("--worker", choices=["overlap"], default=None, help=argparse.SUPPRESS)  # OverlapWorker's process
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stages compare with generate in true fp32
    if args.worker:
        sys.exit(overlap_worker(dev, out_dir, args.toy))
    t_start = time.perf_counter()
    part = PARTS[args.part] if args.part else STAGES
    chosen = [n for n in part if not args.stages or n in args.stages]
    budget_s = args.budget_s if args.budget_s is not None else PART_BUDGET_S * (1 if args.part else len(PARTS))
    plan = ESTIMATE.table(chosen, args.timing_methods)
    report = Report(out_dir / "gpu_check.json", {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "device": dev,
        "device_name": (gpu_name() or torch.cuda.get_device_name(dev)) if dev.startswith("cuda") else platform.processor(),
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.startswith("cuda") else None,
        "toy": args.toy, "part": args.part, "budget_s": budget_s, "h200_estimate": plan})
    sized = "these stages at full size (--toy runs them smaller)" if args.toy else "this run"
    print(f"[gpu_check] H200 estimate of {sized} (s): {plan['seconds']} = {plan['total_s']:.0f} s; "
          f"budget {budget_s:.0f} s", flush=True)
    room_s = lambda: budget_s - (time.perf_counter() - t_start)  # noqa: E731
    # the overlap stage's compiles start now, beside the stages before it
    worker = OverlapWorker(dev, out_dir, args.toy) if "overlap" in chosen else None
    runs = {name: (lambda st, name=name: run_tests(name, dev, args.toy, st)) for name in TEST_STAGES}
    runs.update({
        "train": lambda st: stage_train(dev, out_dir, args.toy, st=st),
        "dist": lambda st: stage_dist(dev, out_dir, args.toy, st=st),
        "overlap": lambda st: worker.run(st, room_s),
        "readiness": lambda st: stage_readiness(dev, out_dir, args.toy, st=st),
        "compiled_timing": lambda st: stage_compiled_timing(dev, args.toy, tuple(args.timing_methods), st=st,
                                                            room_s=room_s),
    })

    def need_s(name: str) -> float:
        """What a stage needs of the budget left: the toy run's stages are CPU-sized, so only a budget
        already spent skips them; compiled_timing guards each of its sub-steps (the plain loop may fit
        where the drafted does not); the overlap stage needs what is left of its worker's pre-run."""
        if args.toy:
            return 0.0
        if name == "compiled_timing":
            return ESTIMATE.STAGES_S[name]
        if name == "overlap":
            return ESTIMATE.stage(name, before_s=time.perf_counter() - worker.t0)
        return ESTIMATE.stage(name, args.timing_methods)

    try:
        for name in chosen:
            st = report.begin(name)
            need = need_s(name)
            if need > room_s() or room_s() <= 0:
                st.record.update(status="skipped", reason=f"budget: {need:.0f} s estimated, {room_s():.0f} s of "
                                                          f"--budget-s {budget_s:.0f} left")
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
    finally:
        if worker is not None:
            worker.stop()
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
