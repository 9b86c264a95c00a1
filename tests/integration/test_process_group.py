"""dist.timeout_s reaches the process group of every job that forms one (d3d.utils.process_group):
d3d.train and d3d.prune through their Accelerator, d3d.eval through accelerate's PartialState. The
group here is real (gloo), formed in this process as a one-process world under a launch's variables
for two, and its timeout is read back from the backend: NCCL's 600 s (gloo's 1800 s) would abort
rank 0's long writes under a barrier. The two-process runs that print the timeout in force are the
SLURM script's test (tests/integration/test_slurm.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose, free_port


@pytest.fixture
def launched(monkeypatch, fresh_accelerate_state):
    """A launch's variables for rank 0 of 2; init_process_group forms a world of this process alone
    (rank 1 never comes) with whatever else it was given, the timeout included."""
    import torch.distributed as dist

    for key, value in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": free_port(), "OMP_NUM_THREADS": torch.get_num_threads()}.items():
        monkeypatch.setenv(key, str(value))
    real = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: real(*a, **{**kw, "rank": 0, "world_size": 1}))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_training_accelerator_forms_its_group_with_the_configured_timeout(launched, tmp_path):
    from d3d.settings import bind_config
    from d3d.training import make_accelerator
    from d3d.utils.process_group import group_timeout_s

    cfg = bind_config(compose("train", ["+experiment=smoke", "dist.timeout_s=1234"], tmp_path), "train")
    accelerator = make_accelerator(cfg.train, timeout_s=cfg.dist.timeout_s, cpu=True)
    assert accelerator.distributed_type.value == "MULTI_CPU"  # the launch was seen: a group was formed
    assert group_timeout_s() == 1234.0


def test_evals_process_state_forms_its_group_with_the_configured_timeout(launched):
    from d3d.models.target import process_state
    from d3d.utils.process_group import group_timeout_s

    assert group_timeout_s() is None
    process_state(4321.0)
    assert group_timeout_s() == 4321.0


class Formed(Exception):
    """Raised where a recipe forms its process group, carrying the timeout it asked for."""


@pytest.mark.parametrize("job,where,overrides", [
    ("train", "d3d.train.make_accelerator", []),
    ("prune", "d3d.prune.make_accelerator", []),
    ("eval", "d3d.eval.process_state", ["eval.out_dir=${paths.output_dir}/e"]),
])
def test_each_recipe_asks_for_dist_timeout_s(job, where, overrides, tmp_path, monkeypatch):
    """The key is bound (conf/dist/default.yaml, d3d.specs.DistSettings) and is what each recipe hands
    to the call that forms its group, before any model loads; the shipped default is at least an hour."""
    import importlib

    module, name = where.rsplit(".", 1)

    def formed(*args, timeout_s=None, **kwargs):
        raise Formed(timeout_s if timeout_s is not None else args[0])

    monkeypatch.setattr(importlib.import_module(module), name, formed)
    run = getattr(importlib.import_module(f"d3d.{job}"), f"run_{job}")
    with pytest.raises(Formed) as got:
        run(compose(job, ["+experiment=smoke", "dist.timeout_s=777", *overrides], tmp_path))
    assert got.value.args[0] == 777
    with pytest.raises(Formed) as got:
        run(compose(job, ["+experiment=smoke", *overrides], tmp_path))
    assert got.value.args[0] >= 3600


def test_a_timeout_that_is_not_positive_is_refused_in_one_line(tmp_path):
    from d3d.errors import ConfigError
    from d3d.settings import bind_config

    with pytest.raises(ConfigError, match=r"^dist\.timeout_s=0\.0: must be above 0\. Fix: set a positive dist\.timeout_s"):
        bind_config(compose("train", ["+experiment=smoke", "dist.timeout_s=0"], tmp_path), "train")
