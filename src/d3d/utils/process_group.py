"""The process group of a multi-process job, created with d3d's timeout (`dist.timeout_s`).

d3d.train and d3d.prune form it through their Accelerator (d3d.training.make_accelerator), d3d.eval
through accelerate's PartialState (d3d.models.target.process_state); both end in one
`torch.distributed.init_process_group` call, which takes the keyword arguments below. Without them
an NCCL group aborts any collective or barrier that waits 600 s, which rank 0's writes of an 8B
drafter and eval's end barrier outlast. Needs torch only (the GPU check imports it on a bare image).
"""

from __future__ import annotations

from datetime import timedelta


def group_kwargs(timeout_s: float) -> dict:
    """What d3d passes to `init_process_group` (through accelerate's PartialState or
    InitProcessGroupKwargs, or directly): the timeout."""
    return {"timeout": timedelta(seconds=timeout_s)}


def group_timeout_s() -> float | None:
    """The timeout in force on the default process group, read back from its backend (gloo or
    NCCL); None when this process has no group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()


def describe_group(processes: int) -> str:
    """One line for a job's log: its processes and the timeout in force (read back, not the config's)."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    return f"{processes} processes ({backend}), process-group timeout {group_timeout_s():.0f} s (dist.timeout_s)"


def accelerate_environment(name: str, processes: int) -> dict[str, str]:
    """The ACCELERATE_* and FSDP_* variables `accelerate launch --config_file conf/accelerate/<name>.yaml
    --num_processes <processes>` gives each process, made by accelerate's own launcher code from the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    from d3d.configdir import config_dir
    from d3d.errors import ConfigError

    path = config_dir() / "accelerate" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"hydra.callbacks.distributed_tasks.accelerate={name}: no conf/accelerate/{name}.yaml. "
                          f"Fix: fsdp or ddp.")
    args = launch_command_parser().parse_args(["--config_file", str(path), "--num_processes", str(processes), "d3d"])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        raise ConfigError(f"hydra.callbacks.distributed_tasks.accelerate={name}: DeepSpeed starts its processes with "
                          f"its own launcher. Fix: fsdp, or submit with scripts/slurm/d3d.sbatch.")
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}
