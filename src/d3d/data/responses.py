"""The target's responses on disk: what d3d.generate writes and d3d.train / d3d.prune read.

A responses folder holds one `responses.rank<r>.jsonl` per generating process. Reading lives here,
below the recipes, so the training recipes do not import the generation recipe.
"""

from __future__ import annotations

from pathlib import Path

from d3d.utils.io import read_jsonl, unique


def rank_file(out_dir: str | Path, rank: int) -> Path:
    """The file one generating process appends its rows to (one writer per file)."""
    return Path(out_dir) / f"responses.rank{rank}.jsonl"


def read_responses(out_dir: str | Path) -> list[dict]:
    """All rows of a responses folder (every rank's file), in file order, each id once."""
    rows = []
    for path in sorted(Path(out_dir).glob("responses.rank*.jsonl")):
        rows += list(read_jsonl(path))
    return unique(rows, lambda r: r["id"])


def row_backends(rows: list[dict]) -> dict[str, int]:
    """How many rows each generation backend wrote (rows from before backends existed are `hf`)."""
    counts: dict[str, int] = {}
    for row in rows:
        name = (row.get("settings") or {}).get("backend", "hf")
        counts[name] = counts.get(name, 0) + 1
    return counts
