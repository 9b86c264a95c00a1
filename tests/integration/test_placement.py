"""Where the models go: `target.device_map` (from_pretrained's, accelerate's big-model placement) and
`drafter.device` (a drafter on a device of its own). On the CPU: the device strings, refused in one
line before any model loads; the placement the memory check counts per device; the device_map path
decoding the default's tokens, through d3d.eval and under the meta-device trap. Two real devices,
and the copies between them, are the GPU check's (tests/integration/test_gpu.py, `test_placement_*`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from d3d.errors import ConfigError
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.utils.io import read_jsonl
from tests.conftest import compose
from tests.integration.conftest import PROMPTS

SMOKE = ["+experiment=smoke", "eval.n=1", "eval.max_new_tokens=12", "decode.C=3", "decode.F=2", "decode.block_size=4",
         "eval.progress=false"]


def evaluate(tmp_path, name: str, *extra, device_map=None):
    """d3d.eval on the smoke setup; `device_map` set in the composed config (Hydra's override grammar
    has no empty key, which {"": device} needs: a YAML overlay writes it as `"": cuda:0`)."""
    from d3d.eval import run_eval

    cfg = compose("eval", SMOKE + [f"eval.out_dir={tmp_path}/{name}", *extra], tmp_path)
    if device_map is not None:
        cfg.target.device_map = device_map
    return run_eval(cfg)


@pytest.mark.parametrize("bad, message", [
    ("drafter.device=cuda:1", r"^drafter.device=cuda:1: this machine has 0 CUDA device\(s\)\. Fix: "),
    ("drafter.device=gpu", r"^drafter.device='gpu': not a device\. Fix: set drafter.device to cpu, cuda or cuda:<i>"),
    ("target.device_map=atuo", r"^target.device_map='atuo': null, auto, or a map of module names to devices\. Fix: "),
    ('target.device_map={model.layers.1: "cuda:1"}', r"^target.device_map=cuda:1: this machine has 0 CUDA device"),
])
def test_a_device_this_machine_lacks_is_one_line_before_any_model_loads(tmp_path, monkeypatch, bad, message):
    import d3d.eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(d3d.eval, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    with pytest.raises(ConfigError, match=message) as err:
        evaluate(tmp_path, "ev", bad)
    assert "\n" not in str(err.value)


def test_the_memory_check_counts_each_device_of_the_placement(tmp_path, monkeypatch):
    """cost.placement: a map's share of the decoder layers per device (the longest module name
    that holds a layer decides), `auto` evenly over the visible GPUs, the drafter on drafter.device
    (`same`: the target's first device), each device with its own memory."""
    from d3d.decoding import cost
    from d3d.settings import bind_config
    from d3d.decoding.cost import placement

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(cost, "memory_bytes", lambda d: {"cuda:0": 80, "cuda:1": 81, "cuda:2": 82, "cuda:3": 83}[d])
    cfg = bind_config(compose("eval", SMOKE, tmp_path), "eval")
    spread = {"model.embed_tokens": 0, "model": "cuda:1", "model.layers.2": 2, "model.layers.3": "cuda:2", "lm_head": 2}
    where = placement(replace(cfg.target, device_map=spread), replace(cfg.drafter, device="cuda:3"), 4)
    assert where.target == {"cuda:1": 0.5, "cuda:2": 0.5} and where.drafter == "cuda:3"
    assert where.memory == {"cuda:1": 81, "cuda:2": 82, "cuda:3": 83}
    auto = placement(replace(cfg.target, device_map="auto"), cfg.drafter, 4)
    assert auto.target == {f"cuda:{i}": 0.25 for i in range(4)} and auto.drafter == "cuda:0"


def test_eval_with_a_placed_target_and_drafter_gives_the_default_rows(tmp_path, monkeypatch):
    """target.device_map={"": cpu} (from_pretrained's device_map) and drafter.device=cpu decode the
    tokens of the default placement, and run.json says where each model was."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    default = evaluate(tmp_path, "default")
    placed = evaluate(tmp_path, "placed", "drafter.device=cpu", device_map={"": "cpu"})
    rows = {p: {(r["method"], r["id"]): r["token_ids"] for r in read_jsonl(p / "rows.jsonl")} for p in (default, placed)}
    assert rows[placed] == rows[default] and len(rows[placed]) == 3
    assert json.loads((placed / "run.json").read_text())["placement"] == {"target": ["cpu"], "drafter": "cpu"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["sync", "async"])
def test_a_device_map_target_is_device_clean_under_the_meta_trap(models, tmp_path, method, temperature):
    """The target reloaded through from_pretrained(device_map={"": cpu}) beside its drafter: the
    loop's tensors and the copies between the two (Passes.to_drafter / to_target) name their
    devices, so the meta-device trap passes, with the tokens of the target loaded plainly."""
    from d3d.models.target import load_model

    target, drafter, tok = models
    target.save_pretrained(tmp_path / "target")
    placed = load_model(str(tmp_path / "target"), "float32", device_map={"": "cpu"})
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    cfg = DecodeConfig(method=method, block_size=4, C=3, F=2, max_new_tokens=16, temperature=temperature)
    plain = SpecGenerator(target, tok, drafter, cfg, seed=3).generate(prompts)
    torch.set_default_device("meta")
    try:
        res = SpecGenerator(placed, tok, drafter, cfg, seed=3).generate(prompts)
    finally:
        torch.set_default_device(None)
    assert res.token_ids == plain.token_ids and res.taus() == plain.taus()
