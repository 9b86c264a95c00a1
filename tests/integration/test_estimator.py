"""The offline acceptance estimator against a slow round-by-round reference."""

from __future__ import annotations

import torch

from d3d.estimator import estimate_acceptance, greedy_rounds
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout
from d3d.objective import Example
from tests.integration.conftest import block_drafts, tiny_drafter


def test_greedy_rounds_hand_case():
    # prompt_len 2, length 9 -> 7 response tokens; anchors 1..7; B = 4 (at most 3 drafts a round).
    m = torch.tensor([2, 0, 0, 3, 1, 0, 0])
    # a=1: m=2 -> τ=3 -> a=4: m=3 -> τ=4 -> a=8: done (3 + 4 = 7 tokens)
    assert greedy_rounds(m, 2, 9, 4) == [3, 4]
    # capped at the tokens left: a=1 with m=3 and only 2 tokens left
    assert greedy_rounds(torch.tensor([3, 3]), 2, 4, 4) == [2]


def slow_tau(model, ex: Example, s: DrafterSettings) -> list[int]:
    """Round by round, as a decoding loop would, with a fresh cache each round."""
    from transformers import DynamicCache

    B, a, taus = s.block_size, ex.prompt_len - 1, []
    while a < len(ex.ids) - 1:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            hidden_states(model, torch.tensor([ex.ids[:a]]), clean_layout(a), cache=cache)
            h = hidden_states(model, torch.tensor([[ex.ids[a]] + [s.mask_token_id] * (B - 1)]),
                              block_layout(torch.tensor([[a]]), B), cache=cache, cache_len=a)
        drafts = logits_at(model, h[0], s.vocab_size).argmax(-1).tolist()[: B - 1]
        accepted = 0
        for k, d in enumerate(drafts):
            if a + 1 + k < len(ex.ids) and d == ex.ids[a + 1 + k]:
                accepted += 1
            else:
                break
        tau = min(accepted + 1, len(ex.ids) - 1 - a)
        taus.append(tau)
        a += tau
    return taus


def test_estimator_equals_slow_reference_on_text_the_drafter_likes(tmp_path):
    model, _, _ = tiny_drafter(tmp_path)
    s = DrafterSettings.of(model)
    # Make responses partly the drafter's own greedy drafts so that rounds accept several tokens.
    g = torch.Generator().manual_seed(3)
    examples = []
    for i in range(3):
        ids = torch.randint(4, 200, (8,), generator=g).tolist()
        for _ in range(4):
            ids += block_drafts(model, ids, s)[: 2 + i]
            ids.append(int(torch.randint(4, 200, (1,), generator=g)))
        examples.append(Example(ids, prompt_len=6))
    stats = estimate_acceptance(model, examples, s.block_size, s.mask_token_id, s.vocab_size)
    expected = [t for ex in examples for t in slow_tau(model, ex, s)]
    assert stats.taus == expected
    assert max(expected) > 1  # the case exercises multi-token rounds
    assert sum(stats.taus) == sum(len(ex.ids) - ex.prompt_len for ex in examples)
