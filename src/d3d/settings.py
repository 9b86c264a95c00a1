"""Binding at the boundary (lingua's dataclass args): each recipe turns the composed Hydra config into
its root config of d3d.specs in `run_*`, once, with a strict merge, so a misspelt or unread key fails
there with its dotted name instead of being ignored, and nothing below reads the raw config or keeps
a second default in `.get(key, default)`. The YAML files keep the documented defaults; the dataclasses
say which keys exist and their types (tests/unit/test_configs.py binds every root x experiment).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from d3d.config import ConfigError, config_dir
from d3d.specs import (
    BenchmarkSpec, DrafterSpec, EvalConfig, GenerateConfig, ModelSpec, PruneConfig, StepSettings, TrainConfig,
    TrainSettings,
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
                                 "eval": EvalConfig}
# Top-level sections bound elsewhere: eval's decode settings, per method (d3d.eval.method_configs).
BOUND_ELSEWHERE = frozenset({"decode", "methods"})
EVERY_SECTION = frozenset(f.name for schema in ROOT_CONFIGS.values() for f in fields(schema)) | BOUND_ELSEWHERE


def bind(schema: type[T], node: Any, where: str) -> T:
    """`node` (a section of the composed config, or plain data) as a `schema` object: unknown keys,
    missing ones and values of the wrong type fail here, named by their dotted key (`where.key`)."""
    try:
        if OmegaConf.is_config(node):  # interpolations reach outside the section: resolve them first
            node = OmegaConf.to_container(node, resolve=True)
        typed = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(getattr(err, "msg", None) or err).splitlines()[0]
        dotted = ".".join(k for k in (where, key) if k)
        raise ConfigError(f"{dotted}: {msg}" if dotted else msg) from None


def bind_config(cfg: DictConfig, name: str):
    """The root config of recipe `name` (d3d.specs.<Name>Config) from its composed config. Sections
    other recipes own, which experiment overlays put in every job, are left out; a top-level key no
    recipe has fails. prune's `train` skips d3d.train's own keys (TRAIN_ONLY_KEYS)."""
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
        if (name, f.name) == ("prune", "train"):
            value = {k: v for k, v in value.items() if k not in TRAIN_ONLY_KEYS}
        node[f.name] = value
    return bind(schema, node, "")


def shipped_benchmark(name: str) -> BenchmarkSpec:
    """The shipped spec of one benchmark, read from conf/benchmark/<name>.yaml."""
    path = config_dir() / "benchmark" / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(f"no benchmark named {name!r} (no {path}); see `python -m d3d.data` for the list")
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
        raise ConfigError(f"{where}.method: missing; a decode file names its method (conf/decode/<name>.yaml)")
    method = plain["method"]
    reads = decode_keys(method, where)
    unread = [k for k in plain if k not in reads]
    if unread:
        raise ConfigError(f"{where}.{unread[0]}: method {method} does not read it (it reads {', '.join(reads)})")
    return bind(DecodeConfig, plain, where)


def check_decode_cost(methods: dict[str, DecodeConfig], target: ModelSpec, drafter: DrafterSpec | None,
                      cache_dir: str | Path, batch: int = 1) -> None:
    """Every method's widest pass against the device's memory, and decode.F against the vocabulary,
    from the models' config.json only (d3d.decoding.cost): a pass that cannot fit is refused in one
    line before any weight loads. The one check of eval, the pipeline's up-front check and the bench
    scripts. `methods` maps the name each was bound under to its config; `batch` = the most requests
    decoded together (eval.concurrency)."""
    from d3d.decoding.cost import check_fits, memory_bytes
    from d3d.decoding.methods import method_row
    from d3d.models.target import pick_device, resolve_model_path, torch_dtype

    device = str(pick_device(target.device))
    width = torch_dtype(target.dtype, device).itemsize  # eval loads the drafter in the target's dtype too
    target_path = resolve_model_path(target, cache_dir)
    shapes = {"target": _shape(target_path, width, target.attn_implementation)}
    if drafter is not None and any(method_row(dc.method).needs_drafter for dc in methods.values()):
        shapes["drafter"] = _drafter_shape(drafter, target, target_path, shapes["target"], cache_dir, width)
    memory = memory_bytes(device)
    for name, dc in methods.items():
        check_fits(dc, method_row(dc.method), name, shapes, batch, memory, device)


def _shape(path: str, width: int, attn: str | None):
    from transformers import AutoConfig

    from d3d.decoding.cost import ModelShape

    return ModelShape.of_config(AutoConfig.from_pretrained(path), width, attn)


def _drafter_shape(drafter: DrafterSpec, target: ModelSpec, target_path: str, target_shape, cache_dir, width: int):
    """The drafter's shape: its checkpoint's config.json, or (a drafter still to be trained, as in the
    pipeline's up-front check) what its init builds: the target's, a subset of its layers, or the
    pretrained model's."""
    from d3d.models.drafter import drafter_attention
    from d3d.models.target import resolve_model_path

    from d3d.config import resolve_path

    attn = drafter_attention(drafter, target)
    folder = resolve_path(drafter.checkpoint) if drafter.checkpoint else None
    if folder is not None and (folder / "config.json").is_file():
        return _shape(str(folder), width, attn)
    if drafter.init == "pretrained" and drafter.model is not None:
        return _shape(resolve_model_path(drafter.model, cache_dir), width, attn)
    if drafter.init == "target_layers" and drafter.layers:
        return target_shape.with_layers(len(drafter.layers))
    return target_shape
