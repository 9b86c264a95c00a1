"""One KV-cache discipline for the target and the drafter, batched and ragged.

Rows of a batch advance at different speeds (each accepts its own number of drafts), yet share one
HF DynamicCache. So a cache slot is not a position: `pos` (b, n) holds each slot's position id and
`valid` (b, n) says whether a later query may see it (False for left padding, rejected drafts,
block tokens). Every forward goes through `KVState.forward`, which builds the d3d mask from the
layout of the new tokens plus these two tensors, and appends the new slots.
"""

from __future__ import annotations

import torch

from d3d.models.drafter import hidden_states
from d3d.models.masks import CLEAN, Layout


class KVState:
    def __init__(self, model, batch: int):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.pos = torch.zeros(batch, 0, dtype=torch.long)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool)

    def __len__(self) -> int:
        return self.pos.shape[1]

    def forward(self, input_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Hidden states of the new tokens; their slots are appended (visible iff clean)."""
        h = hidden_states(self.model, input_ids.to(self.device), layout, cache=self.cache,
                          cache_valid=self.valid, cache_pos=self.pos)
        self.pos = torch.cat([self.pos, layout.pos.cpu()], dim=1)
        self.valid = torch.cat([self.valid, (layout.block == CLEAN).cpu()], dim=1)
        return h

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on."""
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)
            self.pos, self.valid = self.pos[:, :length], self.valid[:, :length]

    def keep_first(self, start: int, counts: torch.Tensor) -> None:
        """Of the slots from `start` on, row r keeps its first counts[r] visible and hides the
        rest; slots no row keeps are dropped."""
        span = torch.arange(len(self) - start)
        self.valid[:, start:] &= span[None, :] < counts.cpu()[:, None]
        self.crop(start + int(counts.max()) if len(counts) else start)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only some rows of the batch (finished requests leave)."""
        self.cache.batch_select_indices(rows.to(self.device))
        self.pos, self.valid = self.pos[rows.cpu()], self.valid[rows.cpu()]
