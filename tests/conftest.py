"""Shared fixtures: one cache for the session (PyPI data, tiny models), composed configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The project cache (data/cache) is reused across runs so shipped data downloads once per machine.
CACHE_DIR = Path(os.environ.get("D3D_TEST_CACHE", ROOT / "data" / "cache"))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return CACHE_DIR


def compose(config_name: str, overrides: list[str] | None = None, tmp_path: Path | None = None):
    """Compose a root config the way the CLI would, with all outputs under tmp_path."""
    from d3d.config import compose as d3d_compose

    extra = []
    if tmp_path is not None:
        extra = [f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    return d3d_compose(config_name, list(overrides or []) + extra)


def load_script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep():
    """scripts/sweep.py as a module: its dry runs (tests/unit) and its claims end to end (tests/integration)."""
    return load_script("sweep")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, script, *args, timeout: int = 600, env: dict | None = None,
             module: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N` on this machine: N real processes (gloo on CPU). `accelerate
    launch --cpu --num_processes 2` starts only one here (docs/design.md, Models). `env`: more
    variables (an accelerate config's, `accelerate_env`); `module`: `script` is a module (`-m`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *(["-m"] if module else []), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path),
           **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def accelerate_env(config_file: str | Path, nproc: int) -> dict[str, str]:
    """The variables `accelerate launch --config_file F --num_processes N` gives each process, made by
    accelerate's own launcher code from the shipped yaml (so the test runs that file, not a copy of
    it); torchrun then starts the N processes, which `accelerate launch` does not do on a CPU."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--num_processes", str(nproc), "x"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


class Killed(Exception):
    """Stands in for SIGKILL at one point of a job (the crash-safety tests of train and prune)."""


def kill_on(n: int, real, when=lambda *a, **k: True):
    """`real`, except that its n-th call (counting the calls where `when` holds) raises Killed."""
    calls = []

    def fn(*args, **kw):
        if when(*args, **kw):
            calls.append(1)
            if len(calls) == n:
                raise Killed
        return real(*args, **kw)

    return fn


def conf_with_benchmark(tmp_path: Path, monkeypatch, name: str = "gsm_hard") -> Path:
    """A copy of conf/ with one more benchmark file (gsm8k's spec under another name), made the
    config tree of this test: what a researcher adding a benchmark YAML does."""
    import shutil

    from omegaconf import OmegaConf

    from d3d.configdir import config_dir

    conf = tmp_path / "conf"
    shutil.copytree(config_dir(), conf)
    spec = OmegaConf.load(conf / "benchmark" / "gsm8k.yaml")
    spec.specs = {name: {**spec.specs.gsm8k, "name": name}}
    OmegaConf.save(spec, conf / "benchmark" / f"{name}.yaml")
    monkeypatch.setenv("D3D_CONFIG_DIR", str(conf))
    return conf
