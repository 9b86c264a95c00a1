"""dtype: auto decides per machine: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""

from __future__ import annotations

import torch

from d3d.models.target import torch_dtype
from d3d.utils import hardware

AVX2 = "processor : 0\nmodel name : AMD EPYC\nflags : fpu sse avx avx2 fma\n\nprocessor : 1\nflags : x\n"
AMX = "processor : 0\nmodel name : Intel Xeon\nflags : avx avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"


def test_parse_cpuinfo_reads_the_first_processor():
    assert hardware.parse_cpuinfo(AVX2) == ("AMD EPYC", {"fpu", "sse", "avx", "avx2", "fma"})
    assert "amx_bf16" in hardware.parse_cpuinfo(AMX)[1]


def _machine(monkeypatch, text):
    model, flags = hardware.parse_cpuinfo(text)
    info = {"model": model, "simd": None, "flags": sorted(flags), "native_bf16": bool(flags & set(hardware.BF16_FLAGS))}
    monkeypatch.setattr(hardware, "cpu_info", lambda: info)


def test_auto_is_fp32_on_avx2_and_bf16_with_native_bf16(monkeypatch):
    monkeypatch.delenv("D3D_CPU_BF16", raising=False)
    _machine(monkeypatch, AVX2)
    assert torch_dtype("auto", "cpu") == torch.float32
    assert torch_dtype("auto", "cuda") == torch.bfloat16
    _machine(monkeypatch, AMX)
    assert torch_dtype("auto", "cpu") == torch.bfloat16
    assert torch_dtype("float32", "cpu") == torch.float32  # an explicit dtype is never second-guessed
    monkeypatch.setenv("D3D_CPU_BF16", "0")
    assert torch_dtype("auto", "cpu") == torch.float32


def test_results_record_the_cpu():
    from d3d.utils.runinfo import run_info

    cpu = run_info("cpu")["cpu"]
    assert cpu["model"] and isinstance(cpu["native_bf16"], bool) and isinstance(cpu["flags"], list)


def test_training_precision_follows_the_cpu(monkeypatch):
    """train.mixed_precision=auto (and pruning's recovery and estimator): bf16 autocast where bf16
    is native, fp32 on AVX2-only CPUs; an explicit setting is kept."""
    from d3d.training import autocast, mixed_precision

    monkeypatch.delenv("D3D_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _machine(monkeypatch, AVX2)
    assert mixed_precision("auto") == "no"
    assert mixed_precision("bf16") == "bf16"
    _machine(monkeypatch, AMX)
    assert mixed_precision("auto") == "bf16"
    assert mixed_precision("no") == "no"
    with autocast("bf16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast("no", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
