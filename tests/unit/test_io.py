"""Output folders: one writer at a time, readers count each key once, damaged rows are named."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from d3d.errors import ConfigError
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


@pytest.fixture
def no_flock(monkeypatch):
    """A filesystem without flock (Lustre mounted without `flock`, NFS without lockd): ENOLCK."""
    import errno
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_without_flock_a_lock_file_holds_the_folder(tmp_path, no_flock):
    """flock raised ENOLCK there and every job died at start: the O_EXCL lock file takes its place,
    names its holder, refuses a second writer and goes with its release."""
    import os
    import socket

    lock = lock_folder(tmp_path, "d3d.train", 1)
    held = tmp_path / ".lock.1.held"
    assert held.read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()}, d3d.train")
    with pytest.raises(FolderBusy, match=rf"pid {os.getpid()} .*if that run is dead, delete {held}"):
        lock_folder(tmp_path, "d3d.train", 1)
    lock.release()
    assert not held.exists()
    lock_folder(tmp_path, "d3d.train", 1).release()


def test_without_flock_a_dead_holders_file_is_taken_over_only_on_its_host(tmp_path, no_flock):
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that held the folder and died (killed: its file stayed)
    held = tmp_path / ".lock.0.held"
    held.write_text(f"pid {gone.pid} on {socket.gethostname()}, d3d.prune since then\n")
    lock_folder(tmp_path, "d3d.prune").release()  # taken over, then released
    assert not held.exists()
    held.write_text(f"pid {gone.pid} on another-node-17, d3d.prune since then\n")  # cannot be checked from here
    with pytest.raises(FolderBusy, match=rf"another-node-17.*delete {held}"):
        lock_folder(tmp_path, "d3d.prune")


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


FAULTY_WRITER = r"""
import json, resource, sys
from pathlib import Path
from d3d.utils.checkpoints import publish
from d3d.utils.io import JsonlWriter, write_json

out = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # what `ulimit -f 4` does; full disks fail the same way
big = "x" * 5000  # one row alone crosses the limit
failed = []
for name, write in [
    ("rows", lambda: JsonlWriter(out / "rows.jsonl").write([{"step": i, "pad": big} for i in (2, 3)])),
    ("summary", lambda: write_json(out / "summary.json", {"rows": 3, "pad": big * 2})),
    ("checkpoint", lambda: publish(out, "final", 2, lambda d: (d.mkdir(), (d / "model.safetensors").write_text(big * 2)))),
]:
    try:
        write()
    except OSError as err:
        failed.append((name, err.errno))
