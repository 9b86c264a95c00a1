"""Pruning's one-sweep layer scores (d3d.layer_scores) against the estimator run once per layer."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding.methods import scored_drafts
from d3d.estimator import estimate_acceptance
from d3d.layer_scores import anchors_of, score_layers, spearman
from d3d.models.drafter import decoder_layers, skipping_layers
from d3d.models.drafter_settings import DrafterSettings
from d3d.objective import Example
from tests.integration.conftest import block_drafts, tiny_drafter


def lively_examples(model, s: DrafterSettings, seed: int, n: int = 3) -> list[Example]:
    """Responses that are partly the drafter's own drafts, so rounds accept several tokens and the
    candidates' τ differ (on random text every τ is 1 and any scorer agrees)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, 200, (8,), generator=g).tolist()
        for _ in range(5):
            ids += block_drafts(model, ids, s)[: 1 + (i + len(ids)) % s.block_size]
            ids.append(int(torch.randint(4, 200, (1,), generator=g)))
        out.append(Example(ids, prompt_len=6))
    return out


def per_layer(model, examples, s, drafts=None) -> list[float]:
    taus = []
    for layer in range(len(decoder_layers(model))):
        with skipping_layers(model, [layer]):
            taus.append(estimate_acceptance(model, examples, s.block_size, s.mask_token_id, s.vocab_size,
                                            drafts=drafts).tau)
    return taus + [estimate_acceptance(model, examples, s.block_size, s.mask_token_id, s.vocab_size,
                                       drafts=drafts).tau]


# each arch with the chain and a tree; a causal drafter (drafter.block_attention) with both too
@pytest.mark.parametrize("arch,tree_nodes,rule", [(a, t, "bidirectional") for a in ("llama", "qwen2") for t in (None, 5)]
                         + [("llama", t, "causal") for t in (None, 5)])
def test_one_sweep_scores_equal_the_estimator_per_layer(tmp_path, arch, tree_nodes, rule):
    model, _, _ = tiny_drafter(tmp_path, arch=arch, layers=4, block=4, rule=rule)
    s = DrafterSettings.of(model)
    drafts = scored_drafts(s.block_size, tree_nodes)
    seen_multi = False
    for seed in range(4):  # fp32: the packed sweep and the chunked estimator agree bit for bit on τ
        examples = lively_examples(model, s, seed)
        fast = score_layers(model, examples, s.block_size, s.mask_token_id, s.vocab_size, drafts=drafts)
        expected = per_layer(model, examples, s, drafts)
        assert fast.taus == pytest.approx(expected, abs=1e-12), seed
        seen_multi |= len(set(expected)) > 1
    assert seen_multi  # the candidates differed somewhere: the comparison can tell layers apart


def test_sampled_anchors_are_seeded_and_cover_a_fraction():
    a = anchors_of(110, 10, 0.25, seed=3)
    assert len(a) == 25 and torch.equal(a, anchors_of(110, 10, 0.25, seed=3))
    assert not torch.equal(a, anchors_of(110, 10, 0.25, seed=4))
    assert int(a.min()) >= 9 and int(a.max()) <= 108 and bool((a[1:] > a[:-1]).all())
    assert torch.equal(anchors_of(110, 10, 1.0, seed=0), torch.arange(9, 109))


def test_sampled_estimator_is_the_mean_round_at_the_sampled_anchors(tmp_path):
    model, _, _ = tiny_drafter(tmp_path, layers=2, block=4)
    s = DrafterSettings.of(model)
    examples = lively_examples(model, s, 0, n=2)
    full = score_layers(model, examples, s.block_size, s.mask_token_id, s.vocab_size, anchor_fraction=0.999999)
    # every anchor "sampled": the mean of min(m, B-1) + 1 capped by the tokens left, per anchor
    from d3d.estimator import match_lengths

    want_tok, want_n = 0, 0
    for ex in examples:
        m = match_lengths(model, ex.ids, ex.prompt_len, s.block_size, s.mask_token_id, s.vocab_size)
        left = len(ex.ids) - 1 - torch.arange(ex.prompt_len - 1, len(ex.ids) - 1)
        want_tok += int(torch.minimum(m.clamp(max=s.block_size - 1) + 1, left).sum())
        want_n += len(m)
    assert full.taus[-1] == pytest.approx(want_tok / want_n)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_shares_of_the_responses_add_up_to_the_whole(tmp_path, fraction):
    """What each process of a multi-process d3d.prune scores (every 3rd response from its rank, each
    with the anchors it has in the whole set): the token and round counts of the three shares sum to
    the whole set's exactly, so the summed scores choose the layer one process does."""
    from d3d.layer_scores import LayerScores

    model, _, _ = tiny_drafter(tmp_path, layers=4, block=4)
    s = DrafterSettings.of(model)
    examples = lively_examples(model, s, seed=1, n=5)
    score = lambda share: score_layers(model, examples, s.block_size, s.mask_token_id, s.vocab_size,  # noqa: E731
                                       anchor_fraction=fraction, seed=2, share=share)
    whole = score((0, 1))
    summed = LayerScores()
    parts = [score((rank, 3)) for rank in range(3)]
    for part in parts:
        summed.add(part)
    assert summed.tokens == whole.tokens and summed.rounds == whole.rounds
    assert all(0 < sum(p.rounds) < sum(whole.rounds) for p in parts)  # each share scored some, none all
