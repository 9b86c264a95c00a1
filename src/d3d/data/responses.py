"""The target's responses on disk: what d3d.generate writes and d3d.train / d3d.prune read.

A responses folder holds one `responses.rank<r>.jsonl` per generating rank (a process of a launched
job, or one `generate.shard=i/n` job); readers see the union of every shard as one response set.
Reading lives here, below the recipes, so the training recipes do not import the generation recipe.
"""

from __future__ import annotations

from pathlib import Path

from d3d.errors import UserError
from d3d.utils.io import read_jsonl, unique

# The repetition-loop detector (`repetition_loop`): a reply whose last tokens repeat one period of at
# most MAX_PERIOD tokens at least MIN_REPEATS times, over at least MIN_SPAN tokens. Greedy decoding
# that falls into such a loop never leaves it (the same context gives the same argmax), so it runs
# to max_new_tokens; the span floor keeps a short run ("====", a row of dots) from counting.
MAX_PERIOD, MIN_REPEATS, MIN_SPAN = 64, 3, 64

# The fields every reader of a response row indexes (read_jsonl refuses a row without one).
RESPONSE_KEYS = ("id", "prompt_ids", "response_ids")


class ConflictingShards(UserError):
    """Two shards of one folder answer the same prompt differently."""


def rank_file(out_dir: str | Path, rank: int) -> Path:
    """The file one generating rank appends its rows to (one writer per file)."""
    return Path(out_dir) / f"responses.rank{rank}.jsonl"


def read_responses(out_dir: str | Path, drop_looping: bool = False) -> list[dict]:
    """All rows of a responses folder (every shard), in file order, each id once. A prompt answered in
    two shards with different responses (two runs that overlapped on the folder, e.g. array jobs
    with different shard counts) is refused: which one to train on is not ours to guess.
    `drop_looping`: leave out rows caught in a repetition loop (`is_looping`)."""
    rows, source = [], {}
    for path in sorted(Path(out_dir).glob("responses.rank*.jsonl")):
        for row in unique(read_jsonl(path, RESPONSE_KEYS), lambda r: r["id"]):  # a legacy file may repeat a row
            first = source.get(row["id"])
            if first is None:
                source[row["id"]] = (path.name, row["response_ids"])
                rows.append(row)
            elif first[1] != row["response_ids"]:
                raise ConflictingShards(
                    f"{out_dir}: prompt {row['id']!r} has different responses in {first[0]} and {path.name} "
                    f"(two generation runs overlapped on this folder). Fix: delete the shard files of one run, "
                    f"or generate into a new folder.")
    return [r for r in rows if not is_looping(r)] if drop_looping else rows


def repetition_loop(ids: list[int], max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
                    min_span: int = MIN_SPAN) -> int | None:
    """The shortest period p <= max_period such that the tail of `ids` is p-periodic over at least
    max(min_repeats * p, min_span) tokens; None if there is none."""
    n = len(ids)
    for p in range(1, min(max_period, n) + 1):
        need = max(min_repeats * p, min_span)
        if need > n:
            continue
        # ids[i] == ids[i - p] for every i of the last (need - p) positions <=> the last `need` tokens have period p
        if all(ids[i] == ids[i - p] for i in range(n - need + p, n)):
            return p
    return None


def is_looping(row: dict) -> bool:
    """Whether a response row ends in a repetition loop (the report counts these; training may drop them)."""
    return repetition_loop(row["response_ids"]) is not None


def row_backend(row: dict) -> str:
    """The generation backend that wrote a row (rows from before backends existed are `hf`)."""
    return (row.get("settings") or {}).get("backend", "hf")


def row_backends(rows: list[dict]) -> dict[str, int]:
    """How many rows each generation backend wrote."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row_backend(row)] = counts.get(row_backend(row), 0) + 1
    return counts
