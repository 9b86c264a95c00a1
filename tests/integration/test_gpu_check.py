"""scripts/gpu_check.py's own checks on the CPU: the race check passes on a correct loop and fails
on a broken hand-off, and async against sync holds what each dtype allows (DESIGN §10)."""

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
        if self.g.pool is None or prev is None or prev[0].shape != r.drafts.shape:
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
