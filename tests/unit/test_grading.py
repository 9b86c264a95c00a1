"""Task-level grading: math answer extraction and code execution in a subprocess."""

from __future__ import annotations

from dataclasses import replace

import pytest

from d3d.data.benchmarks import Record, load_benchmark
from d3d.settings import shipped_benchmark
from d3d.grading.answers import extract_answer, extract_code, normalise_answer
from d3d.grading.verdict import GRADERS, grade, run_tests, split_tests


@pytest.mark.parametrize("text, expected", [
    ("So she has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("The total is \\boxed{1,200} dollars.", "1,200"),
    ("Thus \\boxed{\\frac{3}{4}} and later \\boxed{\\dfrac{1}{2}}", "\\dfrac{1}{2}"),  # the last box
    ("The answer is 42.", "42"),
    ("First 5 then 6, finally 18 eggs", "18"),
    ("no numbers here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("a, b", [("1,000.0", "1000"), ("$18$", "18"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
                                  ("\\text{(B)}", "(B)"), ("0.50", ".5"), ("90^\\circ", "90")])
def test_normalised_answers_match(a, b):
    assert normalise_answer(a) == normalise_answer(b)


def test_different_answers_do_not_match():
    assert normalise_answer("12") != normalise_answer("1.2")
    spec = shipped_benchmark("gsm8k")
    rec = Record("gsm8k/0", ["q"], "18")
    assert grade(spec, rec, "... so \\boxed{18}")["correct"] is True
    assert grade(spec, rec, "... so \\boxed{19}")["correct"] is False
    assert grade(spec, rec, "I do not know")["correct"] is False
    assert grade(spec, rec, "anything", turn=1)["correct"] is None


def test_extract_code_fenced_unfenced_and_cut_off():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("    return x + 1\n") == "    return x + 1\n"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"


@pytest.fixture(scope="module")
def humaneval(cache_dir):
    return load_benchmark(shipped_benchmark("humaneval"), cache_dir)


def test_humaneval_canonical_passes_and_wrong_fails(humaneval):
    spec = shipped_benchmark("humaneval")
    rec = humaneval[0]
    body = rec.metadata["canonical_solution"]
    assert grade(spec, rec, f"```python\n{rec.reference['prompt']}{body}```")["correct"] is True
    assert grade(spec, rec, body)["correct"] is True  # a bare body continues the prompt
    wrong = grade(spec, rec, "```python\n" + rec.reference["prompt"] + "    return None\n```")
    assert wrong["correct"] is False and wrong["error"]


def test_code_that_hangs_times_out(humaneval):
    spec = shipped_benchmark("humaneval")
    out = grade(spec, humaneval[0], "    while True:\n        pass\n", timeout_s=2)
    assert out == {"answer": None, "correct": False, "compared_apart": True, "error": ["timeout"]}


def test_mbpp_tests_run():
    spec = shipped_benchmark("mbpp")
    rec = Record("mbpp/1", ["Write add."], {"tests": ["assert add(1, 2) == 3"], "setup": ""})
    assert grade(spec, rec, "```python\ndef add(a, b):\n    return a + b\n```")["correct"] is True
    assert grade(spec, rec, "```python\ndef add(a, b):\n    return a - b\n```")["correct"] is False


def test_mbpp_canonical_solution_from_the_fixture_passes(cache_dir):
    from d3d.data.benchmarks import load_records
    from tests.unit.conftest import with_local

    spec = with_local("mbpp", "mbpp.jsonl")
    records, _ = load_records(spec, cache_dir)
    for rec in records:
        assert grade(spec, rec, f"```python\n{rec.metadata['canonical_solution']}\n```")["correct"] is True
        assert grade(spec, rec, "```python\npass\n```")["correct"] is False


def test_the_grader_is_chosen_by_the_specs_kind():
    """`kind` in conf/benchmark/<name>.yaml picks the grader (d3d.grading.verdict.GRADERS): the same record and
    reply are checked as math, left unchecked as chat, and an unknown kind is refused by name."""
    from d3d.errors import ConfigError

    rec = Record("gsm8k/0", ["q"], "18")
    assert grade(replace(shipped_benchmark("gsm8k"), kind="math"), rec, "\\boxed{18}")["correct"] is True
    assert grade(replace(shipped_benchmark("gsm8k"), kind="chat"), rec, "\\boxed{18}")["correct"] is None
    with pytest.raises(ConfigError, match=r"benchmark.specs.gsm8k.kind='poetry'"):
        grade(replace(shipped_benchmark("gsm8k"), kind="poetry"), rec, "\\boxed{18}")
    # a new benchmark of a known kind needs no code: every shipped spec's kind has a grader
    from d3d.configdir import config_dir

    kinds = {shipped_benchmark(p.stem).kind for p in (config_dir() / "benchmark").glob("*.yaml")
             if p.stem not in ("all", "all_plus")}
    assert kinds <= set(GRADERS), kinds


# ---------------------------------------------------------------------------- the sandbox (docs/design.md#contract-10)
# Each probe is an answer that tries something hostile and a test that passes only if it was stopped:
# `correct` is True when the sandbox held. Payloads aim at canaries this test makes (a 0600 file, a
# Unix socket, a process with a marker), never at the machine's own files. docs/reliability.md lists
# them. "user" runs the grader itself as an ordinary user (uid 65534, the system Python, only
# d3d.grading loaded), so the non-root chain is tried too.

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from d3d.grading.sandbox import Limits, isolation

SRC = Path(__file__).resolve().parents[2] / "src"
USER_PYTHON = "/usr/bin/python3"
# The grader as an ordinary user: d3d.grading alone, its imports from the rest of the project stubbed.
AS_USER = """import importlib, json, sys, types
d3d = sys.modules["d3d"] = types.ModuleType("d3d")
d3d.__path__ = [sys.argv[1] + "/d3d"]
for name, attrs in {"d3d.errors": {"ConfigError": type("ConfigError", (Exception,), {})},
                    "d3d.data": {}, "d3d.data.benchmarks": {"Record": object}, "d3d.specs": {"BenchmarkSpec": object}}.items():
    sys.modules[name] = types.SimpleNamespace(**attrs)
verdict, sandbox = importlib.import_module("d3d.grading.verdict"), importlib.import_module("d3d.grading.sandbox")
job = json.loads(sys.stdin.read())
try:
    print(json.dumps(verdict.run_tests(job["answer"], job["tests"], job["timeout_s"], sandbox.Limits(**job["limits"]))))
except sys.modules["d3d.errors"].ConfigError as err:
    print(json.dumps(["refused", str(err)]))
"""


def graded(answer: str, tests: str, who: str = "root", limits: Limits = Limits(),
           timeout_s: float = 20) -> tuple[bool, str]:
    if who != "user":
        return run_tests(answer, tests, timeout_s, limits)
    from dataclasses import asdict

    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", USER_PYTHON, "-I", "-c",
                          AS_USER, str(SRC)], capture_output=True, text=True, timeout=60,
                         input=json.dumps({"answer": answer, "tests": tests, "limits": asdict(limits), "timeout_s": timeout_s}), cwd="/")
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


