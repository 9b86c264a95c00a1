"""d3d.utils.timing.timed: the one timing loop the benchmark scripts and pruning share."""

from __future__ import annotations

import torch

from d3d.utils.timing import timed


def test_setup_runs_before_every_repeat_and_feeds_fn():
    made, seen = [], []

    def setup():
        made.append(len(made))
        return made[-1]

    ms = timed(seen.append, torch.device("cpu"), repeats=3, setup=setup)
    assert made == [0, 1, 2, 3]  # one warm-up + three timed runs, each with its own input
    assert seen == made
    assert ms >= 0.0


def test_without_setup_fn_takes_no_argument():
    calls = []
    timed(lambda: calls.append(1), torch.device("cpu"), repeats=2)
    assert len(calls) == 3
