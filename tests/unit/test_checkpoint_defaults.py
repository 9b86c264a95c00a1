"""A trained drafter runs as it was trained: the settings its checkpoint saved (block size, block rule,
draft vocabulary) are the defaults of every job that loads it, and only a value set against one is
refused, in one line naming both, before any model loads (d3d.config.checkpoint_settings,
d3d.settings.check_checkpoint_settings). Configs and a config.json only: no model loads."""

from __future__ import annotations

import json

import pytest

from d3d.errors import ConfigError
from tests.conftest import compose
from tests.unit.test_configs import options

# what d3d.train writes into config.json's d3d section, each unlike the drafter files' defaults
SAVED = {"block_size": 8, "block_attention": "causal", "draft_vocab": 32, "mask_token_id": 5}
JOBS = ["train", "prune", "eval", "export", "bench"]  # every job that binds a drafter


def saved_drafter(tmp_path, **settings):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"d3d": {**SAVED, **settings}}))
    return folder


def bound_drafter(job: str, tmp_path, *overrides):
    """The drafter a job binds at its entry point, as its run_* does."""
    cfg = compose(job, list(overrides), tmp_path)
    if job == "bench":
        from d3d.bench import bind_bench

        return bind_bench(cfg)[0].drafter
    from d3d.settings import bind_config

    return bind_config(cfg, job).drafter


def saved_of(drafter) -> dict:
    return {k: getattr(drafter, k) for k in ("block_size", "block_attention", "draft_vocab")}


@pytest.mark.parametrize("job", JOBS)
def test_a_checkpoints_settings_are_the_defaults_of_every_job_that_loads_it(job, tmp_path):
    folder = saved_drafter(tmp_path)
    drafter = bound_drafter(job, tmp_path, f"drafter.checkpoint={folder}")
    assert saved_of(drafter) == {"block_size": 8, "block_attention": "causal", "draft_vocab": 32}
    # no checkpoint: the drafter files' own, for a drafter still to be built or trained
    assert saved_of(bound_drafter(job, tmp_path)) == {"block_size": 16, "block_attention": "bidirectional",
                                                      "draft_vocab": None}


def test_eval_decodes_a_causal_checkpoint_as_trained_with_no_drafter_key(tmp_path):
    """`d3d.eval drafter.checkpoint=<causal drafter>` was refused ("was trained with
    drafter.block_attention=causal, but this run sets bidirectional"): it binds the saved rule, its
    block reaches every method that verifies blocks, and the loader's check behind it passes."""
    from d3d.models.drafter import check_block_attention
    from d3d.settings import bind_config, method_configs

    folder = saved_drafter(tmp_path)
    cfg = compose("eval", [f"drafter.checkpoint={folder}", "eval.methods=[ar,sync,async,tree,async_tree]"], tmp_path)
    typed = bind_config(cfg, "eval")
    methods = method_configs(cfg, typed.eval)
    assert {name: dc.block_size for name, dc in methods.items() if name != "ar"} == \
        {"sync": 8, "async": 8, "tree": 8, "async_tree": 8}
    check_block_attention(folder, typed.drafter.block_attention)  # the backstop no longer fires


@pytest.mark.parametrize("option", options("drafter"))
def test_every_drafter_file_takes_the_saved_settings_from_its_checkpoint(option, tmp_path):
    folder = saved_drafter(tmp_path)
    drafter = bound_drafter("eval", tmp_path, f"drafter={option}", f"drafter.checkpoint={folder}")
    assert saved_of(drafter) == {"block_size": 8, "block_attention": "causal", "draft_vocab": 32}


CONFLICTS = [  # (override, the saved value it meets, the fix's other way)
    ("drafter.block_attention=bidirectional", "drafter.block_attention=causal",
     "train a drafter with drafter.block_attention=bidirectional"),
    ("drafter.block_size=16", "drafter.block_size=8", "set decode.block_size=16 instead"),
    ("drafter.draft_vocab=null", "drafter.draft_vocab=32", "train a drafter with drafter.draft_vocab=null"),
    ("drafter.draft_vocab=64", "drafter.draft_vocab=32", "train a drafter with drafter.draft_vocab=64"),
]


