"""One rank of a real multi-process training run, started by `torchrun --nproc_per_node N` (gloo on
CPU) from tests/integration/test_train.py. Trains through d3d.train's recipe, then writes what the test checks:
the world size and backend this rank saw, how many of the drafter's parameters it holds as FSDP2
shards (DTensors), and the trained weights as this rank sees them whole.

    torchrun --nproc_per_node 2 tests/multiproc/train_worker.py OUT_DIR ROOT_DIR [hydra overrides]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` importable when run as a script

from d3d.train import TrainRecipe  # noqa: E402
from tests.conftest import compose  # noqa: E402


def main() -> None:
    from torch.distributed.tensor import DTensor

    out, root, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    recipe = TrainRecipe(compose("train", overrides, root))
    recipe.train()
    acc = recipe.accelerator
    rank = acc.process_index
    params = dict(recipe.drafter().named_parameters())
    sharded = [k for k, p in params.items() if isinstance(p, DTensor)]
    # Every rank's own weights (a DTensor gathered whole, every rank taking part), not rank 0's copy.
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
               for k, v in recipe.drafter().state_dict().items()}
    torch.save(weights, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type),
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "params": len(params), "dtensor_params": len(sharded),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params.values()),
        "numel": sum(p.numel() for p in params.values())}))


if __name__ == "__main__":
    main()
