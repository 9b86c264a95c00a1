"""`python -m d3d.export drafter.checkpoint=<folder> export.out_dir=<folder>`: a trained drafter as a
folder vLLM serves as a parallel draft model (docs/serving.md).

vLLM's parallel drafting (speculative_config method=draft_model, parallel_drafting=true) runs the
draft model once per step over the committed tokens it has not seen, then `[last committed, MASK x
(K-1)]` at consecutive positions, and reads a draft at each of the K positions: d3d's block, under
ordinary causal attention. So a drafter trained with drafter.block_attention=causal is served as it
was trained, and its τ under vLLM is the offline estimator's with a block of K+1 (a causal slot
never sees the slots after it, so the first K outputs of that block are vLLM's K drafts). A
bidirectional drafter runs there under a mask it was not trained with: it is exported with a
warning that gives that τ, measured.

What the folder holds, and why:
- the drafter's weights cut to the target's vocabulary (vLLM requires the draft's `vocab_size` to
  be the target's); its config.json names the mask id where vLLM reads it (`mask_token_id`);
- a mask id inside that vocabulary: the trained one when it is (Qwen's padded rows), else a special
  token of the target no prompt or chat template uses, whose embedding row becomes the mask's. The
  LM head keeps the trained rows (the head is untied if it was tied), so the drafts are the drafter's;
- a draft vocabulary's head (drafter.draft_vocab) as a full one: its N rows at their token ids, every
  other row zero. The heads vLLM runs have no bias, so a row cannot say -inf: an excluded token scores 0
  and wins only at a slot where every kept logit is below 0; export.json holds τ both ways;
- the target's tokenizer; `speculative_config.json` (what to pass to vLLM) and `export.json` (what was
  exported from what, the τ measured, and which public Qwen3 mask-id convention the served id is). Its
  d3d settings say block_attention=causal and the served mask id, so d3d loads the folder as the
  drafter vLLM runs (tests/integration/test_serving.py);
- `speculation_profile.json`: the served drafter's acceptance per draft position (cumulative and
  conditional, each convention said: d3d.acceptance) over the steps of that served τ measurement,
  when there were held-out responses to measure on.

The stages, each printed as it starts: load (the drafter, checked against the target's tokenizer) ->
measure (τ on the held-out responses, as trained and as served) -> convert -> write (into
`<out>.partial`) -> check: the folder written is reloaded as d3d loads it and must be the converted
drafter (causal blocks, the served mask id in config.json and in d3d's settings, the target's vocabulary,
bitwise the same logits on a probe, the served τ export.json states); one that is not is refused, the old export kept.

The folder is published whole: written into `<out>.partial`, then swapped with the previous export in
one rename (renameat2's RENAME_EXCHANGE), so a server or a reader sees the old export or the new one,
never a mix or nothing, and a kill at any step leaves a complete export at `<out>` (or, on a
filesystem without the exchange, beside it as `<out>.previous`, put back by the next export). Only a
folder holding export.json and nothing but the files an export writes (EXPORT_FILES) is replaced;
anything else in it is the user's, and the export is refused before the drafter loads.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from d3d.acceptance import speculation_profile
from d3d.config import hydra_job
from d3d.errors import ConfigError, UserError
from d3d.estimator import estimate_acceptance
from d3d.utils.checkpoints import saved_config
from d3d.utils.io import resolve_path, write_json
from d3d.models.drafter import SavedDrafter, check_same_tokenizer, mask_convention
from d3d.models.drafter_settings import DrafterSettings, draft_map
from d3d.models.target import load_tokenizer, resolve_model_path
from d3d.serving import served_taus, speculative_config
from d3d.settings import bind_config
from d3d.specs import ExportConfig
from d3d.examples import held_out
from d3d.training import cut_responses

log = logging.getLogger("d3d.export")

# Every file an export writes into its folder (names or glob patterns): the model's and tokenizer's
# save_pretrained files and d3d's own. A folder holding export.json and only these is an earlier
# export and is replaced whole; a file an export starts writing goes here, or re-exporting refuses it.
EXPORT_FILES = (
    "export.json", "speculative_config.json", "speculation_profile.json",
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


def spare_special_token(tok, vocab_size: int) -> int:
    """The last special token of the target's tokenizer that is not its bos/eos/pad/unk and that its
    chat template never writes: a row whose embedding no prompt reads, so it can carry the mask."""
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template or "")
    spare = [i for i, added in tok.added_tokens_decoder.items()
             if added.special and i < vocab_size and i not in reserved and added.content not in template]
    if not spare:
        raise ConfigError("export.mask_token_id: the drafter's mask id lies outside the target's vocabulary and the "
                          "target's tokenizer has no spare special token to carry it. Fix: set export.mask_token_id to "
                          "an id below the vocabulary size that prompts never contain.")
    return max(spare)


def served_mask_id(s: DrafterSettings, tok, wanted: int | None) -> int:
    if wanted is not None:
        if wanted >= s.vocab_size:
            raise ConfigError(f"export.mask_token_id={wanted}: vLLM needs it inside the target's vocabulary of "
                              f"{s.vocab_size}. Fix: pick an id below {s.vocab_size} that prompts never contain.")
        return wanted
    return s.mask_token_id if s.mask_token_id < s.vocab_size else spare_special_token(tok, s.vocab_size)


def as_served(model, s: DrafterSettings, mask_id: int) -> None:
    """Cut the drafter to the target's vocabulary in place, the mask's input row at `mask_id`; the LM
    head keeps its trained rows, untied from the input embeddings when the mask moved into a row that
    the head also reads."""
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    d2t = draft_map(model)
    if d2t is not None:  # a draft vocabulary: its rows at their token ids, every other row zero (a logit of 0)
        head = torch.zeros(s.vocab_size, head.shape[1], dtype=head.dtype, device=head.device).index_copy_(
            0, d2t.to(head.device), head)
    rows = emb[: s.vocab_size].clone()
    rows[mask_id] = emb[s.mask_token_id]
    moved = mask_id != s.mask_token_id
    tied = head.data_ptr() == emb.data_ptr()
    model.set_input_embeddings(torch.nn.Embedding.from_pretrained(rows, freeze=False))
    if tied and moved:
        model.config.tie_word_embeddings = False
        for config in (model.config, model.config.get_text_config(decoder=True)):
            config.tie_word_embeddings = False
    out = torch.nn.Linear(head.shape[1], s.vocab_size, bias=False, dtype=head.dtype, device=head.device)
    out.weight = torch.nn.Parameter(rows if tied and not moved else head[: s.vocab_size].clone())
    model.set_output_embeddings(out)
    model.config.vocab_size = s.vocab_size
    model.config.mask_token_id = mask_id  # where vLLM reads the parallel-drafting token
    served = DrafterSettings(**{**asdict(s), "mask_token_id": mask_id, "block_attention": "causal", "draft_vocab": None})
    served.attach(model)


def not_exported(folder: Path) -> list[str]:
    """What in `folder` an export did not write: entries that are not plain files named in EXPORT_FILES."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if p.is_symlink() or not p.is_file() or not any(fnmatch.fnmatchcase(p.name, f) for f in EXPORT_FILES))


