"""Binding at the boundary (lingua's dataclass args): each recipe turns the composed Hydra config into
its root config of d3d.specs in `run_*`, once, with a strict merge, so a misspelt or unread key fails
there with its dotted name instead of being ignored, and nothing below reads the raw config or keeps
a second default in `.get(key, default)`. The YAML files keep the documented defaults; the dataclasses
say which keys exist and their types (tests/unit/test_configs.py binds every root x experiment).
"""

from __future__ import annotations

import math
import sys
from dataclasses import fields, is_dataclass, replace
from types import UnionType
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from d3d.config import checkpoint_settings, literal
from d3d.configdir import config_dir
from d3d.errors import ConfigError
from d3d.specs import (
    BenchmarkSpec, DrafterSpec, EvalConfig, EvalSettings, ExportConfig, GenerateConfig, PruneConfig, StepSettings,
    TrainConfig, TrainSettings,
)

if TYPE_CHECKING:  # imported where used: d3d.decoding loads torch and the models
    from d3d.decoding import DecodeConfig

T = TypeVar("T")


# d3d.train's own train.* keys. An experiment overlays every job alike, so the ones it sets (max_steps,
# eval_every, ...) land in prune's `train` section too: they are d3d.train's, and prune skips them by
# name (bind_config); any other key prune does not know still fails.
TRAIN_ONLY_KEYS = frozenset(f.name for f in fields(TrainSettings)) - frozenset(f.name for f in fields(StepSettings))

# Each root config by the name of its YAML (conf/<name>.yaml).
ROOT_CONFIGS: dict[str, type] = {"generate": GenerateConfig, "train": TrainConfig, "prune": PruneConfig,
                                 "eval": EvalConfig, "export": ExportConfig}
# Top-level sections bound elsewhere: eval's decode settings, per method (method_configs).
BOUND_ELSEWHERE = frozenset({"decode", "methods"})
EVERY_SECTION = frozenset(f.name for schema in ROOT_CONFIGS.values() for f in fields(schema)) | BOUND_ELSEWHERE


def bind(schema: type[T], node: Any, where: str) -> T:
    """`node` (a section of the composed config, or plain data) as a `schema` object: unknown keys,
    missing ones, values of the wrong type and numbers that are not finite (NaN, inf) fail here,
    named by their dotted key (`where.key`) with the fix."""
    try:
        if OmegaConf.is_config(node):  # interpolations reach outside the section: resolve them first
            node = OmegaConf.to_container(node, resolve=True)
        typed = OmegaConf.merge(OmegaConf.structured(schema), literal(node))  # resolved text stays text
        obj = OmegaConf.to_object(typed)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(getattr(err, "msg", None) or err).splitlines()[0].rstrip(".")
        dotted = ".".join(k for k in (where, key) if k)
        fix = _binding_fix(err, schema, key, dotted, null="'None'" in msg)
        raise ConfigError(f"{dotted}: {msg}. Fix: {fix}." if dotted else f"{msg}. Fix: {fix}.") from None
    _refuse_non_finite(obj, where)
    return obj  # type: ignore[return-value]


def _binding_fix(err: OmegaConfBaseException, schema: type, key: str, dotted: str, null: bool) -> str:
    """The fix of a binding error: the keys a section has, or what kind of value a key takes."""
    section = getattr(err, "object_type", None)
    if isinstance(err, ConfigKeyError) and section is not None and is_dataclass(section):
        return f"check its spelling; {section.__name__} has {', '.join(f.name for f in fields(section))}"
    kind, optional = _field_kind(schema, key.split(".") if key else [])
    if kind is None:
        return "see the key's type and the shipped value in d3d.specs and conf/"
    return f"set {dotted} to {kind}" + (" or null" if optional else " (it cannot be null)" if null else "")


def _field_kind(schema: Any, path: list[str]) -> tuple[str | None, bool]:
    """In words, what the field at `path` under `schema` takes ("an integer", "a list (e.g. [1, 2])",
    ...), and whether it may be null."""
    optional = False
    for name in path:
        if not is_dataclass(schema):
            return None, False
        hint = get_type_hints(schema, vars(sys.modules[schema.__module__])).get(name)
        if hint is None:
            return None, False
        optional = type(None) in get_args(hint)
        args = [a for a in get_args(hint) if a is not type(None)]
        schema = args[0] if get_origin(hint) in (Union, UnionType) and len(args) == 1 else hint
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    origin = get_origin(schema)
    kind = words.get(schema) or ("a list (e.g. [1, 2])" if origin is list else "a mapping ({key: value})"
                                 if origin is dict else "a section of its keys" if is_dataclass(schema) else None)
    return kind, optional


