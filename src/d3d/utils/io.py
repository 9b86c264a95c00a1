"""Append-only jsonl files that survive a kill: a torn last line is dropped, never misread.
One writer per output folder (`lock_folder`); readers drop duplicate keys anyway (`unique`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator

from d3d.errors import ConfigError


class CorruptFile(ConfigError):
    """A results or weights file that cannot be read; the message names the file (and line)."""


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Complete rows of a jsonl file; a torn final line (killed writer) is skipped. A bad line
    anywhere else is not a kill but damage: it fails naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break  # written partially when the process died
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorruptFile(f"{path}:{number} is not a JSON row ({err.msg}). Fix: repair or delete that "
                                      f"line (rows after it are kept), or delete the file to redo its rows.") from None


def unique(rows: Iterable[dict], key: Callable[[dict], Hashable]) -> list[dict]:
    """The first row of each key, in order: a folder that two writers shared (before folders were
    locked) or a resumed run that re-logged a step must not count a row twice."""
    seen, out = set(), []
    for row in rows:
        k = key(row)
        if k not in seen:
            seen.add(k)
            out.append(row)
    return out


class FolderBusy(ConfigError):
    """Another live process writes into this output folder."""


class FolderLock:
    """An exclusive flock on `<folder>/.lock.<rank>`, held while this object lives (the kernel
    drops it when the process dies, so a killed run never leaves a stale lock). Each process of a
    multi-process job holds its own rank's lock; a second job into the folder meets rank 0's."""

    def __init__(self, folder: str | Path, job: str, rank: int = 0):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f".lock.{rank}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise FolderBusy(f"{folder} is in use by another {job or 'd3d'} run ({holder}); two writers would "
                             f"duplicate or interleave its rows. Fix: wait for it, stop it, or choose another "
                             f"output folder.") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}, {job} since "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: str | Path, job: str, rank: int = 0) -> FolderLock:
    return FolderLock(folder, job, rank)


def repair_tail(path: str | Path) -> None:
    """Cut a torn final line so that appending continues on a clean row boundary."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


class JsonlWriter:
    """Appends rows and flushes them to disk batch by batch."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def published(dest: str | Path) -> Iterator[Path]:
    """`with published(dest) as tmp:` write a file or folder at `tmp` (dest's `.partial` sibling);
    it is renamed to `dest` only when the block ends without an error, so a killed job never leaves
    a half-written file or folder at `dest` (the one write-then-rename of the cache writers)."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    yield tmp
    tmp.rename(dest)
