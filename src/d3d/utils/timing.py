"""One way to time a short piece of work for the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, device: torch.device, repeats: int, setup=None) -> float:
    """Median milliseconds of fn() over `repeats` runs after one warm-up, device-synchronised.

    With `setup`, each run first calls setup() outside the timed region and times fn(setup()):
    for work that consumes its input, e.g. a pass that appends to a freshly built KV cache."""
    times = []
    for _ in range(repeats + 1):
        arg = setup() if setup is not None else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:])