def check_out_dir(out: Path, source: Path) -> None:
    """One line, before the drafter loads, for an out_dir that cannot take an export: the drafter's own
    folder, a file or a path under one, or a folder holding anything an export did not write."""
    if out == source:
        raise ConfigError(f"export.out_dir={out} is the drafter's own folder. Fix: pass another folder.")
    file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        raise ConfigError(f"export.out_dir={out}: {file} is a file, not a folder. Fix: set export.out_dir to a "
                          f"folder, or move that file.")
    for folder in (out, sibling(out, "previous")):
        if not folder.is_dir() or not any(folder.iterdir()):
            continue
        if not (folder / "export.json").is_file():
            raise ConfigError(f"export.out_dir={out}: {folder} exists and holds something else than an export (no "
                              f"export.json). Fix: pass a new folder, or move that one away.")
        other = not_exported(folder)
        if other:
            raise ConfigError(f"export.out_dir={out}: {folder} holds an export and also {', '.join(other[:3])}"
                              f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}, which d3d.export did "
                              f"not write; replacing the export would delete them. Fix: move them out of {folder}, "
                              f"or pass another folder.")


def sibling(out: Path, what: str) -> Path:
    return out.with_name(f"{out.name}.{what}")


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one atomic rename (Linux renameat2 RENAME_EXCHANGE); OSError where the kernel,
    the C library or the filesystem (NFS, some FUSE) has no such rename."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def put_back_previous(out: Path) -> None:
    """A publish killed between its two renames (no exchange) left the old export at <out>.previous and
    nothing at <out>: put it back. With <out> in place, <out>.previous is an old export: removed."""
    previous = sibling(out, "previous")
    if not previous.is_dir():
        return
    if out.exists():
        shutil.rmtree(previous)
    else:
        os.rename(previous, out)
        log.info("put back the export at %s that an interrupted export had moved to %s", out, previous)


