"""The D3D drafter: an ordinary HF causal LM that drafts a whole block in one pass.

Nothing in the network changes: block diffusion lives in the inputs. A block is
`[anchor, MASK x (B-1)]` at positions a..a+B-1, attending to the committed prefix (causal, in the
drafter's own KV cache) and bidirectionally to itself (d3d.models.masks). With the autoregressive
label convention, the output at block slot k predicts the token at position a+k+1: slots 0..B-2
give the B-1 drafts and slot B-1 guesses the bonus token (used by the async all-accepted tray).

So a drafter saves and loads with plain `save_pretrained` / `from_pretrained`; its d3d settings
(block size, mask token id, target vocab size, which original layers it keeps, tokenizer
fingerprint) ride along in `config.d3d`. A drafter with a draft vocabulary (drafter.draft_vocab)
has a smaller LM head, `DraftHead`, whose rows are the N most frequent response tokens; its folder
loads through `load_drafter` (docs/design.md, Draft vocabulary, says how a plain HF loader reads it).

A job that names a trained drafter holds it by one handle, `SavedDrafter`: the folder checked before
anything loads, the block rule it was trained with, its weights' fingerprint for resume keys, and one
`load` that places it (device, dtype, attention) and says its fit to the target, the same for every job.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from d3d.errors import ConfigError
from d3d.models.drafter_settings import DRAFT_MAP, DrafterSettings
from d3d.models.target import drafter_device, load_model, load_tokenizer, resolve_model_path, torch_dtype
from d3d.specs import DrafterSpec, ModelSpec
from d3d.utils.checkpoints import MASK_ID_KEYS, named_mask_id, saved_config, torn_json

log = logging.getLogger("d3d.models.drafter")


class TokenizerMismatchError(ConfigError):
    """The drafter and the target do not share a tokenizer (a ConfigError: the CLI says it in one line)."""


def tokenizer_fingerprint(tokenizer, ignore: tuple[str, ...] = ()) -> str:
    """A hash of the vocabulary (token -> id), ignoring the drafter's added mask token."""
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if t not in ignore}
    return hashlib.sha1(json.dumps(vocab, sort_keys=True).encode()).hexdigest()[:16]


def check_same_tokenizer(drafter_tok, target_tok, settings: DrafterSettings) -> None:
    ignore = (drafter_tok.convert_ids_to_tokens(settings.mask_token_id),) if settings.mask_token_id >= 0 else ()
    mine = tokenizer_fingerprint(drafter_tok, ignore=ignore)
    theirs = tokenizer_fingerprint(target_tok, ignore=ignore)
    if mine != theirs:
        raise TokenizerMismatchError(
            f"the drafter's tokenizer ({drafter_tok.name_or_path}) does not match the target's "
            f"({target_tok.name_or_path}): drafts would be other tokens than the target verifies. Fix: build "
            "the drafter from a model of the target's family (same vocabulary), e.g. drafter=target_copy."
        )


def check_fits_target(drafter, drafter_tok, target, target_tok, target_name: str | None = None) -> list[str]:
    """Contract 7 at load time: a drafter checkpoint must share the target's vocabulary and logits
    width (else drafts are other tokens than the target verifies). Returns warnings for what is
    allowed but worth saying (a drafter trained for another target of the same family)."""
    settings = DrafterSettings.of(drafter)
    check_same_tokenizer(drafter_tok, target_tok, settings)
    width = target.get_output_embeddings().weight.shape[0]
    if settings.vocab_size != width:
        raise TokenizerMismatchError(
            f"the drafter was built for a target with {settings.vocab_size} logits; this target has {width}. "
            "Fix: use a drafter built (d3d.train) for this target or one with the same vocabulary and head.")
    if target_name and settings.target and settings.target != target_name:
        return [f"the drafter was trained for target {settings.target!r}, not {target_name!r} (same vocabulary, "
                "so decoding stays lossless; τ may be lower)"]
    return []


# ---------------------------------------------------------------------------- layers


def decoder_layers(model) -> nn.ModuleList:
    return model.base_model.layers


def _set_layers(model, layers: list[nn.Module]) -> None:
    model.base_model.layers = nn.ModuleList(layers)
    for new_idx, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = new_idx  # KV-cache slot
    model.config.num_hidden_layers = len(layers)


