"""dtype: auto decides per machine: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""

from __future__ import annotations

from pathlib import Path

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


ZEN4 = ("processor : 0\nvendor_id : AuthenticAMD\ncpu family : 25\nmodel : 17\nmodel name : AMD EPYC\n"
        "flags : avx avx2 fma avx512f avx512_bf16\n\nprocessor : 1\ncpu family : 99\n")


def test_records_name_the_cpu_by_family_and_model_and_labels_say_only_what_a_record_holds():
    assert hardware.cpu_identity(ZEN4) == {"vendor": "AuthenticAMD", "family": 25, "model_number": 17}
    zen4 = {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": 25, "model_number": 17,
            "flags": ["avx2", "avx512_bf16"], "native_bf16": True}
    assert hardware.cpu_label(zen4) == "AMD EPYC (family 25 model 17, Zen 4), AVX-512 BF16, native bf16"
    zen3 = {**zen4, "model_number": 1, "flags": ["avx", "avx2", "fma"], "native_bf16": False}
    assert hardware.cpu_label(zen3) == "AMD EPYC (family 25 model 1, Zen 3), AVX2, no native bf16"
    intel = {"model": "Intel(R) Xeon(R) Processor", "vendor": "GenuineIntel", "family": 6, "model_number": 167,
             "flags": ["amx_bf16", "avx2"], "native_bf16": True}
    assert hardware.cpu_label(intel) == "Intel(R) Xeon(R) Processor (family 6 model 167), AMX, native bf16"
    old = {"model": "AMD EPYC", "flags": ["avx", "avx2"], "native_bf16": False}  # a record from before family/model
    assert hardware.cpu_label(old) == "AMD EPYC (family/model not recorded), AVX2, no native bf16"
    assert hardware.cpu_label(None) == "CPU not recorded" and hardware.cpu_label(None, "NVIDIA H100") == "NVIDIA H100"
    here = hardware.cpu_identity(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").is_file() else {}
    assert {k: hardware.cpu_info().get(k) for k in here} == here  # what this machine's records carry
