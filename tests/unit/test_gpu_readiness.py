"""scripts/gpu_readiness.py's arithmetic on synthetic numbers, no model: the overlap comes from the
rounds alone, and `problems` fails a run on its own checks (the script at toy size on the CPU is
tests/integration/test_gpu_readiness.py)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_readiness")


def test_overlap_is_the_share_of_the_tray_pass_an_async_round_hides(script):
    ov = script.overlap_from_rounds
    assert ov(t_sync=30.0, t_miss=30.0, t_tray=10.0) == 1.0  # the tray pass cost the round nothing
    assert ov(t_sync=30.0, t_miss=40.0, t_tray=10.0) == 0.0  # it ran after verification
    assert ov(t_sync=30.0, t_miss=35.0, t_tray=10.0) == pytest.approx(0.5)
    assert ov(t_sync=30.0, t_miss=30.0, t_tray=0.0) is None  # no tray time: nothing to say


def loop(round_ms, draft=5.0, tray=0.0):
    return {"rounds": 8, "round_wall_ms": round_ms, "draft_ms": draft, "verify_ms": 20.0, "tray_ms": tray,
            "backend": "eager"}


def test_projections_use_round_times_only(script):
    """Sync 30 ms, async miss 36 ms with a 12 ms tray pass: overlap 1 - 6/12 = 0.5, whatever the
    passes cost alone (not an input); a hit skips the 5 ms draft; the masked-AR row adds the mask's
    cost to the AR round."""
    loops = {"ar": loop(10.0), "sync": loop(30.0), "async_2x1": loop(36.0, tray=12.0)}
    rows = script.projections(loops, "", tau=4.0, budgets=[(2, 1)], hit_rates=[0.5], block_size=4, mask_cost_ms=1.0)
    sync, async_ = rows
    assert sync["projected_speedup"] == pytest.approx(4 * 10 / 30)
    assert sync["projected_speedup_masked_ar"] == pytest.approx(4 * 11 / 30)
    assert async_["overlap"] == async_["overlap_unclipped"] == pytest.approx(0.5)
    assert async_["hit_round_ms"] == 31.0 and async_["budget_tokens"] == 4 * 3
    assert async_["projected_speedup"] == pytest.approx(4 * 10 / (0.5 * 31 + 0.5 * 36))
    clipped = script.projections({**loops, "async_2x1": loop(50.0, tray=12.0)}, "", 4.0, [(2, 1)], [0.5], 4, None)[1]
    assert clipped["overlap"] == 0.0 and clipped["overlap_unclipped"] == pytest.approx(1 - 20 / 12)


def good_run(device="cuda:0"):
    p = {"device_ms": 2.0, "host_issue_ms": 1.0, "ran_dry": False}
    loops = {"ar": loop(10.0), "sync": loop(30.0), "async_2x1": loop(36.0, tray=12.0)}
    return {"device": device, "passes": {"verify_4": dict(p), "sync_draft": dict(p)}, "verify_ms": {4: 2.0},
            "sync_draft_ms": 2.0, "packed_ms": {"2x1": 2.0}, "loops": loops,
            "projection": load_script("gpu_readiness").projections(loops, "", 4.0, [(2, 1)], [0.5], 4, 0.0)}


def test_a_run_fails_its_own_checks(script):
    assert script.problems(good_run()) == []
    dry = good_run()
    dry["passes"]["verify_4"]["ran_dry"] = True  # the host was slower than the pre-queued sleep
    assert script.problems(dry) == ["passes[verify_4]: the host did not run ahead of the device"]
    wrong = good_run()
    wrong["loops"]["sync@compiled"] = {**loop(30.0), "backend": "eager"}  # a compiled loop that ran eager
    assert script.problems(wrong) == ["loops[sync@compiled] ran on eager"]
    beyond = good_run()
    beyond["projection"][1]["overlap_unclipped"] = -0.6  # rounds that disagree: async 7 ms over a 12 ms tray
    assert script.problems(beyond) == ["projection[async C=2 F=1, eager]: overlap -0.6"]
    beyond["device"] = "cpu"  # on a CPU the bound is not applied (toy rounds are noise)
    assert script.problems(beyond) == []
    empty = good_run()
    del empty["loops"]
    assert "loops missing" in script.problems(empty)
