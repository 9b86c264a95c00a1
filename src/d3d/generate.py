"""`python -m d3d.generate`: the target answers a prompt set; its responses train the drafter.

Data parallel: each rank answers its own slice of the prompts and appends its rows to its own shard,
`<out_dir>/responses.rank<r>.jsonl`, as they finish. Ranks come from the launcher (`torchrun` /
`accelerate launch` on one node or many, `srun`), or from `generate.shard=i/n` for schedulers that
start independent jobs (array jobs), or both (job i of n, each a launch of w processes, is slice
i*w + r of n*w). A re-run skips every id already written by any shard, so a killed rank resumes
without losing or duplicating a row, and the readers (data/responses.py) see all shards as one set.
Each rank then adds its throughput to `<out_dir>/report.json`, with the folder's rows, cut and looping
replies summed from each shard's counts (`responses.rank<r>.counts.json`, kept as rows are added).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from d3d.config import differing_keys, hydra_job
from d3d.errors import ConfigError
from d3d.utils.io import FileLock, JsonlWriter, job_folder, resolve_path, write_json
from d3d.data.chat import chat_prompt_ids, require_thinking_switch, stop_ids
from d3d.data.prompts import load_prompt_set
from d3d.data.responses import MAX_PERIOD, MIN_REPEATS, MIN_SPAN, is_looping, rank_file, read_responses
from d3d.models.engines import check_backend, engine_gpus, engine_version, open_backend, prepare_start
from d3d.settings import bind_config, shipped_benchmark
from d3d.specs import GenerateConfig
from d3d.models.target import (load_model, load_tokenizer, model_fingerprint, pick_device, resolve_model_path,
                               torch_dtype)
from d3d.utils.runinfo import run_info

log = logging.getLogger("d3d.generate")

# What a row depends on, hence the folder's resume key (meta.json "settings"; every row carries them).
# The backend is one: an engine's greedy rows can differ from transformers' by bf16 near-ties, and
# one folder holds one backend's rows (docs/results/study_2026-12-01_generation_backends.md).
SETTING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "enable_thinking", "system_prompt",
                "backend")
# A folder written before a key existed was made with its value here (so it still resumes).
SETTING_DEFAULTS = {"backend": "hf"}


class OutputMismatchError(ConfigError):
    """The output folder holds rows made by a different target or with different settings."""


def check_output_folder(out_dir: Path, header: dict, holds_rows: bool) -> None:
    """A folder belongs to one target and one set of generation settings; say so if not.
    `holds_rows`: whether any response row is in it (the caller has read them already)."""
    meta_path = out_dir / "meta.json"
    # a run that failed before its first batch reached the disk left meta.json and no row: nothing
    # to mix, so it does not bind the folder (it used to refuse every rerun with other settings)
    if not meta_path.is_file() or not holds_rows:
        return
    import json

    old = json.loads(meta_path.read_text())
    old["settings"] = {**SETTING_DEFAULTS, **old.get("settings", {})}
    for key in ("target", "settings"):
        # keys only one side has are not compared: a folder from before `weights` existed resumes
        if differing_keys(old.get(key) or {}, header[key]):
            raise OutputMismatchError(
                f"{out_dir} already holds responses with {key} = {old.get(key)} but this run has "
                f"{key} = {header[key]}. Mixing them would corrupt the training data. Fix: choose another "
                f"folder (generate.out_dir=...) or delete {out_dir} to start over."
            )


def check_context(prompt_ids: dict[str, list[int]], max_new_tokens: int, max_context: int) -> None:
    too_long = [(pid, len(ids)) for pid, ids in prompt_ids.items() if len(ids) + max_new_tokens > max_context]
    if too_long:
        shown = ", ".join(f"{pid} ({n} tokens)" for pid, n in too_long[:5])
        raise ConfigError(
            f"{len(too_long)} prompt(s) do not fit the target's context of {max_context} tokens with "
            f"max_new_tokens={max_new_tokens}: {shown}. Fix: lower generate.max_new_tokens or drop those prompts."
        )


def max_context(model_path: str) -> int:
    """The target's context length, from its config (no weights loaded)."""
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 1 << 30))


