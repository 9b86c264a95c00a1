"""d3d.pipeline: the four stages wired together on the smoke setup (the routing of overrides per stage
is in tests/unit/test_pipeline.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import d3d.pipeline
from d3d.pipeline import main
from d3d.utils.io import read_jsonl
from tests.conftest import CACHE_DIR

HELD_GB = 0.4


def generate_holding_memory(cfg, **kwargs):
    """The generate stage, holding HELD_GB more memory while it runs (imported by the stage's own process)."""
    from d3d.generate import run_generate

    held = b"\x01" * int(HELD_GB * 2**30)  # written, so resident
    out = run_generate(cfg, **kwargs)
    assert held[-1] == 1
    return out


def test_pipeline_runs_every_stage_and_wires_the_drafters(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # generate holds 0.4 GB more than it needs: in one process that memory stayed counted in every later
    # stage's peak (11.5 -> 17.0 GB on the Qwen demo); each stage in its own process has its own peak
    monkeypatch.setitem(d3d.pipeline.RUNNERS, "generate", f"{__name__}:generate_holding_memory")
    args = ["+experiment=smoke", f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}", "eval.n=1",
            "eval.methods=[ar,sync]", "decode.block_size=4", "prune.min_retention=0"]
    main(args)
    record = json.loads(next((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json")).read_text())
    assert list(record["stages"]) == ["generate", "train", "prune", "eval"]
    stages = record["stages"].values()
    assert len({s["pid"] for s in stages} | {os.getpid()}) == 5  # a process of its own per stage
    peaks = {name: s["peak_rss_gb"] for name, s in record["stages"].items()}
    assert all(peaks["generate"] - peaks[s] > HELD_GB / 2 for s in ("train", "prune", "eval")), peaks
    assert record["peak_rss_gb"] == peaks["generate"] == max(peaks.values()) and record["peak_rss_unit"] == "GiB"
    train_out, prune_out, eval_out = (Path(record["stages"][s]["output"]) for s in ("train", "prune", "eval"))
    steps = list(read_jsonl(prune_out / "steps.jsonl"))
    assert [s["layers"] for s in steps] == [2, 1]  # started from the trained 2-layer drafter
    used = OmegaConf.load(eval_out / "config.yaml")
    assert Path(used.drafter.checkpoint) == prune_out / "final"  # eval measures the pruned drafter
    assert Path(used.eval.also_drafters.unpruned) == train_out / "final"  # beside the one it was pruned from
    assert {r["method"] for r in read_jsonl(eval_out / "rows.jsonl")} == {"ar", "sync", "sync@unpruned"}
    out = capsys.readouterr().out
    assert "| gsm8k | sync |" in out and "| gsm8k | sync@unpruned |" in out
    # a rerun of some stages resumes them (nothing is trained or decoded again; each stage's own
    # resumption is tested with its job, and every stage here costs a fresh interpreter), and
    # pipeline.json keeps the other stages' records (it used to hold only the last invocation's, so a
    # demo run stage by stage lost the earlier stages' times)
    rows_before = (eval_out / "rows.jsonl").read_text()
    metrics_before = (train_out / "metrics.jsonl").read_text()
    first = record
    main([*args, "--stages", "eval", "train"])
    assert (eval_out / "rows.jsonl").read_text() == rows_before
    assert (train_out / "metrics.jsonl").read_text() == metrics_before
    record = json.loads(next((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json")).read_text())
    assert record["peak_rss_gb"] == max(s["peak_rss_gb"] for s in record["stages"].values())
    assert [i["stages"] for i in record["invocations"]] == [["generate", "train", "prune", "eval"], ["train", "eval"]]
    assert list(record["stages"]) == ["generate", "train", "prune", "eval"]
    assert record["stages"]["prune"] == first["stages"]["prune"] and record["stages"]["eval"]["invocation"] == 2
    assert record["stages_wall_s"] == round(sum(v["wall_s"] for v in record["stages"].values()), 1)


def test_a_bad_setting_of_a_late_stage_fails_before_the_first_stage_runs(tmp_path, monkeypatch, capsys):
    """decode.block_size=0 belongs to eval, the last stage: it used to fail after generate, train and
    prune had run (~45 minutes on the CPU default), with a traceback. Now: one line, exit 2, nothing run."""
    with pytest.raises(SystemExit) as exit_:
        main(["+experiment=smoke", "decode.block_size=0", f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: decode.block_size=0: an integer in [2, 256]"), err
    assert not (tmp_path / "data" / "responses").exists()
    assert not list((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json"))  # no stage ran


def test_a_packed_pass_too_wide_for_the_device_fails_before_the_first_stage_runs(tmp_path, monkeypatch, capsys):
    """The pipeline's up-front check binds eval's decode settings and bounds their cost too: one line, nothing run."""
    with pytest.raises(SystemExit) as exit_:
        main(["+experiment=smoke", "decode.block_size=256", "decode.C=256", "decode.F=8", f"paths.root_dir={tmp_path}",
              f"paths.cache_dir={CACHE_DIR}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: decode.block_size=256 decode.C=256 decode.F=8 (method async"), err
    assert not (tmp_path / "data" / "responses").exists()
    assert not list((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json"))  # no stage ran


@pytest.mark.parametrize("override, message", [
    ("eval.enable_thinking=true", "error: eval.enable_thinking=true but the chat template of "),
    ("generate.enable_thinking=true", "error: generate.enable_thinking=true but the chat template of "),
    ("generate.backend=sglang", "error: generate.backend=sglang needs sglang, which is not installed"),
    ("generate.backend=tgi", "error: generate.backend='tgi' is not a backend. Fix: use one of hf, vllm, sglang."),
    ("eval.sandbox=nope", "error: eval.sandbox='nope': no such sandbox. Fix: set eval.sandbox=bwrap"),
    ("drafter.draft_vocab=1000", "error: drafter.draft_vocab=1000: a draft vocabulary holds the"),
])
def test_a_thinking_switch_or_an_engine_the_stage_cannot_use_fails_before_the_first_stage(tmp_path, monkeypatch, capsys,
                                                                                            override, message):
    """The up-front check bound generate's settings and eval's decode files only: eval.enable_thinking=true
    on a template without the switch failed when the eval stage started, after generate, train and prune
    had run; a missing or unknown engine when generate started (issue 38)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["+experiment=smoke", override, f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith(message) and "Fix:" in err[0], err
    assert not list((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json"))  # no stage ran
