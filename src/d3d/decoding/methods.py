"""Decoding methods: one step class per method behind one seam, and the one config they read.

A round, as the driver (d3d.decoding.engine.SpecGenerator) runs it:

    step.propose(r)        drafts for this round: r.drafts (b, B-1), r.q (their distributions, T > 0;
                           None for drafts that are no sample, verified as certain)
    step.verify(tgt, r)    the target's verify pass (chain: causal over [pending, drafts])
    step.beside_verify(r)  work that overlaps verification (async: the tray pass)
    step.accept(r, logits) accept / reject on the device: r.accepted, r.token (chain: greedy_verify /
                           sample_verify)
    step.settle(r)         device work that needs the outcome (async: match the trays: r.hit_idx)
    driver                 one host transfer of [accepted, token, hit, *step.path(r)] (chain: the
                           drafts, whose first `accepted` are the committed ones)
    step.keep(tgt, ...)    the target's cache keeps pending + the accepted drafts (chain: a prefix)
    driver                 commits text: path[:accepted] + [token]
    step.commit(r, host, most)  bookkeeping that needs the host's view (the drafter's cache)
    step.retire(keep, keep_list) finished rows leave

verify / accept / path / keep default to the chain's, and so do three helpers the steps share:
drafts_from (drafts from the drafter's block logits), kept_slots (which verified slots hold the
accepted path: None = a prefix) and outcome (what a tray is keyed by: the accepted count). A tree of
drafts (`_TreeSteps`, for `Tree` and `AsyncTree`) supplies its own: its nodes, its path's slots,
the node its path ends at.

A step is built with its DecodeConfig and the driver's `Passes` (d3d.decoding.passes: prefill,
verify and draft passes, the sampling generator, the side stream / worker thread), never the driver
itself. Each class declares what the rest of the code asks of it: `keys` (the DecodeConfig fields
it reads beyond EVERY_METHOD_KEYS: its decode file holds exactly these, eval records and lends
them), `needs_drafter`, `block_size(cfg)`, `budget(cfg)` (drafter tokens beside verification),
`passes(cfg)` (its widest pass per model, which d3d.decoding.cost bounds by the device's memory) and
`overlaps` (its beside_verify work runs on a side stream / worker thread, per decode.overlap).
So a new chain method is one class here, registered with `@register(name)`, one
conf/decode/<name>.yaml and one defaults line in conf/eval.yaml; nothing in the driver, eval or
report changes, and a subclass registered under another name keeps what its class says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from d3d.decoding.kv import KVState
from d3d.decoding.passes import Passes, Round, _on
from d3d.decoding.tree import build_tree
from d3d.decoding.verify import (Sampling, draft_from, greedy_verify, probs, sample_verify, tree_greedy_verify,
                                 tree_path, tree_sample_verify)
from d3d.errors import ConfigError
from d3d.models.forward import logits_at
from d3d.models.masks import CLEAN, Layout, block_layout, concat, tree_ancestors, tree_layout

# How passes run (docs/design.md, Backends): eager (HF's dynamic cache, the reference) | static
# (preallocated slots) | compiled (static + torch.compile; CUDA graphs on CUDA) | frozen (compiled,
# weights folded into the graph: prepacked for oneDNN on CPU)
BACKENDS = ("eager", "static", "compiled", "frozen")
MAX_BLOCK = 256  # far above any trained drafter (16); 1000 used to run for minutes before anything failed
# what the driver reads for every method: the method, its sampling (0 = greedy) and its backend
EVERY_METHOD_KEYS = ("method", "temperature", "top_p", "top_k", "backend")


@dataclass
class DecodeConfig:
    """`decode.*` and `methods.<name>.*` (conf/decode/<name>.yaml, bound by d3d.settings.bind_decode);
    a method reads EVERY_METHOD_KEYS and its class's `keys`. `max_new_tokens` comes from the caller
    (eval.max_new_tokens), `stop_strings` from callers of the engine."""

    method: str = "sync"  # a name in METHODS
    block_size: int = 16
    C: int = 12  # async: covered rejection slots + 1
    F: int = 2  # async: alternatives per covered slot
    coverage: str = "first"  # first | confident
    tree_nodes: int = 15  # tree: draft nodes verified beside the pending token (the verify pass is tree_nodes + 1 wide)
    tree_trays: int = 23  # async_tree: trays for the likeliest outcomes (23 + a glue of 16 = async's 384 tokens at B = 16)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    overlap: str = "auto"  # auto | stream | thread | none (see Method.overlap_mode)
    cpu_threads_drafter: int | None = None  # overlap=thread on CPU: cores for the drafter (None = half)
    backend: str = "eager"  # one of BACKENDS
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every setting checked here, before any model loads: a bad value used to fail deep in torch
        (block_size=0), run silently greedy (temperature=-1) or do nothing (top_p=2)."""
        def bad(key, allowed, fix=None):
            fix = fix or f"set decode.{key} to {allowed.rsplit(' (', 1)[0]}"
            raise ConfigError(f"decode.{key}={getattr(self, key)!r}: {allowed}. Fix: {fix}.")

        method = method_class(self.method)  # a registered name, or the names there are
        choices = {"coverage": ("first", "confident"), "overlap": ("auto", "stream", "thread", "none"),
                   "backend": BACKENDS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                bad(key, f"use {', '.join(allowed[:-1])} or {allowed[-1]}", f"set decode.{key} to one of them")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
        low = 2 if method.needs_drafter else 1  # a speculative block: the pending token + >= 1 draft
        if not whole(self.block_size) or not low <= self.block_size <= MAX_BLOCK:
            bad("block_size", f"an integer in [{low}, {MAX_BLOCK}] for method={self.method} (the drafter's "
                              "training block size is the right one)")
        if self.backend not in method.backends:
            bad("backend", f"method={self.method} runs on {', '.join(method.backends)} only "
                           "(its cache keeps non-contiguous slots, which only the eager cache does)",
                f"set decode.backend={method.backends[0]}")
        for key, least in (("C", 1), ("F", 0), ("tree_nodes", 1), ("tree_trays", 1), ("top_k", 0), ("max_new_tokens", 1)):
            if not whole(getattr(self, key)) or getattr(self, key) < least:
                bad(key, f"an integer >= {least}" + (" (0 = off)" if key == "top_k" else ""))
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1] (1 = off)")

    @property
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), int(self.top_k))

    @property
    def budget(self) -> int:
        """Tokens of drafter work beside each verification (async: the packed pass)."""
        return method_class(self.method).budget(self)