def _refuse_non_finite(obj: Any, where: str) -> None:
    """A float field that is NaN or inf passes every range check written `value < low` (NaN compares
    false) and runs: refused here, for every section, with its dotted key."""
    for f in fields(obj) if is_dataclass(obj) else ():
        value, dotted = getattr(obj, f.name), ".".join(k for k in (where, f.name) if k)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{dotted}={value}: not a finite number. Fix: set {dotted} to a finite number.")
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            _refuse_non_finite(item, f"{dotted}[{i}]" if isinstance(value, list) else dotted)
        if isinstance(value, dict):
            for k, item in value.items():
                _refuse_non_finite(item, f"{dotted}.{k}")


def bind_config(cfg: DictConfig, name: str):
    """The root config of recipe `name` (d3d.specs.<Name>Config) from its composed config. Sections
    other recipes own, which experiment overlays put in every job, are left out; a top-level key no
    recipe has fails. prune's and export's `train` skip d3d.train's own keys (TRAIN_ONLY_KEYS)."""
    schema = ROOT_CONFIGS[name]
    unknown = sorted(set(cfg) - EVERY_SECTION)
    if unknown:
        raise ConfigError(f"{unknown[0]}: no d3d recipe has this top-level key. Fix: check its spelling, or "
                          f"put it in a section ({', '.join(sorted(f.name for f in fields(schema)))})")
    node = {}
    for f in fields(schema):
        if f.name not in cfg:
            continue  # a missing section fails in bind, by its name
        value = cfg[f.name]
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        if f.name == "train" and name in ("prune", "export"):  # the step's keys only (StepSettings)
            value = {k: v for k, v in value.items() if k not in TRAIN_ONLY_KEYS}
        node[f.name] = value
    typed = bind(schema, node, "")
    if getattr(typed, "drafter", None) is not None:
        check_checkpoint_settings(typed.drafter)
    return typed


# The drafter keys a trained drafter saves (config.json's d3d section), with what else a user who set
# one may want. With drafter.checkpoint set, conf/drafter/ takes each from the checkpoint
# (${d3d.from_checkpoint:...}), so a bound value other than the saved one was set by someone: the
# command line, an experiment overlay or a drafter file.
SAVED_DRAFTER_KEYS = {
    "block_size": "set decode.block_size={value} instead to decode it in blocks of {value} (a stated choice)",
    "block_attention": "train a drafter with drafter.block_attention={value}",
    "draft_vocab": "train a drafter with drafter.draft_vocab={value}",
}


def check_checkpoint_settings(drafter: DrafterSpec) -> None:
    """A trained drafter runs as it was trained: each of its saved settings is the default of every job
    that loads it, and a value set against one is refused in one line naming both, before any model
    loads (the loader's block-rule check, d3d.models.drafter.check_block_attention, stays behind it).
    A value equal to the saved one passes."""
    saved = checkpoint_settings(drafter.checkpoint)
    for key, other in SAVED_DRAFTER_KEYS.items():
        value = getattr(drafter, key)
        if key in saved and value != saved[key]:
            word = "null" if value is None else value
            raise ConfigError(f"drafter.{key}={word} was set, but the checkpoint {drafter.checkpoint} was trained with "
                              f"drafter.{key}={'null' if saved[key] is None else saved[key]}. Fix: drop the override "
                              f"to run it as trained, or {other.format(value=word)}.")


def shipped_benchmark(name: str) -> BenchmarkSpec:
    """The shipped spec of one benchmark, read from conf/benchmark/<name>.yaml."""
    path = config_dir() / "benchmark" / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(f"no benchmark named {name!r} (no {path}); see `python -m d3d.benchmarks` for the list")
    specs = OmegaConf.load(path).specs
    return bind(BenchmarkSpec, specs[name], f"benchmark.specs.{name}")


# `decode.*` and `methods.<name>.*` (conf/decode/<name>.yaml) bind to d3d.decoding.DecodeConfig, here and
# nowhere else. Which of its fields a file holds is its method row's to say (Method.reads()): `name` names
# the run (run_name: ${decode.name}) besides; `max_new_tokens` comes from eval.max_new_tokens and
# `stop_strings` is for callers of the engine, so neither is a decode file's key.


def decode_keys(method: str, where: str = "decode") -> tuple[str, ...]:
    """The DecodeConfig fields `method` reads, as its row in d3d.decoding.methods composes them. A decode
    file holds exactly these and `name`; eval's resume key and run.json record only these."""
    from d3d.decoding.methods import method_row

    return method_row(method, where).reads()


