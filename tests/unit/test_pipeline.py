"""d3d.pipeline's routing of overrides to its stages (no stage runs; the stages end to end are in
tests/integration/test_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from d3d.pipeline import earlier_record
from d3d.config import stage_overrides


def test_overrides_go_only_to_stages_that_have_the_key():
    ov = ["+experiment=smoke", "prune.num_layers=1", "eval.n=1", "seed=3", "target=tiny_random"]
    assert stage_overrides("generate", ov) == ["+experiment=smoke", "seed=3", "target=tiny_random"]
    assert stage_overrides("prune", ov) == ["+experiment=smoke", "prune.num_layers=1", "seed=3", "target=tiny_random"]
    assert "eval.n=1" in stage_overrides("eval", ov) and "prune.num_layers=1" not in stage_overrides("eval", ov)
    # prune composes only the training step's train.* keys (conf/training/): d3d.train's own stay with train
    ov = ["train.lr=1e-4", "train.warmup_steps=2"]
    assert stage_overrides("train", ov) == ov and stage_overrides("prune", ov) == ["train.lr=1e-4"]


def test_an_older_pipeline_record_becomes_its_first_invocation(tmp_path, capsys):
    """pipeline.json from before invocations were kept: its stages stay, as invocation 1; an
    unreadable one is moved aside, said in one line, never silently overwritten."""
    path = tmp_path / "pipeline.json"
    assert earlier_record(path) == {"stages": {}, "invocations": []}
    path.write_text(json.dumps({"overrides": ["+experiment=smoke"], "stages": {"train": {"wall_s": 5.0, "output": "t"}},
                                "wall_s": 6.0}))
    record = earlier_record(path)
    assert record["stages"] == {"train": {"wall_s": 5.0, "output": "t", "invocation": 1}}
    assert record["invocations"] == [{"overrides": ["+experiment=smoke"], "wall_s": 6.0, "stages": ["train"]}]
    path.write_text("{ cut")
    assert earlier_record(path) == {"stages": {}, "invocations": []}
    assert (tmp_path / "pipeline.unreadable.json").read_text() == "{ cut" and not path.exists()
    assert "could not be read" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["josé's d3d, run=1 [a]{b} back\\slash\\", "a ${x} b\\${y} c\\\\${z}"])
def test_a_root_with_any_characters_wires_the_stages(tmp_path, monkeypatch, name):
    """A checkout or root whose path holds `,` `=` quotes, brackets, a backslash, spaces or
    a non-ASCII letter: each stage reads the paths the pipeline wires to it as they are (they were
    pasted into overrides unquoted, and Hydra took them for a sweep, a list or a syntax error). A
    root holding `${` (OmegaConf's interpolation), with or without backslashes before it, too: it
    failed at binding, the resolved root read again as an interpolation."""
    from d3d.pipeline import stage_config, wire_stages
    from d3d.settings import bind_config

    root = tmp_path / name
    root.mkdir()
    monkeypatch.setenv("D3D_ROOT", str(root))
    ov = ["+experiment=smoke"]
    train_cfg, wiring = wire_stages(ov, ["train", "prune", "eval"])
    trained = str(Path(train_cfg.train.out_dir).resolve() / "final")
    assert trained.startswith(str(root))
    assert stage_config("prune", ov, wiring["prune"]).drafter.checkpoint == trained
    pruned = stage_config("eval", ov, wiring["eval"])
    assert pruned.drafter.checkpoint.startswith(str(root)) and pruned.drafter.checkpoint.endswith("final")
    assert pruned.eval.also_drafters.unpruned == trained
    bound = bind_config(stage_config("eval", ov, wiring["eval"]), "eval")
    assert bound.paths.root_dir == str(root) and bound.drafter.checkpoint == pruned.drafter.checkpoint


def stops_on_a_setting(cfg, **kwargs):
    from d3d.errors import ConfigError

    raise ConfigError("train.lr=-1: must be positive.\n Fix: set train.lr above 0.")


def is_killed(cfg, **kwargs):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("runner, code, line", [
    ("stops_on_a_setting", 2, "error: train.lr=-1: must be positive. Fix: set train.lr above 0."),
    ("is_killed", 1, "error: the train stage process was killed by signal SIGKILL (the kernel's out-of-memory killer"),
])
def test_a_stage_in_its_own_process_still_ends_in_one_line(tmp_path, monkeypatch, capsys, runner, code, line):
    """A stage runs in a process of its own: its user error comes back as the same one line (exit 2);
    a stage process that dies without a result (a signal, the OOM killer) is one line naming it (exit 1)."""
    import d3d.pipeline

    monkeypatch.setitem(d3d.pipeline.RUNNERS, "train", f"{__name__}:{runner}")
    with pytest.raises(SystemExit) as exit_:
        d3d.pipeline.main(["+experiment=smoke", f"paths.root_dir={tmp_path}", "--stages", "train"])
    assert exit_.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(line) and "Fix:" in err[-1], err
    assert not list((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json"))  # no stage recorded as done


def note(stage: str) -> str:
    """A stage that only notes, in the file $D3D_TEST_NOTES, that it ran."""
    import os

    with open(os.environ["D3D_TEST_NOTES"], "a") as f:
        f.write(stage + "\n")
    return os.environ["D3D_TEST_NOTES"]


def noted_train(cfg, **kwargs):
    return note("train")


def noted_prune(cfg, **kwargs):
    return note("prune")


def test_stages_run_in_the_pipelines_order_each_once(tmp_path, monkeypatch):
    """`--stages prune train` ran prune first, on a trained drafter not made yet; `train train` twice."""
    import d3d.pipeline

    notes = tmp_path / "notes"
    monkeypatch.setenv("D3D_TEST_NOTES", str(notes))
    for stage in ("train", "prune"):
        monkeypatch.setitem(d3d.pipeline.RUNNERS, stage, f"{__name__}:noted_{stage}")
    d3d.pipeline.main(["+experiment=smoke", f"paths.root_dir={tmp_path}", "--stages", "prune", "train", "train"])
    assert notes.read_text().split() == ["train", "prune"]


def test_overrides_after_stages_are_told_to_move_before_it(capsys):
    """`--stages train +experiment=...` reads every word after --stages as a stage: the one line says
    where the overrides go, not only that "+experiment=..." is no stage."""
    import d3d.pipeline

    with pytest.raises(SystemExit) as code:
        d3d.pipeline.main(["--stages", "train", "+experiment=smoke", "train.max_steps=2"])
    line = capsys.readouterr().err.strip()
    assert code.value.code == 2 and "\n" not in line, line
    assert "unknown stage(s) +experiment=smoke, train.max_steps=2" in line and "put the overrides before --stages" in line


def test_a_record_folder_that_cannot_be_made_is_one_line_before_any_stage(tmp_path, monkeypatch, capsys):
    """<paths.output_dir>/pipeline a file (or read-only): the record failed with a traceback after the
    first stage had run."""
    import d3d.pipeline

    monkeypatch.setenv("D3D_TEST_NOTES", str(tmp_path / "notes"))
    monkeypatch.setitem(d3d.pipeline.RUNNERS, "train", f"{__name__}:noted_train")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "pipeline").write_text("")
    with pytest.raises(SystemExit) as exit_:
        d3d.pipeline.main(["+experiment=smoke", f"paths.root_dir={tmp_path}", "--stages", "train"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: paths.output_dir=") and "is a file" in err[0], err
    assert not (tmp_path / "notes").exists()  # no stage ran


def test_a_record_path_that_is_a_folder_is_one_line(tmp_path):
    """pipeline.json a folder: the stage ran, then writing the record was an IsADirectoryError traceback."""
    from d3d.errors import ConfigError

    (tmp_path / "pipeline.json").mkdir()
    with pytest.raises(ConfigError, match=r"pipeline.json is a folder, not the pipeline's record. Fix: move it away"):
        earlier_record(tmp_path / "pipeline.json")


CHECK_HELD_GB = 0.3


def check_holding_memory(cfgs):
    """The up-front check, holding CHECK_HELD_GB more memory while it runs (as converting a GGUF does)."""
    from d3d.pipeline import check_stages

    held = b"\x01" * int(CHECK_HELD_GB * 2**30)  # written, so resident
    check_stages(cfgs)
    assert held[-1] == 1


def test_the_up_front_checks_peak_memory_is_in_the_record(tmp_path, monkeypatch):
    """On a fresh cache the up-front check is the process that first resolves the target, so the GGUF
    conversion (a whole fp32 model) peaks in it; its memory was in no record, and the run's peak_rss_gb
    counted the stages only."""
    import os

    import d3d.pipeline

    monkeypatch.setenv("D3D_TEST_NOTES", str(tmp_path / "notes"))
    monkeypatch.setattr(d3d.pipeline, "CHECK", f"{__name__}:check_holding_memory")
    monkeypatch.setitem(d3d.pipeline.RUNNERS, "train", f"{__name__}:noted_train")
    d3d.pipeline.main(["+experiment=smoke", f"paths.root_dir={tmp_path}", "--stages", "train"])
    record = json.loads(next((tmp_path / "outputs" / "pipeline").glob("*/pipeline.json")).read_text())
    check, train = record["invocations"][0]["check"], record["stages"]["train"]
    assert check["peak_rss_gb"] > CHECK_HELD_GB and check["pid"] not in (os.getpid(), train["pid"])
    assert record["peak_rss_gb"] == check["peak_rss_gb"] > train["peak_rss_gb"] + CHECK_HELD_GB / 2