print(json.dumps(failed))
"""


def test_a_file_size_limit_mid_write_leaves_nothing_half_written_that_a_reader_trusts(tmp_path):
    """`ulimit -f` (and a full disk: the same EFBIG / ENOSPC from write) in the middle of a row, a summary
    and a checkpoint: the rows read back are the whole ones, the summary and final/ are the earlier ones
    (issue 38: observed so on the code as it was; this keeps it so)."""
    import errno

    from d3d.utils.checkpoints import publish, recover, saved_step
    from d3d.utils.io import JsonlWriter, write_json

    with JsonlWriter(tmp_path / "rows.jsonl") as w:
        w.write([{"step": 0}, {"step": 1}])
    write_json(tmp_path / "summary.json", {"rows": 2})
    publish(tmp_path, "final", 1, lambda d: (d.mkdir(), (d / "model.safetensors").write_text("w")))
    proc = subprocess.run([sys.executable, "-c", FAULTY_WRITER, str(tmp_path)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr
    failed = dict(json.loads(proc.stdout))
    assert failed == {"rows": errno.EFBIG, "summary": errno.EFBIG, "checkpoint": errno.EFBIG}, failed
    assert not (tmp_path / "rows.jsonl").read_text().endswith("\n")  # a torn row is on disk ...
    assert [r["step"] for r in read_jsonl(tmp_path / "rows.jsonl")] == [0, 1]  # ... and never read
    with JsonlWriter(tmp_path / "rows.jsonl") as w:  # the next writer cuts it and appends on a row boundary
        w.write([{"step": 2}])
    assert [r["step"] for r in read_jsonl(tmp_path / "rows.jsonl")] == [0, 1, 2]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"rows": 2}
    assert recover(tmp_path, "final") == tmp_path / "final" and saved_step(tmp_path / "final") == 1
    assert not (tmp_path / "final.partial").exists()


@pytest.mark.parametrize("line, problem", [
    (b'{"id": "caf\xe9"}\n', "is not UTF-8 text"),  # a Latin-1 byte in a complete line
    (b'[1, 2]\n', "is a JSON list, not an object"),
    (b'null\n', "is a JSON null, not an object"),
    (b'{"id": "p2", "prompt_ids": [1]}\n', "lacks the field(s) response_ids"),
])
def test_a_line_that_is_not_a_row_is_named_not_a_traceback(tmp_path, line, problem):
    """Responses, rows, steps and metrics files: each reader names the fields it indexes, so a bad
    complete line fails as one CorruptFile at its line (it was a UnicodeDecodeError, KeyError or
    TypeError). A bad torn tail is still a kill, and skipped."""
    from d3d.examples import load_examples
    from d3d.data.responses import read_responses

    good = json.dumps({"id": "p1", "prompt_ids": [1], "response_ids": [2]}).encode() + b"\n"
    path = tmp_path / "responses.rank0.jsonl"
    path.write_bytes(good + line + good)
    for read in (read_responses, lambda folder: load_examples(folder, max_len=8)):  # the jsonl and the Arrow cache
        with pytest.raises(CorruptFile, match=rf"{path}:2 {re.escape(problem)}.*Fix: repair or delete that line"):
            read(tmp_path)
    path.write_bytes(good + line.rstrip(b"\n"))  # the same bytes as a torn last line: a killed writer
    assert [r["id"] for r in read_responses(tmp_path)] == ["p1"]


def test_the_report_names_a_damaged_rows_file_in_one_line(tmp_path):
    from tests.unit.test_report import one_error_line, report, result_folder

    folder = result_folder(tmp_path / "run")
    with open(folder / "rows.jsonl", "ab") as f:
        f.write(b'{"benchmark": "gsm8k", "id": "\xff"}\n')
    one_error_line(report(folder), f"{folder / 'rows.jsonl'}:3 is not UTF-8", "Fix:")
    (folder / "rows.jsonl").write_text('{"benchmark": "gsm8k", "id": "gsm8k/0"}\n')
    one_error_line(report(folder), "rows.jsonl:1 lacks the field(s) method", "Fix:")


@pytest.mark.parametrize("job, key", [("generate", "generate.out_dir"), ("eval", "eval.out_dir"),
                                      ("train", "train.out_dir"), ("prune", "prune.out_dir")])
def test_every_job_refuses_another_kinds_folder(tmp_path, job, key):
    """train.out_dir at a finished prune folder replaced the pruned final/ with no word. A folder
    marked by another kind of job, or (from before the mark) holding its records, is refused
    before anything is written or loaded; its own kind's folder and an empty one are marked."""
    import importlib

    from d3d.utils.io import KIND_FILE, WrongFolder, job_folder

    run = getattr(importlib.import_module(f"d3d.{job}"), f"run_{job}")
    other = "eval" if job == "prune" else "prune"
    marked, old = tmp_path / "marked", tmp_path / "old"
    marked.mkdir()
    (marked / KIND_FILE).write_text(other + "\n")
    old.mkdir()
    (old / ("rows.jsonl" if other == "eval" else "steps.jsonl")).write_text("")
    for folder in (marked, old):
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(WrongFolder, match=rf"{key}=.*output folder of a d3d.{other} run.*Fix: set {key}"):
            run(compose(job, ["+experiment=smoke", f"{key}={folder}"], tmp_path))
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".lock")) == before
    fresh = tmp_path / "fresh"
    with job_folder(fresh, job, key):
        pass
    assert (fresh / KIND_FILE).read_text() == job + "\n"
    with job_folder(fresh, job, key):  # its own kind resumes
        pass


@pytest.mark.parametrize("job, key", [("generate", "generate.out_dir"), ("eval", "eval.out_dir"),
                                      ("train", "train.out_dir"), ("prune", "prune.out_dir")])
def test_every_job_refuses_an_output_path_that_is_a_file_in_one_line(tmp_path, job, key):
    """It was a FileExistsError / NotADirectoryError traceback from mkdir."""
    import importlib

    run = getattr(importlib.import_module(f"d3d.{job}"), f"run_{job}")
    file = tmp_path / "results"
    file.write_text("not a folder")
    for out in (file, file / "run"):
        with pytest.raises(ConfigError, match=rf"^{key}={out}: {file} is a file, not a folder. Fix: set {key}"):
            run(compose(job, ["+experiment=smoke", f"{key}={out}"], tmp_path))


