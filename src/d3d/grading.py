"""Task-level checks: is an answer right? Used to show losslessness at the task level (docs/design.md, Evaluation).

At T = 0 a lossless method returns the AR tokens, so its verdicts must equal AR's; a verdict that
differs is a bug even if the token comparison were somehow fooled. Cheap checks only:
- math (GSM8K, MATH-500, AIME): the final answer (\\boxed{...}, "####", "answer is", else the last
  number) compared with the reference after light normalisation;
- code (HumanEval, MBPP): the completion's code run against the benchmark's tests in a separate
  Python process with a time limit (never in this process: model output is untrusted code).
Other benchmarks (MT-Bench, LiveCodeBench, Alpaca) get `None`: no cheap reference check exists.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any, Callable

from d3d.config import ConfigError
from d3d.data.benchmarks import Record
from d3d.specs import BenchmarkSpec


# ---------------------------------------------------------------------------- math answers


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The model's final answer: boxed, then '####', then 'answer is', then the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1]
            num = NUMBER.search(tail)
            if num:
                return num.group(0)
    nums = NUMBER.findall(text)
    return nums[-1] if nums else None


def normalise_answer(ans: str) -> str:
    """Strip LaTeX dressing, units of formatting, and trailing zeros so '1,000.0' == '1000'."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|\s)", "", s)
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace(" ", "").replace("\\%", "").replace("%", "").rstrip(".")
    if re.fullmatch(r"-?[\d,]*\.?\d+", s):
        s = format(Decimal(s.replace(",", "")).normalize(), "f")
    return s


def math_correct(text: str, reference: str | None) -> tuple[str | None, bool | None]:
    if reference is None:
        return None, None
    answer = extract_answer(text)
    if answer is None:
        return None, False
    return answer, normalise_answer(answer) == normalise_answer(str(reference))


# ---------------------------------------------------------------------------- code execution

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The fenced code blocks of a reply, joined; the whole reply when it has none (or an unclosed one)."""
    blocks = CODE_BLOCK.findall(text)
    if blocks:
        return "\n\n".join(blocks)
    if "```" in text:  # cut off before the closing fence
        return text.split("```", 1)[1].split("\n", 1)[-1]
    return text


# How graded code runs (docs/design.md#contract-10). Model output is untrusted code, but it is written by a
# language model answering a benchmark, not by an attacker: the aim is that an honest mistake or a
# careless program (an endless loop, a fork, a huge allocation, `sys.exit(0)` before its tests, a
# stray `rm`) cannot hurt the host, outlive its time limit, or be graded correct. It is NOT a
# security sandbox for hostile code: a program that sets out to escape (reads the evidence pipe,
# calls setsid from outside a PID namespace, exploits the kernel) may succeed. Layers:
#   - always: a fresh `python -I`, its own session (process group) killed whole on timeout and after
#     it exits, and by a guardian process if the grader itself dies mid-grade (killed eval: the
#     program and its temporary directory go too); resource limits (address space, CPU seconds,
#     file size, open files, processes); stdin closed; stdout/stderr into files whose size the
#     file-size limit caps (only their tails are read back); cwd, HOME and TMPDIR in a temporary
#     directory;
#   - as root: the program runs as uid and gid `nobody` with no supplementary groups, no_new_privs,
#     and one capability, CAP_DAC_READ_SEARCH (it reads the interpreter wherever it is installed,
#     under /root say; reading was never contained). So, namespaces or not, it cannot write root's
#     files or signal the grader, and RLIMIT_NPROC binds it; its directory is chowned to it;
#   - where `unshare` is permitted (root, or user namespaces): new network namespace (no network,
#     not even the host's localhost), new PID namespace (the grader and every other process are
#     invisible to kill(); when the program exits the kernel kills whatever it left behind), and a
#     new mount namespace in which every mount is read-only but the temporary directory.
# `isolation()` says which layers this machine gives (probed once per process, through the real
# chain); `run_python` uses it to choose the chain, and d3d.eval records it in run.json and warns
# in one line when the namespaces are missing.
# A pass needs exit status 0 AND the per-call sentinel that the runner prints after the program
# returned: exiting early (sys.exit(0), os._exit(0), a killed interpreter) is a failure.

_BOOT = r"""
import ctypes, os, sys
path, work, fs, evidence, run_as = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if fs == "readonly":
    # Private mount namespace (unshare --mount): keep the work dir writable, make the rest read-only.
    libc = ctypes.CDLL(None, use_errno=True)
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
    KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,  # locked flags must be restated
            "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    if libc.mount(work.encode(), work.encode(), None, MS_BIND, None) != 0:
        sys.exit("d3d grading: cannot bind the work dir")
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5]) for line in f]
    for point, opts in mounts:
        point = point.replace("\\040", " ")
        if point == work:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts.split(","):
            flags |= KEEP.get(o, 0)
        libc.mount(None, point.encode(), None, flags, None)  # a mount that refuses stays as it was
    os.chdir(work)  # the cwd still pointed into the mount under the bind, now read-only
