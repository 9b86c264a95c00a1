"""When a round's drafts are made: one `Schedule` per way (AR: none; Sync: a draft pass before
verification; Async: trays prepared beside verification), crossed with a Drafts kind
(d3d.decoding.drafts) in the table of d3d.decoding.methods.

A schedule is built with its DecodeConfig, the driver's `Passes` (d3d.decoding.passes: prefill,
verify and draft passes, the sampling generator, the side stream / worker thread), never the driver
itself, and its Drafts. Its hooks, in the order the driver runs them (d3d.decoding.engine):

    begin(prompts)          the drafter's cache
    propose(r)              r.draft, from the drafter's block logits (Drafts.make)
    beside_verify(r)        work that overlaps verification (async: the tray pass)
    settle(r)               device work that needs the verdict (async: match the trays: r.hit_idx)
    commit(r, host, most)   bookkeeping that needs the host's view (the drafter's cache)
    retire(keep, keep_list) finished rows leave

Values handed from one hook to the next within a round live on the round's record (passes.Round);
what a schedule keeps on `self` lasts across rounds (the drafter's cache, what it has not seen,
the prepared blocks).
"""

from __future__ import annotations

import functools
import time

import torch

from d3d.decoding.drafts import Draft, Drafts
from d3d.decoding.kv import KVState
from d3d.decoding.passes import Passes, Round, _on
from d3d.errors import ConfigError
from d3d.models.forward import logits_at
from d3d.models.masks import block_layout, concat


class Schedule:
    keys: tuple[str, ...] = ()  # DecodeConfig fields it reads
    needs_drafter = True
    trays = False  # prepares trays of its Drafts' outcomes (and so reads their tray knobs)
    overlaps = False  # beside_verify runs on a side stream (CUDA) or a worker thread, as decode.overlap says
    reference: type[Schedule] | None = None  # the schedule whose loop this one equals bit for bit in fp32

    def __init__(self, cfg, passes: Passes, drafts: Drafts):
        self.cfg, self.passes, self.drafts = cfg, passes, drafts

    @classmethod
    def widest_drafter(cls, cfg, drafts: type[Drafts]) -> int | None:
        """The drafter's widest pass in new tokens (None: no drafter pass)."""
        return None

    @classmethod
    def check(cls, cfg) -> None:
        """Its own settings, before any model loads (DecodeConfig checks every field's range; decode.overlap
        resolves per device in overlap_mode, when the loop starts)."""

    @classmethod
    def overlap_mode(cls, cfg, device: torch.device) -> str:
        """How beside_verify's work runs: stream | thread | none (none for a schedule that does not overlap).

        auto = a side CUDA stream on GPU and *serial* on CPU: measured on 2 cores, a drafter worker
        thread made async slower (TPOT 328 vs 263 ms) and left the process slower afterwards (sync
        151 -> 219 ms), because two OpenMP teams then fight for the same cores. overlap=thread
        splits the cores (cpu_threads_drafter) for machines that have cores to spare. DecodeConfig
        has already refused values outside auto | stream | thread | none."""
        if not cls.overlaps or cfg.overlap == "none":
            return "none"
        if cfg.overlap == "auto":
            return "stream" if device.type == "cuda" else "none"
        if cfg.overlap == "stream" and device.type != "cuda":
            raise ConfigError("decode.overlap=stream needs a CUDA device; use thread or none on CPU")
        if cfg.overlap == "thread" and device.type == "cuda":  # its worker would use the default stream
            raise ConfigError("decode.overlap=thread is for CPUs; on CUDA use stream (or auto)")
        return cfg.overlap

    def begin(self, prompts: list[list[int]]) -> None: ...

    def propose(self, r: Round) -> None:
        raise NotImplementedError

    def beside_verify(self, r: Round) -> None: ...

    def settle(self, r: Round) -> None: ...

    def commit(self, r: Round, host: list[list[int]], most: int) -> None: ...

    def retire(self, keep: torch.Tensor, keep_list: list[int]) -> None: ...


class AR(Schedule):
    """Plain decoding through the same driver: a verify pass over the pending token, no drafts."""

    needs_drafter = False

    def propose(self, r):
        r.draft = Draft(torch.zeros(len(r.pending), 0, dtype=torch.long, device=self.passes.device))


