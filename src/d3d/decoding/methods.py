"""Decoding methods: what is drafted x when it is drafted. A method is a row of the table below, a
Drafts kind (d3d.decoding.drafts: chain; d3d.decoding.tree_drafts: tree) crossed with a Schedule
(d3d.decoding.schedules: AR, sync, async).

A round, as the driver (d3d.decoding.engine.SpecGenerator) runs it:

    schedule.propose(r)            r.draft: this round's drafts (Drafts.make from the drafter's logits)
    drafts.verify(passes, tgt, r)  the target's verify pass (chain: causal over [pending, drafts])
    schedule.beside_verify(r)      work that overlaps verification (async: the tray pass)
    drafts.accept(r, logits)       the verdict on the device: r.accepted, r.token, r.path, r.kept, r.outcome
    schedule.settle(r)             device work that needs the verdict (async: match the trays: r.hit_idx)
    driver                         one host transfer of [accepted, token, hit, *path]; the target's
                                   cache keeps r.kept; commits text: path[:accepted] + [token]
    schedule.commit(r, host, most) bookkeeping that needs the host's view (the drafter's cache)
    schedule.retire(keep, keep_list)  finished rows leave

What the rest of the code asks of a method it asks its row, which composes its parts: `keys` (the
DecodeConfig fields it reads beyond EVERY_METHOD_KEYS: its decode file holds exactly these, eval
records and lends them), `needs_drafter`, `trays`, `block_size(cfg)`, `budget(cfg)` (drafter tokens
beside verification), `widest(cfg)` (its widest pass per model, which d3d.decoding.cost bounds by
the device's memory), `narrower`, `overlaps`, `reference` (the method whose loop it equals bit for
bit in fp32: (D, Async)'s is (D, Sync)), `check(cfg)` and `check_vocab(cfg, vocab, name)`. The
offline estimator and the pruning scores take its Drafts (`drafts_of(cfg)`). So a new shape of
drafts or a new schedule is one class and one row here, plus one conf/decode/<name>.yaml and one
defaults line in conf/eval.yaml; nothing in the driver, eval, report or the estimator changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d3d.decoding.config import DecodeConfig
from d3d.decoding.drafts import Chain, Drafts, NoDrafts
from d3d.decoding.passes import Passes
from d3d.decoding.schedules import AR, Async, Schedule, Sync
from d3d.decoding.tree_drafts import TreeDrafts
from d3d.errors import ConfigError

# what the driver reads for every method: the method, its sampling (0 = greedy) and its backend
EVERY_METHOD_KEYS = ("method", "temperature", "top_p", "top_k", "backend")


@dataclass(frozen=True)
class Method:
    """A row: its drafts' shape and its schedule, and what follows from the two."""

    drafts: type[Drafts]
    schedule: type[Schedule]

    @property
    def keys(self) -> tuple[str, ...]:
        """DecodeConfig fields read beyond EVERY_METHOD_KEYS: the drafts' own, their tray knobs when
        the schedule prepares trays, the schedule's."""
        return (*self.drafts.keys, *(self.drafts.tray_keys if self.schedule.trays else ()), *self.schedule.keys)

    def reads(self) -> tuple[str, ...]:
        """Every DecodeConfig field this method reads: what its decode file holds and eval records."""
        return (*EVERY_METHOD_KEYS, *self.keys)

    @property
    def needs_drafter(self) -> bool:
        return self.schedule.needs_drafter

    @property
    def trays(self) -> bool:
        """Whether its schedule prepares trays of its drafts' outcomes (a budget beside verification)."""
        return self.schedule.trays

    @property
    def overlaps(self) -> bool:
        return self.schedule.overlaps

    @property
    def backends(self) -> tuple[str, ...]:
        return self.drafts.backends

    @property
    def reference(self) -> str | None:
        """The registered method with these drafts on the schedule this one must equal (None: none)."""
        ref = self.schedule.reference
        return next((name for name, row in METHODS.items() if row == Method(self.drafts, ref)), None) if ref else None

    def block_size(self, cfg) -> int:
        return self.drafts.block_size(cfg)

    def budget(self, cfg) -> int:
        """Tokens of drafter work beside each verification: the drafts' tray pass, if the schedule runs one."""
        return self.drafts.budget(cfg) if self.schedule.trays else 0

    def widest(self, cfg) -> dict[str, int]:
        """The widest pass each model runs, in new tokens: what d3d.decoding.cost bounds by memory."""
        drafter = self.schedule.widest_drafter(cfg, self.drafts)
        return {"target": self.drafts.width(cfg), **({"drafter": drafter} if drafter else {})}

    def narrower(self, cfg, where: str) -> str:
        return self.drafts.narrower(cfg, where, self.schedule.trays)

    def overlap_mode(self, cfg, device: torch.device) -> str:
        return self.schedule.overlap_mode(cfg, device)

    def check(self, cfg) -> None:
        self.drafts.check(cfg, self.needs_drafter)
        self.schedule.check(cfg)

    def check_vocab(self, cfg, vocab: int, name: str, where: str = "decode") -> None:
        self.drafts.check_vocab(cfg, vocab, name, where, self.schedule.trays)

    def sized_by(self, cfg) -> tuple[str, ...]:
        """The keys that size its passes (its drafts' and their tray knobs' counts): what a memory refusal names."""
        return tuple(k for k in self.keys if k not in self.schedule.keys and isinstance(getattr(cfg, k), int))

    def start(self, cfg, passes: Passes) -> Schedule:
        """The schedule of one generate() call, with its drafts."""
        return self.schedule(cfg, passes, self.drafts(cfg, passes.B, passes.gen))


