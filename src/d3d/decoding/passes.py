"""What the driver hands a method's schedule: the passes it may run and what one round knows.

`Passes` holds the models' passes over KV states (prefill, the target's verify pass, the drafter's
draft pass), the sampling generator, and where work beside verification runs: a side CUDA stream
(`stream`) or a worker thread (`pool`), present only when the schedule overlaps (Schedule.overlaps)
and its overlap mode resolved to one. A schedule sees this object, never the driver, so what a method
may touch is the list below. `Round` is one round's record, filled in by the driver and the schedule.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, is_dataclass

import torch

from d3d.decoding.drafts import Draft, moved
from d3d.decoding.kv import KVState, SideStreamGraphs, StaticKVState, allocate, batch_bucket
from d3d.errors import ConfigError
from d3d.models.drafter_settings import DrafterSettings, draft_map
from d3d.models.forward import in_target_vocab, logits_at
from d3d.models.masks import CLEAN, PAD, Layout, block_layout, concat
from d3d.models.target import input_device


def _sync(*devices: torch.device) -> None:
    """Only around prefill and at the end of a call (wall-clock totals): never inside a round."""
    for device in dict.fromkeys(devices):  # the target's and the drafter's, once each
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class _Clock:
    """Spans of device time: CUDA events recorded on a stream (read once, at the end of a call,
    so timing never synchronises the loop), or perf_counter on the CPU, where ops are synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[RoundStats, str, object, object]] = []
        self.overlaps: list[tuple] = []

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def span(self, stats: RoundStats, name: str, start, end=None) -> None:
        """stats.<name> = the time from `start` to `end` (now), once the call resolves it."""
        self.spans.append((stats, name, start, self.mark() if end is None else end))

    def hidden(self, stats: RoundStats, origin, verify: tuple, trays: tuple) -> None:
        """stats.tray_hidden_s = how long the tray pass (marks `trays`, on its stream) ran while the
        verify pass (marks `verify`, on the target's) ran: the overlap of the two spans, once the
        call resolves it. `origin`: a mark both streams passed before either span began (on CUDA
        the events are read as times after it)."""
        self.overlaps.append((stats, origin, verify, trays))

    def resolve(self) -> None:
        for stats, name, a, b in self.spans:
            setattr(stats, name, a.elapsed_time(b) / 1000 if self.cuda else b - a)
        for stats, origin, verify, trays in self.overlaps:
            (v0, v1), (t0, t1) = [[origin.elapsed_time(e) / 1000 if self.cuda else e - origin for e in span]
                                  for span in (verify, trays)]
            stats.tray_hidden_s = max(0.0, min(v1, t1) - max(v0, t0))
        self.spans, self.overlaps = [], []


def _tensors(value) -> list:
    """The tensors of a tensor, a Draft (its fields, a tree's included) or None."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for f in fields(value) for t in _tensors(getattr(value, f.name))] if is_dataclass(value) else []


def _moved(value, device: torch.device):
    """A tensor or a Draft on `device` (None stays None)."""
    if value is None:
        return None
    return value.to(device) if isinstance(value, Draft) else moved(value, device)


def _on(stream):
    """`with _on(s):` runs on CUDA stream s, or on whatever is current when s is None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class RoundStats:
    """What one round reports (GenerationResult.rounds): per active row, and the passes' times in
    seconds (engine docstring, Timings). A field a method does not measure stays None."""

    rows: list[int]  # the original index of each active row
    tau: list[int] = field(default_factory=list)  # tokens each row committed this round
    hit: list[bool] | None = None  # whether each row's outcome had a tray (methods with trays)
    drafted_rows: int | None = None  # rows drafted synchronously (async: the rows that missed)
    wall_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    tray_s: float | None = None
    tray_wait_s: float | None = None  # overlap=thread: how long the main thread waited for the trays
    tray_hidden_s: float | None = None  # of tray_s, what ran while the target's verify pass ran (its overlap)
    issue_s: float | None = None  # CUDA: host time from the round's start to its host transfer, before waiting there


@dataclass
class Round:
    """One round's record, filled in as it goes (tensors on the device): what the driver knows,
    the drafts, their verdict, and what a schedule hands from one hook to the next within the
    round, so a round can be followed from propose to commit by its data."""

    pending: torch.Tensor  # (b,) the last committed token of each row
    next_pos: torch.Tensor  # (b,) its position
    stats: RoundStats
    clock: _Clock
    draft: Draft | None = None  # this round's drafts (Schedule.propose, by Drafts.make)
    # the verdict (Drafts.accept)
    accepted: torch.Tensor | None = None  # (b,) drafts accepted
    token: torch.Tensor | None = None  # (b,) correction or bonus
    path: torch.Tensor | None = None  # (b, B-1) tokens whose first `accepted` each row commits, before `token`
    kept: torch.Tensor | None = None  # (b, k) the verified slots of the pending token and the path; None = a prefix
    outcome: torch.Tensor | None = None  # (b,) where verification ended, as a tray is keyed
    # async: where the glue starts in the drafter's cache, the tray pass's (keys, logits) (a future
    # while a worker thread runs it), and the tray that served each row's outcome, -1 for none
    verify_marks: tuple | None = None  # (round start, verify start, verify end) on the target's stream (Clock.mark)
    glue_start: int = 0
    tray_inputs: tuple | None = None  # (draft, pending, next_pos) on the drafter's device, sent before verification
    trays: object = None
    hit_idx: torch.Tensor | None = None


