"""Every shipped config composes, every experiment overlays every job, bad keys fail clearly."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from d3d.config import config_dir
from d3d.data.benchmarks import iter_specs
from tests.conftest import compose

ROOTS = ["generate", "train", "prune", "eval"]
GROUPS = {  # group -> root configs that use it
    "target": ROOTS, "drafter": ["train", "prune", "eval"], "data": ["generate", "train", "prune"],
    "benchmark": ["eval"], "decode": ["eval"],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def test_config_tree_is_complete():
    for group in ["target", "drafter", "data", "benchmark", "decode", "experiment", "paths", "hydra"]:
        assert options(group), f"conf/{group}/ is empty"
    assert set(options("target")) >= {"smollm2_135m", "qwen25_coder_05b", "qwen25_coder_15b", "qwen3_8b", "qwen3_32b"}
    assert set(options("benchmark")) >= {"gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp",
                                         "livecodebench", "mt_bench", "alpaca", "all"}
    assert set(options("experiment")) >= {"cpu_default", "smoke", "qwen3_8b", "qwen3_32b", "cpu_qwen"}
    assert set(options("decode")) == {"ar", "sync", "async"}


@pytest.mark.parametrize("root", ROOTS)
def test_root_composes_and_resolves(root, tmp_path):
    cfg = compose(root, tmp_path=tmp_path)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["task_name"] == root
    assert plain["target"]["name"] == "smollm2_135m"


@pytest.mark.parametrize("group,option,root", [
    (g, o, r) for g, roots in GROUPS.items() for o in options(g) for r in roots[:1]
])
def test_every_group_option_composes(group, option, root, tmp_path):
    cfg = compose(root, [f"{group}={option}"], tmp_path)
    OmegaConf.to_container(cfg[group], resolve=True)


@pytest.mark.parametrize("experiment", options("experiment"))
@pytest.mark.parametrize("root", ROOTS)
def test_every_experiment_overlays_every_job(root, experiment, tmp_path):
    cfg = compose(root, [f"+experiment={experiment}"], tmp_path)
    OmegaConf.to_container(cfg, resolve=True)


def test_benchmark_all_is_the_seven_of_the_design():
    cfg = compose("eval", ["benchmark=all"])
    suite = [spec.name for spec in iter_specs(cfg.benchmark)]  # all.yaml names its members once, in defaults
    assert suite == ["gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench"]
    assert {name: cfg.benchmark.specs[name].n for name in suite} == {
        "gsm8k": 128, "math500": 128, "aime25": 30, "humaneval": 164, "mbpp": 128, "livecodebench": 128, "mt_bench": 80}


def test_experiments_change_only_deltas():
    base = OmegaConf.to_container(compose("generate"), resolve=False)
    smoke = OmegaConf.to_container(compose("generate", ["+experiment=smoke"]), resolve=False)
    assert smoke["target"]["name"] == "tiny_random" and base["target"]["name"] == "smollm2_135m"
    assert smoke["paths"] == base["paths"]  # untouched groups stay as they were


def test_unknown_key_fails_with_a_clear_message():
    with pytest.raises(Exception) as err:
        compose("generate", ["generate.batchsize=4"])
    assert "batchsize" in str(err.value)


def test_async_budget_name_tracks_keys():
    cfg = compose("eval", ["decode=async", "decode.C=8", "decode.F=1"])
    assert cfg.decode.name == "async_b16_c8_f1"


# The typed boundary of each recipe (d3d.settings): every key of a recipe's own sections is a field it
# reads (a key no code reads is dead: changing it changes nothing, yet resume keys may hold it), and
# every field is in the YAML (a missing one would run on a default nobody documented).
OWN = {"generate": {"generate": "GenerateSettings"}, "train": {"train": "TrainSettings"},
       "prune": {"prune": "PruneSettings", "train": "StepSettings"}, "eval": {"eval": "EvalSettings"}}
# The sections each root composes (experiment overlays may add other recipes' sections on top): a
# group a recipe never reads (generate has no drafter) is not composed.
SECTIONS = {
    "generate": {"paths", "target", "data", "task_name", "run_name", "seed", "generate"},
    "train": {"paths", "target", "drafter", "data", "task_name", "run_name", "seed", "train", "logger"},
    "prune": {"paths", "target", "drafter", "data", "task_name", "run_name", "seed", "train", "prune"},
    "eval": {"paths", "target", "drafter", "data", "benchmark", "decode", "methods", "task_name", "run_name",
             "seed", "eval"},
}


def foreign_keys(root: str, section: str) -> frozenset:
    """Keys an experiment overlay may put in a recipe's section that belong to another recipe. The
    one case: experiments overlay every job alike, so d3d.train's own keys they set (max_steps, ...)
    land in prune's `train`, which prune skips by name (d3d.settings.bind_step_section)."""
    from d3d.settings import TRAIN_ONLY_KEYS

    return TRAIN_ONLY_KEYS if (root, section) == ("prune", "train") else frozenset()


def bind_as_the_recipe_does(cfg, root: str, section: str, schema):
    import d3d.settings

    if (root, section) == ("prune", "train"):
        return d3d.settings.bind_step_section(cfg)
    return d3d.settings.bind_section(cfg, section, schema)


@pytest.mark.parametrize("experiment", [None, *options("experiment")])
@pytest.mark.parametrize("root", sorted(OWN))
def test_every_key_of_a_recipes_sections_is_read_and_every_field_is_set(root, experiment, tmp_path):
    import dataclasses

    import d3d.settings

    cfg = compose(root, [f"+experiment={experiment}"] if experiment else [], tmp_path)
    if experiment is None:
        assert set(cfg) == SECTIONS[root]
    for section, schema_name in OWN[root].items():
        schema = getattr(d3d.settings, schema_name)
        bind_as_the_recipe_does(cfg, root, section, schema)
        fields, keys = {f.name for f in dataclasses.fields(schema)}, set(cfg[section])
        assert not fields - keys, f"{root}: {section} lacks {sorted(fields - keys)}"
        foreign = foreign_keys(root, section) if experiment else frozenset()
        assert not keys - fields - foreign, f"{root}: no code reads {section}.{sorted(keys - fields - foreign)}"


