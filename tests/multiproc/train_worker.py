"""One rank of a real multi-process training run, started by `torchrun --nproc_per_node N` (gloo on
CPU) from tests/integration/test_train.py. Trains through d3d.train's recipe, then writes what the test checks:
the world size this rank saw and its own copy of the trained weights.

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
    out, root, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    recipe = TrainRecipe(compose("train", overrides, root))
    recipe.train()
    acc = recipe.accelerator
    rank = acc.process_index
    # Every rank's own parameters, as this process holds them (not a gathered copy from rank 0).
    weights = {k: v.detach().cpu() for k, v in recipe.drafter().state_dict().items()}
    torch.save(weights, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type),
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}))


if __name__ == "__main__":
    main()