def dtype_name(dtype: str | None, device: str) -> str:
    """`target.dtype` as the engines spell it (`auto` resolved as for the hf backend)."""
    return str(torch_dtype(dtype, pick_device(device))).removeprefix("torch.")


@dataclass(frozen=True)
class Rank:
    """The slice of the prompt set this process answers: every `count`-th batch from `index`."""

    index: int
    count: int
    local: int | None  # its place on its node when a launcher started several (its GPUs); else None
    source: str  # where index and count came from, for the log and the report


def parse_shard(shard: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(shard))
    if not match or not int(match[1]) < int(match[2]):
        raise ConfigError(f"generate.shard={shard!r} is not i/n with 0 <= i < n. Fix: start n jobs with "
                          f"generate.shard=0/n ... (n-1)/n (an array job: generate.shard=$SLURM_ARRAY_TASK_ID/n).")
    return int(match[1]), int(match[2])


def launcher_rank(environ) -> tuple[int, int, int, str] | None:
    """(rank, world size, local rank, launcher) of a process a launcher started: torchrun and
    accelerate launch set RANK / WORLD_SIZE / LOCAL_RANK; srun sets SLURM_PROCID / SLURM_NTASKS /
    SLURM_LOCALID, read inside a job step only (SLURM_STEP_ID): a batch script sees the
    allocation's SLURM_NTASKS too, but it is one process and must answer everything."""
    if "WORLD_SIZE" in environ:
        return int(environ.get("RANK", 0)), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)), "launcher"
    if "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ:
        return (int(environ.get("SLURM_PROCID", 0)), int(environ["SLURM_NTASKS"]),
                int(environ.get("SLURM_LOCALID", 0)), "srun")
    return None


def data_rank(shard: str | None, environ) -> Rank:
    """This process's slice: job i of n (`generate.shard`) times launcher rank r of w -> i*w + r of n*w."""
    i, n = parse_shard(shard) if shard is not None else (0, 1)
    r, w, local, launcher = launcher_rank(environ) or (0, 1, None, "")
    if not 0 <= r < w:
        raise ConfigError(f"the launcher says rank {r} of {w}. Fix: check RANK / WORLD_SIZE (or SLURM_PROCID / "
                          f"SLURM_NTASKS) in this job's environment.")
    source = " x ".join(part for part in (f"shard {i}/{n}" if shard is not None else "",
                                          f"{launcher} rank {r}/{w}" if w > 1 else "") if part) or "one process"
    return Rank(i * w + r, n * w, local if w > 1 else None, source)


def visible_gpus(environ) -> list[str] | None:
    """The GPUs this process may use, without touching CUDA (which reads CUDA_VISIBLE_DEVICES once,
    at its start): the variable's list, else one per GPU the driver lists; None if unknown."""
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    gpus = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(gpus.iterdir())))] if gpus.is_dir() else None


def rank_gpus(local: int, width: int, visible: list[str] | None) -> list[str]:
    """The GPUs of the `local`-th rank on a node when each rank drives `width` of them: GPUs
    local*width ... (local+1)*width - 1 of the visible ones. A scheduler that already gave each task
    its own GPUs (`srun --gpus-per-task`) left exactly `width` visible: those are the rank's."""
    if visible is not None and len(visible) == width:
        return visible
    if visible is not None and (local + 1) * width > len(visible):
        raise ConfigError(f"rank {local} on this node needs GPUs {local * width}..{(local + 1) * width - 1} "
                          f"({width} per engine) but {len(visible)} are visible. Fix: start at most "
                          f"{len(visible) // width} ranks per node, or lower the engine's tensor parallel size.")
    pool = visible if visible is not None else [str(g) for g in range((local + 1) * width)]
    return pool[local * width : (local + 1) * width]