class Method:
    keys: tuple[str, ...] = ()  # DecodeConfig fields read beyond EVERY_METHOD_KEYS
    needs_drafter = True
    overlaps = False  # beside_verify runs on a side stream (CUDA) or a worker thread, as decode.overlap says
    backends = BACKENDS  # the decode.backend values it runs on

    def __init__(self, cfg: DecodeConfig, passes: Passes):
        self.cfg, self.p = cfg, passes

    @classmethod
    def reads(cls) -> tuple[str, ...]:
        """Every DecodeConfig field this method reads: what its decode file holds and eval records."""
        return (*EVERY_METHOD_KEYS, *cls.keys)

    @staticmethod
    def block_size(cfg: DecodeConfig) -> int:
        return int(cfg.block_size)

    @staticmethod
    def budget(cfg: DecodeConfig) -> int:
        return 0

    @classmethod
    def passes(cls, cfg: DecodeConfig) -> dict[str, int]:
        """The widest pass each model runs, in new tokens: what d3d.decoding.cost bounds by memory.
        The target verifies [pending, drafts]; a drafter method's widest pass is its own to say."""
        return {"target": cls.block_size(cfg)}

    @staticmethod
    def narrower(cfg: DecodeConfig, where: str) -> str:
        """How to make the widest pass narrower: the fix in d3d.decoding.cost's refusal."""
        return f"lower {where}.block_size (the drafter's training block size is the right one)"

    @classmethod
    def overlap_mode(cls, cfg: DecodeConfig, device: torch.device) -> str:
        """How beside_verify's work runs: stream | thread | none (none for a method that does not overlap).

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

    def drafts_from(self, r: Round, q_logits: torch.Tensor) -> tuple:
        """r.drafts, r.q from the drafter's block logits (b, B, V): the chain of per-slot drafts
        (argmax, or samples of q at T > 0). Returns the tensors the target's side reads from them."""
        r.drafts, r.q = draft_from(q_logits[:, : self.p.B - 1], self.cfg.sampling, self.p.gen)
        return r.drafts, r.q

    def verify(self, tgt: KVState, r: Round) -> torch.Tensor:
        """The target's logits over this round's drafts (b, B, V): the chain's causal [pending, drafts]."""
        return self.p.verify_pass(tgt, r.pending, r.drafts, r.next_pos)

    def beside_verify(self, r: Round) -> None: ...

    def accept(self, r: Round, p_logits: torch.Tensor) -> None:
        """r.accepted, r.token: the chain's leading accepted drafts and the token after them."""
        s = self.cfg.sampling
        if s.greedy:
            r.accepted, r.token = greedy_verify(p_logits, r.drafts)
        else:
            # drafts given without a distribution are certain (AR's none, a lookup's copies): q is one-hot
            q = r.q if r.q is not None else torch.nn.functional.one_hot(r.drafts, p_logits.shape[-1]).to(p_logits.dtype)
            r.accepted, r.token = sample_verify(p_logits, r.drafts, q, s, self.p.gen)

    def path(self, r: Round) -> torch.Tensor:
        """(b, k) tokens whose first r.accepted[i] row i commits (before r.token): the chain's drafts."""
        return r.drafts

    def kept_slots(self, r: Round) -> torch.Tensor | None:
        """Which of the verified slots hold the pending token and the accepted drafts, (b, k) in
        order; None = the first r.accepted + 1 (the chain's)."""
        return None

    def outcome(self, r: Round) -> torch.Tensor:
        """(b,) where verification ended, as a tray is keyed: the chain's accepted count."""
        return r.accepted

    def keep(self, tgt: KVState, start: int, r: Round, most: int) -> None:
        """The target's cache keeps, of the slots this round's verify pass wrote (from `start` on),
        the pending token and the accepted drafts; `most` = the longest such run of any row."""
        keep_slots(tgt, start, self.kept_slots(r), r.accepted + 1, most)

    def settle(self, r: Round) -> None: ...

    def commit(self, r: Round, host: list[list[int]], most: int) -> None: ...

    def retire(self, keep: torch.Tensor, keep_list: list[int]) -> None: ...


