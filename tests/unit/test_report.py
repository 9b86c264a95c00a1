"""`python -m d3d.report`: a folder that is missing or holds no rows is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def report(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "d3d.report", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def result_folder(path):
    path.mkdir()
    row = {"benchmark": "gsm8k", "id": "gsm8k/0", "turn": 0, "concurrency": 1, "new_tokens": 8, "decode_s": 0.1,
           "prefill_s": 0.01, "rounds": 4, "hit_rate": None, "equal_to_ar": True, "taus": [2, 2, 2, 2]}
    (path / "rows.jsonl").write_text("".join(json.dumps({**row, "method": m}) + "\n" for m in ("ar", "sync")))
    return path


def one_error_line(done, *phrases):
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr
    assert all(p in lines[0] for p in phrases), lines[0]


def test_compare_with_a_missing_folder_fails_in_one_line(tmp_path):
    """It used to print a table with an empty column and exit 0."""
    good = result_folder(tmp_path / "a")
    one_error_line(report("compare", good, tmp_path / "typo"), "typo: no such folder. Fix:")


def test_a_folder_where_nothing_ran_is_one_line(tmp_path):
    """A FileNotFoundError traceback before."""
    (tmp_path / "empty").mkdir()
    one_error_line(report(tmp_path / "empty"), "holds no rows*.jsonl: no d3d.eval run finished a row there", "Fix:")
    (tmp_path / "empty" / "rows.jsonl").write_text('{"benchmark": "gsm8k", "id"')  # killed mid-row
    one_error_line(report("compare", result_folder(tmp_path / "a"), tmp_path / "empty"), "with no finished row")


def test_a_good_folder_still_reports(tmp_path):
    done = report(result_folder(tmp_path / "a"))
    assert done.returncode == 0 and "| gsm8k | sync |" in done.stdout


def test_graded_answers_cut_at_max_new_tokens_are_said_in_the_summary():
    """The demo's items read accuracy 0.00 for every method: the answers were cut at 128 tokens. The
    summary says so, per method, instead of reporting it as the model's accuracy."""
    from d3d.report import summarise, summary_markdown

    row = {"benchmark": "gsm8k", "turn": 0, "concurrency": 1, "new_tokens": 8, "decode_s": 0.1, "prefill_s": 0.01,
           "rounds": 4, "hit_rate": None, "equal_to_ar": True, "taus": [2, 2, 2, 2]}
    rows = [{**row, "id": f"gsm8k/{i}", "method": m, "correct": i == 1, "finish_reason": "length" if i == 0 else "eos"}
            for m in ("ar", "sync") for i in range(2)]
    text = summary_markdown(summarise(rows))
    assert "gsm8k/sync: 1 of 2 graded answers stopped at eval.max_new_tokens" in text
    ungraded = [{**r, "correct": None} for r in rows]
    assert "stopped at eval.max_new_tokens" not in summary_markdown(summarise(ungraded))


def test_graded_answers_judged_inside_the_answer_are_counted_and_said():
    """Tests the grader cannot split into calls compared apart run in the answer's interpreter (where an
    answer could forge them): the summary counts those verdicts per method and says so."""
    from d3d.report import summarise, summary_markdown

    row = {"benchmark": "mbpp", "turn": 0, "concurrency": 1, "new_tokens": 8, "decode_s": 0.1, "prefill_s": 0.01,
           "rounds": 4, "hit_rate": None, "equal_to_ar": True, "taus": [2, 2, 2, 2], "correct": True}
    rows = [{**row, "id": f"mbpp/{i}", "method": m, "compared_apart": i != 0} for m in ("ar", "sync") for i in range(3)]
    summary = summarise(rows)
    assert summary["benchmarks"]["mbpp"]["sync"]["graded_in_answer"] == 1
    assert "mbpp/sync: 1 of 3 graded answers were judged by tests that ran in the answer's own interpreter" in \
        summary_markdown(summary)
    old = [{k: v for k, v in r.items() if k != "compared_apart"} for r in rows]  # rows written before the split
    assert summarise(old)["benchmarks"]["mbpp"]["sync"]["graded_in_answer"] == 0

def test_a_host_bound_row_is_flagged_in_the_summary():
    """Rows whose host spent most of each round issuing it (eager HF passes on a GPU: the device
    waited for the host) are flagged by method, so their speedup is not read as the method's; a
    device-bound row and a CPU row (no share measured) are not."""
    from d3d.report import summarise, summary_markdown

    row = {"benchmark": "gsm8k", "turn": 0, "concurrency": 1, "new_tokens": 8, "decode_s": 0.1, "prefill_s": 0.01,
           "rounds": 4, "hit_rate": None, "equal_to_ar": True, "taus": [2, 2, 2, 2]}
    share = {"ar": 0.97, "sync": 0.4, "async": None}
    rows = [{**row, "id": f"gsm8k/{i}", "method": m, "host_issue_share": s} for m, s in share.items() for i in range(2)]
    text = summary_markdown(summarise(rows))
    assert "gsm8k/ar: HOST-BOUND, the host spent 97% of its rounds" in text
    assert "gsm8k/sync: HOST-BOUND" not in text and "gsm8k/async: HOST-BOUND" not in text
