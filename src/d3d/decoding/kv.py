"""One KV-cache discipline for the target and the drafter, batched and ragged.

Rows of a batch advance at different speeds (each accepts its own number of drafts), yet share one
HF DynamicCache. So a cache slot is not a position: `pos` (b, n) holds each slot's position id and
`valid` (b, n) says whether a later query may see it (False for left padding, rejected drafts,
block tokens). Every forward goes through `KVState.forward`, which builds the d3d mask from the
layout of the new tokens plus these two tensors, and appends the new slots.

`pos` and `valid` live on the model's device, like the cache itself: building a mask never moves
data between host and device. The only host-side knowledge is `gapless`: True while every slot is
visible and slot i holds position i of the one row (batch 1), which lets a causal query skip the
mask entirely (SDPA's causal fast path) without asking the device.
"""

from __future__ import annotations

import torch

from d3d.models.forward import hidden_states
from d3d.models.masks import CLEAN, Layout


class KVState:
    def __init__(self, model, batch: int):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.pos = torch.zeros(batch, 0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        self.gapless = batch == 1

    def __len__(self) -> int:
        return self.pos.shape[1]

    def forward(self, input_ids: torch.Tensor, layout: Layout, causal: bool = False) -> torch.Tensor:
        """Hidden states of the new tokens; their slots are appended (visible iff clean).
        `causal=True` promises the caller's tokens are clean and run on from the cache's positions."""
        h = hidden_states(self.model, input_ids, layout, cache=self.cache, cache_valid=self.valid,
                          cache_pos=self.pos, plain=causal and self.gapless)
        self.pos = torch.cat([self.pos, layout.pos], dim=1)
        self.valid = torch.cat([self.valid, layout.block == CLEAN], dim=1)
        return h

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on."""
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)
            self.pos, self.valid = self.pos[:, :length], self.valid[:, :length]

    def keep_first(self, start: int, counts: torch.Tensor, most: int) -> None:
        """Of the slots from `start` on, row r keeps its first counts[r] visible and hides the
        rest; slots no row keeps are dropped. `most` = max(counts), known on the host already
        (asking the device for it would cost a synchronisation)."""
        span = torch.arange(len(self) - start, device=self.device)
        self.valid[:, start:] &= span[None, :] < counts[:, None]
        self.crop(start + most)  # batch 1: most == counts[0], so no hidden slot is left (gapless holds)

    def subset(self, rows: torch.Tensor) -> "KVState":
        """A separate state holding copies of some rows (a pass over a few rows that must leave
        the rest alone; its KV rows are copied, so it costs a read of those rows' cache)."""
        from transformers import DynamicCache

        sub = KVState.__new__(KVState)
        sub.model, sub.device, sub.gapless = self.model, self.device, self.gapless and len(rows) == 1
        layers = [(layer.keys[rows], layer.values[rows]) for layer in self.cache.layers]
        sub.cache = DynamicCache(layers, config=self.model.config)
        sub.pos, sub.valid = self.pos[rows], self.valid[rows]
        return sub

    def select(self, rows: torch.Tensor) -> None:
        """Keep only some rows of the batch (finished requests leave); `rows` on the device."""
        from transformers import DynamicCache

        if len(self) == 0:  # HF skips empty layers when selecting rows: they would keep the old batch size
            self.cache = DynamicCache(config=self.model.config)
        else:
            self.cache.batch_select_indices(rows)
        self.pos, self.valid = self.pos[rows], self.valid[rows]
