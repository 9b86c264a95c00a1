"""The GPU check: one script to run whenever a GPU is lent (352 s on one H200 by its estimate,
printed at start, inputs in `Estimate` below; the budget guard keeps it inside the timeout).

    PYTHONPATH=src timeout 480 python3 scripts/gpu_check.py --out-dir $OUT   # on the GPU machine
    python scripts/gpu_check.py --device cpu --toy --out-dir /tmp/gc          # what the tests run

It needs torch, transformers and pytest only (no Hydra, OmegaConf or datasets, which the GPU
machines lack) and builds every model from a config with random weights (no hub). Every stage is
recorded in <out-dir>/gpu_check.json as it starts, after each of its sub-steps and when it ends,
so a crash, a kill or a timeout keeps every sub-step that finished (a failing stage is recorded and
the next one runs). Each stage ends with a status: ok, failed (its own checks failed) or skipped
(no CUDA, or `--budget-s`: a stage whose estimate does not fit in the time left is not started).

1. greedy          ar / sync / async greedy on a tiny random Qwen3 in fp32, batch 1 and a ragged
                   batch, against transformers' generate; every difference is classified by the
                   target's logit margin (d3d.decoding.divergence); passes when none is "real"
2. sampling        contract 2 on the device: one verification step on a toy vocabulary (60,000
                   draws) and the joint law of two sampled tokens through ar / sync / async (3,000
                   requests in one batch), total-variation distance against the exact law
3. race            the race check: async with its tray pass overlapped (a side stream on CUDA, a
                   worker thread on CPU) against async serial (overlap=none) in bf16, tokens, τ and
                   hits bit for bit: the same ops on the same shapes, only scheduled differently;
                   host syncs per round (CUDA)
4. async_sync      async against sync: in fp32 tokens and τ bit for bit; in bf16 tokens (a
                   difference classified by the target's margin), not τ: their drafter passes lay
                   the same keys out differently, and bf16 SDPA moves by an ulp with that (DESIGN §10)
5. gpu_tests       pytest -m gpu tests/integration/test_gpu.py: flex BlockMask == dense mask, every
                   method ragged at T = 0 and 1, the race check failing on a broken stream hand-off
                   (the other gpu tests repeat stages 1-4)                          [skipped without CUDA]
6. train           scripts/gpu_train_check.py: bf16 steps of a tiny Qwen3 through the training step
7. readiness       scripts/gpu_readiness.py at Qwen3-8B target / Qwen3-1.7B drafter shapes with
                   random weights: verify latency against B, packed-pass latency against budget, the
                   loops' per-round wall time next to their CUDA-event times, projected speedups;
                   fails when a latency, a loop or a projection is not a positive number
8. compiled_equal  decode.backend=compiled (static KV buffers, torch.compile; CUDA graphs on CUDA)
                   gives the eager loop's greedy tokens on the tiny pair (fp32)
9. compiled_timing per-round wall time, eager against compiled, at Qwen3-8B shapes (bf16, compile
                   time reported apart): AR by default; `--timing-methods ar sync` adds sync (and the
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

from d3d.decoding import DecodeConfig, SpecGenerator  # noqa: E402
from d3d.decoding.divergence import classify  # noqa: E402
from d3d.decoding.verify import Sampling, probs, sample_verify  # noqa: E402
from d3d.models.random_models import NoText, as_drafter, random_model, random_prompts, tiny_pair  # noqa: E402


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


GREEDY_CASES = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("sync", 6, 1, 0), ("async", 4, 3, 2), ("async", 6, 6, 3)]


def new_tally() -> dict:
    return {"cases": 0, "equal": 0, "numerical": 0, "real": 0, "details": []}


def tally(out: dict, target, prompt: list[int], ref: list[int], got: list[int], **where) -> None:
    """Count one greedy comparison; a difference is classified by the target's logit margin."""
    d = classify(target, prompt, ref, got)
    out["cases"] += 1
    out["equal"] += d is None
    if d is not None:
        out[d["kind"]] += 1
        out["details"].append({**where, **d})


