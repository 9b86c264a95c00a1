"""What one decoding pass costs in memory, estimated from the models' configs before any weight loads.

A method's widest pass (Method.widest: a tray pass is its Drafts' budget, B·((C−1)·F + 2) tokens for a chain)
runs q new tokens against kv keys, its cached prefix plus itself. Nothing in DecodeConfig bounds q
by what the device holds: `decode.block_size=256 decode.C=256` on the tiny smoke target built a
17 GB boolean mask, and F above the vocabulary failed in `topk` after the models had loaded. So the
cost is estimated here from config.json (layers, heads, head size, vocabulary, dtype) and refused
in one line when it cannot fit (check_decode_cost, below, calls this for eval, the pipeline's up-front
check and the bench scripts).

Per pass of q tokens over kv keys at batch b, bytes:
- mask: b·q·kv booleans (models/masks.py builds it whole); SDPA takes it as a float bias of the
  model's dtype, one more b·q·kv·dtype (measured on this CPU: q = kv = 4096, 4 heads, fp32: 59 MB
  for SDPA against the 64 MB this predicts) and keeps the scores in tiles; eager attention
  materialises the scores and their softmax, 2·b·heads·q·kv·dtype;
- KV cache: 2·layers·b·kv_heads·head_dim·kv·dtype;
- activations of one layer: b·q·(4·hidden + 3·intermediate)·dtype (q, k, v, o and the MLP's gate, up
  and product; layers run one after another);
- logits: b·q·head·(dtype + 4): the LM head's output and the float copy the passes return, `head`
  the head's rows (a drafter's draft vocabulary, else the vocabulary).
The estimate leaves out the prompt (a lower bound: kv is q plus the new tokens), so a refusal is a
pass that cannot fit, not a guess that might.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import AutoConfig

from d3d.utils.io import resolve_path
from d3d.decoding.config import DecodeConfig
from d3d.decoding.methods import method_row
from d3d.errors import ConfigError
from d3d.models.drafter import check_is_drafter, drafter_attention
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.target import check_device, map_devices, pick_device, resolve_model_path, torch_dtype
from d3d.specs import DrafterSpec, ModelSpec, TargetSpec

GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model's config.json that its passes' memory depends on."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool
    dtype_bytes: int  # of the dtype the model will be loaded in
    eager: bool  # eager attention materialises the scores (SDPA and flex work in tiles)
    head: int | None = None  # LM head rows when not one per token (a drafter's draft vocabulary, untied)

    @classmethod
    def of_config(cls, config, dtype_bytes: int, attn_implementation: str | None) -> "ModelShape":
        """From a transformers PretrainedConfig (AutoConfig.from_pretrained reads config.json only)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        saved = DrafterSettings.of(config, required=False)  # a drafter's: its draft vocabulary's rows
        draft = saved.draft_vocab if saved is not None else None
        return cls(layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                   vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)),
                   dtype_bytes=dtype_bytes, eager=attn_implementation == "eager", head=draft)

    def with_layers(self, layers: int) -> "ModelShape":
        return ModelShape(**{**self.__dict__, "layers": layers})

    def weight_bytes(self) -> int:
        """Embeddings (and an untied head), attention projections and the MLP of every layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.hidden * (self.vocab + (0 if self.tied else self.head_rows))
        return (embed + self.layers * (attn + mlp)) * self.dtype_bytes

    def pass_bytes(self, batch: int, q: int, kv: int) -> dict[str, int]:
        """The terms of the module docstring for one pass of q tokens over kv keys."""
        d = self.dtype_bytes
        scores = batch * q * kv * (1 + d) + (2 * batch * self.heads * q * kv * d if self.eager else 0)
        return {"attention": scores,
                "kv_cache": 2 * self.layers * batch * self.kv_heads * self.head_dim * kv * d,
                "activations": batch * q * (4 * self.hidden + 3 * self.intermediate) * d,
                "logits": batch * q * self.head_rows * (d + 4)}

    @property
    def head_rows(self) -> int:
        return self.head or self.vocab


def memory_bytes(device: str) -> int:
    """What the device holds: a GPU's memory, or on a CPU the machine's RAM (its cgroup's limit when lower)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


@dataclass(frozen=True)
class Placement:
    """Where each model's bytes go, and what each device holds: the target's weights and KV cache
    split over its devices by `target` (device -> share of its layers, summing to 1: one device, or
    target.device_map), the drafter whole on `drafter`. A pass's transient terms (attention, one
    layer's activations) arise on every device that runs a layer; the logits where the last layer is."""

    target: dict[str, float]
    drafter: str
    memory: dict[str, int]

    @classmethod
    def one(cls, device: str, memory: int) -> "Placement":
        return cls({device: 1.0}, device, {device: memory})


def device_needs(cfg, method, shapes: dict[str, ModelShape], batch: int, placement: Placement) -> dict:
    """Bytes each device needs for the method's widest passes, per model: {device: {model: bytes}}."""
    needs: dict = {}
    for model, q in method.widest(cfg).items():
        if model not in shapes:  # a model the run does not load
            continue
        terms = shapes[model].pass_bytes(batch, q, q + cfg.max_new_tokens)  # the prompt left out: a lower bound
        spread = placement.target if model == "target" else {placement.drafter: 1.0}
        last = list(spread)[-1]
        for device, share in spread.items():
            held = share * (shapes[model].weight_bytes() + terms["kv_cache"]) + terms["attention"] + terms["activations"]
            held += terms["logits"] if device == last else 0
            needs.setdefault(device, {})[model] = needs.get(device, {}).get(model, 0) + int(held)
    return needs


def check_fits(cfg, method, name: str, shapes: dict[str, ModelShape], batch: int, memory: int,
               device: str, where: str = "decode", placement: Placement | None = None) -> None:
    """Refuse `cfg` (the DecodeConfig of the run's method `name`, of row `method`; its keys named
    `where`.<key>, as DecodeConfig names them) when its widest passes cannot fit. Counted per device
    (`placement`; default: both models on `device`, which holds `memory`): the weights each device
    holds and each model's widest pass there (an overlapped tray pass runs while the target
    verifies). A refusal says which placement would fit (a drafter on a GPU of its own, a target
    spread by target.device_map). What no memory makes work with this vocabulary (the row's
    check_vocab: a chain's F, a tree's node count) is said first."""
    # what the drafter can draft: its head's rows (a draft vocabulary: the rest have q = 0)
    method.check_vocab(cfg, shapes["drafter"].head_rows if "drafter" in shapes else shapes["target"].vocab, name, where)
    placement = placement or Placement.one(device, memory)
    needs = device_needs(cfg, method, shapes, batch, placement)
    over = [d for d, per in needs.items() if sum(per.values()) > placement.memory[d]]
    if not over:
        return
    dev = over[0]
    widest = None
    for model, q in method.widest(cfg).items():
        if model in shapes and model in needs[dev] and (widest is None or q * (q + cfg.max_new_tokens) > widest[1] * widest[2]):
            widest = (model, q, q + cfg.max_new_tokens)
    model, q, kv = widest
    terms = shapes[model].pass_bytes(batch, q, kv)
    parts = ", ".join(f"{k} {b / GIB:.1f}" for k, b in terms.items())
    setting = " ".join(f"{where}.{k}={getattr(cfg, k)}" for k in method.sized_by(cfg))
    fewer = " or fewer requests at once (eval.concurrency)" if batch > 1 else ""
    raise ConfigError(
        f"{setting} (method {name}, batch {batch}): the {model}'s widest pass runs {q} tokens over {kv} keys "
        f"and needs about {sum(needs[dev].values()) / GIB:.1f} GiB with the weights ({parts} GiB), more than the "
        f"{placement.memory[dev] / GIB:.1f} GiB of this device ({dev}). Fix: {method.narrower(cfg, where)}{fewer}"
        f"{placement_hint(cfg, method, shapes, batch, placement.memory[dev])}.")


def placement_hint(cfg, method, shapes, batch: int, memory: int) -> str:
    """Which placement of the two models fits devices of `memory` bytes, said after a refusal: the
    drafter on a GPU of its own, and the target over as many GPUs as its share needs (an estimate:
    accelerate's balanced placement spreads the layers evenly)."""
    apart = device_needs(cfg, method, shapes, batch, Placement({"target": 1.0}, "drafter", {}))
    target, drafter = apart["target"]["target"], apart.get("drafter", {}).get("drafter")
    if drafter is not None and drafter > memory:
        return ""  # the drafter alone does not fit one such device: only a narrower pass helps
    mine = f"put the drafter on a GPU of its own (drafter.device=cuda:1: it needs {drafter / GIB:.1f} GiB" if drafter else ""
    if target <= memory:
        return f", or {mine}, the target alone {target / GIB:.1f} GiB)" if mine else ""
    for k in range(2, 65):
        spread = device_needs(cfg, method, {"target": shapes["target"]}, batch,
                              Placement({f"gpu{i}": 1 / k for i in range(k)}, "", {}))
        if max(per["target"] for per in spread.values()) <= memory:
            return (f", or spread the target over {k} GPUs (target.device_map=auto: it needs {target / GIB:.1f} GiB "
                    f"on one)" + (f" and {mine})" if mine else ""))
    return ""


def check_loaded(cfg, method, target, drafter, batch: int) -> None:
    """check_fits for models already loaded (SpecGenerator: the Python API and the scripts that build one
    without check_decode_cost refuse what the CLI refuses): the same estimate, from the
    models' configs and their loaded dtype and attention, for a batch of `batch` requests, counted on
    the devices they are on (the target's share of each by its parameters' bytes). A budget left
    to the measured choice (a None tray knob) is refused: d3d.eval chooses it before it builds one."""
    if method.trays and cfg.auto_budget:
        knobs = ", ".join(method.drafts.tray_grid[0])
        raise ConfigError(f"decode.{knobs.split(',')[0]}=None: the tray budget ({knobs}) is left to the measured choice, "
                          f"which d3d.eval makes once the models load (d3d.decoding.budget). Fix: give {knobs} numbers, "
                          f"e.g. the choice eval's run.json records (auto_budget).")
    shapes = {}
    for model_name, model in (("target", target), ("drafter", drafter)):
        if model is not None:
            shapes[model_name] = ModelShape.of_config(model.config, next(model.parameters()).dtype.itemsize,
                                                      getattr(model.config, "_attn_implementation", None))
    held: dict[str, int] = {}
    for p in target.parameters():
        held[str(p.device)] = held.get(str(p.device), 0) + p.numel()
    shares = {d: n / sum(held.values()) for d, n in held.items()}
    drafter_at = str(next(drafter.parameters()).device) if drafter is not None else next(iter(shares))
    devices = [*shares, drafter_at]
    placement = Placement(shares, drafter_at, {d: memory_bytes(d) for d in devices})
    check_fits(cfg, method, cfg.method, shapes, batch, 0, devices[0], placement=placement)


# ---------------------------------------------------------------------------- before any weight loads


def candidates(cfg: DecodeConfig) -> list[DecodeConfig]:
    """The configs a method may run: cfg itself when its budget is given, else one per setting of its
    Drafts' tray grid (what the measured choice, d3d.decoding.budget, picks from)."""
    row = method_row(cfg.method)
    if not (row.trays and cfg.auto_budget):
        return [cfg]
    return [replace(cfg, **setting) for setting in row.drafts.tray_grid]


def check_decode_cost(methods: dict[str, DecodeConfig], target: TargetSpec, drafter: DrafterSpec | None,
                      cache_dir: str | Path, batch: int = 1) -> dict[str, list[dict]]:
    """Every method's widest pass against the device's memory, and decode.F against the vocabulary,
    from the models' config.json only: a pass that cannot fit is refused in one
    line before any weight loads. The one check of eval, the pipeline's up-front check and the bench
    scripts. `methods` maps the name each was bound under to its config; `batch` = the most requests
    decoded together (eval.concurrency). A method whose budget is left to the measured choice is
    checked at each setting it may choose: returns {name: the settings that fit}, the grid the choice
    is made from; none fitting is refused, said for the narrowest."""
    target_path = resolve_model_path(target, cache_dir)
    where = placement(target, drafter, _shape(target_path, 1, None).layers)  # devices named but absent: refused here
    device = next(iter(where.target))
    width = torch_dtype(target.dtype, device).itemsize  # eval loads the drafter in the target's dtype too
    shapes = {"target": _shape(target_path, width, target.attn_implementation)}
    if drafter is not None and any(method_row(dc.method).needs_drafter for dc in methods.values()):
        shapes["drafter"] = _drafter_shape(drafter, target, target_path, shapes["target"], cache_dir, width)
        _check_logits_width(drafter, target, shapes["target"].vocab)
    fitting = {}
    for name, dc in methods.items():
        row = method_row(dc.method)
        if len(options := candidates(dc)) == 1:
            check_fits(dc, row, name, shapes, batch, 0, device, placement=where)
            continue
        fitting[name], refusals = [], []
        for option in options:
            try:
                check_fits(option, row, name, shapes, batch, 0, device, placement=where)
                fitting[name].append({k: getattr(option, k) for k in row.drafts.tray_grid[0]})
            except ConfigError as err:
                refusals.append((row.budget(option), err))
        if not fitting[name]:
            raise min(refusals, key=lambda r: r[0])[1]
    # the widest verify block: with it, even a one-token prompt must leave room in the context, else every
    # request of that method would be skipped after the models loaded
    context = _context(target_path)
    block, name, dc = max(((method_row(dc.method).block_size(dc), name, dc) for name, dc in methods.items()),
                          default=(0, None, None))
    if context and dc is not None and 1 + dc.max_new_tokens + block > context:
        raise ConfigError(f"eval.max_new_tokens={dc.max_new_tokens}: with a one-token prompt and a block of {block} "
                          f"(method {name}) that passes the target's context of {context} tokens, so every request "
                          f"would be skipped. Fix: set eval.max_new_tokens={max(1, context - block - 1)} or less.")
    return fitting


def placement(target: TargetSpec, drafter: DrafterSpec | None, layers: int):
    """Where d3d.eval will put the models (a Placement): the target on target.device,
    or over target.device_map's devices (`auto`: its layers evenly over the visible GPUs, as
    accelerate's balanced placement; a map: each device's share of the `layers` decoder layers, by
    the longest module name that holds `model.layers.<i>`), the drafter on drafter.device (`same`:
    the target's first device), each device with the memory it has."""
    m = target.device_map
    if m is None:
        shares = {str(pick_device(target.device)): 1.0}
    else:
        devices = [str(check_device(str(d), "target.device_map")) for d in map_devices(m)]
        if m == "auto":
            shares = {d: 1 / len(devices) for d in devices}
        else:
            named = {k: str(map_devices({k: v})[0]) for k, v in m.items()}
            owner = []
            for i in range(layers):
                layer = f"model.layers.{i}"
                keys = [k for k in named if k in ("", layer) or layer.startswith(k + ".")]
                owner.append(named[max(keys, key=len)] if keys else devices[-1])
            shares = {d: owner.count(d) / layers for d in devices if owner.count(d)}
    first = next(iter(shares))
    at = first if drafter is None or drafter.device == "same" else str(check_device(drafter.device, "drafter.device"))
    return Placement(shares, at, {d: memory_bytes(d) for d in [*shares, at]})


def _check_logits_width(drafter: DrafterSpec, target: ModelSpec, vocab: int) -> None:
    """A drafter checkpoint built for another vocabulary, said from the two config.json files before
    any weight loads (d3d.models.drafter.check_fits_target says it again, with the tokenizers, after)."""
    saved = DrafterSettings.of_folder(resolve_path(drafter.checkpoint)) if drafter.checkpoint else None
    if saved is None:
        return  # no checkpoint, or not a drafter's config: said where it loads (check_is_drafter)
    built_for = saved.vocab_size
    if built_for != vocab:
        raise ConfigError(f"drafter.checkpoint={drafter.checkpoint}: the drafter was built for a target with {built_for} "
                          f"logits; target {target.name} has {vocab}. Fix: use a drafter built (d3d.train) for this "
                          f"target, or one with the same vocabulary and head.")


def _context(path: str) -> int | None:
    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


def _shape(path: str, width: int, attn: str | None):
    return ModelShape.of_config(AutoConfig.from_pretrained(path), width, attn)


def _drafter_shape(drafter: DrafterSpec, target: ModelSpec, target_path: str, target_shape, cache_dir, width: int):
    """The drafter's shape: its checkpoint's config.json, or (a drafter still to be trained, as in the
    pipeline's up-front check) what its init builds: the target's, a subset of its layers, or the
    pretrained model's."""
    attn = drafter_attention(drafter, target)
    folder = resolve_path(drafter.checkpoint) if drafter.checkpoint else None
    if folder is not None and (folder / "config.json").is_file():
        # a folder from another project (a plain model) was sized as a drafter and refused for the
        # memory its shape would take ("lower decode.block_size"): what it is comes first
        check_is_drafter(folder)
        return _shape(str(folder), width, attn)
    if drafter.init == "pretrained" and drafter.model is not None:
        shape = _shape(resolve_model_path(drafter.model, cache_dir), width, attn)
    elif drafter.init == "target_layers" and drafter.layers:
        shape = target_shape.with_layers(len(drafter.layers))
    else:
        shape = target_shape
    # a draft vocabulary: an untied head of that many rows (d3d.models.drafter.attach_draft_head)
    return replace(shape, head=drafter.draft_vocab, tied=False) if drafter.draft_vocab else shape