def bind_decode(node: Any, where: str) -> DecodeConfig:
    """A decode file's section (`decode`, `methods.<name>`) as a d3d.decoding.DecodeConfig: a key its
    method does not read fails, named, as do a wrong type and a bad value."""
    from d3d.decoding import DecodeConfig

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    plain.pop("name", None)
    if "method" not in plain:  # which keys the file may hold is the method's to say
        raise ConfigError(f"{where}.method: missing; a decode file names its method (conf/decode/<name>.yaml). Fix: "
                          f"add method: <one of the methods> to it.")
    method = plain["method"]
    reads = decode_keys(method, where)
    unread = [k for k in plain if k not in reads]
    if unread:
        raise ConfigError(f"{where}.{unread[0]}: method {method} does not read it (it reads {', '.join(reads)}). Fix: "
                          f"drop the key, or check its spelling.")
    from d3d.decoding.methods import checked

    try:
        cfg = bind(DecodeConfig, plain, where)
        checked(cfg, where)  # what depends on the method, by its row's parts
        _refuse_half_a_budget(cfg, where)
        return cfg
    except ConfigError as err:  # DecodeConfig's own checks say `decode.<key>`: name the section it came from
        text = str(err)
        if where == "decode" or not text.startswith("decode."):
            raise
        raise ConfigError(text.replace("decode.", f"{where}.")) from None


def _refuse_half_a_budget(cfg: DecodeConfig, where: str) -> None:
    """A tray budget is given whole or left to the measured choice whole (null): C=4 with F=null
    would have the chooser overwrite the C the user gave."""
    from d3d.decoding.methods import method_row

    row = method_row(cfg.method)
    knobs = tuple(row.drafts.tray_grid[0]) if row.trays else ()
    unset = [k for k in knobs if getattr(cfg, k) is None]
    if unset and len(unset) < len(knobs):
        given = " ".join(f"{where}.{k}={getattr(cfg, k)}" for k in knobs if k not in unset)
        raise ConfigError(f"{where}.{unset[0]}=null (auto) beside {given}: a tray budget is given whole or chosen whole. "
                          f"Fix: set {' and '.join(f'{where}.{k}' for k in knobs)} to numbers, or all to null (auto).")


# ---------------------------------------------------------------------------- eval's methods
# Bound here, not in d3d.eval, because scripts that plan a run (scripts/memory_plan.py) need the
# methods an eval config runs without importing a recipe.

# What the composed `decode` group lends to every method that reads the key: every method takes the
# run's sampling and backend (the AR baseline decodes as the others do, so a speedup is never the
# backend's), a method that verifies blocks takes a block-verifying group's block size. A method's
# other keys (async's tray budget) stay its own.
LENT_KEYS = ("temperature", "top_p", "top_k", "backend", "block_size")


def method_configs(cfg: DictConfig, ev: EvalSettings) -> dict[str, DecodeConfig]:
    """Each method's decode config. The composed `decode` group replaces its own method's file and
    lends the shared keys to the others: `decode.temperature=1` samples every method (AR too),
    `decode.backend=compiled` compiles every method, and `decode.block_size=4` drafts 4-token blocks
    in sync and async alike.
    `eval.async_budgets: [4x1, 8x2, 16]` turns each method with trays into one method per entry that
    sets its Drafts' tray knobs (C x F: the chain's, 4x1 and 8x2; tree_trays: the tree's, 16), and
    `auto` into one whose budget is chosen on this device. A method whose decode file leaves its
    budget null (the shipped async files) is chosen on this device too (its knobs stay None until
    d3d.eval.resolve_auto_budget)."""
    from d3d.decoding.methods import method_row  # torch: imported where used (see DecodeConfig above)
    from d3d.report import BASELINE

    check_eval_settings(ev)
    resolve_auto_backend(cfg)  # decode.backend=auto, if d3d.eval has not resolved it already
    composed = bind_decode(cfg.decode, "decode")
    out = {}
    for name in ev.methods:
        if name not in cfg.methods:  # Hydra composed them from conf/decode/ (conf/eval.yaml's defaults)
            raise ConfigError(f"eval.methods names {name!r} but conf/decode/{name}.yaml is not composed under "
                              f"`methods` (add it there, and `- decode@methods.{name}: {name}` to conf/eval.yaml)")
        own = bind_decode(cfg.methods[name], f"methods.{name}")
        if composed.method == own.method:
            dc = replace(composed)
        else:  # lent: LENT_KEYS both methods read
            keys = [k for k in LENT_KEYS if k in decode_keys(own.method) and k in decode_keys(composed.method)]
            dc = replace(own, **{k: getattr(composed, k) for k in keys})
        dc = replace(dc, max_new_tokens=ev.max_new_tokens)  # replace() re-validates
        # the budget study: a method with trays gets one per entry that sets its tray knobs (as many
        # values as it has knobs), and `auto` one whose budget is chosen once the models are loaded
        # (resolve_auto_budget)
        row = method_row(dc.method)
        knobs = tuple(row.drafts.tray_grid[0]) if row.trays else ()
        entries = [AUTO if str(b).lower() == AUTO else parse_budget(b) for b in ev.async_budgets or []] if knobs else []
        budgets = [e for e in entries if e == AUTO or len(e) == len(knobs)]
        if budgets:
            for values in budgets:
                if values == AUTO:  # its knobs left to the measured choice, as a decode file's nulls are
                    out[f"{name}_{AUTO}"] = replace(dc, **{k: None for k in knobs})
                    continue
                setting = dict(zip(knobs, values))  # e.g. async_c4_f1, async_tree_tree_trays16
                out[f"{name}_" + "_".join(f"{k.lower()}{v}" for k, v in setting.items())] = replace(dc, **setting)
        else:
            out[name] = dc
    if BASELINE not in out or method_row(out[BASELINE].method).needs_drafter:
        raise ConfigError(f"eval.methods must include {BASELINE}: speedups and equality are measured against it. "
                          f"Fix: eval.methods=[{BASELINE},sync,...]")
    return {BASELINE: out.pop(BASELINE), **out}


