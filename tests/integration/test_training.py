"""d3d.training on a tiny drafter: bf16 autocast reaches the drafter's matmuls through the prepared
step, the chunked loss equals the whole-batch loss, memory switches keep the numbers (the DeepSpeed
plugin and the flex mask rule, which need no model, are in tests/unit/test_training.py; the flex
output equality is a gpu test)."""

from __future__ import annotations

import pytest
import torch

from d3d.models.drafter import build_drafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.objective import ObjectiveConfig, loss_from_hidden, metrics_to_floats, pack
from d3d.training import D3DTrainingStep, enable_activation_checkpointing, make_accelerator
from d3d.settings import bind_config
from tests.conftest import compose


def tiny(tmp_path, *overrides):
    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.block_size=4", *overrides], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    return cfg, model, tok


def a_batch(model, tok, n=2, length=40, anchors=5, seed=0):
    from d3d.objective import Example

    s = DrafterSettings.of(model)
    g = torch.Generator().manual_seed(seed)
    examples = [Example(torch.randint(4, 200, (length - 7 * i,), generator=g).tolist(), 10) for i in range(n)]
    return pack(examples, ObjectiveConfig.shipped(s.block_size, anchors_per_seq=anchors), s.mask_token_id,
                tok.pad_token_id, g)


def test_bf16_autocast_reaches_the_drafter_matmuls(tmp_path, fresh_accelerate_state):
    """mixed_precision=bf16 through the prepared training step: the decoder's projections and the
    LM head run in bf16 (autocast wraps the prepared module's forward), the loss stays fp32."""
    cfg, model, tok = tiny(tmp_path, "train.mixed_precision=bf16")
    accelerator = make_accelerator(cfg.train, timeout_s=cfg.dist.timeout_s, cpu=True)
    s = DrafterSettings.of(model)
    step = accelerator.prepare(D3DTrainingStep(model, s.vocab_size, 1.0))
    seen = {}
    hooks = [mod.register_forward_hook(lambda m, i, o, name=name: seen.update({name: o.dtype}))
             for name, mod in model.named_modules() if name.endswith(("q_proj", "down_proj", "lm_head"))]
    loss, _ = step(a_batch(model, tok))
    for h in hooks:
        h.remove()
    assert seen and set(seen.values()) == {torch.bfloat16}, seen
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert next(model.parameters()).dtype == torch.float32  # weights stay fp32 (autocast, not a cast)


def test_chunked_loss_equals_whole_loss_and_gradient(tmp_path):
    """Loss rows' logits in chunks (recomputed in backward) give the loss and gradients of one pass."""
    _, model, tok = tiny(tmp_path)
    s = DrafterSettings.of(model)
    batch = a_batch(model, tok)
    results = []
    for chunk in (10_000, 7):
        model.zero_grad()
        step = D3DTrainingStep(model, s.vocab_size, 1.0, loss_chunk_rows=chunk)
        loss, m = step(batch)
        loss.backward()
        results.append((loss.detach(), metrics_to_floats(m), [p.grad.clone() for p in model.parameters()]))
    (l1, m1, g1), (l2, m2, g2) = results
    assert len(batch.dn_rows) > 7 * 3  # several chunks really ran
    torch.testing.assert_close(l1, l2)
    assert m1.keys() == m2.keys() and all(abs(m1[k] - m2[k]) < 1e-5 for k in m1)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_keeps_loss_and_gradient(tmp_path):
    _, model, tok = tiny(tmp_path)
    s = DrafterSettings.of(model)
    batch = a_batch(model, tok)
    step = D3DTrainingStep(model, s.vocab_size, 1.0).train()
    out = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_activation_checkpointing(model)
        model.zero_grad()
        loss, _ = step(batch)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert model.is_gradient_checkpointing  # the switch took
    torch.testing.assert_close(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_from_hidden_takes_no_full_vocabulary_tensor(tmp_path):
    """No (rows, V) float tensor for all loss rows at once: the biggest float tensor the LM head
    makes is one chunk's logits."""
    _, model, tok = tiny(tmp_path)
    s = DrafterSettings.of(model)
    batch = a_batch(model, tok)
    head = model.get_output_embeddings()
    shapes = []
    hook = head.register_forward_hook(lambda m, i, o: shapes.append(o.shape[0]))
    h = torch.randn(*batch.input_ids.shape, model.config.hidden_size, requires_grad=True)
    loss, _ = loss_from_hidden(h, head, batch, 1.0, s.vocab_size, chunk_rows=16)
    loss.backward()
    hook.remove()
    assert max(shapes) == 16 and len(batch.dn_rows) > 16


def test_attention_mask_for_refuses_a_tensor_under_flex(tmp_path):
    from d3d.models.forward import attention_mask_for

    _, model, _ = tiny(tmp_path)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(TypeError, match="BlockMask"):
        attention_mask_for(model, torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.heavy  # the GPU training check in a subprocess
def test_gpu_train_check_runs_on_cpu_without_hydra_or_deepspeed(tmp_path):
    """scripts/gpu_train_check.py at toy size, in a process where hydra, omegaconf, datasets and
    deepspeed cannot be imported (the GPU image has none of them): loss finite and falling, JSON written."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "train_check.json"
    blocked = ["hydra", "omegaconf", "datasets", "deepspeed"]
    code = (f"import sys, runpy; sys.modules.update(dict.fromkeys({blocked!r})); "
            f"sys.argv = ['gpu_train_check.py', '--device', 'cpu', '--out', {str(out)!r}, '--steps', '4', '--layers', "
            "'2', '--hidden', '64', '--vocab', '512', '--seq-len', '96', '--block-size', '4', '--anchors', '4']; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'gpu_train_check.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["losses"]) == 4 and report["finite"] and report["falling"]
    assert report["host_peak_rss_mb"] > 0 and report["matmul_dtype"] == "torch.float32"
