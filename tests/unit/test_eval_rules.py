"""d3d.eval's and d3d.report's rules on hand-made rows and keys, no model: the speedup formula and
which resume keys a folder accepts. Eval end to end is in tests/integration/test_eval.py."""

from __future__ import annotations

import json

import pytest

from d3d.report import summarise


def test_speedup_formula_hand_case():
    row = lambda method, i, tokens, decode_s, rounds, equal=True: {
        "benchmark": "b", "id": str(i), "turn": 0, "method": method, "new_tokens": tokens, "decode_s": decode_s,
        "rounds": rounds, "hit_rate": None, "prefill_s": 0.1, "equal_to_ar": equal}
    rows = [row("ar", 0, 10, 1.0, 10), row("ar", 1, 30, 3.0, 30), row("sync", 0, 10, 0.5, 4),
            row("sync", 1, 30, 1.0, 10, equal=False)]
    s = summarise(rows)["benchmarks"]["b"]
    # token-weighted TPOT: AR 4.0 s / 40 = 100 ms; sync 1.5 s / 40 = 37.5 ms -> 2.667x
    assert s["sync"]["speedup_token_weighted"] == pytest.approx(100 / 37.5)
    # prompt-weighted TPOT: AR 100 ms; sync mean(50, 33.3) = 41.67 ms -> 2.4x
    assert s["sync"]["speedup_prompt_weighted"] == pytest.approx(100 / ((50 + 100 / 3) / 2))
    assert s["sync"]["tau_token_weighted"] == pytest.approx(40 / 14)
    assert s["sync"]["equal_to_ar"] == 0.5
    # with prefill (0.1 s a row): AR 4.2 s / 40 = 105 ms; sync 1.7 s / 40 = 42.5 ms -> 2.47x
    assert s["sync"]["speedup_with_prefill"] == pytest.approx(105 / 42.5)
    # a killed run: AR finished a third item that sync did not reach; the speedup compares items 0-1 only
    partial = summarise(rows + [row("ar", 2, 10, 5.0, 10)])["benchmarks"]["b"]
    assert partial["sync"]["speedup_token_weighted"] == pytest.approx(100 / 37.5)
    assert partial["sync"]["speedup_items"] == 2 and partial["ar"]["rows"] == 3


def test_resume_check_allows_new_methods_refuses_changed_ones(tmp_path):
    from d3d.errors import ConfigError
    from d3d.eval import check_resumable

    key = {"target": "t", "max_new_tokens": 8, "methods": {"ar": {"block_size": 1}, "sync": {"block_size": 4}}}
    rows = [{"benchmark": "gsm8k", "id": "0", "turn": 0, "method": "ar"}]
    (tmp_path / "run.json").write_text(json.dumps({"resume_key": key}))
    check_resumable(tmp_path, key, rows)
    check_resumable(tmp_path, {**key, "methods": {**key["methods"], "async_c16_f5": {"block_size": 4}}}, rows)
    check_resumable(tmp_path, {**key, "methods": {"ar": {"block_size": 1}}}, rows)  # a subset of the methods
    with pytest.raises(ConfigError, match=r"\(methods\.sync\.block_size differ\)"):
        check_resumable(tmp_path, {**key, "methods": {**key["methods"], "sync": {"block_size": 8}}}, rows)
    with pytest.raises(ConfigError, match=r"\(max_new_tokens, target differ\)"):
        check_resumable(tmp_path, {**key, "target": "u", "max_new_tokens": 9}, rows)
