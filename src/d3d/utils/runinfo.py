"""What every result records: versions, device, dtype, git commit."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

from d3d.utils.hardware import cpu_info


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def git_dirty() -> bool | None:
    """True when the working tree has uncommitted changes (the commit alone does not say what ran)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's listing: <pci bus id>/information per GPU


def gpu_name() -> str | None:
    """This machine's GPU model, one reader for every record that names it (eval's decode.backend=auto,
    the GPU check, bench's resume key), so that two records of one machine name it alike. The
    driver's own listing (/proc/driver/nvidia/gpus, its first GPU) asks CUDA nothing: d3d.generate
    records its run before an engine's workers start, and a CUDA probe in the parent would keep a
    forked engine core from using the GPU. Where that listing is missing (a container without it),
    CUDA's name, asked only of a process that has initialised CUDA already."""
    for info in sorted(NVIDIA_GPUS.glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name(0)
    return None


def run_info(device: torch.device | str | None = None) -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": gpu_name(),
        "cpu": cpu_info(),  # model, bf16 flags: CPU figures depend on them (bf16 native or emulated)
    }
    if device is not None:
        info["device"] = str(device)
    return info
