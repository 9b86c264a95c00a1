"""scripts/gpu_readiness.py runs at toy size on CPU; its speedup projection matches a hand case."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_readiness")


def test_projection_hand_case(script):
    # AR 10 ms/token; verify 20 ms; draft 10 ms; τ = 4
    assert script.project(4, 0.0, 10, 20, 10, None, 0.0) == pytest.approx(40 / 30)  # sync: draft + verify
    # async, every round a hit, packed pass (15 ms) fully hidden behind verify: round = 20 ms
    assert script.project(4, 1.0, 10, 20, 10, 15, 1.0) == pytest.approx(2.0)
    # no overlap and half misses: 20 + 15 + 0.5 * 10 = 40 ms
    assert script.project(4, 0.5, 10, 20, 10, 15, 0.0) == pytest.approx(1.0)


def test_runs_at_toy_size_on_cpu(script, tmp_path):
    out = tmp_path / "gr.json"
    res = script.main(["--target", "toy", "--drafter", "toy", "--device", "cpu", "--dtype", "float32",
                       "--prefix", "32", "--block-size", "4", "--block-sizes", "1", "4", "--budgets", "2x1", "3x2",
                       "--hit-rate", "0.3", "0.6", "--loop-budget", "3x2", "--loop-tokens", "16", "--repeats", "1",
                       "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["verify_ms"]) == {"1", "4"} and set(saved["packed_ms"]) == {"2x1", "3x2"}
    assert [r["budget_tokens"] for r in res["projection"]] == [4, 4 * 3, 4 * 6]
    assert [r["hit_rate"] for r in res["projection"][1:]] == [0.3, 0.6]
    assert 0.0 <= res["overlap"] <= 1.0 and res["loop"]["rounds"] > 0
    assert all(r["projected_speedup"] > 0 for r in res["projection"])
