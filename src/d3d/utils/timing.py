"""One way to time a short piece of work for the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` runs after one warm-up, device-synchronised."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:])
