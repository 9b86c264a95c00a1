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

from d3d.errors import ConfigError
from d3d.models.forward import attention_mask_for, cache_kwarg, causal_blocks, hidden_states
from d3d.models.masks import CLEAN, Layout, build_mask
from d3d.models.target import input_device

# How passes run (docs/design.md, Backends): eager (HF's dynamic cache, the reference) | static
# (preallocated slots) | compiled (static + torch.compile; CUDA graphs on CUDA) | frozen (compiled,
# weights folded into the graph: prepacked for oneDNN on CPU)
BACKENDS = ("eager", "static", "compiled", "frozen")


class KVState:
    def __init__(self, model, batch: int):
        from transformers import DynamicCache

        self.model = model
        self.device = input_device(model)  # pos, valid and masks; a spread target's layers keep their K/V where they run
        self.cache = DynamicCache(config=model.config)
        self.pos = torch.zeros(batch, 0, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        self.gapless = batch == 1

    def __len__(self) -> int:
        return self.pos.shape[1]

    def forward(self, input_ids: torch.Tensor, layout: Layout, causal: bool = False, once: bool = False,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the new tokens; their slots are appended (visible iff clean).
        `causal=True` promises the caller's tokens are clean and run on from the cache's positions;
        `once=True` says this pass's shape will not recur (prefill): a static state runs it uncompiled;
        `tree` (b, T, T): the new tokens are a tree of drafts, each seeing its ancestors (masks.build_mask)."""
        h = hidden_states(self.model, input_ids, layout, cache=self.cache, cache_valid=self.valid,
                          cache_pos=self.pos, plain=causal and self.gapless, tree=tree)
        self.pos = torch.cat([self.pos, layout.pos], dim=1)
        self.valid = torch.cat([self.valid, layout.block == CLEAN], dim=1)
        return h

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on."""
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)
            self.pos, self.valid = self.pos[:, :length], self.valid[:, :length]

    def keep(self, start: int, slots: torch.Tensor | None, counts: torch.Tensor, most: int) -> None:
        """Of the slots from `start` on, keep the first counts[r] (slots None) or those listed (b, k)."""
        if slots is None:
            self.keep_first(start, counts, most)
        else:
            self.keep_path(start, slots, counts, most)

    def keep_first(self, start: int, counts: torch.Tensor, most: int) -> None:
        """Of the slots from `start` on, row r keeps its first counts[r] visible and hides the
        rest; slots no row keeps are dropped. `most` = max(counts), known on the host already
        (asking the device for it would cost a synchronisation)."""
        span = torch.arange(len(self) - start, device=self.device)
        self.valid[:, start:] &= span[None, :] < counts[:, None]
        self.crop(start + most)  # batch 1: most == counts[0], so no hidden slot is left (gapless holds)

    def keep_path(self, start: int, slots: torch.Tensor, counts: torch.Tensor, most: int) -> None:
        """Of the slots from `start` on, row r keeps slots start + slots[r, :counts[r]] (increasing:
        a tree's accepted path, the pending token first) and drops the rest. The kept slots are
        moved to start, start+1, ... (a gather of `most` slots per layer), so the cache looks as the
        chain's keep_first leaves it: a prefix of visible slots (batch 1 stays gapless)."""
        idx = start + slots[:, :most]  # (b, most)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (b, heads, n, dim)
                at = on_layer(idx, t)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t[:, :, start : start + most] = t.gather(2, at)  # gather copies first: moving in place is safe
        self.pos[:, start : start + most] = self.pos.gather(1, idx)
        self.valid[:, start : start + most] = self.valid.gather(1, idx)
        self.keep_first(start, counts, most)

    def subset(self, rows: torch.Tensor) -> "KVState":
        """A separate state holding copies of some rows (a pass over a few rows that must leave
        the rest alone; its KV rows are copied, so it costs a read of those rows' cache)."""
        from transformers import DynamicCache

        sub = KVState.__new__(KVState)
        sub.model, sub.device, sub.gapless = self.model, self.device, self.gapless and len(rows) == 1
        layers = [(layer.keys[on_layer(rows, layer.keys)], layer.values[on_layer(rows, layer.values)])
                  for layer in self.cache.layers]
        sub.cache = DynamicCache(layers, config=self.model.config)
        sub.pos, sub.valid = self.pos[rows], self.valid[rows]
        return sub

    def select(self, rows: torch.Tensor) -> None:
        """Keep only some rows of the batch (finished requests leave); `rows` on the device."""
        from transformers import DynamicCache

        if len(self) == 0:  # HF skips empty layers when selecting rows: they would keep the old batch size
            self.cache = DynamicCache(config=self.model.config)
        else:
            for layer in self.cache.layers:  # each layer's rows where its K/V are (a spread target: several devices)
                layer.keys, layer.values = layer.keys[on_layer(rows, layer.keys)], layer.values[on_layer(rows, layer.values)]
        self.pos, self.valid = self.pos[rows], self.valid[rows]


class StaticKVState(KVState):
    """The same slots in buffers allocated once (decode.backend=static, compiled or frozen).

    A pass always has the same shapes (its q new tokens against all `capacity` slots), so it can
    be compiled once per shape: on CPU inductor removes the Python and dispatch overhead of a
    step; on CUDA it replays as a CUDA graph. HF's StaticCache writes the
    new keys at slot `cumulative_length` (a device tensor per layer, advanced in place), so the
    slot a pass writes is never a host number the graph would specialise on. Slots past the length
    hold stale keys: the mask hides them (`live`), so cropping is only moving the length back.

    Bookkeeping that HF keeps per layer (`cumulative_length`) is mirrored on the host by `length`
    (the driver knows every pass's width), so `len()` never asks the device.

    Batch buckets. The buffers hold `rows` = the batch rounded up to a power of two (`batch_bucket`)
    and every pass runs over all of them, the rows past the live `batch` padded (a copy of row 0's
    input, whose results are dropped). So a row retiring keeps the shape while the batch stays in
    its bucket (16 requests give at most 5 shapes per pass, not 16), each shape a graph to compile
    and, on CUDA, to capture. A padded row costs nothing on a GPU (the weights are read once) and
    what a row costs on a CPU. The uncompiled static backend pads too, so it stays the reference
    of what the compiled one runs."""

    def __init__(self, model, batch: int, capacity: int, compiled: bool, graphs: bool = True, frozen: bool = False,
                 buffers=None, side_graphs: "SideStreamGraphs | None" = None):
        self.model, self.compiled, self.graphs, self.capacity = model, compiled, graphs, capacity
        self.frozen = frozen
        self.side_graphs = side_graphs  # a side stream's passes: CUDA graphs of their own pool (SideStreamGraphs)
        # (rows, capacity) -> (cache, slot_pos, slot_valid): a pool that hands the same buffers back for
        # the same shape (Passes.buffers), so a shape warmed up before timing keeps its graphs' addresses
        self.buffers = buffers or (lambda rows, cap: allocate(model, rows, cap, frozen, compiled))
        self.rows, self.live = batch_bucket(batch), batch
        self.device = input_device(model)
        self.gapless = False  # the static pass always takes the mask (its keys are all `capacity` slots)
        self.cache, self.slot_pos, self.slot_valid = self.buffers(self.rows, capacity)
        self.length = 0
        for layer in self.cache.layers:  # pooled buffers hold an earlier call's slots: empty (the mask hides them)
            layer.cumulative_length.fill_(0)

    def __len__(self) -> int:
        return self.length

    @property
    def pos(self) -> torch.Tensor:
        return self.slot_pos[: self.live, : self.length]

    @property
    def valid(self) -> torch.Tensor:
        return self.slot_valid[: self.live, : self.length]

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (live, ...) with rows up to `rows`: copies of row 0, so a padded query sees keys."""
        extra = self.rows - t.shape[0]
        return t if extra == 0 else torch.cat([t, t[:1].expand(extra, *t.shape[1:])])

    def forward(self, input_ids: torch.Tensor, layout: Layout, causal: bool = False, once: bool = False,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        q = input_ids.shape[1]
        if self.length + q > self.capacity:
            raise RuntimeError(f"static KV cache full: {self.length} + {q} slots > capacity {self.capacity} "
                               "(the driver sizes it per call; this is a bug)")
        run = static_pass if once or not self.compiled else \
            self.side_graphs or compiled_static_pass(self.device, self.graphs, self.frozen)
        ids, pos, block, limit = map(self._padded, (input_ids, layout.pos, layout.block, layout.limit))
        tree = None if tree is None else self._padded(tree)  # a tree's shape is fixed by tree_nodes: one graph
        h = run(self.model, self.cache, ids, pos, block, limit, self.slot_pos, self.slot_valid, tree)[: self.live]
        self.length += q
        return h.clone() if run is not static_pass and self.device.type == "cuda" else h  # a CUDA graph reuses its output buffer

    def crop(self, length: int) -> None:
        if length < self.length:  # the stale slots stay in the buffers, hidden by the mask (`live`)
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(length)
            self.length = length

    def keep_first(self, start: int, counts: torch.Tensor, most: int) -> None:
        span = torch.arange(self.capacity, device=self.device) - start
        self.slot_valid &= (span[None, :] < 0) | (span[None, :] < self._padded(counts)[:, None])
        self.crop(start + most)

    def keep_path(self, start: int, slots: torch.Tensor, counts: torch.Tensor, most: int) -> None:
        """The eager keep_path in the static buffers: the accepted path's slots moved to start,
        start+1, ... and the rest hidden. Every round gathers the same number of slots, `width` =
        the kept list's width (the pending token + B-1) cut to the slots the verify pass wrote, over
        all `rows`, so the copy has one shape whatever the path's length: nothing here changes a
        shape a compiled pass or a CUDA graph sees, and the buffers keep their addresses. Entries
        past counts[r] copy whatever they name into slots keep_first then hides."""
        width = min(slots.shape[1], self.length - start)
        src = start + self._padded(slots[:, :width])  # (rows, width): verified slots, all below the length
        dst = torch.arange(start, start + width, device=self.device)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (rows, heads, capacity, dim)
                at = src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t.index_copy_(2, dst, t.gather(2, at))  # gather copies first: moving in place is safe
        self.slot_pos.index_copy_(1, dst, self.slot_pos.gather(1, src))
        self.slot_valid.index_copy_(1, dst, self.slot_valid.gather(1, src))
        self.keep_first(start, counts, most)

    def subset(self, rows: torch.Tensor) -> "KVState":
        raise NotImplementedError("a static state drafts every row (a pass over all rows is one compiled shape)")

    def select(self, rows: torch.Tensor) -> None:
        """Keep some rows. Inside the bucket they move to the front of the same buffers (same shape,
        same addresses: CUDA graphs read them there); a batch that leaves its bucket moves to the
        pooled buffers of the smaller one (a new shape, compiled once, at addresses that stay)."""
        n = len(rows)
        bucket = batch_bucket(n)
        cache, slot_pos, slot_valid = (self.cache, self.slot_pos, self.slot_valid) if bucket == self.rows else \
            self.buffers(bucket, self.capacity)
        for old, layer in zip(self.cache.layers, cache.layers):
            layer.keys[:n] = old.keys[rows]  # indexing copies first, so moving rows in place is safe
            layer.values[:n] = old.values[rows]
            layer.cumulative_length.fill_(self.length)
        slot_pos[:n] = self.slot_pos[rows]
        slot_valid[:n] = self.slot_valid[rows]
        self.cache, self.slot_pos, self.slot_valid, self.rows, self.live = cache, slot_pos, slot_valid, bucket, n

    @property
    def batch(self) -> int:
        return self.live


def on_layer(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`index` (made on the loop's device) where cache tensor `t` is: a target spread over devices
    (target.device_map) keeps each layer's K/V on that layer's device. No copy when they are one."""
    return index if index.device == t.device else index.to(t.device)


def batch_bucket(batch: int) -> int:
    """Rows a static state allocates for `batch` live rows: the next power of two (StaticKVState)."""
    return 1 << (batch - 1).bit_length()


def allocate(model, rows: int, capacity: int, frozen: bool = False, compiled: bool = False):
    """Static buffers for `rows` x `capacity` slots: HF's StaticCache, allocated now (so a compiled
    pass never allocates), and the slots' positions and validity."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ConfigError(f"decode.backend={'frozen' if frozen else 'compiled' if compiled else 'static'}: "
                          f"{type(model).__name__} has sliding-window layers, "
                          "whose static cache keeps only a window of slots; use decode.backend=eager")
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    for layer in cache.layers:
        # HF makes the length counter on the default device and moves it here; make it here
        layer.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
        empty = torch.zeros(rows, heads, 0, head_dim, dtype=dtype, device=device)
        layer.lazy_initialization(empty, empty)
    slot_pos = torch.zeros(rows, capacity, dtype=torch.long, device=device)
    slot_valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
    for t in (slot_pos, slot_valid):
        torch._dynamo.mark_static_address(t)  # mutated in place by the pass: CUDA graphs need fixed addresses
    return cache, slot_pos, slot_valid


def static_pass(model, cache, input_ids, pos, block, limit, slot_pos, slot_valid, tree=None) -> torch.Tensor:
    """One pass over a static cache: the d3d mask of the new tokens against every slot, the new
    slots written at the cache's length, the model run. Static shapes only, no host sync.
    `tree` (b, q, q): the new tokens are a tree of drafts, each seeing its ancestors (masks.build_mask)."""
    q, n = input_ids.shape[1], slot_pos.shape[1]
    length = cache.layers[0].cumulative_length  # a device tensor: where the new keys go
    slots = torch.arange(q, device=input_ids.device) + length
    live = slot_valid & (torch.arange(n, device=input_ids.device) < length)
    layout = Layout(pos, block, limit)
    # (b, 1, q, n + q): slots, then the new tokens
    both = build_mask(layout, cache_valid=live, cache_pos=slot_pos, tree=tree, causal_blocks=causal_blocks(model))
    mask = both[..., :n].index_copy(-1, slots, both[..., n:])  # the new tokens' columns are their slots
    slot_pos.index_copy_(1, slots, pos)
    slot_valid.index_copy_(1, slots, block == CLEAN)
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask_for(model, mask), position_ids=pos,
                           use_cache=True, **cache_kwarg(model, cache))
    return out.last_hidden_state


_COMPILED: dict[tuple[bool, bool], object] = {}


def compiled_static_pass(device: torch.device, graphs: bool = True, frozen: bool = False):
    """`static_pass` under torch.compile, made once per process: each model and each shape (q, batch,
    capacity) is a graph of its own. On CUDA it records CUDA graphs (inductor's `triton.cudagraphs`,
    which mode="reduce-overhead" turns on), unless
    `graphs=False`: what SideStreamGraphs captures itself for the passes on a side stream (async's
    drafter), because CUDA-graph trees share one memory pool and assume their graphs replay one
    after another.
    `frozen` (decode.backend=frozen): inductor's freezing, the weights folded into the graph as
    constants and, on CPU, prepacked into oneDNN's blocked layout; a graph per model then."""
    graphs = device.type == "cuda" and graphs
    key = (graphs, frozen)
    if key not in _COMPILED:
        import torch._dynamo

        # every (model, pass width, batch, capacity) is a graph: the default limit of 8 is too few
        # (`recompile_limit` in recent torch, `cache_size_limit` before)
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 256))
        # freezing: the weights become constants of the graph, folded and (on CPU) prepacked for oneDNN
        options = {"triton.cudagraphs": graphs, "freezing": frozen}
        _COMPILED[key] = torch.compile(static_pass, options=options, dynamic=False)
    return _COMPILED[key]


