"""What a round's drafts look like: one `Drafts` kind per shape (a chain here; a tree in
d3d.decoding.tree_drafts), crossed with a schedule (d3d.decoding.schedules) in the table of
d3d.decoding.methods.

A Drafts kind owns its keys (the DecodeConfig fields it reads) and its tray knobs (read when a
schedule prepares trays of its outcomes). Per round it makes the draft record from the drafter's
block logits (`make`), runs the target's verify pass over it (`verify`), accepts (`accept`: the
accepted count, the token after them, the committed path, the verified slots the caches keep, the
outcome a tray is keyed by) and lists the outcomes trays are prepared for (`outcomes`). For the
offline estimator it gives the depth a greedy round accepts on a known response (`match_depth`;
`match_depth_from` the pruning sweep's form, from hidden states), for the memory bound its verify
width and its tray pass (`width`, `budget`, `narrower`), and the settings no vocabulary of the
models' size can serve (`check_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from d3d.decoding.kv import BACKENDS, KVState
from d3d.decoding.tree import Tree
from d3d.decoding.verify import Sampling, draft_from, greedy_verify, probs, sample_verify
from d3d.errors import ConfigError
from d3d.models.masks import CLEAN, Layout
from d3d.specs import MAX_BLOCK  # the drafter's bound (DrafterSpec) is the decode block's


@dataclass(frozen=True)
class Draft:
    """One round's drafts, as its Drafts kind made them. Frozen: the tray pass (a worker thread or a
    side stream) reads it while the main thread verifies."""

    tokens: torch.Tensor  # (b, k) the drafted tokens: a chain's B-1 in order, a tree's nodes in tree order
    logits: torch.Tensor | None = None  # (b, B, V) the drafter's block logits they came from (None: no drafter)
    q: torch.Tensor | None = None  # (b, k, V) the chain's sampling law (T > 0); None: verified as certain
    # a tree's: the verified tokens [pending, nodes], each node's ancestors, the law it was built by
    nodes: torch.Tensor | None = None  # (b, k+1)
    ancestors: torch.Tensor | None = None  # (b, k+1, k+1)
    law: torch.Tensor | None = None  # (b, B, V)
    tree: Tree | None = None

    def handed(self) -> tuple:
        """What the target's side reads of it (ordered across streams by Passes.take)."""
        return self.tokens, self.q, self.nodes, self.ancestors

    def to(self, device: torch.device) -> "Draft":
        """The same drafts on `device` (the drafter's own, for its tray pass, when the target is
        elsewhere: drafter.device); itself when already there."""
        if self.tokens.device == device:
            return self
        def move(v):
            if isinstance(v, Tree):
                return Tree(**{f.name: moved(getattr(v, f.name), device) for f in fields(Tree)})
            return moved(v, device) if isinstance(v, torch.Tensor) else v

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)})


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, one explicit copy (none when already there). Between two GPUs the copy is
    queued without blocking the host; to or from the host it waits for the data (safe to read)."""
    return t if t.device == device else t.to(device, non_blocking=t.device.type == device.type == "cuda")


@dataclass(frozen=True)
class Outcomes:
    """A round's anticipated outcomes, one tray each (Drafts.outcomes): the tray anchored on
    `token` at `pos` serves the round whose verification ends at `at` followed by `token`."""

    glue: torch.Tensor  # (b, g) the verified tokens, run again so the drafter's cache can keep the accepted ones
    glue_layout: Layout
    at: torch.Tensor  # (b, n) where verification ended (Round.outcome: a chain's accepted count, a tree's end node)
    token: torch.Tensor  # (b, n) the token after it: the tray's anchor
    pos: torch.Tensor  # (b, n) the anchor's position
    # glue visibility: None = causal by position (a chain); else the glue's own (b, g, g) and each tray's (b, n, g)
    glue_sees: torch.Tensor | None = None
    sees: torch.Tensor | None = None


class Drafts:
    """One shape of drafts (module docstring). Built per call with its DecodeConfig, the block size
    B and the sampling generator."""

    keys: tuple[str, ...] = ("block_size",)  # DecodeConfig fields it reads
    tray_keys: tuple[str, ...] = ()  # its tray knobs, read when a schedule prepares trays
    tray_grid: tuple[dict, ...] = ()  # the settings of those knobs an auto budget chooses from (d3d.decoding.budget)
    backends = BACKENDS  # the decode.backend values it runs on

    def __init__(self, cfg, block: int, gen: torch.Generator | None):
        self.cfg, self.B, self.gen = cfg, block, gen

    @staticmethod
    def block_size(cfg) -> int:
        return int(cfg.block_size)

    @classmethod
    def width(cls, cfg) -> int:
        """Tokens in the target's verify pass."""
        return cls.block_size(cfg)

    @classmethod
    def budget(cls, cfg) -> int:
        """Tokens in one packed tray pass (glue + trays): 0 for a kind that lists no outcomes."""
        return 0

    @classmethod
    def narrower(cls, cfg, where: str, trays: bool) -> str:
        """How to make the widest pass narrower: the fix in d3d.decoding.cost's refusal."""
        return f"lower {where}.block_size (the drafter's training block size is the right one)"

    @classmethod
    def check(cls, cfg, needs_drafter: bool) -> None:
        """Its own settings, before any model loads (DecodeConfig checks every field's range)."""
        low = 2 if needs_drafter else 1  # a speculative block: the pending token + >= 1 draft
        block = cfg.block_size
        if "block_size" in cls.keys and not (isinstance(block, int) and not isinstance(block, bool) and low <= block <= MAX_BLOCK):
            raise ConfigError(f"decode.block_size={cfg.block_size!r}: an integer in [{low}, {MAX_BLOCK}] for "
                              f"method={cfg.method} (the drafter's training block size is the right one). Fix: set "
                              f"decode.block_size to an integer in [{low}, {MAX_BLOCK}].")
        if cfg.backend not in cls.backends:
            raise ConfigError(f"decode.backend={cfg.backend!r}: method={cfg.method} runs on {', '.join(cls.backends)} "
                              f"only. Fix: set decode.backend={cls.backends[0]}.")

    @classmethod
    def check_vocab(cls, cfg, vocab: int, name: str, where: str, trays: bool) -> None:
        """Its settings that no memory makes work with a `vocab`-token vocabulary (what the drafter can
        draft: a draft vocabulary's size), refused in one line once the vocabulary is known
        (d3d.decoding.cost; `name` is the run's method, `trays` whether its schedule prepares trays):
        none for a kind without such settings."""

    def make(self, pending: torch.Tensor, logits: torch.Tensor) -> Draft:
        raise NotImplementedError

    def verify(self, passes, tgt: KVState, r) -> torch.Tensor:
        raise NotImplementedError

    def accept(self, r, p_logits: torch.Tensor) -> None:
        """r.accepted, r.token, r.path (b, B-1: whose first r.accepted[i] row i commits before
        r.token), r.kept (the verified slots holding the pending token and the accepted drafts, in
        order; None = the first r.accepted + 1) and r.outcome (what a tray is keyed by)."""
        raise NotImplementedError

    def outcomes(self, d: Draft, pending: torch.Tensor, next_pos: torch.Tensor) -> Outcomes:
        raise NotImplementedError(f"{type(self).__name__} lists no outcomes to prepare trays for")

    def depths(self, d: Draft) -> torch.Tensor:
        """(b, width) each verified token's depth below the pending token (0 for it): whose token of
        the response the target's greedy choice after it is, offline (d3d.decoding.budget)."""
        raise NotImplementedError

    def match_depth(self, logits: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
        """(b,) drafts a greedy round accepts when the target's greedy response is `truth` (b, B-1;
        -1 past its end), from the drafter's draft-slot logits (b, B-1, V): the offline estimator's m(a)."""
        raise NotImplementedError

    def match_depth_from(self, hidden: torch.Tensor, head, truth: torch.Tensor) -> torch.Tensor:
        """match_depth from the draft slots' hidden states (b, B-1, d) and the LM head `head`
        (hidden -> logits): the pruning sweep's form (d3d.layer_scores), which a kind may make cheaper."""
        return self.match_depth(head(hidden), truth)


class Chain(Drafts):
    """B-1 drafts in a row, one per block slot (argmax, or samples of q at T > 0), verified causally
    as [pending, drafts]; the caches keep a prefix. Trays: for each covered rejection slot j and each
    of the top-F alternatives t of q there (the draft excluded) "j-1 accepted, then t", and "all
    accepted, then the bonus guess" (slot B-1's argmax); coverage `first` = slots 1..C-1,
    `confident` = the C-1 slots where rejection is likeliest under q."""

    tray_keys = ("C", "F", "coverage")
    tray_grid = tuple({"C": C, "F": F} for C in (2, 4, 8, 12, 16) for F in (1, 2, 5))

    @classmethod
    def budget(cls, cfg):
        """B * ((C-1)*F + 2), with at most the B-1 draft slots covered."""
        return cfg.block_size * (min(cfg.C - 1, cfg.block_size - 1) * cfg.F + 2)

    @classmethod
    def narrower(cls, cfg, where, trays):
        if not trays:
            return super().narrower(cfg, where, trays)
        return (f"lower {where}.C or {where}.F (the tray pass is B*((C-1)*F + 2) tokens: C=12 F=2 at B=16 is 384), "
                f"or set {where}.block_size to the drafter's training block size")

    def make(self, pending, logits):
        tokens, q = draft_from(logits[:, : self.B - 1], self.cfg.sampling, self.gen)
        return Draft(tokens, logits, q)

    def verify(self, passes, tgt, r):
        return passes.verify_pass(tgt, r.pending, r.draft.tokens, r.next_pos)

    def accept(self, r, p_logits):
        s, drafts = self.cfg.sampling, r.draft.tokens
        if s.greedy:
            r.accepted, r.token = greedy_verify(p_logits, drafts)
        else:
            # drafts given without a distribution are certain (AR's none, a lookup's copies): q is one-hot
            q = r.draft.q if r.draft.q is not None else \
                torch.nn.functional.one_hot(drafts, p_logits.shape[-1]).to(p_logits.dtype)
            r.accepted, r.token = sample_verify(p_logits, drafts, q, s, self.gen)
        r.path, r.kept, r.outcome = drafts, None, r.accepted

    def outcomes(self, d, pending, next_pos):
        cfg, B, q_logits, drafts = self.cfg, self.B, d.logits, d.tokens
        b, dev = len(pending), pending.device
        gpos = next_pos[:, None] + torch.arange(B, device=dev)
        slots = self._covered_slots(q_logits, drafts)  # (b, C-1): slot j = 1..B-1
        scores = probs(q_logits, cfg.sampling) if not cfg.sampling.greedy else q_logits
        alt_scores = scores[:, : B - 1].gather(1, (slots - 1)[:, :, None].expand(-1, -1, scores.shape[-1])).clone()
        drafted = drafts.gather(1, slots - 1)
        alt_scores.scatter_(2, drafted[:, :, None], float("-inf"))  # the drafted token is no alternative
        alts = alt_scores.topk(cfg.F, dim=-1).indices if cfg.F > 0 else \
            torch.zeros(b, slots.shape[1], 0, dtype=torch.long, device=dev)
        bonus = q_logits[:, B - 1].argmax(-1)  # slot B-1 guesses the token after the block
        # "j-1 accepted, then t" anchored at d_j's position, and "all accepted, then the bonus" after the block
        at = torch.cat([(slots[:, :, None] - 1).expand_as(alts).reshape(b, -1), torch.full((b, 1), B - 1, device=dev)], 1)
        pos = torch.cat([(next_pos[:, None, None] + slots[:, :, None]).expand_as(alts).reshape(b, -1),
                         (next_pos + B)[:, None]], dim=1)
        return Outcomes(glue=torch.cat([pending[:, None], drafts], dim=1),
                        glue_layout=Layout(gpos, torch.full_like(gpos, CLEAN), gpos + 1),
                        at=at, token=torch.cat([alts.reshape(b, -1), bonus[:, None]], dim=1), pos=pos)

    def depths(self, d):
        b, k = d.tokens.shape
        return torch.arange(k + 1, device=d.tokens.device).expand(b, k + 1)

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

    @classmethod
    def check_vocab(cls, cfg, vocab, name, where, trays):
        if trays and cfg.F > vocab - 1:
            raise ConfigError(f"{where}.F={cfg.F} (method {name}): a tray per alternative token, so at most {vocab - 1} "
                              f"(the {vocab}-token vocabulary less the drafted token). Fix: set {where}.F={min(2, vocab - 1)} "
                              f"or at most {vocab - 1}.")

    def match_depth(self, logits, truth):
        return (logits.argmax(-1) == truth).int().cumprod(dim=1).sum(dim=1)

    def match_depth_from(self, hidden, head, truth):
        """Slot k's head rows only for the anchors whose first k-1 drafts matched (the rest cannot add
        to the depth): on Qwen the 152k-row head would otherwise cost a sixth of a forward per candidate."""
        n, slots = truth.shape
        alive = torch.arange(n, device=hidden.device)
        m = torch.zeros(n, dtype=torch.long, device=hidden.device)
        for k in range(slots):
            if len(alive) == 0:
                break
            alive = alive[head(hidden[alive, k]).argmax(-1) == truth[alive, k]]
            m[alive] += 1
        return m


class NoDrafts(Chain):
    """Plain decoding's: a block of the pending token alone, no drafts, no keys."""

    keys = ()

    @staticmethod
    def block_size(cfg):
        return 1
