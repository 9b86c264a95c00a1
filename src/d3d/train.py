"""`python -m d3d.train`: train the block-diffusion drafter on the target's responses (DESIGN §4).

Loop: packed D3D batches (d3d.objective) -> AdamW with warm-up + cosine decay, clipping, gradient
accumulation -> every `eval_every` steps the exact greedy τ on held-out responses (d3d.estimator)
-> every `save_every` steps a checkpoint that resumes exactly (weights, optimizer, scheduler, RNG,
data position). Runs under accelerate: one process on CPU, or `accelerate launch --config_file
conf/accelerate/<ddp|fsdp|deepspeed_zero2|deepspeed_zero3>.yaml -m d3d.train ...` on GPUs.
Outputs in train.out_dir: last/ (resumable state), final/ (the drafter, save_pretrained),
metrics.jsonl (one row per logged step or evaluation), config.yaml, summary.json.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from d3d.config import ConfigError, differing_keys, hydra_job, resolve_path, to_plain
from d3d.estimator import estimate_acceptance
from d3d.generate import read_responses
from d3d.models.drafter import DrafterSettings, build_drafter, save_drafter
from d3d.objective import Example, ObjectiveConfig, d3d_loss, pack
from d3d.utils.checkpoints import mark_complete, promote, trim_rows
from d3d.utils.checkpoints import recover as recover_checkpoint
from d3d.utils.io import JsonlWriter, lock_folder, read_jsonl, unique, write_json
from d3d.utils.runinfo import run_info

log = logging.getLogger("d3d.train")


# ---------------------------------------------------------------------------- data


def load_examples(responses_dir: Path, max_len: int) -> list[Example]:
    """(prompt + response) token ids of every response row, cut to max_len, sorted by id."""
    rows = read_responses(responses_dir)
    if not rows:
        raise ConfigError(
            f"no target responses in {responses_dir}. Fix: run `python -m d3d.generate` with the same "
            "target and data first (or set train.responses_dir)."
        )
    out = []
    for row in sorted(rows, key=lambda r: r["id"]):
        ids = (row["prompt_ids"] + row["response_ids"])[:max_len]
        if len(ids) > len(row["prompt_ids"]):
            out.append(Example(ids, len(row["prompt_ids"])))
    return out


def split_examples(examples: list[Example], val_size: int, seed: int) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    val = [examples[i] for i in sorted(order[:val_size])]
    train = [examples[i] for i in sorted(order[val_size:])]
    if not train:
        raise ConfigError(f"only {len(examples)} responses: none left for training after val_size={val_size}")
    return train, val


def batch_at(train: list[Example], step: int, micro: int, per_step: int, batch_size: int, seed: int,
             rank: int = 0, ranks: int = 1) -> list[Example]:
    """The micro-batch of a given step on one process: data order is a pure function of (seed,
    position), so a resumed run reads exactly what the uninterrupted run would have read. A step
    reads per_step = batch_size * grad_accum * ranks examples; each (micro, rank) its own slice."""
    start = step * per_step + (micro * ranks + rank) * batch_size
    orders: dict[int, list[int]] = {}  # one seeded shuffle per epoch the batch touches
    out = []
    for i in range(start, start + batch_size):
        epoch, idx = divmod(i, len(train))
        if epoch not in orders:
            orders[epoch] = list(range(len(train)))
            random.Random(seed * 7919 + epoch).shuffle(orders[epoch])
        out.append(train[orders[epoch][idx]])
    return out


def cut_responses(examples: list[Example], max_new_tokens: int | None) -> list[Example]:
    """Keep the first `max_new_tokens` response tokens of each example (all when None): τ on a
    prefix of each held-out response keeps validation and pruning's calibration cheap."""
    if not max_new_tokens:
        return examples
    return [Example(e.ids[: e.prompt_len + int(max_new_tokens)], e.prompt_len) for e in examples]


# ---------------------------------------------------------------------------- model and optimizer


def freeze_embeddings_except_mask(model, mask_id: int) -> None:
    """Tied input/output embeddings stay the target's; only the mask token's row learns."""
    emb = model.get_input_embeddings().weight
    keep = torch.zeros(emb.shape[0], 1, dtype=emb.dtype, device=emb.device)
    keep[mask_id] = 1
    emb.register_hook(lambda grad: grad * keep.to(grad.dtype))
    out = model.get_output_embeddings()
    if out is not None and out.weight is not emb:
        out.weight.requires_grad_(False)


def freeze_lower_layers(model, first_trainable: int) -> None:
    """Train only layers >= first_trainable (and the final norm): a cheaper backward on CPU."""
    for i, layer in enumerate(model.base_model.layers):
        if i < first_trainable:
            layer.requires_grad_(False)


def make_optimizer(model, cfg: DictConfig):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(cfg.weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(cfg.lr), betas=tuple(cfg.betas))