class SideStreamGraphs:
    """The compiled passes of a KV state that lives on a side CUDA stream (async's drafter: its tray
    pass and its drafts beside verification), each shape captured once in a CUDA graph and then
    replayed, so the host issues a pass as one launch and the tray pass hides behind a verification
    that is itself a graph replay. inductor's CUDA-graph trees cannot serve here: they share one
    memory pool and assume their graphs replay one after another on one stream, while the verify
    graphs replay on the main stream at the same time. So these graphs have a pool of their own
    (`torch.cuda.graph(..., pool=...)`, as serving engines capture their passes), shared only with
    each other: they replay one after another on their one stream, and each keeps its output.

    A shape is (model, pass width, rows, buffers): the buffers are pooled per (rows, capacity)
    (Passes.buffers), so their addresses, which a graph reads and writes, never change. Its first
    call runs the compiled pass for real (it compiles, and warms the stream's kernels up) and
    captures it afterwards; every later call copies its inputs into the graph's static inputs and
    replays. A warm-up call (SpecGenerator.warm_up) thus captures every shape before timing, as it
    records the verify graphs. The pass has static shapes and no host sync, and the cache's length
    is a device tensor (StaticKVState), so a replay writes where the live pass would."""

    def __init__(self, stream: torch.cuda.Stream, frozen: bool = False):
        self.stream, self.frozen = stream, frozen
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple] = {}  # shape -> (graph, static inputs, static output)
        self.captures = 0  # graphs captured so far (a timed call must add none)

    def __call__(self, model, cache, input_ids, pos, block, limit, slot_pos, slot_valid) -> torch.Tensor:
        key = (id(model), tuple(input_ids.shape), slot_pos.data_ptr(), slot_pos.shape[1])
        inputs = (input_ids, pos, block, limit)
        if key in self.graphs:
            graph, static, out = self.graphs[key]
            for dst, src in zip(static, inputs):
                dst.copy_(src)
            graph.replay()  # on the current stream: the side stream the state's passes run on
            return out
        run = compiled_static_pass(input_ids.device, graphs=False, frozen=self.frozen)
        h = run(model, cache, *inputs, slot_pos, slot_valid)  # the live pass, compiled on its first call
        static = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        # captured, not run: the cache, its length and the slots stay as the live pass left them
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = run(model, cache, *static, slot_pos, slot_valid)
        self.graphs[key] = (graph, static, out)
        self.captures += 1
        return h