def stage_greedy(device: str, new_tokens: int = 32, st: Stage | None = None) -> dict:
    st = st or Stage()
    target, drafter = tiny_pair(device, torch.float32, block_size=6)
    out = new_tally()
    for method, B, C, F in GREEDY_CASES:
        for batch in (1, 3):
            prompts = random_prompts(batch, 256, seed=batch)
            gen = SpecGenerator(target, NoText(), None if method == "ar" else drafter,
                                DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=new_tokens),
                                eos_token_ids=[])
            res = gen.generate(prompts)
            case = new_tally()
            for p, got in zip(prompts, res.token_ids):
                ref = target.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False)
                tally(case, target, p, ref[0, len(p):].tolist(), got, method=method, B=B, C=C, F=F, batch=batch)
            st.step(f"{method}_B{B}_C{C}_F{F}_batch{batch}", case)
            for k in ("cases", "equal", "numerical", "real", "details"):
                out[k] += case[k]
    out["ok"] = out["real"] == 0
    return out


def _tv(counts: dict, exact: dict, n: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in {**{k: 0.0 for k in counts}, **exact}.items())


def stage_sampling(device: str, n_requests: int = 3000, st: Stage | None = None) -> dict:
    st = st or Stage()
    # 1. one verification step, toy vocabulary of 6: the first token out follows p exactly
    g = torch.Generator(device=device).manual_seed(1)
    torch.manual_seed(0)
    V, B, n = 6, 3, 60000
    p_logits = (torch.randn(1, B, V) * 1.5).expand(n, B, V).to(device)
    q_logits = (torch.randn(1, B - 1, V) * 1.5).expand(n, B - 1, V).to(device)
    s = Sampling(temperature=1.0)
    q = probs(q_logits, s)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, B - 1)
    accepted, token = sample_verify(p_logits, drafts, q, s, g)
    first = torch.where(accepted > 0, drafts[:, 0], token)
    emp = torch.bincount(first, minlength=V).float().cpu() / n
    step_tv = 0.5 * (emp - probs(p_logits[0, 0], s).cpu()).abs().sum().item()
    out = {"step_tv": step_tv, "step_tv_limit": 0.015}
    st.step("verify_step", dict(out))
    # 2. the joint law of two sampled tokens through each loop (top-k keeps the support small)
    target, drafter = tiny_pair(device, torch.float32, block_size=4)
    prompt = random_prompts(1, 256, seed=5)[0]
    sk = Sampling(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = probs(target(torch.tensor([prompt], device=device)).logits[0, -1], sk)
        exact = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            p2 = probs(target(torch.tensor([prompt + [x1]], device=device)).logits[0, -1], sk)
            for x2 in torch.nonzero(p2).flatten().tolist():
                exact[(x1, x2)] = (p1[x1] * p2[x2]).item()
    out["joint_tv"], out["joint_tv_limit"] = {}, 0.06  # 16 outcomes, n = 3000: noise gives ~0.03
    for method in ("ar", "sync", "async"):
        cfg = DecodeConfig(method=method, block_size=4, C=3, F=2, temperature=1.0, top_k=4, max_new_tokens=2)
        res = SpecGenerator(target, NoText(), None if method == "ar" else drafter, cfg, eos_token_ids=[],
                            seed=7).generate([prompt] * n_requests)
        counts: dict = {}
        for t in res.token_ids:
            counts[tuple(t)] = counts.get(tuple(t), 0) + 1
        out["joint_tv"][method] = st.step(f"joint_{method}", _tv(counts, exact, n_requests))
    out["ok"] = step_tv < out["step_tv_limit"] and all(v < out["joint_tv_limit"] for v in out["joint_tv"].values())
    return out


def async_run(target, drafter, prompts, overlap: str, C: int, F: int, new_tokens: int):
    cfg = DecodeConfig(method="async", block_size=6, C=C, F=F, overlap=overlap, cpu_threads_drafter=1,
                       max_new_tokens=new_tokens)
    return SpecGenerator(target, NoText(), drafter, cfg, eos_token_ids=[]).generate(prompts)


def same_rounds(a, b) -> dict:
    """Bit-for-bit comparison of two async runs: tokens, τ and hits per round."""
    hits = lambda res: [r.get("hit") for r in res.rounds]  # noqa: E731
    return {"tokens_equal": a.token_ids == b.token_ids, "tau_equal": a.taus() == b.taus(),
            "hits_equal": hits(a) == hits(b), "hit_rate": a.hit_rate}


def stage_race(device: str, dtype: torch.dtype = torch.bfloat16, new_tokens: int = 48, st: Stage | None = None) -> dict:
    """The race check: async with its tray pass overlapped (a side stream on CUDA, a worker thread
    on CPU) against async run serially (overlap=none), bit for bit: tokens, τ and hits per round.
    Both run the same ops on the same shapes in the same order, so in any dtype the only thing
    that can differ is the scheduling, and a hand-off that does not wait shows up here. (Not
    async against sync: their drafter passes lay the same visible keys out differently, which moves
    bf16 SDPA by an ulp and flips near-tie drafts; DESIGN §10, tests/unit/test_sdpa_gaps.py.)
    On CPU both runs use one thread per op (the worker's own and the main thread's), so no op's
    reduction is split differently between them."""
    st = st or Stage()
    target, drafter = tiny_pair(device, dtype, block_size=6)
    overlapped = "stream" if device.startswith("cuda") else "thread"
    out = {"dtype": str(dtype).replace("torch.", ""), "overlap": overlapped, "runs": []}
    threads = torch.get_num_threads()
    if not device.startswith("cuda"):
        torch.set_num_threads(1)
    try:
        for batch in (1, 3):
            prompts = random_prompts(batch, 256, seed=10 + batch)
            for C, F in [(3, 2), (6, 3)]:
                serial = async_run(target, drafter, prompts, "none", C, F, new_tokens)
                both = async_run(target, drafter, prompts, overlapped, C, F, new_tokens)
                out["runs"].append(st.step(f"batch{batch}_C{C}_F{F}", {"batch": batch, "C": C, "F": F,
                                                                         **same_rounds(serial, both)}))
    finally:
        torch.set_num_threads(threads)
    runs = out["runs"]
    # hits must happen, or the trays the hand-off carries were never used and nothing was checked
    out["some_hits"] = any((r["hit_rate"] or 0) > 0 for r in runs)
    out["ok"] = out["some_hits"] and all(r["tokens_equal"] and r["tau_equal"] and r["hits_equal"] for r in runs)
    if device.startswith("cuda"):
        out["host_syncs_per_round"] = st.step("host_syncs_per_round", count_syncs(
            target, drafter, random_prompts(3, 256, seed=13), new_tokens))
    return out


def stage_async_sync(device: str, new_tokens: int = 48, st: Stage | None = None) -> dict:
    """Async against sync, what survives each dtype (DESIGN §10). fp32: tokens and τ bit for bit
    (a hit serves exactly the block a synchronous draft would). bf16: tokens only, and a token
    difference is classified by the target's logit margin as the greedy stage does (in a ragged
    batch the target's cache keeps rejected slots hidden, so a different τ in one row changes the
    key layout the others' verify passes see): it fails only on a real divergence. τ in bf16 is
    recorded, not required."""
    st = st or Stage()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        target, drafter = tiny_pair(device, dtype, block_size=6)
        res = {"runs": 0, "tokens_equal": 0, "tau_equal": 0, **new_tally()}
        for batch in (1, 3):
            prompts = random_prompts(batch, 256, seed=10 + batch)
            sync = SpecGenerator(target, NoText(), drafter, DecodeConfig(method="sync", block_size=6,
                                                                         max_new_tokens=new_tokens),
                                 eos_token_ids=[]).generate(prompts)
            for C, F in [(3, 2), (6, 3)]:
                got = async_run(target, drafter, prompts, "auto", C, F, new_tokens)
                res["runs"] += 1
                res["tokens_equal"] += got.token_ids == sync.token_ids
                res["tau_equal"] += got.taus() == sync.taus()
                for p, ref, toks in zip(prompts, sync.token_ids, got.token_ids):
                    tally(res, target, p, ref, toks, batch=batch, C=C, F=F)
        name = str(dtype).replace("torch.", "")
        res["ok"] = (res["tokens_equal"] == res["tau_equal"] == res["runs"]) if dtype == torch.float32 else res["real"] == 0
        out[name] = st.step(name, res)
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def count_syncs(target, drafter, prompts, new_tokens: int) -> dict:
    """Synchronising CUDA calls per round of each loop (torch's sync debug mode counts them): the
    loop itself makes one (its host transfer); the rest come from the model code it calls. Prefill
    and setup syncs are taken out by differencing a long call against a one-round call."""
    import warnings

    def syncs(gen, n):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = gen.generate(prompts, max_new_tokens=n)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)], len(res.rounds)

    out = {}
    for method in ("ar", "sync", "async"):
        gen = SpecGenerator(target, NoText(), None if method == "ar" else drafter,
                            DecodeConfig(method=method, block_size=6, C=3, F=2, max_new_tokens=new_tokens),
                            eos_token_ids=[])
        gen.generate(prompts, max_new_tokens=8)  # warm-up outside the count
        (one, r1), (many, rn) = syncs(gen, 1), syncs(gen, new_tokens)
        out[method] = {"rounds": rn, "per_round": (len(many) - len(one)) / max(rn - r1, 1),
                       "setup": len(one), "kinds": sorted(set(many))[:5]}
    return out


