"""scripts/gpu_check.py's own checks on the CPU: the race check passes on a correct loop and fails
on a broken hand-off; async against sync holds what each dtype allows (DESIGN §10); the runner
skips what its budget cannot hold, keeps every finished sub-step when killed, and its H200
estimate (graphs counted with a counting compile backend) fits 6 minutes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def check():
    import torch

    # one thread per op: on 2 shared cores two OpenMP teams made these minutes instead of seconds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_script("gpu_check")
    torch.set_num_threads(threads)


def test_race_check_passes_on_the_cpu_worker_thread(check):
    res = check.stage_race("cpu", new_tokens=24)
    assert res["overlap"] == "thread" and res["some_hits"], res
    assert res["ok"], res["runs"]


def stale_hand_off(monkeypatch):
    """Break the thread hand-off on purpose: the worker builds its trays from the previous round's
    drafts and distributions, as a worker that read them before this round's were ready would."""
    from d3d.decoding import methods

    real = methods.Async.beside_verify

    def broken(self, r):
        prev, self._prev = getattr(self, "_prev", None), (r.drafts, self.q_logits)
        if self.p.pool is None or prev is None or prev[0].shape != r.drafts.shape:
            return real(self, r)
        fresh, self.q_logits = self.q_logits, prev[1]
        try:
            real(self, replace(r, drafts=prev[0]))  # the worker's arguments are taken here
        finally:
            self.q_logits = fresh

    monkeypatch.setattr(methods.Async, "beside_verify", broken)


def test_race_check_fails_on_a_broken_thread_hand_off(check, monkeypatch):
    """Tokens stay right (verification decides them), so only τ and hits show the bug: token
    equality alone would not be a race check."""
    stale_hand_off(monkeypatch)
    res = check.stage_race("cpu", new_tokens=24)
    assert not res["ok"]
    assert all(r["tokens_equal"] for r in res["runs"]) and not all(r["tau_equal"] for r in res["runs"]), res["runs"]


def test_async_against_sync_holds_tau_in_fp32_and_tokens_in_bf16(check):
    res = check.stage_async_sync("cpu", new_tokens=24)
    fp32, bf16 = res["float32"], res["bfloat16"]
    assert fp32["tokens_equal"] == fp32["tau_equal"] == fp32["runs"] > 0, fp32
    assert bf16["real"] == 0 and bf16["runs"] > 0, bf16["details"]
    assert res["ok"]


def test_a_stage_the_budget_cannot_hold_is_recorded_as_skipped(check, tmp_path, monkeypatch):
    """--budget-s: a stage whose H200 estimate (async_sync: 5 s) does not fit in what is left is
    not started but recorded skipped, with its reason; the run does not count it as a failure.
    A fake clock: the first stage (race, stubbed) takes 46 of the 50 s."""
    import json
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(check, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def race(*args, **kw):
        clock[0] = 46.0
        return {"ok": True}

    monkeypatch.setattr(check, "stage_race", race)
    report = check.main(["--device", "cpu", "--out-dir", str(tmp_path), "--stages", "race", "async_sync",
                         "--budget-s", "50"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["stages"]["race"]["status"] == "ok"
    late = saved["stages"]["async_sync"]
    assert late["status"] == "skipped" and late["steps"] == {}
    assert late["reason"] == "budget: 5 s estimated, 4 s of --budget-s 50 left"
    assert saved["skipped"] == ["async_sync"] and report["ok"]


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
            if len(written) == 3:  # inside the greedy stage, which has 10
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


def test_the_default_run_fits_six_minutes_on_an_h200_by_its_estimate(check):
    plan = check.ESTIMATE.table(check.STAGES)
    assert set(plan["seconds"]) == {"startup", *check.STAGES}
    assert plan["total_s"] <= 360, plan
    assert plan["total_s"] < 420 < 480  # the default --budget-s, inside the README's `timeout 480`


@pytest.mark.slow
def test_graph_counts_of_the_compiled_stages_fit_the_budget(check):
    """Count the graphs the compiled stages make with a counting torch.compile backend on the toy
    models (the toy timing drafter differs from its target in structure, as 1.7B does from 8B);
    the estimate's counts are these, and the default run with them still fits 6 minutes."""
    counted = {"compiled_equal": check.count_graphs(lambda: check.stage_compiled_equal("cpu", toy=False))}
    for method in ("ar", "sync"):
        counted[method] = check.count_graphs(lambda: check.stage_compiled_timing("cpu", toy=True, methods=(method,)))
    assert sum(counted["compiled_equal"].values()) == sum(check.Estimate.GRAPHS["compiled_equal"].values())
    assert {m: counted[m] for m in ("ar", "sync")} == {m: check.Estimate.GRAPHS[m] for m in ("ar", "sync")}
    assert check.Estimate(graphs=counted).table(check.STAGES)["total_s"] <= 360