def keep_layers(model, keep: list[int]) -> None:
    """Keep only the decoder layers at these (current) indices, in order; updates config.d3d too."""
    layers = list(decoder_layers(model))
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        model.config.layer_types = [types[i] for i in keep]
    _set_layers(model, [layers[i] for i in keep])
    settings = DrafterSettings.of(model, required=False)
    if settings:
        settings.kept_layers = [settings.kept_layers[i] for i in keep]
        settings.attach(model)


@contextlib.contextmanager
def skipping_layers(model, drop: list[int]) -> Iterator[None]:
    """Run the model without some layers, without copying it (pruning's scorer)."""
    layers = list(decoder_layers(model))
    types = getattr(model.config, "layer_types", None)
    keep = [i for i in range(len(layers)) if i not in set(drop)]
    try:
        if types is not None:
            model.config.layer_types = [types[i] for i in keep]
        _set_layers(model, [layers[i] for i in keep])
        yield
    finally:
        if types is not None:
            model.config.layer_types = types
        _set_layers(model, layers)


# ---------------------------------------------------------------------------- draft vocabulary


class DraftHead(nn.Linear):
    """The LM head over a draft vocabulary: row i scores target token d2t[i]. `d2t` (N,) int64,
    sorted ascending (so the first maximum in draft order is the first in target order, as an argmax
    over the full vocabulary picks it), is a buffer: it is saved beside the weight as `lm_head.d2t`.
    Its forward gives N logits, like any Linear; d3d.models.forward.logits_at maps them to target ids."""

    def __init__(self, weight: torch.Tensor, d2t: torch.Tensor):
        bad = torch.nonzero(d2t[1:] <= d2t[:-1]).flatten()  # objective.py's searchsorted needs it increasing
        if len(bad):
            i = int(bad[0])
            raise ConfigError(f"a draft head's map d2t must list target ids strictly increasing (sorted, no id twice), "
                              f"but d2t[{i + 1}]={int(d2t[i + 1])} follows d2t[{i}]={int(d2t[i])}. Fix: build it with "
                              f"d3d.models.drafter.choose_draft_vocab, or pass torch.unique(d2t) (sorted, distinct).")
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
        self.register_buffer(DRAFT_MAP, d2t.to(device=weight.device, dtype=torch.long))


def special_ids(tokenizer, vocab_size: int, mask_id: int | None = None) -> list[int]:
    """The ids every draft vocabulary keeps whatever their count: the tokenizer's special tokens
    (end of turn, end of text, padding) and the mask token, inside the target's vocabulary."""
    ids = {int(i) for i in tokenizer.all_special_ids} | ({mask_id} if mask_id is not None else set())
    return sorted(i for i in ids if 0 <= i < vocab_size)


def check_draft_vocab(n: int | None, tokenizer, vocab_size: int, extra: int = 0) -> None:
    """drafter.draft_vocab against the vocabulary, from the tokenizer and config.json alone (before any
    model or response loads): at least every special id (+ `extra` not yet added: the mask), at most
    the target's vocabulary."""
    if n is None:
        return
    need = len(special_ids(tokenizer, vocab_size)) + extra
    if not need <= n <= vocab_size:
        raise ConfigError(f"drafter.draft_vocab={n}: a draft vocabulary holds the {need} special tokens the loop needs "
                          f"and at most the target's {vocab_size} tokens. Fix: set drafter.draft_vocab between {need} "
                          f"and {vocab_size} (32000 for a Qwen drafter), or null for the full head.")


def choose_draft_vocab(responses, n: int, vocab_size: int, always: list[int]) -> tuple[torch.Tensor, float]:
    """The draft vocabulary: `always` and then the most frequent tokens of `responses` (token-id
    sequences: the response part of each training example), ties to the lower id, n in all, sorted.
    Returns (d2t, the share of the responses' tokens it covers)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in responses:
        t = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(t[(t >= 0) & (t < vocab_size)], minlength=vocab_size)
    rank = counts.clone()
    rank[torch.as_tensor(always, dtype=torch.long)] = torch.iinfo(torch.long).max  # in whatever their count
    order = torch.sort(rank, descending=True, stable=True).indices  # stable: equal counts keep the lower id first
    d2t = order[:n].sort().values
    total = int(counts.sum())
    return d2t, (int(counts[d2t].sum()) / total if total else 1.0)


def coverage(responses, d2t: torch.Tensor) -> float:
    """The share of the responses' tokens that are in the draft vocabulary `d2t`."""
    inside = total = 0
    for ids in responses:
        t = torch.as_tensor(ids, dtype=torch.long)
        inside += int(torch.isin(t, d2t).sum())
        total += len(t)
    return inside / total if total else 1.0