# What torchrun / accelerate launch tell a process about its job: an engine that saw them would take
# itself for one rank of a torch.distributed world (vLLM's torchrun mode) and wait for the others.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def isolate_rank(rank: Rank, width: int, environ) -> None:
    """Make a launched rank a standalone job on its own GPUs, before anything starts CUDA: the engine
    (and its workers) see only those GPUs, so N ranks on a node run N engines side by side instead of
    N engines on GPU 0, and none of the launcher's world (the ranks share only the folder)."""
    if rank.local is not None:
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(rank_gpus(rank.local, width, visible_gpus(environ)))
        for name in LAUNCHER_VARS:
            environ.pop(name, None)


def run_generate(cfg: DictConfig, check_only: bool = False) -> Path | None:
    """Answer every prompt of this rank's slice not yet answered in the output folder; returns the
    folder. One run at a time per shard: a second writer would answer its prompts again.
    `check_only`: bind the settings, check the shard, the backend and the thinking switch, and
    return None (d3d.pipeline checks every stage first)."""
    typed = bind_config(cfg, "generate")  # the typed boundary: unknown keys fail here
    gen = typed.generate
    rank = data_rank(gen.shard, os.environ)
    check_backend(gen.backend)  # before the prompts and the model load
    if check_only:
        if gen.enable_thinking:
            cache_dir = resolve_path(typed.paths.cache_dir)
            require_thinking_switch(load_tokenizer(resolve_model_path(typed.target, cache_dir)), "generate.enable_thinking")
        return None
    isolate_rank(rank, engine_gpus(gen.backend, dict(getattr(gen, gen.backend, None) or {})), os.environ)
    prepare_start(gen.backend, os.environ)  # before anything below could probe CUDA
    with job_folder(resolve_path(gen.out_dir), "generate", "generate.out_dir", rank.index):
        return _generate(typed, rank)


