"""What the CPU can do, for `dtype: auto` and for every result's record.

bf16 is the right dtype on CPUs with native bf16 matrix instructions (AVX512-BF16, AMX-BF16): a
16-token bf16 pass there costs ~1.1x a 1-token pass and bf16 is no slower per token than fp32.
On AVX2-only CPUs bf16 is emulated, bf16 matmuls run 1.6x (16 rows) to 3x (64 rows) slower than
fp32, and fp32 is right (docs/design.md, dtype). So `auto` decides from the CPU's flags, read from
/proc/cpuinfo (Linux) or, failing that, from torch's own capability probe. D3D_CPU_BF16=1/0 overrides the decision.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# flags a CPU figure depends on, kept in every record: vector width, fused multiply-add, bf16/fp16 paths
RECORDED_FLAGS = ("avx", "amx", "fma", "f16c")

# AMD's family/model numbering -> core generation, for the CPUs whose figures the pages quote (AMD's
# processor programming references: family 19h models 00h-0Fh are Zen 3 EPYC (Milan), 10h-1Fh and
# A0h-AFh Zen 4 EPYC (Genoa, Bergamo/Siena); family 1Ah is Zen 5). Nothing else is guessed: an Intel
# CPU under a hypervisor reports a generic name and model, so its label keeps the recorded numbers.
AMD_GENERATIONS = ((25, range(0x00, 0x10), "Zen 3"), (25, range(0x10, 0x20), "Zen 4"), (25, range(0xA0, 0xB0), "Zen 4"),
                   (26, range(0x00, 0x100), "Zen 5"))


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


def cpu_identity(text: str) -> dict:
    """`lscpu`'s Vendor ID, CPU family and Model of the first processor in a /proc/cpuinfo text."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not key and found:  # the first processor's block has ended
            break
        if key == "vendor_id":
            found["vendor"] = value
        elif key == "cpu family" and value.isdigit():
            found["family"] = int(value)
        elif key == "model" and value.isdigit():
            found["model_number"] = int(value)
    return found


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """CPU model name, vendor, family and model number, the flags its figures depend on
    (RECORDED_FLAGS) and torch's SIMD capability."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    return {"model": model or platform.processor() or platform.machine(), **cpu_identity(text), "simd": capability,
            "flags": sorted(f for f in flags if f in BF16_FLAGS or f.startswith(RECORDED_FLAGS)),
            "native_bf16": bool(flags & set(BF16_FLAGS))}


def cpu_label(cpu: dict | None, cuda: str | None = None, noted: str = "") -> str:
    """How a page names the machine of a record, from what the record holds (run.cpu, run.cuda) and
    nothing else: the model name, family/model (and AMD's generation for them) where recorded, the
    widest vector unit and whether bf16 is native. A record without them says so; `noted` says where
    family/model came from when not from the record."""
    if cuda:
        return cuda
    if not cpu:
        return "CPU not recorded"
    flags = set(cpu.get("flags") or ())
    unit = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else
            "AVX-512" if any(f.startswith("avx512") for f in flags) else "AVX2" if "avx2" in flags else
            cpu.get("simd") or "flags not recorded")
    family, number = cpu.get("family"), cpu.get("model_number")
    if family is None or number is None:
        where = "family/model not recorded"
    else:
        where = f"family {family} model {number}" + (f" {noted}" if noted else "")
        generation = next((g for f, models, g in AMD_GENERATIONS if f == family and number in models), None)
        if generation and "AMD" in (cpu.get("vendor") or cpu.get("model") or ""):
            where += f"{';' if noted else ','} {generation}"
    bf16 = "native bf16" if cpu.get("native_bf16") else "no native bf16"
    return f"{cpu.get('model') or 'CPU'} ({where}), {unit}, {bf16}"


def cpu_prefers_bf16() -> bool:
    override = os.environ.get("D3D_CPU_BF16")
    if override in ("0", "1"):
        return override == "1"
    return cpu_info()["native_bf16"]
