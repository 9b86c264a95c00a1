"""`python -m d3d.prune drafter.checkpoint=<folder>`: acceptance-guided layer pruning (docs/design.md, Pruning).

Greedy, one layer at a time: score every remaining layer by the exact greedy τ of the drafter
without it (offline estimator on calibration responses; the layer is skipped in place, not copied),
remove the layer whose absence keeps τ highest, run a short recovery training with the D3D
objective, and repeat until `prune.num_layers` are gone or τ < min_retention × τ_full. Baselines
for the same budget: `prune.method=last` (drop the last layer) and `similarity` (drop the layer
whose output is closest to its input). After every step: steps.jsonl (layers kept, τ before and
after recovery, retention, draft latency) and a normal checkpoint in step_<k>/; `final/` is the
last step that kept the retention. A killed run resumes from its last finished step, and within a
step from its last scored layer (scores.jsonl).

Why a hold-out: the τ "before recovery" of the chosen layer is the best of L noisy scores on the
calibration responses, so it is biased upward (the winner's curse), and a retention measured on the
same responses inherits part of that bias. With `prune.holdout_size=N` the next N held-out responses
(after the calibration ones, inside train.val_size, so never trained on) get their own τ before and
after recovery, and the retention — the stopping rule — is measured on them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from d3d.config import hydra_job, refuse_mixed_run
from d3d.errors import ConfigError
from d3d.utils.io import CorruptFile, JsonlWriter, job_folder, read_jsonl, resolve_path, unique, write_json
from d3d.decoding.methods import scored_drafts
from d3d.estimator import estimate_acceptance
from d3d.examples import held_out
from d3d.layer_scores import LayerScores, score_layers
from d3d.models.drafter import (
    SavedDrafter, as_deployed, build_drafter, decoder_layers, drafter_folder, keep_layers, save_drafter,
)
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.target import pick_device
from d3d.settings import bind_config
from d3d.specs import PruneConfig, PruneSettings
from d3d.training import (
    BATCH_SPLIT_KEYS, RESUMABLE_TRAIN_KEYS, cut_responses, freeze_embeddings_except_mask, freeze_lower_layers,
    make_accelerator, mixed_precision, my_share, recover, sum_over_processes, with_global_batch, world_size,
)
from d3d.utils.checkpoints import (
    MARKER, check_record_reaches, drafter_problem, mark_complete, promote, publish, saved_config, saved_step, trim_rows,
)
from d3d.utils.checkpoints import recover as recover_checkpoint
from d3d.utils.plotting import pyplot, save_figure

log = logging.getLogger("d3d.prune")


def tau_of(model, calib, s: DrafterSettings, tree_nodes: int | None, acc) -> float:
    """Exact greedy τ (the chain's, or a tree of `tree_nodes` drafts') of the drafter as it decodes on
    this device: a bf16 copy on CUDA and native-bf16 CPUs, where it is also 2-3x faster than fp32.
    Each process of `acc` (the run's Accelerator) estimates its share of the responses; the token and
    round counts are summed, so the τ is one process's on all of them."""
    stats = estimate_acceptance(as_deployed(model), my_share(calib, acc), s.block_size, s.mask_token_id, s.vocab_size,
                                drafts=scored_drafts(s.block_size, tree_nodes))
    tokens, rounds = sum_over_processes(acc, [sum(stats.taus), len(stats.taus)])
    return tokens / max(rounds, 1)


def score_by_acceptance(model, calib, s: DrafterSettings, pc: PruneSettings, record: Path | None, acc) -> list[float]:
    """τ of the drafter without each of its current layers, all in one sweep (d3d.layer_scores: the
    layers below a candidate are shared, exact unless prune.anchor_fraction < 1), on the deployed
    dtype. Each process of `acc` sweeps its share of the responses and the exact counts are summed
    (all_reduce): the scores, and so the layer chosen, are one process's. With `record`, the scores
    are appended to that jsonl keyed by the kept layers, so a run killed after scoring does not
    score again."""
    acc.wait_for_everyone()  # every process sees the record the main process wrote, or none does
    rows = read_jsonl(record, ("kept_layers",)) if record else []
    done = [r for r in rows if r["kept_layers"] == s.kept_layers and "taus" in r]
    if done:
        return done[0]["taus"][:-1]
    mine = len(my_share(calib, acc))
    bar = tqdm(total=mine, desc="scoring layers (responses)", unit="resp", disable=not pc.progress or not acc.is_main_process)
    start = time.perf_counter()
    scores = score_layers(as_deployed(model), calib, s.block_size, s.mask_token_id, s.vocab_size,
                          drafts=scored_drafts(s.block_size, pc.tree_nodes), anchor_fraction=pc.anchor_fraction, seed=len(s.kept_layers),
                          progress=lambda i: bar.update(1), share=(acc.process_index, acc.num_processes))
    bar.close()
    n = len(scores.tokens)
    counts = sum_over_processes(acc, scores.tokens + scores.rounds)
    scores = LayerScores(counts[:n], [int(r) for r in counts[n:]])
    if record and acc.is_main_process:
        with JsonlWriter(record) as writer:
            writer.write([{"kept_layers": s.kept_layers, "taus": scores.taus,
                           "seconds": round(time.perf_counter() - start, 1)}])
    return scores.taus[:-1]  # the last is the whole drafter


@torch.no_grad()
def score_by_similarity(model, calib, s: DrafterSettings) -> list[float]:
    """Mean cosine similarity between each layer's input and output on the calibration text."""
    sims = [0.0] * len(decoder_layers(model))
    for ex in calib:
        out = model(torch.tensor([ex.ids], device=next(model.parameters()).device), output_hidden_states=True)
        hs = out.hidden_states  # embeddings, then after each layer
        for i in range(len(sims)):
            sims[i] += torch.nn.functional.cosine_similarity(hs[i][0], hs[i + 1][0], dim=-1).mean().item() / len(calib)
    return sims


def _by_similarity(model, calib, s, pc, record, acc):
    return score_by_similarity(model, calib, s)  # cheap: every process computes it whole, alike


def _last_layer(model, calib, s, pc, record, acc):
    return [float(i) for i in range(len(decoder_layers(model)))]  # the highest score is the last layer


# prune.method -> a scorer (model, calib, s, pc, record, acc): one score per current layer, the highest is
# removed (acc: the run's Accelerator, for scorers that split the responses over processes). A new pruning
# criterion is one function and one line here (docs/design.md, "Changes a researcher makes").
SCORERS = {"acceptance": score_by_acceptance, "similarity": _by_similarity, "last": _last_layer}
UNRECORDED = {"last"}  # a rule, not a measurement: no scores are reported for it
TAU_SCORES = {"acceptance"}  # scores that are τ: whether a removal alone is safe can be read from them


def scorer(method: str):
    """The scorer prune.method names; checked when the run starts, before the drafter loads (a
    misspelt method used to fail at step 1, after the drafter was built and measured)."""
    if method not in SCORERS:
        raise ConfigError(f"prune.method={method!r}: no such pruning criterion. Fix: use one of "
                          f"{', '.join(sorted(SCORERS))}.")
    return SCORERS[method]


def choose_layers(model, calib, s: DrafterSettings, pc: PruneSettings, tau_now: float,
                  record: Path | None = None, acc=None) -> tuple[list[int], list[float] | None]:
    """The layers (current indices) this step removes. By τ (acceptance): the best-scored one, and
    up to prune.layers_per_step of the next best whose removal alone keeps >= step_safe_retention of
    the current τ. A rule or a proxy (last, similarity) says nothing of τ: its layers_per_step best
    go together, so a baseline removes as many layers a step, with as much recovery, as the
    acceptance-guided step may (the comparison at equal layer counts)."""
    scores = scorer(pc.method)(model, calib, s, pc, record, acc)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if pc.method in TAU_SCORES:
        safe = [i for i in order[1:] if scores[i] >= pc.step_safe_retention * tau_now]
        chosen = order[:1] + safe[: pc.layers_per_step - 1]
    else:
        chosen = order[: pc.layers_per_step]
    return sorted(chosen), None if pc.method in UNRECORDED else scores


def draft_latency_ms(model, s: DrafterSettings, prefix: int = 256, repeats: int = 5, blocks: int = 1) -> float:
    """Median time of a pass of `blocks` blocks after a cached prefix of random tokens (lm_head
    excluded), in the dtype the drafter will decode in (bf16 on a GPU): d3d.decoding.budget's timer."""
    from d3d.decoding.budget import block_pass_ms

    model = as_deployed(model)
    ids = torch.randint(10, s.vocab_size - 1, (1, prefix), device=next(model.parameters()).device)
    return block_pass_ms(model, ids, blocks, repeats, logits=False)


def latencies(model, s: DrafterSettings, pc: PruneSettings) -> dict:
    packed, model = pc.packed_blocks, as_deployed(model)  # one cast copy for both timings
    return {"draft_latency_ms": draft_latency_ms(model, s),
            f"packed_{packed * s.block_size}tok_latency_ms": draft_latency_ms(model, s, blocks=packed)}


def calibration_and_holdout(val: list, pc: PruneSettings, val_max_new_tokens: int | None) -> tuple[list, list]:
    """The first calib_size held-out responses choose the layer; the next holdout_size (none by
    default) measure the retention without the choice's upward bias."""
    n_calib, n_hold = pc.calib_size, pc.holdout_size
    if n_calib + n_hold > len(val):
        raise ConfigError(f"prune.calib_size={n_calib} + prune.holdout_size={n_hold} responses asked, but the "
                          f"held-out split has {len(val)} (train.val_size): lower them, or regenerate with more "
                          f"responses and raise train.val_size *for training too* (the hold-out must never be "
                          f"trained on)")
    cut = [cut_responses(part, val_max_new_tokens) for part in (val[:n_calib], val[n_calib:n_calib + n_hold])]
    return cut[0], cut[1]


def measure(model, calib, holdout, s: DrafterSettings, tree_nodes: int | None, acc, suffix: str = "") -> dict:
    """τ on the calibration responses and, when there is a hold-out, on it; `suffix` names the
    moment in the row's keys ("" = after recovery, "_before_recovery")."""
    deployed = as_deployed(model)
    row = {f"tau{suffix}": tau_of(deployed, calib, s, tree_nodes, acc)}
    if holdout:
        row[f"holdout_tau{suffix}"] = tau_of(deployed, holdout, s, tree_nodes, acc)
    return row


def tau_name(tree_nodes: int | None) -> str:
    return "chain" if tree_nodes is None else f"tree{tree_nodes}"


def retention(row: dict, first: dict) -> float:
    key = "holdout_tau" if "holdout_tau" in first else "tau"
    return row[key] / first[key]


# prune.* keys a resumed run may change (how far to go, where, on what); the rest is the experiment.
RESUMABLE_PRUNE_KEYS = {"num_layers", "min_retention", "out_dir", "stop_at_step", "progress", "device", "packed_blocks"}


def prune_resume_key(cfg: PruneConfig, responses: str | None = None) -> dict:
    """What every step's scores and τ depend on: the starting drafter (path and weights), the
    calibration/hold-out split and the recovery objective: the train.* keys prune reads (`tc`),
    those a resumed training may change aside, and never d3d.train's own (a key written when prune
    composed them still matches: keys only one side has are not compared); `responses`, the
    fingerprint of the examples it reads (d3d.training.train_resume_key)."""
    checkpoint = cfg.drafter.checkpoint
    # a missing path or a run folder, and a block rule it was not trained with: said before any work, with the fix
    saved = SavedDrafter.named(checkpoint, block_attention=cfg.drafter.block_attention) if checkpoint else None
    start = {"checkpoint": str(saved.folder), "weights": saved.fingerprint()} if saved else asdict(cfg.drafter)
    return {"drafter": start, "seed": cfg.seed, "precision": mixed_precision("auto"),
            # the recovery's global batch, not its split over processes (d3d.training.train_resume_key)
            "train": {**{k: v for k, v in asdict(cfg.train).items() if k not in RESUMABLE_TRAIN_KEYS | BATCH_SPLIT_KEYS},
                      "global_batch": cfg.train.batch_size * cfg.train.grad_accum * world_size()},
            "prune": {k: v for k, v in asdict(cfg.prune).items() if k not in RESUMABLE_PRUNE_KEYS},
            **({"responses": responses} if responses else {})}


def run_prune(cfg: DictConfig) -> Path:
    """Prune into prune.out_dir, one run at a time per folder (two would both remove layers). Under
    `accelerate launch` every process runs this: they score shares of the responses, recover the
    drafter together (DDP, FSDP2 or ZeRO, as the launch config says) and the main process writes."""
    typed = bind_config(cfg, "prune")  # the typed boundary: unknown keys fail
    typed.train = with_global_batch(typed.train, world_size())  # grad_accum from train.global_batch_size
    with job_folder(resolve_path(typed.prune.out_dir), "prune", "prune.out_dir", int(os.environ.get("RANK", 0))):
        return _prune(typed)


def resume_point(out_dir: Path, history: list[dict]) -> tuple[list[dict], Path | None]:
    """The rows and the checkpoint a resumed run continues from, made to agree. A step writes
    last.partial (complete, its step inside), then its row, then promotes: recovery promotes a
    complete last.partial whose row is on disk and redoes one whose row is not."""
    last = recover_checkpoint(out_dir, upto=history[-1]["step"])
    step = saved_step(last) if last else None
    if step is None:
        if len(history) > 1 and last is None:
            raise ConfigError(f"{out_dir / 'steps.jsonl'} records {len(history) - 1} removals but {out_dir} has no "
                              f"last/ checkpoint to continue from. Fix: delete {out_dir} to start over.")
        return history, last  # step 0 only, or a folder from before steps were recorded in last/
    check_record_reaches(last, step, history[-1]["step"], out_dir / "steps.jsonl",
                         f"delete {out_dir} to start over (its step_<k>/ folders hold each step's drafter).")
    return trim_rows(out_dir / "steps.jsonl", lambda r: r["step"] <= step), last


def publish_drafter(model, tok, out_dir: Path, name: str, step: int, dtype: str | None = None) -> Path:
    """out_dir/<name> (final, step_<k>) written aside and renamed into place whole, marked with its
    step: a kill while saving never leaves a folder with an empty config.json behind. `dtype`:
    train.save_dtype (bf16 where the drafter decodes in bf16)."""
    return publish(out_dir, name, step, lambda tmp: save_drafter(model, tok, tmp, dtype=dtype))


def linked_copy(source: Path, dest: Path) -> None:
    """`source`'s files (its completion marker aside) in `dest` as hard links: the same weights under a
    second name without writing them again (a copy where the filesystem has no links). Safe because a
    published folder is never written in place: it is replaced whole (d3d.utils.checkpoints.publish)."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(MARKER), copy_function=link)


def publish_step(model, tok, out_dir: Path, row: dict, writer: JsonlWriter, final: bool,
                 save_dtype: str | None = None) -> None:
    """A finished step, in the order resume_point relies on: its drafter as step_<k>/ (and as final/
    when it kept the retention), then the checkpoint to resume from, last.partial, written whole and
    marked with the step, then the step's row, then last.partial promoted to last/. The row comes
    after the complete checkpoint and before the promotion, so a kill anywhere leaves a folder that
    resumes: a complete last.partial with its row is promoted, one without it is redone.
    Each set of weights is written once: final/ links step_<k>/'s files, and so does last.partial
    when they are its fp32 weights; with save_dtype=bfloat16 last.partial is written in fp32 (a resumed
    run continues from the weights recovery trained, not their bf16 rounding)."""
    step = row["step"]
    published = publish_drafter(model, tok, out_dir, f"step_{step}", step, save_dtype)
    if final:
        publish(out_dir, "final", step, lambda tmp: linked_copy(published, tmp))
    partial = out_dir / "last.partial"
    shutil.rmtree(partial, ignore_errors=True)
    if save_dtype in (None, "float32"):
        linked_copy(published, partial)
    else:
        save_drafter(model, tok, partial)
    mark_complete(partial, step)
    writer.write([row])
    promote(out_dir)


def starting_layers(cfg: PruneConfig) -> int | None:
    """The layer count of the drafter pruning starts from, read without its weights: a checkpoint's
    config.json, the layers a target_layers init keeps, or the config of the model the drafter copies
    (a tiny spec, a published shape known by name, a local folder). None when only the Hub knows it
    (then it is checked once the drafter has loaded)."""
    import json

    from d3d.models.random_models import SHAPES

    d = cfg.drafter
    if d.checkpoint:
        return saved_config(drafter_folder(d.checkpoint)).get("num_hidden_layers")  # drafter_folder: it parses
    if d.init == "target_layers" and d.layers:
        return len(d.layers)
    spec = d.model if d.init == "pretrained" and d.model is not None else cfg.target
    if spec.tiny:
        return spec.tiny.num_hidden_layers
    if spec.name in SHAPES:
        return SHAPES[spec.name]["num_hidden_layers"]
    if spec.path and (Path(spec.path).expanduser() / "config.json").is_file():
        return json.loads((Path(spec.path).expanduser() / "config.json").read_text()).get("num_hidden_layers")
    return None


def check_layer_count(num_layers: int, layers: int) -> None:
    """prune.num_layers counts the layers to REMOVE. Removing all of them, or so many that fewer than
    a quarter stay (the paper removes 5 of 36: a count of layers to keep, 31, misread as removals),
    is refused in one line before anything loads. A deeper cut is a second run from the first's final/."""
    if num_layers >= layers:  # it used to save a final/ with no layer left and report success
        raise ConfigError(f"prune.num_layers={num_layers} would remove every layer of a {layers}-layer drafter. "
                          f"Fix: set prune.num_layers={layers - 1} or fewer.")
    floor = max(1, layers // 4)
    if layers - num_layers < floor:
        raise ConfigError(f"prune.num_layers={num_layers} would leave {layers - num_layers} of the drafter's {layers} "
                          f"layers (fewer than a quarter): it counts the layers to REMOVE, not those kept. Fix: "
                          f"prune.num_layers={max(layers - num_layers, 1)} keeps {layers - max(layers - num_layers, 1)}; "
                          f"at most {layers - floor} may go in one run.")


def fp32_drafter(cfg: PruneConfig, device: str, folder: Path | None = None):
    """(model, tokenizer) of a drafter in fp32 on `device`: the one saved in `folder` (the checkpoint a
    resumed run continues from), else the one pruning starts from, drafter.checkpoint or what
    drafter.init builds (deterministic, so distillation's teacher built again is the same drafter)."""
    folder = folder or cfg.drafter.checkpoint
    if folder:
        return SavedDrafter(resolve_path(folder)).load(cfg.drafter, cfg.target, device=device, dtype="float32")
    return build_drafter(cfg.drafter, cfg.target, resolve_path(cfg.paths.cache_dir), device=device, dtype="float32")


def freeze_below(model, first_trainable: int, start_kept: list[int]) -> None:
    """prune.recovery_from_layer: the layers below `first_trainable` of the drafter pruning started
    from (positions in its kept_layers, `start_kept`) take no gradient in recovery, the others train,
    whichever of them a removal took out, in a fresh run and a resumed one alike (a resumed drafter
    has fewer layers, so its own indices are not the starting drafter's). With
    train.trainable_from_layer's value, recovery trains what d3d.train trained: on the Qwen demo's
    drafter (24 layers, the upper 12 trained) all-layer recovery took the prune stage to 11.0 GiB in
    its first recovery step, before its AdamW state (8 bytes a trained weight, ~2.7 GiB) existed."""
    position = {original: i for i, original in enumerate(start_kept)}
    freeze_lower_layers(model, first_trainable, [position[o] for o in DrafterSettings.of(model).kept_layers])


def final_step(history: list[dict], min_retention: float) -> int:
    """The step final/ holds: the last one that kept the retention (step 0 keeps it by definition)."""
    return next(r["step"] for r in reversed(history) if r["retention"] >= min_retention or r["step"] == 0)


def ensure_final(out_dir: Path, model, tok, history: list[dict], min_retention: float,
                 save_dtype: str | None = None) -> None:
    """On resume, make final/ the whole drafter of final_step(): a run killed while saving it (in
    place, before final/ was published; or between the two renames) used to finish with rc 0 and a
    summary.json naming a folder with an empty config.json. Redone from the drafter in memory (the
    checkpoint the run resumes from) or copied from that step's step_<k>/; else refused in one line."""
    want = final_step(history, min_retention)
    final = out_dir / "final"
    try:
        recover_checkpoint(out_dir, "final", upto=history[-1]["step"])  # finish or undo an interrupted publish
        step = saved_step(final) if final.is_dir() else None
        problem = None if step == want else drafter_problem(final) if step is None else f"{final} holds step {step}"
    except CorruptFile as err:
        problem = str(err).split(". Fix")[0]
    if problem is None:
        return
    if want == history[-1]["step"]:
        log.warning("%s: saving final/ again (step %d)", problem, want)
        publish_drafter(model, tok, out_dir, "final", want, save_dtype)
        return
    source = out_dir / f"step_{want}"
    why = drafter_problem(source)
    if why is not None:
        raise ConfigError(f"{problem}, and the drafter of step {want} that final/ should hold is not whole either "
                          f"({why}). Fix: delete {out_dir} to start over.")
    log.warning("%s: copying %s to final/", problem, source.name)
    publish(out_dir, "final", want, lambda tmp: shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(MARKER)))


def _prune(cfg: PruneConfig) -> Path:
    pc, tc = cfg.prune, cfg.train
    scorer(pc.method)
    layers = starting_layers(cfg)  # a resumed run starts from the same drafter (its resume key holds it)
    if layers is not None:
        check_layer_count(pc.num_layers, layers)
    torch.manual_seed(cfg.seed)
    out_dir = resolve_path(pc.out_dir)
    # Recovery trains as d3d.train does with train.mixed_precision=auto: bf16 matmuls under autocast
    # with fp32 weights on CUDA and native-bf16 CPUs, fp32 on AVX2-only CPUs.
    acc = make_accelerator(tc, timeout_s=cfg.dist.timeout_s, cpu=pick_device(pc.device).type == "cpu", precision="auto")
    main = acc.is_main_process
    device = str(acc.device)  # this process's GPU under accelerate launch
    if main and acc.num_processes > 1:
        print(f"[d3d.prune] {acc.num_processes} processes ({acc.distributed_type.value}): scoring split over them, "
              f"recovery on a global batch of {tc.batch_size * tc.grad_accum * acc.num_processes}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    examples, train, val = held_out(tc, cfg.seed)
    calib, holdout = calibration_and_holdout(val, pc, tc.val_max_new_tokens)

    history = unique(read_jsonl(out_dir / "steps.jsonl", ("step",)), lambda r: r["step"])
    key = prune_resume_key(cfg, examples.fingerprint())
    if history:  # a run from before resume keys has none: resumes as it did
        refuse_mixed_run(out_dir, history[0].get("resume_key"), key, "was pruned",
                         "pass a new prune.out_dir, or delete that one.",
                         also=["prune.holdout_size"] if ("holdout_tau" in history[0]) != bool(holdout) else [])
    last = None
    if history:
        with acc.main_process_first():  # the main process repairs the folder; the others then find it whole
            history, last = resume_point(out_dir, history)
    model, tok = fp32_drafter(cfg, device, last)
    if last is not None:
        log.info("resuming after step %d", history[-1]["step"])
    model.eval()
    layers = history[0]["layers"] if history else len(decoder_layers(model))  # the starting drafter's count
    check_layer_count(pc.num_layers, layers)  # again: a drafter only the Hub knew the shape of
    s = DrafterSettings.of(model)
    if tc.freeze_embeddings:
        freeze_embeddings_except_mask(model, s.mask_token_id)
    writer = JsonlWriter(out_dir / "steps.jsonl") if main else None
    scores_file = out_dir / "scores.jsonl"  # acceptance scores as they are made (mid-step resume)
    if not history:
        if main:
            scores_file.unlink(missing_ok=True)  # a fresh run: scores of another run's drafter do not apply
        full = measure(model, calib, holdout, s, pc.tree_nodes, acc)
        row = {"step": 0, "tau_of": tau_name(pc.tree_nodes), "resume_key": key, "removed": None, "layers": len(decoder_layers(model)), "kept_layers": s.kept_layers,
               **{f"{k}_before_recovery": v for k, v in full.items()}, **full, "retention": 1.0,
               **latencies(model, s, pc)}
        if main:
            publish_drafter(model, tok, out_dir, "final", 0, tc.save_dtype)  # before the row: a recorded step 0 has its final/
            writer.write([row])
        history.append(row)
    elif main:
        ensure_final(out_dir, model, tok, history, pc.min_retention, tc.save_dtype)
    tau_full = history[0]["tau"]
    step = history[-1]["step"]
    teacher = None
    if pc.recovery_loss == "distill" and pc.recovery_steps:  # the unpruned drafter's block laws, as it decodes
        teacher = as_deployed(fp32_drafter(cfg, device)[0]).eval()
    while layers - history[-1]["layers"] < pc.num_layers and history[-1]["retention"] >= pc.min_retention:
        step += 1
        start = time.perf_counter()
        chosen, scores = choose_layers(model, calib, s, pc, history[-1]["tau"], scores_file, acc)
        chosen = chosen[: pc.num_layers - (layers - history[-1]["layers"])]
        original = [DrafterSettings.of(model).kept_layers[i] for i in chosen]
        keep_layers(model, [i for i in range(len(decoder_layers(model))) if i not in chosen])
        s = DrafterSettings.of(model)
        scored_s = time.perf_counter() - start
        before = measure(model, calib, holdout, s, pc.tree_nodes, acc, "_before_recovery")
        if pc.recovery_from_layer:  # before each recovery: the one before may hand back another module
            freeze_below(model, pc.recovery_from_layer, history[0]["kept_layers"])
        recovery_start = time.perf_counter()
        model = recover(acc, model, train, tc, s, pc.recovery_steps, cfg.seed + step, tok.pad_token_id, teacher,
                        pc.recovery_lr, pc.recovery_warmup_steps, pc.recovery_schedule)
        recovery_s = time.perf_counter() - recovery_start
        after = measure(model, calib, holdout, s, pc.tree_nodes, acc)
        row = {"step": step, "removed": original[0] if len(original) == 1 else original,
               "layers": len(decoder_layers(model)), "kept_layers": s.kept_layers, "tau_of": tau_name(pc.tree_nodes),
               "scores": scores, **before, **after, "retention": retention(after, history[0]),
               **latencies(model, s, pc), "choose_s": round(scored_s, 2), "recovery_s": round(recovery_s, 2),
               "step_s": round(time.perf_counter() - start, 2)}
        if main:
            publish_step(model, tok, out_dir, row, writer, final=row["retention"] >= pc.min_retention,
                         save_dtype=tc.save_dtype)
            held = f", hold-out τ {row['holdout_tau_before_recovery']:.3f} -> {row['holdout_tau']:.3f}" if holdout else ""
            print(f"[d3d.prune] step {step}: removed layer(s) {original}, {row['layers']} left, τ {row['tau_before_recovery']:.3f} -> "
                  f"{row['tau']:.3f}{held} (retention {row['retention']:.3f}), draft {row['draft_latency_ms']:.1f} ms", flush=True)
        history.append(row)
        if pc.stop_at_step and step >= pc.stop_at_step:
            break
    acc.wait_for_everyone()
    if not main:
        return out_dir
    writer.close()
    write_json(out_dir / "summary.json", {"method": pc.method, "tau_full": tau_full,
                                          "holdout_tau_full": history[0].get("holdout_tau"), "steps": history,
                                          "final": str(out_dir / "final"),
                                          "final_step": final_step(history, pc.min_retention)})
    (out_dir / "steps.md").write_text(steps_markdown(history))
    plot_steps(history, out_dir / "pruning.png")
    print(steps_markdown(history), flush=True)
    return out_dir


def steps_markdown(history: list[dict]) -> str:
    packed_key = next((k for k in history[0] if k.startswith("packed_")), None)
    held = "holdout_tau" in history[0]
    cols = ["step", "removed", "layers", "τ before recovery", "τ after",
            *(["hold-out τ before", "hold-out τ after"] if held else []), "retention", "draft ms", "packed pass ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    taus = ["tau_before_recovery", "tau", *(["holdout_tau_before_recovery", "holdout_tau"] if held else [])]
    for h in history:
        cells = [h["step"], "—" if h["removed"] is None else h["removed"], h["layers"],
                 *(f"{h[k]:.3f}" for k in taus), f"{h['retention']:.3f}", f"{h['draft_latency_ms']:.1f}",
                 f"{h[packed_key]:.0f}" if packed_key and packed_key in h else "—"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot_steps(history: list[dict], path: Path) -> Path:
    """τ (before/after recovery; calibration and, if measured, hold-out) and one-block draft latency
    against layers removed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = [h["step"] for h in history]
    sets = [("", "calibration", "C0"), *([("holdout_", "hold-out", "C2")] if "holdout_tau" in history[0] else [])]
    for prefix, name, color in sets:
        ax.plot(xs, [h[f"{prefix}tau"] for h in history], "o-", color=color, label=f"τ after recovery ({name})")
        ax.plot(xs, [h[f"{prefix}tau_before_recovery"] for h in history], "x:", color=color, alpha=0.6,
                label=f"τ before recovery ({name})")
    ax.set_xlabel("layers removed")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("τ (greedy, offline estimator)")
    ax2 = ax.twinx()
    ax2.plot(xs, [h["draft_latency_ms"] for h in history], "s--", color="C1", label="draft ms")
    ax2.set_ylabel("one-block draft latency (ms)", color="C1")
    ax.legend(fontsize=8, loc="lower left")
    return save_figure(fig, path)


@hydra_job("prune")
def main(cfg: DictConfig) -> None:
    run_prune(cfg)


if __name__ == "__main__":
    main()
