"""d3d.training without a model: the DeepSpeed plugin carries train.*, the global batch keeps its size
over process counts, and the flex_attention mask rule equals build_mask. The prepared step on a tiny drafter is in tests/integration/test_training.py."""

from __future__ import annotations

import torch

from d3d.models.masks import block_layout, build_mask, clean_layout, concat, mask_mod_for, pad_layout
import dataclasses

import pytest

from d3d.errors import ConfigError
from d3d.training import deepspeed_plugin, train_resume_key, with_global_batch
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


@pytest.mark.parametrize("causal", [False, True])
def test_mask_mod_equals_build_mask(causal):
    """The flex_attention rule (evaluated per (q, kv) index) is build_mask's, on a packed training
    layout with padding and on a decoding layout after a cache, for either block rule."""
    anchors = torch.tensor([[3, 6, 9]])
    train = pad_layout(concat(clean_layout(12), block_layout(anchors, 4)), 30)
    short = pad_layout(concat(clean_layout(7), block_layout(torch.tensor([[2, 5, 6]]), 4)), 30)
    both = type(train)(*(torch.cat([getattr(train, f), getattr(short, f)]) for f in ("pos", "block", "limit")))
    decode = block_layout(torch.tensor([[5, 8]]), 4)
    for layout, cache_len in ((both, 0), (decode, 5)):
        dense = build_mask(layout, cache_len, causal_blocks=causal)[:, 0]
        b, t, k = dense.shape
        mod = mask_mod_for(layout, cache_len, causal_blocks=causal)
        bi, qi, ki = torch.meshgrid(torch.arange(b), torch.arange(t), torch.arange(k), indexing="ij")
        assert torch.equal(mod(bi, torch.zeros_like(bi), qi, ki), dense)


def test_the_global_batch_derives_the_accumulation_on_any_process_count():
    """train.global_batch_size=256 with 8-sequence micro-batches: 32 micro-batches on 1 process, 4 on
    a node of 8, 1 on 4 nodes of 8: the same 256 sequences an optimizer step, so max_steps, lr and
    warm-up mean the same (the global batch used to grow with the processes)."""
    tc = bind_config(compose("train", ["+experiment=qwen3_8b", "train.global_batch_size=256"]), "train").train
    assert [with_global_batch(tc, world).grad_accum for world in (1, 8, 32)] == [32, 4, 1]
    unset = dataclasses.replace(tc, global_batch_size=None)
    assert with_global_batch(unset, 32) is unset  # null: today's behaviour, grad_accum as given (4)
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=256 is not a multiple of train.batch_size=8 x "
                                          r"24 processes = 192. Fix: set train.global_batch_size to a multiple of 192"):
        with_global_batch(tc, 24)


def test_the_resume_key_holds_the_global_batch_not_its_split(monkeypatch):
    """A run resumed on another process count with the same global batch is the same experiment; one
    whose global batch changed with the process count (global_batch_size null) is not."""
    cfg = bind_config(compose("train", ["+experiment=qwen3_8b", "train.global_batch_size=64"]), "train")
    keys = []
    for world in ("8", "2"):
        monkeypatch.setenv("WORLD_SIZE", world)
        keys.append(train_resume_key(dataclasses.replace(cfg, train=with_global_batch(cfg.train, int(world)))))
    assert keys[0] == keys[1] and keys[0]["train"]["global_batch"] == 64
    grown = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=None))
    assert train_resume_key(grown)["train"]["global_batch"] == 8 * 4 * 2  # batch x grad_accum x processes


def test_an_indivisible_global_batch_is_refused_before_the_drafter_loads(tmp_path, monkeypatch):
    import d3d.train

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(d3d.train, "held_out", lambda *a, **k: pytest.fail("data loaded before the check"))
    with pytest.raises(ConfigError, match=r"train.global_batch_size=4 is not a multiple of train.batch_size=2 x 3"):
        d3d.train.run_train(compose("train", ["+experiment=smoke", "train.global_batch_size=4"], tmp_path))


def test_adamw_on_one_cpu_process_is_fused_and_keeps_the_loops_weights_to_fp32_rounding():
    """On a CPU torch's default AdamW is its per-tensor loop: two temporaries the size of each tensor
    (1.0 GB beside the Qwen drafter's tied embedding) and ~10x the fused kernel's time on an AVX2 EPYC.
    One CPU process now fuses it; the weights stay the loop's to fp32 rounding (not bit for bit)."""
    import copy
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from d3d.training import fuses_adamw, make_optimizer

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fuses_adamw(SimpleNamespace(device=cpu, distributed_type=DistributedType.NO))
    assert not fuses_adamw(SimpleNamespace(device=cpu, distributed_type=DistributedType.MULTI_CPU))
    assert not fuses_adamw(SimpleNamespace(device=cuda, distributed_type=DistributedType.NO))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(64, 16), "proj": torch.nn.Linear(16, 64)})
    twins = [copy.deepcopy(model) for _ in range(2)]
    loop, fused = (make_optimizer(m, 1e-2, 0.1, [0.9, 0.95], fused=f) for m, f in zip(twins, (False, True)))
    assert fused.defaults["fused"] and not loop.defaults["fused"] and not loop.defaults["foreach"]
    for _ in range(5):
        x = torch.randint(0, 64, (8,))
        for m, opt in zip(twins, (loop, fused)):
            m["proj"](m["embed"](x)).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
    for start, a, b in zip(model.parameters(), twins[0].parameters(), twins[1].parameters()):
        assert not torch.equal(a, start)  # both trained
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
