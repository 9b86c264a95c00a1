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


def test_each_part_fits_five_minutes_on_an_h200_by_its_estimate(check):
    """Two parts, each one command inside a lent GPU's 10-minute limit with room for a rerun of the
    first within its 15 minutes of device time (about 2-3 minutes of it the machine's start): each
    part's estimate <= 300 s, its default budget above that and below the README's `timeout`."""
    import re

    from tests.conftest import ROOT

    assert check.STAGES == check.PARTS[1] + check.PARTS[2] and len(set(check.STAGES)) == 12
    # what matters first comes from part 1: every contract stage, and async's overlap at 8B / 1.7B
    assert {*check.TEST_STAGES} - {"compiled_equal"} | {"overlap"} <= set(check.PARTS[1])
    readme = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "scripts/gpu_check.py --part" in ln]
    timeouts = {int(re.search(r"--part (\d)", ln).group(1)): int(re.search(r"timeout (\d+)", ln).group(1))
                for ln in readme}
    assert set(timeouts) == set(check.PARTS), readme
    for part, stages in check.PARTS.items():
        plan = check.ESTIMATE.table(stages)
        assert set(plan["seconds"]) == {"startup", *stages}
        assert plan["total_s"] <= 300, (part, plan)
        assert plan["total_s"] < check.PART_BUDGET_S < timeouts[part] <= 420, (part, timeouts)
    # the overlap's cold compiles (~223 s) fit part 1 only because its worker compiles beside the
    # stages before it: alone, the stage waits for all of them
    alone = check.ESTIMATE.table(["overlap"])["seconds"]["overlap"]
    assert alone > 200 > check.ESTIMATE.table(check.PARTS[1])["seconds"]["overlap"]


def test_the_second_part_merges_into_the_first_parts_record(check, tmp_path, monkeypatch):
    """Both parts land in one gpu_check.json (what decode.backend=auto reads): a run finding a record
    of the same machine and versions keeps its stages; a record of another setting (here a toy run)
    is replaced, not merged into."""
    import json

    monkeypatch.setattr(check, "run_tests", lambda stage, *args, **kw: {"ok": True})
    path = tmp_path / "gpu_check.json"
    for stage in ("greedy", "compiled_equal"):  # one of part 1, one of part 2
        check.main(["--device", "cpu", "--out-dir", str(tmp_path), "--stages", stage])
    saved = json.loads(path.read_text())
    assert set(saved["stages"]) == {"greedy", "compiled_equal"} and saved["ok"], saved["stages"]
    assert len(saved["earlier_runs"]) == 1
    check.main(["--device", "cpu", "--toy", "--out-dir", str(tmp_path), "--stages", "race"])
    assert set(json.loads(path.read_text())["stages"]) == {"race"}
