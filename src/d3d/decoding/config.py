"""The one config every decoding method reads: `decode.*` and `methods.<name>.*`."""

from __future__ import annotations

from dataclasses import dataclass, field

from d3d.decoding.kv import BACKENDS
from d3d.decoding.verify import Sampling
from d3d.errors import ConfigError


# The fields that size a tray pass, any of which may be left to the measured choice (None).
TRAY_KNOBS = ("C", "F", "tree_trays")


@dataclass
class DecodeConfig:
    """`decode.*` and `methods.<name>.*` (conf/decode/<name>.yaml, bound by d3d.settings.bind_decode);
    a method reads EVERY_METHOD_KEYS and its row's `keys` (d3d.decoding.methods). `max_new_tokens`
    comes from the caller (eval.max_new_tokens), `stop_strings` from callers of the engine.

    A tray knob (C, F, tree_trays) may be None: the budget is not given, so d3d.eval chooses it by
    measurement on the device once the models load (d3d.decoding.budget; the shipped async files
    leave it so). Until then the config has no budget (`auto_budget`); the engine refuses one."""

    method: str = "sync"  # a name in METHODS
    block_size: int = 16
    C: int | None = 12  # async: covered rejection slots + 1 (None: auto, with F)
    F: int | None = 2  # async: alternatives per covered slot (None: auto, with C)
    coverage: str = "first"  # first | confident
    tree_nodes: int = 15  # tree: draft nodes verified beside the pending token (the verify pass is tree_nodes + 1 wide)
    tree_trays: int | None = 23  # None: auto; async_tree: trays for the likeliest outcomes (23 + a glue of 16 = async's 384 tokens at B = 16)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    overlap: str = "auto"  # auto | stream | thread | none (see Schedule.overlap_mode)
    cpu_threads_drafter: int | None = None  # overlap=thread on CPU: cores for the drafter (None = half)
    backend: str = "eager"  # one of BACKENDS
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every value's range, checked here: a bad value used to fail deep in torch, run silently
        greedy (temperature=-1) or do nothing (top_p=2). What depends on the method (its name, its
        block's bounds, its backends, its schedule's knobs) its row's parts check:
        d3d.decoding.methods.checked(cfg), which d3d.settings.bind_decode and SpecGenerator call
        before any pass runs."""
        def bad(key, allowed, fix=None):
            fix = fix or f"set decode.{key} to {allowed.rsplit(' (', 1)[0]}"
            raise ConfigError(f"decode.{key}={getattr(self, key)!r}: {allowed}. Fix: {fix}.")

        if not isinstance(self.method, str):
            bad("method", "a method's name", "set decode.method to a name in d3d.decoding.methods.METHODS")
        choices = {"coverage": ("first", "confident"), "overlap": ("auto", "stream", "thread", "none"),
                   "backend": BACKENDS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                bad(key, f"use {', '.join(allowed[:-1])} or {allowed[-1]}", f"set decode.{key} to one of them")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        for key, least in (("C", 1), ("F", 0), ("tree_nodes", 1), ("tree_trays", 1), ("top_k", 0), ("max_new_tokens", 1)):
            if key in TRAY_KNOBS and getattr(self, key) is None:
                continue  # auto: chosen by measurement (class docstring)
            if not whole(getattr(self, key)) or getattr(self, key) < least:
                bad(key, f"an integer >= {least}" + (" (0 = off)" if key == "top_k" else ""))
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1] (1 = off)")

    @property
    def auto_budget(self) -> bool:
        """Whether a tray knob is left to the measured choice (None)."""
        return any(getattr(self, k) is None for k in TRAY_KNOBS)

    @property
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), int(self.top_k))
