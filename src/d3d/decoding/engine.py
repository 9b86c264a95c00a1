"""The decoding loops: AR baseline, synchronous and asynchronous speculative decoding (DESIGN §5).

One round of each, for a batch of requests (rows advance at their own speed; finished rows leave):

    ar:    target([pending])                      -> next token
    sync:  drafter([newly committed | pending, MASK x (B-1)])      -> drafts d_1..d_{B-1}
           target([pending, d_1..d_{B-1}])        -> accept a drafts + 1 token (d3d.decoding.verify)
    async: while the target verifies, the drafter runs one packed pass of *trays*: the glue
           [pending, d_1..d_{B-1}] (causal: it commits whatever the target accepts) plus one block
           per anticipated outcome: "j-1 drafts accepted, then alternative t" for covered slots j
           and the top-F alternatives t, and "all accepted, then the bonus guess". If the outcome
           (a, token) has a tray, its drafts are the next block (a hit); else draft synchronously.

The drafter's block slot B-1 predicts the token after the block: that is the bonus guess.
The target's pending token (the last committed one) is always fed in the next target pass, so the
target's cache holds committed tokens but the last; the drafter's cache likewise.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from d3d.config import ConfigError
from d3d.decoding.kv import KVState
from d3d.decoding.verify import Sampling, draft_from, greedy_verify, probs, sample_verify
from d3d.models.drafter import DrafterSettings, logits_at
from d3d.models.masks import CLEAN, PAD, Layout, block_layout, concat


MAX_BLOCK = 256  # far above any trained drafter (16); 1000 used to run for minutes before anything failed


@dataclass
class DecodeConfig:
    method: str = "sync"  # ar | sync | async
    block_size: int = 16
    C: int = 12  # async: covered rejection slots + 1
    F: int = 2  # async: alternatives per covered slot
    coverage: str = "first"  # first | confident
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    overlap: str = "auto"  # auto | stream | thread | none (see SpecGenerator.overlap_mode)
    cpu_threads_drafter: int | None = None  # overlap=thread on CPU: cores for the drafter (None = half)
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every setting checked here, before any model loads: a bad value used to fail deep in torch
        (block_size=0), run silently greedy (temperature=-1) or do nothing (top_p=2)."""
        def bad(key, allowed):
            raise ConfigError(f"decode.{key}={getattr(self, key)!r}: {allowed}")

        choices = {"method": ("ar", "sync", "async"), "coverage": ("first", "confident"),
                   "overlap": ("auto", "stream", "thread", "none")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                bad(key, f"use {', '.join(allowed[:-1])} or {allowed[-1]}")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
        low = 1 if self.method == "ar" else 2  # a speculative block holds the pending token and >= 1 draft
        if not whole(self.block_size) or not low <= self.block_size <= MAX_BLOCK:
            bad("block_size", f"an integer in [{low}, {MAX_BLOCK}] for method={self.method} (the drafter's "
                              "training block size is the right one)")
        for key, least in (("C", 1), ("F", 0), ("top_k", 0), ("max_new_tokens", 1)):
            if not whole(getattr(self, key)) or getattr(self, key) < least:
                bad(key, f"an integer >= {least}" + (" (0 = off)" if key == "top_k" else ""))
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1] (1 = off)")

    @classmethod
    def from_cfg(cls, cfg) -> "DecodeConfig":
        return cls(**{k: (list(cfg[k]) if k == "stop_strings" else cfg[k])
                      for k in cls.__dataclass_fields__ if k in cfg})

    @property
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), int(self.top_k))

    @property
    def budget(self) -> int:
        """Tokens in one packed async pass: B * ((C-1)*F + 2), with at most the B-1 draft slots
        covered (C > B buys nothing: `_covered_slots` caps it)."""
        return self.block_size * (min(self.C - 1, self.block_size - 1) * self.F + 2)