# decode.method -> its row
METHODS: dict[str, Method] = {
    "ar": Method(NoDrafts, AR),
    "sync": Method(Chain, Sync),
    "async": Method(Chain, Async),
    "tree": Method(TreeDrafts, Sync),
    "async_tree": Method(TreeDrafts, Async),
}


# The rows the scripts time and project, found by what they are, not by name (no file under scripts/
# names a method: tests/unit/test_scripts_methods.py): `plain` the first row without a drafter (the
# baseline), `trays` the first that prepares trays, `drafted` the row `trays` equals without them.
_TRAYS = next(name for name, row in METHODS.items() if row.trays)
ROLES: dict[str, str] = {"plain": next(name for name, row in METHODS.items() if not row.needs_drafter),
                         "drafted": METHODS[_TRAYS].reference, "trays": _TRAYS}


def method_row(name: str, where: str = "decode") -> Method:
    if name not in METHODS:
        *most, last = METHODS
        raise ConfigError(f"{where}.method={name!r}: use {', '.join(most)} or {last}. Fix: set {where}.method to one "
                          f"of them (or add a row of this name to d3d.decoding.methods.METHODS).")
    return METHODS[name]


def drafts_of(cfg) -> Drafts:
    """The drafts of cfg's method outside a decoding loop (the offline estimator and the pruning
    sweep score a drafter by what these drafts would accept; greedy, so no generator)."""
    row = checked(cfg)
    return row.drafts(cfg, row.block_size(cfg), None)


def scored_drafts(block_size: int, tree_nodes: int | None) -> Drafts | None:
    """What `prune.tree_nodes` (and the scripts' --tree-nodes) score a drafter by: null the chain (the
    estimator's default), N the drafts of the `tree` row with N nodes."""
    if tree_nodes is None:
        return None
    return drafts_of(DecodeConfig(method="tree", block_size=block_size, tree_nodes=tree_nodes))


def checked(cfg, where: str = "decode") -> Method:
    """The row of cfg.method, after its parts have checked what of `cfg` depends on the method (a
    DecodeConfig checks its values' ranges itself): the entry points' one call."""
    row = method_row(cfg.method, where)
    row.check(cfg)
    return row