# every job with the block rule, every kind of setting with eval (the check is one function for all)
@pytest.mark.parametrize("job, conflict", [(job, CONFLICTS[0]) for job in JOBS] + [("eval", c) for c in CONFLICTS[1:]])
def test_a_value_set_against_the_checkpoint_is_one_line_naming_both(job, conflict, tmp_path):
    override, saved, fix = conflict
    folder = saved_drafter(tmp_path)
    with pytest.raises(ConfigError) as err:
        bound_drafter(job, tmp_path, f"drafter.checkpoint={folder}", override)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{override} was set, but the checkpoint {folder} was trained with {saved}. "
                              f"Fix: drop the override to run it as trained, or {fix}")


@pytest.mark.parametrize("job", JOBS)
def test_a_value_set_to_the_saved_one_passes(job, tmp_path):
    folder = saved_drafter(tmp_path)
    drafter = bound_drafter(job, tmp_path, f"drafter.checkpoint={folder}", "drafter.block_attention=causal",
                            "drafter.block_size=8", "drafter.draft_vocab=32")
    assert saved_of(drafter) == {"block_size": 8, "block_attention": "causal", "draft_vocab": 32}


def test_a_checkpoint_without_a_setting_takes_the_drafters_default(tmp_path):
    """A folder saved before a setting existed (no block_attention, no draft_vocab in its d3d section)
    was trained with the drafter's default, which it binds; a folder that is not a drafter's adds
    nothing here and is refused where it loads (d3d.models.drafter.drafter_folder)."""
    from d3d.config import checkpoint_settings

    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"d3d": {"block_size": 4, "mask_token_id": 5}}))
    assert saved_of(bound_drafter("eval", tmp_path, f"drafter.checkpoint={old}")) == \
        {"block_size": 4, "block_attention": "bidirectional", "draft_vocab": None}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_settings(str(plain)) == {} == checkpoint_settings(str(tmp_path / "nowhere"))
    assert checkpoint_settings(None) == {} and checkpoint_settings(str(old))["block_size"] == 4


@pytest.mark.parametrize("key", ["pard_token", "mask_token_id"])
def test_a_pard_format_folder_decodes_with_causal_blocks_by_default(key, tmp_path):
    """A PARD-format folder (a mask id, no d3d settings) was trained with causal blocks, the rule its
    loader gives it (d3d.models.drafter.pard_settings): every job binds that rule with no drafter key
    (it used to need drafter.block_attention=causal by hand, else the loader refused it), the block
    size stays the run's (the folder does not say), and the other rule set by hand is refused in one
    line before anything loads."""
    from d3d.models.drafter import check_block_attention

    folder = tmp_path / "pard"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 64, key: 63}))
    for job in JOBS:
        drafter = bound_drafter(job, tmp_path, f"drafter.checkpoint={folder}")
        assert saved_of(drafter) == {"block_size": 16, "block_attention": "causal", "draft_vocab": None}
    check_block_attention(folder, drafter.block_attention)  # the loader's backstop agrees
    with pytest.raises(ConfigError, match=r"^drafter.block_attention=bidirectional was set, but the checkpoint .* "
                                          r"was trained with drafter.block_attention=causal\. Fix: "):
        bound_drafter("eval", tmp_path, f"drafter.checkpoint={folder}", "drafter.block_attention=bidirectional")


def test_a_checkpoints_config_is_parsed_once_per_version(tmp_path, monkeypatch):
    """OmegaConf resolves every ${d3d.from_checkpoint:...} key each time it is read: one parse of the
    folder's config.json serves them all, and a config.json saved again (a resumed run's newer
    checkpoint in the same folder) is read again, not served stale."""
    import os

    import d3d.utils.checkpoints as checkpoints
    from d3d.config import checkpoint_settings

    parses = []
    real = checkpoints.saved_defaults
    monkeypatch.setattr(checkpoints, "saved_defaults", lambda folder: parses.append(folder) or real(folder))
    folder = saved_drafter(tmp_path)
    bound_drafter("eval", tmp_path, f"drafter.checkpoint={folder}")
    assert checkpoint_settings(str(folder))["block_size"] == 8
    assert len(parses) == 1
    config = folder / "config.json"
    config.write_text(json.dumps({"d3d": {**SAVED, "block_size": 4}}))
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    assert checkpoint_settings(str(folder))["block_size"] == 4 and len(parses) == 2
    checkpoint_settings(str(folder))["block_size"] = 99  # a caller's copy, not the cache's
    assert checkpoint_settings(str(folder))["block_size"] == 4
