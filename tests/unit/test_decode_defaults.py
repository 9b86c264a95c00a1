"""What a run verifies and budgets when the user says nothing: the drafter's trained block (one home:
its checkpoint's settings; a number is a stated choice, recorded and said), and a tray budget chosen
by measurement (null knobs), each row saying which budget ran. No model: configs and stubs."""

from __future__ import annotations

import json

import pytest
import torch

from d3d.errors import ConfigError
from d3d.decoding import DecodeConfig
from tests.conftest import compose


def bound_methods(tmp_path, *overrides):
    from d3d.settings import bind_config, method_configs

    cfg = compose("eval", ["eval.methods=[ar,sync,async,tree,async_tree]", *overrides], tmp_path)
    return method_configs(cfg, bind_config(cfg, "eval").eval)


def drafter_folder(tmp_path, block: int):
    """A folder whose config.json holds the settings d3d.train writes (d3d.block_size)."""
    folder = tmp_path / f"drafter_b{block}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"d3d": {"block_size": block, "mask_token_id": 0}}))
    return folder


def test_the_decode_block_is_the_drafters_trained_block(tmp_path):
    folder = drafter_folder(tmp_path, 8)
    methods = bound_methods(tmp_path, f"drafter.checkpoint={folder}")
    assert {name: dc.block_size for name, dc in methods.items() if name != "ar"} == \
        {"sync": 8, "async": 8, "tree": 8, "async_tree": 8}
    # no checkpoint: the block the drafter will be built and trained with
    assert bound_methods(tmp_path, "drafter.block_size=6")["async"].block_size == 6
    # a number is a stated choice: it wins, lent to every method that verifies blocks
    stated = bound_methods(tmp_path, f"drafter.checkpoint={folder}", "decode.block_size=4")
    assert {dc.block_size for name, dc in stated.items() if name != "ar"} == {4}


def test_a_block_other_than_the_trained_one_is_said(tmp_path):
    from d3d.eval import run_notes

    folder = drafter_folder(tmp_path, 8)
    stated = bound_methods(tmp_path, f"drafter.checkpoint={folder}", "decode.block_size=4")
    notes = run_notes(stated, {}, trained_block=8)
    assert len(notes) == 1 and "sync, async, tree, async_tree: blocks of 4, a stated choice" in notes[0]
    assert "trained with 8" in notes[0]
    assert run_notes(bound_methods(tmp_path, f"drafter.checkpoint={folder}"), {}, trained_block=8) == []


def test_an_async_budget_not_given_is_measured(tmp_path):
    methods = bound_methods(tmp_path)
    assert methods["async"].auto_budget and methods["async_tree"].auto_budget
    assert not methods["sync"].auto_budget and not methods["tree"].auto_budget
    given = bound_methods(tmp_path, "decode.C=4", "decode.F=1")["async"]  # the run's decode group is async
    assert (given.C, given.F, given.auto_budget) == (4, 1, False)
    with pytest.raises(ConfigError, match=r"decode\.F=null \(auto\) beside decode\.C=4: .* Fix: "):
        bound_methods(tmp_path, "decode.C=4")
    with pytest.raises(ConfigError, match=r"methods\.async_tree\.tree_trays=0"):  # a given budget is checked
        bound_methods(tmp_path, "methods.async_tree.tree_trays=0")
    # an experiment overlay that fixes a budget is a given budget; none of the shipped ones does
    from tests.unit.test_configs import options

    for experiment in options("experiment"):
        cfg = compose("eval", [f"+experiment={experiment}"], tmp_path)
        assert cfg.methods["async"].C is None and cfg.decode.get("C") is None, experiment


