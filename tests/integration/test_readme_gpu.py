"""Each recipe line of the README's GPU section, run on this CPU as one process with the Hub off,
gets to the point where it needs a GPU, the Hub or the previous stage's output and stops there with
one `error:` line and exit status 2: no traceback, no half-written output. `accelerate launch` and
torchrun lines run as plain `python -m` here (one process is what a CPU offers; the multi-process
paths have their own torchrun tests)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CACHE_DIR, FIXTURES, ROOT
from tests.unit.test_readme_gpu import commands, hydra_call, written_by

pytestmark = pytest.mark.heavy  # a fresh interpreter per line, ~10 s each


@pytest.mark.parametrize("line", [line for line in commands() if hydra_call(line)])
def test_recipe_line_stops_with_one_error_line(line, tmp_path):
    job, overrides = hydra_call(line)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "HYDRA_FULL_ERROR": "0"}
    env.pop("D3D_VERBOSE", None)
    argv = [sys.executable, "-m", f"d3d.{job}", *overrides, f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/hydra", f"hydra.sweep.dir={tmp_path}/hydra"]
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    err = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr, f"{line!r} on a CPU without the Hub:\n{run.stderr[-3000:]}"
    assert run.returncode == 2 and err and err[-1].startswith("error: "), (
        f"{line!r}: exit {run.returncode}, stderr ends {err[-3:]}")


# ---------------------------------------------------------------------------- the rehearsal
# Every line of the section, in its order, at toy scale on this CPU: each line's own words (launcher,
# accelerate config, module, overrides) with the GPU sizes made toy ones, each stage reading what the
# one before wrote. What a line cannot be here, and what covers it instead:
NOT_HERE = {
    "make setup": "installs; its TORCH_SPEC=\"\" branch is dry-run by tests/unit/test_readme_gpu.py",
    "scripts/gpu_check.py": "`make test-gpu-check` runs it on the CPU (--toy), every stage",
    "hydra/launcher=slurm": "a scheduler; the same multirun through submitit's local executor is "
                            "tests/integration/test_sweeps.py",
}
PROCESSES = 2  # the toy node's GPUs: every `torchrun --nproc_per_node` / accelerate launch gets 2
NODES, GPUS_PER_NODE = 2, 1  # the toy allocation of an sbatch line
TOY_SIZES = {  # job -> what makes the line a toy one (after the line's own overrides, so these win)
    "generate": ["data.limit=8", "generate.max_new_tokens=24", "generate.batch_size=4", "generate.progress=false"],
    "train": ["train.max_steps=2", "train.eval_every=2", "train.save_every=2", "train.freeze_embeddings=false",
              "train.progress=false", "train.val_size=2", "train.batch_size=1"],
    "prune": ["prune.num_layers=1", "prune.recovery_steps=1", "prune.calib_size=2", "prune.min_retention=0",
              "prune.progress=false", "train.freeze_embeddings=false", "train.val_size=2", "train.batch_size=1"],
    # one item per benchmark, no warm-up, a fixed tray budget (`auto` measures budgets first: minutes here)
    "eval": ["eval.n=1", "eval.max_new_tokens=8", "eval.warmup=0", "eval.async_budgets=[2x1]"],
    "export": ["train.val_size=2"],
}

# With the Hub off, MBPP and LiveCodeBench have no offline source here (hub only: skipped with a line);
# the seven-benchmark line reads them from the test fixtures instead, as a pre-filled cache would serve them
OFFLINE_FIXTURES = [f"benchmark.specs.{name}.{key}" for name in ("mbpp", "livecodebench") for key in (
    f"local_file={FIXTURES / (name + '.jsonl')}", "sources=[local]")]


def toy_overrides(job: str, overrides: list[str], root: Path, produced: dict[str, str]) -> list[str]:
    """The line's overrides at toy scale: the smoke experiment for its overlay, the CPU for a GPU it
    names, a checkpoint an earlier line wrote at its toy place; then the toy sizes and folders."""
    sizes = TOY_SIZES[job] + (OFFLINE_FIXTURES if "benchmark=all" in overrides else [])
    mine = {o.split("=", 1)[0] for o in sizes}
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in mine:  # the toy size instead of the GPU one
            continue
        if key.lstrip("+") == "experiment":
            o = "+experiment=smoke"
        elif key == "drafter.device" and value.startswith("cuda"):
            o = "drafter.device=cpu"
        elif key == "drafter.checkpoint":
            assert value in produced, f"README: {value} is written by no earlier line of the section ({produced})"
            o = f"drafter.checkpoint={produced[value]}"
        out.append(o)
    return [*out, *sizes, f"paths.root_dir={root}", f"paths.cache_dir={CACHE_DIR}"]


def generation(overrides: list[str], root: Path) -> subprocess.CompletedProcess:
    """The engine step, the line's own command: `torchrun --nproc_per_node N -m d3d.generate ...
    generate.backend=vllm`, with the fake vLLM first on PYTHONPATH (tests/stub_engine.py). Like vLLM on
    a GPU node its engine core is a process of its own, forked unless told to spawn, and a forked core
    refuses to start after a fork-poisoning CUDA probe in its rank; the targets resolve dtype and
    device as the GPU overlays' do (auto), so a probe on that path fails this step."""
    from tests.conftest import torchrun
    from tests.stub_engine import STUB_VLLM

    env = {"PYTHONPATH": os.pathsep.join([str(STUB_VLLM), str(ROOT / "src"), str(ROOT)]),
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(PROCESSES)))}
    return torchrun(PROCESSES, "d3d.generate", *overrides, "target.dtype=auto", "target.device=auto",
                    f"hydra.run.dir={root}/hydra/generate", module=True, env=env)


def run_line(line: str, root: Path, produced: dict[str, str], step: int) -> tuple[str, subprocess.CompletedProcess | None]:
    """Run one line of the section at toy scale; returns (what ran, its process) or (why not, None)."""
    from tests.stand_ins import rendezvous_port, sbatch

    for words, why in NOT_HERE.items():
        if words in line:
            return why, None
    argv = shlex.split(line)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
           "OMP_NUM_THREADS": "1", "D3D_CPU_BF16": "0"}
    hydra_dir = [f"hydra.run.dir={root}/hydra/{step}", f"hydra.sweep.dir={root}/hydra/{step}"]
    if argv[0] == "cat":  # a file an earlier line wrote: at its toy place
        head = next((k for k in produced if argv[1].startswith(k)), None)
        assert head, f"README: {argv[1]} is written by no earlier line"
        path = Path(produced[head] + argv[1][len(head):])
        return f"read {path}", subprocess.CompletedProcess(argv, 0 if path.is_file() else 1, path.read_text()
                                                           if path.is_file() else "", f"{path} is missing")
    if argv[0] == "sbatch":
        script = argv[argv.index("scripts/slurm/d3d.sbatch")]
        config, module, *overrides = argv[argv.index(script) + 1:]
        job = module.removeprefix("d3d.")
        toy = toy_overrides(job, overrides, root, produced) + hydra_dir
        toy += [f"train.out_dir={root}/ckpt/{step}"] if job == "train" else []
        return f"sbatch {NODES} x {GPUS_PER_NODE}", sbatch(ROOT / script, [config, module, *toy], nodes=NODES,
                                                            gpus_per_node=GPUS_PER_NODE, port=rendezvous_port())
    if argv[0].endswith("scripts/sweep.py") or argv[1:2] == ["scripts/sweep.py"]:
        cmd = [sys.executable, "scripts/sweep.py", *argv[2:], "--dry-run", "--gpus", str(PROCESSES), "--root", str(root)]
        return "dry run", subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    call = hydra_call(line)
    if call is None:  # python -m d3d.benchmarks and the like: as written
        cmd = [sys.executable, *argv[1:]] if argv[0].startswith("python") else argv
        return "as written", subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    job, overrides = call
    toy = toy_overrides(job, overrides, root, produced)
    writes = written_by(job, overrides)
    if job in ("train", "prune"):  # each drafter at its toy place, where the next line reads it
        toy.append(f"{job}.out_dir={root}/ckpt/{step}")
        produced[writes] = f"{root}/ckpt/{step}/final"
    if job == "generate":
        produced[writes] = str(root / "data" / "responses" / "tiny_random" / "cpu_math")  # smoke's target and prompts
    if argv[0] == "torchrun":
        assert job == "generate", f"README: {line!r}: torchrun is the section's launcher for generation only"
        return f"torchrun {PROCESSES} ranks, stand-in vLLM", generation(toy, root)
    if argv[0] == "accelerate":
        config = argv[argv.index("--config_file") + 1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
               str(PROCESSES), "-m", f"d3d.{job}", *toy, *hydra_dir]
        return f"accelerate launch {PROCESSES} processes", subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                                                                          text=True, timeout=600)
    cmd = [sys.executable, "-m", f"d3d.{job}", *toy, *hydra_dir]
    return "one process", subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("_", ["in order"])
def test_the_section_rehearsed_line_by_line_at_toy_scale(_, tmp_path):
    """Each line of the section, in order, at toy scale (TOY_SIZES, 2 processes, 2 stand-in nodes of one):
    generation on 2 torchrun ranks through an engine, training under FSDP2 on gloo, pruning under
    FSDP2 from that training's checkpoint, the seven-benchmark eval of the pruned drafter on 2 ranks
    with the Hub off (offline sources), its export, the sweep's dry run, and the SLURM script under
    the stand-in srun. Each
    line must finish with status 0 and leave what the next one reads; the lines this CPU cannot run
    are NOT_HERE, each with what covers it."""
    import json
    import time

    root = tmp_path / "node"
    produced: dict[str, str] = {}
    log = []
    for step, line in enumerate(commands()):
        t0 = time.perf_counter()
        how, proc = run_line(line, root, produced, step)
        log.append(f"{time.perf_counter() - t0:6.1f} s  {how:32}  {line[:110]}")
        print(log[-1], flush=True)
        if proc is None:
            continue
        assert proc.returncode == 0, f"README line {step}: {line!r} ({how}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    print("\n".join(log))
    ran = "\n".join(log)
    for words in ("torchrun 2 ranks", "accelerate launch 2 processes", "dry run", "sbatch 2 x 1"):
        assert words in ran, f"the section has no line run as {words!r}:\n{ran}"
    report = json.loads((Path(produced["data/responses/qwen3_8b/ultrachat"]) / "report.json").read_text())
    assert set(report["ranks"]) == {"0", "1"}  # two ranks, each its own shard
    runs = [json.loads(p.read_text()) for p in root.glob("hydra/*/run.json")]
    suite = [r for r in runs if len(r["benchmark_sources"]) >= 7]
    assert suite and suite[0]["processes"] == PROCESSES, [(r["processes"], list(r["benchmark_sources"])) for r in runs]
    pruned = [Path(produced[k]) for k in produced if k.endswith("-acceptance/final")]
    assert pruned and (pruned[0] / "config.json").is_file(), "the pruning line left no final/"