@pytest.mark.parametrize("job, key", [("eval", "eval.out_dir"), ("train", "train.out_dir")])
def test_an_output_path_through_a_symlink_loop_is_one_line(tmp_path, job, key):
    """It was an OSError traceback (ELOOP) from Path.resolve, before the job named the key."""
    import importlib

    run = getattr(importlib.import_module(f"d3d.{job}"), f"run_{job}")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    out = tmp_path / "a" / "run"
    with pytest.raises(ConfigError, match=rf"^{key}={out} cannot be written \(Too many levels of symbolic links"):
        run(compose(job, ["+experiment=smoke", f"{key}={out}"], tmp_path))


READ_ONLY = ("import sys\nsys.path.insert(0, {src!r})\nfrom d3d.errors import ConfigError\n"
             "from d3d.utils.io import job_folder\n"
             "for out in ({folder!r}, {folder!r} + '/new'):\n"
             "    try:\n        with job_folder(out, 'train', 'train.out_dir'): print('written')\n"
             "    except ConfigError as err: print(err)\n")


def test_a_read_only_output_folder_is_one_line(tmp_path):
    """A read-only folder (permission bits for a user, a read-only mount for root, whom the bits do
    not stop: bubblewrap binds it read-only) was a PermissionError / OSError traceback."""
    import os
    import shutil

    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / ".lock.0").write_text("")  # an earlier run's lock file, which opens even in a read-only folder
    code = [sys.executable, "-c", READ_ONLY.format(src=str(ROOT / "src"), folder=str(folder))]
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif shutil.which("bwrap"):
        code = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(folder), str(folder), *code]
    else:
        pytest.skip("root without bubblewrap: no read-only folder to try")
    try:
        out = subprocess.run(code, capture_output=True, text=True, timeout=60)
    finally:
        folder.chmod(0o755)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 2, (out.stdout, out.stderr)
    assert lines[0].startswith(f"train.out_dir={folder} cannot be written") and "Fix: set train.out_dir" in lines[0]
    assert lines[1].startswith(f"train.out_dir={folder}/new cannot be written") and "Fix:" in lines[1]


def test_two_writers_of_one_json_file_never_share_a_temporary_file(tmp_path, monkeypatch):
    """Ranks all write meta.json: with one `meta.json.tmp` for every writer, a second writer that
    wrote it between the first one's write and rename published the first's file as its own and
    left the first a FileNotFoundError (or, mid-write, a torn file to publish)."""
    import os

    from d3d.utils.io import write_json

    path, real, calls = tmp_path / "meta.json", os.replace, []

    def replace(src, dst):
        calls.append(str(src))
        if len(calls) == 1:  # the other rank writes the same file just before this one publishes
            write_json(path, {"writer": "B"})
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    write_json(path, {"writer": "A", "pad": "x" * 1000})
    assert json.loads(path.read_text())["writer"] == "A" and len(set(calls)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]


def test_a_waiting_lock_without_flock_waits_for_the_holder(tmp_path, no_flock):
    """The lock every waiting lock of the project takes (cache builds, generate's report): without
    flock it used to go unlocked (caches) or fail with ENOLCK (the report); now its O_EXCL file
    holds it and a second taker waits until the holder lets go."""
    import threading
    import time

    from d3d.utils.io import FileLock, LockBusy, cache_lock

    held = tmp_path / "entry.lock.held"
    order = []
    with cache_lock(tmp_path / "entry"):
        assert held.is_file()
        with pytest.raises(LockBusy) as busy:
            FileLock(tmp_path / "entry.lock", wait=False)
        assert busy.value.held_file == held

        def second():
            with FileLock(tmp_path / "entry.lock", "second"):
                order.append("second")

        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)
        order.append("first done")
    waiter.join(10)
    assert order == ["first done", "second"] and not held.exists()


def test_a_folder_in_use_names_the_job_that_holds_it(tmp_path):
    """An eval refused by a running train's lock said "in use by another d3d.eval run": the job named
    was the one refused, not the holder."""
    with lock_folder(tmp_path, "d3d.train"):
        with pytest.raises(FolderBusy, match=r"in use by another d3d.train run \(pid \d+ on .*, d3d.train since") as err:
            lock_folder(tmp_path, "d3d.eval")
    assert "d3d.eval" not in str(err.value)
