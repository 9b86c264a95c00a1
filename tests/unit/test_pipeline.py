"""d3d.pipeline's routing of overrides to its stages (no stage runs; the stages end to end are in
tests/integration/test_pipeline.py)."""

from __future__ import annotations

from d3d.pipeline import stage_overrides


def test_overrides_go_only_to_stages_that_have_the_key():
    ov = ["+experiment=smoke", "prune.num_layers=1", "eval.n=1", "seed=3", "target=tiny_random"]
    assert stage_overrides("generate", ov) == ["+experiment=smoke", "seed=3", "target=tiny_random"]
    assert stage_overrides("prune", ov) == ["+experiment=smoke", "prune.num_layers=1", "seed=3", "target=tiny_random"]
    assert "eval.n=1" in stage_overrides("eval", ov) and "prune.num_layers=1" not in stage_overrides("eval", ov)
    # prune composes only the training step's train.* keys (conf/training/): d3d.train's own stay with train
    ov = ["train.lr=1e-4", "train.warmup_steps=2"]
    assert stage_overrides("train", ov) == ov and stage_overrides("prune", ov) == ["train.lr=1e-4"]
