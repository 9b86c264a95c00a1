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
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": cpu_info(),  # model, bf16 flags: CPU figures depend on them (bf16 native or emulated)
    }
    if device is not None:
        info["device"] = str(device)
    return info
