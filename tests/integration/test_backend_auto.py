"""d3d.eval with decode.backend=auto on the smoke setup: the run says in one line which backend auto
chose and why, before any model loads, and records it in run.json's notes, so in summary.md."""

from __future__ import annotations

import json

import pytest

from d3d.eval import run_eval
from tests.conftest import compose


@pytest.mark.heavy  # a whole eval (40 s on the loaded 2-core CPU): the default suite keeps the unit tests
def test_an_eval_with_auto_says_and_records_its_choice(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose("eval", ["+experiment=smoke", "benchmark=gsm8k", "eval.n=1", "eval.max_new_tokens=4",
                           "eval.methods=[ar,sync]", "decode.backend=auto", f"eval.out_dir={tmp_path}/ev"], tmp_path)
    out = run_eval(cfg)
    printed = capsys.readouterr().out
    said = "on a CPU auto is eager, the CPU default"
    assert f"[d3d.eval] decode.backend=auto: eager, {said}" in printed.splitlines()
    assert printed.index("decode.backend=auto") < printed.index("[d3d.eval] gsm8k")  # said before it decodes
    run = json.loads((out / "run.json").read_text())
    assert run["notes"][0] == f"decode.backend=auto chose eager: {said}"
    assert {m["backend"] for m in run["methods"].values()} == {"eager"}
    assert f"- decode.backend=auto chose eager: {said}" in (out / "summary.md").read_text()
