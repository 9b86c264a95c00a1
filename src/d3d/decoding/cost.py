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
- logits: b·q·vocab·(dtype + 4): the LM head's output and the float copy the passes return.
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

    @classmethod
    def of_config(cls, config, dtype_bytes: int, attn_implementation: str | None) -> "ModelShape":
        """From a transformers PretrainedConfig (AutoConfig.from_pretrained reads config.json only)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                   vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)),
                   dtype_bytes=dtype_bytes, eager=attn_implementation == "eager")

    def with_layers(self, layers: int) -> "ModelShape":
        return ModelShape(**{**self.__dict__, "layers": layers})

    def weight_bytes(self) -> int:
        """Embeddings (and an untied head), attention projections and the MLP of every layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return (embed + self.layers * (attn + mlp)) * self.dtype_bytes

    def pass_bytes(self, batch: int, q: int, kv: int) -> dict[str, int]:
        """The terms of the module docstring for one pass of q tokens over kv keys."""
        d = self.dtype_bytes
        scores = batch * q * kv * (1 + d) + (2 * batch * self.heads * q * kv * d if self.eager else 0)
        return {"attention": scores,
                "kv_cache": 2 * self.layers * batch * self.kv_heads * self.head_dim * kv * d,
                "activations": batch * q * (4 * self.hidden + 3 * self.intermediate) * d,
                "logits": batch * q * self.vocab * (d + 4)}


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


def check_fits(cfg, method, name: str, shapes: dict[str, ModelShape], batch: int, memory: int,
               device: str, where: str = "decode") -> None:
    """Refuse `cfg` (the DecodeConfig of the run's method `name`, of row `method`; its keys named
    `where`.<key>, as DecodeConfig names them) when its widest passes cannot fit in `memory`. The weights of both models and each one's widest pass (method.widest) must fit
    together (an overlapped tray pass runs while the target verifies). What no memory makes work with
    this vocabulary (the row's check_vocab: a chain's F, a tree's node count) is said first."""
    method.check_vocab(cfg, shapes["target"].vocab, name, where)
    need, widest = 0, None
    for model, q in method.widest(cfg).items():
        if model not in shapes:  # a model the run does not load
            continue
        kv = q + cfg.max_new_tokens  # the prompt left out: a lower bound
        terms = shapes[model].pass_bytes(batch, q, kv)
        need += shapes[model].weight_bytes() + sum(terms.values())
        if widest is None or q * kv > widest[1] * widest[2]:
            widest = (model, q, kv, terms)
    if need <= memory:
        return
    model, q, kv, terms = widest
    parts = ", ".join(f"{k} {b / GIB:.1f}" for k, b in terms.items())
    setting = " ".join(f"{where}.{k}={getattr(cfg, k)}" for k in method.sized_by(cfg))
    fewer = " or fewer requests at once (eval.concurrency)" if batch > 1 else ""
    raise ConfigError(
        f"{setting} (method {name}, batch {batch}): the {model}'s widest pass runs {q} tokens over {kv} keys "
        f"and needs about {need / GIB:.1f} GiB with the weights ({parts} GiB), more than the {memory / GIB:.1f} GiB "
        f"of this device ({device}). Fix: {method.narrower(cfg, where)}{fewer}.")


def check_loaded(cfg, method, target, drafter, batch: int) -> None:
    """check_fits for models already loaded (SpecGenerator: the Python API and the scripts that build one
    without d3d.settings.check_decode_cost refuse what the CLI refuses): the same estimate, from the
    models' configs and their loaded dtype and attention, for a batch of `batch` requests."""
    device = next(target.parameters()).device
    shapes = {}
    for model_name, model in (("target", target), ("drafter", drafter)):
        if model is not None:
            shapes[model_name] = ModelShape.of_config(model.config, next(model.parameters()).dtype.itemsize,
                                                      getattr(model.config, "_attn_implementation", None))
    check_fits(cfg, method, cfg.method, shapes, batch, memory_bytes(str(device)), str(device))