def who_params():
    user_ok = os.geteuid() == 0 and os.path.exists(USER_PYTHON) and shutil.which("setpriv")
    return ["root" if os.geteuid() == 0 else "self",
            pytest.param("user", marks=pytest.mark.skipif(not user_ok, reason="needs root, setpriv and /usr/bin/python3"))]


WHO = who_params()


@pytest.fixture
def shared_dir():
    """A folder both root and uid 65534 reach; its files belong to whoever grades (`owned`)."""
    d = tempfile.mkdtemp(prefix="d3d-canary-", dir="/tmp")
    os.chmod(d, 0o777)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def owned(path: Path, who: str) -> Path:
    if who == "user":
        os.chown(path, 65534, 65534)
    return path


@pytest.mark.parametrize("who", WHO)
def test_a_right_answer_passes_and_a_wrong_one_fails_in_the_sandbox(who):
    assert graded("def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3\n", who) == (True, "")
    ok, why = graded("def add(a, b):\n    return a - b\n", "assert add(1, 2) == 3\n", who)
    assert not ok and why.startswith("AssertionError")


READ = ("def leaked(path):\n    try:\n        return open(path).read()\n    except OSError:\n        return None\n")


@pytest.mark.parametrize("who", WHO)
def test_host_files_cannot_be_read(who, shared_dir):
    """The grader's own 0600 files (in its home, in /tmp) were read and could be raised into rows.jsonl."""
    secret = f"secret-{uuid.uuid4().hex}"
    paths = [shared_dir / "private.txt"]
    if who == "root":
        paths.append(Path(tempfile.mkstemp(dir="/root")[1]))  # root's home is 0700
    try:
        for path in paths:
            path.write_text(secret)
            os.chmod(path, 0o600)
            owned(path, who)
        tests = "".join(f"assert leaked({str(p)!r}) is None\n" for p in paths) + "assert leaked('/etc/shadow') is None\n"
        ok, why = graded(READ, tests, who)
        assert ok and secret not in why, why
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("who", WHO)
def test_host_files_cannot_be_written(who, shared_dir):
    canary = shared_dir / "canary.txt"
    canary.write_text("keep me")
    owned(canary, who)
    answer = (f"import ctypes, os\nlibc = ctypes.CDLL(None)\n"
              f"for point in [line.split()[4] for line in open('/proc/self/mountinfo')]:\n"
              f"    libc.mount(None, point.encode(), None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND, read-write\n"
              f"def wrote():\n    n = 0\n"
              f"    for path in ({str(canary)!r}, {str(shared_dir / 'new.txt')!r}, '/tmp/x', '/x', '/dev/shm/x'):\n"
              f"        try:\n            open(path, 'a').write('gone')\n            n += 1\n        except OSError:\n            pass\n"
              f"    return n\n"
              f"open('scratch.txt', 'w').write('its own scratch is writable')\n")
    ok, why = graded(answer, "assert wrote() == 0, wrote()\nassert open('scratch.txt').read()\n", who)
    assert ok, why
    assert canary.read_text() == "keep me" and not (shared_dir / "new.txt").exists()


