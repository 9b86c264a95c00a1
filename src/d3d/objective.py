"""The D3D training objective (docs/design.md, Training): blockwise denoising + weighted AR loss, one packed pass.

Per sequence the packed input is `[clean sequence | block_1 | ... | block_N]`:
- the clean sequence runs causally; its outputs on the response give the AR loss (weight λ);
- block i is `[x_a, MASK x (B-1)]` at positions a..a+B-1 for an anchor a in the response; it sees
  the clean tokens before a and itself (d3d.models.masks). Slot j predicts x_{a+j+1} with weight
  exp(-j/γ) (= exp(-(k-1)/γ) for the k-th draft). Slot B-1's target, x_{a+B}, is the bonus token.
Only rows that carry a loss go through the LM head. A drafter with a draft vocabulary (a head with
a `d2t` map) takes both losses over its N tokens: a target token outside them has no logit, so its
row is left out of the loss (it cannot be learnt) and counted (`dn_outside`, `ar_outside`: the
share of loss rows it was), and it counts as a miss in the slot accuracies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from d3d.models.drafter_settings import draft_map
from d3d.models.masks import Layout, block_layout, clean_layout, concat, pad_layout
from d3d.specs import ObjectiveKnobs


@dataclass
class Example:
    ids: list[int]  # prompt + response token ids
    prompt_len: int  # loss is taken on positions >= prompt_len only


@dataclass
class ObjectiveConfig(ObjectiveKnobs):
    block_size: int

    @classmethod
    def from_cfg(cls, knobs: ObjectiveKnobs, block_size: int) -> "ObjectiveConfig":
        """From `train.*` (d3d.specs.StepSettings) and the drafter's block size."""
        return cls(block_size=block_size, **{f.name: getattr(knobs, f.name) for f in fields(ObjectiveKnobs)})

    @classmethod
    def shipped(cls, block_size: int, **overrides) -> "ObjectiveConfig":
        """The objective of conf/training/default.yaml (the one home of its defaults) with `overrides`,
        for scripts and tests that build one without composing a config. Read with PyYAML: no OmegaConf
        on a bare GPU image (scripts/gpu_train_check.py)."""
        import yaml

        from d3d.configdir import config_dir

        train = yaml.safe_load((config_dir() / "training" / "default.yaml").read_text())
        return cls(block_size=block_size, **{**{f.name: train[f.name] for f in fields(ObjectiveKnobs)}, **overrides})


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (b, T)
    layout: Layout
    dn_rows: torch.Tensor  # flat indices into b*T of block slots carrying a denoising loss
    dn_targets: torch.Tensor
    dn_weights: torch.Tensor
    dn_slots: torch.Tensor  # slot index j of each denoising row (for per-slot accuracy)
    ar_rows: torch.Tensor  # flat indices of clean positions predicting a response token
    ar_targets: torch.Tensor
    n_tokens: int  # real (non-padding) tokens in the packed batch


def slot_weights(cfg: ObjectiveConfig) -> torch.Tensor:
    """w_j for slots j = 0..B-1 (the k-th draft is slot k-1)."""
    j = torch.arange(cfg.block_size, dtype=torch.float32)
    return torch.ones_like(j) if cfg.uniform_weights else torch.exp(-j / cfg.gamma)


def sample_anchors(ex: Example, cfg: ObjectiveConfig, gen: torch.Generator) -> torch.Tensor:
    """Anchor positions a in [prompt_len-1, len-2]: the block at a drafts response tokens a+1..."""
    lo, hi = ex.prompt_len - 1, len(ex.ids) - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    if cfg.block_aligned:
        candidates = torch.arange(lo, hi + 1, cfg.block_size)
    else:
        candidates = torch.arange(lo, hi + 1)
    if len(candidates) > cfg.anchors_per_seq:
        pick = torch.randperm(len(candidates), generator=gen)[: cfg.anchors_per_seq]
        candidates = candidates[pick]
    return candidates.sort().values


def pack(examples: list[Example], cfg: ObjectiveConfig, mask_id: int, pad_id: int,
         gen: torch.Generator, anchors: list[torch.Tensor] | None = None) -> PackedBatch:
    """Build the packed batch; `anchors` fixes the anchors (tests), else they are sampled."""
    B = cfg.block_size
    w = slot_weights(cfg)
    anchors = anchors if anchors is not None else [sample_anchors(ex, cfg, gen) for ex in examples]
    rows_ids, layouts = [], []
    dn_rows, dn_t, dn_w, dn_s, ar_rows, ar_t = [], [], [], [], [], []
    width = max(len(ex.ids) + len(a) * B for ex, a in zip(examples, anchors))
    n_tokens = 0
    for r, (ex, anc) in enumerate(zip(examples, anchors)):
        ids = torch.tensor(ex.ids, dtype=torch.long)
        L, n = len(ids), len(anc)
        blocks = torch.full((n, B), mask_id, dtype=torch.long)
        if n:
            blocks[:, 0] = ids[anc]
            if cfg.partial_mask > 0:  # some slots show their clean token (an option, off by default)
                show = torch.rand((n, B), generator=gen) < cfg.partial_mask
                show[:, 0] = False
                pos = (anc[:, None] + torch.arange(B)).clamp(max=L - 1)
                blocks = torch.where(show & (anc[:, None] + torch.arange(B) < L), ids[pos], blocks)
        layout = concat(clean_layout(L), block_layout(anc[None], B))
        layouts.append(pad_layout(layout, width))
        row = torch.full((width,), pad_id, dtype=torch.long)
        row[:L] = ids
        row[L : L + n * B] = blocks.reshape(-1)
        rows_ids.append(row)
        n_tokens += L + n * B
        # AR loss: clean position i predicts x_{i+1}, for response targets i+1 >= prompt_len.
        src = torch.arange(ex.prompt_len - 1, L - 1)
        ar_rows.append(r * width + src)
        ar_t.append(ids[src + 1])
        # Denoising loss: block b slot j predicts x_{a_b+j+1} while that position exists (all of a
        # row's blocks at once: a loop over anchors was most of the data time of a step).
        slots = B if cfg.predict_bonus else B - 1
        j = torch.arange(slots).expand(n, slots)
        exists = j < (L - 1 - anc)[:, None]
        j = j[exists]
        block = torch.arange(n)[:, None].expand(n, slots)[exists]
        dn_rows.append(r * width + L + block * B + j)
        dn_t.append(ids[anc[block] + 1 + j])
        dn_w.append(w[j])
        dn_s.append(j)
    cat = lambda xs, dtype=torch.long: torch.cat(xs) if xs else torch.empty(0, dtype=dtype)
    return PackedBatch(
        torch.stack(rows_ids), Layout(*(torch.cat([getattr(l, f) for l in layouts]) .reshape(len(examples), width)
                                        for f in ("pos", "block", "limit"))),
        cat(dn_rows), cat(dn_t), cat(dn_w, torch.float32), cat(dn_s), cat(ar_rows), cat(ar_t), n_tokens,
    )


