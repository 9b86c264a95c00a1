"""The GPU check: one script to run whenever a GPU is lent (about 5 minutes on one H200).

    PYTHONPATH=src python scripts/gpu_check.py --out-dir $OUT             # on the GPU machine
    python scripts/gpu_check.py --device cpu --toy --out-dir /tmp/gc      # what the tests run

It needs torch, transformers and pytest only (no Hydra, OmegaConf or datasets, which the GPU
machines lack) and builds every model from a config with random weights (no hub). Stages, each
recorded in <out-dir>/gpu_check.json as soon as it ends, so a crash or a timeout still returns
what finished (a failing stage is recorded and the next one runs):

1. env          torch / transformers versions, the device, its capability
2. greedy       ar / sync / async greedy on a tiny random Qwen3 in fp32, batch 1 and a ragged batch,
                against transformers' generate; every difference is classified by the target's
                logit margin (d3d.decoding.divergence); passes when none is "real"
3. sampling     contract 2 on the device: one verification step on a toy vocabulary (60,000 draws)
                and the joint law of two sampled tokens through ar / sync / async (3,000 requests
                in one batch), total-variation distance against the exact law
4. race         the race check: async with its tray pass overlapped (a side stream on CUDA, a worker
                thread on CPU) against async serial (overlap=none) in bf16, tokens, τ and hits bit for
                bit: the same ops on the same shapes, only scheduled differently; host syncs per round
4b. async_sync  async against sync: in fp32 tokens and τ bit for bit; in bf16 tokens (a difference
                classified by the target's margin), not τ: their drafter passes lay the same keys out
                differently, and bf16 SDPA moves by an ulp with that (DESIGN §10)
5. gpu_tests    pytest -m gpu tests/integration/test_gpu.py: flex BlockMask == dense mask, every method ragged at
                T = 0 and 1 on CUDA, the race check failing on a broken stream hand-off (the other gpu
                tests repeat stages 2-4)                                                    [GPU only]
6. train        scripts/gpu_train_check.py: bf16 steps of a tiny Qwen3 through the training step
7. readiness    scripts/gpu_readiness.py at Qwen3-8B target / Qwen3-1.7B drafter shapes with random
                weights: verify latency against B, packed-pass latency against budget, the loop's
                per-round wall time next to its CUDA-event times, overlap, projected speedups
8. compiled     decode.backend=compiled (static KV buffers, torch.compile; CUDA graphs on CUDA):
                greedy tokens against the eager loop's on the tiny pair (fp32), then the AR and sync
                loops' per-round wall time, eager against compiled, at Qwen3-8B / 1.7B shapes (bf16,
                compile time reported apart). Last, because compiling an 8B model takes minutes
Exit status 0 when every stage passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # d3d from this checkout, installed or not

from d3d.decoding import DecodeConfig, SpecGenerator  # noqa: E402
from d3d.decoding.divergence import classify  # noqa: E402
from d3d.decoding.verify import Sampling, probs, sample_verify  # noqa: E402


def _script(name: str):
    """A sibling script as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readiness = _script("gpu_readiness")  # its random-model helpers and NoText serve the checks too
NoText = readiness.NoText


