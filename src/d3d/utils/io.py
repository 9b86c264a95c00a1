"""Append-only jsonl files that survive a kill: a torn last line is dropped, never misread.
One writer per output folder (`lock_folder`); readers drop duplicate keys anyway (`unique`). Every
lock of the project is a `FileLock` (flock, or a lock file where the filesystem has none); a small
file that several processes may write is written whole under a temporary name of its own
(`write_text_atomic`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator

from d3d.errors import ConfigError


def resolve_path(value: str | os.PathLike) -> Path:
    """Config paths are relative to the directory the job was launched from. A path through a symlink
    loop is made absolute without resolving links: where it is read or written, the job names its key."""
    path = Path(os.path.expanduser(str(value)))
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # ELOOP (Python 3.11's resolve raises it; 3.13 returns the path)
        return Path(os.path.abspath(path))


class CorruptFile(ConfigError):
    """A results or weights file that cannot be read; the message names the file (and line)."""


def read_jsonl(path: str | Path, keys: tuple[str, ...] = ()) -> Iterator[dict]:
    """Complete rows of a jsonl file; a torn final line (killed writer) is skipped. A bad line
    anywhere else is not a kill but damage: it fails naming the file and the line. A complete line
    that is not UTF-8, not a JSON object, or lacks one of `keys` (the fields its reader indexes) is
    damage too: it fails here, with the line, not later as a KeyError far from the file."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # written partially when the process died
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                problem = f"is not UTF-8 text (byte {err.start + 1} of the line)"
            except json.JSONDecodeError as err:
                problem = f"is not a JSON row ({err.msg})"
            else:
                missing = [k for k in keys if k not in row] if isinstance(row, dict) else None
                if missing == []:
                    yield row
                    continue
                problem = (f"is a JSON {'null' if row is None else type(row).__name__}, not an object" if missing is None
                           else f"lacks the field(s) {', '.join(missing)}")
            raise CorruptFile(f"{path}:{number} {problem}. Fix: repair or delete that line (rows after it are "
                              f"kept), or delete the file to redo its rows.")


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


# flock's errors where the filesystem cannot lock (Lustre mounted without `flock`, NFS without lockd)
NO_FLOCK = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})


class LockBusy(Exception):
    """A lock taken without waiting is held: `holder` says by whom, `held_file` is the O_EXCL lock
    file to delete if that holder is dead on another host (None where flock holds it)."""

    def __init__(self, holder: str, held_file: Path | None):
        super().__init__(holder)
        self.holder, self.held_file = holder, held_file


class FileLock:
    """An exclusive lock on `path` between processes, held while this object lives: every lock of the
    project (one writer per output folder, one builder per cache entry, the report of a generation).

    Where the filesystem has flock: an exclusive flock on `path`, whose text names the holder; the
    kernel drops it when the process dies, so a killed run never leaves a stale lock. Where flock
    fails for want of support (NO_FLOCK), a lock file `<path>.held` made with O_CREAT|O_EXCL (atomic
    on local disks, NFSv3+ and Lustre) holding this host and pid, removed on release: exclusive among
    the processes that take this lock; a holder that died on this host (its pid is gone) is
    recognised and its file taken over; one that died on another host cannot be checked from here,
    so a refusal names the file to delete, and a waiter says once that it waits and for which file.
    Two processes taking over the same dead holder's file at the same instant could both hold it:
    the one race it leaves.

    `wait`: block until the lock is free; else raise LockBusy at once. `note`: what the holder does,
    written into the lock for whoever meets it."""

    def __init__(self, path: str | Path, note: str = "", wait: bool = True):
        self.path, self.note = Path(path), note
        self.held_file: Path | None = None  # the O_EXCL lock file, when flock is not there
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            self.release()
            raise LockBusy(holder, None) from None
        except OSError as err:
            if err.errno not in NO_FLOCK:
                raise
            self.release()
            self._take(self.path.with_name(self.path.name + ".held"), wait)
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, self._me().encode(), 0)

    def _me(self) -> str:
        return f"pid {os.getpid()} on {socket.gethostname()}, {self.note} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"

    def _take(self, path: Path, wait: bool) -> None:
        pause, said = 0.01, False
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = path.read_text(encoding="utf-8", errors="replace").strip() if path.exists() else ""
                if holder and _dead_here(holder):
                    path.unlink(missing_ok=True)
                    continue
                if not wait:
                    raise LockBusy(holder or "unknown", path) from None
                if not said:
                    print(f"[d3d] waiting for {path} ({holder or 'being written'}); if that run is dead, delete "
                          f"the file", file=sys.stderr, flush=True)
                    said = True
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._me())
            self.held_file = path
            return

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self.held_file is not None:
            self.held_file.unlink(missing_ok=True)
            self.held_file = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class FolderLock(FileLock):
    """One writer per output folder: a FileLock on `<folder>/.lock.<rank>`, not waited for. Each
    process of a multi-process job holds its own rank's lock; a second job into the folder meets
    rank 0's and is refused, naming the holder."""

    def __init__(self, folder: str | Path, job: str, rank: int = 0):
        self.folder = folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.job = job
        try:
            super().__init__(folder / f".lock.{rank}", job, wait=False)
        except LockBusy as busy:
            fix = f" (if that run is dead, delete {busy.held_file})" if busy.held_file else ""
            # the holder's job, from its note (it used to be this job's name: an eval refused by a
            # running train said "in use by another d3d.eval run")
            holder_job = re.search(r", (\S+) since ", busy.holder)
            raise FolderBusy(f"{folder} is in use by another {holder_job[1] if holder_job else 'd3d'} run "
                             f"({busy.holder}); two writers would duplicate or interleave its rows. Fix: wait for it, "
                             f"stop it, or choose another output folder{fix}.") from None


