"""The GPU check's process-group stage (scripts/gpu_check.py `dist`, scripts/gpu_dist_check.py) on the
CPU: two gloo processes under torchrun with conf/accelerate/fsdp.yaml's launch variables, in
processes that cannot import hydra, omegaconf, datasets or deepspeed (the GPU image has none of
them). FSDP2 shards every parameter, the loss falls, the in-training evaluation gathers the drafter
and sums its counts, and the group's timeout read back is conf/dist/default.yaml's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.heavy  # torchrun: two processes, ~90 s on 2 cores


def test_the_dist_stage_forms_a_group_with_the_configured_timeout(tmp_path, monkeypatch):
    import yaml

    from tests.conftest import ROOT, load_script

    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(  # every process of the stage, torchrun's workers included
        "import sys\nsys.modules.update(dict.fromkeys(['hydra', 'omegaconf', 'datasets', 'deepspeed']))\n")
    monkeypatch.setenv("PYTHONPATH", str(blocker))
    res = load_script("gpu_check").stage_dist("cpu", tmp_path, toy=True)
    assert res["ok"], res["tail"]
    run = res["result"]
    shipped = yaml.safe_load((ROOT / "conf" / "dist" / "default.yaml").read_text())["timeout_s"]
    assert (run["backend"], run["processes"], run["timeout_s_in_force"]) == ("gloo", 2, shipped)
    assert run["distributed_type"] == "FSDP" and run["dtensor_params"] == run["params"] > 0
    assert len(run["losses"]) == 4 and run["losses"][-1] < run["losses"][0] and run["val_rounds"] > 0