def publish(out: Path, write: Callable[[Path], None]) -> None:
    """Run write(folder) into <out>.partial, then make that folder <out>: a rename when there is no
    export yet, else an atomic exchange with the old export, which is removed after. Where there is no
    exchange, two renames: the old export to <out>.previous, the new one to <out> (a kill between them
    leaves the old one there, put back by the next export)."""
    put_back_previous(out)
    new = sibling(out, "partial")
    if new.is_dir():
        shutil.rmtree(new)  # an earlier export's, killed while writing (or its old export, after an exchange)
    elif new.exists():
        new.unlink()
    new.mkdir(parents=True)
    write(new)  # a kill or an error here leaves <out> as it was
    if not out.exists():
        os.rename(new, out)
        return
    try:
        exchange(new, out)
    except OSError as err:
        if err.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        previous = sibling(out, "previous")
        os.rename(out, previous)
        os.rename(new, out)
        shutil.rmtree(previous)
        return
    shutil.rmtree(new)  # the old export, now at <out>.partial


def served_profile(measured: dict | None, k: int) -> dict | None:
    """speculation_profile.json: the per-position acceptance of the served drafter (the full head
    where a draft vocabulary was widened: what vLLM runs), from served_taus' steps on the held-out
    responses; None when there were none to measure on."""
    if not measured:
        return None
    return speculation_profile(measured[f"tau_histogram_served_causal_K{k}"], k,
                               f"{measured['responses']} held-out greedy responses of the target (the drafter's "
                               f"training split), the drafter served causally with K={k}: d3d.serving.served_taus")


def held_out_responses(cfg: ExportConfig):
    """The held-out responses of the drafter's training (d3d.train's split with this seed), cut as
    its validation cuts them; None when there are none here."""
    try:
        val = held_out(cfg.train, cfg.seed).val
    except ConfigError as err:
        log.info("no responses to measure τ on: %s", err)
        return None
    return cut_responses(list(val), cfg.train.val_max_new_tokens)


# ---------------------------------------------------------------------------- the stages
# load -> measure -> convert -> write -> check, each printed as it starts. Write and check run on
# <out>.partial inside `publish`: an export that does not reload as it was converted is never swapped in.


def stage(name: str, what: str) -> None:
    print(f"[d3d.export] {name}: {what}", flush=True)


@dataclass
class Loaded:
    """The trained drafter as it was saved, and what the stages after `load` read of it and of the target."""

    source: Path
    model: Any
    s: DrafterSettings
    k: int  # the drafts vLLM asks for per step
    target_path: Path
    target_tok: Any
    fingerprint: str  # the saved weights' (SavedDrafter.fingerprint), export.json's source_weights


@dataclass
class Served:
    """The drafter converted for vLLM and everything the folder will hold, and what `check` compares
    the reloaded folder with: the served rule, a probe's logits, and τ served causally."""

    model: Any
    target_tok: Any
    k: int
    mask_id: int
    spec: dict
    record: dict
    profile: dict | None
    probe: torch.Tensor  # token ids the converted drafter's logits were taken on
    probe_logits: torch.Tensor
    tau: float | None  # export.json's τ served causally with K drafts, on the held-out responses (None: none here)


