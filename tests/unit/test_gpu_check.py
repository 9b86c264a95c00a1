"""scripts/gpu_check.py's bookkeeping, no stage run: a stage its budget cannot hold is recorded as
skipped, and the default run fits its H200 estimate. The stages themselves at toy size on the CPU
are in tests/integration/test_gpu_check.py."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def check():
    return load_script("gpu_check")


def test_a_stage_the_budget_cannot_hold_is_recorded_as_skipped(check, tmp_path, monkeypatch):
    """--budget-s: a stage whose H200 estimate (async_sync: 5 s) does not fit in what is left is
    not started but recorded skipped, with its reason; the run does not count it as a failure.
    A fake clock: the first stage (race, its pytest run stubbed) takes 46 of the 50 s."""
    import json
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(check, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    ran = []

    def run_tests(stage, *args, **kw):
        ran.append(stage)
        clock[0] = 46.0
        return {"ok": True}

    monkeypatch.setattr(check, "run_tests", run_tests)
    report = check.main(["--device", "cpu", "--out-dir", str(tmp_path), "--stages", "race", "async_sync",
                         "--budget-s", "50"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["stages"]["race"]["status"] == "ok"
    late = saved["stages"]["async_sync"]
    assert late["status"] == "skipped" and late["steps"] == {}
    assert late["reason"] == "budget: 5 s estimated, 4 s of --budget-s 50 left"
    assert saved["skipped"] == ["async_sync"] and report["ok"] and ran == ["race"]


def test_the_default_run_fits_twelve_minutes_on_an_h200_by_its_estimate(check):
    plan = check.ESTIMATE.table(check.STAGES)
    assert set(plan["seconds"]) == {"startup", *check.STAGES}
    # 389 s before readiness's compiled async row at 8B / 1.7B shapes (3 cold compiles, 223 s),
    # compiled_equal's trees and side-stream graphs and the exact host-sync counts came in
    assert plan["total_s"] <= 720, plan
    assert plan["total_s"] <= 720 < 780  # the default --budget-s, inside the README's `timeout 780`
