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


# Device work queued ahead of a timed call: ~50 ms at the ~2 GHz SM clock of an H100/H200, longer
# than the host takes to issue any single pass the readiness script times (an eager 8B verify is
# ~20 ms of host time). `device_and_host_ms` checks that it was long enough, every time.
SLEEP_CYCLES = 100_000_000


def device_and_host_ms(fn, device: torch.device, repeats: int, setup=None) -> dict:
    """Median device time and host issue time (ms) of fn(), apart, over `repeats` runs after one
    warm-up (`setup` as in `timed`).

    On CUDA, a synchronize and then `torch.cuda._sleep` leave the device busy while the host issues
    fn's kernels, so CUDA events around fn time the kernels back to back: device time without the
    gaps where the device waited for the host. perf_counter around the call is the host's issue
    time. When the host took longer than the sleep (or fn synchronised), the device did wait inside
    the events: `ran_dry` says so, and device_ms is then only an upper bound. On the CPU ops run as
    they are issued: device and host time are both the call's wall time."""
    cuda = device.type == "cuda"
    dev, host, dry = [], [], []
    for _ in range(repeats + 1):
        arg = setup() if setup is not None else None
        if cuda:
            torch.cuda.synchronize(device)
            sleep0, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            sleep0.record()
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
        t = time.perf_counter()
        fn(arg) if setup is not None else fn()
        issued = time.perf_counter() - t
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            dev.append(start.elapsed_time(end) / 1000)
            dry.append(issued >= sleep0.elapsed_time(start) / 1000)
        else:
            dev.append(issued)
            dry.append(False)
        host.append(issued)
    return {"device_ms": 1000 * statistics.median(dev[1:]), "host_issue_ms": 1000 * statistics.median(host[1:]),
            "ran_dry": any(dry[1:])}
