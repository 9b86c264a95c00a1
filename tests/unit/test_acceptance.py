"""The acceptance views of summary.json/md, the plots and `d3d.report compare` (d3d.acceptance), on
hand-built rows whose accept counts are known by construction."""

from __future__ import annotations

import json

from d3d.report import main, write_report

# block of 4: K = 3 draft positions. Request 0 accepts 3, 0, 1, 2 drafts (τ 4, 1, 2, 3) from a
# 100-token prompt; request 1 accepts 0, 0, 3 (τ 1, 1, 4) from a 126-token prompt, so its third
# round starts from 128 tokens, in the second context bucket.
TAUS = {"gsm8k/0": ([4, 1, 2, 3], 100), "gsm8k/1": ([1, 1, 4], 126)}


def rows(method: str, taus=TAUS) -> list[dict]:
    return [{"benchmark": "gsm8k", "id": i, "turn": 0, "concurrency": 1, "method": method, "prompt_tokens": p,
             "new_tokens": sum(t), "rounds": len(t), "taus": t, "decode_s": 0.1, "prefill_s": 0.01,
             "hit_rate": None, "equal_to_ar": True} for i, (t, p) in taus.items()]


def result_folder(path, taus=TAUS, block_size=4):
    path.mkdir()
    ar = {i: ([1] * sum(t), p) for i, (t, p) in taus.items()}
    lines = rows("ar", ar) + rows("sync", taus)
    (path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "run.json").write_text(json.dumps({"methods": {"ar": {"method": "ar"},
                                                           "sync": {"method": "sync", "block_size": block_size}}}))
    return path


def test_views_of_rows_with_known_accept_counts(tmp_path):
    summary = write_report(result_folder(tmp_path / "run"))
    sync = summary["benchmarks"]["gsm8k"]["sync"]
    # 7 rounds; accepted >= 1 in 4 of them, >= 2 in 3, >= 3 in 2
    assert sync["acceptance"]["cumulative"] == [4 / 7, 3 / 7, 2 / 7]
    assert sync["acceptance"]["conditional"] == [4 / 7, 3 / 4, 2 / 3]
    assert abs(1 + sum(sync["acceptance"]["cumulative"]) - sync["tau_token_weighted"]) < 1e-12  # 16 tokens / 7 rounds
    q = sync["tau_per_request"]  # τ 10/4 and 6/3
    assert (q["requests"], q["min"], q["p50"], q["max"]) == (2, 2.0, 2.25, 2.5)
    assert [(b["from"], b["to"], b["rounds"], b["requests"], b["tau"]) for b in sync["tau_by_context"]] == [
        (0, 128, 6, 2, 2.0), (128, 256, 1, 1, 4.0)]
    assert "acceptance" not in summary["benchmarks"]["gsm8k"]["ar"]  # AR drafts nothing
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())["benchmarks"]["gsm8k"]["sync"]
    assert saved["acceptance"]["cumulative"] == sync["acceptance"]["cumulative"]
    text = (tmp_path / "run" / "summary.md").read_text()
    assert "| gsm8k | sync | 2.29 | 0.57 0.43 0.29 | 0.57 0.75 0.67 | 2.05 / 2.25 / 2.45 |" in text
    assert "0–128: 2.00 (6), 128–256: 4.00 (1)" in text
    assert "acceptance.png" in summary["plots"] and (tmp_path / "run" / "acceptance.png").is_file()


def test_positions_follow_the_block_not_the_rounds(tmp_path):
    """A block of 6 whose rounds never accepted past 3 drafts still has 5 positions, the last ones 0;
    a position no round reached has no conditional rate."""
    sync = write_report(result_folder(tmp_path / "run", block_size=6))["benchmarks"]["gsm8k"]["sync"]
    assert sync["acceptance"]["cumulative"] == [4 / 7, 3 / 7, 2 / 7, 0.0, 0.0]
    assert sync["acceptance"]["conditional"][3:] == [0.0, None]


def test_compare_shows_two_runs_views_side_by_side(tmp_path, capsys):
    a = result_folder(tmp_path / "a")
    b = result_folder(tmp_path / "b", {"gsm8k/0": ([2, 2, 2, 2], 300), "gsm8k/1": ([1, 3], 40)})
    out = tmp_path / "compare.md"
    main(["compare", str(a), str(b), "--labels", "A", "B", "--out", str(out)])
    text = capsys.readouterr().out
    assert text.strip() == out.read_text().strip()
    assert "### gsm8k / sync" in text
    assert "| k | A cumulative | A conditional | B cumulative | B conditional |" in text
    # B: 6 rounds accepting 1, 1, 1, 1, 0, 2 drafts
    assert "| 1 | 0.57 | 0.57 | 0.83 | 0.83 |" in text and "| 3 | 0.29 | 0.67 | 0.00 | 0.00 |" in text
    assert "| p50 | 2.25 | 2.00 |" in text
    assert "| 256–512 | — | 2.00 (4) |" in text
