"""What the CPU can do, for `dtype: auto` and for every result's record.

bf16 is the right dtype on CPUs with native bf16 matrix instructions (AVX512-BF16, AMX-BF16): a
16-token bf16 pass there costs ~1.1x a 1-token pass and bf16 is no slower per token than fp32.
On AVX2-only CPUs bf16 is emulated, multi-row bf16 matmuls run 2-7x slower than fp32, and fp32 is
right (docs/results.md). So `auto` decides from the CPU's flags, read from /proc/cpuinfo (Linux)
or, failing that, from torch's own capability probe. D3D_CPU_BF16=1/0 overrides the decision.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text."""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """CPU model, its bf16-relevant flags and torch's SIMD capability."""
    try:
        with open("/proc/cpuinfo") as fh:
            model, flags = parse_cpuinfo(fh.read())
    except OSError:
        model, flags = None, set()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    return {"model": model or platform.processor() or platform.machine(), "simd": capability,
            "flags": sorted(f for f in flags if f in BF16_FLAGS or f.startswith("avx")),
            "native_bf16": bool(flags & set(BF16_FLAGS))}


def cpu_prefers_bf16() -> bool:
    override = os.environ.get("D3D_CPU_BF16")
    if override in ("0", "1"):
        return override == "1"
    return cpu_info()["native_bf16"]
