"""Decoding methods: one step object per method behind one seam (the driver is engine.SpecGenerator).

A round, as the driver runs it:

    step.propose(r)        drafts for this round: r.drafts (b, B-1), r.q (their distributions, T > 0)
    driver                 launches the target's verify pass over [pending, drafts]
    step.beside_verify(r)  work that overlaps verification (async: the tray pass)
    driver                 accept / reject on the device: r.accepted, r.token
    step.settle(r)         device work that needs the outcome (async: match the trays: r.hit_idx)
    driver                 one host transfer; crops the target's cache; commits text
    step.commit(r, host, most)  bookkeeping that needs the host's view (the drafter's cache)
    step.retire(keep, keep_list) finished rows leave

So a new method (a tree of drafts, say) is one new class here and one line in METHODS; nothing in
the driver, eval or report changes. Each class says whether it needs a drafter, its block size and
its packed budget (tokens of drafter work beside verification).
"""

from __future__ import annotations

import time

import torch

from d3d.decoding.engine import DecodeConfig, Round, _on
from d3d.decoding.kv import KVState
from d3d.decoding.verify import Sampling, draft_from, probs
from d3d.models.forward import logits_at
from d3d.models.masks import CLEAN, Layout, block_layout, concat


class Method:
    needs_drafter = True

    def __init__(self, gen):
        self.g, self.cfg = gen, gen.cfg

    @staticmethod
    def block_size(cfg: DecodeConfig) -> int:
        return int(cfg.block_size)

    @staticmethod
    def budget(cfg: DecodeConfig) -> int:
        return 0

    def begin(self, prompts: list[list[int]]) -> None: ...

    def propose(self, r: Round) -> None:
        raise NotImplementedError

    def beside_verify(self, r: Round) -> None: ...

    def settle(self, r: Round) -> None: ...

    def commit(self, r: Round, host: list[list[int]], most: int) -> None: ...

    def retire(self, keep: torch.Tensor, keep_list: list[int]) -> None: ...


class AR(Method):
    """Plain decoding through the same driver: a verify pass over the pending token, no drafts."""

    needs_drafter = False

    @staticmethod
    def block_size(cfg):
        return 1

    def propose(self, r):
        r.drafts = torch.zeros(len(r.pending), 0, dtype=torch.long, device=self.g.device)


class Sync(Method):
    """Draft a block, verify it; the drafter's cache commits the accepted text in the next draft pass."""

    def begin(self, prompts):
        g, b = self.g, len(prompts)
        self.dr = g.new_state(g.drafter, b, 2 * g.B)  # a draft pass: <= B new tokens + the block
        g.prefill(self.dr, prompts)
        # tokens the target committed that the drafter has not seen: pending + accepted drafts
        self.unc = torch.zeros(b, 0, dtype=torch.long, device=g.device)
        self.unc_n = torch.zeros(b, dtype=torch.long, device=g.device)

    def propose(self, r):
        t = r.clock.mark()
        q_logits = self.g.draft_pass(self.dr, r.pending, r.next_pos, self.unc, self.unc_n)
        r.clock.span(r.stat, "draft_s", t)
        r.drafts, r.q = draft_from(q_logits[:, : self.g.B - 1], self.cfg.sampling, self.g.gen)

    def settle(self, r):
        self.unc, self.unc_n = torch.cat([r.pending[:, None], r.drafts], dim=1), r.accepted + 1

    def commit(self, r, host, most):
        self.unc = self.unc[:, :most]

    def retire(self, keep, keep_list):
        self.dr.select(keep)
        self.unc, self.unc_n = self.unc[keep], self.unc_n[keep]


