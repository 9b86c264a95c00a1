"""Model resolution: tiny models, GGUF conversion (its errors, reached before any model loads, are in
tests/unit/test_models.py)."""

from __future__ import annotations

import time

import pytest

from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.settings import bind_config
from tests.conftest import compose


def test_tiny_model_is_deterministic(tmp_path):
    cfg = bind_config(compose("generate", ["target=tiny_random"]), "generate").target
    a = resolve_model_path(cfg, tmp_path / "a")
    b = resolve_model_path(cfg, tmp_path / "b")
    ma, mb = load_model(a, "float32", "cpu"), load_model(b, "float32", "cpu")
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and (pa == pb).all()
    tok = load_tokenizer(a)
    text = "Ünïcode ✓ and code: def f(x): return x**2\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text



def test_random_models_are_seeded_and_the_tiny_pair_is_one_model_in_every_dtype():
    """d3d.models.random_models: a shape and a seed fix the weights (another seed changes them), and
    tiny_pair's bf16 target is its fp32 target rounded, as its CUDA copy is its CPU copy moved: the
    race and equality checks compare runs of one model, never of two inits."""
    import torch

    from d3d.models.random_models import random_model, tiny_pair

    def weights(m):
        return {k: v.float() for k, v in m.state_dict().items()}

    a, b, c = (weights(random_model("toy_drafter", seed=s)) for s in (3, 3, 4))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    (t32, d32), (t16, _) = tiny_pair("cpu", torch.float32), tiny_pair("cpu", torch.bfloat16)
    for k, v in t16.state_dict().items():  # (the drafter's noise is drawn in its own dtype)
        assert v.dtype == torch.bfloat16 and torch.equal(v, t32.state_dict()[k].to(torch.bfloat16)), k
    assert not torch.equal(t32.lm_head.weight, d32.lm_head.weight)  # the drafter is perturbed
    assert d32.config.d3d["mask_token_id"] == 255 and d32.config.d3d["block_size"] == 4

@pytest.mark.slow
def test_smollm2_gguf_converts_and_reloads_fast(cache_dir):
    """The real CPU default target: GGUF from PyPI -> HF folder -> reload in seconds, chat works."""
    import torch

    from d3d.data.chat import chat_prompt_ids

    cfg = bind_config(compose("generate"), "generate").target
    path = resolve_model_path(cfg, cache_dir)  # converts once (~40 s), then cached
    start = time.time()
    tok, model = load_tokenizer(path), load_model(path, "bfloat16", "cpu")
    assert time.time() - start < 20
    assert model.config.num_hidden_layers == 30 and model.config.model_type == "llama"
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "What is 2+3?"}])
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, len(ids):])
