"""scripts/gpu_check.py, the runner, on the CPU: killed mid-stage, it keeps every finished sub-step;
the overlap stage's worker compiles before its go and times after it with nothing left to compile;
the graphs its compiled stages make are the estimate's (its budget bookkeeping, which runs no stage,
is in tests/unit/test_gpu_check.py; the checks it runs are tests/integration/test_gpu.py, with their
CPU variants in the default suite)."""

from __future__ import annotations

import pytest


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


@pytest.mark.heavy
def test_the_overlap_worker_compiles_before_its_go_and_times_after_it(tmp_path):
    """--stages overlap on the toy models: the worker runs the row once (its compiles) before the
    go, then readiness on the same models finds every graph compiled: none compiled after the go,
    none inside the timed call, and the row's loop on the compiled backend is recorded."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--toy", "--out-dir",
                           str(tmp_path), "--stages", "overlap"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    stage = saved["stages"]["overlap"]
    assert proc.returncode == 0 and stage["status"] == "ok", (proc.stdout[-3000:], stage.get("tail"))
    steps = stage["steps"]
    assert steps["prewarm"]["loop_beside_other_stages"]["warmup_s"] > 0 and steps["after_go"]["graphs_compiled"] == 0
    (name, loop), = steps["loops"].items()
    assert name == f"{stage['row']}@compiled" and loop["compiles_in_timed"] == 0 and loop["rounds"] > 0


@pytest.mark.slow
def test_graph_counts_of_the_compiled_stages_are_the_estimates():
    """Count the graphs the compiled stages make with a counting torch.compile backend on the toy
    models (the toy timing drafter differs from its target in structure, as 1.7B does from 8B; the
    overlap row's models are readiness's toy pair): the runner's estimate holds these counts, and
    with them each part still fits 300 s on an H200."""
    from tests.conftest import load_script
    from tests.integration.test_gpu import compiled_against_eager, compiled_cases

    check = load_script("gpu_check")
    readiness = check.readiness
    counted = {"compiled_equal": check.count_graphs(
        lambda: [compiled_against_eager("cpu", *case) for case in compiled_cases(toy=False)])}
    for role, method in check.TIMED.items():  # the plain loop and the drafted one, by role
        counted[role] = check.count_graphs(lambda: check.stage_compiled_timing("cpu", toy=True, methods=(method,)))

    def overlap_row():  # the overlap worker's pre-run: the row's loop on readiness's toy models
        import torch
        from dataclasses import replace

        s = check.READINESS[True]
        target = readiness.random_model(s["target"], "cpu", torch.float32, seed=0)
        drafter = check.as_drafter(readiness.random_model(s["drafter"], "cpu", torch.float32, seed=1), s["block"])
        cfg = replace(readiness.preset_rows(s["preset"], s["block"])[check.overlap_row(True)], backend="compiled")
        readiness.loop_rounds(target, drafter, cfg, s["prefix"], s["tokens"], torch.device("cpu"))

    counted["overlap"] = check.count_graphs(overlap_row)
    assert sum(counted["compiled_equal"].values()) == sum(check.Estimate.GRAPHS["compiled_equal"].values()), counted
    assert {r: counted[r] for r in (*check.TIMED, "overlap")} == \
        {r: check.Estimate.GRAPHS[r] for r in (*check.TIMED, "overlap")}, counted
    for stages in check.PARTS.values():
        assert check.Estimate(graphs=counted).table(stages)["total_s"] <= 300