class Async(Method):
    """While the target verifies, one packed drafter pass prepares the next block for the likely
    outcomes (trays); a row whose outcome has a tray starts its next round at once (a hit).

    All drafter work runs on the generator's side stream (`dstream`, CUDA) or, with overlap=thread,
    the tray pass runs in its worker thread; see the engine's module docstring."""

    @staticmethod
    def budget(cfg):
        """Tokens in one packed pass: B * ((C-1)*F + 2), with at most the B-1 draft slots covered."""
        return cfg.block_size * (min(cfg.C - 1, cfg.block_size - 1) * cfg.F + 2)

    def begin(self, prompts):
        g = self.g
        with _on(g.dstream):
            self.dr = g.new_state(g.drafter, len(prompts), self.budget(self.cfg), side_stream=True)  # glue + trays
            g.prefill(self.dr, prompts)
        # the next block's logits per row, and which rows hit (host list; device mask for the CUDA path)
        self.prepared, self.hit, self.hit_dev = None, [False] * len(prompts), None

    def propose(self, r):
        g, ds = self.g, self.g.dstream
        g.lend(ds, r.pending, r.next_pos, self.prepared, self.hit_dev)
        with _on(ds):
            miss = [i for i, h in enumerate(self.hit) if not h]
            if miss:
                t = r.clock.mark(ds)
                q_logits = self._draft_misses(r, miss)
                r.clock.span(r.stat, "draft_s", t, r.clock.mark(ds))
                r.stat["drafted_rows"] = len(miss)
            else:
                q_logits = self.prepared
            r.drafts, r.q = draft_from(q_logits[:, : g.B - 1], self.cfg.sampling, g.gen)
            self.q_logits, self.glue_start = q_logits, len(self.dr)
        g.take(ds, r.drafts, r.q)

    def _draft_misses(self, r, miss: list[int]) -> torch.Tensor:
        """Drafter logits for every row: the hit rows' prepared blocks, a synchronous draft for the
        rest. The glue already committed every accepted token, so a draft pass here only runs a block
        and leaves the cache as it was. On CPU only the missed rows are drafted (a pass costs what its
        rows cost; their KV rows are copied out for it); on CUDA a pass over all rows costs about
        what a pass over a few costs (the weights are read once), so all rows are drafted; so does a
        static backend (a pass over all rows is its one compiled shape)."""
        g = self.g
        if self.prepared is None or len(miss) == len(self.hit) or g.device.type == "cuda" or g.static:
            q_logits = g.draft_pass(self.dr, r.pending, r.next_pos)
            if self.prepared is None or len(miss) == len(self.hit):
                return q_logits
            return torch.where(self.hit_dev[:, None, None], self.prepared, q_logits)
        idx = torch.tensor(miss, dtype=torch.long, device=g.device)
        part = g.draft_pass(self.dr.subset(idx), r.pending[idx], r.next_pos[idx])
        q_logits = self.prepared.clone()
        q_logits[idx] = part
        return q_logits

    def beside_verify(self, r):
        g, ds = self.g, self.g.dstream
        args = (r.pending, r.drafts, self.q_logits, r.next_pos)
        if ds is not None:  # queued on the side stream; its inputs were lent to it before verify
            with _on(ds):
                t = r.clock.mark(ds)
                self.future = self._tray_pass(self.dr, *args)
                r.clock.span(r.stat, "tray_s", t, r.clock.mark(ds))
        elif g.pool is not None:  # a worker thread (CPU, overlap=thread)

            @torch.inference_mode()  # grad mode is per thread: the worker needs its own
            def work():
                t = time.perf_counter()
                res = self._tray_pass(self.dr, *args)
                r.stat["tray_s"] = time.perf_counter() - t
                return res

            self.future = g.pool.submit(work)
        else:  # serially
            t = r.clock.mark()
            self.future = self._tray_pass(self.dr, *args)
            r.clock.span(r.stat, "tray_s", t)

    def settle(self, r):
        t = time.perf_counter()
        if hasattr(self.future, "result"):
            self.future = self.future.result()
            r.stat["tray_wait_s"] = time.perf_counter() - t
        keys, self.tray_logits = self.future
        self.g.take(self.g.dstream, keys, self.tray_logits)
        r.hit_idx = self._find_trays(keys, r.accepted, r.token)

    def commit(self, r, host, most):
        g, ds = self.g, self.g.dstream
        g.lend(ds, r.accepted)
        with _on(ds):
            self.dr.keep_first(self.glue_start, r.accepted + 1, most)  # the glue commits pending + accepted drafts
        self.hit, self.hit_dev = [h[2] >= 0 for h in host], r.hit_idx >= 0
        r.stat["hit"] = list(self.hit)
        n = len(host)
        self.prepared = self.tray_logits[torch.arange(n, device=g.device), r.hit_idx.clamp(min=0)] if any(self.hit) else None

    def retire(self, keep, keep_list):
        g, ds = self.g, self.g.dstream
        g.lend(ds, keep)
        with _on(ds):
            self.dr.select(keep)
        self.hit, self.hit_dev = [self.hit[i] for i in keep_list], self.hit_dev[keep]
        if self.prepared is not None:
            self.prepared = self.prepared[keep]

    # ---- the packed pass

    def _tray_pass(self, dr: KVState, pending, drafts, q_logits, next_pos):
        """Glue + trays in one packed pass. Returns (keys (b, n, 2), tray logits (b, n, B, V))."""
        g, cfg = self.g, self.cfg
        b, B, s, dev = len(pending), g.B, g.settings, g.device
        glue = torch.cat([pending[:, None], drafts], dim=1)
        gpos = next_pos[:, None] + torch.arange(B, device=dev)
        slots = self._covered_slots(q_logits, drafts)  # (b, C-1): slot j = 1..B-1
        scores = probs(q_logits, cfg.sampling) if not cfg.sampling.greedy else q_logits
        alt_scores = scores[:, : B - 1].gather(1, (slots - 1)[:, :, None].expand(-1, -1, scores.shape[-1])).clone()
        drafted = drafts.gather(1, slots - 1)
        alt_scores.scatter_(2, drafted[:, :, None], float("-inf"))  # the drafted token is no alternative
        alts = alt_scores.topk(cfg.F, dim=-1).indices if cfg.F > 0 else \
            torch.zeros(b, slots.shape[1], 0, dtype=torch.long, device=dev)
        anchor_pos = (next_pos[:, None, None] + slots[:, :, None]).expand_as(alts).reshape(b, -1)
        anchor_tok = alts.reshape(b, -1)
        keys_a = (slots[:, :, None] - 1).expand_as(alts).reshape(b, -1)
        bonus = q_logits[:, B - 1].argmax(-1)  # slot B-1 guesses the token after the block
        anchor_pos = torch.cat([anchor_pos, (next_pos + B)[:, None]], dim=1)
        anchor_tok = torch.cat([anchor_tok, bonus[:, None]], dim=1)
        keys = torch.stack([torch.cat([keys_a, torch.full((b, 1), B - 1, device=dev)], dim=1), anchor_tok], dim=-1)
        n = anchor_tok.shape[1]
        trays = torch.full((b, n, B), s.mask_token_id, dtype=torch.long, device=dev)
        trays[:, :, 0] = anchor_tok
        layout = concat(Layout(gpos, torch.full_like(gpos, CLEAN), gpos + 1), block_layout(anchor_pos, B))
        h = dr.forward(torch.cat([glue, trays.reshape(b, n * B)], dim=1), layout)
        dr.crop(len(dr) - n * B)  # keep the glue (B slots); verification decides how much of it stays
        tray_logits = logits_at(g.drafter, h[:, B:].reshape(b, n, B, -1), s.vocab_size).float()
        return keys, tray_logits

    def _covered_slots(self, q_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Rejection slots j (1-based draft index) that get trays: the first C-1, or the C-1 where
        rejection is likeliest under the drafter: prod_{i<j} q(d_i) * (1 - q(d_j))."""
        b, n = drafts.shape
        dev = drafts.device
        c = max(0, min(self.cfg.C - 1, n))
        if self.cfg.coverage == "first" or c == 0:
            return torch.arange(1, c + 1, device=dev).expand(b, c).clone()
        sampling = Sampling(1.0) if self.cfg.sampling.greedy else self.cfg.sampling
        q = probs(q_logits[:, :n], sampling)
        qd = q.gather(2, drafts[:, :, None]).squeeze(2)
        survive = torch.cat([torch.ones(b, 1, device=dev), qd.cumprod(1)[:, :-1]], dim=1)
        reject_here = survive * (1 - qd)
        return (reject_here.topk(c, dim=1).indices + 1).sort(dim=1).values

    @staticmethod
    def _find_trays(keys: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Index of the tray keyed (accepted, token) per row, -1 when none (a miss)."""
        match = (keys[:, :, 0] == accepted[:, None]) & (keys[:, :, 1] == token[:, None])
        found = match.any(dim=1)
        idx = match.long().argmax(dim=1)
        return torch.where(found, idx, torch.full_like(idx, -1))


METHODS: dict[str, type[Method]] = {"ar": AR, "sync": Sync, "async": Async}


def method_class(name: str) -> type[Method]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"decode.method={name!r}: use one of {', '.join(METHODS)}") from None