def stage_gpu_tests(device: str, st: Stage | None = None) -> dict:
    st = st or Stage()
    if not device.startswith("cuda"):
        return {"status": "skipped", "reason": "no CUDA: the gpu-marked tests need it"}
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # only the file that collects without Hydra, and only what the other stages do not already run
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/integration/test_gpu.py", "-k", "flex or ragged or broken"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    st.step("pytest", {"returncode": proc.returncode})
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}


def stage_train(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    st = st or Stage()
    script = ROOT / "scripts" / "gpu_train_check.py"
    if not script.is_file():
        return {"ok": False, "error": "scripts/gpu_train_check.py is missing"}
    out = out_dir / "gpu_train_check.json"  # it writes its own JSON after every training step
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), "--device", device.split(":")[0], "--out", str(out),
                           "--steps", "4" if toy else "20"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    res = st.step("steps", json.loads(out.read_text()) if out.is_file() else {})
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "result": res,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


def readiness_problems(res: dict) -> list[str]:
    """What makes a readiness run unusable: a latency or round time that is not a positive number,
    a loop that ran no round, a projection that is not a positive finite speedup."""
    import math

    good = lambda x: isinstance(x, (int, float)) and math.isfinite(x) and x > 0  # noqa: E731
    bad = [f"verify_ms[{b}]" for b, t in res.get("verify_ms", {}).items() if not good(t)]
    bad += [f"packed_ms[{k}]" for k, t in res.get("packed_ms", {}).items() if not good(t)]
    bad += ["sync_draft_ms"] * (not good(res.get("sync_draft_ms")))
    bad += [f"loops[{k}]" for k, lp in res.get("loops", {}).items() if not lp["rounds"] or not good(lp["round_wall_ms"])]
    bad += [f"projection[{r['method']}]" for r in res.get("projection", [])
            if not good(r["projected_speedup"]) or (r["overlap"] is not None and not 0 <= r["overlap"] <= 1)]
    missing = [k for k in ("verify_ms", "sync_draft_ms", "packed_ms", "loops", "projection") if k not in res]
    return bad + [f"{k} missing" for k in missing]


