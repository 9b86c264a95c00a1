"""`python -m d3d.train`: train the block-diffusion drafter on the target's responses (docs/design.md, Training).

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
import shutil
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from d3d.config import hydra_job, refuse_mixed_run, to_plain
from d3d.examples import StepBatches, StepLoader, held_out
from d3d.estimator import estimate_acceptance
from d3d.models.drafter import build_drafter, check_draft_vocab_spec, coverage, save_drafter
from d3d.models.drafter_settings import DrafterSettings, draft_map
from d3d.objective import ObjectiveConfig
from d3d.training import (
    D3DTrainingStep, GROWING_TRAIN_KEYS, autocast, compute_dtype, cut_responses, drafter_state_dict,
    enable_activation_checkpointing, freeze_embeddings_except_mask, freeze_lower_layers, fuses_adamw,
    make_accelerator, make_optimizer, make_scheduler, my_share, optimizer_step, plain_drafter,
    sum_over_processes, train_resume_key, with_global_batch, world_size,
)
from d3d.utils.checkpoints import check_record_reaches, mark_complete, promote, publish, trim_rows
from d3d.utils.checkpoints import recover as recover_checkpoint
from d3d.utils.io import JsonlWriter, job_folder, read_jsonl, resolve_path, unique, write_json
from d3d.settings import bind_config
from d3d.specs import TrainConfig
from d3d.utils.runinfo import run_info

log = logging.getLogger("d3d.train")


# ---------------------------------------------------------------------------- the loop


def evaluate(accelerator, step_module, val: list, settings: DrafterSettings) -> dict:
    """Held-out exact greedy τ of the drafter being trained, in the training's precision (bf16 where
    the drafter will decode in bf16: the τ it reports is the deployed drafter's, and the estimate is
    faster). Every process takes part: it estimates its share of the responses on the plain drafter
    (`plain_drafter`: gathered under FSDP2 / ZeRO-3) and the counts are summed, so the τ is the one
    a single process computes on all of them. The step module is left in train mode."""
    B = settings.block_size
    model = plain_drafter(accelerator, step_module, inference=compute_dtype(accelerator.mixed_precision))
    model.eval()  # the estimator fills a KV cache, which gradient checkpointing turns off in train mode
    with autocast(accelerator.mixed_precision, accelerator.device):
        stats = estimate_acceptance(model, my_share(val, accelerator), B, settings.mask_token_id, settings.vocab_size)
    counts = sum_over_processes(accelerator, [sum(stats.taus), len(stats.taus), stats.anchors, *stats.slot_hits,
                                              *stats.histogram(B)])
    tokens, rounds, anchors, hits, histogram = counts[0], counts[1], counts[2], counts[3 : 2 + B], counts[2 + B :]
    step_module.train()
    return {"val_tau": tokens / max(rounds, 1), "val_slot_accuracy": [round(h / max(anchors, 1), 4) for h in hits],
            "val_tau_histogram": [int(n) for n in histogram]}


def responses(examples):
    """The response tokens of each example (what a draft vocabulary is chosen from and covers)."""
    return (ex.ids[ex.prompt_len :] for ex in examples)


def draft_vocab_record(drafter, train_set, val) -> dict | None:
    """A draft vocabulary's size and the share of response tokens it covers, on the training split it was
    chosen from and on the held-out one (logged, and kept in summary.json); None for a full head."""
    d2t = draft_map(drafter)
    if d2t is None:
        return None
    record = {"size": len(d2t), "coverage_train": round(coverage(responses(train_set), d2t), 5),
              "coverage_val": round(coverage(responses(val), d2t), 5)}
    log.info("draft vocabulary of %d tokens: covers %.2f%% of the training responses' tokens, %.2f%% of the "
             "held-out ones'", record["size"], 100 * record["coverage_train"], 100 * record["coverage_val"])
    return record


def check_same_run(resume_dir: Path, state: dict, key: dict) -> None:
    old = state.get("resume_key")  # None: a checkpoint from before keys, no check
    refuse_mixed_run(resume_dir, old, key, "was trained",
                     "resume with the settings and responses it was trained on, pass a new train.out_dir, or "
                     "train.resume=false to start over there.", grows=GROWING_TRAIN_KEYS)


def save_checkpoint(accelerator, model, tokenizer, out_dir: Path, state: dict) -> None:
    """out_dir/last: accelerate state (model, optimizer, scheduler, RNG) + trainer state, atomically."""
    tmp = out_dir / "last.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    weights = drafter_state_dict(accelerator, model)  # every process takes part: it gathers sharded weights
    if accelerator.is_main_process:
        write_json(tmp / "trainer_state.json", state)
        save_drafter(accelerator.unwrap_model(model).drafter, tokenizer, tmp / "drafter", weights)
        mark_complete(tmp, state["step"])
        promote(out_dir)  # a kill anywhere in here leaves one whole checkpoint (d3d.utils.checkpoints)
    accelerator.wait_for_everyone()


class TrainRecipe:
    """`setup` builds everything from the config (data, drafter, the prepared training step,
    optimizer, scheduler, resumed state); `train` runs the loop and writes final/ and summary.json.
    After `train`, `self.step_module` is the prepared step (the multi-process test reads its weights)."""

    def __init__(self, raw: DictConfig, cfg: TrainConfig | None = None):
        """`raw`: the composed config (written to config.yaml and summary.json as the record of the
        run); `cfg`: its typed form, bound here unless run_train already did."""
        from accelerate.utils import set_seed

        self.raw = raw
        self.cfg = cfg = cfg or bind_config(raw, "train")  # the typed boundary: unknown keys fail
        cfg.train = with_global_batch(cfg.train, world_size())  # grad_accum from train.global_batch_size
        tc = self.tc = cfg.train
        self.accelerator = accelerator = make_accelerator(tc, timeout_s=cfg.dist.timeout_s)
        set_seed(cfg.seed)
        self.out_dir = out_dir = resolve_path(tc.out_dir)
        resume_dir = out_dir / "last"
        if tc.resume and accelerator.is_main_process:
            recover_checkpoint(out_dir)  # finish a save a kill interrupted (else step 0 and no metrics)
        accelerator.wait_for_everyone()
        resuming = tc.resume and (resume_dir / "trainer_state.json").is_file()
        self.key = train_resume_key(cfg)
        self.state = {"step": 0, "elapsed_s": 0.0}
        if resuming:  # other settings are refused before the data and the drafter load (minutes on the CPU default)
            self.state = json.loads((resume_dir / "trainer_state.json").read_text())
            check_same_run(resume_dir, self.state, self.key)

        check_draft_vocab_spec(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir), responses=True)
        with accelerator.main_process_first():  # one process builds the Arrow cache; the others map it
            examples, self.train_set, val = held_out(tc, cfg.seed)
        self.key = train_resume_key(cfg, examples.fingerprint())
        if resuming:  # and on the same responses, before the drafter loads
            check_same_run(resume_dir, self.state, self.key)
        self.val = cut_responses(val, tc.val_max_new_tokens)
        drafter, self.tokenizer = build_drafter(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir),
                                                device="cpu", dtype="float32", responses=responses(self.train_set))
        self.settings = settings = DrafterSettings.of(drafter)
        self.draft_vocab = draft_vocab_record(drafter, self.train_set, self.val)
        if tc.freeze_embeddings:
            freeze_embeddings_except_mask(drafter, settings.mask_token_id)
        if tc.trainable_from_layer:
            freeze_lower_layers(drafter, tc.trainable_from_layer)
        if tc.gradient_checkpointing:
            enable_activation_checkpointing(drafter)
        self.objective = ObjectiveConfig.from_cfg(tc, settings.block_size)
        step_module = D3DTrainingStep(drafter, settings.vocab_size, self.objective.ar_weight,
                                      tc.loss_chunk_rows)
        optimizer = make_optimizer(step_module, tc.lr, tc.weight_decay, tc.betas, fused=fuses_adamw(accelerator))
        scheduler = make_scheduler(optimizer, tc.warmup_steps, tc.max_steps)
        self.step_module, self.optimizer, self.scheduler = accelerator.prepare(step_module, optimizer, scheduler)

        if resuming:
            accelerator.load_state(str(resume_dir))
            if accelerator.is_main_process:  # rows of steps after the checkpoint are redone, not doubled
                kept = trim_rows(out_dir / "metrics.jsonl", lambda r: r["step"] <= int(self.state["step"]))
                check_record_reaches(resume_dir, self.state.get("logged_step"), max((r["step"] for r in kept), default=None),
                                     out_dir / "metrics.jsonl", "restore that file, or train.resume=false to start over.")
            log.info("resumed from %s at step %d", resume_dir, self.state["step"])
        elif accelerator.is_main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)
            # an earlier run's checkpoint goes with its rows: else a kill before this run's first save
            # and a resume would continue the old run on top of this run's rows
            for stale in ("last", "last.partial", "last.old"):
                shutil.rmtree(out_dir / stale, ignore_errors=True)
        if accelerator.is_main_process:
            (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(raw, resolve=True))

    def drafter(self):
        return self.accelerator.unwrap_model(self.step_module).drafter

    def micro_batches(self, step: int) -> list:
        """This process's micro-batches of one optimizer step, packed ahead by train.num_workers
        DataLoader workers (d3d.examples.StepLoader; restarted where the loop asks for another
        step than the next). Each slice of the step's global batch draws its anchors from a
        generator seeded by (seed, step, slice), so a resumed run draws what the uninterrupted one
        did, and N processes x 1 micro-batch train on exactly the batches that 1 process x N
        micro-batches does (contract 9, docs/design.md#contract-9)."""
        loader = getattr(self, "_loader", None)
        if loader is None or loader.next_step != step:
            tc, accelerator = self.tc, self.accelerator
            batches = StepBatches(self.train_set, self.objective, self.settings.mask_token_id, self.tokenizer.pad_token_id,
                                  self.cfg.seed, tc.batch_size, tc.grad_accum, tc.length_grouping, tc.max_steps,
                                  accelerator.process_index, accelerator.num_processes)
            loader = self._loader = StepLoader(batches, step, tc.num_workers)
        return next(loader)

    def train(self) -> Path:
        cfg, tc, accelerator, out_dir = self.cfg, self.tc, self.accelerator, self.out_dir
        model, optimizer, scheduler, settings, val = self.step_module, self.optimizer, self.scheduler, self.settings, self.val
        metrics = JsonlWriter(out_dir / "metrics.jsonl") if accelerator.is_main_process else None
        wandb_run = start_wandb(cfg, self.raw, accelerator)
        max_steps, step = tc.max_steps, int(self.state["step"])
        budget_s = tc.max_minutes * 60 if tc.max_minutes else None
        bar = tqdm(total=max_steps, initial=step, desc="train", disable=not tc.progress or not accelerator.is_main_process)

        logged = {"step": self.state.get("logged_step")}  # the last step in metrics.jsonl, kept in each checkpoint

        def log_row(row: dict) -> None:
            logged["step"] = row["step"]
            if metrics is not None:
                metrics.write([row])
            if wandb_run is not None:
                wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

        if step == 0 and tc.eval_every:
            log_row({"step": 0, **evaluate(accelerator, model, val, settings)})
        start = time.perf_counter() - float(self.state["elapsed_s"])
        model.train()
        # A resumed run whose time budget is already spent is finished: rerunning it trains no more.
        spent = budget_s is not None and float(self.state["elapsed_s"]) > budget_s
        while step < max_steps and not spent:
            t0 = time.perf_counter()
            batches = list(self.micro_batches(step))
            m = optimizer_step(model, optimizer, batches, tc.clip, accelerator)
            scheduler.step()  # once per optimizer step, whatever grad_accum and the number of processes
            step += 1
            bar.update(1)
            tokens = sum(b.n_tokens for b in batches)
            # elapsed_s: training wall time so far (resumes included, evaluations before this step too):
            # the x axis of "held-out τ per CPU-minute" (scripts/sweep.py recipe)
            now = time.perf_counter()
            row = {"step": step, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens / (now - t0),
                   "elapsed_s": round(now - start, 2), **{k: round(v, 6) for k, v in m.items()}}
            # under a wall-time budget the step total may be a cap never reached: show the minutes too
            bar.set_postfix(loss=f"{m['loss']:.3f}",
                            **({"min": f"{(now - start) / 60:.1f}/{tc.max_minutes:g}"} if budget_s else {}))
            out_of_time = budget_s is not None and now - start > budget_s
            if tc.eval_every and (step % tc.eval_every == 0 or step == max_steps or out_of_time):
                row.update(evaluate(accelerator, model, val, settings))
            if step % tc.log_every == 0 or "val_tau" in row or step == max_steps:
                log_row(row)
            self.state = {"step": step, "elapsed_s": time.perf_counter() - start, "resume_key": self.key,
                          "logged_step": logged["step"]}
            if step % tc.save_every == 0 or step == max_steps or out_of_time:
                save_checkpoint(accelerator, model, self.tokenizer, out_dir, self.state)
            if out_of_time or (tc.stop_at_step and step >= tc.stop_at_step):
                break
        bar.close()

        weights = drafter_state_dict(accelerator, model)
        if accelerator.is_main_process:
            # written aside and renamed whole: a kill never leaves final/ half-written (d3d.utils.checkpoints)
            final = publish(out_dir, "final", step, lambda tmp: save_drafter(self.drafter(), self.tokenizer, tmp, weights,
                                                                             dtype=tc.save_dtype))
            history = unique(read_jsonl(out_dir / "metrics.jsonl", ("step",)), lambda r: r["step"])
            evals = [r for r in history if "val_tau" in r]
            write_json(out_dir / "summary.json", {
                "steps": step, "max_steps": max_steps, "elapsed_s": round(time.perf_counter() - start, 1),
                "val_tau_first": evals[0]["val_tau"] if evals else None,
                "val_tau_last": evals[-1]["val_tau"] if evals else None,
                "train_examples": len(self.train_set), "val_examples": len(val), "drafter": str(final),
                "draft_vocab": self.draft_vocab,
                "run": run_info(accelerator.device), "config": to_plain(self.raw),
            })
            print(f"[d3d.train] {out_dir}: {step} steps; held-out τ "
                  f"{evals[0]['val_tau'] if evals else float('nan'):.3f} -> {evals[-1]['val_tau'] if evals else float('nan'):.3f}")
        if metrics is not None:
            metrics.close()
        if wandb_run is not None:
            wandb_run.finish()
        return out_dir


def run_train(cfg: DictConfig) -> Path:
    """Train into train.out_dir, one run at a time per folder (two would interleave metrics and
    checkpoints). Each process of `accelerate launch` holds its rank's lock."""
    import os

    typed = bind_config(cfg, "train")
    with job_folder(resolve_path(typed.train.out_dir), "train", "train.out_dir", int(os.environ.get("RANK", 0))):
        return TrainRecipe(cfg, typed).train()


def start_wandb(cfg: TrainConfig, raw: DictConfig, accelerator):
    """wandb when asked for: online with an API key, offline without one; never required."""
    if not cfg.logger.wandb or not accelerator.is_main_process:
        return None
    import os

    import wandb

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=cfg.logger.project, name=cfg.run_name, config=to_plain(raw), mode=mode,
                      dir=str(resolve_path(cfg.train.out_dir)))


@hydra_job("train")
def main(cfg: DictConfig) -> None:
    run_train(cfg)


if __name__ == "__main__":
    main()
