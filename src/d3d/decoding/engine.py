"""The decoding driver: AR baseline, synchronous and asynchronous speculative decoding (docs/design.md#decoding-decoding).

`SpecGenerator` is the driver every method shares: prefill, the target's verify pass, the accept
decision, the one host transfer per round, committing text (EOS, max_new_tokens, stop strings),
retiring finished rows and timing. What differs between methods is a row of the table in
d3d.decoding.methods (keyed by `decode.method`): its Drafts (what the drafts look like: how they are
verified and accepted, which slots the caches keep, the committed path) and its Schedule (when they
are made, what runs beside verification), built with the passes they may run (d3d.decoding.passes),
not with the driver; the driver asks the row what it needs (a drafter, its block, whether it
overlaps), never its name. One round of each, for a batch of requests (rows advance at their own speed):

    ar:    target([pending])                      -> next token
    sync:  drafter([newly committed | pending, MASK x (B-1)])      -> drafts d_1..d_{B-1}
           target([pending, d_1..d_{B-1}])        -> accept a drafts + 1 token (d3d.decoding.verify)
    async: while the target verifies, the drafter runs one packed pass of *trays*: the glue
           [pending, d_1..d_{B-1}] (causal: it commits whatever the target accepts) plus one block
           per anticipated outcome: "j-1 drafts accepted, then alternative t" for covered slots j
           and the top-F alternatives t, and "all accepted, then the bonus guess". If the outcome
           (a, token) has a tray, its drafts are the next block (a hit); rows that missed draft
           synchronously (on CPU only they do; on CUDA one pass over all rows costs the same).
    tree:  sync's drafter pass -> a tree of tree_nodes drafts (best-first by path probability)
           target([pending, nodes], each node seeing its ancestors) -> the longest accepted path + 1 token

The drafter's block slot B-1 predicts the token after the block: that is the bonus guess.
The target's pending token (the last committed one) is always fed in the next target pass, so the
target's cache holds committed tokens but the last; the drafter's cache likewise.

Devices. Every per-round tensor (pending tokens, positions, drafts, accept counts, tray keys and
their matching, masks) lives on the model's device; the host gets one small transfer per round
(accept counts, next tokens, hit indices and drafts: b x (B + 2) integers) to commit text, check
EOS / stop strings and retire rows. Sampling uses a generator on the device. A drafter on a device
of its own (drafter.device; a target spread by target.device_map) keeps its cache and passes
there: the loop's tensors it reads are copied to it (`Passes.to_drafter`) and its logits and tray
keys back (`Passes.to_target`), explicitly, once each per round; drafts are made and verified on
the target's input device, with the one sampling generator. Between two GPUs the copies run on
streams of their own (a copy queued on the target's stream after verification would wait for it):
async sends the tray pass's inputs before the verify pass is queued.

Streams (overlap=stream, CUDA). All drafter work runs on one side stream and all target work on
the current stream, so each KV cache has one owner stream and the caching allocator never hands
a cache's memory to the other stream. The few tensors that cross (drafts, q, tray logits one way;
pending tokens, positions, accept counts the other) are ordered with `wait_stream` and marked
with `record_stream`. Each round launches the verify pass first, then the tray pass, so the GPU
runs them concurrently; on a compiled backend both are CUDA-graph replays (the side stream's in a
memory pool of its own: kv.SideStreamGraphs), so the host issues them back to back.

Timings per round (`rounds[i]`, a RoundStats): `wall_s` is host wall time from the round's start to its host
transfer (it includes waiting for the device). `draft_s`, `verify_s`, `tray_s` are the passes'
device time: CUDA events on their stream (on CUDA), wall time of the synchronous call (on CPU);
`verify_s` includes the accept/reject decision. `tray_wait_s` (CPU worker thread only) is how
long the main thread waited for the tray pass after verifying. `tray_hidden_s` is how much of the
tray pass ran while the target's verify pass ran (the overlap of their spans, CUDA events on both
streams; 0 when run serially). `issue_s` (CUDA) is the host time up to the round's transfer, before
it waits for the device: a round whose issue_s is near its wall_s was host-bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from d3d.decoding.config import DecodeConfig
from d3d.decoding.cost import check_loaded
from d3d.decoding.methods import checked
from d3d.decoding.passes import Passes, Round, RoundStats, _Clock, _sync
from d3d.models.target import input_device


@dataclass
class GenerationResult:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    rounds: list[RoundStats]  # one per round: tau/hit per active row, times
    prefill_s: float
    decode_s: float

    def taus(self, row: int | None = None) -> list[int]:
        out = []
        for r in self.rounds:
            for rid, tau in zip(r.rows, r.tau):
                if row is None or rid == row:
                    out.append(tau)
        return out

    @property
    def mean_tau(self) -> float:
        t = self.taus()
        return sum(t) / max(len(t), 1)

    @property
    def hit_rate(self) -> float | None:
        hits = [h for r in self.rounds for h in r.hit or []]
        return sum(hits) / len(hits) if hits else None

    @property
    def host_issue_share(self) -> float | None:
        """The share of the rounds' wall time the host spent issuing them (CUDA; None elsewhere, where
        ops run as they are issued). Near 1 the device waited for the host: the passes are host-bound,
        and the loop's time is the host's Python, not the method's (eager HF passes on a GPU)."""
        timed = [(r.issue_s, r.wall_s) for r in self.rounds if r.issue_s is not None and r.wall_s]
        return sum(i for i, _ in timed) / sum(w for _, w in timed) if timed else None

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


