"""Crash-safe checkpoint promotion: `last/` is replaced by a finished `last.partial/` so that a kill
at any moment leaves one complete checkpoint that says which step it holds.

    write everything into last.partial/ -> mark_complete(last.partial, step)   (COMPLETE, written last)
    (the job writes its row for that step here: the row may run ahead of last/, never behind)
    promote(): last -> last.old, last.partial -> last, remove last.old

`recover()` at start-up finishes an interrupted promotion: a complete last.partial wins (it is the
newest finished state), else last/, else a last.old left by a kill between the two renames. An
incomplete last.partial (no marker, or one a kill left empty) is deleted. `trim_rows` then drops
the rows of steps the checkpoint does not hold, so that a resumed run rewrites them instead of
logging them twice; `check_record_reaches` refuses a checkpoint the record no longer reaches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from d3d.utils.io import CorruptFile, published, read_jsonl

MARKER = "COMPLETE"


def mark_complete(folder: Path, step: int) -> None:
    """Record the step inside the checkpoint, last and durably: its presence means "finished". It is
    written aside and renamed, so a kill leaves either no marker or a whole one, never an empty one."""
    path = Path(folder) / MARKER
    tmp = path.with_name(MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": int(step)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def saved_step(folder: Path) -> int | None:
    """The step a complete checkpoint holds; None for an unfinished one or one from before markers.
    A marker that is there but unreadable (empty or torn: written in place by an older version when
    the kill came) raises CorruptFile: which step the folder holds is unknown."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    try:
        step = json.loads(text)["step"]
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    except (json.JSONDecodeError, TypeError, KeyError):
        pass
    raise CorruptFile(f"{path} is empty or torn ({text[:40]!r}, not {{\"step\": N}}), so the step {folder.name}/ holds is "
                      f"unknown. Fix: delete {folder} and rerun to start the run over (or pass a new output "
                      f"folder).")


def _complete_step(folder: Path) -> int | None:
    """saved_step for a folder being written: an unreadable marker means "not finished" (the kill
    came while writing it), so the folder is redone, not trusted."""
    try:
        return saved_step(folder)
    except CorruptFile:
        return None


def _rename(src: Path, dst: Path) -> None:
    os.replace(src, dst)  # one function, so tests can stop the process between the two renames


def promote(out_dir: Path, name: str = "last") -> Path:
    """Make out_dir/<name>.partial (complete) the new out_dir/<name>."""
    last, partial, old = out_dir / name, out_dir / f"{name}.partial", out_dir / f"{name}.old"
    if _complete_step(partial) is None:
        raise RuntimeError(f"{partial} is not complete: mark_complete() it before promoting")
    shutil.rmtree(old, ignore_errors=True)
    if last.exists():
        _rename(last, old)
    _rename(partial, last)
    shutil.rmtree(old, ignore_errors=True)
    return last


def recover(out_dir: Path, name: str = "last", upto: int | None = None) -> Path | None:
    """Finish or undo an interrupted save; the complete checkpoint to resume from, if any.
    `upto`: the last step the job's record holds; a complete last.partial beyond it is a step whose
    row was never written (prune writes the row after the checkpoint), so it is redone instead."""
    last, partial, old = out_dir / name, out_dir / f"{name}.partial", out_dir / f"{name}.old"
    step = _complete_step(partial) if partial.is_dir() else None
    if step is not None and (upto is None or step <= upto):
        promote(out_dir, name)  # killed after the state was complete: it is the newest
    else:
        shutil.rmtree(partial, ignore_errors=True)  # killed while writing it (or before its row): redone
        if not last.exists() and old.is_dir():
            _rename(old, last)  # killed between the renames: the previous checkpoint is still whole
    shutil.rmtree(old, ignore_errors=True)
    if last.is_dir():
        saved_step(last)  # a promoted checkpoint had a whole marker: an unreadable one now is damage, said here
        return last
    return None


def publish(out_dir: Path, name: str, step: int, write: Callable[[Path], None]) -> Path:
    """out_dir/<name> replaced whole by what `write` puts into a fresh <name>.partial, marked with
    `step`: the same write-then-rename as last/, so a kill leaves the previous folder or the new one
    (or, between the renames, <name>.old, which `recover(out_dir, name)` puts back)."""
    partial = out_dir / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    mark_complete(partial, step)
    return promote(out_dir, name)


