"""Verification, shared by every loop: greedy, and lossless rejection sampling (docs/design.md#decoding-decoding).

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


# ---------------------------------------------------------------- trees (decode.method=tree)
#
# A tree of drafts (d3d.decoding.tree) is verified in one target pass over [pending, nodes]:
# p_logits (b, T, V) at the T = N+1 nodes, node 0 the pending token; node i's logits score the
# token after it. `node_tok` (b, T) are the nodes' tokens (node 0's is never read), `parents`
# (b, T) and `ancestors` (b, T, T) the tree's shape (d3d.models.masks.tree_ancestors). Both rules
# return (accepted, next_token, best): the depth of the deepest accepted node, the token after it
# (the correction, or the bonus under a leaf) and that node's index.


def tree_greedy_verify(p_logits: torch.Tensor, node_tok: torch.Tensor, ancestors: torch.Tensor):
    """The longest root path whose every token is the target's argmax after its parent; then the
    target's argmax after that path. Siblings carry distinct tokens, so at most one child of an
    accepted node matches: the accepted nodes are one path, and `best` its end."""
    target = p_logits.argmax(-1)  # (b, T): the target's token after each node
    parents = parent_of(ancestors)
    match = node_tok == target.gather(1, parents.clamp(min=0))
    match[:, 0] = True  # the pending token is committed text
    accepted_node = ~(ancestors & ~match[:, None, :]).any(-1)  # every node on its path matches
    depth = ancestors.sum(-1) - 1
    best = torch.where(accepted_node, depth, -1).argmax(dim=1)
    return depth.gather(1, best[:, None]).squeeze(1), target.gather(1, best[:, None]).squeeze(1), best


def tree_sample_verify(p_logits: torch.Tensor, node_tok: torch.Tensor, ancestors: torch.Tensor, s: Sampling,
                       generator: torch.Generator | None = None):
    """Lossless multi-candidate rejection sampling over a tree whose children are *deterministic*
    candidates (the best-first tree picks them from q; they are no samples of q).

    At a node with target law p (after the path so far), its children x_1, x_2, ... are tried in
    order. Each is a proposal with a point mass, q_i = delta(x_i), so the usual rule "accept with
    prob min(1, p'(x)/q(x)), else continue from norm(max(0, p' - q))" reads: accept x_i with prob
    p'_i(x_i); on rejection p'_{i+1} = p'_i with x_i removed, renormalised. With no child left,
    sample the token from the last residual. Accepting x_i moves to that child, whose own target
    law (its logits) starts afresh.

    Why the output token at a node follows p exactly: the residual before trying x_i is
    p'_i = p restricted to the tokens outside {x_1..x_{i-1}}, divided by R_{i-1} = 1 - sum_{l<i} p(x_l)
    (by induction: removing x_i from p'_i and renormalising divides by 1 - p(x_i)/R_{i-1} =
    R_i/R_{i-1}). So P(x_i is the output) = prod_{j<i} (1 - p(x_j)/R_{j-1}) * p(x_i)/R_{i-1}
    = prod_{j<i} (R_j/R_{j-1}) * p(x_i)/R_{i-1} = R_{i-1} * p(x_i)/R_{i-1} = p(x_i), the product
    telescoping (R_0 = 1); and a token y outside the candidates is output with prob
    R_k * p(y)/R_k = p(y) after all k candidates were rejected. Then, given the token, the next
    one is decided at that child by its own p, so every output token follows the target's
    conditional law: the rule is lossless. (Sampling the correction from p instead of the residual,
    or accepting x_i with p(x_i) instead of p'_i(x_i), breaks the telescoping; the law test in
    tests/unit/test_verify.py detects both.)

    Vectorised over rows; one step per tried child (at most T-1, since children come after their
    parent and each step moves `last` forward), on the device, no host sync."""
    p = probs(p_logits, s)  # (b, T, V)
    b, t, _ = p.shape
    dev, rows = p.device, torch.arange(b, device=p.device)
    parents = parent_of(ancestors)
    order = torch.arange(t, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)  # the accepted node we stand on
    last = torch.zeros(b, dtype=torch.long, device=dev)  # children at indices <= last are tried
    resid = p[:, 0].clone()
    for _ in range(t - 1):
        cand = (order[None, :] > last[:, None]) & (parents == cur[:, None])
        has = cand.any(dim=1)
        j = cand.long().argmax(dim=1)
        x = node_tok.gather(1, j[:, None]).squeeze(1)
        px = resid.gather(1, x[:, None]).squeeze(1)
        u = torch.rand((b,), generator=generator, device=dev)
        take = has & (u < px)
        drop = has & ~take
        removed = resid.scatter(1, x[:, None], 0.0)
        removed = removed / removed.sum(-1, keepdim=True).clamp(min=torch.finfo(removed.dtype).tiny)
        resid = torch.where(take[:, None], p[rows, j], torch.where(drop[:, None], removed, resid))
        cur = torch.where(take, j, cur)
        last = torch.where(has, j, last)
    token = sample(resid, generator)
    depth = ancestors.sum(-1) - 1
    return depth.gather(1, cur[:, None]).squeeze(1), token, cur


def parent_of(ancestors: torch.Tensor) -> torch.Tensor:
    """(b, T) each node's parent (-1 for the root): its deepest proper ancestor."""
    depth = ancestors.sum(-1) - 1  # (b, T)
    proper = ancestors & ~torch.eye(ancestors.shape[-1], dtype=torch.bool, device=ancestors.device)
    scored = torch.where(proper, depth[:, None, :], -1)
    return torch.where(proper.any(-1), scored.argmax(-1), -1)


def tree_path(ancestors: torch.Tensor, best: torch.Tensor, node_tok: torch.Tensor, width: int):
    """The path from the root to `best` (b,), root excluded: its nodes' indices and tokens (b, width),
    the first depth(best) entries real, the rest padded with the root (index 0, its token)."""
    b, t = node_tok.shape
    on_path = ancestors[torch.arange(b, device=best.device), best]  # (b, T)
    depth = ancestors.sum(-1) - 1
    at = torch.where(on_path & (depth > 0), depth - 1, width)  # column `width` collects the rest
    nodes = torch.zeros(b, width + 1, dtype=torch.long, device=best.device)
    nodes.scatter_(1, at, torch.arange(t, device=best.device).expand(b, t) * (at < width))
    nodes = nodes[:, :width]
    return nodes, node_tok.gather(1, nodes)
