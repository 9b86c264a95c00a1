"""d3d.train's batches packed by DataLoader workers, end to end on the smoke experiment: a run whose
steps were packed in two worker processes, killed and resumed in the loop's process, trains exactly
as the uninterrupted run packed in the loop (the unit checks are in tests/unit/test_examples.py)."""

from __future__ import annotations

import pytest

from d3d.generate import run_generate
from d3d.train import run_train
from d3d.utils.io import read_jsonl
from tests.conftest import compose


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline_root")
    run_generate(compose("generate", ["+experiment=smoke", "data.limit=10", "generate.max_new_tokens=24"], path))
    return path


def losses(root, name, *overrides):
    cfg = compose("train", ["+experiment=smoke", "data.limit=10", f"train.out_dir={root}/ckpt/{name}", "train.max_steps=6",
                            "train.save_every=3", "train.eval_every=0", "train.batch_size=2", "train.grad_accum=2",
                            *overrides], root)
    return [(r["step"], r["loss"]) for r in read_jsonl(run_train(cfg) / "metrics.jsonl") if "loss" in r]


@pytest.mark.heavy  # worker processes, three short trainings (~1 min on 2 cores)
def test_steps_packed_by_workers_and_resumed_equal_the_loops_own(root):
    in_loop = losses(root, "loop")
    part = losses(root, "workers", "train.num_workers=2", "train.stop_at_step=3")
    assert part == in_loop[:3]
    assert (root / "ckpt" / "workers" / "last" / "trainer_state.json").is_file()
    assert losses(root, "workers") == in_loop  # resumed at step 3, with num_workers=0: who packs is a resumable key
