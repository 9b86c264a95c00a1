"""`python -m d3d.generate`: the target answers a prompt set; its responses train the drafter.

Rows go to `<out_dir>/responses.rank<r>.jsonl`, flushed batch by batch. A re-run skips every id
already written by any rank, so a killed run resumes without losing or duplicating a row. Several
processes (`accelerate launch -m d3d.generate`) split the remaining prompts round-robin.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from d3d.config import ConfigError, differing_keys, hydra_job, resolve_path
from d3d.data.chat import chat_prompt_ids, require_thinking_switch, stop_ids
from d3d.data.prompts import load_prompt_set
from d3d.data.responses import rank_file, read_responses
from d3d.models.engines import check_backend, engine_version, open_backend
from d3d.settings import bind_config, shipped_benchmark
from d3d.specs import GenerateConfig
from d3d.models.target import (load_model, load_tokenizer, model_fingerprint, pick_device, process_device,
                               process_state, resolve_model_path, torch_dtype)
from d3d.utils.io import JsonlWriter, lock_folder, write_json
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


def run_generate(cfg: DictConfig, check_only: bool = False) -> Path | None:
    """Answer every prompt not yet answered in the output folder; returns the folder. One run at a
    time per folder: a second writer would answer every prompt again. `check_only`: bind the settings,
    check the backend and the thinking switch, and return None (d3d.pipeline checks every stage first)."""
    typed = bind_config(cfg, "generate")  # the typed boundary: unknown keys fail here
    if check_only:
        check_backend(typed.generate.backend)
        if typed.generate.enable_thinking:
            cache_dir = resolve_path(typed.paths.cache_dir)
            require_thinking_switch(load_tokenizer(resolve_model_path(typed.target, cache_dir)), "generate.enable_thinking")
        return None
    with lock_folder(resolve_path(typed.generate.out_dir), "d3d.generate", process_state().process_index):
        return _generate(typed)


def _generate(cfg: GenerateConfig) -> Path:
    gen = cfg.generate
    state = process_state()
    check_backend(gen.backend, state.num_processes)  # before the prompts and the model load
    torch.manual_seed(cfg.seed + state.process_index)
    cache_dir = resolve_path(cfg.paths.cache_dir)
    out_dir = resolve_path(gen.out_dir)

    prompts = load_prompt_set(cfg.data, cache_dir, shipped_benchmark)
    if gen.limit:
        prompts = prompts[: gen.limit]
    settings = {k: getattr(gen, k) for k in SETTING_KEYS}
    model_path = resolve_model_path(cfg.target, cache_dir)
    device = process_device(state, cfg.target.device)  # `dtype: auto` resolves per device and CPU
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
    backend = open_backend(
        gen.backend, model_path, gen, tokenizer, stop_ids(tokenizer, model_path),
        dtype_name(cfg.target.dtype, device), cfg.seed,
        lambda: load_model(model_path, cfg.target.dtype, device, cfg.target.attn_implementation))
    if state.is_main_process:
        engine = {"backend": gen.backend, "version": engine_version(gen.backend),
                  "options": dict(getattr(gen, gen.backend, None) or {})}
        write_json(out_dir / "meta.json", {**header, "prompt_set": asdict(cfg.data), "engine": engine,
                                           "run": run_info(pick_device(device))})

    # Batches are cut from the whole prompt set, done or not, and process r takes batches r, r+n, ...:
    # a batch's members and (when sampling) its random stream are the same in a resumed run as in an
    # uninterrupted one, so the rows are too. Finished batches are skipped.
    order = sorted(prompts, key=lambda p: len(ids[p.id]), reverse=True) if gen.sort_by_length else prompts
    bs = gen.batch_size
    batches = [(k, order[b : b + bs]) for k, b in enumerate(range(0, len(order), bs))]
    mine = [(k, batch) for k, batch in batches[state.process_index :: state.num_processes]
            if any(p.id not in done for p in batch)]
    todo = sum(sum(p.id not in done for p in batch) for _, batch in mine)
    log.info("%d prompts, %d already answered, %d for this process", len(prompts), len(done), todo)
    total_tokens, start = 0, time.perf_counter()
    bar = tqdm(total=todo, desc=f"generate[{state.process_index}]", unit="prompt",
               disable=not gen.progress or not state.is_local_main_process)
    with JsonlWriter(rank_file(out_dir, state.process_index)) as writer:
        for k, members in mine:
            batch = [(p, ids[p.id]) for p in members]
            # sampling seed: one stream per batch (hf) / per prompt from it (engines), whatever ran before
            results = backend.generate(batch, cfg.seed * 1_000_003 + k)
            rows = []
            for (prompt, prompt_ids), (resp_ids, reason) in zip(batch, results):
                if prompt.id in done:  # a batch a kill cut short: its written rows stay as they are
                    continue
                rows.append({
                    "id": prompt.id, "messages": prompt.messages,
                    "response": tokenizer.decode(resp_ids, skip_special_tokens=True),
                    "prompt_ids": prompt_ids, "response_ids": resp_ids, "finish_reason": reason,
                    "target": cfg.target.name, "settings": settings,
                })
                total_tokens += len(resp_ids)
            writer.write(rows)
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{total_tokens / (time.perf_counter() - start):.1f}")
    bar.close()
    backend.close()
    elapsed = time.perf_counter() - start
    state.wait_for_everyone()
    rows = read_responses(out_dir)
    if state.is_main_process:
        stats = {"rows": len(rows), "new_rows": todo, "new_tokens": total_tokens,
                 "seconds": round(elapsed, 2), "tokens_per_s": round(total_tokens / max(elapsed, 1e-9), 2),
                 "batch_size": bs, "processes": state.num_processes, "backend": gen.backend}
        write_json(out_dir / "last_run.json", stats)
        print(f"[d3d.generate] {out_dir}: {len(rows)} rows ({todo} new, {total_tokens} tokens, "
              f"{stats['tokens_per_s']} tok/s)")
    return out_dir


@hydra_job("generate")
def main(cfg: DictConfig) -> None:
    run_generate(cfg)


if __name__ == "__main__":
    main()
