"""scripts/gpu_readiness.py's arithmetic on synthetic numbers, no model: the overlap comes from the
rounds alone, the rows and their hit rates come from a conf/bench preset, and `problems` fails a
run on its own checks (the script at toy size on the CPU is
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


def rows_of(**settings):
    from d3d.decoding import DecodeConfig

    return {name: DecodeConfig(**kw) for name, kw in settings.items()}


ROWS = dict(ar={"method": "ar"}, sync={"method": "sync", "block_size": 4},
            async_2x1={"method": "async", "block_size": 4, "C": 2, "F": 1})


def test_projections_use_round_times_only(script):
    """Sync 30 ms, async miss 36 ms with a 12 ms tray pass: overlap 1 - 6/12 = 0.5, whatever the
    passes cost alone (not an input); a hit skips the 5 ms draft; the masked-AR row adds the mask's
    cost to the AR round; the τ to match sync is τ scaled by the expected round over sync's."""
    loops = {"ar": loop(10.0), "sync": loop(30.0), "async_2x1": loop(36.0, tray=12.0)}
    rows, taus = rows_of(**ROWS), {"ar": 4.0, "sync": 4.0, "async_2x1": 4.0}
    out = script.projections(loops, rows, "", taus, {"async_2x1": 0.5}, mask_cost_ms=1.0)
    sync, async_ = out
    assert (sync["row"], sync["method"], async_["row"], async_["method"]) == ("sync", "sync", "async_2x1", "async")
    assert sync["projected_speedup"] == pytest.approx(4 * 10 / 30) and sync["budget_tokens"] == 0
    assert sync["projected_speedup_masked_ar"] == pytest.approx(4 * 11 / 30)
    assert async_["overlap"] == async_["overlap_unclipped"] == pytest.approx(0.5)
    assert async_["hit_round_ms"] == 31.0 and async_["budget_tokens"] == 4 * 3
    assert async_["projected_speedup"] == pytest.approx(4 * 10 / (0.5 * 31 + 0.5 * 36))
    assert async_["tau_to_match"] == pytest.approx(4 * (0.5 * 31 + 0.5 * 36) / 30) and async_["against"] == "sync"
    clipped = script.projections({**loops, "async_2x1": loop(50.0, tray=12.0)}, rows, "", taus, {"async_2x1": 0.5},
                                 None)[1]
    assert clipped["overlap"] == 0.0 and clipped["overlap_unclipped"] == pytest.approx(1 - 20 / 12)


def test_the_rows_come_from_the_preset(script):
    """--preset: the rows of conf/bench/<name>.yaml in bench.methods order, drafted ones at the
    drafter's block size; a row with trays takes the paper's hit rate of its budget (the async tree
    of 15 nodes and 23 trays packs async 12x2's 384 tokens); the overlap of a row with trays is
    against the row it equals without them."""
    rows = script.preset_rows("gpu_readiness", 16)
    assert script.roles(rows) == ("ar", "sync")
    assert all(dc.block_size == 16 for name, dc in rows.items() if name != "ar")
    from d3d.decoding.methods import method_row

    budgets = {name: method_row(dc.method).budget(dc) for name, dc in rows.items() if method_row(dc.method).trays}
    assert {name: script.PAPER_HIT_RATES[(16, b)] for name, b in budgets.items()} == {
        "async_12x2": 0.713, "async_16x2": 0.783, "async_12x5": 0.818, "async_tree_15x23": 0.713}
    assert script.without_trays("async_12x2", rows) == "sync" and script.without_trays("async_tree_15x23", rows) == "tree_15"
    assert script.per_row(["7.88", "tree_15=6.5"], rows, "--tau")["tree_15"] == 6.5
    with pytest.raises(ValueError, match="--hit-rate sinc=0.5: no row 'sinc'"):
        script.per_row(["sinc=0.5"], rows, "--hit-rate")


def good_run(device="cuda:0"):
    p = {"device_ms": 2.0, "host_issue_ms": 1.0, "ran_dry": False}
    loops = {"ar": loop(10.0), "sync": loop(30.0), "async_2x1": loop(36.0, tray=12.0)}
    return {"device": device, "passes": {"verify_4": dict(p), "sync_draft": dict(p)}, "verify_ms": {4: 2.0},
            "sync_draft_ms": 2.0, "packed_ms": {"async_2x1": 2.0}, "loops": loops,
            "projection": load_script("gpu_readiness").projections(loops, rows_of(**ROWS), "", dict.fromkeys(ROWS, 4.0),
                                                                   {"async_2x1": 0.5}, 0.0)}


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
    assert script.problems(beyond) == ["projection[async_2x1, eager]: overlap -0.6"]
    beyond["device"] = "cpu"  # on a CPU the bound is not applied (toy rounds are noise)
    assert script.problems(beyond) == []
    empty = good_run()
    del empty["loops"]
    assert "loops missing" in script.problems(empty)


def test_an_async_row_that_hides_too_little_of_its_trays_on_the_compiled_backend_fails_by_name(script):
    """At the paper's shapes (8B target, 1.7B drafter) on CUDA, an async row on the compiled backend
    must hide at least half of its tray pass behind verification (its measured `overlap`), and no
    compiled loop may compile inside its timed call; the problem names the row. Elsewhere (the toy
    shapes, a CPU) the overlap is reported, not bound."""
    run = {**good_run(), "target": "qwen3_8b", "drafter": "qwen3_1p7b"}
    run["loops"]["async_2x1@compiled"] = {**loop(30.0, tray=12.0), "backend": "compiled", "trays": True,
                                          "overlap": 0.3, "compiles_in_timed": 0}
    run["loops"]["ar@compiled"] = {**loop(10.0), "backend": "compiled", "trays": False, "overlap": None,
                                   "compiles_in_timed": 2}
    assert script.problems(run) == [
        "loops[ar@compiled]: 2 graphs compiled inside the timed call",
        f"loops[async_2x1@compiled]: overlap 0.3 < {script.MIN_OVERLAP} (the share of its tray pass hidden behind "
        "verification)"]
    run["loops"]["async_2x1@compiled"]["overlap"] = 0.8
    run["loops"]["ar@compiled"]["compiles_in_timed"] = 0
    assert script.problems(run) == []
    run["loops"]["async_2x1@compiled"]["overlap"] = 0.3
    assert script.problems({**run, "target": "toy", "drafter": "toy"}) == []
    assert script.problems({**run, "device": "cpu"}) == []
