"""The draft vocabulary's parts without a model: choosing it, the losses over it, its logits in the
target's vocabulary, its refusals, and the memory bound's smaller head (docs/design.md, Draft vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from d3d.decoding.cost import ModelShape
from d3d.errors import ConfigError
from d3d.models.drafter import DraftHead, check_draft_vocab, choose_draft_vocab, coverage
from d3d.models.forward import in_target_vocab
from d3d.objective import Example, ObjectiveConfig, loss_from_hidden, metrics_to_floats, pack


def test_the_most_frequent_tokens_and_the_specials_are_chosen():
    responses = [[5, 5, 5, 7, 7, 2], [5, 7, 9, 9, 9, 9, 3]]  # counts: 9:4, 5:4, 7:3, 2:1, 3:1
    d2t, share = choose_draft_vocab(responses, 4, vocab_size=12, always=[11])
    assert d2t.tolist() == [5, 7, 9, 11]  # 11 in with no count; 2 and 3 tie below 7 and are left out
    assert math.isclose(share, 11 / 13) and math.isclose(coverage(responses, d2t), 11 / 13)
    assert choose_draft_vocab(responses, 5, 12, [11])[0].tolist() == [2, 5, 7, 9, 11]  # a tie goes to the lower id


class ByteSpecials:
    all_special_ids = [0, 1, 2, 300]  # 300: beyond a 260-token vocabulary, so not counted


@pytest.mark.parametrize("n,ok", [(2, False), (3, False), (4, True), (260, True), (261, False)])
def test_a_draft_vocabulary_too_small_for_the_specials_or_too_large_is_refused(n, ok):
    if ok:
        check_draft_vocab(n, ByteSpecials(), 260, extra=1)  # + the mask token still to be added
        return
    with pytest.raises(ConfigError, match=r"^drafter.draft_vocab=\d+: .* between 4 and 260"):
        check_draft_vocab(n, ByteSpecials(), 260, extra=1)


@pytest.mark.parametrize("value", [0, -3, True, "32k"])
def test_draft_vocab_must_be_a_count(value):
    from d3d.settings import bind_config
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="drafter.draft_vocab"):
        bind_config(compose("train", ["+experiment=smoke", f"drafter.draft_vocab={value}"]), "train")


def test_logits_in_the_target_vocabulary_put_zero_mass_outside():
    d2t = torch.tensor([1, 4, 6])
    logits = torch.tensor([[2.0, 0.5, 3.0]])
    full = in_target_vocab(logits, d2t, 8)
    assert full[0, d2t].tolist() == logits[0].tolist() and full.argmax(-1).item() == 6
    assert torch.isinf(full[0, [0, 2, 3, 5, 7]]).all()
    q = torch.softmax(full, -1)
    assert q[0, [0, 2, 3, 5, 7]].sum() == 0 and torch.allclose(q[0, d2t], torch.softmax(logits[0], -1))
    assert in_target_vocab(logits, None, 8) is logits


def test_the_losses_leave_out_targets_outside_the_draft_vocabulary_and_count_them():
    """The denoising and AR losses over the draft vocabulary equal the CE over its rows on the rows
    whose target it holds; the other rows add nothing and are reported (dn_outside, ar_outside)."""
    torch.manual_seed(0)
    V, d, MASK = 20, 8, 19
    ex = Example([3, 4, 5, 6, 7, 8, 9], prompt_len=2)
    cfg = ObjectiveConfig.shipped(3, gamma=2.0)
    batch = pack([ex], cfg, MASK, 0, torch.Generator(), [torch.tensor([1, 3])])
    d2t = torch.tensor([0, 4, 6, 8, 19])  # 5, 7, 9 (and 3) outside
    head = DraftHead(torch.randn(len(d2t), d), d2t)
    hidden = torch.randn(1, batch.input_ids.shape[1], d)
    loss, m = loss_from_hidden(hidden, head, batch, ar_weight=0.5, vocab_size=V)
    m = metrics_to_floats(m)
    h = hidden.reshape(-1, d)

    def ce(rows, targets, weights):
        keep = torch.isin(targets, d2t)
        rows, targets, weights = rows[keep], targets[keep], weights[keep]
        logits = h[rows] @ head.weight.T
        draft = torch.searchsorted(d2t, targets)
        return (F.cross_entropy(logits, draft, reduction="none") * weights).sum() / weights.sum(), (~keep).float().mean()

    dn, dn_out = ce(batch.dn_rows, batch.dn_targets, batch.dn_weights)
    ar, ar_out = ce(batch.ar_rows, batch.ar_targets, torch.ones(len(batch.ar_rows)))
    assert m["loss_denoise"] == pytest.approx(dn.item(), rel=1e-5) and m["loss_ar"] == pytest.approx(ar.item(), rel=1e-5)
    assert loss.item() == pytest.approx((dn + 0.5 * ar).item(), rel=1e-5)
    assert m["dn_outside"] == pytest.approx(dn_out.item()) and 0 < m["dn_outside"] < 1
    assert m["ar_outside"] == pytest.approx(ar_out.item()) and 0 < m["ar_outside"] < 1
    loss.backward()  # a finite gradient: the rows outside add no inf
    assert torch.isfinite(head.weight.grad).all()


def test_the_memory_bound_counts_the_smaller_head():
    full = ModelShape(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=1000,
                      tied=True, dtype_bytes=2, eager=False)
    draft = ModelShape(**{**full.__dict__, "tied": False, "head": 100})
    assert draft.weight_bytes() - full.weight_bytes() == 100 * 64 * 2  # an untied head of 100 rows
    assert draft.pass_bytes(1, 16, 32)["logits"] * 10 == full.pass_bytes(1, 16, 32)["logits"]


@pytest.mark.parametrize("d2t", [[1, 5, 3], [1, 3, 3]])
def test_a_draft_head_refuses_an_unsorted_or_duplicated_map(d2t):
    """The losses find a target id's draft row by `searchsorted` (d3d.objective) and argmax ties go to
    the first row: both need d2t strictly increasing. An unsorted or duplicated map is refused in one
    line (it was accepted and trained on wrong rows)."""
    with pytest.raises(ConfigError, match=r"^a draft head's map d2t .* strictly increasing") as err:
        DraftHead(torch.zeros(3, 4), torch.tensor(d2t))
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)
    DraftHead(torch.zeros(3, 4), torch.tensor([1, 3, 5]))  # sorted, distinct: fine
