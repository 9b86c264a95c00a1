"""The training objective against small hand-computed cases."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from d3d.objective import (
    Example, ObjectiveConfig, metrics_to_floats, pack, sample_anchors, slot_weights, weight_of_draft,
)
from d3d.training import D3DTrainingStep

MASK, PAD = 99, 0


def test_slot_weights():
    w = slot_weights(ObjectiveConfig.shipped(16, gamma=7.0))
    assert w[0] == 1.0 and math.isclose(w[7].item(), math.exp(-1), rel_tol=1e-6)
    assert math.isclose(weight_of_draft(8, 7.0), math.exp(-1))
    assert slot_weights(ObjectiveConfig.shipped(4, uniform_weights=True)).tolist() == [1, 1, 1, 1]


def test_pack_hand_case():
    # prompt [10, 11], response [12, 13, 14]; B = 3, anchors at 1 (last prompt token) and 3.
    ex = Example([10, 11, 12, 13, 14], prompt_len=2)
    cfg = ObjectiveConfig.shipped(3, gamma=2.0)
    b = pack([ex], cfg, MASK, PAD, torch.Generator(), [torch.tensor([1, 3])])
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 11, MASK, MASK, 13, MASK, MASK]]
    assert b.layout.pos.tolist() == [[0, 1, 2, 3, 4, 1, 2, 3, 3, 4, 5]]
    # block at 1: slots 0,1,2 predict x2,x3,x4; block at 3: slot 0 predicts x4 only (end of text).
    assert b.dn_rows.tolist() == [5, 6, 7, 8]
    assert b.dn_targets.tolist() == [12, 13, 14, 14]
    torch.testing.assert_close(b.dn_weights, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), 1.0]))
    # AR loss only on response targets: positions 1,2,3 predict 12,13,14 (never a prompt token).
    assert b.ar_rows.tolist() == [1, 2, 3] and b.ar_targets.tolist() == [12, 13, 14]


def test_no_bonus_slot_option():
    ex = Example([10, 11, 12, 13, 14], prompt_len=2)
    b = pack([ex], ObjectiveConfig.shipped(3, predict_bonus=False), MASK, PAD, torch.Generator(), [torch.tensor([1])])
    assert b.dn_targets.tolist() == [12, 13]


def test_anchor_sampling_stays_in_the_response():
    ex = Example(list(range(100, 160)), prompt_len=20)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = sample_anchors(ex, ObjectiveConfig.shipped(4, anchors_per_seq=8), g)
        assert len(a) == 8 and len(set(a.tolist())) == 8
        assert a.min() >= 19 and a.max() <= 58 and a.tolist() == sorted(a.tolist())
    a = sample_anchors(ex, ObjectiveConfig.shipped(4, anchors_per_seq=100, block_aligned=True), g)
    assert a.tolist() == list(range(19, 59, 4))
    short = Example([1, 2, 3], prompt_len=2)
    assert sample_anchors(short, ObjectiveConfig.shipped(16, anchors_per_seq=8), g).tolist() == [1]


def layerless_lm(vocab: int = 8):
    """A real HF causal LM with no decoder layer: each row's logits depend on its own token only
    (lm_head(norm(embedding))), so the training step's loss can be computed by hand. The masked
    attention itself is contract 3's test (tests/integration/test_drafter.py)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=0,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def test_loss_weighting_and_ar_switch():
    """d3d.train's step (D3DTrainingStep: packed forward + chunked loss) takes exactly
    L_denoise (slot-weighted) + λ·L_AR, at λ = 1 and at a λ that is neither 0 nor 1, and λ = 0 drops
    the AR term."""
    lm = layerless_lm()
    ex = Example([1, 2, 3, 4, 5], prompt_len=2)
    cfg = ObjectiveConfig.shipped(3, gamma=2.0)
    b = pack([ex], cfg, 7, 0, torch.Generator(), [torch.tensor([1, 3])])
    m1 = metrics_to_floats(D3DTrainingStep(lm, 8, ar_weight=1.0)(b)[1])
    m0 = metrics_to_floats(D3DTrainingStep(lm, 8, ar_weight=0.0, loss_chunk_rows=2)(b)[1])  # chunks change nothing
    m03 = metrics_to_floats(D3DTrainingStep(lm, 8, ar_weight=0.3)(b)[1])
    with torch.no_grad():
        table = lm.lm_head(lm.model.norm(lm.model.embed_tokens.weight))  # logits of each input token
    ids = b.input_ids[0]
    ce = lambda row, t: F.cross_entropy(table[ids[row]][None], torch.tensor([t])).item()
    w = [1.0, math.exp(-0.5), math.exp(-1.0), 1.0]
    dn = sum(wi * ce(r, t) for wi, r, t in zip(w, [5, 6, 7, 8], [3, 4, 5, 5])) / sum(w)
    ar = sum(ce(r, t) for r, t in zip([1, 2, 3], [3, 4, 5])) / 3
    assert math.isclose(m0["loss"], dn, rel_tol=1e-5)
    assert math.isclose(m1["loss"], dn + ar, rel_tol=1e-5)
    assert math.isclose(m03["loss"], dn + 0.3 * ar, rel_tol=1e-5) and math.isclose(m03["loss_ar"], ar, rel_tol=1e-5)
    assert "loss_ar" not in m0