def keep_slots(state: KVState, start: int, slots: torch.Tensor | None, counts: torch.Tensor, most: int) -> None:
    """A cache keeps, of its slots from `start` on, the first counts[r] (slots None) or those listed."""
    if slots is None:
        state.keep_first(start, counts, most)
    else:
        state.keep_path(start, slots, counts, most)


METHODS: dict[str, type[Method]] = {}  # decode.method -> its class, filled by @register


def register(name: str):
    """`@register("name")` on a Method subclass: decode.method=name runs it."""
    def add(cls: type[Method]) -> type[Method]:
        METHODS[name] = cls
        return cls
    return add


def method_class(name: str, where: str = "decode") -> type[Method]:
    if name not in METHODS:
        *most, last = METHODS
        raise ConfigError(f"{where}.method={name!r}: use {', '.join(most)} or {last}. Fix: set {where}.method to one "
                          f"of them (or register a method of this name in d3d.decoding.methods).")
    return METHODS[name]


@register("ar")
class AR(Method):
    """Plain decoding through the same driver: a verify pass over the pending token, no drafts."""

    needs_drafter = False

    @staticmethod
    def block_size(cfg):
        return 1

    def propose(self, r):
        r.drafts = torch.zeros(len(r.pending), 0, dtype=torch.long, device=self.p.device)


