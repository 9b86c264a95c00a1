"""Scheduler jobs as distributed runs: the Hydra callback conf/hydra/launcher/{slurm,local}.yaml install.

Hydra's submitit launcher starts the task function once per task of a job (tasks_per_node x nodes,
one task per GPU), with the scheduler's view of its rank but none of the variables torch.distributed
reads at `init_process_group("env://")`, which `accelerate launch` and torchrun set. Without them every
task would train the whole run alone and write the same folders. The callback exports them in each task
before the task runs, so d3d.train, d3d.prune and d3d.eval see what they see under torchrun: the DDP
data-parallel step, ranks that shard eval items, one process that writes."""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback

from d3d.utils.process_group import accelerate_environment

TORCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class DistributedTasks(Callback):
    """A `hydra.callbacks` entry: Hydra calls on_job_start inside the job, before the task function.
    `accelerate`: a file of conf/accelerate/ by name (e.g. fsdp): every task also gets the variables
    `accelerate launch --config_file` that file gives its processes, so the job shards as that launch
    does (FSDP2 for an 8B drafter); null: the plain data-parallel run (DDP)."""

    def __init__(self, accelerate: str | None = None) -> None:
        self.accelerate = accelerate

    def on_job_start(self, config: Any = None, **kwargs: Any) -> None:
        tasks = export_task_environment()
        if self.accelerate and tasks:
            os.environ.update(accelerate_environment(self.accelerate, int(tasks["WORLD_SIZE"])))


def export_task_environment() -> dict[str, str]:
    """MASTER_ADDR/PORT (the job's first host; a port drawn from the job id), RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE of this submitit task, as exported; nothing for a one-task job
    or outside submitit. CUDA_VISIBLE_DEVICES stays as the scheduler set it: accelerate picks
    cuda:LOCAL_RANK among the node's GPUs."""
    import submitit

    try:
        job = submitit.JobEnvironment()
    except RuntimeError:  # not inside a submitit job: nothing to translate
        return {}
    if job.num_tasks <= 1:
        return {}
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return {k: os.environ[k] for k in TORCH_VARIABLES}