@pytest.mark.parametrize("who", WHO)
def test_unix_sockets_of_the_host_are_out_of_reach(who, shared_dir):
    path = str(shared_dir / "service.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    try:
        answer = (f"import socket\ndef reached():\n    s = socket.socket(socket.AF_UNIX)\n    try:\n"
                  f"        s.connect({path!r})\n        return True\n    except OSError:\n        return False\n")
        ok, why = graded(answer, "assert not reached()\n", who)
    finally:
        server.close()
    assert ok, why


@pytest.mark.parametrize("who", WHO)
def test_host_processes_are_invisible(who):
    marker = f"d3d-canary-{uuid.uuid4().hex}"
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        answer = (f"import os\ndef seen():\n    found = []\n    for pid in os.listdir('/proc'):\n        try:\n"
                  f"            if {marker!r}.encode() in open(f'/proc/{{pid}}/cmdline', 'rb').read():\n"
                  f"                found.append(pid)\n        except OSError:\n            pass\n    return found\n")
        ok, why = graded(answer, "assert seen() == [], seen()\nimport os\nassert os.getpid() < 10\n", who)
    finally:
        witness.kill()
        witness.wait()
    assert ok, why


HOLD = """import os, time
def held(mb, children=3):
    r, w = os.pipe()
    for _ in range(children):
        try:
            if os.fork() == 0:
                try:
                    buf = bytearray(mb << 20)
                    os.write(w, b"1")
                except MemoryError:
                    pass
                time.sleep(2)
                os._exit(0)
        except OSError:
            pass
    os.close(w)
    time.sleep(1)
    got = os.read(r, 64)
    return len(got) * mb
"""


@pytest.mark.parametrize("who", WHO)
def test_the_process_tree_holds_no_more_memory_than_its_budget(who):
    """Three children held 2.4 GB against a 2 GB cap (the address-space limit was per process)."""
    limits = Limits(memory_mb=256, processes=6)  # room for the three children
    ok, why = graded(HOLD, f"assert held(100) <= {limits.memory_mb}, held(100)\n", who, limits)
    assert ok, why


HELD_OUTSIDE = """import ctypes, os
def held_outside(mb=8, times=30):
    total = 0
    for _ in range(times):  # memfd files: written, never mapped, so no address-space limit counts them
        try:
            fd = os.memfd_create("x")
            for _ in range(mb):
                os.write(fd, b"\\1" * (1 << 20))
            total += mb
        except OSError:
            break
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    for _ in range(times):  # System V segments: filled while attached, kept after detaching
        segment = libc.shmget(0, mb << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if segment < 0:
            break
        address = libc.shmat(segment, None, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(address, 1, mb << 20)
        libc.shmdt(ctypes.c_void_p(address))
        total += mb
    return total
"""


@pytest.mark.parametrize("who", WHO)
def test_no_memory_is_held_outside_the_address_space_budget(who):
    """memfd files and System V shared memory hold pages no address-space limit counts: 2.4 GB in
    8 s against a 2 GB tree (probed; 256 descriptors of 16 MB per process were in reach). They are
    refused (EPERM) by the sandbox's seccomp filter."""
    ok, why = graded(HELD_OUTSIDE, "assert held_outside() == 0, held_outside()\n", who, Limits(memory_mb=256))
    assert ok, why


@pytest.mark.parametrize("who", WHO)
def test_the_scratch_disk_is_one_budget(who):
    """Six files wrote 90 MB against a 16 MB per-file cap: no cap held their sum."""
    limits = Limits(file_mb=4, disk_mb=8)
    answer = ("def written():\n    total = 0\n    for i in range(6):\n        try:\n"
              "            with open(f'f{i}', 'wb') as f:\n                f.write(b'x' * (3 << 20))\n            total += 3\n"
              "        except OSError:\n            break\n    return total\n")
    ok, why = graded(answer, f"assert written() <= {limits.disk_mb}, written()\n", who, limits)
    assert ok, why


@pytest.mark.parametrize("who", WHO)
def test_a_fork_bomb_is_bounded_and_nothing_outlives_the_timeout(who):
    marker = f"d3d-canary-{uuid.uuid4().hex}"
    answer = (f"import os, subprocess, sys\nn = 0\nfor _ in range(30):\n    try:\n"
              f"        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True)\n"
              f"        n += 1\n    except OSError:\n        break\nwhile True:\n    pass\n")
    ok, why = graded(answer, "", who, Limits(processes=4), timeout_s=3)
    assert not ok and why == "timeout"
    forks = ("import os, time\ndef forked():\n    n = 0\n    for _ in range(30):\n        try:\n            pid = os.fork()\n"
             "        except OSError:\n            break\n        if pid == 0:\n            time.sleep(3)\n            os._exit(0)\n"
             "        n += 1\n    return n\n")
    # the harness, its twin (d3d.grading.verdict: the tests ran apart) and 2 more
    assert graded(forks, "assert forked() == 2\n", who, Limits(processes=4)) == (True, "")
    deadline = time.time() + 5
    while alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert alive_with(marker) == []


KILLED_GRADER = "import sys\nsys.path.insert(0, {src!r})\nfrom d3d.grading.verdict import run_tests\nrun_tests({program!r}, '', 120)\n"


def test_a_grader_killed_mid_grade_leaves_nothing_running():
    """SIGKILL the grading process while its program (and a child that left its session) runs."""
    hexpart = uuid.uuid4().hex
    marker = f"d3d-canary-{hexpart}"  # only the grandchild's command line holds it whole
    program = (f"import subprocess, sys, time\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', 'd3d-canary-' + {hexpart!r}],"
               f" start_new_session=True)\n"
               f"time.sleep(120)\n")
    grader = subprocess.Popen([sys.executable, "-c", KILLED_GRADER.format(src=str(SRC), program=program)])
    deadline = time.time() + 60
    while not alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert alive_with(marker), "the graded program never started"
    grader.kill()
    grader.wait()
    deadline = time.time() + 10
    while alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert alive_with(marker) == []
    finally:  # a failing run does not leave its canaries behind
        for pid in alive_with(marker):
            os.kill(pid, signal.SIGKILL)


def alive_with(marker: str) -> list[int]:
    """Host pids (zombies excluded) whose command line carries `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmd and state != "Z":
                pids.append(int(entry))
    return pids


# ---------------------------------------------------------------------------- pass means the tests ran and passed

HE = Record("humaneval/add", ["Write add."], {"prompt": "def add(a, b):\n", "entry_point": "add",
                                               "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
                                                       "    assert abs(candidate(2, 2) - 4) < 1e-9\n"})
MBPP = Record("mbpp/add", ["Write add."], {"tests": ["import math", "assert math.isclose(add(2, 2), 4)",
                                                     "assert abs(add(1, 2) - 3) < 1e-9"], "setup": ""})
EQ = Record("mbpp/add-eq", ["Write add."], {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "setup": ""})
CMATH = Record("mbpp/add-cmath", ["Write add."], {"tests": ["import cmath", "assert cmath.isclose(add(1, 2), 3)"], "setup": ""})
WRONG = "def add(a, b):\n    return 0\n"
CHEATS = {  # record, answer: each answer is wrong, and each used to pass
    "dangling decorator": (HE, WRONG + "def _skip(f):\n    return lambda *a: None\n@_skip\n"),
    "evidence channel": (MBPP, "import os\nfor fd in range(3, 64):\n    try:\n        seen = os.read(fd, 64)\n"
                               "    except OSError:\n        continue\n    if len(seen) == 32:\n"
                               "        os.write(1, b'\\n' + seen + b'\\n')\n        os._exit(0)\n"),
    "always-equal object": (HE, "class Yes(int):\n    __eq__ = lambda self, other: True\n    __sub__ = lambda self, other: 0\n"
                                "def add(a, b):\n    return Yes()\n"),
    "monkeypatched builtins": (MBPP, WRONG + "import builtins, math\nbuiltins.abs = lambda x: 0\n"
                                     "math.isclose = lambda *a, **k: True\n"),
    "tests read from its own file": (MBPP, "import re, sys\nknown = {}\n"
                                           "for path in (globals().get('__file__'), sys.argv[0], 'check.py'):\n    try:\n"
                                           "        text = open(path).read()\n    except (OSError, TypeError):\n        continue\n"
                                           "    for a, b, c in re.findall(r'add\\((\\d+), (\\d+)\\)(?: - |, )(\\d+)', text):\n"
                                           "        known[int(a), int(b)] = int(c)\n"
                                           "def add(a, b):\n    return known.get((a, b), 0)\n"),
    # issue 58's probes, each `correct: True` on 56804d3: what the harness trusted or did not restore ...
    "weakref proxy of an always-equal object": (EQ, "import weakref\nclass Yes:\n    __eq__ = lambda self, other: True\n"
                                                    "yes = Yes()\ndef add(a, b):\n    return weakref.proxy(yes)\n"),
    "mapping proxy over an always-equal dict": (EQ, "import types\nclass Yes(dict):\n    __eq__ = lambda self, other: True\n"
                                                    "def add(a, b):\n    return types.MappingProxyType(Yes())\n"),
    "UserString whose data the answer replaced": (EQ, "import collections\nclass Yes:\n    __eq__ = lambda self, other: True\n"
                                                      "def add(a, b):\n    s = collections.UserString('')\n    s.data = Yes()\n"
                                                      "    return s\n"),
    "patched Counter.__eq__": (EQ, "import collections\ncollections.Counter.__eq__ = lambda self, other: True\n"
                                   "def add(a, b):\n    return collections.Counter()\n"),
    "a meta_path finder for the tests' import": (CMATH, "import sys, types\nfrom importlib.machinery import ModuleSpec\nclass Finder:\n"
                                                        "    def find_spec(self, name, path=None, target=None):\n"
                                                        "        if name == 'cmath':\n"
                                                        "            return ModuleSpec(name, self)\n"
                                                        "    def create_module(self, spec):\n"
                                                        "        fake = types.ModuleType('cmath')\n"
                                                        "        fake.isclose = lambda *a, **k: True\n        return fake\n"
                                                        "    def exec_module(self, module):\n        pass\n"
                                                        "sys.meta_path.insert(0, Finder())\n" + WRONG),
    # ... and by introspection: the harness's reporter from a frame's locals or from gc, the nonce from
    # the heap through /proc/self/mem.
    "the reporter from a frame's locals": (HE, "import sys\nframe = sys._getframe()\nwhile frame is not None:\n"
                                              "    if callable(frame.f_locals.get('say')):\n"
                                              "        frame.f_locals['say']('pass')\n"
                                              "    frame = frame.f_back\n" + WRONG),
    "the reporter from gc": (HE, "import gc\nfor o in gc.get_objects():\n"
                                "    if callable(o) and getattr(o, '__name__', '') == 'say':\n        o('pass')\n" + WRONG),
    "the nonce from /proc/self/mem": (HE, "import os, re\nfound = set()\n"
                                         "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
                                         "    for line in maps:\n        where, perms = line.split()[:2]\n"
                                         "        lo, hi = (int(x, 16) for x in where.split('-'))\n"
                                         "        if 'r' not in perms or hi - lo > 64 << 20:\n            continue\n"
                                         "        try:\n            mem.seek(lo)\n            chunk = mem.read(hi - lo)\n"
                                         "        except (OSError, ValueError, OverflowError):\n            continue\n"
                                         "        found.update(re.findall(b'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', chunk))\n"
                                         "for nonce in found:\n    for fd in range(3, 64):\n        try:\n"
                                         "            os.write(fd, nonce + b' pass\\n')\n        except OSError:\n            pass\n"
                                         "if len(found) == 1:\n    os._exit(0)\n" + WRONG),
}


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("cheat", list(CHEATS))
def test_a_wrong_answer_does_not_pass_by_a_trick(cheat, who):
    """Each used to pass: `correct: True` without the tests having passed."""
    from d3d.grading.answers import PROGRAMS
    from d3d.grading.verdict import split_tests

    record, answer = CHEATS[cheat]
    loader = "humaneval" if record is HE else "mbpp"
    assert split_tests(PROGRAMS[loader](record, answer)[1]) is not None  # graded apart from the answer
    right = "def add(a, b):\n    return a + b\n"
    if who != "user":  # the grader's entry point, as eval calls it
        spec = shipped_benchmark(loader)
        assert grade(spec, record, f"```python\n{answer}```")["correct"] is False
        assert grade(spec, record, f"```python\n{right}```")["correct"] is True  # the same record, honestly answered
    else:  # the same records honestly answered pass as a user in test_a_right_answer_passes_… and the root case
        assert graded(*PROGRAMS[loader](record, answer), who)[0] is False


@pytest.mark.parametrize("early_exit", ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()"])
def test_exit_zero_before_the_tests_is_a_fail(early_exit):
    ok, why = run_tests(f"{early_exit}\n", "assert 1 == 2, 'wrong answer'\n", 10)
    assert not ok and ("exited before its tests" in why or "no verdict" in why), why
    assert run_tests("x = 1\n", "assert x == 1\n", 10) == (True, "")


def test_output_is_capped_and_only_its_tail_kept():
    ok, why = run_tests("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "", 10, Limits(file_mb=1))
    assert not ok and "over 1 MB" in why and len(why) < 5000


def test_where_bwrap_is_missing_grading_refuses_in_one_line_unless_told_unsafe(monkeypatch):
    from d3d.errors import ConfigError
    import d3d.grading.sandbox as grading

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real(name, *a, **k))
    grading.isolation.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"eval.sandbox=bwrap: .*bwrap not found.*Fix: install bubblewrap.*"
                                              r"eval.sandbox=unsafe_subprocess") as err:
            grading.isolation("bwrap")
        assert "\n" not in str(err.value)
        facts = grading.isolation("unsafe_subprocess")
        assert facts["sandbox"] == "unsafe_subprocess" and "unsandboxed" in grading.isolation_warning(facts)
        assert run_tests("def f():\n    return 1\n", "assert f() == 1\n", 10, sandbox="unsafe_subprocess") == (True, "")
        with pytest.raises(ConfigError, match=r"eval.sandbox='nope': no such sandbox. Fix: set eval.sandbox=bwrap"):
            run_tests("x = 1\n", "", 10, sandbox="nope")
    finally:
        monkeypatch.undo()
        grading.isolation.cache_clear()
    assert isolation("bwrap")["sandbox"] == "bwrap" and grading.isolation_warning(isolation("bwrap")) is None


def test_where_libseccomp_is_missing_grading_refuses_in_one_line(monkeypatch):
    """The sandbox's system-call filter comes from libseccomp: without it bwrap would run with the
    memory loopholes open, so grading refuses, naming the package, as it does without bwrap."""
    import ctypes.util

    from d3d.errors import ConfigError
    import d3d.grading.sandbox as grading

    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None if name == "seccomp" else real(name))
    grading._seccomp_filter.cache_clear()
    grading.isolation.cache_clear()
    try:
        for refuse in (lambda: grading.isolation("bwrap"), lambda: run_tests("x = 1\n", "", 10)):
            with pytest.raises(ConfigError, match=r"eval.sandbox=bwrap: .*libseccomp not found.*Fix: install libseccomp "
                                                  r".*eval.sandbox=unsafe_subprocess") as err:
                refuse()
            assert "\n" not in str(err.value)
    finally:
        monkeypatch.undo()
        grading._seccomp_filter.cache_clear()
        grading.isolation.cache_clear()
    assert isolation("bwrap")["seccomp_denies"] == list(grading.DENIED_SYSCALLS)


# ---------------------------------------------------------------------------- issue 58: graded code

SYSV = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def held_in_the_kernel(sets=20):
    made = 0
    for _ in range(sets):  # System V semaphore sets of 32000: kernel memory no rlimit of the tree counts
        if libc.semget(0, 32000, 0o1600) < 0:  # IPC_PRIVATE, IPC_CREAT | 0600
            break
        made += 1
    queue = libc.msgget(0, 0o1600)  # a System V message queue, filled without waiting
    if queue >= 0:
        message = ctypes.create_string_buffer(8 + 4096)
        message[0] = b"\\1"  # mtype 1
        while made < 100 and libc.msgsnd(queue, message, 4096, 0o4000) == 0:  # IPC_NOWAIT
            made += 1
    return made
"""


@pytest.mark.parametrize("who", WHO)
def test_system_v_semaphores_and_message_queues_are_refused(who):
    """`semget(IPC_PRIVATE, 32000, …)` in a loop made ~2 GB of kernel memory in 6 s, and msgget +
    msgsnd 500 MB in 0.9 s, outside memory_mb + disk_mb: the seccomp filter refuses both (EPERM)."""
    ok, why = graded(SYSV, "assert held_in_the_kernel() == 0, held_in_the_kernel()\n", who)
    assert ok, why


KERNEL_OBJECTS = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def made():
    got = []
    if libc.syscall(425, 8, ctypes.create_string_buffer(120)) >= 0:  # io_uring_setup: rings in kernel memory
        got.append("io_uring")
    if libc.syscall(248, b"user", b"d3d", b"x" * 1024, 1024, -2) >= 0:  # add_key to the session keyring
        got.append("key")
    return got
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe uses x86-64 system call numbers")
@pytest.mark.parametrize("who", WHO)
def test_io_uring_and_the_keyring_are_refused(who):
    """An io_uring ring and a key in the kernel keyring were made: kernel memory and attack surface no
    graded program needs."""
    ok, why = graded(KERNEL_OBJECTS, "assert made() == [], made()\n", who)
    assert ok, why


TWIN = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def reached():
    twin, got = os.getppid(), []
    for path in (f"/proc/{twin}/mem", f"/proc/{twin}/environ", f"/proc/{twin}/fd/0"):
        try:
            os.close(os.open(path, os.O_RDONLY))
            got.append(path)
        except OSError:
            pass
    try:
        got += os.listdir(f"/proc/{twin}/fd")
    except OSError:
        pass
    if libc.ptrace(16, twin, None, None) == 0:  # PTRACE_ATTACH
        got.append("ptrace")
    local, remote = (ctypes.c_char * 8)(), ctypes.c_void_p(id(None))
    iov = lambda buf, n: (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), n)
    if libc.process_vm_readv(twin, iov(local, 8), 1, iov(remote, 8), 1, 0) > 0:
        got.append("process_vm_readv")
    return got