@pytest.mark.parametrize("experiment", [None, *options("experiment")])
def test_every_decode_key_is_one_its_method_reads(experiment, tmp_path):
    """conf/decode/<name>.yaml holds exactly the keys its method reads (d3d.settings.decode_keys) and
    its name: no tray budget in sync or ar, no max_new_tokens (eval.max_new_tokens is the one read)."""
    from d3d.settings import decode_keys

    cfg = compose("eval", [f"+experiment={experiment}"] if experiment else [], tmp_path)
    for where, node in [("decode", cfg.decode), *((f"methods.{n}", cfg.methods[n]) for n in cfg.methods)]:
        assert set(node) - {"name"} == set(decode_keys(node.method)), where


def test_an_unread_key_and_a_wrong_type_fail_at_the_boundary(tmp_path):
    from d3d.config import ConfigError
    from d3d.settings import EvalSettings, GenerateSettings, bind_section

    with pytest.raises(ConfigError, match=r"eval\.max_new_token: Key 'max_new_token' not in 'EvalSettings'"):
        bind_section(compose("eval", ["+eval.max_new_token=8"], tmp_path), "eval", EvalSettings)
    with pytest.raises(ConfigError, match=r"generate\.batch_size: Value 'many'"):
        bind_section(compose("generate", ["generate.batch_size=many"], tmp_path), "generate", GenerateSettings)


def test_an_unknown_key_fails_in_prunes_train_and_in_a_decode_file(tmp_path):
    """prune skips d3d.train's own keys an overlay put in `train` by name, nothing else; a decode file's
    key that DecodeConfig lacks fails instead of being dropped."""
    from d3d.config import ConfigError
    from d3d.eval import method_configs
    from d3d.settings import EvalSettings, bind_section, bind_step_section

    assert bind_step_section(compose("prune", ["+train.max_steps=8"], tmp_path)).lr == 3e-5
    with pytest.raises(ConfigError, match=r"train\.lrr: Key 'lrr' not in 'StepSettings'"):
        bind_step_section(compose("prune", ["+train.lrr=1"], tmp_path))
    cfg = compose("eval", ["+methods.sync.Cc=3"], tmp_path)
    with pytest.raises(ConfigError, match=r"methods\.sync\.Cc: not a decode setting"):
        method_configs(cfg, bind_section(cfg, "eval", EvalSettings))


def test_every_decode_file_is_a_method_eval_can_name(tmp_path):
    """eval.methods picks from `methods`, which Hydra composes from conf/decode/ (conf/eval.yaml's
    defaults): a decode file without its defaults line would be a method no run can name."""
    from d3d.decoding import DecodeConfig

    cfg = compose("eval", [], tmp_path)
    assert set(cfg.methods) == set(options("decode"))
    for name in cfg.methods:
        DecodeConfig.from_cfg(OmegaConf.to_container(cfg.methods[name], resolve=True))


# The list every training prompt set typed by hand before it was derived (resume keys written then hold it).
HAND_TYPED_EXCLUDE_EVAL = ["gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench",
                           "alpaca"]


@pytest.mark.parametrize("data", options("data"))
def test_training_prompts_exclude_every_benchmark_file(data, tmp_path):
    """exclude_eval is derived from conf/benchmark/: every spec there, suites (all, all_plus) aside."""
    shipped = {name for option in options("benchmark")
               for name in OmegaConf.load(config_dir() / "benchmark" / f"{option}.yaml").get("specs") or []}
    assert shipped >= set(HAND_TYPED_EXCLUDE_EVAL)  # at least: a new benchmark file adds to it
    excluded = compose("generate", [f"data={data}"], tmp_path).data.exclude_eval
    assert list(excluded) == sorted(shipped)
    # an explicit list still wins
    assert list(compose("generate", [f"data={data}", "data.exclude_eval=[gsm8k]"], tmp_path).data.exclude_eval) == ["gsm8k"]


def test_a_new_benchmark_file_is_excluded_from_training_data(tmp_path, monkeypatch):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(config_dir(), conf)
    spec = OmegaConf.load(conf / "benchmark" / "gsm8k.yaml")
    spec.specs = {"gsm_hard": {**spec.specs.gsm8k, "name": "gsm_hard"}}
    OmegaConf.save(spec, conf / "benchmark" / "gsm_hard.yaml")
    monkeypatch.setenv("D3D_CONFIG_DIR", str(conf))
    assert "gsm_hard" in compose("train", [], tmp_path).data.exclude_eval


def test_the_derived_exclusion_keeps_resume_keys_of_the_hand_typed_list(tmp_path):
    """Its order changes no prompt, so train's resume key compares it sorted: a checkpoint written
    with the hand-typed list (another order) resumes; one written with another set does not."""
    import copy

    from d3d.config import differing_keys
    from d3d.training import comparable_train_key, train_resume_key

    key = train_resume_key(compose("train", [], tmp_path))
    old = copy.deepcopy(key)
    old["data"]["exclude_eval"] = HAND_TYPED_EXCLUDE_EVAL
    assert differing_keys(comparable_train_key(old), key) == []
    old["data"]["exclude_eval"] = HAND_TYPED_EXCLUDE_EVAL[:-1]
    assert differing_keys(comparable_train_key(old), key) == ["data.exclude_eval"]