class SpecGenerator:
    """`SpecGenerator(target, tokenizer, drafter, DecodeConfig(...)).generate(prompt_ids)`."""

    def __init__(self, target, tokenizer, drafter=None, config: DecodeConfig | None = None,
                 eos_token_ids: list[int] | None = None, seed: int = 0):
        self.cfg = config or DecodeConfig()
        self.method = checked(self.cfg)
        if self.method.needs_drafter and drafter is None:
            raise ValueError(f"decode.method={self.cfg.method} needs a drafter; use method=ar for the baseline")
        self.target, self.drafter, self.tok = target, drafter, tokenizer
        # the loop keeps its state where the target's inputs go; a drafter on a device of its own
        # (drafter.device) gets its inputs and hands back its drafts by explicit copies (Passes)
        self.device = input_device(target)
        self.B = self.method.block_size(self.cfg)
        check_loaded(self.cfg, self.method, target, drafter, 1)  # the CLI's memory bound (d3d.decoding.cost)
        self.eos = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
        self.seed = seed
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        # what the schedule may run; a side stream or worker thread only if the method's class overlaps
        self.passes = Passes(target, drafter, self.B, self.cfg.backend, self.method.overlap_mode(self.cfg, self.device),
                             self.gen, self.cfg.cpu_threads_drafter)

    def context_problem(self, prompts: list[list[int]], max_new_tokens: int) -> str | None:
        """Why these prompts cannot be decoded (prompt + new tokens + a block past the target's
        context), or None. The loop refuses such a call; d3d.eval asks first and skips the request."""
        return context_problem(self.target, prompts, max_new_tokens, self.B)

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None, seed: int | None = None,
                 ignore_eos: bool = False, reserve: int = 0) -> GenerationResult:
        """Decode a batch of prompts (token id lists). `seed` restarts the sampling stream for
        this call, so one request's sampled output does not depend on what ran before it.
        `ignore_eos`: decode max_new_tokens whatever comes (no EOS, no stop string), as a warm-up
        must to run every pass. `reserve`: size a static backend's buffers as for a call whose
        longest prompt plus new tokens is this many (a warm-up sizes them for the run's longest call)."""
        if seed is not None:
            self.gen.manual_seed(int(seed))
        with self.passes.call():
            return self._generate(prompts, max_new_tokens, ignore_eos, reserve)

    def warm_up(self, batch: int, reserve: int, prompt: list[int]) -> GenerationResult:
        """One call that runs every pass of this method at `batch` rows (its batch bucket) over
        buffers sized for `reserve` tokens (longest prompt + max_new_tokens of the calls to come):
        a static backend compiles (and on CUDA records) each of its shapes here, not in a timed
        call. Three rounds at least (2B + 1 new tokens, a round commits at most B): sync drafts
        its first block without tokens to commit, a later one with them (two shapes)."""
        return self.generate([list(prompt)] * batch, max_new_tokens=2 * self.B + 1, seed=self.seed,
                             ignore_eos=True, reserve=reserve)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_new_tokens: int | None, ignore_eos: bool = False,
                  reserve: int = 0) -> GenerationResult:
        cfg, B, dev, passes = self.cfg, self.B, self.device, self.passes
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        max_new = int(max_new_tokens or cfg.max_new_tokens)
        problem = self.context_problem(prompts, max_new)
        if problem:
            raise ValueError(f"{problem}. Fix: shorten the prompt or lower max_new_tokens.")
        b = len(prompts)
        check_loaded(replace(cfg, max_new_tokens=max_new), self.method, self.target, self.drafter, b)
        clock = _Clock(dev)
        schedule = self.method.start(cfg, passes)
        drafts = schedule.drafts
        passes.room = max(max(len(p) for p in prompts) + max_new, reserve) + B  # slots committed at most, before a pass
        _sync(dev, passes.drafter_device)
        t0 = time.perf_counter()
        tgt = passes.new_state(self.target, b, B)
        passes.prefill(tgt, prompts)
        schedule.begin(prompts)
        _sync(dev, passes.drafter_device)
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
            r = Round(pending, next_pos, RoundStats(list(rows)), clock)
            origin = clock.mark()  # before anything of the round, on either stream
            schedule.propose(r)  # r.draft
            start = len(tgt)
            v0 = clock.mark()
            p_logits = drafts.verify(passes, tgt, r)
            r.verify_marks = (origin, v0, clock.mark())  # the verify pass alone: what a tray pass can hide behind
            schedule.beside_verify(r)  # launched after verification: on CUDA the two overlap
            drafts.accept(r, p_logits)  # r.accepted, r.token, r.path, r.kept, r.outcome
            clock.span(r.stats, "verify_s", v0)
            schedule.settle(r)
            # ---- the one host transfer of the round: accept counts, next tokens, hits (-1: no tray
            # prepared, as for a method without trays), the drafts' path
            hits = r.hit_idx if r.hit_idx is not None else torch.full_like(r.accepted, -1)
            sent = torch.cat([r.accepted[:, None], r.token[:, None], hits[:, None], r.path], dim=1)
            if clock.cuda:  # what the host spent issuing the round; the transfer then waits for the device
                r.stats.issue_s = time.perf_counter() - r_start
            host = sent.tolist()
            most = max(h[0] for h in host) + 1  # the longest commit of any row
            tgt.keep(start, r.kept, r.accepted + 1, most)  # the pending token and the accepted path
            schedule.commit(r, host, most)
            # ---- commit: accepted drafts + the correction/bonus token; stop at EOS / max_new / stop string
            taus, finished = [], []
            for i, (a, tok, _, *drafted) in enumerate(host):
                row = rows[i]
                kept = self._commit(out[row], drafted[:a] + [tok], max_new, reasons, row, ignore_eos)
                taus.append(kept)
                if kept < a + 1 or len(out[row]) >= max_new or reasons[row] == "stop":
                    finished.append(i)
            r.stats.tau = taus
            pending = r.token
            next_pos = next_pos + r.accepted + 1
            r.stats.wall_s = time.perf_counter() - r_start
            rounds.append(r.stats)
            if finished:
                keep_list = [i for i in range(len(rows)) if i not in set(finished)]
                if not keep_list:
                    break
                keep = torch.tensor(keep_list, dtype=torch.long, device=dev)
                rows = [rows[i] for i in keep_list]
                pending, next_pos = pending[keep], next_pos[keep]
                tgt.select(keep)
                schedule.retire(keep, keep_list)
        _sync(dev, passes.drafter_device)
        decode_s = time.perf_counter() - t_dec
        clock.resolve()
        texts = [self.tok.decode(t, skip_special_tokens=True) for t in out]
        return GenerationResult(out, texts, reasons, rounds, prefill_s, decode_s)

    def _commit(self, out: list[int], new: list[int], max_new: int, reasons: list[str], row: int,
                ignore_eos: bool = False) -> int:
        kept = 0
        for t in new:
            if len(out) >= max_new:
                break
            out.append(t)
            kept += 1
            if t in self.eos and not ignore_eos:
                reasons[row] = "stop"
                break
        if self.cfg.stop_strings and reasons[row] != "stop" and not ignore_eos:
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