def load(cfg: ExportConfig, saved: SavedDrafter) -> Loaded:
    """The drafter from its folder, fp32 on the CPU, checked against the target's tokenizer and K."""
    ec = cfg.export
    model, tok = saved.load(cfg.drafter, cfg.target, device="cpu", dtype="float32")
    model.eval()
    s = DrafterSettings.of(model)
    k = ec.num_speculative_tokens or s.block_size - 1
    if k > s.block_size:
        raise ConfigError(f"export.num_speculative_tokens={k}: a drafter trained on blocks of {s.block_size} has "
                          f"{s.block_size} trained slots. Fix: set it to {s.block_size - 1} (d3d's block) or "
                          f"{s.block_size} (with the bonus slot's guess).")
    target_path = resolve_model_path(cfg.target, resolve_path(cfg.paths.cache_dir))
    target_tok = load_tokenizer(target_path)
    check_same_tokenizer(tok, target_tok, s)
    return Loaded(saved.folder, model, s, k, target_path, target_tok, saved.fingerprint())


def measure(examples, d: Loaded) -> dict | None:
    """τ as trained (d3d's loop) and served (causal, K drafts) on the held-out responses; a bidirectional
    drafter is exported only with what vLLM's causal pass costs it said, so it needs responses."""
    source, model, s, k = d.source, d.model, d.s, d.k
    taus = served_taus(model, examples, k) if examples else None
    if s.block_attention != "causal":
        if taus is None:
            raise ConfigError(f"drafter.checkpoint={source} was trained with bidirectional blocks, which vLLM runs "
                              f"causally: export measures what that costs first, on the held-out responses in "
                              f"train.responses_dir, and there are none. Fix: run d3d.generate for it (or set "
                              f"train.responses_dir), or export a drafter trained with drafter.block_attention=causal.")
        log.warning("drafter %s was trained with bidirectional blocks; vLLM drafts causally: its τ is %.3f there "
                    "(K=%d) against %.3f in d3d's loop (B=%d), on %d held-out responses. Train with "
                    "drafter.block_attention=causal to serve it as trained.", source,
                    taus[f"tau_served_causal_K{k}"], k, taus[f"tau_d3d_bidirectional_B{s.block_size}"], s.block_size,
                    taus["responses"])
    return taus


def probe_ids(s: DrafterSettings) -> torch.Tensor:
    """A fixed sequence of token ids inside the served vocabulary: the converted and the reloaded
    drafter must give it bitwise the same logits."""
    return (torch.arange(3, 3 + 16 * 37, 37) % s.vocab_size)[None]


@torch.no_grad()
def served_tau(model, examples, k: int) -> float | None:
    """τ of an exported drafter as vLLM serves it (its settings say causal): served_taus' served value."""
    s = DrafterSettings.of(model)
    return estimate_acceptance(model, examples, k + 1, s.mask_token_id, s.vocab_size).tau if examples else None


def convert(cfg: ExportConfig, d: Loaded, out: Path, examples, taus: dict | None) -> Served:
    """The drafter cut to the target's vocabulary, the mask in a row vLLM can write, a draft vocabulary
    widened to a full head; the folder's records, and the converted drafter's logits on a probe."""
    ec, source, model, s, k, target_tok = cfg.export, d.source, d.model, d.s, d.k, d.target_tok
    mask_id = served_mask_id(s, target_tok, ec.mask_token_id)
    if mask_id != s.mask_token_id:
        log.info("mask id %d is outside the target's vocabulary of %d: served as %d (%s)", s.mask_token_id,
                 s.vocab_size, mask_id, target_tok.convert_ids_to_tokens(mask_id))
    as_served(model, s, mask_id)
    full_head = served_taus(model, examples, k) if examples and s.draft_vocab else None
    if full_head:
        log.info("draft vocabulary of %d tokens served as a head of %d rows (the others zero): τ under vLLM %.3f, "
                 "against %.3f with the draft vocabulary's -inf outside it, on %d held-out responses", s.draft_vocab,
                 s.vocab_size, full_head[f"tau_served_causal_K{k}"], taus[f"tau_served_causal_K{k}"], taus["responses"])
    spec = speculative_config(out, k)
    record = {"source": str(source), "source_weights": d.fingerprint, "target": cfg.target.name,
              "target_path": str(d.target_path), "trained_block_attention": s.block_attention, "block_size": s.block_size,
              "trained_mask_token_id": s.mask_token_id, "mask_token_id": mask_id, "vocab_size": s.vocab_size,
              # which public Qwen3 mask-id convention the served id is (None: neither, or not a Qwen3 vocabulary)
              "mask_convention": mask_convention(mask_id, s.vocab_size),
              "draft_vocab": s.draft_vocab, "speculative_config": spec, **({"measured": taus} if taus else {}),
              **({"measured_full_head": full_head} if full_head else {})}
    profile = served_profile(full_head or taus, k)
    if profile is None:
        log.info("no held-out responses here: no speculation_profile.json (set train.responses_dir to measure one)")
    probe = probe_ids(s)
    with torch.no_grad():
        logits = model(probe).logits
    served = full_head or taus  # what export.json says vLLM's τ is: the reloaded folder must give it
    tau = served[f"tau_served_causal_K{k}"] if served else None
    return Served(model, target_tok, k, mask_id, spec, record, profile, probe, logits, tau)