def torn_json(folder: Path) -> Path | None:
    """The first JSON file of a model folder (config, tokenizer, generation config) that does not
    parse: a kill while it was written, or a copy cut short."""
    for path in sorted(Path(folder).glob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return path
    return None


def saved_config(folder: str | os.PathLike) -> dict | None:
    """A saved model folder's config.json as a dict; None when it is missing, empty or torn."""
    try:
        config = json.loads((Path(os.path.expanduser(str(folder))) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def saved_settings(folder: str | os.PathLike) -> dict | None:
    """A saved drafter's d3d settings as its config.json holds them (block_size, block_attention,
    draft_vocab, mask_token_id, ...), None where it holds none. The one parse of them: typed by
    d3d.models.drafter_settings.DrafterSettings.of_folder, read here, on the base floor, so that
    config-time code (d3d.config, no torch) reads them the same way."""
    raw = (saved_config(folder) or {}).get("d3d")
    return raw if isinstance(raw, dict) else None


# Where a parallel drafter's config.json names its mask id, read in the order vLLM's parallel drafting
# reads them (docs/serving.md), so d3d decodes with the id vLLM would serve: the first key present wins.
# d3d.export writes `mask_token_id`; PARD's own folders `pard_token`.
MASK_ID_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")


def named_mask_id(config: dict) -> tuple[str, int] | None:
    """(key, id) of the first MASK_ID_KEYS entry that config.json holds, or None."""
    for key in MASK_ID_KEYS:
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return key, int(value)
    return None


def saved_defaults(folder: str | os.PathLike) -> dict | None:
    """The settings a saved drafter folder decodes with unless a run sets others: its d3d settings
    (saved_settings), or for a PARD-format folder (no d3d settings, a mask id that MASK_ID_KEYS names)
    causal blocks, the rule it was trained with (d3d.models.drafter.pard_settings). None for a
    folder that is neither."""
    settings = saved_settings(folder)
    if settings is not None:
        return settings
    config = saved_config(folder)
    return {"block_attention": "causal"} if config is not None and named_mask_id(config) else None


def drafter_problem(folder: Path) -> str | None:
    """Why a saved drafter folder would not load (None: it looks whole), read from its files without
    loading the model: folders written in place before they were published could be cut by a kill
    (an empty config.json, a short safetensors file, a torn tokenizer.json)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return f"{folder} holds no config.json"
    torn = torn_json(folder)
    if torn:
        return f"{torn} is empty or torn"
    if saved_settings(folder) is None:
        return f"{folder / 'config.json'} holds no d3d settings"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return f"{folder} holds no .safetensors weights"
    for path in weights:  # 8-byte header length, a JSON header, then the tensors its offsets end at
        with open(path, "rb") as f:
            head = f.read(8)
            try:
                header = json.loads(f.read(int.from_bytes(head, "little"))) if len(head) == 8 else None
            except (json.JSONDecodeError, UnicodeDecodeError, OverflowError, MemoryError):
                header = None
        end = max((t["data_offsets"][1] for k, t in (header or {}).items() if k != "__metadata__"), default=0)
        if header is None or path.stat().st_size < 8 + int.from_bytes(head, "little") + end:
            return f"{path} is cut short"
    return None


def check_record_reaches(checkpoint: Path, needed: int | None, recorded: int | None, record: Path, fix: str) -> None:
    """A job writes a step's row before the checkpoint that holds the step, so its record always
    reaches the checkpoint. A checkpoint ahead of the record (the record was replaced, truncated or
    deleted since) would resume past rows that no longer exist, and the run would end with a history
    missing steps it trained: refused in one line instead. `needed`: the last step the record must
    hold (None: a checkpoint from before this was recorded, not checked)."""
    if needed is not None and (recorded is None or recorded < needed):
        has = "no rows" if recorded is None else f"rows up to step {recorded}"
        raise CorruptFile(f"{checkpoint} was saved after {record.name} recorded step {needed}, but {record} now holds "
                          f"{has}: the checkpoint is ahead of the run's record and the missing rows cannot be "
                          f"rebuilt. Fix: {fix}")


def trim_rows(path: Path, keep: Callable[[dict], bool]) -> list[dict]:
    """Rewrite a jsonl file of steps (atomically) keeping the rows `keep` accepts; returns them."""
    path = Path(path)
    rows = list(read_jsonl(path, ("step",)))
    kept = [r for r in rows if keep(r)]
    if len(kept) != len(rows):
        with published(path) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    return kept
