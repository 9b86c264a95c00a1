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

    import d3d.train

    out, root, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    evaluated = []  # the drafter each in-training evaluation decodes with: its dtype and whether it takes gradients
    estimate = d3d.train.estimate_acceptance

    def recording(model, *args, **kwargs):
        p = next(model.parameters())
        evaluated.append({"dtype": str(p.dtype), "requires_grad": any(q.requires_grad for q in model.parameters())})
        return estimate(model, *args, **kwargs)

    d3d.train.estimate_acceptance = recording
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
        "numel": sum(p.numel() for p in params.values()), "evaluated": evaluated,
        # the FSDP2 mixed-precision policy of the prepared root (None under DDP or one process)
        "mp_policy": mp_policy(recipe.step_module)}))


def mp_policy(module) -> dict | None:
    state = getattr(module, "_get_fsdp_state", None)
    if state is None:
        return None
    policy = state()._mp_policy
    return {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype)}


if __name__ == "__main__":
    main()
