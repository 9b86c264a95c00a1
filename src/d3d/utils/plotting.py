"""Headless matplotlib for every figure d3d writes (eval's report, prune's steps, sweeps).

Imported lazily by the functions that draw, so a run that writes no figure never loads matplotlib.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend: files only, no display needed on a node or in CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write a figure and close it (an open figure per plot would grow a sweep's memory)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