def draft_head_of(model, d2t: torch.Tensor) -> DraftHead:
    """A DraftHead of the model's own head rows d2t (the pretrained rows: tied heads take the embedding's)."""
    full = model.get_output_embeddings().weight
    return DraftHead(full.detach()[d2t.to(full.device)].clone(), d2t)


def attach_draft_head(model, d2t: torch.Tensor) -> None:
    """Replace the LM head by `draft_head_of` its rows d2t, untied from the input embeddings, and say so
    in the settings."""
    model.set_output_embeddings(draft_head_of(model, d2t))
    model.config.tie_word_embeddings = False  # the draft rows are their own weights now
    settings = DrafterSettings.of(model)
    settings.draft_vocab = len(d2t)
    settings.attach(model)


def read_draft_head(path: Path, name: str | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A saved draft head from a drafter folder's safetensors files: (`<name>.weight` (N, d), `<name>.d2t`
    (N,)), None for a tensor that is not there. name: the head module's (None: the one whose d2t is saved)."""
    from safetensors import safe_open

    found = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys = list(fh.keys())
            if name is None:
                name = next((k[: -len(".d2t")] for k in keys if k.endswith("lm_head.d2t")), None)
            for key in (f"{name}.weight", f"{name}.d2t"):
                if name is not None and key in keys:
                    found[key] = fh.get_tensor(key)
    return found.get(f"{name}.weight"), found.get(f"{name}.d2t")


def _load_draft_head(model, path: Path, n: int) -> None:
    """The saved DraftHead onto a model that from_pretrained built with a full-size head (whose mismatched
    rows it could not fill)."""
    name = _head_key(model)
    weight, d2t = read_draft_head(path, name)
    if weight is None or d2t is None or weight.shape[0] != n or d2t.shape != (n,):
        raise ConfigError(f"drafter.checkpoint={path}: its config says a {n}-token draft vocabulary but its weights hold "
                          f"no {name}.weight of {n} rows with its {name}.d2t map. Fix: copy the folder again from where "
                          "d3d.train or d3d.prune wrote it.")
    full = model.get_output_embeddings().weight
    model.set_output_embeddings(DraftHead(weight.to(device=full.device, dtype=full.dtype), d2t))


def _head_key(model) -> str:
    head = model.get_output_embeddings()
    return next(name for name, module in model.named_modules() if module is head)


# ---------------------------------------------------------------------------- building


def _add_mask_token(model, tokenizer, name: str, vocab_size: int) -> int:
    """The mask token id; a new token's embedding row starts at the mean of the real tokens' rows.
    The new id can land inside the embedding matrix (Qwen pads 151,665 tokens to 151,936 rows):
    that padding row was never trained, so it is overwritten just like an appended one."""
    new = name not in tokenizer.get_vocab()
    n_real = len(tokenizer)  # rows that belong to real tokens, before the mask joins them
    if new:
        tokenizer.add_tokens([name], special_tokens=True)
    mask_id = tokenizer.convert_tokens_to_ids(name)
    emb = model.get_input_embeddings()
    if mask_id >= emb.weight.shape[0]:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        emb = model.get_input_embeddings()
    if new:  # start it in the middle of the vocabulary
        with torch.no_grad():
            emb.weight[mask_id] = emb.weight[: min(n_real, vocab_size)].mean(dim=0)
    return mask_id


def drafter_attention(drafter: DrafterSpec, target: ModelSpec) -> str:
    """The drafter's attention backend: its own model's (`drafter.model.attn_implementation`) when
    it names one (init=pretrained), else the target's, which every other init copies. flex_attention
    puts the training step's d3d mask in a BlockMask (d3d.models.forward; GPU only)."""
    return (drafter.model or target).attn_implementation


def _from_target(target_path, spec: DrafterSpec, cache_dir, device, dtype, attn):
    return load_model(target_path, dtype, device, attn), load_tokenizer(target_path)


def _from_pretrained(target_path, spec: DrafterSpec, cache_dir, device, dtype, attn):
    if spec.model is None:
        raise ValueError(f"drafter {spec.name!r}: init=pretrained needs drafter.model (a model config like "
                         "conf/target/*.yaml)")
    path = resolve_model_path(spec.model, cache_dir)
    return load_model(path, dtype, device, attn), load_tokenizer(path)


