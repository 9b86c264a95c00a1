"""Drafter: contract 3 (training forward == inference forward), save/load, tokenizer checks."""

from __future__ import annotations

import pytest
import torch

from d3d.estimator import match_lengths
from d3d.models.drafter import (
    TokenizerMismatchError, build_drafter, keep_layers, load_drafter, save_drafter, skipping_layers,
)
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout
from d3d.objective import Example, ObjectiveConfig, pack
from d3d.training import D3DTrainingStep
from d3d.settings import bind_config
from tests.conftest import compose
from tests.integration.conftest import tiny_drafter


@pytest.mark.parametrize("rule", ["bidirectional", "causal"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_contract3_training_forward_equals_inference_forward(arch, rule, tmp_path):
    """For either drafter.block_attention; a causal block's logits are also those of a plain causal
    pass over [prefix, anchor, MASK ...] (what an engine's parallel draft runs), a bidirectional one's not."""
    model, tok, _ = tiny_drafter(tmp_path, arch, rule=rule)
    s = DrafterSettings.of(model)
    B = s.block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (40,), generator=g).tolist()
    ex = Example(ids, prompt_len=12)
    anchors = torch.tensor([11, 15, 20, 33, 38])
    batch = pack([ex], ObjectiveConfig.shipped(B, anchors_per_seq=5), s.mask_token_id, 0, g, [anchors])
    with torch.no_grad():
        # The training path proper: the module d3d.train prepares (mask built where the model is).
        h = D3DTrainingStep(model, s.vocab_size, ar_weight=1.0).hidden(batch)[0]
        train_logits = logits_at(model, h[len(ids):].reshape(len(anchors), B, -1), s.vocab_size)
        from transformers import DynamicCache

        for i, a in enumerate(anchors.tolist()):
            # Inference path: the committed prefix x_0..x_{a-1} in the KV cache, then the block.
            cache = DynamicCache(config=model.config)
            hidden_states(model, torch.tensor([ids[:a]]), clean_layout(a), cache=cache)
            block = torch.tensor([[ids[a]] + [s.mask_token_id] * (B - 1)])
            hb = hidden_states(model, block, block_layout(torch.tensor([[a]]), B), cache=cache, cache_len=a)
            infer = logits_at(model, hb[0], s.vocab_size)
            torch.testing.assert_close(train_logits[i], infer, atol=2e-5, rtol=1e-4)
            plain = model(torch.cat([torch.tensor([ids[:a]]), block], dim=1)).logits[0, a:, : s.vocab_size]
            assert torch.allclose(plain, infer, atol=2e-5, rtol=1e-4) == (rule == "causal")
            # and the labels line up: slot j of the training batch is trained on x_{a+j+1}
            rows = batch.dn_rows[(batch.dn_rows >= len(ids) + i * B) & (batch.dn_rows < len(ids) + (i + 1) * B)]
            targets = batch.dn_targets[(batch.dn_rows >= len(ids) + i * B) & (batch.dn_rows < len(ids) + (i + 1) * B)]
            assert targets.tolist() == ids[a + 1 : a + 1 + len(rows)]


def test_estimator_match_lengths_use_the_same_forward(tmp_path):
    model, _, _ = tiny_drafter(tmp_path)
    s = DrafterSettings.of(model)
    ids = torch.randint(4, 200, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    m = match_lengths(model, ids, 10, s.block_size, s.mask_token_id, s.vocab_size, chunk=3)
    # Slow reference: one block at a time with a fresh cache.
    from transformers import DynamicCache

    B = s.block_size
    for i, a in enumerate(range(9, 29)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            hidden_states(model, torch.tensor([ids[:a]]), clean_layout(a), cache=cache)
            hb = hidden_states(model, torch.tensor([[ids[a]] + [s.mask_token_id] * (B - 1)]),
                               block_layout(torch.tensor([[a]]), B), cache=cache, cache_len=a)
        drafts = logits_at(model, hb[0], s.vocab_size).argmax(-1).tolist()[: B - 1]
        k = 0
        while k < B - 1 and a + 1 + k < len(ids) and drafts[k] == ids[a + 1 + k]:
            k += 1
        assert int(m[i]) == k


def test_save_and_load_keeps_settings(tmp_path):
    model, tok, _ = tiny_drafter(tmp_path)
    save_drafter(model, tok, tmp_path / "d")
    model2, tok2 = load_drafter(tmp_path / "d", dtype="float32")
    assert DrafterSettings.of(model2) == DrafterSettings.of(model)
    assert tok2.convert_tokens_to_ids("<|mask|>") == DrafterSettings.of(model).mask_token_id
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "d")  # an ordinary HF folder
    assert plain.config.d3d["block_size"] == 4


def test_mask_token_is_added_with_mean_embedding(tmp_path):
    """SmolLM2-like case: no free row, so the token is added and its row starts at the mean."""
    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.mask_token='<|brand_new_mask|>'"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    s = DrafterSettings.of(model)
    emb = model.get_input_embeddings().weight
    assert s.mask_token_id == s.vocab_size == emb.shape[0] - 1
    torch.testing.assert_close(emb[s.mask_token_id], emb[: s.vocab_size].mean(0))


def test_mask_token_in_a_padded_embedding_starts_at_the_mean(tmp_path):
    """Qwen-like case: the embedding has untrained padding rows past the tokenizer (151,665 tokens,
    151,936 rows), so the new token's id lands on one of them; that row must be re-initialised too."""
    from d3d.models import load_model, load_tokenizer, resolve_model_path
    from d3d.models.drafter import _add_mask_token

    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    model, tok = load_model(path, "float32", "cpu"), load_tokenizer(path)
    n_real = len(tok)
    model.resize_token_embeddings(n_real + 16, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[n_real:] = 5.0  # far from any real token's row
    mask_id = _add_mask_token(model, tok, "<|brand_new_mask|>", vocab_size=n_real + 16)
    emb = model.get_input_embeddings().weight
    assert mask_id == n_real and emb.shape[0] == n_real + 16
    torch.testing.assert_close(emb[mask_id], emb[:n_real].mean(0))


def test_layer_subset_and_skipping(tmp_path):
    model, _, _ = tiny_drafter(tmp_path, layers=4)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), skipping_layers(model, [1, 2]):
        skipped = model(ids).logits
    assert model.config.num_hidden_layers == 4  # restored
    keep_layers(model, [0, 3])
    with torch.no_grad():
        rebuilt = model(ids).logits
    torch.testing.assert_close(skipped, rebuilt)
    assert DrafterSettings.of(model).kept_layers == [0, 3]


def test_tokenizer_mismatch_is_refused(tmp_path):
    from d3d.models.drafter import check_same_tokenizer
    from d3d.models.random_models import build_byte_tokenizer

    model, tok, _ = tiny_drafter(tmp_path)
    other = build_byte_tokenizer()
    other.add_tokens(["<|something_else|>", "extra"], special_tokens=False)
    with pytest.raises(TokenizerMismatchError, match="family"):
        check_same_tokenizer(tok, other, DrafterSettings.of(model))
    check_same_tokenizer(tok, build_byte_tokenizer(), DrafterSettings.of(model))  # same vocab: fine


def test_a_drafter_checkpoint_is_checked_against_the_target_it_meets(tmp_path):
    """Contract 7 at load time (d3d.eval, d3d.bench): another vocabulary or logits width is
    refused before any decoding; another target of the same vocabulary is only a warning."""
    from accelerate import PartialState

    from d3d.decoding import DecodeConfig
    from d3d.eval import load_models
    from d3d.models import load_model, load_tokenizer, resolve_model_path
    from d3d.models.drafter import check_fits_target, save_drafter

    model, tok, cfg = tiny_drafter(tmp_path)
    path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    target, target_tok = load_model(path, "float32", "cpu"), load_tokenizer(path)
    assert check_fits_target(model, tok, target, target_tok, cfg.target.name) == []
    assert "trained for target" in check_fits_target(model, tok, target, target_tok, "another_target")[0]
    wider = load_model(path, "float32", "cpu")
    wider.resize_token_embeddings(len(target_tok) + 8)
    with pytest.raises(TokenizerMismatchError, match="logits"):
        check_fits_target(model, tok, wider, target_tok)
    # through d3d.eval's loader: a checkpoint whose vocabulary differs is refused
    tok.add_tokens(["<|not_in_the_target|>"])
    folder = save_drafter(model, tok, tmp_path / "foreign")
    ev = bind_config(compose("eval", ["+experiment=smoke", f"target.name={cfg.target.name}",
                          f"target.tiny.num_hidden_layers={cfg.target.tiny.num_hidden_layers}",
                          f"drafter.checkpoint={folder}"], tmp_path), "eval")
    with pytest.raises(TokenizerMismatchError, match="does not match"):
        load_models(ev, {"sync": DecodeConfig(method="sync")}, cfg.paths.cache_dir, PartialState())


def test_a_truncated_weight_file_is_named(tmp_path):
    """A damaged checkpoint (a copy cut short) fails with one line naming the file and the fix,
    not a deserializer traceback."""
    from d3d.errors import UserError
    from d3d.models.drafter import build_drafter, load_drafter, save_drafter
    from tests.conftest import compose

    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    save_drafter(model, tok, tmp_path / "d")
    weights = next((tmp_path / "d").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match=f"cannot load the weights in {weights}.*damaged or truncated") as err:
        load_drafter(tmp_path / "d")
    assert "\n" not in str(err.value)


def test_drafter_inits_come_from_one_registry(tmp_path):
    """drafter.init picks a builder from INITS: `random` gives the target's architecture with fresh
    weights (other than the target's), and an unknown name is refused naming the ones there are."""
    from d3d.models.drafter import INITS

    copy_model, _, _ = tiny_drafter(tmp_path, init="target")
    rand_model, _, cfg = tiny_drafter(tmp_path, init="random")
    assert set(INITS) >= {"target", "target_layers", "pretrained", "random"}  # at least: a new init adds one
    assert type(rand_model) is type(copy_model) and DrafterSettings.of(rand_model).init == "random"
    a, b = copy_model.model.layers[0].mlp.up_proj.weight, rand_model.model.layers[0].mlp.up_proj.weight
    assert a.shape == b.shape and (a - b).abs().max() > 0.01  # same noise added to both: the bases differ
    cfg.drafter.init = "nope"
    with pytest.raises(ValueError, match=f"drafter.init='nope': use {', '.join(INITS)}"):  # every registered name
        build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