def write(folder: Path, served: Served) -> None:
    """The folder vLLM loads: weights and config, the target's tokenizer, d3d's records."""
    served.model.save_pretrained(folder)
    served.target_tok.save_pretrained(folder)
    write_json(folder / "speculative_config.json", served.spec)
    write_json(folder / "export.json", served.record)
    if served.profile:
        write_json(folder / "speculation_profile.json", served.profile)


@torch.no_grad()
def check(folder: Path, served: Served, examples) -> None:
    """Reload the written folder as d3d loads it and refuse it, before it replaces any export, unless it
    is the converted drafter under the served rule: causal blocks, the served mask id where vLLM and d3d
    read it, the target's vocabulary, no draft vocabulary, the speculative_config; bitwise the same
    logits on a probe; the τ served causally on the held-out responses that export.json states."""
    model, _ = SavedDrafter.named(folder, "export.out_dir").load(device="cpu", dtype="float32")
    model.eval()
    s = DrafterSettings.of(model)
    config = saved_config(folder) or {}  # what vLLM reads: the mask id at the top level
    wrong = [f"{what} {got!r}, not {want!r}" for what, got, want in (
        ("block attention", s.block_attention, "causal"),
        ("mask id", s.mask_token_id, served.mask_id),
        ("config.json's mask_token_id", config.get("mask_token_id"), served.mask_id),
        ("vocabulary", s.vocab_size, served.record["vocab_size"]),
        ("draft vocabulary", s.draft_vocab, None),
        ("speculative_config.json", json.loads((folder / "speculative_config.json").read_text()), served.spec),
    ) if got != want]
    if not wrong and not torch.equal(model(served.probe).logits, served.probe_logits):
        wrong.append("other logits than the converted drafter's on a probe (other weights)")
    tau = served_tau(model, examples, served.k) if not wrong else served.tau
    if tau != served.tau:
        wrong.append(f"τ {tau} served causally, not export.json's {served.tau}")
    if wrong:
        raise UserError(f"{folder}: the export written does not reload as the drafter converted: {'; '.join(wrong)}. "
                        f"Fix: export again (the previous export, if any, is untouched); if it repeats, check the "
                        f"disk it writes to.")


def export(cfg: ExportConfig) -> Path:
    if not cfg.drafter.checkpoint:
        raise ConfigError("drafter.checkpoint: unset; export serves a trained drafter. Fix: pass "
                          "drafter.checkpoint=<the final/ folder of a d3d.train or d3d.prune run>.")
    saved = SavedDrafter.named(cfg.drafter.checkpoint, block_attention=cfg.drafter.block_attention)
    source = saved.folder
    out = resolve_path(cfg.export.out_dir)
    check_out_dir(out, source)
    stage("load", str(source))
    loaded = load(cfg, saved)
    examples = held_out_responses(cfg)
    stage("measure", f"τ on {len(examples)} held-out responses" if examples else "no held-out responses")
    taus = measure(examples, loaded)
    stage("convert", f"the target's vocabulary, K={loaded.k} drafts")
    served = convert(cfg, loaded, out, examples, taus)
    del loaded

    def write_and_check(folder: Path) -> None:
        stage("write", str(out))
        write(folder, served)
        served.model = None  # check compares with what convert took of it: one drafter in memory at a time
        stage("check", "the folder reloaded as d3d loads it")
        check(folder, served, examples)

    publish(out, write_and_check)
    print(json.dumps(served.spec), flush=True)
    return out


def run_export(cfg: DictConfig) -> Path:
    return export(bind_config(cfg, "export"))


@hydra_job("export")
def main(cfg: DictConfig) -> None:
    run_export(cfg)


if __name__ == "__main__":
    main()
