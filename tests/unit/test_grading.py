"""Task-level grading: math answer extraction and code execution in a subprocess."""

from __future__ import annotations

from dataclasses import replace

import pytest

from d3d.data.benchmarks import Record, load_benchmark
from d3d.settings import shipped_benchmark
from d3d.grading import GRADERS, extract_answer, extract_code, grade, normalise_answer


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
    assert out == {"answer": None, "correct": False, "error": ["timeout"]}


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


# ---------------------------------------------------------------------------- containment (docs/design.md#contract-10)
# Harmless payloads only: they aim at a canary in the test's own temp dir, a socket this test
# opens, a signal handler this test installs, an allocation under a small limit.

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from d3d.grading import Limits, isolation, run_python


def alive_with(marker: str) -> list[int]:
    """Host pids (zombies excluded) whose command line carries `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("early_exit", ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()"])
def test_exit_zero_before_the_tests_is_a_fail(early_exit):
    ok, err = run_python(f"{early_exit}\nassert 1 == 2, 'wrong answer'\n", timeout_s=10)
    assert not ok and "before its tests finished" in err
    assert run_python("assert 1 == 1\n", timeout_s=10) == (True, "")  # the same shape, tests run: a pass


def test_memory_is_limited():
    grab = "buf = bytearray({} << 20)\n"
    small = Limits(memory_mb=256)
    ok, err = run_python(grab.format(512), timeout_s=10, limits=small)
    assert not ok and "MemoryError" in err
    assert run_python(grab.format(16), timeout_s=10, limits=small)[0]  # the limit leaves room to work


def test_output_is_capped_and_only_its_tail_kept():
    ok, err = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout_s=10,
                         limits=Limits(file_mb=1))
    assert not ok and "over 1 MB" in err and len(err) < 5000


@pytest.mark.parametrize("detach", [False, True])
def test_timeout_kills_the_whole_process_group(detach):
    """A spawned grandchild (and, in a PID namespace, one that left the session) dies with the program."""
    if detach and isolation()["pids"] != "namespace":
        pytest.skip(f"no PID namespace here ({isolation()}): a setsid grandchild can escape")
    marker = f"d3d-canary-{uuid.uuid4().hex}"
    program = (f"import subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}],"
               f" start_new_session={detach})\n"
               f"while True:\n    pass\n")
    ok, err = run_python(program, timeout_s=2)
    assert not ok and err == "timeout"
    deadline = time.time() + 5  # the kernel reaps asynchronously
    while alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert alive_with(marker) == []


def test_a_passing_program_leaves_nothing_running():
    marker = f"d3d-canary-{uuid.uuid4().hex}"
    program = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
    assert run_python(program, timeout_s=10)[0]
    deadline = time.time() + 5
    while alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert alive_with(marker) == []


def test_stdin_is_closed(monkeypatch):
    """The grader's stdin (here a pipe holding a secret) is not the program's."""
    saved = os.dup(0)
    r, w = os.pipe()
    os.write(w, b"secret\n")
    os.close(w)
    os.dup2(r, 0)
    try:
        ok, err = run_python("import sys\nassert 'secret' not in sys.stdin.read(), 'read the grader stdin'\n", 10)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(r)
    assert ok, err


def test_files_outside_its_directory_are_untouched(tmp_path):
    if isolation()["filesystem"] != "readonly":
        pytest.skip(f"no private read-only mounts here ({isolation()})")
    canary = tmp_path / "canary.txt"
    canary.write_text("keep me")
    program = (f"import os\n"
               f"for attempt in (lambda: os.remove({str(canary)!r}), lambda: open({str(canary)!r}, 'w').write('gone')):\n"
               f"    try:\n        attempt()\n    except OSError:\n        pass\n"
               f"open('scratch.txt', 'w').write('its own directory is writable')\n")
    assert run_python(program, timeout_s=10)[0]
    assert canary.read_text() == "keep me"


def test_no_network():
    if isolation()["network"] != "unshared":
        pytest.skip(f"no network namespace here ({isolation()})")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        ok, err = run_python(program, timeout_s=10)
    finally:
        server.close()
    assert not ok and "Error" in err  # unreachable, not merely refused


def test_cannot_signal_the_grader():
    if isolation()["pids"] != "namespace":
        pytest.skip(f"no PID namespace here ({isolation()})")
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    try:
        program = (f"import os, signal\n"
                   f"for pid in ({os.getpid()}, os.getppid()):\n"
                   f"    try:\n        os.kill(pid, signal.SIGUSR1)\n    except OSError:\n        pass\n")
        run_python(program, timeout_s=10)
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == []


def test_the_grader_is_chosen_by_the_specs_kind():
    """`kind` in conf/benchmark/<name>.yaml picks the grader (d3d.grading.GRADERS): the same record and
    reply are checked as math, left unchecked as chat, and an unknown kind is refused by name."""
    from d3d.config import ConfigError

    rec = Record("gsm8k/0", ["q"], "18")
    assert grade(replace(shipped_benchmark("gsm8k"), kind="math"), rec, "\\boxed{18}")["correct"] is True
    assert grade(replace(shipped_benchmark("gsm8k"), kind="chat"), rec, "\\boxed{18}")["correct"] is None
    with pytest.raises(ConfigError, match=r"benchmark.specs.gsm8k.kind='poetry'"):
        grade(replace(shipped_benchmark("gsm8k"), kind="poetry"), rec, "\\boxed{18}")
    # a new benchmark of a known kind needs no code: every shipped spec's kind has a grader
    from d3d.config import config_dir

    kinds = {shipped_benchmark(p.stem).kind for p in (config_dir() / "benchmark").glob("*.yaml")
             if p.stem not in ("all", "all_plus")}
    assert kinds <= set(GRADERS), kinds


KILLED_GRADER = "import sys\nsys.path.insert(0, {src!r})\nfrom d3d.grading import run_python\nrun_python({program!r}, 120)\n"


def test_a_grader_killed_mid_grade_leaves_nothing_running_or_on_disk(tmp_path):
    """SIGKILL the grading process while its program (and a child of it) runs: both used to live on,
    reparented, with their temporary directory left behind."""
    from tests.conftest import ROOT

    hexpart = uuid.uuid4().hex
    marker = f"d3d-canary-{hexpart}"  # only the grandchild's command line holds it whole
    program = (f"import subprocess, sys, time\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', 'd3d-canary-' + {hexpart!r}])\n"
               f"time.sleep(120)\n")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    grader = subprocess.Popen([sys.executable, "-c", KILLED_GRADER.format(src=str(ROOT / "src"), program=program)],
                              env={**os.environ, "TMPDIR": str(tmpdir)})
    deadline = time.time() + 60
    while not alive_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert alive_with(marker), "the graded program never started"
    grader.kill()
    grader.wait()
    left = lambda: alive_with(marker) + alive_with(str(tmpdir)) + [p.name for p in tmpdir.iterdir()]
    deadline = time.time() + 10
    while left() and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert left() == []
    finally:  # a failing run does not leave its canaries behind
        for pid in alive_with(marker) + alive_with(str(tmpdir)):
            os.kill(pid, signal.SIGKILL)


def test_the_process_count_is_limited_for_root_too():
    """RLIMIT_NPROC does not bind root: a fork loop used to get every process it asked for."""
    program = ("import os, time\nn = 0\nfor _ in range(30):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
               "    n += 1\nassert n < 30, f'{n} processes forked under a limit of 4'\n")
    ok, err = run_python(program, timeout_s=20, limits=Limits(processes=4))
    assert ok, err
    assert isolation()["processes"].startswith("RLIMIT_NPROC"), isolation()


def test_isolation_is_described_and_weaker_isolation_is_one_warning_line():
    from d3d.grading import isolation_warning

    facts = isolation()
    assert {"namespaces", "network", "pids", "filesystem", "processes", "limits"} <= set(facts)
    fallback = {**facts, "namespaces": None, "network": "shared", "pids": "shared", "filesystem": "writable",
                "effective_uid": os.geteuid()}  # a program that kept the grader's own user
    line = isolation_warning(fallback)
    user = "root" if os.geteuid() == 0 else "this user"
    assert "\n" not in line and f"use the network, write files as {user}, signal the grader" in line
    full = {**facts, "network": "unshared", "pids": "namespace", "filesystem": "readonly",
            "processes": "RLIMIT_NPROC for real uid 65534"}
    assert isolation_warning(full) is None


def test_without_unshare_roots_graded_code_runs_as_nobody(tmp_path, monkeypatch):
    """Where unshare is missing, root's graded code used to keep effective uid 0: it could write
    root's files and signal the grader (recorded and warned only). Now it runs as nobody."""
    if os.geteuid() != 0:
        pytest.skip("the grader is not root here: its programs already run as its own, unprivileged user")
    import shutil

    import d3d.grading as grading

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # no unshare on this machine
    grading.isolation.cache_clear()
    try:
        canary = tmp_path / "root_owned.txt"
        canary.write_text("keep me")
        program = (f"import os, signal\n"
                   f"assert os.geteuid() != 0 and os.getegid() != 0, (os.geteuid(), os.getegid())\n"
                   f"for attempt in (lambda: open({str(canary)!r}, 'w').write('gone'), lambda: os.remove({str(canary)!r}),\n"
                   f"                lambda: os.kill({os.getpid()}, signal.SIGKILL)):\n"
                   f"    try:\n        attempt()\n    except PermissionError:\n        pass\n"
                   f"    else:\n        raise AssertionError('allowed as root would be')\n"
                   f"open('scratch.txt', 'w').write('its own directory is writable')\n"
                   f"import json, decimal  # modules still load from wherever the interpreter lives\n")
        ok, err = grading.run_python(program, timeout_s=10)
        assert ok, err
        assert canary.read_text() == "keep me"
        facts = grading.isolation()  # what run.json records, and the warning that still comes (network)
        assert facts["namespaces"] is None and facts["effective_uid"] == grading.NOBODY, facts
        warning = grading.isolation_warning(facts)
        assert "use the network, write files as uid 65534" in warning and "signal the grader" not in warning
    finally:
        grading.isolation.cache_clear()
