"""d3d.utils.cluster and conf/hydra/launcher/: a submitit task gets the rank variables torchrun would
give it, and the launcher files compose over conf/hydra/default.yaml. The multirun that runs through
them is in tests/integration/test_sweeps.py."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e .[cluster]")

from d3d.utils.cluster import TORCH_VARIABLES, export_task_environment


@pytest.fixture
def clean_env(monkeypatch):
    for name in TORCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def local_task(env, task: int, tasks: int) -> None:
    """The variables submitit's local executor sets in task `task` of a one-node job of `tasks` tasks."""
    for key, value in {"SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": tasks, "SUBMITIT_LOCAL_JOB_NUM_NODES": 1,
                       "SUBMITIT_LOCAL_NODEID": 0, "SUBMITIT_LOCAL_GLOBALID": task, "SUBMITIT_LOCAL_LOCALID": task,
                       "SUBMITIT_EXECUTOR": "local"}.items():
        env.setenv(key, str(value))


def test_each_task_of_a_job_gets_its_rank(clean_env):
    local_task(clean_env, 1, 2)
    got = export_task_environment()
    assert {k: got[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert got["MASTER_ADDR"] == socket.gethostname() and 20000 <= int(got["MASTER_PORT"]) <= 60000
    local_task(clean_env, 0, 2)
    assert export_task_environment()["MASTER_PORT"] == got["MASTER_PORT"]  # every task of the job agrees


def test_a_job_named_to_shard_with_fsdp_gets_the_fsdp_launch_variables(clean_env):
    """hydra.callbacks.distributed_tasks.accelerate=fsdp (an 8B overlay's sweep): each task also gets
    what `accelerate launch --config_file conf/accelerate/fsdp.yaml` gives its processes, for the
    job's task count; without it, a task is the DDP run's."""
    import os

    from d3d.utils.cluster import DistributedTasks
    from d3d.utils.process_group import accelerate_environment

    for name in {*accelerate_environment("fsdp", 2), *(k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_")))}:
        clean_env.setenv(name, "")  # recorded, so the callback's exports are undone after the test
        clean_env.delenv(name)
    local_task(clean_env, 1, 2)
    DistributedTasks().on_job_start()
    assert "ACCELERATE_USE_FSDP" not in os.environ
    DistributedTasks(accelerate="fsdp").on_job_start()
    assert (os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_VERSION"]) == ("true", "2")
    assert os.environ["RANK"] == "1"


def test_a_one_task_job_and_a_plain_run_are_left_alone(clean_env):
    import os

    assert export_task_environment() == {}  # no submitit job here
    local_task(clean_env, 0, 1)
    assert export_task_environment() == {} and "RANK" not in os.environ


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_launcher_files_compose_with_the_project_hydra_config(launcher):
    """`hydra/launcher=<name>` on any recipe: the submitit launcher, the callback, and the project's own
    run and sweep folders (conf/hydra/default.yaml) kept."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from d3d.configdir import config_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", [f"hydra/launcher={launcher}", "+experiment=smoke"], return_hydra_config=True)
    hydra = cfg.hydra
    target = {"slurm": "SlurmLauncher", "local": "LocalLauncher"}[launcher]
    assert hydra.launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
    assert hydra.callbacks.distributed_tasks._target_ == "d3d.utils.cluster.DistributedTasks"
    assert hydra.callbacks.distributed_tasks.accelerate is None  # DDP unless a run names fsdp
    assert hydra.sweep.subdir == "+experiment-smoke"  # conf/hydra/default.yaml: the slug of the overrides
    if launcher == "slurm":
        assert (hydra.launcher.nodes, hydra.launcher.gpus_per_node, hydra.launcher.tasks_per_node) == (1, 8, 8)
        assert hydra.launcher.partition is None and hydra.launcher.timeout_min > 0
