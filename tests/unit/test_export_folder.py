"""d3d.export's folder: only what an export wrote is replaced, anything else is refused in one line
before the drafter loads, and the new export replaces the old one without a moment where a kill
leaves neither (faults injected between the steps of `publish`). No model is loaded here; the
export itself runs in tests/integration/test_export.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import d3d.export as export
from d3d.errors import ConfigError
from d3d.export import check_out_dir, publish


def an_export(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("export.json", "config.json", "model.safetensors", "tokenizer.json", "speculative_config.json"):
        (folder / name).write_text(f"{tag} {name}")
    return folder


def writer(tag: str, fail_after: str | None = None):
    def write(folder: Path) -> None:
        for name in ("config.json", "model.safetensors", "tokenizer.json", "speculative_config.json", "export.json"):
            (folder / name).write_text(f"{tag} {name}")
            if name == fail_after:
                raise KeyboardInterrupt  # a kill (Ctrl-C, or the last thing a SIGKILLed job did)
    return write


def tags(folder: Path) -> set[str]:
    return {p.read_text().split()[0] for p in folder.iterdir()}


class Killed(BaseException):
    pass


def test_a_folder_holding_anything_an_export_did_not_write_is_refused_and_kept(tmp_path):
    out = an_export(tmp_path / "served", "old")
    (out / "README.md").write_text("mine")
    (out / "results").mkdir()
    with pytest.raises(ConfigError, match=r"holds an export and also README.md, results/, which d3d.export did not "
                                          r"write.*Fix: move them out"):
        check_out_dir(out, tmp_path / "drafter")
    assert (out / "README.md").read_text() == "mine" and (out / "results").is_dir()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds something else than an export.*Fix:"):
        check_out_dir(plain, tmp_path / "drafter")
    check_out_dir(an_export(tmp_path / "clean", "old"), tmp_path / "drafter")  # an export alone: replaceable


@pytest.mark.parametrize("under", ["", "/inside"])
def test_an_out_dir_that_is_a_file_or_under_one_is_one_line(tmp_path, under):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=rf"export.out_dir=.*file{under}: .*file is a file, not a folder. Fix:"):
        check_out_dir(tmp_path / f"file{under}", tmp_path / "drafter")


def test_a_kill_while_writing_leaves_the_old_export_whole(tmp_path):
    out = an_export(tmp_path / "served", "old")
    with pytest.raises(KeyboardInterrupt):
        publish(out, writer("new", fail_after="model.safetensors"))
    assert tags(out) == {"old"} and len(list(out.iterdir())) == 5
    publish(out, writer("new"))  # the next export clears the half-written one and replaces the old
    assert tags(out) == {"new"} and sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_a_kill_after_the_swap_leaves_the_new_export_and_nothing_stale(tmp_path, monkeypatch):
    out = an_export(tmp_path / "served", "old")
    real = export.shutil.rmtree
    monkeypatch.setattr(export.shutil, "rmtree", lambda p, *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        publish(out, writer("new"))
    assert tags(out) == {"new"}
    monkeypatch.setattr(export.shutil, "rmtree", real)
    publish(out, writer("newer"))
    assert tags(out) == {"newer"} and sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_without_the_atomic_exchange_a_kill_between_the_renames_loses_nothing(tmp_path, monkeypatch):
    """On a filesystem without RENAME_EXCHANGE: old -> .previous, new -> out. Killed between the two,
    the next export puts the old one back before it starts."""
    out = an_export(tmp_path / "served", "old")

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "Invalid argument")

    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append((Path(a).name, Path(b).name))
        if len(calls) == 2:
            raise Killed()
        real_rename(a, b)

    monkeypatch.setattr(export, "exchange", no_exchange)
    monkeypatch.setattr(export.os, "rename", rename)
    with pytest.raises(Killed):
        publish(out, writer("new"))
    assert calls == [("served", "served.previous"), ("served.partial", "served")]
    assert tags(tmp_path / "served.previous") == {"old"}  # the old export whole, beside its place
    monkeypatch.setattr(export.os, "rename", real_rename)
    check_out_dir(out, tmp_path / "drafter")  # the leftover is recognised as an export
    with pytest.raises(KeyboardInterrupt):  # the next export put it back first, then was killed itself
        publish(out, writer("newer", fail_after="config.json"))
    assert tags(out) == {"old"}
    publish(out, writer("newer"))
    assert tags(out) == {"newer"} and sorted(p.name for p in tmp_path.iterdir()) == ["served"]


def test_an_export_into_a_new_folder_is_one_rename(tmp_path):
    publish(tmp_path / "a" / "served", writer("new"))
    assert tags(tmp_path / "a" / "served") == {"new"} and os.listdir(tmp_path / "a") == ["served"]
