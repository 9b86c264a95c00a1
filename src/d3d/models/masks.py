"""The one attention-mask builder of d3d: training, the offline estimator and every decoding loop.

Every token is either *clean* (part of the committed text, processed causally) or belongs to a
*block* (an anchor token followed by masks, drafted in one pass). One rule covers every layout:

    a clean query at position p sees clean keys at positions <= p;
    a block query whose anchor sits at position a sees clean keys at positions < a,
      and every token of its own block (bidirectional inside the block);
    nothing else: blocks never see each other, clean tokens never see blocks, padding is unseen.

A drafter trained with `drafter.block_attention=causal` (docs/design.md, Causal blocks) changes one
clause: a block query at position p sees only the tokens of its own block at positions <= p. Its
block pass is then an ordinary causal pass over [prefix, anchor, MASK ...], which is what an
inference engine runs for a parallel draft. Every builder below takes that choice as
`causal_blocks`, and d3d.models.forward reads it from the model, so no pass can disagree with training.

Keys already in a KV cache are clean tokens at positions 0..C-1. A layout is described per token
by three integer tensors: `pos` (its position id), `block` (block index, -1 for clean) and `limit`
(the exclusive upper bound on the clean positions it may see: p+1 for clean tokens, the anchor
position for block tokens). Padding has block = -2 and is never seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLEAN, PAD = -1, -2


@dataclass
class Layout:
    """Per-token description of a packed input (batch, T) — see the module docstring."""

    pos: torch.Tensor  # (b, T) position ids
    block: torch.Tensor  # (b, T) block index, CLEAN or PAD
    limit: torch.Tensor  # (b, T) clean keys visible: position < limit

    @property
    def shape(self) -> torch.Size:
        return self.pos.shape


def clean_layout(length: int, start: int = 0, batch: int = 1, device: torch.device | str | None = None) -> Layout:
    """`length` causal tokens at positions start..start+length-1 (on `device`, default the CPU)."""
    pos = torch.arange(start, start + length, device=device or "cpu").expand(batch, -1)
    return Layout(pos.clone(), torch.full_like(pos, CLEAN), pos + 1)


def block_layout(anchors: torch.Tensor, block_size: int, first_block: int = 0) -> Layout:
    """Blocks of `block_size` at the given anchor positions (b, n): n*B tokens per row."""
    b, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    pos = (anchors[:, :, None] + offsets).reshape(b, n * block_size)
    block = (torch.arange(n, device=anchors.device)[:, None].expand(n, block_size) + first_block)
    block = block.reshape(1, n * block_size).expand(b, -1).clone()
    limit = anchors[:, :, None].expand(b, n, block_size).reshape(b, n * block_size).clone()
    return Layout(pos, block, limit)


def concat(*layouts: Layout) -> Layout:
    return Layout(*(torch.cat([getattr(l, f) for l in layouts], dim=1) for f in ("pos", "block", "limit")))


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """(b, T, T) bool: node i may see node j iff j is i or one of its ancestors. `parents` (b, T):
    each node's parent index (< its own index), -1 for the root. Made on the device without asking
    it anything: the closure of "is my parent" by repeated squaring, log2(T) boolean products."""
    b, t = parents.shape
    dev = parents.device
    eye = torch.eye(t, dtype=torch.bool, device=dev).expand(b, t, t)
    up = torch.nn.functional.one_hot(parents.clamp(min=0), t).bool() & (parents >= 0)[:, :, None]
    anc = eye | up
    for _ in range(max(t - 1, 1).bit_length()):  # paths of length <= 2^k after k squarings
        anc = anc | (torch.bmm(anc.float(), anc.float()) > 0)
    return anc


def tree_layout(root_pos: torch.Tensor, ancestors: torch.Tensor) -> Layout:
    """Clean tokens of a tree whose root (the pending token) sits at `root_pos` (b,): each node at
    the root's position + its depth, seeing clean keys up to its own position (build_mask's `tree`
    then keeps, of the in-row ones, only its ancestors)."""
    pos = root_pos[:, None] + ancestors.sum(-1) - 1  # depth = ancestors, itself excluded
    return Layout(pos, torch.full_like(pos, CLEAN), pos + 1)


def build_mask(query: Layout, cache_len: int | torch.Tensor = 0, cache_valid: torch.Tensor | None = None,
               cache_pos: torch.Tensor | None = None, tree: torch.Tensor | None = None, *,
               causal_blocks: bool) -> torch.Tensor:
    """Boolean mask (b, 1, T, cache_len + T): True where a query may attend to a key.

    Keys are the `cache_len` cached clean tokens followed by the query tokens themselves. Cached
    keys sit at positions 0..cache_len-1 unless `cache_pos` (b, cache_len) says otherwise (batched
    decoding, where rows advance at different speeds); `cache_valid` (b, cache_len) hides cache
    slots that hold padding or rejected drafts. `tree` (b, T, T), for a tree of drafts
    (`tree_ancestors`): query token i sees query token j only where tree[i, j] (the cached keys
    follow the clean rule as they are). `causal_blocks`: a block token sees only its block's tokens
    at positions up to its own (module docstring); asked of every caller, so none forgets it.
    """
    b, t = query.shape
    dev = query.pos.device
    if cache_pos is not None:
        cache_len = cache_pos.shape[1]
    c = int(cache_len)
    cache_pos = torch.arange(c, device=dev).expand(b, c) if cache_pos is None else cache_pos.to(dev)
    key_pos = torch.cat([cache_pos, query.pos], dim=1)  # (b, K)
    key_block = torch.cat([torch.full((b, c), CLEAN, device=dev, dtype=query.block.dtype), query.block], dim=1)
    key_clean = key_block == CLEAN
    if cache_valid is not None:
        key_clean = key_clean & torch.cat([cache_valid.to(dev), torch.ones(b, t, dtype=torch.bool, device=dev)], dim=1)
    sees_clean = key_clean[:, None, :] & (key_pos[:, None, :] < query.limit[:, :, None])
    same_block = (key_block[:, None, :] == query.block[:, :, None]) & (query.block[:, :, None] >= 0)
    if causal_blocks:
        same_block = same_block & (key_pos[:, None, :] <= query.pos[:, :, None])
    mask = sees_clean | same_block
    if tree is not None:
        mask = torch.cat([mask[:, :, :c], mask[:, :, c:] & tree.to(dev)], dim=2)
    # A padding query sees only itself, so softmax never runs over an empty row (no NaNs). Written
    # without a data-dependent branch: asking the device "is there padding?" would cost a sync.
    itself = torch.arange(c + t, device=dev)[None, :] == (c + torch.arange(t, device=dev))[:, None]
    mask = torch.where((query.block == PAD)[:, :, None], itself[None], mask)
    return mask[:, None]


def pad_layout(layout: Layout, length: int) -> Layout:
    """Right-pad a layout to `length` tokens with unseen padding."""
    b, t = layout.shape
    if t >= length:
        return layout
    extra = length - t
    fill = lambda v: torch.full((b, extra), v, dtype=layout.pos.dtype, device=layout.pos.device)
    return Layout(torch.cat([layout.pos, fill(0)], 1), torch.cat([layout.block, fill(PAD)], 1),
                  torch.cat([layout.limit, fill(0)], 1))


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask for eager attention (SDPA takes the boolean mask as it is)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def mask_mod_for(query: Layout, cache_len: int = 0, *, causal_blocks: bool):
    """build_mask's rule as a flex_attention `mask_mod(b, h, q, kv) -> bool`, for a layout whose
    cached keys (if any) are the clean positions 0..cache_len-1. Index tensors, no (T, K) tensor:
    flex evaluates it per tile on the device, so a long packed row never builds a dense mask."""
    pos, block, limit = query.pos, query.block, query.limit
    c = int(cache_len)

    def mask_mod(b, h, q, kv):
        t = (kv - c).clamp(min=0)  # the query-token index of an in-row key (kv >= c)
        in_cache = kv < c
        key_pos = torch.where(in_cache, kv, pos[b, t])
        key_block = torch.where(in_cache, CLEAN, block[b, t])
        q_block = block[b, q]
        sees_clean = (key_block == CLEAN) & (key_pos < limit[b, q])
        same_block = (key_block == q_block) & (q_block >= 0)
        if causal_blocks:
            same_block = same_block & (key_pos <= pos[b, q])
        # A padding query sees only itself (as in build_mask), so its softmax row is never empty.
        return torch.where(q_block == PAD, kv == q + c, sees_clean | same_block)

    return mask_mod


def block_mask(query: Layout, cache_len: int = 0, block_size: int = 128, *, causal_blocks: bool):
    """The d3d mask as a flex_attention `BlockMask`, built on the layout's device (docs/design.md, Training: flex on
    CUDA). Tiles that nothing in them may see are skipped, which a dense SDPA mask cannot do."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = query.shape
    mask_mod = mask_mod_for(query, cache_len, causal_blocks=causal_blocks)
    return create_block_mask(mask_mod, b, None, t, int(cache_len) + t,
                             device=query.pos.device, BLOCK_SIZE=block_size)
