"""Verification, shared by every loop: greedy, and lossless rejection sampling (DESIGN §5).

Inputs for a batch of b rows and a block of B positions:
- `p_logits` (b, B, V): the target's logits at the block's positions; position k scores the token
  after the k-th block token, so p[:, k] judges draft k+1 and p[:, B-1] gives the bonus token;
- `drafts` (b, B-1): the drafts; `q` (b, B-1, V): the distributions they were sampled from (T > 0).
Returns (accepted (b,), next_token (b,)): the number of drafts accepted and the token that follows
them (the correction at the first rejection, or the bonus after a full accept). τ = accepted + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p, applied identically to target and drafter logits."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, idx = p.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < s.top_p  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p * keep
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def greedy_verify(p_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    target = p_logits.argmax(-1)  # (b, B)
    n = drafts.shape[1]
    match = (drafts == target[:, :n]).long()
    accepted = match.cumprod(dim=1).sum(dim=1)  # leading matches (0 when there are no drafts)
    next_token = target.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_token


def sample_verify(p_logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, s: Sampling,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept draft k with prob min(1, p/q); at the first rejection sample norm(max(0, p - q));
    after a full accept sample the bonus from p. The output follows the target's distribution.

    Vectorised over rows and slots, on the logits' device: no per-token host round trip."""
    p = probs(p_logits, s)  # (b, B, V)
    b, n = drafts.shape
    u = torch.rand((b, n), generator=generator, device=p.device)
    p_d = p[:, :n].gather(2, drafts[:, :, None]).squeeze(2)
    q_d = q.gather(2, drafts[:, :, None]).squeeze(2)
    ok = (q_d > 0) & (u * q_d <= p_d)  # u < p/q, without dividing by zero
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (b,)
    # The slot after the accepted drafts: its residual max(0, p - q), or p itself after a full
    # accept (q is zero-padded there, so the residual of that slot *is* p).
    q_pad = torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], dim=1)
    at = accepted[:, None, None].expand(b, 1, p.shape[-1])
    residual = (p.gather(1, at) - q_pad.gather(1, at)).squeeze(1).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # p == q at that slot leaves no residual mass; rejection then has probability 0, but guard it.
    dist = torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny),
                       p.gather(1, at).squeeze(1))
    next_token = sample(dist, generator)
    return accepted, next_token


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of p (..., V), without a host sync (torch.multinomial checks its input on
    the host, which stalls the GPU pipeline every round). The exponential race: with E_i ~ Exp(1)
    independent, argmax_i p_i / E_i is i with probability p_i / sum(p)."""
    e = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)
    return (p.float() / e.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)


def draft_from(q_logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None):
    """Drafts and the distributions they come from: argmax at T = 0, samples from q at T > 0."""
    if s.greedy:
        return q_logits.argmax(-1), None
    q = probs(q_logits, s)
    return sample(q, generator), q
