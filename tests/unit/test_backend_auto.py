"""decode.backend=auto, the GPU overlays' backend: `compiled` where the GPU check passed its compiled
stages on this GPU model under this torch, eager otherwise (a failing, missing or other GPU's record),
and on a CPU the CPU default, as before. No model: records written here, CUDA's presence and the
GPU's name stubbed."""

from __future__ import annotations

import json

import pytest
import torch

from d3d.decoding.config import COMPILED_STAGES, resolve_backend
from tests.conftest import compose

GPU = "NVIDIA H200"


def record(path, stages=None, **env):
    """A gpu_check.json as scripts/gpu_check.py writes it: both parts run, every compiled stage ok."""
    rec = {"env": {"device": "cuda", "device_name": GPU, "torch": torch.__version__, "toy": False, **env},
           "stages": {name: {"status": "ok"} for name in ("greedy", "race", *COMPILED_STAGES)} | (stages or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return path


def test_auto_is_compiled_where_the_check_passed_on_this_gpu(tmp_path):
    backend, why = resolve_backend("cuda", record(tmp_path / "gpu_check.json"), GPU, torch.__version__)
    assert backend == "compiled" and GPU in why and torch.__version__ in why


@pytest.mark.parametrize("case,expect", [
    ({"stages": {"overlap": {"status": "failed"}}}, "overlap failed"),
    ({"stages": {"compiled_timing": {"status": "skipped"}}}, "compiled_timing skipped"),
    ({"drop": "compiled_equal"}, "compiled_equal not run"),  # part 2 not run yet
    ({"device_name": "NVIDIA H100 80GB HBM3"}, "passed on NVIDIA H100 80GB HBM3, not on this NVIDIA H200"),
    ({"torch": "2.0.0"}, "ran under torch 2.0.0"),
    ({"toy": True}, "not a full-size GPU run"),
    ({"device": "cpu"}, "not a full-size GPU run"),
    ({"missing": True}, "no GPU check record at"),
    ({"garbled": True}, "does not read"),
], ids=["failed", "skipped", "part2-missing", "other-gpu", "other-torch", "toy", "cpu-record", "missing", "garbled"])
def test_auto_is_eager_without_a_passing_record_for_this_gpu(tmp_path, case, expect):
    path = tmp_path / "gpu_check.json"
    case = dict(case)
    if not case.pop("missing", False):
        drop = case.pop("drop", None)
        garbled = case.pop("garbled", False)
        record(path, **case)
        if drop:
            rec = json.loads(path.read_text())
            del rec["stages"][drop]
            path.write_text(json.dumps(rec))
        if garbled:
            path.write_text(path.read_text()[:40])
    backend, why = resolve_backend("cuda", path, GPU, torch.__version__)
    assert backend == "eager" and expect in why and "HOST-BOUND" in why, why


def test_auto_on_a_cpu_is_the_cpu_default_even_beside_a_passing_record(tmp_path):
    """On a CPU auto is what a CPU run decodes with today (conf/decode: eager): the overlay's methods
    bind exactly as those of the same run with no overlay's backend."""
    from d3d.settings import bind_config, method_configs

    assert resolve_backend("cpu", record(tmp_path / "gpu_check.json"), GPU, torch.__version__)[0] == "eager"
    methods = {}
    for backend in ("auto", "eager"):
        cfg = compose("eval", ["target.device=cpu", f"decode.backend={backend}"], tmp_path)
        record(tmp_path / "outputs" / "gpu_check" / "gpu_check.json")  # even where a GPU passed
        methods[backend] = method_configs(cfg, bind_config(cfg, "eval").eval)
    assert methods["auto"] == methods["eager"] and {dc.backend for dc in methods["auto"].values()} == {"eager"}


@pytest.mark.parametrize("experiment", ["qwen3_8b", "qwen3_32b", "qwen3_8b_d8b", "qwen3_32b_d8b"])
def test_the_gpu_overlays_time_compiled_once_the_record_at_paths_gpu_check_passes(experiment, tmp_path, monkeypatch):
    """paths.gpu_check (default: outputs/gpu_check/gpu_check.json, where the README's GPU section has
    the check write) is the record auto reads: on a GPU (stubbed) every method of the overlay binds
    compiled with a passing record there, eager with a failing one; which and why is returned."""
    import d3d.models.target as target
    import d3d.utils.runinfo as runinfo
    from d3d.settings import bind_config, method_configs, resolve_auto_backend

    monkeypatch.setattr(target, "cuda_present", lambda: True)
    monkeypatch.setattr(runinfo, "gpu_name", lambda: GPU)
    for stages, expect in (({}, "compiled"), ({"compiled_equal": {"status": "failed"}}, "eager")):
        cfg = compose("eval", [f"+experiment={experiment}"], tmp_path)
        assert cfg.decode.backend == "auto" and cfg.paths.gpu_check == f"{tmp_path}/outputs/gpu_check/gpu_check.json"
        record(tmp_path / "outputs" / "gpu_check" / "gpu_check.json", stages)
        choice = resolve_auto_backend(cfg)
        assert choice["backend"] == expect, choice
        methods = method_configs(cfg, bind_config(cfg, "eval").eval)
        assert {dc.backend for dc in methods.values()} == {expect}


def test_auto_left_unresolved_is_refused_in_one_line():
    from d3d.errors import ConfigError
    from d3d.decoding import DecodeConfig

    with pytest.raises(ConfigError, match=r"^decode\.backend='auto': auto is chosen where a run starts .* Fix: set "
                                          r"decode\.backend to one of eager, static, compiled, frozen\.$"):
        DecodeConfig(method="sync", backend="auto")


def test_the_gpu_is_named_by_one_reader_that_asks_cuda_nothing(tmp_path, monkeypatch):
    """eval (before anything touches CUDA) and the GPU check (CUDA in use) must name one GPU alike, or
    auto would find the check's record "another GPU's": both read the driver's listing first, which
    asks CUDA nothing, and CUDA's own name only where there is no listing and CUDA is in use already."""
    import d3d.utils.runinfo as runinfo

    listing = tmp_path / "gpus"
    (listing / "0000:18:00.0").mkdir(parents=True)
    (listing / "0000:18:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:  42\n")
    monkeypatch.setattr(runinfo, "NVIDIA_GPUS", listing)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200 (CUDA's spelling)")
    assert runinfo.gpu_name() == "NVIDIA H200"  # the listing, CUDA in use or not
    monkeypatch.setattr(runinfo, "NVIDIA_GPUS", tmp_path / "none")
    assert runinfo.gpu_name() == "NVIDIA H200 (CUDA's spelling)"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert runinfo.gpu_name() is None  # never a CUDA probe of its own


def test_the_gpu_model_matches_across_case_and_spacing(tmp_path):
    """One model spelled with other spacing or case is the same GPU; another model is not."""
    path = record(tmp_path / "gpu_check.json", device_name="NVIDIA  h200 ")
    assert resolve_backend("cuda", path, GPU, torch.__version__)[0] == "compiled"
    assert resolve_backend("cuda", path, "NVIDIA H200 NVL", torch.__version__)[0] == "eager"