"""


@pytest.mark.parametrize("who", WHO)
def test_the_twin_that_runs_the_tests_is_out_of_the_answers_reach(who):
    """The tests' checks run in a twin forked before the answer ran (d3d.grading.verdict): the answer's
    process, its child, can neither open the twin's memory, descriptors or environment nor trace it."""
    assert split_tests("assert reached() == []\n") is not None
    ok, why = graded(TWIN, "assert reached() == [], reached()\n", who)
    assert ok, why


@pytest.mark.parametrize("who", WHO)
def test_the_sandbox_shows_nothing_of_the_graders_environment(who):
    """/proc/1/environ (bwrap's init) showed the grader's PATH and its `d3d-grade-*` folder."""
    answer = ("import os\ndef environments():\n    seen = []\n    for pid in os.listdir('/proc'):\n        try:\n"
              "            seen += open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
              "        except (OSError, NotADirectoryError):\n            pass\n    return [e for e in seen if e]\n")
    tests = ("seen = environments()\nassert seen, 'no environment read'\n"
             "assert not [e for e in seen if b'd3d-grade' in e or e.startswith(b'PATH=')], seen\n")
    ok, why = graded(answer, tests, who)
    assert ok, why


def test_without_bwrap_a_grade_is_refused_in_one_line(monkeypatch, tmp_path):
    """grade() without bwrap returned a wrong verdict as root (the chain's `not found` as the failure)
    and a FileNotFoundError traceback as a user: now the refusal `isolation()` gives."""
    from d3d.errors import ConfigError

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real(name, *a, **k))
    with pytest.raises(ConfigError, match=r"eval.sandbox=bwrap: graded code cannot be sandboxed here \(bwrap not found\)"
                                          r"\. Fix: install bubblewrap") as err:
        grade(shipped_benchmark("mbpp"), EQ, "```python\ndef add(a, b):\n    return a + b\n```")
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    if os.geteuid() == 0 and os.path.exists(USER_PYTHON) and shutil.which("setpriv"):  # as a user, bwrap off its PATH
        out = subprocess.run([shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", USER_PYTHON,
                              "-I", "-c", AS_USER, str(SRC)], capture_output=True, text=True, timeout=60, cwd="/",
                             env={"PATH": str(tmp_path)},
                             input=json.dumps({"answer": "x = 1\n", "tests": "assert x == 1\n", "limits": {},
                                               "timeout_s": 10}))
        assert out.returncode == 0, out.stderr
        refused = json.loads(out.stdout)
        assert refused[0] == "refused" and "not found). Fix: install bubblewrap" in refused[1], refused