AUTO = "auto"


def resolve_auto_backend(cfg: DictConfig) -> dict | None:
    """decode.backend=auto (and a method section's) replaced in `cfg` by the backend this machine
    gets (d3d.decoding.config.resolve_backend: the GPU check's record at paths.gpu_check, this GPU's
    model, torch's version, the target's device): {"backend", "why"}, or None where nothing says
    auto. Asks CUDA nothing (a forked engine must find it uninitialised: d3d.utils.runinfo.gpu_name)."""
    from d3d.decoding.config import AUTO_BACKEND, resolve_backend

    nodes = [cfg.decode, *(cfg.methods[n] for n in cfg.get("methods") or {})]
    autos = [node for node in nodes if node.get("backend") == AUTO_BACKEND]
    if not autos:
        return None
    import torch

    from d3d.models.target import map_devices, pick_device
    from d3d.utils.runinfo import gpu_name

    device_map = cfg.target.get("device_map")
    spread = len(map_devices(OmegaConf.to_container(device_map) if OmegaConf.is_config(device_map) else device_map)) \
        if device_map is not None else 1
    backend, why = resolve_backend(pick_device(cfg.target.device).type, cfg.paths.gpu_check, gpu_name(),
                                   torch.__version__, spread)
    for node in autos:
        node.backend = backend
    return {"backend": backend, "why": why}


def check_eval_settings(ev: EvalSettings) -> None:
    """eval.* values of the right type that still cannot work, refused before any model loads
    (max_new_tokens=0 used to write empty rows and an empty table). Types are EvalSettings' job."""
    if not ev.concurrency:  # max() of no batch sizes used to be a traceback
        raise ConfigError("eval.concurrency=[]: no batch size to run. Fix: set eval.concurrency=[1] (or e.g. [1,4,16]).")
    for key, least, value in [("max_new_tokens", 1, ev.max_new_tokens), ("warmup", 0, ev.warmup),
                              ("auto_budget_prompts", 1, ev.auto_budget_prompts),
                              *([("n", 1, ev.n)] if ev.n is not None else []),
                              *(("concurrency", 1, c) for c in ev.concurrency)]:
        if value < least:
            raise ConfigError(f"eval.{key}={value!r}: an integer >= {least}. Fix: set eval.{key} to {least} or more.")
    if ev.exec_timeout_s <= 0:
        raise ConfigError(f"eval.exec_timeout_s={ev.exec_timeout_s!r}: seconds > 0. Fix: set eval.exec_timeout_s=10.")
    from d3d.grading.sandbox import check_sandbox

    check_sandbox(ev.sandbox)
    for label in ev.also_drafters:  # its rows are named <method>@<label>
        if not label or "@" in label or "/" in label:
            raise ConfigError(f"eval.also_drafters.{label}: a label names rows <method>@<label>. Fix: use a plain "
                              f"name such as `unpruned` (no '@' or '/').")


def parse_budget(text) -> tuple[int, ...]:
    """An eval.async_budgets entry: the values of a Drafts kind's tray knobs joined by x."""
    if str(text).lower() != AUTO:
        try:
            return tuple(int(x) for x in str(text).lower().split("x"))
        except ValueError:
            pass
    raise ConfigError(f"eval.async_budgets entry {text!r}: write CxF for a chain's trays (e.g. 8x2: C covered slots + 1, "
                      f"F alternatives), T for a tree's (e.g. 16 trays), or auto. Fix: e.g. eval.async_budgets=[4x1,8x2,16].")
