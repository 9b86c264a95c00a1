"""Settings out of range fail at the boundary (d3d.specs), in one line naming the key and the fix,
before anything loads. Each used to run: generate.batch_size=0 answered nothing with rc 0;
train.save_every=0, train.grad_accum=0 and prune.calib_size=0 failed minutes later, after the
drafter was built."""

from __future__ import annotations

import pytest

from d3d.config import ConfigError
from d3d.settings import bind_config
from tests.conftest import compose


@pytest.mark.parametrize("root,override,message", [
    ("generate", "generate.batch_size=0", r"generate.batch_size=0: must be at least 1. Fix: set generate.batch_size=1"),
    ("generate", "generate.max_new_tokens=0", r"generate.max_new_tokens=0: must be at least 1"),
    ("generate", "generate.limit=0", r"generate.limit=0: must be at least 1"),
    ("train", "train.save_every=0", r"train.save_every=0: must be at least 1"),
    ("train", "train.grad_accum=0", r"train.grad_accum=0: must be at least 1"),
    ("train", "train.max_steps=0", r"train.max_steps=0: must be at least 1"),
    ("train", "train.batch_size=0", r"train.batch_size=0: must be at least 1"),
    ("train", "train.lr=0", r"train.lr=0.0: must be above 0"),
    ("train", "train.max_minutes=-1", r"train.max_minutes=-1.0: must be above 0"),
    ("train", "train.mixed_precision=bf17", r"train.mixed_precision='bf17': not a precision. Fix: use auto, no, bf16 or fp16"),
    ("prune", "prune.calib_size=0", r"prune.calib_size=0: must be at least 1"),
    ("prune", "prune.num_layers=0", r"prune.num_layers=0: must be at least 1"),
    ("prune", "train.val_size=-1", r"train.val_size=-1: must be at least 0"),  # prune's view of the step's keys
])
def test_a_setting_out_of_range_is_one_line_at_the_boundary(root, override, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        bind_config(compose(root, ["+experiment=smoke", override]), root)


def test_sampling_settings_are_checked_only_when_sampling():
    bind_config(compose("generate", ["generate.top_p=0"]), "generate")  # greedy: unread
    with pytest.raises(ConfigError, match=r"^generate.top_p=0.0: must be above 0"):
        bind_config(compose("generate", ["generate.do_sample=true", "generate.top_p=0"]), "generate")
    with pytest.raises(ConfigError, match=r"^generate.top_p=1.5: must be at most 1"):
        bind_config(compose("generate", ["generate.do_sample=true", "generate.top_p=1.5"]), "generate")


def test_the_edges_of_each_range_bind():
    for root, override in [("generate", "generate.batch_size=1"), ("train", "train.eval_every=0"),
                           ("train", "train.warmup_steps=0"), ("prune", "prune.min_retention=0"),
                           ("prune", "prune.recovery_steps=0")]:
        bind_config(compose(root, ["+experiment=smoke", override]), root)
