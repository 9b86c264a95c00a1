"""Task-level checks: is an answer right? Used to show losslessness at the task level (docs/design.md, Evaluation).

At T = 0 a lossless method returns the AR tokens, so its verdicts must equal AR's; a verdict that
differs is a bug even if the token comparison were somehow fooled. Cheap checks only:
- math (GSM8K, MATH-500, AIME): the final answer (\\boxed{...}, "####", "answer is", else the last
  number) compared with the reference after light normalisation;
- code (HumanEval, MBPP): the completion's code run against the benchmark's tests in a sandbox
  (bubblewrap) with a time limit (never in this process: model output is untrusted code).
Other benchmarks (MT-Bench, LiveCodeBench, Alpaca) get `None`: no cheap reference check exists.
"""

from __future__ import annotations

import ast
import errno
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
import sysconfig
import tempfile
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


# How graded code runs (docs/design.md#contract-10). Model output is untrusted code: it runs in a
# sandbox built on bubblewrap (`bwrap`, Flatpak's sandbox; docs/reliability.md says why this tool),
# with fresh user, PID, network, IPC, UTS and mount namespaces, its own /proc, no capabilities, and
# a filesystem of only the Python runtime (read-only: the interpreter, its standard library and the
# shared libraries `ldd` names) and a scratch tmpfs of `Limits.disk_mb` as its cwd and HOME. It runs
# as uid 65534 on the host too: a root grader stages the runtime paths others cannot reach (an
# interpreter under a 0700 /root) into a private mount namespace (util-linux `unshare --mount`),
# then starts bwrap as nobody (`setpriv`), so the kernel's process count binds it (it never binds
# uid 0). No cgroup is created (a shared machine's or a cluster job's
# hierarchy is not the grader's to change): the tree's budget is per-process limits times a process
# count, set inside its user namespace, where RLIMIT_NPROC counts only the tree (see `Limits`). A
# timeout kills bwrap's process group; --die-with-parent and the PID namespace take every process of
# the tree with it.
#
# Pass means the tests ran and passed. The answer must parse alone (a dangling decorator cannot
# swallow the tests); answer and tests reach the harness over stdin, never as a file; the tests run
# with builtins and modules as they were before the answer ran, and no value they get from a call
# or compare may be of a class the answer wrote (its `==` could say yes to anything); the
# verdict goes out on a pipe of its own, as a line carrying a per-run nonce the answer never sees on
# any file or descriptor. What a hostile answer can still do is in docs/reliability.md.

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