def _generate(cfg: GenerateConfig, rank: Rank) -> Path:
    gen = cfg.generate
    torch.manual_seed(cfg.seed)
    cache_dir = resolve_path(cfg.paths.cache_dir)
    out_dir = resolve_path(gen.out_dir)

    prompts = load_prompt_set(cfg.data, cache_dir, shipped_benchmark)
    if gen.limit:
        prompts = prompts[: gen.limit]
    settings = {k: getattr(gen, k) for k in SETTING_KEYS}
    model_path = resolve_model_path(cfg.target, cache_dir)
    device = str(cfg.target.device)  # a launched rank's GPUs are pinned: `auto` is its first one
    header = {"target": {"name": cfg.target.name, "path": model_path if not Path(model_path).is_dir()
                         else cfg.target.name, "weights": model_fingerprint(model_path),
                         "dtype": dtype_name(cfg.target.dtype, device)}, "settings": settings}
    done = {row["id"] for row in read_responses(out_dir)}
    check_output_folder(out_dir, header, holds_rows=bool(done))
    tokenizer = load_tokenizer(model_path)
    if gen.enable_thinking:  # a template without the switch would silently ignore it
        require_thinking_switch(tokenizer, "generate.enable_thinking")
    ids = {p.id: chat_prompt_ids(tokenizer, p.messages, gen.enable_thinking, gen.system_prompt) for p in prompts}
    check_context({p.id: ids[p.id] for p in prompts if p.id not in done}, gen.max_new_tokens,
                  max_context(model_path))
    # Batches are cut from the whole prompt set, done or not, and rank r of n takes batches r, r+n, ...:
    # a batch's members and (hf, sampling) its random stream are the same whatever n and however
    # often the run was resumed, so the rows are too (an engine seeds each prompt from its id).
    order = sorted(prompts, key=lambda p: len(ids[p.id]), reverse=True) if gen.sort_by_length else prompts
    bs = gen.batch_size
    batches = [(k, [(p, ids[p.id]) for p in order[b : b + bs]]) for k, b in enumerate(range(0, len(order), bs))]
    mine = [(k, batch) for k, batch in batches[rank.index :: rank.count] if any(p.id not in done for p, _ in batch)]
    todo = sum(p.id not in done for _, batch in mine for p, _ in batch)
    log.info("%d prompts, %d already answered, %d for rank %d of %d (%s)", len(prompts), len(done), todo,
             rank.index, rank.count, rank.source)
    new = {"rows": 0, "tokens": 0, "cut": 0, "looping": 0}
    if not mine:  # a rank with nothing left to answer starts no engine (minutes on a GPU node)
        return _report(out_dir, rank, gen, new, 0.0)
    backend = open_backend(
        gen.backend, model_path, gen, tokenizer, stop_ids(tokenizer, model_path),
        dtype_name(cfg.target.dtype, device), cfg.seed,
        lambda: load_model(model_path, cfg.target.dtype, device, cfg.target.attn_implementation))
    # every rank writes it (the same header): a shard job may run before shard 0 does
    engine = {"backend": gen.backend, "version": engine_version(gen.backend),
              "options": dict(getattr(gen, gen.backend, None) or {})}
    write_json(out_dir / "meta.json", {**header, "prompt_set": asdict(cfg.data), "engine": engine,
                                       "run": run_info(pick_device(device))})
    start = time.perf_counter()
    bar = tqdm(total=todo, desc=f"generate[{rank.index}]", unit="prompt",
               disable=not gen.progress or rank.local not in (None, 0))
    with JsonlWriter(rank_file(out_dir, rank.index)) as writer:
        for finished in backend.run(mine, done, cfg.seed):
            rows = [{"id": prompt.id, "messages": prompt.messages,
                     "response": tokenizer.decode(resp_ids, skip_special_tokens=True),
                     "prompt_ids": ids[prompt.id], "response_ids": resp_ids, "finish_reason": reason,
                     "target": cfg.target.name, "settings": settings} for prompt, resp_ids, reason in finished]
            writer.write(rows)  # as they finish: a kill loses only the replies still in flight
            for key, n in {"rows": len(rows), **tally(rows)}.items():
                new[key] += n
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{new['tokens'] / (time.perf_counter() - start):.1f}")
    bar.close()
    backend.close()
    return _report(out_dir, rank, gen, new, time.perf_counter() - start)


def _report(out_dir: Path, rank: Rank, gen, new: dict[str, int], seconds: float) -> Path:
    """Print this rank's line, add its part to report.json, and print the folder's line if it is the last."""
    part = {"rank": rank.index, "ranks": rank.count, "source": rank.source, "backend": gen.backend,
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "batch_size": gen.batch_size,
            **{f"new_{k}": n for k, n in new.items()}, "seconds": round(seconds, 2),
            "tokens_per_s": round(new["tokens"] / max(seconds, 1e-9), 2)}
    print(f"[d3d.generate] rank {rank.index}/{rank.count}: {new['rows']} new rows, {new['tokens']} tokens, "
          f"{part['tokens_per_s']} tok/s; {part['new_cut']} cut at max_new_tokens, {part['new_looping']} looping")
    report = publish_report(out_dir, part)
    if report is not None:  # the last rank of the run to finish says how the whole folder looks
        print(f"[d3d.generate] {out_dir}: {report['rows']} rows; {report['cut']} ({report['cut_share']:.1%}) cut "
              f"at max_new_tokens={gen.max_new_tokens}, {report['looping']} ({report['looping_share']:.1%}) in a "
              f"repetition loop; {report['tokens_per_s']} tok/s over {len(report['ranks'])} rank(s)")
    return out_dir