class Sync(Schedule):
    """Draft a block, verify it; the drafter's cache commits the accepted path in the next draft pass."""

    @classmethod
    def widest_drafter(cls, cfg, drafts):
        return 2 * drafts.block_size(cfg)  # <= B tokens to commit + the block

    def begin(self, prompts):
        p, b = self.passes, len(prompts)
        self.dr = p.new_state(p.drafter, b, 2 * p.B)  # a draft pass: <= B new tokens + the block
        p.prefill(self.dr, prompts)
        # tokens the target committed that the drafter has not seen: pending + the accepted path
        # (on the drafter's device, as all its state)
        self.unc = torch.zeros(b, 0, dtype=torch.long, device=p.drafter_device)
        self.unc_n = torch.zeros(b, dtype=torch.long, device=p.drafter_device)

    def propose(self, r):
        p = self.passes
        t = r.clock.mark()  # one timed draft pass: the drafter commits what it has not seen and reads the block
        q_logits = p.draft_pass(self.dr, *p.to_drafter(r.pending, r.next_pos), self.unc, self.unc_n)
        (q_logits,) = p.to_target(q_logits)  # drafts are made where they are verified (one sampling stream)
        r.clock.span(r.stats, "draft_s", t)
        r.draft = self.drafts.make(r.pending, p.target_vocab(q_logits))

    def settle(self, r):
        self.unc, self.unc_n = self.passes.to_drafter(torch.cat([r.pending[:, None], r.path], dim=1), r.accepted + 1)

    def commit(self, r, host, most):
        self.unc = self.unc[:, :most]

    def retire(self, keep, keep_list):
        (keep,) = self.passes.to_drafter(keep)
        self.dr.select(keep)
        self.unc, self.unc_n = self.unc[keep], self.unc_n[keep]


