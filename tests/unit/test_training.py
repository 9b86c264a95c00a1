"""d3d.training without a model: the DeepSpeed plugin carries train.*, and the flex_attention mask
rule equals build_mask. The prepared step on a tiny drafter is in tests/integration/test_training.py."""

from __future__ import annotations

import torch

from d3d.models.masks import block_layout, build_mask, clean_layout, concat, mask_mod_for, pad_layout
from d3d.training import deepspeed_plugin
from d3d.settings import bind_config
from tests.conftest import compose


def test_deepspeed_plugin_carries_train_settings(monkeypatch):
    """accelerate launch with deepspeed_zero2.yaml: the engine's micro-batch, accumulation, clipping
    and precision are train.*'s, even where the yaml's env says otherwise (it said GA=1)."""
    cfg = bind_config(compose("train", ["+experiment=qwen3_8b"]), "train")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0.5")
    plugin = deepspeed_plugin(cfg.train, "bf16")
    ds = plugin.deepspeed_config
    tc = cfg.train
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == \
        (tc.batch_size, tc.grad_accum, tc.clip) == (8, 4, 1.0)
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping, plugin.zero_stage) == (4, 1.0, 2)
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == 2
    assert "auto" not in str(ds)  # "auto" is filled only from a prepared DataLoader, which d3d has not
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert deepspeed_plugin(cfg.train, "bf16") is None


def test_mask_mod_equals_build_mask():
    """The flex_attention rule (evaluated per (q, kv) index) is build_mask's, on a packed training
    layout with padding and on a decoding layout after a cache."""
    anchors = torch.tensor([[3, 6, 9]])
    train = pad_layout(concat(clean_layout(12), block_layout(anchors, 4)), 30)
    short = pad_layout(concat(clean_layout(7), block_layout(torch.tensor([[2, 5, 6]]), 4)), 30)
    both = type(train)(*(torch.cat([getattr(train, f), getattr(short, f)]) for f in ("pos", "block", "limit")))
    decode = block_layout(torch.tensor([[5, 8]]), 4)
    for layout, cache_len in ((both, 0), (decode, 5)):
        dense = build_mask(layout, cache_len)[:, 0]
        b, t, k = dense.shape
        mod = mask_mod_for(layout, cache_len)
        bi, qi, ki = torch.meshgrid(torch.arange(b), torch.arange(t), torch.arange(k), indexing="ij")
        assert torch.equal(mod(bi, torch.zeros_like(bi), qi, ki), dense)
