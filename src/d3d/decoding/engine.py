"""The decoding driver: AR baseline, synchronous and asynchronous speculative decoding (DESIGN §5).

`SpecGenerator` is the driver every method shares: prefill, the target's verify pass, the accept
decision, the one host transfer per round, committing text (EOS, max_new_tokens, stop strings),
retiring finished rows and timing. What differs between methods — where drafts come from and what
runs beside verification — is a step object per method (d3d.decoding.methods, a registry keyed by
`decode.method`). One round of each, for a batch of requests (rows advance at their own speed):

    ar:    target([pending])                      -> next token
    sync:  drafter([newly committed | pending, MASK x (B-1)])      -> drafts d_1..d_{B-1}
           target([pending, d_1..d_{B-1}])        -> accept a drafts + 1 token (d3d.decoding.verify)
    async: while the target verifies, the drafter runs one packed pass of *trays*: the glue
           [pending, d_1..d_{B-1}] (causal: it commits whatever the target accepts) plus one block
           per anticipated outcome: "j-1 drafts accepted, then alternative t" for covered slots j
           and the top-F alternatives t, and "all accepted, then the bonus guess". If the outcome
           (a, token) has a tray, its drafts are the next block (a hit); rows that missed draft
           synchronously (on CPU only they do; on CUDA one pass over all rows costs the same).

The drafter's block slot B-1 predicts the token after the block: that is the bonus guess.
The target's pending token (the last committed one) is always fed in the next target pass, so the
target's cache holds committed tokens but the last; the drafter's cache likewise.

Devices. Every per-round tensor (pending tokens, positions, drafts, accept counts, tray keys and
their matching, masks) lives on the model's device; the host gets one small transfer per round
(accept counts, next tokens, hit indices and drafts: b x (B + 2) integers) to commit text, check
EOS / stop strings and retire rows. Sampling uses a generator on the device.

Streams (overlap=stream, CUDA). All drafter work runs on one side stream and all target work on
the current stream, so each KV cache has one owner stream and the caching allocator never hands
a cache's memory to the other stream. The few tensors that cross (drafts, q, tray logits one way;
pending tokens, positions, accept counts the other) are ordered with `wait_stream` and marked
with `record_stream`. Each round launches the verify pass first, then the tray pass, so the GPU
runs them concurrently.

Timings per round (`rounds[i]`): `wall_s` is host wall time from the round's start to its host
transfer (it includes waiting for the device). `draft_s`, `verify_s`, `tray_s` are the passes'
device time: CUDA events on their stream (on CUDA), wall time of the synchronous call (on CPU);
`verify_s` includes the accept/reject decision. `tray_wait_s` (CPU worker thread only) is how
long the main thread waited for the tray pass after verifying.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from d3d.errors import ConfigError
from d3d.decoding.kv import KVState, StaticKVState, batch_bucket
from d3d.decoding.verify import Sampling, greedy_verify, sample_verify
from d3d.models.drafter import DrafterSettings
from d3d.models.forward import logits_at
from d3d.models.masks import CLEAN, PAD, Layout, block_layout, concat


# How passes run (docs/design.md, Backends): eager (HF's dynamic cache, the reference) | static
# (preallocated slots) | compiled (static + torch.compile; CUDA graphs on CUDA) | frozen (compiled,
# weights folded into the graph: prepacked for oneDNN on CPU)
BACKENDS = ("eager", "static", "compiled", "frozen")
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
    backend: str = "eager"  # one of BACKENDS
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every setting checked here, before any model loads: a bad value used to fail deep in torch
        (block_size=0), run silently greedy (temperature=-1) or do nothing (top_p=2)."""
        def bad(key, allowed):
            raise ConfigError(f"decode.{key}={getattr(self, key)!r}: {allowed}")

        from d3d.decoding.methods import METHODS  # the registry names the methods there are

        choices = {"method": tuple(METHODS), "coverage": ("first", "confident"),
                   "overlap": ("auto", "stream", "thread", "none"), "backend": BACKENDS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                bad(key, f"use {', '.join(allowed[:-1])} or {allowed[-1]}")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
        low = 2 if METHODS[self.method].needs_drafter else 1  # a speculative block: the pending token + >= 1 draft
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
        """Tokens of drafter work beside each verification (async: the packed pass)."""
        from d3d.decoding.methods import method_class

        return method_class(self.method).budget(self)


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


def context_problem(target, prompts: list[list[int]], max_new_tokens: int, block: int = 0) -> str | None:
    """Why these prompts do not fit the target's context with max_new_tokens (and, for a loop that
    verifies blocks, one block past them), or None."""
    limit = getattr(target.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if limit and longest + max_new_tokens + block > limit:
        extra = f" + block {block}" if block else ""
        return (f"prompt of {longest} tokens + max_new_tokens {max_new_tokens}{extra} exceeds the "
                f"target's context of {limit} tokens")
    return None


def _sync(device: torch.device) -> None:
    """Only around prefill and at the end of a call (wall-clock totals): never inside a round."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Spans of device time: CUDA events recorded on a stream (read once, at the end of a call,
    so timing never synchronises the loop), or perf_counter on the CPU, where ops are synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[dict, str, object, object]] = []

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def span(self, stat: dict, key: str, start, end=None) -> None:
        self.spans.append((stat, key, start, self.mark() if end is None else end))

    def resolve(self) -> None:
        for stat, key, a, b in self.spans:
            stat[key] = a.elapsed_time(b) / 1000 if self.cuda else b - a
        self.spans = []


def _on(stream):
    """`with _on(s):` runs on CUDA stream s, or on whatever is current when s is None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class Round:
    """What one round knows, filled in as it goes (tensors on the device)."""

    pending: torch.Tensor  # (b,) the last committed token of each row
    next_pos: torch.Tensor  # (b,) its position
    stat: dict  # this round's record: rows, tau, hit, timings
    clock: "_Clock"
    drafts: torch.Tensor | None = None  # (b, B-1)
    q: torch.Tensor | None = None  # (b, B-1, V): the drafts' distributions (T > 0)
    accepted: torch.Tensor | None = None  # (b,)
    token: torch.Tensor | None = None  # (b,) correction or bonus
    hit_idx: torch.Tensor | None = None  # (b,) async: the tray that matched, -1 for none


class SpecGenerator:
    """`SpecGenerator(target, tokenizer, drafter, DecodeConfig(...)).generate(prompt_ids)`."""

    def __init__(self, target, tokenizer, drafter=None, config: DecodeConfig | None = None,
                 eos_token_ids: list[int] | None = None, seed: int = 0):
        from d3d.decoding.methods import method_class

        self.cfg = config or DecodeConfig()
        self.method = method_class(self.cfg.method)
        if self.method.needs_drafter and drafter is None:
            raise ValueError(f"decode.method={self.cfg.method} needs a drafter; use method=ar for the baseline")
        self.target, self.drafter, self.tok = target, drafter, tokenizer
        self.device = next(target.parameters()).device
        if drafter is not None and next(drafter.parameters()).device != self.device:
            raise ValueError(f"the drafter is on {next(drafter.parameters()).device} and the target on {self.device}: "
                             "put both on one device (the loop keeps its state there)")
        self.settings = DrafterSettings.of(drafter) if drafter is not None else None
        self.B = self.method.block_size(self.cfg)
        self.eos = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
        self.seed = seed
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.overlap = self.overlap_mode(self.cfg, self.device)
        self.dstream = torch.cuda.Stream(self.device) if self.overlap == "stream" else None
        self.pool = None  # overlap=thread: a worker thread that lives for one generate() call
        self.static = self.cfg.backend != "eager"
        self.states: dict[tuple[int, int], StaticKVState] = {}  # static buffers, reused across calls
        self.room = 0  # slots a call needs beyond its widest pass (set per call)

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
        if cfg.overlap == "thread" and device.type == "cuda":  # its worker would use the default stream
            raise ValueError("decode.overlap=thread is for CPUs; on CUDA use stream (or auto)")
        return cfg.overlap

    # ------------------------------------------------------------------ streams

    def lend(self, stream, *tensors) -> None:
        """`tensors`, made on the current stream, are about to be used on `stream`: order that
        stream after the work queued so far, and keep the allocator from reusing their memory
        until `stream` is done with them."""
        if stream is None:
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            if t is not None and t.numel():
                t.record_stream(stream)

    def take(self, stream, *tensors) -> None:
        """The converse: the current stream will use `tensors` that `stream` made."""
        if stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(stream)
        for t in tensors:
            if t is not None and t.numel():
                t.record_stream(current)

    # ------------------------------------------------------------------ passes shared by the methods

    def new_state(self, model, batch: int, widest: int, side_stream: bool = False) -> KVState:
        """An empty KV state for `model`: HF's dynamic cache (backend=eager), or static buffers
        big enough for this call (`room` + the widest pass), reused across calls. Their capacity is
        a power of two, and so is their batch (`batch_bucket`), so calls of similar lengths and
        sizes share one compiled shape."""
        if not self.static:
            return KVState(model, batch)
        need = self.room + widest
        capacity = max(256, 1 << (need - 1).bit_length())
        key = (id(model), batch_bucket(batch))
        state = self.states.get(key)
        if state is None or state.rows != key[1] or state.capacity < need:  # rows: a retiring call may have shrunk it
            state = StaticKVState(model, batch, capacity, compiled=self.cfg.backend in ("compiled", "frozen"),
                                  graphs=not (side_stream and self.dstream is not None), frozen=self.cfg.backend == "frozen")
            self.states[key] = state
        state.reset(batch)
        return state

    def prefill(self, state: KVState, prompts: list[list[int]]) -> None:
        """Every prompt token but the last (the first pending token), left-padded. Built on the
        host from Python lists and moved in one transfer per tensor."""
        lens = [len(p) - 1 for p in prompts]
        width = max(lens)
        if width == 0:
            return
        ids = [[0] * (width - n) + p[:-1] for p, n in zip(prompts, lens)]
        pos = [[0] * (width - n) + list(range(n)) for n in lens]
        block = [[PAD] * (width - n) + [CLEAN] * n for n in lens]
        dev = self.device
        ids, pos, block = (torch.tensor(x, dtype=torch.long, device=dev) for x in (ids, pos, block))
        state.forward(ids, Layout(pos, block, pos + 1), causal=True, once=True)

    def verify_pass(self, tgt: KVState, pending: torch.Tensor, drafts: torch.Tensor, next_pos: torch.Tensor):
        """Target logits at [pending, drafts] (b, B, V); their slots stay in the cache for now."""
        ids = torch.cat([pending[:, None], drafts], dim=1)
        pos = next_pos[:, None] + torch.arange(ids.shape[1], device=self.device)
        h = tgt.forward(ids, Layout(pos, torch.full_like(pos, CLEAN), pos + 1), causal=True)
        return logits_at(self.target, h).float()

    def draft_pass(self, dr: KVState, pending: torch.Tensor, next_pos: torch.Tensor, unc: torch.Tensor | None = None,
                   unc_n: torch.Tensor | None = None):
        """Commit each row's new tokens (`unc` (b, k), the first unc_n[r] of row r; they end just
        before next_pos) into the drafter's cache and draft the next block: logits (b, B, V)."""
        b, B, s, dev = len(pending), self.B, self.settings, self.device
        if unc is None:
            unc, unc_n = torch.zeros(b, 0, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev)
        real = unc.shape[1]
        if self.static and real:  # one width for every round (the most a round commits), so one compiled shape
            unc = torch.cat([unc, torch.zeros(b, B - real, dtype=torch.long, device=dev)], dim=1)
        k = unc.shape[1]
        span = torch.arange(k, device=dev)
        pos = (next_pos - unc_n)[:, None] + span
        block = torch.where(span[None, :] < unc_n[:, None], CLEAN, PAD)
        blocks = torch.full((b, B), s.mask_token_id, dtype=torch.long, device=dev)
        blocks[:, 0] = pending
        layout = concat(Layout(pos, block, pos + 1), block_layout(next_pos[:, None], B))
        h = dr.forward(torch.cat([unc, blocks], dim=1), layout)
        dr.crop(len(dr) - B - (k - real))  # the block's slots (and static padding) are never reused
        return logits_at(self.drafter, h[:, k:], s.vocab_size).float()  # (b, B, V)

    def context_problem(self, prompts: list[list[int]], max_new_tokens: int) -> str | None:
        """Why these prompts cannot be decoded (prompt + new tokens + a block past the target's
        context), or None. The loop refuses such a call; d3d.eval asks first and skips the request."""
        return context_problem(self.target, prompts, max_new_tokens, self.B)

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None,
                 seed: int | None = None) -> GenerationResult:
        """Decode a batch of prompts (token id lists). `seed` restarts the sampling stream for
        this call, so one request's sampled output does not depend on what ran before it."""
        if seed is not None:
            self.gen.manual_seed(int(seed))
        if self.overlap != "thread":
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
        cfg, B, dev = self.cfg, self.B, self.device
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        max_new = int(max_new_tokens or cfg.max_new_tokens)
        problem = self.context_problem(prompts, max_new)
        if problem:
            raise ValueError(f"{problem}. Fix: shorten the prompt or lower max_new_tokens.")
        b = len(prompts)
        clock = _Clock(dev)
        step = self.method(self)
        self.room = max(len(p) for p in prompts) + max_new + B  # slots committed at most, before a pass
        _sync(dev)
        t0 = time.perf_counter()
        tgt = self.new_state(self.target, b, B)
        self.prefill(tgt, prompts)
        step.begin(prompts)
        _sync(dev)
        prefill_s = time.perf_counter() - t0

        rows = list(range(b))  # original index of each active row (host bookkeeping)
        pending = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=dev)
        next_pos = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=dev)
        out: list[list[int]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        rounds = []
        t_dec = time.perf_counter()
        while rows:
            r_start = time.perf_counter()
            r = Round(pending, next_pos, {"rows": list(rows)}, clock)
            step.propose(r)  # r.drafts (b, B-1), r.q
            start = len(tgt)
            v0 = clock.mark()
            p_logits = self.verify_pass(tgt, pending, r.drafts, next_pos)
            step.beside_verify(r)  # launched after verification: on CUDA the two overlap
            if cfg.sampling.greedy:
                r.accepted, r.token = greedy_verify(p_logits, r.drafts)
            else:
                q = r.q if r.q is not None else torch.zeros_like(p_logits[:, :0])
                r.accepted, r.token = sample_verify(p_logits, r.drafts, q, cfg.sampling, self.gen)
            clock.span(r.stat, "verify_s", v0)
            step.settle(r)
            # ---- the one host transfer of the round: accept counts, next tokens, hits, drafts
            hits = r.hit_idx if r.hit_idx is not None else r.accepted
            host = torch.cat([r.accepted[:, None], r.token[:, None], hits[:, None], r.drafts], dim=1).tolist()
            most = max(h[0] for h in host) + 1  # the longest commit of any row
            tgt.keep_first(start, r.accepted + 1, most)
            step.commit(r, host, most)
            # ---- commit: accepted drafts + the correction/bonus token; stop at EOS / max_new / stop string
            taus, finished = [], []
            for i, (a, tok, _, *drafted) in enumerate(host):
                row = rows[i]
                kept = self._commit(out[row], drafted[:a] + [tok], max_new, reasons, row)
                taus.append(kept)
                if kept < a + 1 or len(out[row]) >= max_new or reasons[row] == "stop":
                    finished.append(i)
            r.stat["tau"] = taus
            pending = r.token
            next_pos = next_pos + r.accepted + 1
            r.stat["wall_s"] = time.perf_counter() - r_start
            rounds.append(r.stat)
            if finished:
                keep_list = [i for i in range(len(rows)) if i not in set(finished)]
                if not keep_list:
                    break
                keep = torch.tensor(keep_list, dtype=torch.long, device=dev)
                rows = [rows[i] for i in keep_list]
                pending, next_pos = pending[keep], next_pos[keep]
                tgt.select(keep)
                step.retire(keep, keep_list)
        _sync(dev)
        decode_s = time.perf_counter() - t_dec
        clock.resolve()
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