class Async(Schedule):
    """While the target verifies, one packed drafter pass runs the glue (the verified tokens again,
    so the drafter's cache can keep whichever the target accepts) and one tray per outcome its
    Drafts lists (Drafts.outcomes); a row whose outcome has a tray starts its next round from the
    tray's block at once (a hit), the others draft synchronously. A hit serves exactly the block a
    synchronous draft would, so its loop equals Sync's with the same Drafts, bit for bit in fp32.

    All drafter work runs on the passes' side stream (`stream`, CUDA) or, with overlap=thread,
    the tray pass runs in its worker thread; see the engine's module docstring."""

    keys = ("overlap", "cpu_threads_drafter")
    trays = overlaps = True
    reference = Sync

    @classmethod
    def widest_drafter(cls, cfg, drafts):
        return max(drafts.budget(cfg), drafts.block_size(cfg))  # the tray pass

    @classmethod
    def check(cls, cfg):
        k = cfg.cpu_threads_drafter
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"decode.cpu_threads_drafter={k!r}: an integer >= 1, or null (half the cores)")

    def begin(self, prompts):
        p = self.passes
        with _on(p.stream):
            self.dr = p.new_state(p.drafter, len(prompts), self.widest_drafter(self.cfg, type(self.drafts)),
                                  side_stream=True)  # glue + trays
            p.prefill(self.dr, prompts)
        # the next block's logits per row, and which rows hit (host list; device mask for the CUDA path)
        self.prepared, self.hit, self.hit_dev = None, [False] * len(prompts), None

    def propose(self, r):
        p, ds = self.passes, self.passes.stream
        p.lend(ds, r.pending, r.next_pos, self.prepared, self.hit_dev)
        with _on(ds):
            miss = [i for i, h in enumerate(self.hit) if not h]
            if miss:
                t = r.clock.mark(ds)
                q_logits = self._draft_misses(r, miss)
                r.clock.span(r.stats, "draft_s", t, r.clock.mark(ds))
                r.stats.drafted_rows = len(miss)
            else:
                q_logits = self.prepared
            r.draft, r.glue_start = self.drafts.make(r.pending, p.target_vocab(q_logits)), len(self.dr)
        p.take(ds, *r.draft.handed())
        # the tray pass's inputs, on the drafter's device before verification is queued (a drafter on
        # a GPU of its own: copies queued after verification would wait for it; Passes.to_drafter)
        r.tray_inputs = p.to_drafter(r.draft, r.pending, r.next_pos)

    def _draft_misses(self, r, miss: list[int]) -> torch.Tensor:
        """Drafter logits for every row: the hit rows' prepared blocks, a synchronous draft for the
        rest. The glue already committed every accepted token, so a draft pass here only runs a block
        and leaves the cache as it was. On CPU only the missed rows are drafted (a pass costs what its
        rows cost; their KV rows are copied out for it); on CUDA a pass over all rows costs about
        what a pass over a few costs (the weights are read once), so all rows are drafted; so does a
        static backend (a pass over all rows is its one compiled shape)."""
        p = self.passes
        pending, next_pos = p.to_drafter(r.pending, r.next_pos)
        if self.prepared is None or len(miss) == len(self.hit) or p.drafter_device.type == "cuda" or p.static:
            (q_logits,) = p.to_target(p.draft_pass(self.dr, pending, next_pos))
            if self.prepared is None or len(miss) == len(self.hit):
                return q_logits
            return torch.where(self.hit_dev[:, None, None], self.prepared, q_logits)
        idx = torch.tensor(miss, dtype=torch.long, device=p.drafter_device)
        part = p.draft_pass(self.dr.subset(idx), pending[idx], next_pos[idx])
        q_logits = self.prepared.clone()
        at, part = p.to_target(idx, part)
        q_logits[at] = part
        return q_logits

    def beside_verify(self, r):
        p, ds = self.passes, self.passes.stream
        # values, bound now; already on the drafter's device (propose sent them)
        tray_pass = functools.partial(self._tray_pass, self.dr, *r.tray_inputs)
        if ds is not None:  # queued on the side stream; its inputs were lent to it before verify
            with _on(ds):
                t = r.clock.mark(ds)
                r.trays = tray_pass()
                end = r.clock.mark(ds)
            r.clock.span(r.stats, "tray_s", t, end)
            r.clock.hidden(r.stats, r.verify_marks[0], r.verify_marks[1:], (t, end))
        elif p.pool is not None:  # a worker thread (CPU, overlap=thread)

            @torch.inference_mode()  # grad mode is per thread: the worker needs its own
            def work():
                t = time.perf_counter()
                return tray_pass(), time.perf_counter() - t

            r.trays = p.pool.submit(work)
        else:  # serially (or on a drafter's GPU of its own)
            t = r.clock.mark()
            r.trays = tray_pass()
            end = r.clock.mark()
            r.clock.span(r.stats, "tray_s", t, end)
            if p.drafter_device == p.device:  # (the events of a drafter's own GPU are not the clock's)
                r.clock.hidden(r.stats, r.verify_marks[0], r.verify_marks[1:], (t, end))
            # the keys back as soon as they are made, on a stream that waits for no verification
            # (settle makes the target's stream wait for them, after the accept is queued)
            r.trays = (*p.to_target(r.trays[0], wait=False), r.trays[1])

    def settle(self, r):
        t = time.perf_counter()
        if hasattr(r.trays, "result"):  # the worker's future: wait for it
            r.trays, r.stats.tray_s = r.trays.result()
            r.stats.tray_wait_s = time.perf_counter() - t
        p = self.passes
        keys, tray_logits = r.trays
        p.take(p.stream, keys, tray_logits)
        p.take(p.inbox, keys)  # a drafter on a GPU of its own: beside_verify sent them back already
        r.hit_idx = find_trays(*p.to_target(keys), r.outcome, r.token)

    def commit(self, r, host, most):
        p, ds = self.passes, self.passes.stream
        p.lend(ds, r.accepted, r.kept)
        kept, counts, hit_idx = p.to_drafter(r.kept, r.accepted + 1, r.hit_idx)
        with _on(ds):  # the glue commits the pending token and the accepted path
            self.dr.keep(r.glue_start, kept, counts, most)
        self.hit, self.hit_dev = [h[2] >= 0 for h in host], r.hit_idx >= 0
        r.stats.hit = list(self.hit)
        rows = torch.arange(len(host), device=p.drafter_device)
        # the served trays' logits, on the loop's device: the next round's drafts are made from them
        self.prepared = p.to_target(r.trays[1][rows, hit_idx.clamp(min=0)])[0] if any(self.hit) else None

    def retire(self, keep, keep_list):
        p, ds = self.passes, self.passes.stream
        p.lend(ds, keep)
        with _on(ds):
            self.dr.select(*p.to_drafter(keep))
        self.hit, self.hit_dev = [self.hit[i] for i in keep_list], self.hit_dev[keep]
        if self.prepared is not None:
            self.prepared = self.prepared[keep]

    def _tray_pass(self, dr: KVState, d: Draft, pending: torch.Tensor, next_pos: torch.Tensor):
        """The glue and a tray per outcome the Drafts lists, in one packed pass: a tray is
        [t, MASK x (B-1)] at its anchor's position, seeing the cached prefix, the glue as its
        outcome allows (by position for a chain; its node's path for a tree) and itself. Returns
        (keys (b, n, 2) = (outcome, token), tray logits (b, n, B, V or a draft vocabulary's N))."""
        p, B, s = self.passes, self.passes.B, self.passes.settings
        o = self.drafts.outcomes(d, pending, next_pos)
        (b, n), g = o.token.shape, o.glue.shape[1]
        trays = torch.full((b, n, B), s.mask_token_id, dtype=torch.long, device=p.drafter_device)
        trays[:, :, 0] = o.token
        seen = None
        if o.glue_sees is not None:  # in-row visibility: the glue's own, and each tray's of the glue
            seen = torch.ones(b, g + n * B, g + n * B, dtype=torch.bool, device=p.drafter_device)
            seen[:, :g, :g] = o.glue_sees
            seen[:, g:, :g] = o.sees.repeat_interleave(B, dim=1)
        layout = concat(o.glue_layout, block_layout(o.pos, B))
        h = dr.forward(torch.cat([o.glue, trays.reshape(b, n * B)], dim=1), layout, tree=seen)
        dr.crop(len(dr) - n * B)  # keep the glue; verification decides how much of it stays
        # over a draft vocabulary, N columns: the served tray's are mapped when its drafts are made (propose)
        tray_logits = logits_at(p.drafter, h[:, g:].reshape(b, n, B, -1), s.vocab_size, draft_ids=True).float()
        return torch.stack([o.at, o.token], dim=-1), tray_logits


def find_trays(keys: torch.Tensor, outcome: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Index of the tray keyed (outcome, token) per row, -1 when none (a miss)."""
    match = (keys[:, :, 0] == outcome[:, None]) & (keys[:, :, 1] == token[:, None])
    found = match.any(dim=1)
    idx = match.long().argmax(dim=1)
    return torch.where(found, idx, torch.full_like(idx, -1))