def stage_readiness(device: str, out_dir: Path, toy: bool, st: Stage | None = None) -> dict:
    st = st or Stage()
    out = str(out_dir / "gpu_readiness.json")
    if toy:
        argv = ["--target", "toy", "--drafter", "toy", "--device", device, "--dtype", "float32", "--prefix", "32",
                "--block-size", "4", "--block-sizes", "1", "4", "--budgets", "2x1", "3x2", "--hit-rate", "0.3", "0.6",
                "--loop-tokens", "12", "--repeats", "1", "--out", out]
    else:
        argv = ["--target", "qwen3_8b", "--drafter", "qwen3_1p7b", "--device", device, "--dtype", "bfloat16",
                "--prefix", "2048", "--loop-tokens", "32", "--out", out]
    res = readiness.main(argv, on_stage=st.step)  # each of its stages lands here too
    problems = readiness_problems(res)
    return {"ok": not problems, "problems": problems, "result": res}


def compiled_cases(toy: bool) -> list[tuple]:
    cases = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("async", 4, 3, 2)]
    # ragged only on the GPU: rows retiring is where static buffers change shape; batch 1 runs the
    # same code (a static pass always takes the mask), and every graph costs a cold compile
    return [(m, B, C, F, batch) for m, B, C, F in (cases[:1] if toy else cases) for batch in ((1,) if toy else (3,))]