def draft_targets(head, targets: torch.Tensor) -> torch.Tensor:
    """Target token ids as the head's row ids: themselves for a full head; for a draft vocabulary
    (draft_map(head), sorted) the row of each, -1 for a token outside it."""
    d2t = draft_map(head)
    if d2t is None:
        return targets
    row = torch.searchsorted(d2t, targets).clamp(max=len(d2t) - 1)
    return torch.where(d2t[row] == targets, row, -1)


def _weighted_ce(head, hidden: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                 vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`targets` are row ids of the head (draft_targets); -1 rows carry no loss and never hit."""
    logits = head(hidden)
    logits = (logits[..., :vocab_size] if vocab_size else logits).float()
    ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-1)
    return (ce * weights).sum(), logits.argmax(-1) == targets


def chunked_weighted_ce(head, hidden: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                        vocab_size: int | None, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_i w_i·CE_i, argmax hit per row) through the LM head, `chunk_rows` rows at a time.

    A Qwen3 micro-batch has ~25k loss rows and a 152k vocabulary: their fp32 logits alone would be
    ~15 GB. Each chunk's logits are recomputed in backward (activation checkpointing), so at most
    one chunk's (rows, V) tensor is alive at any time."""
    total = hidden.new_zeros((), dtype=torch.float32)
    hits = []
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    for s in range(0, hidden.shape[0], chunk_rows):
        args = (head, hidden[s : s + chunk_rows], targets[s : s + chunk_rows], weights[s : s + chunk_rows], vocab_size)
        if recompute:
            part, hit = torch.utils.checkpoint.checkpoint(_weighted_ce, *args, use_reentrant=False)
        else:
            part, hit = _weighted_ce(*args)
        total = total + part
        hits.append(hit)
    return total, (torch.cat(hits) if hits else targets.new_zeros(0, dtype=torch.bool))


def loss_from_hidden(hidden: torch.Tensor, head, batch: PackedBatch, ar_weight: float, vocab_size: int | None,
                     chunk_rows: int = 4096) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = L_denoise + λ·L_AR from the packed forward's final hidden states (b, T, d), with logits
    only at loss rows. Metrics stay 0-dim tensors on the device (read them with metrics_to_floats:
    one host transfer per step, not one per metric)."""
    dev = hidden.device
    h = hidden.reshape(-1, hidden.shape[-1])
    targets, w = draft_targets(head, batch.dn_targets.to(dev)), batch.dn_weights.to(dev)
    inside = targets >= 0
    w = w * inside  # a token outside a draft vocabulary: no loss, and not in the weights' sum
    dn_sum, hit = chunked_weighted_ce(head, h[batch.dn_rows.to(dev)], targets, w, vocab_size, chunk_rows)
    loss_dn = dn_sum / w.sum().clamp(min=1e-9)
    loss = loss_dn
    metrics = {"loss_denoise": loss_dn.detach()}
    if draft_map(head) is not None:
        metrics["dn_outside"] = (~inside).float().mean() if len(inside) else torch.zeros((), device=dev)
    if len(batch.dn_slots):
        # Per-slot accuracy: hits summed per slot on the device; the counts are known on the host.
        counts = torch.bincount(batch.dn_slots)
        slot_hits = torch.zeros(len(counts), device=dev).index_add_(0, batch.dn_slots.to(dev), hit.float())
        for j, n in enumerate(counts.tolist()):
            if n:
                metrics[f"acc_slot{j + 1}"] = slot_hits[j] / n
    if ar_weight > 0 and len(batch.ar_rows):
        ar_t = draft_targets(head, batch.ar_targets.to(dev))
        ar_in = (ar_t >= 0).float()
        ar_sum, _ = chunked_weighted_ce(head, h[batch.ar_rows.to(dev)], ar_t, ar_in, vocab_size, chunk_rows)
        loss_ar = ar_sum / ar_in.sum().clamp(min=1)
        if draft_map(head) is not None:
            metrics["ar_outside"] = 1 - ar_in.mean()
        loss = loss + ar_weight * loss_ar
        metrics["loss_ar"] = loss_ar.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    values = torch.stack([v.float() for v in metrics.values()]).tolist() if metrics else []
    return dict(zip(metrics, values))


def weight_of_draft(k: int, gamma: float) -> float:
    """w_k = exp(-(k-1)/γ) for the k-th draft (1-based), as docs/design.md, Training writes it."""
    return math.exp(-(k - 1) / gamma)