def make_scheduler(optimizer, cfg: DictConfig):
    warmup, total = int(cfg.warmup_steps), int(cfg.max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def mixed_precision(setting: str) -> str:
    """auto = bf16 on CUDA, none on CPU: on our AVX2 CPUs bf16 matmuls of many rows run 2-7x
    slower than fp32 (scripts/bench_generate.py), so CPU training stays fp32."""
    if setting == "auto":
        return "bf16" if torch.cuda.is_available() else "no"
    return setting


# ---------------------------------------------------------------------------- the loop


def evaluate(model, val: list[Example], settings: DrafterSettings) -> dict:
    stats = estimate_acceptance(model, val, settings.block_size, settings.mask_token_id, settings.vocab_size)
    out = stats.as_dict(settings.block_size)
    return {"val_tau": out["tau"], "val_slot_accuracy": [round(a, 4) for a in out["slot_accuracy"]],
            "val_tau_histogram": out["tau_histogram"]}


# train.* keys a resumed run may change: budgets, cadence, where things go. Anything else changes the
# experiment, and a run resumed with it would be half one experiment and half another.
RESUMABLE_TRAIN_KEYS = {"max_steps", "max_minutes", "eval_every", "save_every", "log_every", "progress", "resume",
                        "stop_at_step", "out_dir", "responses_dir", "val_max_new_tokens"}


def train_resume_key(cfg: DictConfig) -> dict:
    plain = to_plain(cfg)
    target = {k: v for k, v in plain["target"].items() if k not in ("device", "dtype", "attn_implementation")}
    return {"target": target, "drafter": plain["drafter"], "data": plain["data"], "seed": plain["seed"],
            "train": {k: v for k, v in plain["train"].items() if k not in RESUMABLE_TRAIN_KEYS}}


def check_same_run(resume_dir: Path, state: dict, key: dict) -> None:
    differ = differing_keys(state.get("resume_key") or {}, key)  # checkpoints from before keys: no check
    if differ:
        raise ConfigError(f"{resume_dir} was trained with other settings ({', '.join(differ)} differ); resuming "
                          f"would mix two runs. Fix: pass a new train.out_dir, or train.resume=false to start over there.")


def save_checkpoint(accelerator, model, tokenizer, out_dir: Path, state: dict) -> None:
    """out_dir/last: accelerate state (model, optimizer, scheduler, RNG) + trainer state, atomically."""
    tmp = out_dir / "last.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    weights = accelerator.get_state_dict(model)  # every process takes part: it gathers sharded weights
    if accelerator.is_main_process:
        write_json(tmp / "trainer_state.json", state)
        save_drafter(accelerator.unwrap_model(model), tokenizer, tmp / "drafter", weights)
        mark_complete(tmp, state["step"])
        promote(out_dir)  # a kill anywhere in here leaves one whole checkpoint (d3d.utils.checkpoints)
    accelerator.wait_for_everyone()


def run_train(cfg: DictConfig) -> Path:
    """Train into train.out_dir, one run at a time per folder (two would interleave metrics and
    checkpoints). Each process of `accelerate launch` holds its rank's lock."""
    import os

    with lock_folder(resolve_path(cfg.train.out_dir), "d3d.train", int(os.environ.get("RANK", 0))):
        return _train(cfg)


def _train(cfg: DictConfig) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tc = cfg.train
    # The scheduler is stepped by hand once per optimizer step: accelerate would otherwise step it
    # once per process (it assumes a sharded dataloader shortened the epoch; ours counts steps).
    accelerator = Accelerator(mixed_precision=mixed_precision(tc.mixed_precision), step_scheduler_with_optimizer=False,
                              gradient_accumulation_steps=int(tc.grad_accum), cpu=not torch.cuda.is_available())
    set_seed(int(cfg.seed))
    out_dir = resolve_path(tc.out_dir)
    cache_dir = resolve_path(cfg.paths.cache_dir)
    examples = load_examples(resolve_path(tc.responses_dir), int(tc.max_len))
    train, val = split_examples(examples, int(tc.val_size), int(cfg.seed))
    val = cut_responses(val, tc.get("val_max_new_tokens"))

    resume_dir = out_dir / "last"
    if tc.resume and accelerator.is_main_process:
        recover_checkpoint(out_dir)  # finish a save a kill interrupted (else step 0 and no metrics)
    accelerator.wait_for_everyone()
    resuming = bool(tc.resume) and (resume_dir / "trainer_state.json").is_file()
    model, tokenizer = build_drafter(cfg.drafter, cfg.target, cache_dir, device="cpu", dtype="float32")
    settings = DrafterSettings.of(model)
    if tc.freeze_embeddings:
        freeze_embeddings_except_mask(model, settings.mask_token_id)
    if tc.get("trainable_from_layer"):
        freeze_lower_layers(model, int(tc.trainable_from_layer))
    objective = ObjectiveConfig.from_cfg(tc, settings.block_size)
    optimizer = make_optimizer(model, tc)
    scheduler = make_scheduler(optimizer, tc)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    key = train_resume_key(cfg)
    state = {"step": 0, "elapsed_s": 0.0}
    if resuming:
        state = json.loads((resume_dir / "trainer_state.json").read_text())
        check_same_run(resume_dir, state, key)
        accelerator.load_state(str(resume_dir))
        if accelerator.is_main_process:  # rows of steps after the checkpoint are redone, not doubled
            trim_rows(out_dir / "metrics.jsonl", lambda r: r["step"] <= int(state["step"]))
        log.info("resumed from %s at step %d", resume_dir, state["step"])
    elif accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    if accelerator.is_main_process:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    metrics = JsonlWriter(out_dir / "metrics.jsonl") if accelerator.is_main_process else None
    wandb_run = start_wandb(cfg, accelerator)
    rank, ranks = accelerator.process_index, accelerator.num_processes
    per_step = int(tc.batch_size) * int(tc.grad_accum) * ranks  # the global batch of one optimizer step
    max_steps, step = int(tc.max_steps), int(state["step"])
    budget_s = float(tc.max_minutes) * 60 if tc.max_minutes else None
    pad_id = tokenizer.pad_token_id
    bar = tqdm(total=max_steps, initial=step, desc="train", disable=not tc.progress or not accelerator.is_main_process)

    def log_row(row: dict) -> None:
        if metrics is not None:
            metrics.write([row])
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    if step == 0 and tc.eval_every:
        log_row({"step": 0, **evaluate(accelerator.unwrap_model(model), val, settings)})
    start = time.perf_counter() - float(state["elapsed_s"])
    model.train()
    # A resumed run whose time budget is already spent is finished: rerunning it trains no more.
    spent = budget_s is not None and float(state["elapsed_s"]) > budget_s
    while step < max_steps and not spent:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + step + 7_919_000_000 * rank)
        sums: dict = {}
        tokens = 0
        for micro in range(int(tc.grad_accum)):
            batch = pack(batch_at(train, step, micro, per_step, int(tc.batch_size), int(cfg.seed), rank, ranks),
                         objective, settings.mask_token_id, pad_id, gen)
            with accelerator.accumulate(model):
                loss, m = d3d_loss(model, batch, objective.ar_weight, settings.vocab_size)
                accelerator.backward(loss)
                if accelerator.sync_gradients and tc.clip:
                    m["grad_norm"] = float(accelerator.clip_grad_norm_(model.parameters(), float(tc.clip)))
                optimizer.step()
                optimizer.zero_grad()
            tokens += batch.n_tokens
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v / int(tc.grad_accum)
        scheduler.step()  # once per optimizer step, whatever grad_accum and the number of processes
        step += 1
        bar.update(1)
        row = {"step": step, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens / (time.perf_counter() - t0),
               **{k: round(v, 6) for k, v in sums.items()}}
        bar.set_postfix(loss=f"{sums['loss']:.3f}")
        out_of_time = budget_s is not None and time.perf_counter() - start > budget_s
        if tc.eval_every and (step % int(tc.eval_every) == 0 or step == max_steps or out_of_time):
            row.update(evaluate(accelerator.unwrap_model(model), val, settings))
            model.train()
        if step % int(tc.log_every) == 0 or "val_tau" in row or step == max_steps:
            log_row(row)
        state = {"step": step, "elapsed_s": time.perf_counter() - start, "resume_key": key}
        if step % int(tc.save_every) == 0 or step == max_steps or out_of_time:
            save_checkpoint(accelerator, model, tokenizer, out_dir, state)
        if out_of_time or (tc.get("stop_at_step") and step >= int(tc.stop_at_step)):
            break
    bar.close()

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        final = save_drafter(accelerator.unwrap_model(model), tokenizer, out_dir / "final", weights)
        history = unique(read_jsonl(out_dir / "metrics.jsonl"), lambda r: r["step"])
        evals = [r for r in history if "val_tau" in r]
        write_json(out_dir / "summary.json", {
            "steps": step, "max_steps": max_steps, "elapsed_s": round(time.perf_counter() - start, 1),
            "val_tau_first": evals[0]["val_tau"] if evals else None,
            "val_tau_last": evals[-1]["val_tau"] if evals else None,
            "train_examples": len(train), "val_examples": len(val), "drafter": str(final),
            "run": run_info(accelerator.device), "config": to_plain(cfg),
        })
        print(f"[d3d.train] {out_dir}: {step} steps; held-out τ "
              f"{evals[0]['val_tau'] if evals else float('nan'):.3f} -> {evals[-1]['val_tau'] if evals else float('nan'):.3f}")
    if metrics is not None:
        metrics.close()
    if wandb_run is not None:
        wandb_run.finish()
    return out_dir


def start_wandb(cfg: DictConfig, accelerator):
    """wandb when asked for: online with an API key, offline without one; never required."""
    if not cfg.logger.wandb or not accelerator.is_main_process:
        return None
    import os

    import wandb

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=cfg.logger.project, name=cfg.run_name, config=to_plain(cfg), mode=mode,
                      dir=str(resolve_path(cfg.train.out_dir)))


@hydra_job("train")
def main(cfg: DictConfig) -> None:
    run_train(cfg)


if __name__ == "__main__":
    main()