def stage_compiled_equal(device: str, toy: bool, st: Stage | None = None) -> dict:
    """decode.backend=compiled gives the eager loop's greedy tokens (tiny pair, fp32)."""
    st = st or Stage()
    target, drafter = tiny_pair(device, torch.float32, block_size=6)
    out = new_tally()
    for method, B, C, F, batch in compiled_cases(toy):
        prompts = random_prompts(batch, 256, seed=20 + batch)
        make = lambda backend: SpecGenerator(  # noqa: E731
            target, NoText(), None if method == "ar" else drafter,
            DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=24, backend=backend), eos_token_ids=[])
        eager, compiled = make("eager").generate(prompts), make("compiled").generate(prompts)
        case = new_tally()
        for p, ref, got in zip(prompts, eager.token_ids, compiled.token_ids):
            tally(case, target, p, ref, got, method=method, batch=batch)
        st.step(f"{method}_batch{batch}", case)
        for k in ("cases", "equal", "numerical", "real", "details"):
            out[k] += case[k]
    out["ok"] = out["real"] == 0 and out["cases"] > 0
    return out


# the toy drafter differs from the toy target in structure, as 1.7B does from 8B, so no graph is
# shared between them (dynamo guards on a module's structure, not on which module it is)
TIMING_SHAPES = {True: ("toy", "toy_drafter", torch.float32, 32, 8), False: ("qwen3_8b", "qwen3_1p7b", torch.bfloat16, 512, 32)}


def stage_compiled_timing(device: str, toy: bool, methods=("ar",), st: Stage | None = None,
                          room_s=lambda: float("inf")) -> dict:
    """Per-round wall time, eager against compiled (CUDA graphs on CUDA), at Qwen3-8B (target) /
    1.7B (drafter, only when sync is timed) shapes in bf16. Each compiled method costs cold compiles
    of the large graphs (ESTIMATE), so only AR runs by default; a sub-step that `room_s()` (the
    budget left) cannot hold is recorded as skipped."""
    st = st or Stage()
    name_t, name_d, dtype, prefix, tokens = TIMING_SHAPES[toy]
    dev = torch.device(device)
    big_t = random_model(name_t, dev, dtype, seed=0)
    big_d = as_drafter(random_model(name_d, dev, dtype, seed=1), 16) if "sync" in methods else None
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
    out["ok"] = all(s.get("rounds") for s in st.record["steps"].values() if s.get("status") != "skipped")
    return out