@register("sync")
class Sync(Method):
    """Draft a block, verify it; the drafter's cache commits the accepted text in the next draft pass."""

    keys = ("block_size",)

    @classmethod
    def passes(cls, cfg):
        return {"target": cfg.block_size, "drafter": 2 * cfg.block_size}  # <= B tokens to commit + the block

    def begin(self, prompts):
        p, b = self.p, len(prompts)
        self.dr = p.new_state(p.drafter, b, 2 * p.B)  # a draft pass: <= B new tokens + the block
        p.prefill(self.dr, prompts)
        # tokens the target committed that the drafter has not seen: pending + accepted drafts
        self.unc = torch.zeros(b, 0, dtype=torch.long, device=p.device)
        self.unc_n = torch.zeros(b, dtype=torch.long, device=p.device)

    def _draft_logits(self, r) -> torch.Tensor:
        """One timed draft pass: the drafter commits what it has not seen and reads the block."""
        t = r.clock.mark()
        q_logits = self.p.draft_pass(self.dr, r.pending, r.next_pos, self.unc, self.unc_n)
        r.clock.span(r.stat, "draft_s", t)
        return q_logits

    def propose(self, r):
        self.drafts_from(r, self._draft_logits(r))

    def settle(self, r):
        # the drafter commits the pending token and the accepted path in its next draft pass
        self.unc, self.unc_n = torch.cat([r.pending[:, None], self.path(r)], dim=1), r.accepted + 1

    def commit(self, r, host, most):
        self.unc = self.unc[:, :most]

    def retire(self, keep, keep_list):
        self.dr.select(keep)
        self.unc, self.unc_n = self.unc[keep], self.unc_n[keep]


