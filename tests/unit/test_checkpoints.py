"""Checkpoint markers (d3d.utils.checkpoints): a kill while writing one, or damage to one, never
blocks a resume with a traceback, and a checkpoint ahead of its job's record is refused."""

from __future__ import annotations

import json

import pytest

import d3d.utils.checkpoints as ck
from d3d.utils.io import CorruptFile
from tests.conftest import Killed, kill_on


def checkpoint(folder, step, marker: str | None = "whole"):
    folder.mkdir(parents=True)
    (folder / "weights").write_text(f"step {step}")
    if marker == "whole":
        ck.mark_complete(folder, step)
    elif marker is not None:
        (folder / ck.MARKER).write_text(marker)


@pytest.mark.parametrize("torn", ["", '{"st', "null\n", '{"step": "3"}\n'])
def test_a_torn_marker_in_last_partial_is_an_unfinished_save(tmp_path, torn):
    """Killed while writing last.partial's marker (as the old in-place write could be): the save is
    redone from last/, where a JSONDecodeError used to block every resume."""
    checkpoint(tmp_path / "last", 3)
    checkpoint(tmp_path / "last.partial", 6, marker=torn)
    assert ck.recover(tmp_path) == tmp_path / "last"
    assert ck.saved_step(tmp_path / "last") == 3 and not (tmp_path / "last.partial").exists()


def test_a_torn_marker_in_last_is_one_line_with_the_fix(tmp_path):
    """A promoted checkpoint had a whole marker; one unreadable now is damage: named, not resumed from
    (and not a JSONDecodeError)."""
    checkpoint(tmp_path / "last", 3, marker="")
    with pytest.raises(CorruptFile, match=r"last/COMPLETE is empty or torn .* Fix: delete .*last and rerun"):
        ck.recover(tmp_path)


def test_a_kill_while_marking_leaves_no_marker(tmp_path, monkeypatch):
    folder = tmp_path / "last.partial"
    checkpoint(folder, 6, marker=None)
    monkeypatch.setattr(ck.os, "fsync", kill_on(1, ck.os.fsync))
    with pytest.raises(Killed):
        ck.mark_complete(folder, 6)
    assert not (folder / ck.MARKER).exists()  # not an empty file that reads as "finished"
    monkeypatch.undo()
    ck.mark_complete(folder, 6)
    assert json.loads((folder / ck.MARKER).read_text()) == {"step": 6} and ck.saved_step(folder) == 6


def test_a_checkpoint_ahead_of_the_record_is_refused(tmp_path):
    record = tmp_path / "metrics.jsonl"
    ck.check_record_reaches(tmp_path / "last", 6, 6, record, "x")  # caught up: fine
    ck.check_record_reaches(tmp_path / "last", None, None, record, "x")  # an old checkpoint: not checked
    with pytest.raises(CorruptFile, match=r"now holds rows up to step 3: the checkpoint is ahead .* Fix: redo"):
        ck.check_record_reaches(tmp_path / "last", 6, 3, record, "redo")
    with pytest.raises(CorruptFile, match=r"now holds no rows"):
        ck.check_record_reaches(tmp_path / "last", 6, None, record, "redo")


def test_drafter_problem_sees_a_cut_save(tmp_path):
    """The load check for final/ folders written in place by older versions (no marker)."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"d3d": {"block_size": 4}}))
    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert ck.drafter_problem(tmp_path) is None
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    assert "model.safetensors is cut short" in ck.drafter_problem(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data)
    (tmp_path / "tokenizer.json").write_text('{"vers')
    assert "tokenizer.json is empty or torn" in ck.drafter_problem(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")  # a plain model, not a drafter
    assert "holds no d3d settings" in ck.drafter_problem(tmp_path)


def test_publish_replaces_a_folder_whole_or_not_at_all(tmp_path):
    checkpoint(tmp_path / "final", 0)

    def write(step, kill=False):
        def fill(folder):
            folder.mkdir()
            (folder / "weights").write_text("")  # a kill here is a half-written folder
            if kill:
                raise Killed
            (folder / "weights").write_text(f"step {step}")
        return fill

    with pytest.raises(Killed):
        ck.publish(tmp_path, "final", 1, write(1, kill=True))
    assert (tmp_path / "final" / "weights").read_text() == "step 0"  # the previous folder, untouched
    ck.publish(tmp_path, "final", 1, write(1))
    assert (tmp_path / "final" / "weights").read_text() == "step 1" and ck.saved_step(tmp_path / "final") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_drafter_folder_is_checked_before_its_shape_is_sized(tmp_path):
    """A plain model from another project given as the drafter was sized first and refused as a
    memory problem ("needs … GiB, lower decode.block_size"); a drafter folder with a torn
    tokenizer.json was a tokenizers traceback once the target had loaded. Both are now one line
    saying what the folder is, from the eval job's first check."""
    from d3d.errors import ConfigError
    from d3d.eval import run_eval
    from tests.conftest import compose

    plain = tmp_path / "other_project"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({  # a shape no machine holds
        "model_type": "llama", "hidden_size": 65536, "intermediate_size": 131072, "num_hidden_layers": 200,
        "num_attention_heads": 512, "num_key_value_heads": 8, "vocab_size": 256, "max_position_embeddings": 4096}))
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.json").write_text(json.dumps({"model_type": "llama", "d3d": {"block_size": 4}}))
    (torn / "tokenizer.json").write_text('{"version": "1.0", "mod')
    cases = ((plain, r"is a plain model \(its config.json has no d3d settings\), not a d3d drafter\. Fix"),
             (torn, r"drafter.checkpoint=.*torn: its tokenizer.json is empty or torn\. Fix: copy that file again"))
    for folder, message in cases:
        with pytest.raises(ConfigError, match=message):
            run_eval(compose("eval", ["+experiment=smoke", f"drafter.checkpoint={folder}"], tmp_path))
