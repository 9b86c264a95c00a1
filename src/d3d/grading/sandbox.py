"""Where graded code runs (docs/design.md#contract-10), and the refusal where it cannot.

Model output is untrusted code: it runs in a sandbox built on bubblewrap (`bwrap`, Flatpak's sandbox;
docs/reliability.md says why this tool), with fresh user, PID, network, IPC, UTS and mount namespaces,
its own /proc, no capabilities, a seccomp filter, and a filesystem of only the Python runtime
(read-only: the interpreter, its standard library and the shared libraries `ldd` names) and a scratch
tmpfs of `Limits.disk_mb` as its cwd and HOME. It runs as uid 65534 on the host too: a root grader
stages the runtime paths others cannot reach (an interpreter under a 0700 /root) into a private mount
namespace (util-linux `unshare --mount`), then starts bwrap as nobody (`setpriv`), so the kernel's
process count binds it (it never binds uid 0). No cgroup is created (a shared machine's or a cluster
job's hierarchy is not the grader's to change): the tree's budget is per-process limits times a
process count, set inside its user namespace, where RLIMIT_NPROC counts only the tree (see `Limits`).
A timeout kills bwrap's process group; --die-with-parent and the PID namespace take every process of
the tree with it. What runs inside is one Python program (d3d.grading.verdict's harness); this module
knows nothing of answers and tests.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

from d3d.errors import ConfigError

SANDBOXES = ("bwrap", "unsafe_subprocess")  # eval.sandbox: the second runs graded code unsandboxed
NOBODY = 65534  # the uid graded code has inside its sandbox and, for a root grader, on the host


@dataclass(frozen=True)
class Limits:
    """The budget of one graded program's whole process tree."""

    memory_mb: int = 2048  # address space of the tree: each process gets memory_mb // processes
    processes: int = 4  # processes and threads of the tree, the harness included
    file_mb: int = 16  # largest file it may write, its captured output included
    disk_mb: int = 64  # its scratch directory in all (a tmpfs of this size; memory too, so the tree
    #                    holds at most memory_mb + disk_mb)
    open_files: int = 256


@dataclass(frozen=True)
class Ran:
    """How a program ended in the sandbox."""

    code: int  # its exit status (negative: the signal)
    said: str  # what it wrote on the verdict pipe
    stderr: str  # the tail of its standard error
    timed_out: bool
    flooded: bool  # output or a file reached Limits.file_mb


# System calls the sandbox refuses (EPERM), each by its kernel objects: the harness uses none of them.
# - memory no rlimit of the sandbox counts (RLIMIT_AS counts mappings; these hold pages unmapped or in
#   the kernel): memfd files, System V shared memory kept after detaching, System V semaphore sets
#   (32000 semaphores a set) and message queues (`ipc` is their multiplexer where it exists), POSIX
#   message queues, io_uring's rings, and the kernel keyring's payloads;
# - reach into another process of the tree (the verdict's twin, d3d.grading.verdict): ptrace, reads and
#   writes of another process's memory, taking another process's descriptors;
# - kernel interfaces no graded program needs: userfaultfd, bpf, perf events.
DENIED_SYSCALLS = ("memfd_create", "memfd_secret", "shmget", "semget", "msgget", "ipc", "mq_open",
                   "io_uring_setup", "add_key", "request_key", "keyctl",
                   "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
                   "userfaultfd", "bpf", "perf_event_open")
SECCOMP_MISSING = "libseccomp not found"
SECCOMP_FIX = ("install libseccomp (`apt-get install -y libseccomp2`), which builds the sandbox's system-call "
               "filter, or set eval.sandbox=unsafe_subprocess to grade without a sandbox.")
BWRAP_FIX = ("install bubblewrap (`make setup` does, or `apt-get install -y bubblewrap`) and allow unprivileged user "
             "namespaces (sysctl user.max_user_namespaces=15000; on Ubuntu 24.04 "
             "kernel.apparmor_restrict_unprivileged_userns=0), or set eval.sandbox=unsafe_subprocess "
             "to grade without a sandbox.")


def check_sandbox(sandbox: str) -> None:
    if sandbox not in SANDBOXES:
        raise ConfigError(f"eval.sandbox={sandbox!r}: no such sandbox. Fix: set eval.sandbox=bwrap (or "
                          f"eval.sandbox=unsafe_subprocess to grade without one).")


def _tools() -> dict[str, str | None]:
    """The programs the bwrap chain starts, by name: their paths, None where missing."""
    names = ("bwrap", "ldd", *(("unshare", "setpriv", "sh", "mount") if os.geteuid() == 0 else ()))
    return {name: shutil.which(name) for name in names}


