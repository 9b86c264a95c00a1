"""The masked forward pass every component runs a drafter (or the target) through: the training
step, the offline estimator, the budget timer and each decoding pass (docs/design.md, One mask builder).

It works on any HF causal LM, not only a drafter: a packed input of clean tokens and blocks (a
d3d.models.masks.Layout), optionally after a KV cache, goes through the backbone under the one d3d
mask in the form the attention backend takes (SDPA's boolean mask, eager's additive one, flex's
BlockMask), and the LM head runs only on the rows a caller picks.

Whether a block attends causally inside itself is the model's own setting (`causal_blocks`, from the
drafter's saved `block_attention`), read here for every pass: training, the estimator, pruning's
scorer and every decoding pass build their masks with it, so none of them can disagree.
"""

from __future__ import annotations

import torch

from d3d.models.drafter_settings import DrafterSettings, draft_map
from d3d.models.masks import Layout, block_mask, build_mask, float_mask


def causal_blocks(model) -> bool:
    """True for a drafter saved with block_attention=causal (docs/design.md, Causal blocks). A model
    without d3d settings (the target) never sees a block, so the rule does not matter for it."""
    settings = DrafterSettings.of(model, required=False)
    return settings is not None and settings.block_attention == "causal"


def attention_mask_for(model, mask):
    """SDPA takes the boolean mask; eager wants an additive one; flex takes only a `BlockMask`
    (transformers adds a tensor mask to flex's scores: a bool mask would be a +1/+0 bias that masks
    nothing, docs/design.md, One mask builder), so a tensor under flex is refused rather than silently ignored."""
    impl = model.config._attn_implementation
    if impl == "flex_attention":
        if isinstance(mask, torch.Tensor):
            raise TypeError("flex_attention needs a BlockMask (d3d.models.masks.block_mask), not a "
                            f"{mask.dtype} tensor: transformers would add it to the scores and mask nothing")
        return mask
    if impl == "eager":
        return float_mask(mask, model.dtype)
    return mask


def packed_attention_mask(model, layout: Layout):
    """The d3d mask of a packed training input, built on the layout's device (move the layout
    first): a BlockMask under flex_attention, else build_mask's dense mask as the backend wants it."""
    causal = causal_blocks(model)
    if model.config._attn_implementation == "flex_attention":
        return block_mask(layout, causal_blocks=causal)
    return attention_mask_for(model, build_mask(layout, causal_blocks=causal))


def hidden_states(model, input_ids: torch.Tensor, layout: Layout, cache=None, cache_len: int = 0,
                  cache_valid: torch.Tensor | None = None, cache_pos: torch.Tensor | None = None,
                  plain: bool | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states (normed) of a packed input under the d3d mask; fills `cache` if given.

    When the mask would be plain causal attention over an all-visible prefix (batch-1 decoding),
    no mask is passed, so HF/SDPA take their causal fast path; the result is the same. `plain`
    says so from what the caller knows (the decoding loop: no device sync); None = find out.
    `tree` (b, T, T): the new tokens are a tree of drafts (masks.build_mask), never plain."""
    if tree is not None:
        plain = False
    if plain is None:
        plain = _is_plain_causal(layout, cache_len, cache_valid, cache_pos)
    if plain:
        attention_mask = None
    else:
        mask = build_mask(layout, cache_len, cache_valid, cache_pos, tree, causal_blocks=causal_blocks(model))
        attention_mask = attention_mask_for(model, mask.to(input_ids.device))
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=layout.pos.to(input_ids.device), use_cache=cache is not None, **cache_kwarg(model, cache),
    )
    return out.last_hidden_state


def _is_plain_causal(layout: Layout, cache_len, cache_valid, cache_pos) -> bool:
    """True when every token is clean, the cache is fully visible and positions run on from it."""
    from d3d.models.masks import CLEAN

    if layout.pos.shape[0] != 1 or not bool((layout.block == CLEAN).all()):
        return False
    dev = layout.pos.device
    c = cache_pos.shape[1] if cache_pos is not None else int(cache_len)
    if cache_valid is not None and not bool(cache_valid.all()):
        return False
    if cache_pos is not None and c and not torch.equal(cache_pos[0], torch.arange(c, device=cache_pos.device)):
        return False
    return torch.equal(layout.pos[0], torch.arange(c, c + layout.pos.shape[1], device=dev))


def cache_kwarg(model, cache) -> dict:
    """transformers >= 5.24 calls the KV cache `cache`; earlier releases `past_key_values`."""
    import inspect

    params = inspect.signature(type(model.base_model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def logits_at(model, hidden: torch.Tensor, vocab_size: int | None = None, draft_ids: bool = False) -> torch.Tensor:
    """LM-head logits of selected hidden rows, cut to the target's vocabulary.

    The rows go through the head as one contiguous 2-D matrix: a strided 3-D slice (a block's draft
    slots) makes torch's matmul broadcast the head's weight into a batched one, copying all of it
    once per block when the weight does not require grad (a frozen or untied head): 35 of 39 s of
    an estimate on the Qwen drafter went to that copy.

    A drafter with a draft vocabulary (a head with a map, draft_map; d3d.models.drafter.DraftHead) gives
    its N logits scattered into the target's vocabulary, -inf elsewhere (so q is 0 there), unless
    `draft_ids`: then its N logits as they are (the decoding passes keep them so; Passes.target_vocab)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    head = model.get_output_embeddings()
    logits = head(flat).reshape(*hidden.shape[:-1], -1)
    d2t = draft_map(head)
    if d2t is not None:
        return logits if draft_ids else in_target_vocab(logits, d2t, vocab_size or DrafterSettings.of(model).vocab_size)
    return logits[..., :vocab_size] if vocab_size else logits


def in_target_vocab(logits: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits (..., N) as target-vocabulary logits (..., vocab_size): column d2t[i]
    holds logit i, every other column -inf, so the argmax is d2t of the draft argmax and a softmax
    (with any temperature, top-k, top-p) puts exactly zero outside the draft vocabulary. Unchanged
    when `d2t` is None (a full head)."""
    if d2t is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, d2t.to(logits.device), logits)