def _random(target_path, spec: DrafterSpec, cache_dir, device, dtype, attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = copy.deepcopy(AutoConfig.from_pretrained(target_path))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype, device), attn_implementation=attn)
    return model.to(device), load_tokenizer(target_path)


# drafter.init -> (model, tokenizer) before the d3d additions; `target_layers` keeps a subset of the
# target's layers afterwards (drafter.layers). A new initialisation is one function and one line.
INITS = {"target": _from_target, "target_layers": _from_target, "pretrained": _from_pretrained, "random": _random}


def check_draft_vocab_spec(spec: DrafterSpec, target: ModelSpec, cache_dir: str | Path, responses: bool) -> None:
    """drafter.draft_vocab before anything large loads (the tokenizer and config.json only): N in range,
    and responses to choose it from (`responses`: the caller has them; d3d.train does)."""
    if spec.draft_vocab is None or spec.checkpoint:
        return  # a checkpoint carries its own vocabulary
    if not responses:
        raise ConfigError(f"drafter.draft_vocab={spec.draft_vocab}: a draft vocabulary is chosen from the training "
                          "responses, so only d3d.train builds one. Fix: train the drafter (d3d.train) and pass its "
                          "folder as drafter.checkpoint, or set drafter.draft_vocab=null.")
    from transformers import AutoConfig

    target_path = resolve_model_path(target, Path(cache_dir))
    tok = load_tokenizer(target_path)
    vocab = int(AutoConfig.from_pretrained(target_path).vocab_size)
    mask = tok.get_vocab().get(spec.mask_token)  # None: added when the drafter is built
    check_draft_vocab(spec.draft_vocab, tok, vocab, int(mask is None or mask not in special_ids(tok, vocab)))