def _dead_here(holder: str) -> bool:
    """Whether a lock file's holder ("pid N on HOST, ...") was a process of this host that is gone."""
    words = holder.split()
    if len(words) < 4 or words[0] != "pid" or words[3].rstrip(",") != socket.gethostname():
        return False
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):  # alive under another user, or not a pid: not ours to judge
        return False
    return False


def lock_folder(folder: str | Path, job: str, rank: int = 0) -> FolderLock:
    return FolderLock(folder, job, rank)


# Each job marks its output folder with its kind, so that another job's output key pointed there
# (train.out_dir at a finished prune folder) is refused before it replaces that job's `final/`. A
# folder from before the mark is known by the record file only its kind writes.
KIND_FILE = ".d3d-job"
KIND_RECORDS = {"train": "metrics.jsonl", "prune": "steps.jsonl", "eval": "rows*.jsonl",
                "generate": "responses.rank*.jsonl"}


def folder_kind(folder: Path) -> str | None:
    """The kind of job whose output `folder` is (its mark, else its record file), or None."""
    mark = folder / KIND_FILE
    if mark.is_file():
        return mark.read_text(encoding="utf-8", errors="replace").strip() or None
    return next((kind for kind, pattern in KIND_RECORDS.items() if any(folder.glob(pattern))), None)


class WrongFolder(ConfigError):
    """An output folder that another kind of job made."""


def output_folder(folder: Path, key: str) -> None:
    """Make `folder` (config `key`), or fail in one line where it cannot be an output folder: a file
    stands at its path (or above it), or it cannot be written (permissions, a read-only mount)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(folder))
    except (FileExistsError, NotADirectoryError):
        file = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise ConfigError(f"{key}={folder}: {file} is a file, not a folder. Fix: set {key} to a folder, or move "
                          f"that file.") from None
    except OSError as err:
        raise _not_writable(folder, key, err) from None
    if not os.access(folder, os.W_OK | os.X_OK):  # checked: an existing lock file would open anyway
        raise _not_writable(folder, key, None)


def _not_writable(folder: Path, key: str, err: OSError | None) -> ConfigError:
    why = f" ({err.strerror}: {err.filename})" if err else ""
    return ConfigError(f"{key}={folder} cannot be written{why}. Fix: set {key} to a folder you can write, or make "
                       f"{folder} writable.")


@contextlib.contextmanager
def job_folder(folder: str | Path, kind: str, key: str, rank: int = 0) -> Iterator[FolderLock]:
    """The output folder of a `kind` job ("train", "prune", "eval", "generate"), set by config `key`:
    made (output_folder), locked (one writer), refused when another kind of job made it, marked with
    `kind` by rank 0. All before the job loads anything."""
    folder = Path(folder)
    output_folder(folder, key)
    try:
        lock = lock_folder(folder, f"d3d.{kind}", rank)
        found = folder_kind(folder)
        if found not in (None, kind):
            lock.release()
            raise WrongFolder(f"{key}={folder} is the output folder of a d3d.{found} run ({KIND_FILE} or its "
                              f"records say so); d3d.{kind} would write over its results. Fix: set {key} to "
                              f"another folder.")
        if rank == 0 and not (folder / KIND_FILE).is_file():
            write_text_atomic(folder / KIND_FILE, kind + "\n")
    except OSError as err:  # a filesystem may refuse what os.access allowed (NFS squashing root)
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise _not_writable(folder, key, err) from None
    with lock:
        yield lock


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


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `path` whole or not at all, as readers see it: written to a temporary name of this
    writer's own (so two processes writing the same file, ranks writing one meta.json, never write
    into one temporary file and publish each other's torn halves), then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the file it replaces was not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


@contextlib.contextmanager
def cache_lock(dest: str | Path) -> Iterator[None]:
    """`with cache_lock(dest): if dest is missing, build it (published)`: one builder of a cache entry
    at a time, across the jobs sharing the cache. Jobs started together on a fresh cache all saw the
    entry missing and built it at once into the one `.partial` sibling, each removing the others'
    (two failed, a stale `.partial` stayed); now the others wait, then find it built. A FileLock on
    `<dest>.lock` (with its lock-file fallback where the filesystem has no flock)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dest.with_name(dest.name + ".lock"), f"building {dest.name}"):
        yield


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
