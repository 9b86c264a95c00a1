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