if run_as != "-":
    # Root: the program becomes uid/gid `run_as` (nobody), with no supplementary groups, before its
    # code runs, so it cannot write root's files or signal the grader (there may be no namespaces to
    # stop it), and RLIMIT_NPROC binds it. It keeps one capability, CAP_DAC_READ_SEARCH, so it still
    # reads the interpreter and its modules wherever they are installed (under /root, mode 0700, say):
    # reading was never contained. no_new_privs: a set-uid binary it runs does not make it root again.
    class Head(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Caps(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    uid = int(run_as)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: the permitted set survives setresuid, to be cut below
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        dropped = True
    except OSError:  # a container without CAP_SETUID: it stays root, which isolation() reports (never a failed grade)
        dropped = False
    if dropped:
        head, caps = Head(0x20080522, 0), (Caps * 2)()  # _LINUX_CAPABILITY_VERSION_3; every other capability dropped
        caps[0].effective = caps[0].permitted = 1 << 2  # CAP_DAC_READ_SEARCH
        libc.capset(ctypes.byref(head), caps)
os.set_inheritable(evidence, False)  # children of the program do not get the pipe
sys.argv = [path]
with open(path, encoding="utf-8") as f:
    code = compile(f.read(), path, "exec")
exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
# Only now, after the program returned normally, is the sentinel read and shown.
sentinel = os.read(evidence, 64)
sys.stdout.flush()
os.write(1, b"\n" + sentinel + b"\n")
"""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one graded program (per process; processes counted per user)."""

    memory_mb: int = 2048  # address space: HumanEval/MBPP solutions need tens of MB
    file_mb: int = 16  # largest file it may write, its captured output included
    processes: int = 64  # beyond those its user already runs (as root: real uid nobody, see above)
    open_files: int = 256


NOBODY = 65534  # the real uid a root grader's programs run with, so that RLIMIT_NPROC binds them


def _unshare_prefix(as_root: bool) -> list[str]:
    base = ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child"]
    return base if as_root else base[:1] + ["--map-root-user"] + base[1:]


_PROBE = """import json, os, socket, sys
s = socket.socket(); s.settimeout(1)
try:
    s.connect(('127.0.0.1', 9)); net = 'shared'
except ConnectionRefusedError:
    net = 'shared'
except OSError:
    net = 'unshared'
outside = sys.argv[0].rsplit('/', 2)[0]  # the directory above its own: read-only only under a private mount
fs = 'readonly' if os.statvfs(outside).f_flag & os.ST_RDONLY else 'writable'
caps = int(next(l for l in open('/proc/self/status') if l.startswith('CapEff')).split()[1], 16)
uid, mapped = os.getuid(), False  # the kernel counts the uid outside a user namespace (--map-root-user)
for line in open('/proc/self/uid_map'):
    inner, outer, count = map(int, line.split())
    if inner <= uid < inner + count and (inner, outer) != (0, 0):
        uid, mapped = outer + uid - inner, True
        break
binds = uid != 0 and (mapped or not caps & (1 << 21 | 1 << 24))  # a user namespace's caps do not lift it
print(json.dumps({"network": net, "filesystem": fs, "pids": "namespace" if os.getpid() == 1 else "shared",
                  "uid": uid, "euid": os.geteuid(), "nproc_binds": binds}))
"""


@functools.lru_cache(maxsize=1)
def isolation() -> dict:
    """Which layers this machine gives graded code, found by running a probe through the real chain:
    it tries to reach the network and to write outside its directory, and reports whether the
    process limit binds it. d3d.eval records this dict in run.json."""
    facts = {"session": True, "rlimits": True, "guardian": True, "namespaces": None, "network": "shared",
             "pids": "shared", "filesystem": "writable", "processes": "unknown", "effective_uid": None,
             "limits": asdict(Limits())}
    chains = [(_unshare_prefix(os.geteuid() == 0), "readonly"), (_unshare_prefix(False), "readonly")]
    for prefix, fs in [*(chains if shutil.which("unshare") else []), ([], "writable")]:
        try:
            ok, out = _run_contained(_PROBE, 10.0, Limits(), prefix, fs)
            seen = json.loads(out.strip().splitlines()[-1]) if ok else None
        except (OSError, ValueError, IndexError):
            continue
        if seen:
            facts.update(namespaces=prefix or None, network=seen["network"], filesystem=seen["filesystem"],
                         pids=seen["pids"], effective_uid=seen["euid"],
                         processes=(f"RLIMIT_NPROC for real uid {seen['uid']}" if seen["nproc_binds"] else
                                    "unlimited (root with CAP_SYS_ADMIN/CAP_SYS_RESOURCE: RLIMIT_NPROC does not bind)"))
            break
    return facts


def isolation_warning(facts: dict) -> str | None:
    """One line for a machine that gives graded code less than the full isolation, else None."""
    missing = [what for what, ok in [("a network namespace", facts["network"] == "unshared"),
                                     ("a PID namespace", facts["pids"] == "namespace"),
                                     ("read-only mounts", facts["filesystem"] == "readonly"),
                                     ("a process limit", facts["processes"].startswith("RLIMIT"))] if not ok]
    if not missing:
        return None
    euid = facts.get("effective_uid")  # a record from before the field: as the grader's own user
    euid = os.geteuid() if euid is None else euid
    user = "root" if euid == 0 else "this user" if euid == os.geteuid() else f"uid {euid}"
    # another uid without CAP_KILL (root's programs run as nobody) cannot signal the grader
    signals = "a PID namespace" in missing and euid == os.geteuid()
    return (f"graded code runs without {', '.join(missing)} here (unshare {'missing or refused' if not facts['namespaces'] else 'partial'}): "
            f"it can {'use the network, ' if 'a network namespace' in missing else ''}"
            f"{f'write files as {user}, ' if 'read-only mounts' in missing else ''}"
            f"{'signal the grader, ' if signals else ''}"
            f"{'fork without bound, ' if 'a process limit' in missing else ''}"
            f"and keeps its time, memory and file-size limits (run.json records what it had)")


def _preexec(limits: Limits, timeout_s: float, extra_processes: int):
    def apply() -> None:
        cap = lambda which, value: resource.setrlimit(which, (value, value))
        cap(resource.RLIMIT_AS, limits.memory_mb << 20)
        cap(resource.RLIMIT_CPU, int(math.ceil(timeout_s)) + 1)  # a busy grandchild dies on its own too
        cap(resource.RLIMIT_FSIZE, limits.file_mb << 20)
        cap(resource.RLIMIT_NOFILE, limits.open_files)
        cap(resource.RLIMIT_CORE, 0)
        cap(resource.RLIMIT_NPROC, extra_processes + limits.processes)
    return apply


def _user_processes(uid: int) -> int:
    """Processes whose real uid is `uid` now: RLIMIT_NPROC counts them all, not only the program's."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    n += next(int(line.split()[1]) for line in f if line.startswith("Uid:")) == uid
            except (OSError, StopIteration, ValueError):
                pass
    return n


# The guardian: one small process per grading process, in a session of its own. The grader tells it
# each program's process group and temporary directory as it starts it and forgets it when done;
# when its stdin closes without that (the grader was killed mid-grade), it kills what is left and
# removes the directories. Without it a killed eval left its graded programs running (reparented
# to init) and their directories behind. Its stdin's write end is only the grader's (close-on-exec).
_GUARD = r"""
import os, shutil, signal, sys, time
live = {}
for line in sys.stdin:
    op, pgid, tmp = line.rstrip("\n").split(" ", 2)
    if op == "+":
        live[pgid] = tmp
    else:
        live.pop(pgid, None)
for pgid, tmp in live.items():
    try:
        os.killpg(int(pgid), signal.SIGKILL)
        deadline = time.time() + 5
        while time.time() < deadline:
            os.killpg(int(pgid), 0)  # ProcessLookupError once the group is empty
            time.sleep(0.02)
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)
"""
_guardian: subprocess.Popen | None = None
_guardian_lock = threading.Lock()


def _guard(line: str) -> None:
    global _guardian
    with _guardian_lock:
        if _guardian is None or _guardian.poll() is not None:
            _guardian = subprocess.Popen([sys.executable, "-I", "-c", _GUARD], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                         start_new_session=True)  # not in the terminal's group: Ctrl-C reaches the grader only
            atexit.register(_release_guardian, _guardian)
        _guardian.stdin.write(line + "\n")
        _guardian.stdin.flush()


def _release_guardian(proc: subprocess.Popen) -> None:
    """At a normal exit nothing is registered: closing its stdin ends it."""
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _tail(path: str, n: int = 4000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode("utf-8", "replace")


def _run_contained(program: str, timeout_s: float, limits: Limits, prefix: list[str], fs: str) -> tuple[bool, str]:
    """One program through `prefix` (an unshare command line, or nothing); (passed, stdout or error tail)."""
    with tempfile.TemporaryDirectory(prefix="d3d-grade-") as tmp:
        work = os.path.join(os.path.realpath(tmp), "work")  # the program's world; tmp itself holds what it must not touch
        os.mkdir(work)
        path = os.path.join(work, "check.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        sentinel = secrets.token_hex(16).encode()
        read_end, write_end = os.pipe()
        os.write(write_end, sentinel)
        os.close(write_end)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        run_as = NOBODY if os.geteuid() == 0 else None  # root runs nothing as root (see _BOOT)
        if run_as is not None:  # its directory is the one place it may write
            os.chown(work, run_as, run_as)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
            try:
                proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", _BOOT, path, work, fs, str(read_end),
                                         "-" if run_as is None else str(run_as)], cwd=work,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                        pass_fds=(read_end,), start_new_session=True,
                                        preexec_fn=_preexec(limits, timeout_s,
                                                            _user_processes(os.getuid() if run_as is None else run_as)))
            finally:
                os.close(read_end)
            _guard(f"+ {proc.pid} {tmp}")  # its session id is its pid (start_new_session)
            try:
                code = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            code = proc.wait()
        stdout, stderr = _tail(out_path), _tail(err_path)
        flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= limits.file_mb << 20
    _guard(f"- {proc.pid} -")  # its group is dead and its directory removed: nothing left to guard
    if timed_out:
        return False, "timeout"
    if flooded or code == -signal.SIGXFSZ:  # Python ignores SIGXFSZ and raises "File too large" instead
        return False, f"output or a file over {limits.file_mb} MB"
    if code != 0:
        return False, stderr or f"exit status {code}"
    if not stdout.endswith("\n" + sentinel.decode() + "\n"):
        return False, "exited before its tests finished (status 0 without the runner's evidence)"
    return True, stdout[: -len(sentinel) - 2]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the program's whole process group (its session): forks and spawned commands too."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(program: str, timeout_s: float, limits: Limits | None = None) -> tuple[bool, str]:
    """Run a program contained (see above); (passed, the error tail when it failed)."""
    facts = isolation()
    prefix = facts["namespaces"] or []
    ok, out = _run_contained(program, timeout_s, limits or Limits(), prefix, "readonly" if prefix else "writable")
    return ok, "" if ok else out


def humaneval_program(record: Record, text: str) -> str:
    ref = record.reference
    code = extract_code(text)
    # A reply that restates the function is complete; else it is the body after the prompt.
    body = code if f"def {ref['entry_point']}" in code else ref["prompt"] + code
    return f"{body}\n\n{ref['test']}\n\ncheck({ref['entry_point']})\n"


def mbpp_program(record: Record, text: str) -> str:
    ref = record.reference
    return "\n".join([ref.get("setup") or "", extract_code(text), *ref["tests"]]) + "\n"


# ---------------------------------------------------------------------------- one entry point


# How a code benchmark's tests become a program, by its parser (`spec.loader`): the test format is
# the parser's. A code benchmark without one (LiveCodeBench: stdin tests) is not checked.
PROGRAMS: dict[str, Callable[[Record, str], str]] = {"humaneval": humaneval_program, "mbpp": mbpp_program}

UNCHECKED = {"answer": None, "correct": None}


def grade_math(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float) -> dict[str, Any]:
    answer, ok = math_correct(text, record.reference)
    return {"answer": answer, "correct": ok}


def grade_code(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float) -> dict[str, Any]:
    program = PROGRAMS.get(spec.loader)
    if program is None:
        return dict(UNCHECKED)
    ok, err = run_python(program(record, text), timeout_s)
    return {"answer": None, "correct": ok, **({} if ok else {"error": err.strip().splitlines()[-1:]})}


# Graders by `spec.kind` (conf/benchmark/<name>.yaml): a new benchmark of a known kind is graded with
# no code change; a new kind is one function here.
GRADERS: dict[str, Callable[..., dict[str, Any]] | None] = {"math": grade_math, "code": grade_code, "chat": None}


def grade(spec: BenchmarkSpec, record: Record, text: str, turn: int = 0,
          timeout_s: float = 10.0) -> dict[str, Any]:
    """{"answer": ..., "correct": True/False/None} for one reply (None: not checkable)."""
    if spec.kind not in GRADERS:
        raise ConfigError(f"benchmark.specs.{spec.name}.kind={spec.kind!r}: use {', '.join(GRADERS)}")
    grader = GRADERS[spec.kind]
    if grader is None or turn > 0 or record.reference is None:
        return dict(UNCHECKED)
    return grader(spec, record, text, timeout_s)