class Estimate:
    """The default run's duration on one H200, stage by stage, from stated inputs (seconds).

    Inputs:
    - compile of one large graph, cold: 87 s for a 36-layer Qwen3-8B graph with inductor on these
      CPUs (DESIGN §10; dynamo alone 7 s), pro rata by layers for the 28-layer 1.7B (68 s). On the
      GPU host inductor does the same tracing and lowering (Triton kernels are shared between the
      identical layers), so the CPU figure is taken as is;
    - compile of one tiny graph (2 layers): 2 s with inductor on CPU (docs/design.md, Backends),
      taken as 5 s on CUDA for Triton's kernel builds;
    - graphs per stage: counted with a counting torch.compile backend on the toy models
      (tests/integration/test_gpu_check.py checks these numbers against a count);
    - the tiny-model stages are host-bound on a GPU (a few hundred aten ops a pass): their time is
      bounded by their time on this project's 2-core CPU, one thread (measured, below);
    - an eager Qwen3-8B round costs ~20 ms of host time (2.6 k ops at 7.5 µs, DESIGN §10), a
      1.7B-drafted sync or async round ~60-80 ms; readiness decodes 5 loops (ar, sync, 3 async
      budgets) of 32 tokens after a 32-token warm-up, 64 rounds each at τ = 1 (random weights);
    - startup (imports, CUDA context) and model init (8B and 1.7B random weights made on the device).
    """

    TIMING_GRAPH_S = {"target": 87.0, "drafter": 87.0 * 28 / 36}  # Qwen3-8B, Qwen3-1.7B
    TINY_GRAPH_S = 5.0
    # graphs each compiled run makes, per role, counted on the toy models (count_graphs). The tiny
    # pair's target and drafter share a structure, so they share graphs of equal shapes: only the
    # total counts there; on CUDA async's side-stream drafter passes (no CUDA graphs) are compiled
    # apart, which can add one graph per shape they shared on CPU: TINY_CUDA_EXTRA
    GRAPHS = {"compiled_equal": {"target": 2, "drafter": 5}, "ar": {"target": 1}, "sync": {"target": 1, "drafter": 2}}
    TINY_CUDA_EXTRA = 2
    STAGES_S = {  # stage: seconds on one H200, without its compiles. Tiny stages: their time on
        # this project's CPU (2-core AMD EPYC, one thread, default sizes, measured) rounded up
        "startup": 15,  # torch + transformers imports, the CUDA context
        "greedy": 20,  # 10 tiny runs + transformers' generate per prompt: 17 s on the CPU
        "sampling": 10,  # 3 loops over 3,000 requests in one batch: 24 s on the CPU, compute-bound there
        "race": 10,  # 8 tiny async runs in bf16: 5 s on the CPU; + the host-sync count (9 short calls)
        "async_sync": 5,  # 4 sync + 8 async tiny runs, fp32 and bf16: 2 s on the CPU
        "gpu_tests": 60,  # pytest start ~10 s, flex_attention's compile ~30 s, ragged and race runs
        "train": 45,  # accelerate start, flex_attention's forward and backward compiles, 20 tiny steps
        "readiness": 40,  # 8B + 1.7B init ~10 s, latencies ~6 s, 5 eager loops of 64 rounds at 20-80 ms
        "compiled_equal": 5,  # 3 tiny eager and compiled runs of 24 tokens, without their compiles
        "compiled_timing": 10,  # 8B init ~5 s, eager AR 64 rounds at ~20 ms, compiled AR's rounds and capture
    }

    def __init__(self, graphs: dict | None = None):
        self.graphs = graphs or self.GRAPHS

    def substep(self, method: str, backend: str) -> float:
        """A compiled_timing sub-step: its cold compiles, plus 64 rounds at eager speed."""
        compiles = sum(n * self.TIMING_GRAPH_S[role] for role, n in self.graphs[method].items())
        return (compiles if backend == "compiled" else 0.0) + 5.0

    def stage(self, name: str, timing_methods=("ar",)) -> float:
        extra = 0.0
        if name == "compiled_equal":
            extra = (sum(self.graphs["compiled_equal"].values()) + self.TINY_CUDA_EXTRA) * self.TINY_GRAPH_S
        elif name == "compiled_timing":
            extra = sum(self.substep(m, "compiled") - 5.0 for m in timing_methods)
        return self.STAGES_S[name] + extra

    def table(self, stages, timing_methods=("ar",)) -> dict:
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
                role.append("drafter" if hasattr(model.config, "d3d") else "target")
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
STAGES = ("greedy", "sampling", "race", "async_sync", "gpu_tests", "train", "readiness", "compiled_equal",
          "compiled_timing")


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
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="a stage (or compiled_timing sub-step) whose estimate does not fit in what is left of this "
                        "is recorded as skipped, not started (the README wraps the run in `timeout 480`)")
    p.add_argument("--timing-methods", nargs="+", default=["ar"], choices=["ar", "sync"],
                   help="loops compiled_timing times at 8B shapes (sync adds ~220 s of cold compiles)")
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
    runs = {
        "greedy": lambda st: stage_greedy(dev, 16 if args.toy else 32, st=st),
        "sampling": lambda st: stage_sampling(dev, st=st),
        "race": lambda st: stage_race(dev, new_tokens=24 if args.toy else 48, st=st),
        "async_sync": lambda st: stage_async_sync(dev, new_tokens=24 if args.toy else 48, st=st),
        "gpu_tests": lambda st: stage_gpu_tests(dev, st=st),
        "train": lambda st: stage_train(dev, out_dir, args.toy, st=st),
        "readiness": lambda st: stage_readiness(dev, out_dir, args.toy, st=st),
        "compiled_equal": lambda st: stage_compiled_equal(dev, args.toy, st=st),
        "compiled_timing": lambda st: stage_compiled_timing(dev, args.toy, tuple(args.timing_methods), st=st,
                                                            room_s=room_s),
    }
    for name in chosen:
        st = report.begin(name)
        # the toy run's stages are CPU-sized: only a budget already spent skips them
        # (compiled_timing guards each of its sub-steps: AR may fit where sync does not)
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
