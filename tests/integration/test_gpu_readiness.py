"""scripts/gpu_readiness.py and scripts/gpu_check.py run at toy size on CPU; the speedup
projection matches a hand case; the readiness JSON is written stage by stage."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_readiness")


def test_projection_hand_case(script):
    # AR round 10 ms (1 token); τ = 4
    assert script.project(4, None, 10, t_sync=30) == pytest.approx(40 / 30)  # sync round: draft + verify
    assert script.project(4, 1.0, 10, t_miss=30, t_hit=20) == pytest.approx(2.0)  # every round a hit
    assert script.project(4, 0.5, 10, t_miss=50, t_hit=30) == pytest.approx(1.0)  # half: 40 ms a round


TOY = ["--preset", "gpu_readiness_toy", "--target", "toy", "--drafter", "toy", "--device", "cpu", "--dtype", "float32",
       "--prefix", "32", "--block-size", "4", "--block-sizes", "1", "4", "--loop-tokens", "12", "--repeats", "1",
       "--backends", "eager", "--tray-tokens", "8", "--hit-rate", "async_2x1=0.3", "async_3x2=0.6", "async_tree_3x2=0.5"]


def test_runs_at_toy_size_on_cpu(script, tmp_path):
    out = tmp_path / "gr.json"
    res = script.main(TOY + ["--out", str(out)])
    saved = json.loads(out.read_text())
    trays = ["async_2x1", "async_3x2", "async_tree_3x2"]  # the toy preset's rows with trays
    assert set(saved["verify_ms"]) == {"1", "4"} and list(saved["packed_ms"]) == trays
    assert list(saved["loops"]) == ["ar", "sync", *trays[:2], "tree_3", trays[2]]  # the preset's rows, in order
    assert saved["preset"] == "gpu_readiness_toy" and saved["rows"]["async_3x2"]["C"] == 3
    rows = {r["row"]: r for r in res["projection"]}
    assert list(rows) == ["sync", *trays[:2], "tree_3", trays[2]]
    assert [rows[r]["budget_tokens"] for r in ("sync", *trays)] == [0, 4 * 3, 4 * 6, 4 + 2 * 4]
    assert [rows[r]["hit_rate"] for r in trays] == [0.3, 0.6, 0.5]  # each budget its own
    assert all(r["projected_speedup"] > 0 and r["tau_used"] == 7.88 for r in res["projection"])
    assert all(0.0 <= rows[r]["overlap"] <= 1.0 for r in trays)  # the async tree's against tree_3's round
    # every row with the τ it needs to match sync's projection
    sync_round = saved["loops"]["sync"]["round_wall_ms"]
    assert rows["tree_3"]["tau_to_match"] == pytest.approx(7.88 * saved["loops"]["tree_3"]["round_wall_ms"] / sync_round)
    assert saved["loops"]["ar"]["rounds"] == 12 and saved["loops"]["sync"]["draft_ms"] > 0
    # every pass twice over (CPU: device time is the call's wall time), the AR step masked too
    assert {"verify_1", "verify_4", "ar_step_masked", "sync_draft", *(f"packed_{r}" for r in trays)} == set(saved["passes"])
    assert all(p["device_ms"] == p["host_issue_ms"] > 0 and not p["ran_dry"] for p in saved["passes"].values())
    assert saved["ar_mask_cost_ms"] == saved["passes"]["ar_step_masked"]["device_ms"] - saved["verify_ms"]["1"]
    assert all(r["backend"] == "eager" and r["projected_speedup_masked_ar"] > 0 for r in res["projection"])
    assert saved["problems"] == []
    # the draft vocabulary's passes beside the full head's: the toy's 512 ids halved, a 2-block tray at B = 4
    dv = saved["draft_vocab"]
    assert (dv["draft_vocab"], dv["head_rows"], dv["vocab"], dv["tray_blocks"]) == (256, 256, 512, 2)
    assert all(dv[k] > 0 for k in ("full_draft_ms", "draft_vocab_draft_ms", "full_tray_ms", "draft_vocab_tray_ms"))
    assert dv["tray_speedup"] == pytest.approx(dv["full_tray_ms"] / dv["draft_vocab_tray_ms"])


def test_the_compiled_backend_is_timed_beside_eager(script, tmp_path, monkeypatch):
    """--backends eager compiled: every row runs once per backend its method runs on, the compiled ones with
    decode.backend=compiled, and each backend's projections use its own AR round (the compiled AR
    step takes the mask as verification does: no masked-AR row there). The loops are stubbed:
    this checks the selection, not a compile."""
    seen = []

    def rounds(target, drafter, cfg, prefix, new_tokens, device):
        seen.append((cfg.method, cfg.backend))
        t = {"eager": 10.0, "compiled": 4.0}[cfg.backend] * (1 if cfg.method == "ar" else 3)
        return {"rounds": 4, "tau": 1.0, "hit_rate": 0.0, "round_wall_ms": t, "verify_ms": t / 3, "draft_ms": t / 3,
                "tray_ms": t / 3 if cfg.method == "async" else 0.0, "overhead_ms": 0.0, "overlap": None,
                "compiles_in_timed": 0, "warmup_s": 0.0}

    monkeypatch.setattr(script, "loop_rounds", rounds)
    i = TOY.index("--backends")
    res = script.main(TOY[:i] + ["--backends", "eager", "compiled"] + TOY[i + 2:] + ["--out", str(tmp_path / "gr.json")])
    # every row on both, trees included (their static caches move the accepted path's slots into place)
    rows = ("ar", "sync", "async", "async", "tree", "async_tree")
    assert seen == [(m, "eager") for m in rows] + [(m, "compiled") for m in rows]
    names = ("ar", "sync", "async_2x1", "async_3x2", "tree_3", "async_tree_3x2")
    assert {k: lp["backend"] for k, lp in res["loops"].items()} == {
        **{n: "eager" for n in names}, **{f"{n}@compiled": "compiled" for n in names}}
    compiled = [r for r in res["projection"] if r["backend"] == "compiled"]
    assert compiled[0]["row"] == "sync" and compiled[0]["projected_speedup"] == pytest.approx(7.88 * 4.0 / 12.0)
    assert all(r["projected_speedup_masked_ar"] is None for r in compiled)


def test_a_row_with_trays_and_no_hit_rate_is_refused(script, tmp_path, capsys):
    """A budget's hit rate is its own: the toy budgets have no paper figure, and a row left without
    one is named, as is a row the preset does not have."""
    i = TOY.index("--hit-rate")
    with pytest.raises(SystemExit):
        script.main(TOY[:i] + ["--hit-rate", "async_2x1=0.3", "--out", str(tmp_path / "x.json")])
    assert "no hit rate or τ for async_3x2, async_tree_3x2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(TOY + ["async_9x9=0.3", "--out", str(tmp_path / "x.json")])
    assert "--hit-rate async_9x9=0.3: no row 'async_9x9'" in capsys.readouterr().err


def test_json_is_written_after_each_stage(script, tmp_path, monkeypatch):
    """A crash in the loops stage still leaves the latencies measured before it on disk."""
    def boom(*a, **k):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(script, "loop_rounds", boom)
    out = tmp_path / "gr.json"
    with pytest.raises(RuntimeError):
        script.main(TOY + ["--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["stages_done"] == ["passes", "verify_ms", "sync_draft_ms", "packed_ms", "draft_vocab", "ar_mask_cost_ms"]
    assert "loops" not in saved


@pytest.mark.heavy  # every stage of the GPU check in a subprocess: 100 to 185 s on 2 quiet cores
def test_gpu_check_end_to_end_on_cpu(tmp_path):
    """The prepared GPU check at toy size on the CPU, in a process that cannot import Hydra,
    OmegaConf, datasets or DeepSpeed (the GPU machines have none of them): every stage passes,
    and the JSON holds each stage's record. Its pytest stage's file collects there too."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "tests/gpu_machine.py", "scripts/gpu_check.py", "--device", "cpu", "--toy",
                           "--budget-s", "3600", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = saved = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = saved["stages"]
    assert list(stages) == list(load_script("gpu_check").STAGES)  # every stage of the default run, in order
    greedy = stages["greedy"]["steps"]
    # ar, sync and async at two block sizes each, tree and async_tree: 7 cases at batch 1 and 3
    assert len(greedy) == 14 and all(t["outcome"] == "passed" and t["result"]["real"] == 0 for t in greedy.values())
    compiled = stages["compiled_equal"]["steps"]
    assert compiled and all(t["result"]["equal"] == t["result"]["cases"] > 0 for t in compiled.values())
    assert {"ar_eager", "ar_compiled"} <= set(stages["compiled_timing"]["steps"])
    race = stages["race"]["steps"]["test_race_overlapped_equals_serial_in_bf16[cpu]"]["result"]
    assert any(r["hit_rate"] for r in race) and all(r["tau_equal"] for r in race)
    assert stages["race"]["steps"]["test_race_check_fails_on_a_broken_hand_off[cpu]"]["outcome"] == "passed"
    assert stages["async_sync"]["steps"]["test_async_sync_agree_as_the_dtype_allows[cpu-float32]"]["outcome"] == "passed"
    joint = [t["result"]["joint_tv"] for n, t in stages["sampling"]["steps"].items() if "joint" in n]
    assert len(joint) == 3 and all(v < 0.06 for v in joint)
    assert stages["engine"]["steps"]["test_engine_flex_block_mask_equals_dense_sdpa"]["outcome"] == "skipped"
    assert stages["readiness"]["problems"] == [] and "projection" in stages["readiness"]["steps"]
    failed = {k: v.get("error") or v.get("tail") for k, v in stages.items() if v["status"] == "failed"}
    assert not failed and report["ok"] and report["skipped"] == [], failed
    train = stages["train"]["result"]
    assert len(train["losses"]) == 4 and train["finite"] and train["falling"]


def test_the_gpu_tests_and_their_runner_import_without_hydra():
    """The GPU image has no Hydra, OmegaConf, datasets or DeepSpeed: in a process where importing
    any of them fails (tests/gpu_machine.py), the gpu tests collect (their conftest files included)
    and the runner's module imports (--help)."""
    import re
    import subprocess
    import sys

    from tests.conftest import ROOT

    # -p no:hydra_pytest: here Hydra is installed and pytest would load its plugin; there it is not
    proc = subprocess.run([sys.executable, "tests/gpu_machine.py", "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                           "-p", "no:cacheprovider", "-p", "no:hydra_pytest", "tests/integration/test_gpu.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and re.search(r"\b52/\d+ tests collected", proc.stdout), \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "tests/gpu_machine.py", "scripts/gpu_check.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--budget-s" in proc.stdout, proc.stderr[-2000:]
