"""The one config every decoding method reads: `decode.*` and `methods.<name>.*`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

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
                if key == "backend" and self.backend == AUTO_BACKEND:  # resolved before binding (resolve_backend)
                    bad(key, "auto is chosen where a run starts (d3d.eval, resolve_backend), not here",
                        f"set decode.backend to one of {', '.join(BACKENDS)}")
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


# ---------------------------------------------------------------------------- decode.backend=auto
# `auto` (the GPU overlays' backend) is chosen where a run starts, before any model loads
# (d3d.settings.resolve_auto_backend): `compiled` on a GPU where the GPU check (scripts/gpu_check.py)
# passed its compiled stages on the same GPU model and torch, else eager, as on a CPU, where eager is
# the default (conf/decode/*.yaml). An eager row whose passes are host-bound is flagged in the
# eval's summary (d3d.report's HOST-BOUND note).
AUTO_BACKEND = "auto"
CPU_BACKEND = "eager"  # conf/decode's default: a CPU run with auto decodes and times as one without it
# The GPU check's stages that prove the compiled backend: async's overlap at the paper's shapes (part 1),
# the compiled loops' tokens and compiled AR's timing (part 2). The check names its stages so.
COMPILED_STAGES = ("overlap", "compiled_equal", "compiled_timing")


def resolve_backend(device_type: str, record: str | Path, gpu: str | None, torch_version: str,
                    spread: int = 1) -> tuple[str, str]:
    """decode.backend=auto on this machine: (backend, why). `record` is the GPU check's
    gpu_check.json (paths.gpu_check); `gpu` this machine's GPU model (d3d.utils.runinfo.gpu_name),
    `spread` how many devices the target's weights are on (a spread target runs eager only)."""
    if device_type != "cuda":
        return CPU_BACKEND, f"on a CPU auto is {CPU_BACKEND}, the CPU default"
    if spread > 1:
        return "eager", f"the target is spread over {spread} devices (target.device_map), which only eager runs"
    fallback = "eager: its host-bound rows are flagged HOST-BOUND in the summary"
    try:
        rec = json.loads(Path(record).read_text())
    except FileNotFoundError:
        return "eager", f"no GPU check record at {record} ({fallback}; run scripts/gpu_check.py --part 1 and --part 2)"
    except (OSError, ValueError) as err:
        return "eager", f"the GPU check record {record} does not read ({type(err).__name__}; {fallback})"
    env, stages = rec.get("env", {}), rec.get("stages", {})
    if env.get("toy") or not str(env.get("device", "")).startswith("cuda"):
        return "eager", f"the GPU check record {record} is not a full-size GPU run ({fallback})"
    if " ".join(str(env.get("device_name")).split()).casefold() != " ".join(str(gpu).split()).casefold():
        return "eager", f"the GPU check passed on {env.get('device_name')}, not on this {gpu} ({fallback})"
    if env.get("torch") != torch_version:
        return "eager", f"the GPU check ran under torch {env.get('torch')}, this is {torch_version} ({fallback})"
    bad = {name: stages.get(name, {}).get("status", "not run") for name in COMPILED_STAGES}
    bad = {name: status for name, status in bad.items() if status != "ok"}
    if bad:
        said = ", ".join(f"{name} {status}" for name, status in bad.items())
        return "eager", f"the GPU check on this {gpu} did not pass its compiled stages ({said}; {fallback})"
    return "compiled", f"the GPU check passed its compiled stages ({', '.join(COMPILED_STAGES)}) on this {gpu} under torch {torch_version} ({record})"
