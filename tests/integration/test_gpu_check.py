"""scripts/gpu_check.py, the runner, on the CPU: killed mid-stage, it keeps every finished sub-step
(its budget bookkeeping, which runs no stage, is in tests/unit/test_gpu_check.py; the checks it runs
are tests/integration/test_gpu.py, with their CPU variants in the default suite)."""

from __future__ import annotations


def test_killed_mid_stage_the_json_holds_every_finished_sub_step(tmp_path):
    """SIGKILL the toy run once a few sub-steps have landed: every sub-step it reported written
    (it reports only after the file is replaced) is in gpu_check.json, which still parses."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--toy", "--out-dir",
                             str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    written = []
    try:
        for line in proc.stdout:
            if line.startswith("[gpu_check] step "):
                written.append(line.split()[2])
            if len(written) == 3:  # inside the greedy stage, which has 10 tests
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        rest, _ = proc.communicate(timeout=60)
    written += [ln.split()[2] for ln in rest.splitlines() if ln.startswith("[gpu_check] step ")]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    on_disk = {f"{stage}/{step}" for stage, rec in saved["stages"].items() for step in rec["steps"]}
    assert len(written) >= 3 and set(written) <= on_disk, (written, on_disk)
    assert saved["stages"]["greedy"]["status"] == "running"  # killed inside it: no verdict, its steps kept