def refuse_if_unavailable(sandbox: str) -> None:
    """One line naming the fix where `sandbox` cannot start here (a tool or libseccomp missing)."""
    check_sandbox(sandbox)
    if sandbox != "bwrap":
        return
    missing = [name for name, path in _tools().items() if path is None]
    if missing:
        raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({', '.join(missing)} not found). "
                          f"Fix: {BWRAP_FIX}")
    if _seccomp_filter() is None:
        raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({SECCOMP_MISSING}). "
                          f"Fix: {SECCOMP_FIX}")


@functools.lru_cache(maxsize=1)
def _runtime() -> tuple[str, tuple[str, ...]]:
    """The interpreter and the host paths it needs: its standard library, extension modules and the
    shared libraries `ldd` names for them (found, not assumed: a venv's or pyenv's Python works)."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    paths, objects = {python, sysconfig.get_path("stdlib")}, [python]
    dynload = sysconfig.get_config_var("DESTSHARED") or ""  # the extension modules' folder
    if os.path.isdir(dynload):
        paths.add(dynload)
        objects += [os.path.join(dynload, f) for f in sorted(os.listdir(dynload)) if f.endswith(".so")]
    out = subprocess.run([_tools()["ldd"], *objects], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith("/") and os.path.exists(word) and not word.endswith(":"):
            paths.add(word)
    paths.update(p for p in ("/etc/ld.so.cache",) if os.path.exists(p))
    return python, tuple(sorted(paths))


@functools.lru_cache(maxsize=1)
def _seccomp_filter() -> bytes | None:
    """The BPF program bwrap loads (`--seccomp FD`), compiled by libseccomp for this machine's
    architecture (other architectures' system calls are killed); None where libseccomp is missing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("seccomp")
    if not name:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    context = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW by default
    try:
        for syscall in DENIED_SYSCALLS:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number < 0:  # __NR_SCMP_ERROR: no such call on this architecture (ipc on x86-64)
                continue
            if lib.seccomp_rule_add(context, 0x00050000 | errno.EPERM, number, 0) != 0:  # SCMP_ACT_ERRNO(EPERM)
                raise OSError(f"libseccomp refused a rule for {syscall}")
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(context, f.fileno()) != 0:
                raise OSError("libseccomp could not export the filter")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(context)


def _open_to_all(path: str) -> bool:
    """Whether any user can read `path` (every folder above it searchable by others)."""
    parts = path.split("/")
    folders = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    need = 0o005 if os.path.isdir(path) else 0o004  # others may read it (and enter it)
    try:
        return all(os.stat(d).st_mode & 0o001 for d in folders) and os.stat(path).st_mode & need == need
    except OSError:
        return False


def _bwrap_argv(program: str, limits: Limits, stage: str | None, seccomp_fd: int) -> list[str]:
    """The command line that starts `program` in bwrap; `stage`: a root grader's staging folder;
    `seccomp_fd`: a descriptor open on the filter (_seccomp_filter). Every tool by its full path: the
    chain runs with an environment of LANG alone."""
    python, paths = _runtime()
    tools = _tools()
    binds, mounts = [], []
    for i, path in enumerate(paths):
        source = path
        if stage and not _open_to_all(path):  # root: bound into a private mount namespace for nobody to reach
            source = os.path.join(stage, str(i))
            if os.path.isdir(path):
                os.mkdir(source)
            else:
                open(source, "w").close()
            mounts += [path, source]
        binds += ["--ro-bind", source, path]
    sandbox = [tools["bwrap"], "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
               "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd), *binds,
               "--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb << 20), "--tmpfs", "/scratch",
               "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/scratch", "--clearenv",
               "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch", "--setenv", "LANG", "C.UTF-8",
               "--", python, "-I", "-c", program]
    if not stage:
        return sandbox
    stage_mounts = f'set -e; while [ "$1" != -- ]; do {tools["mount"]} --bind "$1" "$2"; shift 2; done; shift; exec "$@"'
    return [tools["unshare"], "--mount", "--propagation", "private", "--", tools["sh"], "-c", stage_mounts, "sh",
            *mounts, "--", tools["setpriv"], f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *sandbox]


def _preexec(limits: Limits, timeout_s: float, nproc: int | None):
    def apply() -> None:
        cap = lambda which, value: resource.setrlimit(which, (value, value))
        cap(resource.RLIMIT_AS, (limits.memory_mb // limits.processes) << 20)
        cap(resource.RLIMIT_CPU, int(math.ceil(timeout_s)) + 1)  # a busy grandchild dies on its own too
        cap(resource.RLIMIT_FSIZE, limits.file_mb << 20)
        cap(resource.RLIMIT_NOFILE, limits.open_files)
        cap(resource.RLIMIT_CORE, 0)
        if nproc is not None:
            cap(resource.RLIMIT_NPROC, nproc)
    return apply


def _user_processes(uid: int) -> int:
    """Processes whose real uid is `uid` now (unsafe_subprocess: RLIMIT_NPROC counts them all)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    n += next(int(line.split()[1]) for line in f if line.startswith("Uid:")) == uid
            except (OSError, StopIteration, ValueError):
                pass
    return n


def _tail(path: str, n: int = 4000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode("utf-8", "replace")


def run_program(program: str, job: Callable[[int, int], bytes], timeout_s: float, limits: Limits,
                sandbox: str = "bwrap") -> Ran:
    """Run the Python source `program` in `sandbox` with `job(verdict_fd, nproc)` on its stdin: the
    descriptor it reports on, and the processes it may allow itself (RLIMIT_NPROC, set from inside)."""
    refuse_if_unavailable(sandbox)
    read_end, write_end = os.pipe()
    # bwrap's own init is pid 1 of the namespace: one more than the tree's budget. Unsandboxed, the
    # count is this user's, so the processes the user already runs are added.
    nproc = limits.processes + (1 if sandbox == "bwrap" else _user_processes(os.getuid()))
    stdin = job(write_end, nproc)
    with tempfile.TemporaryDirectory(prefix="d3d-grade-") as tmp:
        os.chmod(tmp, 0o755)  # a root grader's staging folder is read by nobody's bwrap
        passed = [write_end]
        if sandbox == "bwrap":
            stage = None
            if os.geteuid() == 0:
                stage = os.path.join(tmp, "stage")
                os.mkdir(stage)
            with open(os.path.join(tmp, "seccomp.bpf"), "wb") as f:
                f.write(_seccomp_filter())
            passed.append(os.open(os.path.join(tmp, "seccomp.bpf"), os.O_RDONLY))
            argv = _bwrap_argv(program, limits, stage, passed[-1])
            # Nothing of the grader's environment or paths: the chain's processes (bwrap's init is pid 1
            # inside) show theirs in /proc/<pid>/environ.
            cwd, env = "/", {"LANG": "C.UTF-8"}
        else:
            cwd = os.path.join(tmp, "scratch")
            os.mkdir(cwd)
            argv = [sys.executable, "-I", "-c", program]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                                        pass_fds=passed, start_new_session=True,
                                        preexec_fn=_preexec(limits, timeout_s, None if sandbox == "bwrap" else nproc))
            finally:
                for fd in passed:
                    os.close(fd)
            try:
                try:
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            code = proc.wait()
            os.set_blocking(read_end, False)  # a process that left the tree may still hold the write end
            try:
                said = os.read(read_end, 4096).decode("utf-8", "replace")
            except BlockingIOError:
                said = ""
            finally:
                os.close(read_end)
        flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= limits.file_mb << 20
        return Ran(code, said, _tail(err_path), timed_out, flooded or code == -signal.SIGXFSZ)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group: bwrap, and with it (--die-with-parent) its PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# The isolation probe: the uid graded code gets, on the verdict pipe.
_WHO = "import json, os, sys\nos.write(json.loads(sys.stdin.read())['fd'], str(os.getuid()).encode())\n"


@functools.lru_cache(maxsize=None)
def isolation(sandbox: str = "bwrap") -> dict:
    """What graded code gets with `sandbox`, for run.json; bwrap is tried once through the real chain,
    and where it cannot run here, grading refuses in one line naming the fix."""
    check_sandbox(sandbox)
    limits = Limits()
    facts = {"sandbox": sandbox, "limits": asdict(limits),
             "tree_memory_mb": limits.memory_mb + (limits.disk_mb if sandbox == "bwrap" else 0)}
    if sandbox == "unsafe_subprocess":
        return facts | {"user": os.geteuid(), "network": "host", "filesystem": "host (as this user)"}
    refuse_if_unavailable(sandbox)
    ran = run_program(_WHO, lambda fd, nproc: f'{{"fd": {fd}}}'.encode(), 30.0, limits)
    if ran.said != str(NOBODY):
        why = ran.stderr.strip().splitlines()[-1:] or [f"exit status {ran.code}"]
        raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({why[0]}). Fix: {BWRAP_FIX}")
    version = subprocess.run([_tools()["bwrap"], "--version"], capture_output=True, text=True).stdout.strip()
    return facts | {"bwrap": version, "user": NOBODY, "network": "none",
                    "filesystem": "python runtime (read-only), scratch tmpfs", "seccomp_denies": list(DENIED_SYSCALLS)}


def isolation_warning(facts: dict) -> str | None:
    """One line for grading without a sandbox, else None."""
    if facts["sandbox"] != "unsafe_subprocess":
        return None
    return ("eval.sandbox=unsafe_subprocess: graded code runs unsandboxed, as this user: it can read and write "
            "this user's files, use the network and signal the grader (run.json records it)")
