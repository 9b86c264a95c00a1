"""d3d.eval end to end on the smoke setup: rows, MT-Bench turns, resume, summary from rows."""

from __future__ import annotations

import json

import pytest

from d3d.eval import run_eval, summarise
from d3d.utils.io import read_jsonl
from tests.conftest import compose

SMOKE = ["+experiment=smoke", "eval.n=2", "eval.max_new_tokens=12", "decode.C=3", "decode.F=2", "decode.block_size=4"]


def evaluate(tmp_path, *extra):
    cfg = compose("eval", SMOKE + [f"eval.out_dir={tmp_path}/ev", *extra], tmp_path)
    return run_eval(cfg)


def test_eval_gsm8k_and_mt_bench_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "benchmark=all")
    rows = list(read_jsonl(out / "rows.jsonl"))
    benches = {r["benchmark"] for r in rows}
    assert benches == {"gsm8k", "math500", "aime25", "humaneval", "mt_bench"}  # mbpp, livecodebench skipped
    mt = [r for r in rows if r["benchmark"] == "mt_bench"]
    assert {r["turn"] for r in mt} == {0, 1} and len(mt) == 2 * 2 * 3
    assert all(r["equal_to_ar"] for r in rows)  # greedy: every method returns the AR tokens
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["gsm8k"]["ar"]["speedup_token_weighted"] == pytest.approx(1.0)
    assert summary["benchmarks"] == json.loads(json.dumps(summarise(rows)["benchmarks"]))
    assert "| gsm8k | async |" in (out / "summary.md").read_text()


def test_resume_skips_finished_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.n=1")
    first = list(read_jsonl(out / "rows.jsonl"))
    out = evaluate(tmp_path, "eval.n=2")
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert rows[: len(first)] == first and len(rows) == 2 * len(first)
    assert len({(r["id"], r["method"]) for r in rows}) == len(rows)


def test_speedup_formula_hand_case():
    rows = [
        {"benchmark": "b", "method": "ar", "new_tokens": 10, "decode_s": 1.0, "rounds": 10, "hit_rate": None,
         "prefill_s": 0.1, "equal_to_ar": True},
        {"benchmark": "b", "method": "ar", "new_tokens": 30, "decode_s": 3.0, "rounds": 30, "hit_rate": None,
         "prefill_s": 0.1, "equal_to_ar": True},
        {"benchmark": "b", "method": "sync", "new_tokens": 10, "decode_s": 0.5, "rounds": 4, "hit_rate": None,
         "prefill_s": 0.1, "equal_to_ar": True},
        {"benchmark": "b", "method": "sync", "new_tokens": 30, "decode_s": 1.0, "rounds": 10, "hit_rate": None,
         "prefill_s": 0.1, "equal_to_ar": False},
    ]
    s = summarise(rows)["benchmarks"]["b"]
    # token-weighted TPOT: AR 4.0 s / 40 = 100 ms; sync 1.5 s / 40 = 37.5 ms -> 2.667x
    assert s["sync"]["speedup_token_weighted"] == pytest.approx(100 / 37.5)
    # prompt-weighted TPOT: AR 100 ms; sync mean(50, 33.3) = 41.67 ms -> 2.4x
    assert s["sync"]["speedup_prompt_weighted"] == pytest.approx(100 / ((50 + 100 / 3) / 2))
    assert s["sync"]["tau_token_weighted"] == pytest.approx(40 / 14)
    assert s["sync"]["equal_to_ar"] == 0.5


def test_eval_cli_writes_into_its_run_folder(tmp_path):
    import subprocess
    import sys

    from tests.conftest import CACHE_DIR, ROOT

    proc = subprocess.run([sys.executable, "-m", "d3d.eval", *SMOKE, "eval.n=1", f"paths.root_dir={tmp_path}",
                           f"paths.cache_dir={CACHE_DIR}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "eval" / "runs").glob("*/*/summary.md"))
    assert len(runs) == 1 and "| gsm8k | ar |" in runs[0].read_text()
