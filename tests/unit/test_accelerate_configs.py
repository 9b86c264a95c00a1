"""conf/accelerate/*.yaml bound to the code that reads them: each file goes through accelerate's own
launcher (argument validation and the environment it gives every process), and what d3d takes from
that environment is what the file says. ZeRO-3 cannot run on these CPUs (DeepSpeed 0.19 runs ZeRO
0/1/2 there), so its file is held by this test rather than by a run."""

from __future__ import annotations

import pytest

from d3d.settings import bind_config
from d3d.training import deepspeed_plugin
from tests.conftest import ROOT, compose

CONFIGS = sorted((ROOT / "conf" / "accelerate").glob("*.yaml"))


def launch_env(path, *extra: str) -> tuple[object, dict[str, str]]:
    """accelerate launch's parsed arguments and the variables each process gets, for one file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(path), *extra, "x.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # what accelerate's launch_command does before its DeepSpeed launcher
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return args, prepare_multi_gpu_env(args)
    return args, prepare_simple_launcher_cmd_env(args)[1]


def test_every_launch_config_is_read_by_accelerate():
    assert {p.name for p in CONFIGS} >= {"single.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero2.yaml",
                                         "deepspeed_zero3.yaml"}
    for path in CONFIGS:
        args, env = launch_env(path)
        assert env["ACCELERATE_MIXED_PRECISION"] in ("no", "bf16"), path.name


@pytest.mark.parametrize("name", ["fsdp.yaml"])
def test_fsdp_configs_are_fsdp2_full_shard(name):
    """d3d shards with FSDP2 (DTensor parameters; FSDP1 is refused at start, d3d.training.check_sharding)."""
    _, env = launch_env(ROOT / "conf" / "accelerate" / name)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("true", "2", "true")
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("name, stage", [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_configs_reach_the_plugin(name, stage, monkeypatch):
    """The stage each file names is the one the DeepSpeed plugin is built with, its batch keys train.*'s."""
    _, env = launch_env(ROOT / "conf" / "accelerate" / name)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    tc = bind_config(compose("train", ["+experiment=qwen3_8b", "train.global_batch_size=256"]), "train").train
    plugin = deepspeed_plugin(tc, "bf16")
    assert plugin.zero_stage == stage and plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == tc.batch_size
