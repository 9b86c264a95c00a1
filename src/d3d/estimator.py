"""Offline acceptance estimator (docs/design.md, Pruning): exact greedy τ without decoding.

When a response is the target's own greedy output, a greedy speculative round accepts exactly
the drafts that equal the response. So τ follows from teacher forcing: for every anchor a in the
response, draft the block at a once (all anchors of a sequence in a few packed passes over the
drafter's KV cache of the response) and count m(a), the leading drafts equal to the response.
Then walk the rounds as the decoding loop would: start at the last prompt token, each round commits
τ = min(m(a), B-1) + 1 tokens (the accepted drafts + the correction/bonus token), capped at the
tokens left, and the next round anchors at a + τ.

The chain is the default; `drafts` (a Drafts kind, d3d.decoding.methods.drafts_of) estimates the
τ of another shape by the same walk, with m(a) its `match_depth` at the block at a: for a tree,
the depth of the deepest node whose path equals the response (greedy tree acceptance takes the
longest path matching the target's argmax, which on its own greedy response is the response).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from d3d.decoding.config import DecodeConfig
from d3d.decoding.drafts import Chain, Drafts
from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout


@dataclass
class AcceptanceStats:
    taus: list[int] = field(default_factory=list)  # τ of every round of every sequence
    per_sequence: list[float] = field(default_factory=list)  # mean τ of each sequence
    slot_hits: list[int] = field(default_factory=list)  # anchors whose first k drafts all match
    anchors: int = 0

    @property
    def tau(self) -> float:
        """Mean τ per round over all rounds (tokens committed / rounds)."""
        return sum(self.taus) / max(len(self.taus), 1)

    def slot_accuracy(self) -> list[float]:
        """P(first k drafts all correct) over all anchors, k = 1..B-1."""
        return [h / max(self.anchors, 1) for h in self.slot_hits]

    def histogram(self, block_size: int) -> list[int]:
        counts = [0] * (block_size + 1)
        for t in self.taus:
            counts[t] += 1
        return counts[1:]

    def as_dict(self, block_size: int) -> dict:
        return {"tau": self.tau, "rounds": len(self.taus), "sequences": len(self.per_sequence),
                "slot_accuracy": self.slot_accuracy(), "tau_histogram": self.histogram(block_size)}


@torch.no_grad()
def match_lengths(model, ids: list[int], prompt_len: int, block_size: int, mask_id: int,
                  vocab_size: int | None = None, chunk: int = 64, drafts: Drafts | None = None) -> torch.Tensor:
    """m(a) for every anchor a = prompt_len-1 .. len-2: leading drafts that equal the response
    (with `drafts`: its match_depth, e.g. a tree's deepest node on the response's path)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    B, L = block_size, len(ids)
    drafts = shape_of(drafts, B)
    seq = torch.tensor(ids, dtype=torch.long, device=dev)
    cache = DynamicCache(config=model.config)
    # The committed text, causal, in the drafter's cache (an anchor a only sees positions < a).
    hidden_states(model, seq[None, : L - 1], clean_layout(L - 1, device=dev), cache=cache, plain=True)
    anchors = torch.arange(prompt_len - 1, L - 1, device=dev)
    out = []
    for start in range(0, len(anchors), chunk):
        anc = anchors[start : start + chunk]
        blocks = torch.full((len(anc), B), mask_id, dtype=torch.long, device=dev)
        blocks[:, 0] = seq[anc]
        layout = block_layout(anc[None], B)  # built on the device, like the mask
        h = hidden_states(model, blocks.reshape(1, -1), layout, cache=cache, cache_len=L - 1, plain=False)
        logits = logits_at(model, h.reshape(len(anc), B, -1)[:, : B - 1], vocab_size)
        pos = anc[:, None] + 1 + torch.arange(B - 1, device=dev)
        truth = torch.where(pos < L, seq[pos.clamp(max=L - 1)], torch.full_like(pos, -1))
        out.append(drafts.match_depth(logits, truth))
        cache.crop(-(cache.get_seq_length() - (L - 1)))  # drop this chunk's blocks
    return torch.cat(out).cpu() if out else torch.empty(0, dtype=torch.long)


def shape_of(drafts: Drafts | None, block_size: int) -> Drafts:
    """The drafts whose greedy τ is estimated: the chain of `block_size` when None."""
    if drafts is None:
        return Chain(DecodeConfig(block_size=block_size), block_size, None)
    if drafts.B != block_size:
        raise ValueError(f"drafts of block {drafts.B} scored at block_size {block_size}: build them with the drafter's block size")
    return drafts


def greedy_rounds(m: torch.Tensor, prompt_len: int, length: int, block_size: int) -> list[int]:
    """τ of each round of the greedy loop, given m(a) for anchors prompt_len-1 .. length-2."""
    taus, a = [], prompt_len - 1
    while a < length - 1:
        tau = min(int(m[a - (prompt_len - 1)]), block_size - 1) + 1
        tau = min(tau, length - 1 - a)
        taus.append(tau)
        a += tau
    return taus


@torch.no_grad()
def estimate_acceptance(model, examples, block_size: int, mask_id: int, vocab_size: int | None = None,
                        chunk: int = 64, drafts: Drafts | None = None) -> AcceptanceStats:
    """Exact greedy τ of `model` on target greedy responses (`examples`: d3d.objective.Example), for
    the chain or for `drafts` (d3d.decoding.methods.drafts_of: a tree, say)."""
    was_training = model.training
    model.eval()
    stats = AcceptanceStats(slot_hits=[0] * (block_size - 1))
    for ex in examples:
        if len(ex.ids) - ex.prompt_len < 1:
            continue
        m = match_lengths(model, ex.ids, ex.prompt_len, block_size, mask_id, vocab_size, chunk, drafts)
        taus = greedy_rounds(m, ex.prompt_len, len(ex.ids), block_size)
        stats.taus += taus
        stats.per_sequence.append(sum(taus) / len(taus))
        stats.anchors += len(m)
        for k in range(1, block_size):
            stats.slot_hits[k - 1] += int((m >= k).sum())
    model.train(was_training)
    return stats
