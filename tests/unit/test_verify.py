"""Contract 2 on a toy vocabulary, no model: one verification step is lossless, and the sync-free
sampler draws from p. The same property through the decoding loop is in
tests/integration/test_decoding.py."""

from __future__ import annotations

import torch

from d3d.decoding.verify import Sampling, probs, sample_verify


def test_contract2_one_verification_step_is_lossless():
    """Toy vocabulary of 6: the first token out of a verification step follows p exactly."""
    torch.manual_seed(0)
    V, B, n = 6, 3, 60000
    p_logits = torch.randn(1, B, V).expand(n, B, V).clone() * 1.5
    q_logits = torch.randn(1, B - 1, V).expand(n, B - 1, V).clone() * 1.5
    s = Sampling(temperature=1.0)
    q = probs(q_logits, s)
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, B - 1)
    accepted, token = sample_verify(p_logits, drafts, q, s, g)
    first = torch.where(accepted > 0, drafts[:, 0], token)
    emp = torch.bincount(first, minlength=V).float() / n
    exact = probs(p_logits[0, 0], s)
    tv = 0.5 * (emp - exact).abs().sum().item()
    # TV of n=60000 samples from the right law is ~0.005; a wrong residual (e.g. sampling the
    # correction from p instead of norm(max(0, p - q))) shifts it by > 0.05 here.
    assert tv < 0.015, tv
    wrong = torch.where(accepted > 0, drafts[:, 0], torch.multinomial(exact.expand(n, V), 1, generator=g)[:, 0])
    assert 0.5 * ((torch.bincount(wrong, minlength=V).float() / n) - exact).abs().sum().item() > 0.03


def test_sample_draws_from_p():
    """The sync-free sampler (exponential race) against the exact law on a toy vocabulary."""
    from d3d.decoding.verify import sample

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sample(p.expand(60000, 5).clone(), g)
    emp = torch.bincount(draws, minlength=5).float() / 60000
    assert emp[4] == 0 and 0.5 * (emp - p).abs().sum() < 0.01  # noise ~0.004 at n = 60000