def tiny_pair(device: str, dtype: torch.dtype, block_size: int = 4, seed: int = 0, vocab: int = 256):
    """A tiny random Qwen3 target and a drafter copied from it with a little noise (so drafts
    are often right and the async trays hit). A wide init makes the logits peaked: near-ties,
    which any two kernels may break differently, are then rare."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, initializer_range=0.2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to(device=device, dtype=dtype).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return target, readiness.as_drafter(drafter, block_size)


def random_prompts(n: int, vocab: int, seed: int, lengths=(9, 3, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


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


def stage_greedy(device: str, new_tokens: int = 32) -> dict:
    target, drafter = tiny_pair(device, torch.float32, block_size=6)
    out = new_tally()
    for method, B, C, F in GREEDY_CASES:
        for batch in (1, 3):
            prompts = random_prompts(batch, 256, seed=batch)
            gen = SpecGenerator(target, NoText(), None if method == "ar" else drafter,
                                DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=new_tokens),
                                eos_token_ids=[])
            res = gen.generate(prompts)
            for p, got in zip(prompts, res.token_ids):
                ref = target.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False)
                tally(out, target, p, ref[0, len(p):].tolist(), got, method=method, B=B, C=C, F=F, batch=batch)
    out["ok"] = out["real"] == 0
    return out


def _tv(counts: dict, exact: dict, n: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in {**{k: 0.0 for k in counts}, **exact}.items())


def stage_sampling(device: str, n_requests: int = 3000) -> dict:
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
        out["joint_tv"][method] = _tv(counts, exact, n_requests)
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


def stage_race(device: str, dtype: torch.dtype = torch.bfloat16, new_tokens: int = 48) -> dict:
    """The race check: async with its tray pass overlapped (a side stream on CUDA, a worker thread
    on CPU) against async run serially (overlap=none), bit for bit: tokens, τ and hits per round.
    Both run the same ops on the same shapes in the same order, so in any dtype the only thing
    that can differ is the scheduling, and a hand-off that does not wait shows up here. (Not
    async against sync: their drafter passes lay the same visible keys out differently, which moves
    bf16 SDPA by an ulp and flips near-tie drafts; DESIGN §10, tests/unit/test_sdpa_gaps.py.)
    On CPU both runs use one thread per op (the worker's own and the main thread's), so no op's
    reduction is split differently between them."""
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
                out["runs"].append({"batch": batch, "C": C, "F": F, **same_rounds(serial, both)})
    finally:
        torch.set_num_threads(threads)
    runs = out["runs"]
    # hits must happen, or the trays the hand-off carries were never used and nothing was checked
    out["some_hits"] = any((r["hit_rate"] or 0) > 0 for r in runs)
    out["ok"] = out["some_hits"] and all(r["tokens_equal"] and r["tau_equal"] and r["hits_equal"] for r in runs)
    if device.startswith("cuda"):
        out["host_syncs_per_round"] = count_syncs(target, drafter, random_prompts(3, 256, seed=13), new_tokens)
    return out


def stage_async_sync(device: str, new_tokens: int = 48) -> dict:
    """Async against sync, what survives each dtype (DESIGN §10). fp32: tokens and τ bit for bit
    (a hit serves exactly the block a synchronous draft would). bf16: tokens only, and a token
    difference is classified by the target's logit margin as the greedy stage does (in a ragged
    batch the target's cache keeps rejected slots hidden, so a different τ in one row changes the
    key layout the others' verify passes see): it fails only on a real divergence. τ in bf16 is
    recorded, not required."""
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
        out[name] = res
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


def stage_gpu_tests(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"ok": True, "skipped": "CPU run: the gpu-marked tests need CUDA"}
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # only the file that collects without Hydra, and only what the other stages do not already run
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/integration/test_gpu.py", "-k", "flex or ragged or broken"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}


def stage_train(device: str, out_dir: Path, toy: bool) -> dict:
    script = ROOT / "scripts" / "gpu_train_check.py"
    if not script.is_file():
        return {"ok": False, "error": "scripts/gpu_train_check.py is missing"}
    out = out_dir / "gpu_train_check.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), "--device", device.split(":")[0], "--out", str(out),
                           "--steps", "4" if toy else "20"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    res = json.loads(out.read_text()) if out.is_file() else {}
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "result": res,
            "tail": (proc.stdout + proc.stderr)[-2000:]}


def stage_readiness(device: str, out_dir: Path, toy: bool) -> dict:
    out = str(out_dir / "gpu_readiness.json")
    if toy:
        argv = ["--target", "toy", "--drafter", "toy", "--device", device, "--dtype", "float32", "--prefix", "32",
                "--block-size", "4", "--block-sizes", "1", "4", "--budgets", "2x1", "3x2", "--hit-rate", "0.3", "0.6",
                "--loop-tokens", "12", "--repeats", "1", "--out", out]
    else:
        argv = ["--target", "qwen3_8b", "--drafter", "qwen3_1p7b", "--device", device, "--dtype", "bfloat16",
                "--prefix", "2048", "--out", out]
    res = readiness.main(argv)
    return {"ok": True, "result": res}


def stage_compiled(device: str, toy: bool) -> dict:
    """The compiled backend gives the eager loop's greedy tokens, and what it saves per round."""
    target, drafter = tiny_pair(device, torch.float32, block_size=6)
    out = new_tally()
    cases = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("async", 4, 3, 2)]
    for method, B, C, F in cases[:1] if toy else cases:
        for batch in (1,) if toy else (1, 3):
            prompts = random_prompts(batch, 256, seed=20 + batch)
            make = lambda backend: SpecGenerator(  # noqa: E731
                target, NoText(), None if method == "ar" else drafter,
                DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=24, backend=backend), eos_token_ids=[])
            eager, compiled = make("eager").generate(prompts), make("compiled").generate(prompts)
            for p, ref, got in zip(prompts, eager.token_ids, compiled.token_ids):
                tally(out, target, p, ref, got, method=method, batch=batch)
    del target, drafter
    # per-round wall time at the real shapes (or toy ones): eager, then compiled after its warm-up
    shapes = ("toy", "toy", torch.float32, 32, 8) if toy else ("qwen3_8b", "qwen3_1p7b", torch.bfloat16, 512, 32)
    name_t, name_d, dtype, prefix, tokens = shapes
    big_t = readiness.random_model(name_t, torch.device(device), dtype, seed=0)
    big_d = readiness.as_drafter(readiness.random_model(name_d, torch.device(device), dtype, seed=1), 16)
    out["timing"] = {"target": name_t, "drafter": name_d, "dtype": str(dtype), "prefix": prefix}
    for method in ("ar",) if toy else ("ar", "sync"):
        for backend in ("eager", "compiled"):
            t0 = time.perf_counter()
            lp = readiness.loop_rounds(big_t, big_d, DecodeConfig(method=method, block_size=16, backend=backend),
                                       prefix, tokens, torch.device(device))
            lp["seconds_with_warmup"] = round(time.perf_counter() - t0, 1)
            out["timing"][f"{method}_{backend}"] = lp
            print(f"[gpu_check] compiled: {method} {backend} round {lp['round_wall_ms']:.2f} ms", flush=True)
    out["ok"] = out["real"] == 0
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--toy", action="store_true", help="toy sizes everywhere (the CPU test)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "outputs/gpu_check"))
    p.add_argument("--stages", nargs="+", default=None, help="run only these stages")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_file = out_dir / "gpu_check.json"
    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stages compare with generate in true fp32
    report: dict = {"env": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": __import__("transformers").__version__, "device": dev,
                            "device_name": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor(),
                            "capability": list(torch.cuda.get_device_capability(dev)) if dev.startswith("cuda") else None,
                            "toy": args.toy},
                    "stages": {}}
    stages = {
        "greedy": lambda: stage_greedy(dev, 16 if args.toy else 32),
        "sampling": lambda: stage_sampling(dev),
        "race": lambda: stage_race(dev, new_tokens=24 if args.toy else 48),
        "async_sync": lambda: stage_async_sync(dev, new_tokens=24 if args.toy else 48),
        "gpu_tests": lambda: stage_gpu_tests(dev),
        "train": lambda: stage_train(dev, out_dir, args.toy),
        "readiness": lambda: stage_readiness(dev, out_dir, args.toy),
        "compiled": lambda: stage_compiled(dev, args.toy),
    }
    for name, run in stages.items():
        if args.stages and name not in args.stages:
            continue
        t0 = time.perf_counter()
        try:
            res = run()
        except Exception as err:  # recorded, and the next stage still runs
            res = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        report["stages"][name] = res
        report_file.write_text(json.dumps(report, indent=2, default=str))
        print(f"[gpu_check] {name}: {'ok' if res['ok'] else 'FAILED'} in {res['seconds']} s", flush=True)
        if not res["ok"]:
            print(json.dumps({k: v for k, v in res.items() if k != "result"}, indent=2, default=str)[-3000:], flush=True)
    report["ok"] = all(s["ok"] for s in report["stages"].values())
    report_file.write_text(json.dumps(report, indent=2, default=str))
    print(f"[gpu_check] {'all stages passed' if report['ok'] else 'SOME STAGES FAILED'}; written: {report_file}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
