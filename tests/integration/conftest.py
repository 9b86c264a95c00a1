"""Fixtures and helpers that several integration modules share: the tiny decoding pair (`models`)
with its prompts and transformers' greedy reference, and a tiny drafter with lively weights.
Imported by pytest, and on the GPU machines too: nothing here may import Hydra or OmegaConf at
module level (tests/gpu_machine.py)."""

from __future__ import annotations

import pytest
import torch

from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.models.drafter import build_drafter
from tests.conftest import compose


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state; a test that picks another precision resets it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target with lively random weights and a drafter copied from it, slightly perturbed."""
    from d3d.settings import bind_config  # imports OmegaConf: not at module level (see above)

    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.block_size=6"]), "train")
    path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    tok = load_tokenizer(path)
    target = load_model(path, "float32", "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    out = tmp_path_factory.mktemp("tgt")
    target.save_pretrained(out)
    tok.save_pretrained(out)
    cfg.target.tiny = None
    cfg.target.path = str(out)
    drafter, _ = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return target, drafter, tok


@pytest.fixture(scope="module")
def causal_models(models):
    """The `models` pair with the same drafter weights saved as drafter.block_attention=causal."""
    import copy

    from d3d.models.drafter_settings import DrafterSettings

    target, drafter, tok = models
    causal = copy.deepcopy(drafter)
    settings = DrafterSettings.of(causal)
    settings.block_attention = "causal"
    settings.attach(causal)
    return target, causal, tok


PROMPTS = ["Hello there, how are you?", "2+2=", "def f(x):\n    return", "Once upon a time"]


def two_token_tv(target, prompt: list[int], sampling, token_ids: list[list[int]]) -> float:
    """Total variation between the sampled pairs (x1, x2) and the target's exact joint law under
    `sampling` (d3d.decoding.verify.Sampling), computed by brute force over the law's support; a pair
    outside the support fails at once (a draft accepted where the target gives it zero mass)."""
    from d3d.decoding.verify import probs

    with torch.no_grad():
        p1 = probs(target(torch.tensor([prompt])).logits[0, -1], sampling)
        exact = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            p2 = probs(target(torch.tensor([prompt + [x1]])).logits[0, -1], sampling)
            for x2 in torch.nonzero(p2).flatten().tolist():
                exact[(x1, x2)] = (p1[x1] * p2[x2]).item()
    counts: dict = {}
    for t in token_ids:
        counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    assert set(counts) <= set(exact), set(counts) - set(exact)
    n = len(token_ids)
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items())


def reference(target, tok, prompt_ids, n, eos):
    out = target.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def tiny_drafter(tmp_path, arch="llama", layers=2, block=4, init="target", rule="bidirectional"):
    from d3d.settings import bind_config

    cfg = bind_config(compose("train", ["+experiment=smoke", f"drafter.block_size={block}", f"drafter.init={init}",
                                        f"drafter.block_attention={rule}",
                                        f"target.tiny.model_type={arch}", f"target.tiny.num_hidden_layers={layers}",
                                        f"target.name=tiny_{arch}_{layers}"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():  # random weights, so the test would notice any mixing of positions
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval(), tok, cfg


def block_drafts(model, ids: list[int], s) -> list[int]:
    """The drafter's greedy drafts of one block anchored on the last token of `ids` (a cached
    prefix, then the block), as a decoding round makes them: for building responses a drafter likes."""
    from transformers import DynamicCache

    from d3d.models.forward import hidden_states, logits_at
    from d3d.models.masks import block_layout, clean_layout

    a = len(ids) - 1
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        hidden_states(model, torch.tensor([ids[:a]]), clean_layout(a), cache=cache)
        h = hidden_states(model, torch.tensor([[ids[a]] + [s.mask_token_id] * (s.block_size - 1)]),
                          block_layout(torch.tensor([[a]]), s.block_size), cache=cache, cache_len=a)
    return logits_at(model, h[0], s.vocab_size).argmax(-1).tolist()
