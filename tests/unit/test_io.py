"""Output folders: one writer at a time, readers count each key once, damaged rows are named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from d3d.utils.io import CorruptFile, FolderBusy, lock_folder, read_jsonl
from tests.conftest import ROOT, compose

HOLD = ("import sys, time\nsys.path.insert(0, {src!r})\nfrom d3d.utils.io import lock_folder\n"
        "lock = lock_folder({folder!r}, 'holder')\nprint('held', flush=True)\ntime.sleep(60)\n")


@pytest.fixture
def held(tmp_path):
    """Another process holding tmp_path/out (as a running job would); yields (folder, its pid)."""
    folder = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(src=str(ROOT / "src"), folder=str(folder))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc.pid
    proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_naming_the_holder(held):
    folder, pid = held
    with pytest.raises(FolderBusy, match=rf"in use by another .* run \(pid {pid} .*choose another output folder"):
        lock_folder(folder, "d3d.eval")


def test_the_lock_goes_with_its_holder(tmp_path):
    with lock_folder(tmp_path, "a"):
        with pytest.raises(FolderBusy):
            lock_folder(tmp_path, "b")
    lock_folder(tmp_path, "b").release()  # released on exit; a killed holder's flock dies with it too


@pytest.mark.parametrize("job, key", [("generate", "generate.out_dir"), ("eval", "eval.out_dir"),
                                      ("train", "train.out_dir"), ("prune", "prune.out_dir")])
def test_every_job_refuses_a_folder_in_use_before_writing(held, tmp_path, job, key):
    import importlib

    folder, pid = held
    run = getattr(importlib.import_module(f"d3d.{job}"), f"run_{job}")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(FolderBusy, match=f"pid {pid}"):
        run(compose(job, ["+experiment=smoke", f"{key}={folder}"], tmp_path))
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def test_readers_count_each_key_once(tmp_path):
    """Folders written by two writers before locks existed: each row counts once."""
    from d3d.data.responses import read_responses
    from d3d.report import read_rows

    resp = {"id": "p1", "prompt_ids": [1], "response_ids": [2]}
    for name in ("responses.rank0.jsonl", "responses.rank1.jsonl"):
        (tmp_path / name).write_text(json.dumps(resp) + "\n" + json.dumps({**resp, "id": "p2"}) + "\n")
    assert [r["id"] for r in read_responses(tmp_path)] == ["p1", "p2"]
    row = {"benchmark": "gsm8k", "id": "1", "turn": 0, "method": "ar", "concurrency": 1}
    (tmp_path / "rows.jsonl").write_text((json.dumps(row) + "\n") * 2 + json.dumps({**row, "method": "sync"}) + "\n")
    assert [r["method"] for r in read_rows(tmp_path)] == ["ar", "sync"]


def test_a_damaged_line_is_named_with_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2, oops\n{"a": 3}\n{"a": 4')  # line 2 damaged; the torn tail is a kill
    with pytest.raises(CorruptFile, match=rf"{path}:2 is not a JSON row.*Fix"):
        list(read_jsonl(path))
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]


def test_published_appears_whole_or_not_at_all(tmp_path):
    """The cache writers' one write-then-rename: `dest` appears only when the block finishes."""
    import pytest

    from d3d.utils.io import published

    dest = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with published(dest) as tmp:
            tmp.mkdir()
            (tmp / "half").write_text("x")
            raise RuntimeError("killed mid-write")
    assert not dest.exists() and (tmp_path / "entry.partial").exists()  # the leftover is not the entry
    with published(dest) as tmp:  # the next writer starts from a clean partial
        assert not tmp.exists()
        tmp.mkdir()
        (tmp / "whole").write_text("y")
    assert sorted(p.name for p in dest.iterdir()) == ["whole"] and not (tmp_path / "entry.partial").exists()
