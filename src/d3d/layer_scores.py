"""Greedy τ of a drafter without each of its layers, every layer in one sweep (docs/design.md, Pruning).

Acceptance-guided pruning asks, for every layer l, the exact greedy τ of the drafter without l
(d3d.estimator). Asked one layer at a time that is L whole estimates, and on the Qwen2.5-Coder-0.5B
drafter (24 layers) on 2 CPU cores about 35 minutes a step. Three things make it minutes:

- **What candidates share is computed once.** Without layer l, layers 0..l-1 see exactly the input
  they see in the whole drafter. So one forward of the whole drafter records every layer's input
  h_l, and the drafter without l is layers l+1.. run on h_l: the L candidates cost L/2 whole
  forwards, not L (plus the one that records).
- **One packed forward per response**: `[response | a block at every anchor]` under the d3d mask
  (the training layout: each block sees the clean tokens before its anchor and itself), which is
  what the estimator's cached prefix + chunks of blocks compute (contract 3), in one pass.
- **LM-head rows only where they can matter** (chains: Chain.match_depth_from): slot k's logits are
  needed only for the anchors whose first k-1 drafts all matched; the head (152k rows on Qwen)
  otherwise costs a sixth of a forward per candidate.

Then m(a), the leading drafts that equal the response, and the same walk as the estimator
(`greedy_rounds`): the τ is exact up to the rounding of one packed pass against chunked ones (the
two layouts put masked keys in different places; bit-equal τ is tested in fp32).

`anchor_fraction < 1` is the cheaper, *sampled* estimator: each response keeps a seeded uniform
subset of its anchors, and τ̂ = the mean over them of min(m(a), B-1) + 1, the acceptance length of a
round anchored at a random position (the walk's τ when m does not depend on where a round starts).
It is a proxy: prune ranks layers by it, and measures the chosen one's τ with the exact estimator
(its rank agreement with the exact scores: scripts/prune_study.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from d3d.decoding.drafts import Drafts
from d3d.estimator import greedy_rounds, shape_of
from d3d.models.drafter import decoder_layers, skipping_layers
from d3d.models.forward import attention_mask_for, causal_blocks, logits_at
from d3d.models.masks import block_layout, build_mask, clean_layout, concat


@dataclass
class LayerScores:
    """Rounds of the greedy walk (or sampled anchors) per candidate: index l = without layer l,
    index L (the last) = the whole drafter."""

    tokens: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)

    def add(self, other: "LayerScores") -> None:
        if not self.tokens:
            self.tokens, self.rounds = [0.0] * len(other.tokens), [0] * len(other.rounds)
        self.tokens = [a + b for a, b in zip(self.tokens, other.tokens)]
        self.rounds = [a + b for a, b in zip(self.rounds, other.rounds)]

    @property
    def taus(self) -> list[float]:
        """τ per candidate: committed tokens / rounds (the estimator's AcceptanceStats.tau)."""
        return [t / max(r, 1) for t, r in zip(self.tokens, self.rounds)]


def anchors_of(length: int, prompt_len: int, fraction: float, seed: int) -> torch.Tensor:
    """All anchors prompt_len-1 .. length-2, or a seeded uniform subset of ceil(fraction * n)."""
    anchors = torch.arange(prompt_len - 1, length - 1)
    if fraction >= 1.0 or len(anchors) == 0:
        return anchors
    keep = max(1, int(-(-fraction * len(anchors) // 1)))
    pick = torch.randperm(len(anchors), generator=torch.Generator().manual_seed(seed))[:keep]
    return anchors[pick.sort().values]


class _LayerInputs:
    """Records the input hidden states of every decoder layer during one forward."""

    def __init__(self, model):
        self.inputs: list[torch.Tensor | None] = [None] * len(decoder_layers(model))
        self.handles = [layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i, layer in enumerate(decoder_layers(model))]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self.inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _upper(model, h: torch.Tensor, first: int, mask, pos: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states of layers first.. run on `h`, their input in the whole drafter."""
    with skipping_layers(model, list(range(first))):
        out = model.base_model(inputs_embeds=h, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.last_hidden_state


@torch.no_grad()
def score_layers(model, examples, block_size: int, mask_id: int, vocab_size: int | None = None,
                 drafts: Drafts | None = None, anchor_fraction: float = 1.0, seed: int = 0,
                 progress=None, share: tuple[int, int] = (0, 1)) -> LayerScores:
    """τ of the drafter without each layer (and, last, with all of them) on target greedy responses.

    `progress(i)` is called after each response (a progress bar). With anchor_fraction = 1 the τ are
    the estimator's walk; below 1 the sampled estimator of the module docstring. `drafts`: the shape
    whose τ scores (the chain when None; d3d.decoding.methods.drafts_of for another). `share`:
    (rank, processes): this process scores every processes-th response from its rank, each with the
    anchors it would get in the whole set, so the counts of all shares add up to the whole set's
    (`LayerScores.add`; d3d.prune sums them over processes)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    B, n_layers = block_size, len(decoder_layers(model))
    drafts = shape_of(drafts, B)
    head = lambda h: logits_at(model, h, vocab_size)  # noqa: E731
    total = LayerScores([0.0] * (n_layers + 1), [0] * (n_layers + 1))  # a share with no response adds zeros
    rank, processes = share
    for i, ex in enumerate(examples):
        L = len(ex.ids)
        if i % processes != rank or L - ex.prompt_len < 1:
            continue
        seq = torch.tensor(ex.ids, dtype=torch.long, device=dev)
        anc = anchors_of(L, ex.prompt_len, anchor_fraction, seed * 1_000_003 + i).to(dev)
        blocks = torch.full((len(anc), B), mask_id, dtype=torch.long, device=dev)
        blocks[:, 0] = seq[anc]
        layout = concat(clean_layout(L - 1, device=dev), block_layout(anc[None], B))
        ids = torch.cat([seq[: L - 1], blocks.reshape(-1)])[None]
        mask = attention_mask_for(model, build_mask(layout, causal_blocks=causal_blocks(model)))
        pos = layout.pos
        truth_pos = anc[:, None] + 1 + torch.arange(B - 1, device=dev)
        truth = torch.where(truth_pos < L, seq[truth_pos.clamp(max=L - 1)], torch.full_like(truth_pos, -1))
        with _LayerInputs(model) as rec:
            whole = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        finals = [_upper(model, rec.inputs[l], l + 1, mask, pos) for l in range(n_layers)] + [whole]
        ex_scores = LayerScores()
        for final in finals:
            h = final[0, L - 1 :].reshape(len(anc), B, -1)[:, : B - 1]
            m = drafts.match_depth_from(h, head, truth).cpu()
            if anchor_fraction >= 1.0:
                taus = greedy_rounds(m, ex.prompt_len, L, B)
                ex_scores.tokens.append(float(sum(taus)))
                ex_scores.rounds.append(len(taus))
            else:  # the sampled estimator: a round at each sampled anchor, capped at the tokens left
                left = (L - 1 - anc.cpu())
                per = torch.minimum(m.clamp(max=B - 1) + 1, left)
                ex_scores.tokens.append(float(per.sum()))
                ex_scores.rounds.append(len(per))
        total.add(ex_scores)
        if progress:
            progress(i)
    model.train(was_training)
    return total


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")