RIGHT_BY_VALUE = {  # record, answer: each answer is right, and each used to fail
    "a Fraction against a float": (Record("mbpp/half", ["Write half."], {"tests": ["assert half(1) == 0.5"], "setup": ""}),
                                   "from fractions import Fraction\ndef half(x):\n    return Fraction(x, 2)\n"),
    "a namedtuple of its own against a tuple": (
        Record("mbpp/pair", ["Write pair."], {"tests": ["assert pair(1) == (1, 2)"], "setup": ""}),
        "from collections import namedtuple\nP = namedtuple('P', 'a b')\ndef pair(x):\n    return P(x, x + 1)\n"),
    "the tests build objects of the answer's class": (
        Record("mbpp/span", ["Write longest."], {"tests": ["assert longest([Pair(1, 5), Pair(2, 3)]) == 4"], "setup": ""}),
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "def longest(pairs):\n    return max(p.b - p.a for p in pairs)\n"),
}


def test_an_iterator_the_tests_collect_passes():
    """`list(f(x))` runs with the call, in the answer's process: an answer returning a generator is not
    refused as `not plain data`."""
    record = Record("mbpp/evens", ["Write evens."], {"tests": ["assert list(evens(5)) == [0, 2, 4]"], "setup": ""})
    out = grade(shipped_benchmark("mbpp"), record, "```python\ndef evens(n):\n    return (i for i in range(0, n, 2))\n```")
    assert out["correct"] is True and out["compared_apart"] is True, out