def build_drafter(spec: DrafterSpec, target: ModelSpec, cache_dir: str | Path, device: str = "cpu",
                  dtype: str | None = "auto", responses=None):
    """A drafter (model, tokenizer) as conf/drafter/*.yaml describes, ready to train. `responses`
    (token-id sequences: the training examples' responses) choose its draft vocabulary when
    drafter.draft_vocab is set."""
    cache_dir = Path(cache_dir)
    attn = drafter_attention(spec, target)
    if spec.checkpoint:
        return SavedDrafter.named(spec.checkpoint, block_attention=spec.block_attention).load(
            spec, target, device=device, dtype=dtype or "auto")
    check_draft_vocab_spec(spec, target, cache_dir, responses is not None)
    target_path = resolve_model_path(target, cache_dir)
    target_tok = load_tokenizer(target_path)
    init = spec.init
    if init not in INITS:
        raise ValueError(f"drafter.init={init!r}: use {', '.join(INITS)}")
    model, tok = INITS[init](target_path, spec, cache_dir, device, dtype, attn)
    vocab_size = model.get_output_embeddings().weight.shape[0]  # logits width the target shares
    check_same_tokenizer(tok, target_tok, DrafterSettings())  # before the mask token is added
    settings = DrafterSettings(
        block_size=spec.block_size,
        vocab_size=vocab_size,
        kept_layers=list(range(model.config.num_hidden_layers)),
        init=init, target=target.name, block_attention=spec.block_attention,
    )
    settings.mask_token_id = _add_mask_token(model, tok, spec.mask_token, settings.vocab_size)
    settings.tokenizer_fingerprint = tokenizer_fingerprint(tok, ignore=(spec.mask_token,))
    settings.attach(model)
    if init == "target_layers":
        if not spec.layers:
            raise ValueError(f"drafter {spec.name!r}: init=target_layers needs drafter.layers (target layer indices)")
        keep_layers(model, list(spec.layers))
    if spec.draft_vocab is not None:
        # checked again against the drafter's own head (init=pretrained: another model of the family)
        mask = settings.mask_token_id
        always = special_ids(tok, settings.vocab_size, mask)
        check_draft_vocab(spec.draft_vocab, tok, settings.vocab_size, len(always) - len(special_ids(tok, settings.vocab_size)))
        d2t, _ = choose_draft_vocab(responses, spec.draft_vocab, settings.vocab_size, always)
        attach_draft_head(model, d2t)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def save_drafter(model, tokenizer, out_dir: str | Path, state_dict: dict | None = None,
                 dtype: str | None = None) -> Path:
    """An ordinary HF folder. `state_dict`: the gathered weights when training sharded them (FSDP,
    ZeRO-3), where the unwrapped module holds only this process's shard. `dtype` (train.save_dtype):
    floating weights cast to it as they are written (bfloat16: half the bytes of fp32, the dtype a
    GPU decodes in), and config.json says so; None keeps the weights' own."""
    out_dir = Path(out_dir)
    if dtype is not None:
        cast = torch_dtype(dtype)
        state = model.state_dict() if state_dict is None else state_dict
        done = {}  # a tied weight is one tensor under two names: cast once, so it stays one
        state_dict = {k: done.setdefault((v.data_ptr(), v.shape), v.to(cast)) if v.is_floating_point() else v
                      for k, v in state.items()}
    model.save_pretrained(out_dir, state_dict=state_dict)
    if dtype is not None:  # save_pretrained writes the module's own dtype
        config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
        (out_dir / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def weights_fingerprint(folder: str | Path) -> str:
    """A hash of a checkpoint's weight files: a result folder names its drafter by path *and* by
    this, so a drafter retrained into the same folder is not mistaken for the one that made them."""
    h = hashlib.sha1()
    for f in sorted(p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- PARD-format folders

# The two public mask ids of Qwen3 drafters (151,936 embedding rows; its tokenizer's 151,669 tokens end
# at 151668): export.json's mask_convention names the one an export's id is.
QWEN3_ROWS = 151936
QWEN3_MASK_IDS = {151669: "SDAR (151669, the first id after Qwen3's tokens)", 151670: "PARD-2 (151670)"}


def mask_convention(mask_id: int, vocab_size: int) -> str | None:
    """Which public Qwen3 convention `mask_id` follows; None for another id or another vocabulary."""
    return QWEN3_MASK_IDS.get(mask_id) if vocab_size == QWEN3_ROWS else None


def pard_mask_id(config: dict) -> tuple[str, int]:
    """named_mask_id of a PARD-format folder's config, refused in one line where it lies outside the
    folder's embedding rows (check_is_drafter asks before anything loads)."""
    key, mask_id = named_mask_id(config)
    if not 0 <= mask_id < int(config.get("vocab_size", 0)):
        raise ConfigError(f"the PARD-format drafter's mask id {mask_id} (config.json's {key}) lies outside its "
                          f"{config.get('vocab_size')} embedding rows. Fix: set {key} to the id it was trained with.")
    return key, mask_id


def pard_settings(config: dict, block_size: int) -> DrafterSettings:
    """The d3d settings of a PARD-format folder (a causal LM trained to draft in parallel, with a mask
    id and no d3d settings; docs/serving.md): causal blocks, its mask id, its own vocabulary (checked
    against the target's where it loads), all its layers, and the block it decodes with, which the
    folder does not say (drafter.block_size)."""
    key, mask_id = pard_mask_id(config)
    return DrafterSettings(block_size=block_size, mask_token_id=mask_id, vocab_size=int(config["vocab_size"]),
                           kept_layers=list(range(int(config["num_hidden_layers"]))), init=f"pard:{key}",
                           block_attention="causal")


def check_is_drafter(path: Path, key: str = "drafter.checkpoint") -> None:
    """A folder whose config.json has no `d3d` settings and no parallel-drafting mask id (MASK_ID_KEYS)
    is a plain model (the target's own folder, say), not a drafter: said in one line with the fix,
    before it loads (it used to be a ValueError traceback). So is a drafter folder with a JSON file
    that does not parse (a copy cut short)."""
    config = saved_config(path)
    if config is None:
        raise ConfigError(f"{key}={path}: its config.json is empty or torn. Fix: pass a whole drafter folder (the "
                          f"final/ of a finished d3d.train or d3d.prune run).")
    if "d3d" not in config and named_mask_id(config) is None:
        raise ConfigError(f"{key}={path} is a plain model (its config.json has no d3d settings), not a d3d drafter. "
                          f"Fix: pass the final/ folder of a d3d.train or d3d.prune run, or a PARD-format drafter (its "
                          f"config.json names a mask id: {', '.join(MASK_ID_KEYS)}), or leave {key} unset to build an "
                          f"untrained drafter from drafter.init.")
    if "d3d" not in config:
        pard_mask_id(config)  # a PARD-format drafter's mask id inside its rows
    torn = torn_json(path)  # a torn tokenizer.json was a tokenizers traceback once the target had loaded
    if torn:
        raise ConfigError(f"{key}={path}: its {torn.name} is empty or torn. Fix: copy that file again from where the "
                          f"drafter was saved (the tokenizer is the target's), or pass a whole drafter folder.")


def check_block_attention(folder, wanted: str, key: str = "drafter.checkpoint") -> None:
    """A drafter decodes with the block rule it was trained with (it rides in its config.d3d, and
    d3d.models.forward reads it there), so a run that asks for the other rule is refused before the
    weights load rather than silently running the saved one."""
    config, settings = saved_config(folder), DrafterSettings.of_folder(folder)
    if settings is not None:
        saved = settings.block_attention
    elif config is not None and named_mask_id(config):
        saved = "causal"  # a PARD-format drafter drafts with causal blocks (pard_settings)
    else:
        return  # not a drafter folder: check_is_drafter says so where it loads
    if saved != wanted:
        raise ConfigError(f"{key}={folder} was trained with drafter.block_attention={saved}, but this run sets "
                          f"{wanted}. Fix: set drafter.block_attention={saved} (a drafter's block rule is its "
                          f"training's), or train a {wanted} drafter.")


def drafter_folder(value, key: str = "drafter.checkpoint") -> Path:
    """A drafter checkpoint the user named, checked before anything loads: a training run folder
    (whose drafter is its final/) or a missing path gets a one-line error with the fix."""
    path = Path(os.path.expanduser(str(value))).resolve()  # d3d.config.resolve_path, without OmegaConf
    if not path.exists():
        raise ConfigError(f"{key}={value}: {path} does not exist. Fix: pass a folder written by d3d.train "
                          f"(<train.out_dir>/final) or d3d.prune (<prune.out_dir>/final).")
    if (path / "config.json").is_file():
        check_is_drafter(path, key)  # not the target's own folder (a plain model)
        return path
    for inner in ("final", "last/drafter"):
        if (path / inner / "config.json").is_file():
            raise ConfigError(f"{key}={value} is a run folder, not a drafter. Fix: {key}={path / 'final'}"
                              + ("" if inner == "final" else " (once the run finishes; or its last/drafter)"))
    raise ConfigError(f"{key}={value}: {path} holds no config.json, so it is not a saved drafter. Fix: pass "
                      f"the final/ folder of a d3d.train or d3d.prune run.")


def load_drafter(path: str | Path, device: str = "cpu", dtype: str | None = "auto",
                 attn_implementation: str | None = "sdpa", block_size: int | None = None):
    """A saved drafter and its tokenizer. A PARD-format folder (no d3d settings, a mask id under one of
    MASK_ID_KEYS) loads as a causal drafter decoding blocks of `block_size` (drafter.block_size: the
    folder does not say), its settings attached as a d3d folder's are."""
    if (Path(path) / "config.json").is_file():  # a plain model folder: one line with the fix, before it loads
        check_is_drafter(Path(path))
    config = saved_config(Path(path))
    if config is not None and "d3d" not in config:
        if block_size is None:
            raise ConfigError(f"{path} is a PARD-format drafter (no d3d settings, so no block of its own): only d3d.eval "
                              f"and d3d.bench decode one, with drafter.block_size as its block. Fix: pass it to one of "
                              f"those, or pass a d3d drafter folder here.")
        settings = pard_settings(config, block_size)
        model = load_model(str(path), dtype, device, attn_implementation)
        settings.attach(model)
        log.info("PARD-format drafter %s: mask id %d from config.json's %s (read in vLLM's order: %s), causal blocks "
                 "of %d", path, settings.mask_token_id, settings.init.partition(":")[2], ", ".join(MASK_ID_KEYS),
                 block_size)
        return model, load_tokenizer(str(path))
    n = _saved_draft_vocab(Path(path))
    if n is None:
        model = load_model(str(path), dtype, device, attn_implementation)
    else:  # from_pretrained builds the full head the config's vocabulary implies; the saved one replaces it
        from transformers.utils import logging as hf_logging

        was = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report calls the expected head mismatch a problem
        try:
            model = load_model(str(path), dtype, device, attn_implementation, ignore_mismatched_sizes=True)
        finally:
            hf_logging.set_verbosity(was)
        _load_draft_head(model, Path(path), n)
    DrafterSettings.of(model)  # fails clearly on a non-drafter folder
    return model, load_tokenizer(str(path))


def _saved_draft_vocab(path: Path) -> int | None:
    settings = DrafterSettings.of_folder(path)
    return settings.draft_vocab if settings is not None else None


# ---------------------------------------------------------------------------- the handle on a trained drafter


@dataclass(frozen=True)
class SavedDrafter:
    """A trained drafter a job names (drafter.checkpoint, eval.also_drafters.<label>, a script's
    --drafter): its folder and the key that named it, which every error says. Read without loading
    (`fingerprint`, `resume_record`; its settings: DrafterSettings.of_folder) and loaded one way for
    every job (`load`)."""

    folder: Path
    key: str = "drafter.checkpoint"

    @classmethod
    def named(cls, value, key: str = "drafter.checkpoint", block_attention: str | None = None) -> "SavedDrafter":
        """The folder `value` names, checked before anything loads (a missing path, a run folder, a plain
        model, a torn config: drafter_folder); with `block_attention` (the run's drafter.block_attention)
        also the block rule it was trained with (check_block_attention)."""
        folder = drafter_folder(value, key)
        if block_attention is not None:
            check_block_attention(folder, block_attention, key)
        return cls(folder, key)

    def fingerprint(self) -> str:
        return weights_fingerprint(self.folder)

    def resume_record(self) -> dict:
        """How a result folder names the drafter its rows came from: its path *and* its weights, so a
        drafter retrained into the same folder is not mistaken for the one that made them."""
        return {"drafter": str(self.folder), "drafter_weights": self.fingerprint()}

    def load(self, spec: DrafterSpec | None = None, target_spec: ModelSpec | None = None, *, target=None,
             target_tok=None, device: str | None = None, dtype: str | None = None, decoding: bool = False,
             warn: Callable[[str], None] | None = None):
        """(model, tokenizer). `device`: None = drafter.device beside `target` (`same`: the target's input
        device), cpu without one. `dtype`: None = the target's (target_spec.dtype). The attention backend
        the specs give (drafter_attention; sdpa without them). `decoding` (d3d.eval, d3d.bench): a PARD-format
        folder loads too, drafting blocks of drafter.block_size. With `target` and `target_tok` its fit to
        the target is checked (check_fits_target): a mismatch refused, anything else worth saying passed to
        `warn` (the log by default) after the key that named it."""
        if device is None:
            device = drafter_device(spec.device if spec is not None else "same", target) if target is not None else "cpu"
        if dtype is None:
            dtype = target_spec.dtype if target_spec is not None else "auto"
        attn = drafter_attention(spec, target_spec) if spec is not None and target_spec is not None else "sdpa"
        model, tok = load_drafter(self.folder, device=device, dtype=dtype, attn_implementation=attn,
                                  block_size=spec.block_size if decoding and spec is not None else None)
        if target is not None and target_tok is not None:
            for warning in check_fits_target(model, tok, target, target_tok, target_spec.name if target_spec else None):
                (warn or log.warning)(f"{self.key}: {warning}")
        return model, tok


@contextlib.contextmanager
def block_attention_as(model, rule: str) -> Iterator[None]:
    """The drafter drafting with `rule` blocks for the duration (d3d.models.forward reads the rule from
    its settings for every pass), its own rule back afterwards: how an engine that drafts otherwise
    (vLLM's causal parallel-draft pass, d3d.serving) sees it."""
    settings = DrafterSettings.of(model)
    trained = settings.block_attention
    settings.block_attention = rule
    settings.attach(model)
    try:
        yield
    finally:
        settings.block_attention = trained
        settings.attach(model)


def as_deployed(model):
    """The drafter in the dtype it will decode in (bf16 on a GPU): itself, or a copy for inference
    (no parameter takes a gradient) cast one parameter at a time. A whole deepcopy cast afterwards
    held a second fp32 copy for a moment: 8 bytes a parameter beside the model, 61 GiB at 8B."""
    param = next(model.parameters())
    deployed = torch_dtype("auto", param.device)
    if deployed == param.dtype:
        return model
    # deepcopy takes each parameter from the memo (a tied weight is one entry, so it stays tied)
    memo = {id(p): nn.Parameter(p.detach().to(deployed), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo).to(deployed)
