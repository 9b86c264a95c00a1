"""The README's GPU section is a list of commands a researcher runs in order on a GPU node. Each one
must exist: its Hydra overrides compose and bind to the typed config (tests/unit), and run on a CPU
it stops where it needs a GPU or the Hub with one `error:` line, no traceback (tests/integration,
heavy). A command whose key was renamed, or an overlay that does not compose, fails here first."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose

JOBS = ("generate", "train", "prune", "eval", "export")  # the Hydra recipes; pipeline/report take their own flags
SBATCH = "scripts/slurm/d3d.sbatch"  # the cluster line's batch script: its config, module and overrides follow


def gpu_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## On a GPU node")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def commands() -> list[str]:
    """Every shell line of the section's ```bash blocks, comments and continuations removed."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", gpu_section(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def split_multirun(value: str) -> str:
    """`a=0,1` in a multirun sweeps 0 and 1: bind the first arm (commas inside brackets are a list)."""
    depth, out = 0, ""
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            break
        out += ch
    return out


def hydra_call(line: str) -> tuple[str, list[str]] | None:
    """(job, overrides) of a line that runs a d3d recipe through python, accelerate or torchrun."""
    argv = shlex.split(line)
    if SBATCH in argv:  # sbatch ... scripts/slurm/d3d.sbatch ACCELERATE_CONFIG MODULE [overrides]
        i = argv.index(SBATCH) + 1
    elif "-m" in argv:
        i = argv.index("-m")
    else:
        return None
    module = argv[i + 1] if i + 1 < len(argv) else ""
    job = module.removeprefix("d3d.")
    if not module.startswith("d3d.") or job not in JOBS:
        return None
    args = argv[i + 2:]
    multirun = "-m" in args or "--multirun" in args
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    for a in overrides:
        assert not a.startswith("-"), f"README: {line!r}: {a} is not a Hydra override"
    if multirun:
        overrides = [split_multirun(a) for a in overrides]
    return job, overrides


def written_by(job: str, overrides: list[str]) -> str | None:
    """Where a line writes by default on a GPU node, relative, as the section's later lines name it:
    generation its responses, training and pruning their drafter's final/."""
    cfg = compose(job, [o for o in overrides if not o.startswith("hydra/")] + ["paths.root_dir=."])
    folder = {"generate": lambda: cfg.generate.out_dir, "train": lambda: f"{cfg.train.out_dir}/final",
              "prune": lambda: f"{cfg.prune.out_dir}/final"}.get(job)
    return folder().removeprefix("./") if folder else None


def test_the_section_has_the_order_a_researcher_follows():
    lines = commands()
    jobs = [c[0] for c in map(hydra_call, lines) if c]
    assert any("gpu_check.py" in line for line in lines[:3]), "the GPU check comes first"
    seen = [j for k, j in enumerate(jobs) if j not in jobs[:k]]
    assert seen == ["generate", "train", "prune", "eval", "export"], seen
    assert any(" -m " in f" {line} " and "sweep" in line or "hydra/launcher" in line for line in lines), "sweeps last"


@pytest.mark.parametrize("line", [line for line in commands() if hydra_call(line)])
def test_every_recipe_line_composes_and_binds(line, tmp_path):
    from d3d.settings import bind_config

    job, overrides = hydra_call(line)
    cfg = compose(job, [o for o in overrides if not o.startswith("hydra/")], tmp_path)
    bind_config(cfg, job)


@pytest.mark.parametrize("line", commands())
def test_every_file_a_line_names_exists(line):
    for word in shlex.split(line):
        if re.fullmatch(r"(scripts|conf)/[\w./-]+\.(py|yaml)", word):
            assert (ROOT / word).is_file(), f"README: {line!r} names {word}, which is not in the repository"
        if word.startswith("--config_file="):
            assert (ROOT / word.split("=", 1)[1]).is_file()


def test_parser_reads_what_the_readme_writes():
    """The helpers above on lines of each shape (seen failing when a shape is misread)."""
    assert hydra_call("accelerate launch --config_file conf/accelerate/fsdp.yaml -m d3d.train +experiment=qwen3_8b") == (
        "train", ["+experiment=qwen3_8b"])
    assert hydra_call("python -m d3d.train -m +experiment=qwen3_8b train.ar_weight=0,1") == (
        "train", ["+experiment=qwen3_8b", "train.ar_weight=0"])
    assert split_multirun("eval.concurrency=[1,2,4],x") == "eval.concurrency=[1,2,4]"
    assert hydra_call("python scripts/memory_plan.py") is None
    assert hydra_call(f"sbatch --nodes 4 --gpus-per-node 8 {SBATCH} conf/accelerate/fsdp.yaml d3d.train +experiment=x") == (
        "train", ["+experiment=x"])
    assert Path(ROOT / "README.md").is_file()


def make_dry_run(tmp_path, *args: str) -> str:
    """The commands `make setup` would run for a venv that does not exist yet (make -n: nothing runs)."""
    import subprocess

    run = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path}/venv", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_setup_without_a_torch_spec_keeps_the_machines_torch(tmp_path):
    """The section's first line, `make setup TORCH_SPEC=""` on a GPU node: the venv sees the system's
    packages (the node's CUDA torch) and every pip install is held to that torch's version, so
    neither d3d's requirements nor vLLM's pin replace it. The CPU default (CI's) installs its own."""
    line = next(line for line in commands() if line.startswith("make setup"))
    keep = make_dry_run(tmp_path, *shlex.split(line)[2:])
    assert 'TORCH_SPEC=""' in line and f"-m venv --system-site-packages {tmp_path}/venv" in keep
    installs = [ln for ln in keep.splitlines() if " -m pip install " in ln and ' -e ".[' in ln]  # d3d and its extras
    assert installs and all(f"-c {tmp_path}/venv/torch-constraint.txt" in ln for ln in installs), installs
    assert "print('torch==' + torch.__version__)\" > " + f"{tmp_path}/venv/torch-constraint.txt" in keep
    default = make_dry_run(tmp_path)
    assert "--system-site-packages" not in default and 'pip install -q "torch==' in default


def test_the_section_follows_one_drafter():
    """The stages' first lines are one chain: training reads the responses generation wrote, pruning
    the drafter training wrote, eval and export the drafter pruning wrote (seen failing on a section
    whose pruning line took the 8B drafter and whose eval and export lines the unpruned 1.7B one)."""
    first: dict[str, list[str]] = {}
    for call in filter(None, map(hydra_call, commands())):
        first.setdefault(*call)

    def checkpoint(job: str) -> str:
        found = [o.split("=", 1)[1] for o in first[job] if o.startswith("drafter.checkpoint=")]
        assert found, f"README: the first {job} line names no drafter.checkpoint"
        return found[0]

    responses = compose("train", first["train"] + ["paths.root_dir=."]).train.responses_dir.removeprefix("./")
    assert responses == written_by("generate", first["generate"]), "training reads other responses than generation wrote"
    assert checkpoint("prune") == written_by("train", first["train"]), "pruning starts from another drafter than training's"
    pruned = written_by("prune", first["prune"])
    assert checkpoint("eval") == pruned and checkpoint("export") == pruned, (
        f"eval and export read {checkpoint('eval')}, {checkpoint('export')}; pruning wrote {pruned}")
