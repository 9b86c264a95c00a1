"""What one decoding pass costs in memory, estimated from the models' configs before any weight loads.

A method's widest pass (Method.widest: a tray pass is its Drafts' budget, B·((C−1)·F + 2) tokens for a chain)
runs q new tokens against kv keys, its cached prefix plus itself. Nothing in DecodeConfig bounds q
by what the device holds: `decode.block_size=256 decode.C=256` on the tiny smoke target built a
17 GB boolean mask, and F above the vocabulary failed in `topk` after the models had loaded. So the
cost is estimated here from config.json (layers, heads, head size, vocabulary, dtype) and refused
in one line when it cannot fit (d3d.settings.check_decode_cost calls this for eval, the pipeline's
up-front check and the bench scripts).

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
from dataclasses import dataclass

from d3d.errors import ConfigError

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
        draft = (getattr(config, "d3d", None) or {}).get("draft_vocab")
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
    method.check_vocab(cfg, shapes["target"].vocab, name, where)
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
    without d3d.settings.check_decode_cost refuse what the CLI refuses): the same estimate, from the
    models' configs and their loaded dtype and attention, for a batch of `batch` requests, counted on
    the devices they are on (the target's share of each by its parameters' bytes)."""
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
