"""CUDA-only checks of the decoding engine (marked `gpu`, skipped without a GPU; scripts/gpu_check.py
runs them on a lent machine). The CPU suite covers the same properties with the meta-device trap
(tests/integration/test_decoding.py) and the CPU mode of the GPU check (tests/integration/test_gpu_readiness.py,
tests/integration/test_gpu_check.py: there the race check runs on the worker thread)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def check():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the equality checks
    return load_script("gpu_check")


def test_greedy_equals_generate_on_cuda_fp32(check):
    """generate runs unmasked kernels and the loop masked ones: a rare near-tie may flip even in
    fp32, so the criterion is the stage's: no divergence rounding cannot explain."""
    res = check.stage_greedy("cuda")
    assert res["real"] == 0, res["details"]


def test_sampling_is_lossless_on_cuda(check):
    res = check.stage_sampling("cuda")
    assert res["ok"], res


def test_race_check_side_stream_equals_serial_in_bf16(check):
    """The side stream must not race the main stream (through the caching allocator or missing
    waits): async with the stream against async serial runs the same ops on the same shapes, so
    tokens, τ and hits must agree bit for bit in bf16."""
    res = check.stage_race("cuda")
    assert res["ok"], res


def test_race_check_fails_on_a_broken_stream_hand_off(check, monkeypatch):
    """The race check has teeth on CUDA: `lend` without its `wait_stream`, and the main stream held
    back (torch.cuda._sleep, ~tens of ms) right before it computes what the side stream reads next
    (positions, hit flags, the prepared block), so the side stream reads them before they are
    written. Written for the first GPU run; it has not run yet (no GPU was lent when it was written)."""
    from d3d.decoding import methods, passes

    def lend_without_wait(self, stream, *tensors):
        for t in tensors:
            if stream is not None and t is not None and t.numel():
                t.record_stream(stream)  # memory stays safe; only the ordering is gone

    real_commit = methods.Async.commit

    def late_commit(self, r, host, most):
        torch.cuda._sleep(100_000_000)  # on the main stream: what follows in this round lands late
        real_commit(self, r, host, most)

    monkeypatch.setattr(passes.Passes, "lend", lend_without_wait)
    monkeypatch.setattr(methods.Async, "commit", late_commit)
    res = check.stage_race("cuda", new_tokens=24)
    assert not res["ok"], res["runs"]


def test_async_against_sync_on_cuda(check):
    """fp32: tokens and τ bit for bit; bf16: tokens (differences only within rounding)."""
    res = check.stage_async_sync("cuda")
    assert res["ok"], res


def test_every_method_runs_ragged_on_cuda_at_both_temperatures(check):
    from d3d.decoding import DecodeConfig, SpecGenerator

    target, drafter = check.tiny_pair("cuda", torch.bfloat16, block_size=6)
    prompts = check.random_prompts(3, 256, seed=2)
    for method in ("ar", "sync", "async"):
        for temperature in (0.0, 1.0):
            cfg = DecodeConfig(method=method, block_size=6, C=3, F=2, temperature=temperature, max_new_tokens=20)
            res = SpecGenerator(target, check.NoText(), None if method == "ar" else drafter, cfg,
                                eos_token_ids=[]).generate(prompts)
            assert [len(t) for t in res.token_ids] == [20, 20, 20]
            assert all(0 <= x < 256 for t in res.token_ids for x in t)


def test_flex_block_mask_output_equals_dense_sdpa(check):
    """On CUDA the training step under flex_attention (a BlockMask) gives the hidden states and
    the loss of SDPA with the dense bool mask (built from a config: no Hydra on the GPU machines)."""
    from d3d.models.drafter import DrafterSettings
    from d3d.objective import Example, ObjectiveConfig, pack
    from d3d.training import D3DTrainingStep

    _, model = check.tiny_pair("cuda", torch.float32, block_size=4)
    s = DrafterSettings.of(model)
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(4, 200, (150 - 7 * i,), generator=g).tolist(), 10) for i in range(2)]
    batch = pack(examples, ObjectiveConfig.shipped(s.block_size, anchors_per_seq=8), s.mask_token_id, 0, g)
    step = D3DTrainingStep(model, s.vocab_size, 1.0)
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        h_sdpa, (l_sdpa, _) = step.hidden(batch), step(batch)
        model.set_attn_implementation("flex_attention")
        h_flex, (l_flex, _) = step.hidden(batch), step(batch)
    real = batch.layout.block.cuda() != -2  # padding rows differ by design (flex skips empty tiles)
    torch.testing.assert_close(h_flex[real], h_sdpa[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(l_flex, l_sdpa, rtol=1e-4, atol=1e-4)