@register("async")
class Async(Method):
    """While the target verifies, one packed drafter pass prepares the next block for the likely
    outcomes (trays); a row whose outcome has a tray starts its next round at once (a hit).

    All drafter work runs on the passes' side stream (`stream`, CUDA) or, with overlap=thread,
    the tray pass runs in its worker thread; see the engine's module docstring."""

    keys = ("block_size", "C", "F", "coverage", "overlap", "cpu_threads_drafter")
    overlaps = True

    @staticmethod
    def budget(cfg):
        """Tokens in one packed pass: B * ((C-1)*F + 2), with at most the B-1 draft slots covered."""
        return cfg.block_size * (min(cfg.C - 1, cfg.block_size - 1) * cfg.F + 2)

    @classmethod
    def passes(cls, cfg):
        return {"target": cfg.block_size, "drafter": max(cls.budget(cfg), cfg.block_size)}  # the tray pass

    @staticmethod
    def narrower(cfg, where):
        return (f"lower {where}.C or {where}.F (the tray pass is B*((C-1)*F + 2) tokens: C=12 F=2 at B=16 is 384), "
                f"or set {where}.block_size to the drafter's training block size")

    def begin(self, prompts):
        p = self.p
        with _on(p.stream):
            self.dr = p.new_state(p.drafter, len(prompts), self.passes(self.cfg)["drafter"], side_stream=True)  # glue + trays
            p.prefill(self.dr, prompts)
        # the next block's logits per row, and which rows hit (host list; device mask for the CUDA path)
        self.prepared, self.hit, self.hit_dev = None, [False] * len(prompts), None

    def propose(self, r):
        p, ds = self.p, self.p.stream
        p.lend(ds, r.pending, r.next_pos, self.prepared, self.hit_dev)
        with _on(ds):
            miss = [i for i, h in enumerate(self.hit) if not h]
            if miss:
                t = r.clock.mark(ds)
                q_logits = self._draft_misses(r, miss)
                r.clock.span(r.stat, "draft_s", t, r.clock.mark(ds))
                r.stat["drafted_rows"] = len(miss)
            else:
                q_logits = self.prepared
            handed = self.drafts_from(r, q_logits)
            self.q_logits, self.glue_start = q_logits, len(self.dr)
        p.take(ds, *handed)

    def _draft_misses(self, r, miss: list[int]) -> torch.Tensor:
        """Drafter logits for every row: the hit rows' prepared blocks, a synchronous draft for the
        rest. The glue already committed every accepted token, so a draft pass here only runs a block
        and leaves the cache as it was. On CPU only the missed rows are drafted (a pass costs what its
        rows cost; their KV rows are copied out for it); on CUDA a pass over all rows costs about
        what a pass over a few costs (the weights are read once), so all rows are drafted; so does a
        static backend (a pass over all rows is its one compiled shape)."""
        p = self.p
        if self.prepared is None or len(miss) == len(self.hit) or p.device.type == "cuda" or p.static:
            q_logits = p.draft_pass(self.dr, r.pending, r.next_pos)
            if self.prepared is None or len(miss) == len(self.hit):
                return q_logits
            return torch.where(self.hit_dev[:, None, None], self.prepared, q_logits)
        idx = torch.tensor(miss, dtype=torch.long, device=p.device)
        part = p.draft_pass(self.dr.subset(idx), r.pending[idx], r.next_pos[idx])
        q_logits = self.prepared.clone()
        q_logits[idx] = part
        return q_logits

    def beside_verify(self, r):
        p, ds = self.p, self.p.stream
        args = (r.pending, r.drafts, self.q_logits, r.next_pos)
        if ds is not None:  # queued on the side stream; its inputs were lent to it before verify
            with _on(ds):
                t = r.clock.mark(ds)
                self.future = self._tray_pass(self.dr, *args)
                r.clock.span(r.stat, "tray_s", t, r.clock.mark(ds))
        elif p.pool is not None:  # a worker thread (CPU, overlap=thread)

            @torch.inference_mode()  # grad mode is per thread: the worker needs its own
            def work():
                t = time.perf_counter()
                res = self._tray_pass(self.dr, *args)
                r.stat["tray_s"] = time.perf_counter() - t
                return res

            self.future = p.pool.submit(work)
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
        self.p.take(self.p.stream, keys, self.tray_logits)
        r.hit_idx = self._find_trays(keys, self.outcome(r), r.token)

    def commit(self, r, host, most):
        p, ds = self.p, self.p.stream
        slots = self.kept_slots(r)
        p.lend(ds, r.accepted, slots)
        with _on(ds):  # the glue commits the pending token and the accepted drafts
            keep_slots(self.dr, self.glue_start, slots, r.accepted + 1, most)
        self.hit, self.hit_dev = [h[2] >= 0 for h in host], r.hit_idx >= 0
        r.stat["hit"] = list(self.hit)
        n = len(host)
        self.prepared = self.tray_logits[torch.arange(n, device=p.device), r.hit_idx.clamp(min=0)] if any(self.hit) else None

    def retire(self, keep, keep_list):
        p, ds = self.p, self.p.stream
        p.lend(ds, keep)
        with _on(ds):
            self.dr.select(keep)
        self.hit, self.hit_dev = [self.hit[i] for i in keep_list], self.hit_dev[keep]
        if self.prepared is not None:
            self.prepared = self.prepared[keep]

    # ---- the packed pass

    def _tray_pass(self, dr: KVState, pending, drafts, q_logits, next_pos):
        """Glue + trays in one packed pass. Returns (keys (b, n, 2), tray logits (b, n, B, V))."""
        p, cfg = self.p, self.cfg
        b, B, s, dev = len(pending), p.B, p.settings, p.device
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
        tray_logits = logits_at(p.drafter, h[:, B:].reshape(b, n, B, -1), s.vocab_size).float()
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
    def _find_trays(keys: torch.Tensor, outcome: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Index of the tray keyed (outcome, token) per row, -1 when none (a miss)."""
        match = (keys[:, :, 0] == outcome[:, None]) & (keys[:, :, 1] == token[:, None])
        found = match.any(dim=1)
        idx = match.long().argmax(dim=1)
        return torch.where(found, idx, torch.full_like(idx, -1))


class _TreeSteps:
    """The tree's half of a round, shared by `tree` (drafted synchronously) and `async_tree` (with
    trays): a tree of `tree_nodes` drafts from the drafter's block logits (d3d.decoding.tree:
    best-first by path probability, the chain inside), verified in one target pass of
    tree_nodes + 1 tokens, each node seeing the prefix, the pending token and its ancestors at
    position pending + depth. Acceptance takes the longest matching path (greedy) or
    multi-candidate rejection sampling (T > 0; the candidates are deterministic, so q only shapes
    the tree), and the caches keep the accepted path's slots (KVState.keep_path)."""

    backends = ("eager",)  # keep_path moves slots of HF's dynamic cache; the static buffers keep prefixes only

    def drafts_from(self, r, q_logits):
        p, s = self.p, self.cfg.sampling
        # the drafter's law at every block slot: greedy scores the tree by its plain softmax,
        # sampling by the q it would sample from; the draft slots shape the tree, and an async
        # tree's trays read all B (slot B-1: the bonus after the deepest nodes)
        self.law = probs(q_logits[:, : p.B], Sampling(1.0) if s.greedy else s)
        self.tree = build_tree(self.law[:, : p.B - 1], self.cfg.tree_nodes)
        self.anc = tree_ancestors(self.tree.parents)
        self.node_tok = torch.cat([r.pending[:, None], self.tree.tokens], dim=1)
        r.drafts, r.q = self.tree.tokens, None  # r.drafts: the nodes in tree order, not a chain
        return r.drafts, self.node_tok, self.anc

    def verify(self, tgt, r):
        h = tgt.forward(self.node_tok, tree_layout(r.next_pos, self.anc), tree=self.anc)
        return logits_at(self.p.target, h).float()

    def accept(self, r, p_logits):
        s = self.cfg.sampling
        if s.greedy:
            r.accepted, r.token, self.best = tree_greedy_verify(p_logits, self.node_tok, self.anc)
        else:
            r.accepted, r.token, self.best = tree_sample_verify(p_logits, self.node_tok, self.anc, s, self.p.gen)
        self.path_nodes, self.path_tok = tree_path(self.anc, self.best, self.node_tok, self.p.B - 1)

    def path(self, r):
        return self.path_tok

    def kept_slots(self, r):
        return torch.cat([torch.zeros_like(self.path_nodes[:, :1]), self.path_nodes], dim=1)  # pending, then the path

    def outcome(self, r):
        return self.best  # the node the accepted path ends at