def test_objects_of_a_class_the_tests_define_are_not_blamed_on_the_answer():
    """Tests that define a class run together with the answer; their own objects passed to it were
    refused as `a class it wrote`."""
    record = Record("mbpp/box", ["Write unbox."], {"tests": ["class Box:\n    def __init__(self, v):\n        self.v = v",
                                                            "assert unbox(Box(3)) == 3"], "setup": ""})
    out = grade(shipped_benchmark("mbpp"), record, "```python\ndef unbox(box):\n    return box.v\n```")
    assert out["correct"] is True and out["compared_apart"] is False, out
    wrong = grade(shipped_benchmark("mbpp"), record, "```python\ndef unbox(box):\n    return box\n```")
    assert wrong["correct"] is False, wrong  # the test's object given back: the test's own == says no


@pytest.mark.parametrize("case", list(RIGHT_BY_VALUE))
def test_a_right_answer_is_judged_by_its_values(case):
    """Values are compared as the runtime's own types, numbers by value: a right answer no longer fails
    for the class of what it returns, nor for objects the tests build from its classes."""
    record, answer = RIGHT_BY_VALUE[case]
    out = grade(shipped_benchmark("mbpp"), record, f"```python\n{answer}```")
    assert out["correct"] is True and out["compared_apart"] is True, out
    wrong = answer.replace("return ", "return 1 + ") if "namedtuple" not in answer else answer.replace("x + 1", "x + 2")
    assert grade(shipped_benchmark("mbpp"), record, f"```python\n{wrong}```")["correct"] is False


