"""Settings out of range fail at the boundary (d3d.specs), in one line naming the key and the fix,
before anything loads. Each used to run: generate.batch_size=0 answered nothing with rc 0;
train.save_every=0, train.grad_accum=0 and prune.calib_size=0 failed minutes later, after the
drafter was built."""

from __future__ import annotations

import pytest

from d3d.errors import ConfigError
from d3d.settings import bind_config
from tests.conftest import compose


@pytest.mark.parametrize("root,override,message", [
    ("generate", "generate.batch_size=0", r"generate.batch_size=0: must be at least 1. Fix: set generate.batch_size=1"),
    ("generate", "generate.max_new_tokens=0", r"generate.max_new_tokens=0: must be at least 1"),
    ("generate", "generate.limit=0", r"generate.limit=0: must be at least 1"),
    ("train", "train.save_every=0", r"train.save_every=0: must be at least 1"),
    ("train", "train.grad_accum=0", r"train.grad_accum=0: must be at least 1"),
    ("train", "train.max_steps=0", r"train.max_steps=0: must be at least 1"),
    ("train", "train.batch_size=0", r"train.batch_size=0: must be at least 1"),
    ("train", "train.lr=0", r"train.lr=0.0: must be above 0"),
    ("train", "train.max_minutes=-1", r"train.max_minutes=-1.0: must be above 0"),
    ("train", "train.mixed_precision=bf17", r"train.mixed_precision='bf17': not a precision. Fix: use auto, no, bf16 or fp16"),
    ("prune", "prune.calib_size=0", r"prune.calib_size=0: must be at least 1"),
    ("prune", "prune.num_layers=0", r"prune.num_layers=0: must be at least 1"),
    ("prune", "train.val_size=-1", r"train.val_size=-1: must be at least 0"),  # prune's view of the step's keys
    # seeds: 2**64 was torch's "Overflow when unpacking long", 2**32 and -1 numpy's, after the job started
    ("train", "seed=18446744073709551616", r"seed=18446744073709551616: not a seed numpy and torch both take. Fix: set "
                                           r"seed to an integer in \[0, 4294967295\]"),
    ("eval", "seed=4294967296", r"seed=4294967296: not a seed"),
    ("generate", "seed=-1", r"seed=-1: not a seed"),
    ("train", "drafter.seed=4294967296", r"drafter.seed=4294967296: not a seed"),
    ("generate", "data.seed=-1", r"data.seed=-1: not a seed"),
    # a width the heads do not divide was a transformers traceback while the tiny target was built
    ("train", "target.tiny.hidden_size=66", r"target.tiny: hidden_size=66, num_attention_heads=4, num_key_value_heads=2: "
                                            r"hidden_size must be an even multiple .* Fix: e.g. hidden_size=64"),
    ("train", "target.tiny.num_key_value_heads=3", r"target.tiny: .*num_key_value_heads=3: .* num_key_value_heads=1"),
])
def test_a_setting_out_of_range_is_one_line_at_the_boundary(root, override, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        bind_config(compose(root, ["+experiment=smoke", override]), root)


def test_sampling_settings_are_checked_only_when_sampling():
    bind_config(compose("generate", ["generate.top_p=0"]), "generate")  # greedy: unread
    with pytest.raises(ConfigError, match=r"^generate.top_p=0.0: must be above 0"):
        bind_config(compose("generate", ["generate.do_sample=true", "generate.top_p=0"]), "generate")
    with pytest.raises(ConfigError, match=r"^generate.top_p=1.5: must be at most 1"):
        bind_config(compose("generate", ["generate.do_sample=true", "generate.top_p=1.5"]), "generate")


def test_the_edges_of_each_range_bind():
    for root, override in [("generate", "generate.batch_size=1"), ("train", "train.eval_every=0"),
                           ("train", "train.warmup_steps=0"), ("prune", "prune.min_retention=0"),
                           ("prune", "prune.recovery_steps=0")]:
        bind_config(compose(root, ["+experiment=smoke", override]), root)


# ---------------------------------------------------------------- every numeric key, hostile (issue 38)

def _numeric_leaves(schema, prefix=""):
    """(dotted key, type, nullable) of every int / float field under a dataclass, nested sections included."""
    import dataclasses
    import sys
    import typing

    hints = typing.get_type_hints(schema, vars(sys.modules[schema.__module__]))
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        nullable = type(None) in typing.get_args(hint)
        base = args[0] if nullable and len(args) == 1 else hint
        if base in (int, float):
            yield f"{prefix}{f.name}", base, nullable
        elif dataclasses.is_dataclass(base):
            yield from _numeric_leaves(base, f"{prefix}{f.name}.")


def _sections():
    """(root, section, its schema, its composed value) of every dataclass section of every recipe on smoke."""
    import dataclasses
    import typing

    from omegaconf import OmegaConf

    from d3d.settings import ROOT_CONFIGS, TRAIN_ONLY_KEYS

    for root, schema in ROOT_CONFIGS.items():
        cfg = compose(root, ["+experiment=smoke"])
        hints = typing.get_type_hints(schema, vars(__import__("d3d.specs", fromlist=["x"])))
        for f in dataclasses.fields(schema):
            sub = hints[f.name]
            sub = next((a for a in typing.get_args(sub) if a is not type(None)), sub)
            if dataclasses.is_dataclass(sub) and f.name in cfg and cfg[f.name] is not None:
                value = OmegaConf.to_container(cfg[f.name], resolve=True)
                if root in ("prune", "export") and f.name == "train":  # their view of the step's keys
                    value = {k: v for k, v in value.items() if k not in TRAIN_ONLY_KEYS}
                yield root, f.name, sub, value
        if root == "eval":  # the benchmark group's specs: a section per benchmark
            from d3d.specs import BenchmarkSpec

            for name, spec in OmegaConf.to_container(cfg.benchmark.specs, resolve=True).items():
                yield root, f"benchmark.specs.{name}", BenchmarkSpec, spec


SIGNED = {"seed", "tiny.seed"}  # any integer seeds a generator
UNREAD = {"generate.temperature", "generate.top_p"}  # greedy (the shipped generate) reads neither: checked when sampling


def _set(node: dict, dotted: str, value) -> dict:
    import copy

    node = copy.deepcopy(node)
    *parents, last = dotted.split(".")
    at = node
    for key in parents:
        at = at[key]
    at[last] = value
    return node


def test_every_numeric_key_of_every_recipe_refuses_hostile_values_in_one_line_with_the_fix():
    """A wrong type, a list, null where a number belongs, NaN, inf and a negative count, for every int and
    float key of every recipe's sections (nested ones too): one line that starts with the dotted key and
    says the fix. Before: type errors named no fix; NaN passed every `value < low` check (prune.min_retention,
    train.partial_mask, eval.exec_timeout_s: nan ran); negative λ, weight decay, betas and tiny sizes ran."""
    from d3d.settings import bind, check_eval_settings

    checked, missed = 0, []
    for root, section, schema, value in _sections():
        for key, kind, nullable in _numeric_leaves(schema):
            try:
                _set(value, key, 0)
            except (KeyError, TypeError):  # a nested section the composed config leaves null (target.gguf)
                continue
            dotted = f"{section}.{key}"
            hostile = ["abc", [1, 2]] + ([] if nullable else [None]) + ([float("nan"), float("inf")] if kind is float else [])
            hostile += [] if key in SIGNED or dotted in UNREAD else [-1]
            for bad in hostile:
                try:
                    bound = bind(schema, _set(value, key, bad), section)
                    if section == "eval":
                        check_eval_settings(bound)
                    missed.append(f"{root}: {dotted}={bad!r} bound")
                except ConfigError as err:
                    msg = str(err)
                    if not (msg.startswith((f"{dotted}:", f"{dotted}=")) and "Fix:" in msg and "\n" not in msg):
                        missed.append(f"{root}: {dotted}={bad!r}: {msg}")
                checked += 1
    assert not missed, "\n".join(missed)
    assert checked > 300, checked  # the walk reached the sections


def test_every_section_refuses_an_unknown_key_naming_its_keys():
    from d3d.settings import bind

    for root, section, schema, value in _sections():
        with pytest.raises(ConfigError, match=rf"^{section}\.nope: Key 'nope' not in '{schema.__name__}'\. Fix: check "
                                              rf"its spelling; {schema.__name__} has "):
            bind(schema, {**value, "nope": 1}, section)


@pytest.mark.parametrize("method", ["ar", "sync", "async", "tree", "async_tree"])
def test_every_decode_file_refuses_hostile_values_named_by_its_own_section(method):
    """methods.<name>.* used to be named decode.<key> in DecodeConfig's refusals, without a fix."""
    from omegaconf import OmegaConf

    from d3d.settings import bind_decode, decode_keys

    cfg = compose("eval", ["+experiment=smoke"])
    node = OmegaConf.to_container(cfg.methods[method], resolve=True)
    where = f"methods.{method}"
    numeric = [k for k in decode_keys(method) if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)]
    assert numeric
    for key in numeric:
        for bad in ("abc", None, [1, 2], float("nan"), -1):
            if key == "block_size" and method == "ar" and bad == -1:
                continue
            with pytest.raises(ConfigError) as err:
                bind_decode({**node, key: bad}, where)
            msg = str(err.value)
            assert msg.startswith((f"{where}.{key}:", f"{where}.{key}=")) and "Fix:" in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match=rf"^{where}\.nope: method {method} does not read it .* Fix: "):
        bind_decode({**node, "nope": 1}, where)


def test_eval_lists_refuse_empty_and_scalars():
    """eval.concurrency=[] was max() of nothing, a traceback; eval.auto_budget_prompts=0 took every prompt."""
    from d3d.settings import bind, check_eval_settings

    cfg = compose("eval", ["+experiment=smoke"])
    from omegaconf import OmegaConf

    ev = OmegaConf.to_container(cfg.eval, resolve=True)
    for bad, message in [({"concurrency": []}, r"^eval.concurrency=\[\]: no batch size to run. Fix: "),
                         ({"auto_budget_prompts": 0}, r"^eval.auto_budget_prompts=0: an integer >= 1. Fix: "),
                         ({"concurrency": 4}, r"^eval.concurrency: .* Fix: set eval.concurrency to a list"),
                         ({"methods": "ar"}, r"^eval.methods: .* Fix: set eval.methods to a list")]:
        with pytest.raises(ConfigError, match=message):
            check_eval_settings(bind(type(bind_config(cfg, "eval").eval), {**ev, **bad}, "eval"))