def tally(rows: list[dict]) -> dict[str, int]:
    """Response tokens, replies cut at max_new_tokens, and replies caught in a repetition loop."""
    return {"tokens": sum(len(r["response_ids"]) for r in rows),
            "cut": sum(r["finish_reason"] == "length" for r in rows),
            "looping": sum(is_looping(r) for r in rows)}


def shard_counts(shard: Path) -> dict:
    """Rows, response tokens, cut and looping replies of one shard (each complete line once: a row a
    legacy shard repeats counts twice here, once for readers): kept beside it (`responses.rank<r>.counts.json`) with the byte offset they cover, so a later count reads only
    the rows appended since. The report then costs O(shards), not O(rows): it used to re-read every
    shard under one lock, minutes at 100k rows. The counts also remember the bytes just before their
    offset: a shard rewritten under them (edited, truncated, replaced) is counted again whole. Any
    process may refresh any shard's counts (each write is whole, and every offset's counts are right)."""
    import hashlib
    import json

    path = shard.with_name(shard.stem + ".counts.json")
    fresh = {"bytes": 0, "mark": hashlib.sha1(b"").hexdigest(), "rows": 0, "tokens": 0, "cut": 0, "looping": 0}
    try:
        counts = json.loads(path.read_text())
        if set(counts) != set(fresh):
            counts = fresh
    except (OSError, ValueError):
        counts = fresh

    def mark(f, offset: int) -> str:  # a hash of the 256 bytes before `offset`
        f.seek(max(0, offset - 256))
        return hashlib.sha1(f.read(offset - max(0, offset - 256))).hexdigest()

    with open(shard, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if counts["bytes"] > size or mark(f, counts["bytes"]) != counts["mark"]:
            counts = dict(fresh)
        if counts["bytes"] == size:
            return counts
        counts = dict(counts)
        f.seek(counts["bytes"])
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # a row still being written (or torn by a kill): counted once it is whole
            counts["bytes"] += len(raw)
            if raw.strip():
                for key, n in {"rows": 1, **tally([json.loads(raw)])}.items():
                    counts[key] += n
        counts["mark"] = mark(f, counts["bytes"])
    write_json(path, counts)
    return counts


def publish_report(out_dir: Path, part: dict) -> dict | None:
    """Put this rank's part into `<out_dir>/report.json` and sum the folder's counts over every
    shard (`shard_counts`): rows cut at the limit, caught in a loop, tokens per second per rank and
    summed. Parts of an earlier run with another rank count are dropped; a rank that had nothing
    left to answer keeps its part from the run that answered (a no-op rerun used to write 0 tok/s
    over it). A row in two shards (two overlapping runs) counts twice here; readers take it once.
    Returns the report once every rank of this run has reported, else None."""
    import json

    with FileLock(out_dir / ".report.lock", "d3d.generate's report"):
        path = out_dir / "report.json"
        old = json.loads(path.read_text()).get("ranks", {}) if path.is_file() else {}
        ranks = {k: v for k, v in old.items() if v.get("ranks") == part["ranks"]}
        if part["new_rows"] or str(part["rank"]) not in ranks:
            ranks[str(part["rank"])] = part
        shards = [shard_counts(shard) for shard in sorted(out_dir.glob("responses.rank*.jsonl"))]
        counts = {key: sum(c[key] for c in shards) for key in ("rows", "tokens", "cut", "looping")}
        share = lambda n: n / max(counts["rows"], 1)  # noqa: E731
        report = {**counts, "cut_share": share(counts["cut"]), "looping_share": share(counts["looping"]),
                  "loop_detector": {"max_period": MAX_PERIOD, "min_repeats": MIN_REPEATS, "min_span": MIN_SPAN},
                  "tokens_per_s": round(sum(p["tokens_per_s"] for p in ranks.values()), 2),
                  "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))}
        write_json(path, report)
    return report if len(ranks) == part["ranks"] else None


@hydra_job("generate")
def main(cfg: DictConfig) -> None:
    run_generate(cfg)


if __name__ == "__main__":
    main()