MAPPED = Record("humaneval/add-mapped", ["Write add."], {"prompt": "def add(a, b):\n", "entry_point": "add",
                                                         "test": "def check(candidate):\n"
                                                                 "    assert list(map(candidate, [1, 2], [1, 1])) == [2, 3]\n"})
FAKE_VERDICT = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'0' * 32 + b' pass\\n')\n"
                "    except OSError:\n        pass\nos._exit(0)\n")


@pytest.mark.parametrize("record", [MAPPED, HE], ids=["together", "apart"])
def test_a_verdict_without_the_runs_nonce_is_not_a_pass(record):
    """A wrong answer writes `<another nonce> pass` on every descriptor and exits 0 before the tests:
    only the line carrying this run's nonce is a verdict (tests of another shape run in the answer's
    interpreter, where the verdict pipe is within its reach)."""
    spec = shipped_benchmark("humaneval")
    out = grade(spec, record, f"```python\n{FAKE_VERDICT}{WRONG}```")
    assert out["correct"] is False and out["compared_apart"] is (record is HE), out
    assert grade(spec, record, "```python\ndef add(a, b):\n    return a + b\n```")["correct"] is True


def test_tests_split_into_calls_and_checks_by_their_shape_alone():
    from d3d.grading.verdict import split_tests

    he = split_tests("METADATA = {}\n\ndef check(candidate):\n    import math\n"
                     "    assert candidate([3, 1], math.pi) == [1, 3], 'sorted'\n    assert abs(candidate([], 0) - 1.5) < 1e-6\n"
                     "\ncheck(sort_it)\n")
    assert he.calls == ("candidate([3, 1], math.pi)", "candidate([], 0)") and he.bind == {"candidate": "sort_it"}
    assert he.imports == "import math" and "[1, 3]" in he.tests and "1.5" in he.tests and "__d3d_atom(1, {})" in he.tests
    assert not any("[1, 3]" in c or "1.5" in c for c in he.calls)  # expected values never reach the answer
    mbpp = split_tests("assert set(common((1, 2), (2, 3))) == {2}\nassert f(1) == sorted([2, 1])\n")
    assert mbpp.calls == ("set(common((1, 2), (2, 3)))", "f(1)") and mbpp.bind == {}
    collected = split_tests("assert list(f(3)) == [0, 1, 2]\nassert sorted(f(2), key=abs) == [0, 1]\n")
    assert collected.calls == ("list(f(3))", "f(2)")  # an iterator collected with the call; `key=` stays apart
    looped = split_tests("import random\nfor i in range(3):\n    x = random.random()\n    assert abs(f(i, x) - i - x) < 1e-9\n")
    assert looped.calls == ("f(i, x)",) and "__d3d_atom(0, {'i': i, 'x': x})" in looped.tests  # its values, sent per call
    for other in ("x = [3, 1]\nf(x)\nassert x == [1, 3]\n",  # a call made for what it does to its arguments
                  "def g(y):\n    return y\nassert f(g) == 1\n",  # a function of the tests' passed to the answer
                  "class P:\n    pass\nassert f(P()) == 1\n",  # tests that build their own classes
                  "assert list(map(f, [1])) == [2]\n",  # the answer's function passed, not called
                  "assert True\n"):  # no call into the answer
        assert split_tests(other) is None, other


@pytest.mark.heavy
def test_every_canonical_humaneval_solution_passes(humaneval):
    """All 164 HumanEval canonical solutions pass, most with their checks apart from the answer."""
    spec = shipped_benchmark("humaneval")
    failed, apart = [], 0
    for rec in humaneval:
        out = grade(spec, rec, f"```python\n{rec.reference['prompt']}{rec.metadata['canonical_solution']}```")
        apart += out["compared_apart"]
        if out["correct"] is not True:
            failed.append((rec.id, out.get("error")))
    assert len(humaneval) == 164 and failed == [], failed
    print(f"{apart} of {len(humaneval)} graded apart")