# The harness: the only code started in the sandbox. It reads {answer, tests, nonce, ...} from stdin
# to its end (stdin is then /dev/null), runs the answer, restores what the answer may have patched,
# runs the tests, and writes its verdict on fd `verdict` as "<nonce> pass" or "<nonce> fail <why>".
# It leaves by os._exit: the answer's atexit hooks and threads never run after the verdict.
_HARNESS = r"""
import builtins, json, os, resource, sys
def main():
    job = json.loads(sys.stdin.buffer.read())
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"],) * 2)  # in its user namespace: the tree alone
    verdict, nonce, tests = job.pop("verdict"), job.pop("nonce"), job.pop("tests")
    def say(line):
        os.write(verdict, (nonce + " " + line.replace("\n", " ")[:500] + "\n").encode())
        os._exit(0)
    pristine = dict(builtins.__dict__)
    before = {name: (m, dict(m.__dict__)) for name, m in list(sys.modules.items()) if type(m) is type(sys)}
    type_, id_, isinstance_, dict_, len_, repr_ = type, id, isinstance, dict, len, repr
    plain = {bool, int, float, complex, str, bytes, type(None)}
    nested = {list, tuple, set, frozenset}
    flags, module_of, name_of = (type.__dict__[k] for k in ("__flags__", "__module__", "__qualname__"))
    modules = sys.modules
    def trusted(t):
        # A class written in C, or one a module of the runtime defines under its own name (random.Random):
        # the answer can write a class with any __module__ and name, but not put it in that module's place.
        meta = type_(t)
        if meta is not type and not trusted(meta):
            return False
        if not flags.__get__(t) & (1 << 9):  # Py_TPFLAGS_HEAPTYPE: written in Python
            return True
        where, name = module_of.__get__(t), name_of.__get__(t)
        module = modules.get(where) if isinstance_(where, str) else None
        return (where != "__main__" and module is not None and isinstance_(getattr(module, "__file__", None), str)
                and dict_.get(module.__dict__, name) is t)
    def vet(value):
        # Any other class can define ==, - or bool to say yes to anything.
        stack, seen = [value], set()
        while stack and len_(seen) < 1000000:
            v = stack.pop()
            t = type_(v)
            if t in plain:
                continue
            if id_(v) in seen:
                continue
            seen.add(id_(v))
            if t in nested:
                stack.extend(v)
            elif t is dict_:
                stack.extend(dict_.keys(v))
                stack.extend(dict_.values(v))
            elif not trusted(t):
                raise AssertionError("the answer gave a " + repr_(name_of.__get__(t)) + " object, a class it wrote, "
                                     "whose == cannot be trusted: a plain value is expected")
        return value
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(job.pop("answer"), "<answer>", "exec"), namespace)
    except SystemExit:
        say("fail the answer exited before its tests ran")
    except BaseException as err:
        say("fail " + type_(err).__name__ + ": " + str(err))
    sys.settrace(None)
    sys.setprofile(None)
    for name in [n for n in sys.modules if n not in before]:
        del sys.modules[name]  # a module the answer imported is imported afresh by the tests
    for name, (module, saved) in before.items():
        sys.modules[name] = module
        for key in [k for k in module.__dict__ if k not in saved]:
            del module.__dict__[key]
        module.__dict__.update(saved)
    scope = {**namespace, "__builtins__": pristine, "__d3d_vet": vet}
    try:
        exec(compile(tests, "<tests>", "exec"), scope)
    except BaseException as err:
        say("fail " + type_(err).__name__ + ": " + str(err))
    say("pass")
main()
"""


class _Vetted(ast.NodeTransformer):
    """The tests with each call's result and each compared operand passed through the harness's `vet`."""

    @staticmethod
    def wrap(node: ast.expr) -> ast.expr:
        return ast.copy_location(ast.Call(ast.Name("__d3d_vet", ast.Load()), [node], []), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        return self.wrap(self.generic_visit(node))

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        node.left = self.wrap(node.left)
        node.comparators = [self.wrap(c) for c in node.comparators]
        return node


def vetted_tests(tests: str) -> str:
    return ast.unparse(ast.fix_missing_locations(_Vetted().visit(ast.parse(tests))))


def unparsable(answer: str) -> str | None:
    """Why the answer alone is not a complete program, or None."""
    try:
        ast.parse(answer)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return f"the answer is not a complete program on its own ({type(err).__name__}: {err})"
    return None


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
    out = subprocess.run(["ldd", *objects], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith("/") and os.path.exists(word) and not word.endswith(":"):
            paths.add(word)
    paths.update(p for p in ("/etc/ld.so.cache",) if os.path.exists(p))
    return python, tuple(sorted(paths))


# Kernel objects that hold memory no rlimit of the sandbox counts (RLIMIT_AS counts mappings; these keep
# their pages unmapped): memfd files, System V shared memory kept after detaching, POSIX message
# queues. A seccomp filter makes each fail with EPERM inside the sandbox; the harness uses none of them.
UNCOUNTED_MEMORY_SYSCALLS = ("memfd_create", "memfd_secret", "shmget", "mq_open")
SECCOMP_MISSING = "libseccomp not found"
SECCOMP_FIX = ("install libseccomp (`apt-get install -y libseccomp2`), which builds the sandbox's system-call "
               "filter, or set eval.sandbox=unsafe_subprocess to grade without a sandbox.")


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
        for syscall in UNCOUNTED_MEMORY_SYSCALLS:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number < 0:  # __NR_SCMP_ERROR: no such call on this architecture
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


def _bwrap_argv(limits: Limits, stage: str | None, seccomp_fd: int) -> list[str]:
    """The command line that starts the harness in bwrap; `stage`: a root grader's staging folder;
    `seccomp_fd`: a descriptor open on the filter (_seccomp_filter)."""
    python, paths = _runtime()
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
    sandbox = ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
               "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd), *binds,
               "--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb << 20), "--tmpfs", "/scratch",
               "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/scratch", "--clearenv",
               "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch", "--setenv", "LANG", "C.UTF-8",
               "--", python, "-I", "-c", _HARNESS]
    if not stage:
        return sandbox
    stage_mounts = 'set -e; while [ "$1" != -- ]; do mount --bind "$1" "$2"; shift 2; done; shift; exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", stage_mounts, "sh", *mounts, "--",
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *sandbox]


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