def test_each_row_says_which_budget_ran():
    from d3d.eval import budget_records, run_notes

    bound = {"ar": DecodeConfig(method="ar"), "sync": DecodeConfig(method="sync"),
             "async": DecodeConfig(method="async", C=None, F=None),
             "async_tree": DecodeConfig(method="async_tree", tree_trays=None),
             "async_c4_f1": DecodeConfig(method="async", C=4, F=1)}
    ran = {**bound, "async": DecodeConfig(method="async", C=8, F=2),
           "async_tree": DecodeConfig(method="tree")}  # no tray budget beat the tree: it ran as its reference
    records = budget_records(bound, ran)
    assert records == {"async": {"by": "auto", "setting": "8x2", "tokens": 16 * (7 * 2 + 2)},
                       "async_tree": {"by": "auto", "setting": "none", "tokens": 0},
                       "async_c4_f1": {"by": "given", "setting": "4x1", "tokens": 16 * (3 * 1 + 2)}}
    assert run_notes(ran, records, None) == [
        "async_c4_f1: tray budget given (4x1, 80 tokens a packed pass), not chosen by measurement (null tray knobs "
        "choose it)"]


def test_an_unchosen_budget_never_reaches_a_loop():
    from d3d.decoding.cost import candidates, check_loaded
    from d3d.decoding.methods import method_row

    auto = DecodeConfig(method="async", C=None, F=None)
    with pytest.raises(ConfigError, match=r"decode\.C=None: the tray budget \(C, F\) is left to the measured choice"):
        check_loaded(auto, method_row("async"), None, None, 1)  # SpecGenerator's first check
    # before the models load, the memory check bounds every setting the choice may pick
    assert [(c.C, c.F) for c in candidates(auto)] == [(s["C"], s["F"]) for s in method_row("async").drafts.tray_grid]
    assert candidates(DecodeConfig(method="async", C=4, F=1)) == [DecodeConfig(method="async", C=4, F=1)]


class _Drafter(torch.nn.Module):
    """What the pass timers read of a drafter: its settings and a device."""

    def __init__(self, block: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"d3d": {"block_size": block, "mask_token_id": 0}})()


def test_the_chooser_times_drafter_passes_at_the_block_the_loop_drafts(monkeypatch):
    """A drafter trained at 8 run at 4: its draft pass is timed as 4 tokens and each packed pass as its
    budget in blocks of 4 (they were timed at 8, the budgets counted at 4)."""
    from d3d.decoding import budget
    from d3d.decoding.methods import method_row

    widths = []
    monkeypatch.setattr(budget, "_after_prefix_ms",
                        lambda model, prefix, x, *a, **k: widths.append((model, x.shape[1])) or 1.0)
    drafter, target = _Drafter(8), _Drafter(8)
    cfg = DecodeConfig(method="async", block_size=4, C=4, F=1)
    drafts = method_row("async").drafts(cfg, 4, None)
    grid = [{"C": 2, "F": 1}, {"C": 4, "F": 2}]
    budget.pass_costs(target, drafter, list(range(10)), drafts, grid, repeats=1)
    drafter_widths = [w for model, w in widths if model is drafter]
    # the draft (1 block), then each setting's budget B*((C-1)*F + 2) in blocks of B = 4
    assert drafter_widths == [4, 4 * (1 * 1 + 2), 4 * (3 * 2 + 2)]


@pytest.mark.parametrize("methods", ["[]", "[sync,tree]"])
def test_methods_without_the_baseline_are_refused_with_the_fix(tmp_path, methods):
    from d3d.settings import bind_config, method_configs

    cfg = compose("eval", [f"eval.methods={methods}"], tmp_path)
    with pytest.raises(ConfigError, match=r"must include ar.*Fix: eval.methods=\[ar,"):
        method_configs(cfg, bind_config(cfg, "eval").eval)


def test_a_drafter_block_too_wide_is_refused_under_its_own_key(tmp_path):
    """drafter.block_size=300 reached eval's decode files through their interpolation and was refused
    as `decode.block_size=300`, a key the user never set; d3d.train took it without a word."""
    from d3d.settings import bind_config

    for job in ("eval", "train"):
        with pytest.raises(ConfigError, match=r"^drafter.block_size=300: at most 256 .*Fix: set drafter.block_size "
                                              r"between 2 and 256"):
            bound_methods(tmp_path, "drafter.block_size=300") if job == "eval" else \
                bind_config(compose("train", ["drafter.block_size=300"], tmp_path), "train")
    assert bound_methods(tmp_path, "drafter.block_size=256")["sync"].block_size == 256