class Passes:
    """The passes a step may run and the streams it runs them on (module docstring).

    `target`, `drafter` (None for drafter-free methods), `settings` (the drafter's), `device`,
    `B` (the method's block: the pending token + B-1 drafts), `gen` (the sampling generator),
    `static` (a static backend: one shape per pass), `stream` and `pool` (work beside
    verification), `new_state`, `prefill`, `verify_pass`, `draft_pass`, `lend`, `take`."""

    def __init__(self, target, drafter, block: int, backend: str, overlap: str, gen: torch.Generator,
                 cpu_threads_drafter: int | None = None):
        self.target, self.drafter, self.B, self.gen = target, drafter, block, gen
        # the loop's state lives where the target's inputs go; the drafter's where its weights are
        self.device = input_device(target)
        self.drafter_device = input_device(drafter) if drafter is not None else self.device
        self.settings = DrafterSettings.of(drafter) if drafter is not None else None
        # a draft vocabulary's map to target ids, where drafts are made (None: the full head)
        d2t = draft_map(drafter) if drafter is not None else None
        self.d2t = None if d2t is None else moved(d2t, self.device)
        self.backend, self.static = backend, backend != "eager"
        spread = {p.device for p in target.parameters()}
        if self.static and len(spread) > 1:
            raise ConfigError(f"decode.backend={backend}: the target is spread over {len(spread)} devices "
                              f"(target.device_map), and a static backend keeps its cache on one. Fix: "
                              f"decode.backend=eager, or a device_map that puts the target on one device.")
        self.overlap, self.cpu_threads_drafter = overlap, cpu_threads_drafter
        # a drafter on a device of its own runs beside the target without a side stream: each device
        # queues its own work, and the copies between them (to_drafter, to_target) order the two
        two = self.drafter_device != self.device
        self.stream = torch.cuda.Stream(self.device) if overlap == "stream" and not two else None
        # two GPUs: the copies between them run on two streams of the target's device (to_drafter,
        # to_target), never on the stream its passes run on
        both_cuda = two and self.device.type == self.drafter_device.type == "cuda"
        self.outbox = torch.cuda.Stream(self.device) if both_cuda else None
        self.inbox = torch.cuda.Stream(self.device) if both_cuda else None
        # a compiled backend's passes on the side stream: CUDA graphs of their own pool, kept across calls
        # with the buffers they read (the main stream's passes are inductor's CUDA-graph trees)
        self.side_graphs = SideStreamGraphs(self.stream, backend == "frozen") \
            if self.stream is not None and backend in ("compiled", "frozen") else None
        self.pool = None  # overlap=thread: a worker thread that lives for one generate() call
        # static buffers, reused across calls: (id(model), rows, capacity) -> (cache, slot_pos, slot_valid)
        self.buffer_pool: dict[tuple[int, int, int], tuple] = {}
        self.room = 0  # slots a call needs beyond its widest pass (set per call)

    @contextlib.contextmanager
    def call(self):
        """One generate() call. With overlap=thread, a worker thread for this call only; on CPU
        the cores are split between target and drafter (cpu_threads_drafter, None = half)."""
        if self.overlap != "thread":
            yield
            return
        split = self.device.type == "cpu"
        total = torch.get_num_threads()
        k = int(self.cpu_threads_drafter or max(1, total // 2))
        self.pool = ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads if split else None,
                                       initargs=(k,) if split else ())
        if split:
            torch.set_num_threads(max(1, total - k))
        try:
            yield
        finally:
            self.pool.shutdown()
            self.pool = None
            torch.set_num_threads(total)

    # ------------------------------------------------------------------ devices

    # A copy between two GPUs runs on the source device's current stream, behind a two-way barrier
    # with the destination's current stream: each waits for what the other had queued. Issued on
    # the target's own stream after its verify pass, a copy to the drafter would wait for that
    # verification (and the drafter's tray pass with it); a copy back would hold the drafter's
    # stream until verification ends. So both directions run on streams of their own on the
    # target's device (`outbox`, `inbox`), and the target's stream waits for a copy back only
    # where it reads it (`take`).

    def to_drafter(self, *values):
        """The loop's tensors (or a Draft) a drafter pass reads, on the drafter's device: explicit
        copies when drafter.device is not the target's (on `outbox`, after the work queued so far on
        the target's stream), the same values otherwise."""
        if self.outbox is None:
            return tuple(_moved(v, self.drafter_device) for v in values)
        self.lend(self.outbox, *[t for v in values for t in _tensors(v)])
        with torch.cuda.stream(self.outbox):
            return tuple(_moved(v, self.drafter_device) for v in values)

    def to_target(self, *tensors, wait: bool = True):
        """The drafter's results the loop reads (logits, tray keys), on the loop's device. Between
        two GPUs copied on `inbox`, which waits for nothing of the target's; `wait=False` leaves the
        target's stream free until a `take(inbox, ...)` where it reads them."""
        if self.inbox is None:
            return tuple(_moved(t, self.device) for t in tensors)
        with torch.cuda.stream(self.inbox):
            out = tuple(_moved(t, self.device) for t in tensors)
        if wait:
            self.take(self.inbox, *out)
        return out

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

    # ------------------------------------------------------------------ passes

    def new_state(self, model, batch: int, widest: int, side_stream: bool = False) -> KVState:
        """An empty KV state for `model`: HF's dynamic cache (backend=eager), or static buffers
        big enough for this call (`room` + the widest pass), reused across calls. Their capacity is
        a power of two, and so is their batch (`batch_bucket`), so calls of similar lengths and
        sizes share one compiled shape. The smallest pooled buffers that hold the call are taken:
        a warm-up that ran the run's longest call at every batch bucket (d3d.eval) leaves every
        later call of the run a shape already compiled, at the addresses its CUDA graphs read."""
        if not self.static:
            return KVState(model, batch)
        need = self.room + widest
        rows = batch_bucket(batch)
        held = [cap for (m, r, cap) in self.buffer_pool if m == id(model) and r == rows and cap >= need]
        capacity = min(held, default=max(256, 1 << (need - 1).bit_length()))
        state = StaticKVState(model, batch, capacity, compiled=self.backend in ("compiled", "frozen"),
                              frozen=self.backend == "frozen", buffers=lambda r, cap: self.buffers(model, r, cap),
                              side_graphs=self.side_graphs if side_stream else None)
        return state

    def buffers(self, model, rows: int, capacity: int) -> tuple:
        """The pooled static buffers of `model` for `rows` x `capacity` slots (allocated once)."""
        key = (id(model), rows, capacity)
        if key not in self.buffer_pool:
            self.buffer_pool[key] = allocate(model, rows, capacity, self.backend == "frozen", self.backend != "static")
        return self.buffer_pool[key]

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
        ids, pos, block = (torch.tensor(x, dtype=torch.long, device=state.device) for x in (ids, pos, block))
        state.forward(ids, Layout(pos, block, pos + 1), causal=True, once=True)

    def verify_pass(self, tgt: KVState, pending: torch.Tensor, drafts: torch.Tensor, next_pos: torch.Tensor):
        """Target logits at [pending, drafts] (b, B, V); their slots stay in the cache for now."""
        ids = torch.cat([pending[:, None], drafts], dim=1)
        pos = next_pos[:, None] + torch.arange(ids.shape[1], device=self.device)
        h = tgt.forward(ids, Layout(pos, torch.full_like(pos, CLEAN), pos + 1), causal=True)
        return self.target_logits(h)

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's float logits of hidden states `h`, on the loop's device (a target spread by
        target.device_map computes them where its LM head is)."""
        return moved(logits_at(self.target, h).float(), self.device)

    def target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's block logits over the target's vocabulary: a draft vocabulary's N columns
        scattered to their target ids, -inf elsewhere (q is zero there, so rejection sampling keeps
        the target's law; d3d.models.forward.in_target_vocab). The passes return the N columns, so
        trays hold and move N-wide logits; this runs once per round, on the block drafts come from."""
        return in_target_vocab(logits, self.d2t, self.settings.vocab_size)

    def draft_pass(self, dr: KVState, pending: torch.Tensor, next_pos: torch.Tensor, unc: torch.Tensor | None = None,
                   unc_n: torch.Tensor | None = None):
        """Commit each row's new tokens (`unc` (b, k), the first unc_n[r] of row r; they end just
        before next_pos) into the drafter's cache and draft the next block: logits (b, B, V), or (b, B, N)
        over a draft vocabulary (target_vocab maps them).
        Everything here is on the drafter's device (the caller moves its inputs: to_drafter)."""
        b, B, s, dev = len(pending), self.B, self.settings, self.drafter_device
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
        return logits_at(self.drafter, h[:, k:], s.vocab_size, draft_ids=True).float()  # (b, B, V or N)
