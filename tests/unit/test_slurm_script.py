"""scripts/slurm/d3d.sbatch's launch lines, without launching: under the stand-in srun and scontrol
(tests/stand_ins/) and a stand-in `python` that prints its arguments, a 4 x 8 allocation gives four
tasks, each an `accelerate launch` with its own node rank, and accelerate's own parser reads each
line as one node of a 32-process job. The runs it starts (2 nodes x 1 process, train and prune
under FSDP2) are tests/integration/test_slurm.py."""

from __future__ import annotations

import shlex

from tests.conftest import ROOT
from tests.stand_ins import sbatch


def test_a_4x8_allocation_gives_each_node_its_own_launch_line(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "node $SLURM_NODEID: $*"\n')
    fake.chmod(0o755)
    run = sbatch(ROOT / "scripts" / "slurm" / "d3d.sbatch", ["conf/accelerate/fsdp.yaml", "d3d.train",
                 "+experiment=qwen3_8b_d8b", "train.global_batch_size=256"], nodes=4, gpus_per_node=8, port=29511,
                 timeout=60, env={"PATH": f"{tmp_path}:{ROOT / 'tests' / 'stand_ins'}:/usr/bin:/bin",
                                  "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_GPUS_ON_NODE": ""})
    assert run.returncode == 0, run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("node "))
    assert [line.split(":")[0] for line in lines] == ["node 0", "node 1", "node 2", "node 3"], run.stdout
    for rank, line in enumerate(lines):
        argv = shlex.split(line.split(": ", 1)[1])
        assert argv[:2] == ["-m", "accelerate.commands.launch"]
        assert argv[argv.index("-m", 2):] == ["-m", "d3d.train", "+experiment=qwen3_8b_d8b", "train.global_batch_size=256"]
        args = launch_command_parser().parse_args(argv[2:])
        args, _, _ = _validate_launch_command(args)
        assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, rank)
        assert (args.main_process_ip, args.main_process_port, args.use_fsdp) == ("gpu07", 29511, True)


def test_the_gpu_count_is_read_from_what_sbatch_was_given(tmp_path):
    """--gpus-per-node h100:8 reaches the script as SLURM_GPUS_PER_NODE=h100:8 (no SLURM_GPUS_ON_NODE
    on some versions)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "node $SLURM_NODEID: $*"\n')
    fake.chmod(0o755)
    run = sbatch(ROOT / "scripts" / "slurm" / "d3d.sbatch", ["conf/accelerate/fsdp.yaml", "d3d.train"], nodes=2,
                 gpus_per_node=8, port=29511, timeout=60,
                 env={"PATH": f"{tmp_path}:{ROOT / 'tests' / 'stand_ins'}:/usr/bin:/bin", "SLURM_GPUS_ON_NODE": "",
                      "SLURM_GPUS_PER_NODE": "h100:8"})
    assert run.returncode == 0, run.stderr
    assert "--num_machines 2 --num_processes 16" in run.stdout