@dataclass
class GenerationResult:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    rounds: list[dict]  # one per round: tau/hit per active row, times
    prefill_s: float
    decode_s: float

    def taus(self, row: int | None = None) -> list[int]:
        out = []
        for r in self.rounds:
            for rid, tau in zip(r["rows"], r["tau"]):
                if row is None or rid == row:
                    out.append(tau)
        return out

    @property
    def mean_tau(self) -> float:
        t = self.taus()
        return sum(t) / max(len(t), 1)

    @property
    def hit_rate(self) -> float | None:
        hits = [h for r in self.rounds for h in r.get("hit", []) if h is not None]
        return sum(hits) / len(hits) if hits else None

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecGenerator:
    """`SpecGenerator(target, tokenizer, drafter, DecodeConfig(...)).generate(prompt_ids)`."""

    def __init__(self, target, tokenizer, drafter=None, config: DecodeConfig | None = None,
                 eos_token_ids: list[int] | None = None, seed: int = 0):
        self.cfg = config or DecodeConfig()
        if self.cfg.method != "ar" and drafter is None:
            raise ValueError(f"decode.method={self.cfg.method} needs a drafter; use method=ar for the baseline")
        self.target, self.drafter, self.tok = target, drafter, tokenizer
        self.device = next(target.parameters()).device
        self.settings = DrafterSettings.of(drafter) if drafter is not None else None
        self.B = 1 if self.cfg.method == "ar" else int(self.cfg.block_size)
        self.eos = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.overlap = self.overlap_mode(self.cfg, self.device)
        self.side_stream = torch.cuda.Stream(self.device) if self.overlap == "stream" else None
        self.pool = None  # overlap=thread: a worker thread that lives for one generate() call

    @staticmethod
    def overlap_mode(cfg: DecodeConfig, device: torch.device) -> str:
        """How the packed tray pass runs beside verification: stream | thread | none.

        auto = a side CUDA stream on GPU and *serial* on CPU: measured on 2 cores, a drafter worker
        thread made async slower (TPOT 328 vs 263 ms) and left the process slower afterwards (sync
        151 -> 219 ms), because two OpenMP teams then fight for the same cores. overlap=thread
        splits the cores (cpu_threads_drafter) for machines that have cores to spare."""
        if cfg.method != "async" or cfg.overlap == "none":
            return "none"
        if cfg.overlap not in ("auto", "stream", "thread"):
            raise ValueError(f"decode.overlap={cfg.overlap!r}: use auto, stream, thread or none")
        if cfg.overlap == "auto":
            return "stream" if device.type == "cuda" else "none"
        if cfg.overlap == "stream" and device.type != "cuda":
            raise ValueError("decode.overlap=stream needs a CUDA device; use thread or none on CPU")
        return cfg.overlap

    # ------------------------------------------------------------------ passes

    def _prefill(self, state: KVState, prompts: list[list[int]]) -> None:
        """Every prompt token but the last (the first pending token), left-padded."""
        lens = [len(p) - 1 for p in prompts]
        width = max(lens)
        if width == 0:
            return
        b = len(prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        block = torch.full((b, width), PAD, dtype=torch.long)
        for r, (p, n) in enumerate(zip(prompts, lens)):
            if n:
                ids[r, width - n :] = torch.tensor(p[:-1])
                pos[r, width - n :] = torch.arange(n)
                block[r, width - n :] = CLEAN
        state.forward(ids, Layout(pos, block, pos + 1))

    def _verify_pass(self, tgt: KVState, pending: torch.Tensor, drafts: torch.Tensor, next_pos: torch.Tensor):
        """Target logits at [pending, drafts] (b, B, V); their slots stay in the cache for now."""
        ids = torch.cat([pending[:, None], drafts], dim=1)
        n = ids.shape[1]
        pos = next_pos[:, None] + torch.arange(n)
        h = tgt.forward(ids, Layout(pos, torch.full_like(pos, CLEAN), pos + 1))
        return logits_at(self.target, h).float()

    def _draft_pass(self, dr: KVState, uncommitted: list[list[int]], pending: torch.Tensor, next_pos: torch.Tensor):
        """Commit each row's new tokens into the drafter's cache and draft the next block."""
        b, B, s = len(pending), self.B, self.settings
        k = max((len(u) for u in uncommitted), default=0)
        ids = torch.zeros(b, k, dtype=torch.long)
        pos = torch.zeros(b, k, dtype=torch.long)
        block = torch.full((b, k), PAD, dtype=torch.long)
        for r, u in enumerate(uncommitted):
            if u:
                ids[r, : len(u)] = torch.tensor(u)
                pos[r, : len(u)] = next_pos[r] - len(u) + torch.arange(len(u))
                block[r, : len(u)] = CLEAN
        blocks = torch.full((b, B), s.mask_token_id, dtype=torch.long)
        blocks[:, 0] = pending
        layout = concat(Layout(pos, block, pos + 1), block_layout(next_pos[:, None], B))
        h = dr.forward(torch.cat([ids, blocks], dim=1), layout)
        dr.crop(len(dr) - B)  # the block's slots are never reused
        return logits_at(self.drafter, h[:, k:], s.vocab_size).float()  # (b, B, V)

    def _tray_pass(self, dr: KVState, pending, drafts, q_logits, next_pos):
        """Glue + trays in one packed pass. Returns (keys (b, n, 2), tray logits (b, n, B, V))."""
        b, B, s, cfg = len(pending), self.B, self.settings, self.cfg
        glue = torch.cat([pending[:, None], drafts], dim=1)
        gpos = next_pos[:, None] + torch.arange(B)
        slots = self._covered_slots(q_logits, drafts)  # (b, C-1): slot j = 1..B-1
        scores = probs(q_logits, cfg.sampling) if not cfg.sampling.greedy else q_logits
        alt_scores = scores[:, : B - 1].gather(1, (slots - 1)[:, :, None].expand(-1, -1, scores.shape[-1])).clone()
        drafted = drafts.gather(1, slots - 1)
        alt_scores.scatter_(2, drafted[:, :, None], float("-inf"))  # the drafted token is no alternative
        alts = alt_scores.topk(cfg.F, dim=-1).indices if cfg.F > 0 else torch.zeros(b, slots.shape[1], 0, dtype=torch.long)
        anchor_pos = (next_pos[:, None, None] + slots[:, :, None]).expand_as(alts).reshape(b, -1)
        anchor_tok = alts.reshape(b, -1)
        keys_a = (slots[:, :, None] - 1).expand_as(alts).reshape(b, -1)
        bonus = q_logits[:, B - 1].argmax(-1)  # slot B-1 guesses the token after the block
        anchor_pos = torch.cat([anchor_pos, (next_pos + B)[:, None]], dim=1)
        anchor_tok = torch.cat([anchor_tok, bonus[:, None]], dim=1)
        keys = torch.stack([torch.cat([keys_a, torch.full((b, 1), B - 1)], dim=1), anchor_tok], dim=-1)
        n = anchor_tok.shape[1]
        trays = torch.full((b, n, B), s.mask_token_id, dtype=torch.long)
        trays[:, :, 0] = anchor_tok
        layout = concat(Layout(gpos, torch.full_like(gpos, CLEAN), gpos + 1), block_layout(anchor_pos, B))
        h = dr.forward(torch.cat([glue, trays.reshape(b, n * B)], dim=1), layout)
        dr.crop(len(dr) - n * B)  # keep the glue (B slots); verification decides how much of it stays
        tray_logits = logits_at(self.drafter, h[:, B:].reshape(b, n, B, -1), s.vocab_size).float()
        return keys, tray_logits

    def _covered_slots(self, q_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Rejection slots j (1-based draft index) that get trays: the first C-1, or the C-1 where
        rejection is likeliest under the drafter: prod_{i<j} q(d_i) * (1 - q(d_j))."""
        b, n = drafts.shape
        c = max(0, min(self.cfg.C - 1, n))
        if self.cfg.coverage == "first" or c == 0:
            return torch.arange(1, c + 1).expand(b, c).clone()
        q = probs(q_logits[:, :n], Sampling(1.0)) if self.cfg.sampling.greedy else probs(q_logits[:, :n], self.cfg.sampling)
        qd = q.gather(2, drafts[:, :, None]).squeeze(2)
        survive = torch.cat([torch.ones(b, 1), qd.cumprod(1)[:, :-1]], dim=1)
        reject_here = survive * (1 - qd)
        return (reject_here.topk(c, dim=1).indices + 1).sort(dim=1).values

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None,
                 seed: int | None = None) -> GenerationResult:
        if seed is not None:  # this call's own random stream (per-item streams resume identically)
            self.gen.manual_seed(int(seed))
        if self.overlap == "none":
            return self._generate(prompts, max_new_tokens)
        # a worker thread for this call only; on CPU the cores are split between target and drafter
        split = self.device.type == "cpu"
        total = torch.get_num_threads()
        k = int(self.cfg.cpu_threads_drafter or max(1, total // 2))
        self.pool = ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads if split else None,
                                       initargs=(k,) if split else ())
        if split:
            torch.set_num_threads(max(1, total - k))
        try:
            return self._generate(prompts, max_new_tokens)
        finally:
            self.pool.shutdown()
            self.pool = None
            torch.set_num_threads(total)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_new_tokens: int | None) -> GenerationResult:
        cfg, B = self.cfg, self.B
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        max_new = int(max_new_tokens or cfg.max_new_tokens)
        limit = getattr(self.target.config, "max_position_embeddings", None)
        if limit and max(len(p) for p in prompts) + max_new + B > limit:
            raise ValueError(f"prompt + max_new_tokens ({max(len(p) for p in prompts)} + {max_new}) exceeds the "
                             f"target's context of {limit} tokens. Fix: shorten the prompt or lower max_new_tokens.")
        b = len(prompts)
        _sync(self.device)
        t0 = time.perf_counter()
        tgt = KVState(self.target, b)
        self._prefill(tgt, prompts)
        dr = None
        if self.drafter is not None:
            dr = KVState(self.drafter, b)
            self._prefill(dr, prompts)
        _sync(self.device)
        prefill_s = time.perf_counter() - t0

        rows = torch.arange(b)  # original index of each active row
        pending = torch.tensor([p[-1] for p in prompts])
        next_pos = torch.tensor([len(p) - 1 for p in prompts])
        out: list[list[int]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        uncommitted: list[list[int]] = [[] for _ in range(b)]
        prepared = None  # async: (drafts, q_logits) for every active row from a hit
        rounds = []
        t_dec = time.perf_counter()
        while len(rows):
            r_start = time.perf_counter()
            stat: dict = {"rows": rows.tolist()}
            n_active = len(rows)
            if cfg.method == "ar":
                start = len(tgt)
                p_logits = self._verify_pass(tgt, pending, torch.zeros(n_active, 0, dtype=torch.long), next_pos)
                accepted = torch.zeros(n_active, dtype=torch.long)
                token = p_logits[:, 0].argmax(-1) if cfg.sampling.greedy else \
                    torch.multinomial(probs(p_logits[:, 0], cfg.sampling), 1, generator=self.gen)[:, 0]
                drafts = torch.zeros(n_active, 0, dtype=torch.long)
                tgt.keep_first(start, accepted + 1)
                stat["verify_s"] = time.perf_counter() - r_start
            else:
                if prepared is None:
                    t = time.perf_counter()
                    q_logits = self._draft_pass(dr, uncommitted, pending, next_pos)
                    _sync(self.device)
                    stat["draft_s"] = time.perf_counter() - t
                    uncommitted = [[] for _ in range(n_active)]
                else:
                    q_logits = prepared
                drafts, q = draft_from(q_logits[:, : B - 1], cfg.sampling, self.gen)
                future = None
                glue_start = len(dr)
                if cfg.method == "async":
                    future = self._launch_trays(dr, pending, drafts, q_logits, next_pos)
                t = time.perf_counter()
                start = len(tgt)
                p_logits = self._verify_pass(tgt, pending, drafts, next_pos)
                if cfg.sampling.greedy:
                    accepted, token = greedy_verify(p_logits.cpu(), drafts)
                else:
                    accepted, token = sample_verify(p_logits.cpu(), drafts, q.cpu(), cfg.sampling, self.gen)
                _sync(self.device)
                stat["verify_s"] = time.perf_counter() - t
                tgt.keep_first(start, accepted + 1)
                prepared = None
                if future is not None:
                    t = time.perf_counter()
                    keys, tray_logits = future.result() if hasattr(future, "result") else future
                    stat["tray_wait_s"] = time.perf_counter() - t
                    dr.keep_first(glue_start, accepted + 1)  # the glue commits pending + accepted drafts
                    hit_idx = self._find_trays(keys, accepted, token)
                    stat["hit"] = (hit_idx >= 0).tolist()
                    if bool((hit_idx >= 0).all()):
                        prepared = tray_logits[torch.arange(n_active), hit_idx]
                else:
                    for i in range(n_active):
                        uncommitted[i] = [int(pending[i])] + drafts[i, : int(accepted[i])].tolist()
            # commit: accepted drafts + the correction/bonus token; stop at EOS / max_new / stop string
            taus, finished = [], []
            for i in range(n_active):
                row = int(rows[i])
                new = drafts[i, : int(accepted[i])].tolist() + [int(token[i])]
                kept = self._commit(out[row], new, max_new, reasons, row)
                taus.append(kept)
                if kept < len(new) or len(out[row]) >= max_new or reasons[row] == "stop":
                    finished.append(i)
            stat["tau"] = taus
            stat["wall_s"] = time.perf_counter() - r_start
            rounds.append(stat)
            pending = token
            next_pos = next_pos + accepted + 1
            if finished:
                keep = torch.tensor([i for i in range(n_active) if i not in set(finished)], dtype=torch.long)
                if len(keep) == 0:
                    break
                rows, pending, next_pos = rows[keep], pending[keep], next_pos[keep]
                tgt.select(keep)
                if dr is not None:
                    dr.select(keep)
                uncommitted = [uncommitted[i] for i in keep.tolist()]
                if prepared is not None:
                    prepared = prepared[keep]
        _sync(self.device)
        decode_s = time.perf_counter() - t_dec
        texts = [self.tok.decode(t, skip_special_tokens=True) for t in out]
        return GenerationResult(out, texts, reasons, rounds, prefill_s, decode_s)

    def _commit(self, out: list[int], new: list[int], max_new: int, reasons: list[str], row: int) -> int:
        kept = 0
        for t in new:
            if len(out) >= max_new:
                break
            out.append(t)
            kept += 1
            if t in self.eos:
                reasons[row] = "stop"
                break
        if self.cfg.stop_strings and reasons[row] != "stop":
            text = self.tok.decode(out[-(len(new) + 32):], skip_special_tokens=True)
            if any(s in text for s in self.cfg.stop_strings):
                # cut right after the first token whose text completes a stop string
                for n in range(len(out) - kept + 1, len(out) + 1):
                    if any(s in self.tok.decode(out[:n], skip_special_tokens=True) for s in self.cfg.stop_strings):
                        kept -= len(out) - n
                        del out[n:]
                        reasons[row] = "stop"
                        break
        return kept

    def _launch_trays(self, dr, pending, drafts, q_logits, next_pos):
        if self.pool is None:  # overlap=none: serially, before verification
            return self._tray_pass(dr, pending, drafts, q_logits, next_pos)

        if self.side_stream is not None:  # the drafts were made on the main stream
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))

        @torch.inference_mode()  # grad mode is per thread: the worker needs its own
        def work():
            if self.side_stream is None:
                return self._tray_pass(dr, pending, drafts, q_logits, next_pos)
            with torch.cuda.stream(self.side_stream):
                res = self._tray_pass(dr, pending, drafts, q_logits, next_pos)
            self.side_stream.synchronize()
            return res

        return self.pool.submit(work)

    @staticmethod
    def _find_trays(keys: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Index of the tray keyed (accepted, token) per row, -1 when none (a miss)."""
        match = (keys[:, :, 0] == accepted[:, None]) & (keys[:, :, 1] == token[:, None])
        found = match.any(dim=1)
        idx = match.float().argmax(dim=1)
        return torch.where(found, idx, torch.full_like(idx, -1))