@register("tree")
class Tree(_TreeSteps, Sync):
    """Sync drafting, tree verification (_TreeSteps); the drafter commits the accepted path in its
    next draft pass, as sync commits the chain."""

    keys = ("block_size", "tree_nodes")

    @classmethod
    def passes(cls, cfg):
        # the target verifies the pending token and every node; the drafter's pass is sync's
        return {"target": cfg.tree_nodes + 1, "drafter": 2 * cfg.block_size}

    @staticmethod
    def narrower(cfg, where):
        return f"lower {where}.tree_nodes (the verify pass is tree_nodes + 1 tokens) or {where}.block_size"


@register("async_tree")
class AsyncTree(_TreeSteps, Async):
    """Async with a tree of drafts: while the target verifies the tree, one packed drafter pass runs
    the glue (the tree itself, each node seeing its ancestors, so the drafter's cache can keep
    whichever path the target accepts) and `tree_trays` trays, one per outcome "the accepted path
    ends at node n, then token t" (t no child of n: a child would have extended the path). The
    outcomes are the likeliest under the drafter's own law, P(reach n) * q_{depth(n)}(t), the law
    the tree was built by; a leaf's outcome is its bonus. A tray [t, MASK x (B-1)] sits at
    position pending + depth(n) + 1 and sees the prefix, n's path and itself. A hit serves its
    block as the next round's drafter logits, from which the next tree grows; a miss drafts as
    async does. Tokens are the target's (verification decides them), so this is as lossless as
    the tree."""

    keys = ("block_size", "tree_nodes", "tree_trays", "overlap", "cpu_threads_drafter")

    @staticmethod
    def budget(cfg):
        """Tokens in one packed pass: the glue (tree_nodes + 1) + B per tray."""
        return cfg.tree_nodes + 1 + cfg.tree_trays * cfg.block_size

    @classmethod
    def passes(cls, cfg):
        return {"target": cfg.tree_nodes + 1, "drafter": max(cls.budget(cfg), cfg.block_size)}

    @staticmethod
    def narrower(cfg, where):
        return (f"lower {where}.tree_trays or {where}.tree_nodes (the tray pass is tree_nodes + 1 + "
                f"B * tree_trays tokens), or set {where}.block_size to the drafter's training block size")

    def _tray_pass(self, dr, pending, drafts, q_logits, next_pos):
        """Glue (the tree) + trays in one packed pass. Returns (keys (b, n, 2) = (node, token), tray logits (b, n, B, V)).
        Async's signature; the tree, its ancestors and its law come from drafts_from (self), not drafts / q_logits."""
        p, cfg, tree = self.p, self.cfg, self.tree
        b, B, s, dev = len(pending), p.B, p.settings, p.device
        g = self.node_tok.shape[1]  # glue: the pending token and the nodes
        v = self.law.shape[-1]
        # q after each node: slot depth(n) predicts the token after node n (slot B-1: the bonus)
        after = self.law.gather(1, tree.depth[:, :, None].expand(-1, -1, v))  # (b, g, V), the law the tree was built by
        children = tree.parents[:, 1:] * v + tree.tokens  # a child's token ends no path at its parent
        after = after.reshape(b, g * v).scatter(1, children, 0.0).reshape(b, g, v)
        k = min(cfg.tree_trays, v)
        top_q, top_t = after.topk(k, dim=-1)  # (b, g, k): each node's likeliest outcomes
        law = tree.score.exp()[:, :, None] * top_q  # P(reach n) * q(t)
        pick = law.reshape(b, g * k).topk(min(cfg.tree_trays, g * k), dim=-1).indices
        node, tok = pick // k, top_t.reshape(b, g * k).gather(1, pick)
        n = node.shape[1]
        keys = torch.stack([node, tok], dim=-1)
        anchor_pos = next_pos[:, None] + tree.depth.gather(1, node) + 1
        trays = torch.full((b, n, B), s.mask_token_id, dtype=torch.long, device=dev)
        trays[:, :, 0] = tok
        # in-row visibility: the glue is the tree; a tray sees its node's path (and its own block)
        seen = torch.ones(b, g + n * B, g + n * B, dtype=torch.bool, device=dev)
        seen[:, :g, :g] = self.anc
        seen[:, g:, :g] = self.anc.gather(1, node[:, :, None].expand(-1, -1, g)).repeat_interleave(B, dim=1)
        layout = concat(tree_layout(next_pos, self.anc), block_layout(anchor_pos, B))
        h = dr.forward(torch.cat([self.node_tok, trays.reshape(b, n * B)], dim=1), layout, tree=seen)
        dr.crop(len(dr) - n * B)  # keep the glue; verification decides which path of it stays
        tray_logits = logits_at(p.drafter, h[:, g:].reshape(b, n, B, -1), s.vocab_size).float()
        return keys, tray_logits