def check_sandbox(sandbox: str) -> None:
    if sandbox not in SANDBOXES:
        raise ConfigError(f"eval.sandbox={sandbox!r}: no such sandbox. Fix: set eval.sandbox=bwrap (or "
                          f"eval.sandbox=unsafe_subprocess to grade without one).")


def run_tests(answer: str, tests: str, timeout_s: float, limits: Limits | None = None,
              sandbox: str = "bwrap") -> tuple[bool, str]:
    """Run the answer, then the tests, in `sandbox` (see above); (passed, why it failed)."""
    limits = limits or Limits()
    why = unparsable(answer)
    if why:
        return False, why
    check_sandbox(sandbox)
    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    # bwrap's own init is pid 1 of the namespace: one more than the tree's budget. Unsandboxed, the
    # count is this user's, so the processes the user already runs are added.
    nproc = limits.processes + (1 if sandbox == "bwrap" else _user_processes(os.getuid()))
    job = json.dumps({"answer": answer, "tests": vetted_tests(tests), "nonce": nonce, "verdict": write_end,
                      "nproc": nproc})
    with tempfile.TemporaryDirectory(prefix="d3d-grade-") as tmp:
        os.chmod(tmp, 0o755)  # a root grader's staging folder is read by nobody's bwrap
        stage = None
        if sandbox == "bwrap" and os.geteuid() == 0:
            stage = os.path.join(tmp, "stage")
            os.mkdir(stage)
        scratch = os.path.join(tmp, "scratch")  # unsafe_subprocess: its cwd (bwrap: a tmpfs instead)
        os.mkdir(scratch)
        passed = [write_end]
        if sandbox == "bwrap":
            program = _seccomp_filter()
            if program is None:
                raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({SECCOMP_MISSING}). "
                                  f"Fix: {SECCOMP_FIX}")
            with open(os.path.join(tmp, "seccomp.bpf"), "wb") as f:
                f.write(program)
            passed.append(os.open(os.path.join(tmp, "seccomp.bpf"), os.O_RDONLY))
            argv = _bwrap_argv(limits, stage, passed[-1])
        else:
            argv = [sys.executable, "-I", "-c", _HARNESS]
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch,
                   "LANG": "C.UTF-8"}
            try:
                proc = subprocess.Popen(argv, cwd=scratch, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                                        pass_fds=passed, start_new_session=True,
                                        preexec_fn=_preexec(limits, timeout_s, None if sandbox == "bwrap" else nproc))
            finally:
                for fd in passed:
                    os.close(fd)
            try:
                try:
                    proc.stdin.write(job.encode())
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
        stderr = _tail(err_path)
        flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= limits.file_mb << 20
    if timed_out:
        return False, "timeout"
    if flooded or code == -signal.SIGXFSZ:  # Python ignores SIGXFSZ and raises "File too large" instead
        return False, f"output or a file over {limits.file_mb} MB"
    lines = said.splitlines()
    mine = [line[len(nonce) + 1:] for line in lines if line.startswith(nonce + " ")]
    if not lines:  # the harness never got to its verdict: the sandbox's or the interpreter's own words
        return False, (stderr.strip().splitlines() or [f"no verdict from the tests (exit status {code})"])[-1]
    if len(lines) != 1 or len(mine) != 1:  # anything else on the verdict pipe is the answer's
        return False, "the verdict pipe held lines the tests did not write"
    if mine[0] == "pass" and code == 0:
        return True, ""
    return False, mine[0].removeprefix("fail ") or f"exit status {code}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group: bwrap, and with it (--die-with-parent) its PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
    missing = [tool for tool in ("bwrap", "ldd", *(("unshare", "setpriv") if os.geteuid() == 0 else ()))
               if not shutil.which(tool)]
    why = f"{', '.join(missing)} not found" if missing else SECCOMP_MISSING if _seccomp_filter() is None else None
    if not why:
        why = run_tests("import os\nuid = os.getuid()\n", f"assert uid == {NOBODY}, uid\n", 30.0)[1]
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
        facts |= {"bwrap": version, "user": NOBODY, "network": "none", "filesystem": "python runtime (read-only), scratch tmpfs",
                  "seccomp_denies": list(UNCOUNTED_MEMORY_SYSCALLS)}
    if why == SECCOMP_MISSING:
        raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({why}). Fix: {SECCOMP_FIX}")
    if why:
        raise ConfigError(f"eval.sandbox=bwrap: graded code cannot be sandboxed here ({why}). Fix: install "
                          f"bubblewrap (`make setup` does, or `apt-get install -y bubblewrap`) and allow unprivileged user "
                          f"namespaces (sysctl user.max_user_namespaces=15000; on Ubuntu 24.04 "
                          f"kernel.apparmor_restrict_unprivileged_userns=0), or set eval.sandbox=unsafe_subprocess "
                          f"to grade without a sandbox.")
    return facts


