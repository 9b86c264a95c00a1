"""`make demo` = `python -m d3d.pipeline --demo`: the overlay is chosen from the CPU and recorded."""

from __future__ import annotations

import pytest

import d3d.pipeline as pipeline


@pytest.mark.parametrize("native, experiment, stages", [
    (True, "pipeline_qwen", ["generate", "train", "prune", "eval"]),  # where speculation pays: the Qwen pair in bf16, pruned
    (False, "pipeline_cpu", ["generate", "train", "prune", "eval"]),
])
def test_demo_picks_the_overlay_this_cpu_suits_and_records_why(monkeypatch, native, experiment, stages):
    monkeypatch.setenv("D3D_CPU_BF16", "1" if native else "0")  # the choice is made in a process of its own
    seen = {}
    monkeypatch.setattr(pipeline, "run_pipeline", lambda overrides, stages, demo=None: seen.update(
        overrides=overrides, stages=stages, demo=demo))
    pipeline.main(["--demo", "eval.n=2"])
    assert seen["overrides"] == [f"+experiment={experiment}", "eval.n=2"] and seen["stages"] == stages
    assert seen["demo"]["experiment"] == experiment and seen["demo"]["why"] and "model" in seen["demo"]["cpu"]
    pipeline.main(["--demo", "--stages", "eval"])  # an explicit stage list still wins
    assert seen["stages"] == ["eval"]
