"""The smallest job the SLURM script can run: form the process group as d3d.eval does, gather every
process's rank, print it. `python -m tests.stand_ins.world` under `accelerate launch`."""

from __future__ import annotations

import torch.distributed as dist

from d3d.models.target import process_state
from d3d.utils.process_group import describe_group

state = process_state(120.0)
ranks: list = [None] * state.num_processes
dist.all_gather_object(ranks, state.process_index)
print(f"world: process {state.process_index} of {describe_group(state.num_processes)}, ranks {ranks}", flush=True)
dist.destroy_process_group()