def isolation_warning(facts: dict) -> str | None:
    """One line for grading without a sandbox, else None."""
    if facts["sandbox"] != "unsafe_subprocess":
        return None
    return ("eval.sandbox=unsafe_subprocess: graded code runs unsandboxed, as this user: it can read and write "
            "this user's files, use the network and signal the grader (run.json records it)")


def humaneval_program(record: Record, text: str) -> tuple[str, str]:
    """(answer, tests): a reply that restates the function is complete; else it is the body after the prompt."""
    ref = record.reference
    code = extract_code(text)
    answer = code if f"def {ref['entry_point']}" in code else ref["prompt"] + code
    return answer, f"{ref['test']}\n\ncheck({ref['entry_point']})\n"


def mbpp_program(record: Record, text: str) -> tuple[str, str]:
    """(answer, tests): the benchmark's setup code runs first, as part of the answer's program."""
    ref = record.reference
    return "\n".join([ref.get("setup") or "", extract_code(text)]) + "\n", "\n".join(ref["tests"]) + "\n"


# ---------------------------------------------------------------------------- one entry point


# How a code benchmark's reply and tests become (answer, tests), by its parser (`spec.loader`): the
# test format is the parser's. A code benchmark without one (LiveCodeBench: stdin tests) is not checked.
PROGRAMS: dict[str, Callable[[Record, str], tuple[str, str]]] = {"humaneval": humaneval_program, "mbpp": mbpp_program}

UNCHECKED = {"answer": None, "correct": None}


def grade_math(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float, sandbox: str) -> dict[str, Any]:
    answer, ok = math_correct(text, record.reference)
    return {"answer": answer, "correct": ok}


def grade_code(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float,
               sandbox: str = "bwrap") -> dict[str, Any]:
    program = PROGRAMS.get(spec.loader)
    if program is None:
        return dict(UNCHECKED)
    ok, err = run_tests(*program(record, text), timeout_s, sandbox=sandbox)
    return {"answer": None, "correct": ok, **({} if ok else {"error": err.strip().splitlines()[-1:]})}


# Graders by `spec.kind` (conf/benchmark/<name>.yaml): a new benchmark of a known kind is graded with
# no code change; a new kind is one function here.
GRADERS: dict[str, Callable[..., dict[str, Any]] | None] = {"math": grade_math, "code": grade_code, "chat": None}


def grade(spec: BenchmarkSpec, record: Record, text: str, turn: int = 0,
          timeout_s: float = 10.0, sandbox: str = "bwrap") -> dict[str, Any]:
    """{"answer": ..., "correct": True/False/None} for one reply (None: not checkable); code runs in
    `sandbox` (eval.sandbox)."""
    if spec.kind not in GRADERS:
        raise ConfigError(f"benchmark.specs.{spec.name}.kind={spec.kind!r}: use {', '.join(GRADERS)}")
    grader = GRADERS[spec.kind]
    if grader is None or turn > 0 or record.reference is None:
        return dict(UNCHECKED)
    return grader(spec, record, text, timeout_s, sandbox)
