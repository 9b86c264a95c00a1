"""d3d.bench's configs and arithmetic, no model: every preset and experiment binds, bad input fails
in one line naming its key, the summary's ratios and break-even τ from synthetic rows."""

from __future__ import annotations

import pytest

from d3d.bench import best_rows, bind_bench, difference_shares, shares, summarise, summary_markdown
from d3d.configdir import config_dir
from d3d.errors import ConfigError
from d3d.decoding.methods import METHODS
from tests.conftest import compose

PRESETS = sorted(p.stem for p in (config_dir() / "bench").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_binds_every_row_it_names(preset, tmp_path):
    cfg, ours = bind_bench(compose("bench", [f"bench={preset}"], tmp_path))
    assert cfg.bench.name == preset
    assert set(ours) == {m for m in cfg.bench.methods if m not in ("generate", "assisted", "prompt_lookup")}
    assert all(dc.method in METHODS and dc.max_new_tokens == cfg.bench.max_new_tokens for dc in ours.values())


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_overlays_the_bench(experiment, tmp_path):
    cfg, _ = bind_bench(compose("bench", [f"+experiment={experiment}"], tmp_path))
    assert cfg.target.name == compose("eval", [f"+experiment={experiment}"], tmp_path).target.name


@pytest.mark.parametrize("override,match", [
    (["bench.methods=[ar,sinc]"], r"bench.methods names 'sinc'"),
    (["bench.methods=[sync,tree]"], r"no baseline"),
    (["bench.backends=[eagre]"], r"bench.backends"),
    (["bench.repeats=0"], r"bench.repeats=0"),
    (["bench=qwen_trees", "bench.assistant=qwen9"], r"bench.assistant=qwen9"),
    (["+methods.sync.C=4"], r"methods.sync.C: method sync does not read it"),
    (["+bench.nprompts=2"], r"bench.nprompts"),
    (["+bnech.n_prompts=2"], r"bnech: d3d.bench has no such top-level key"),
    (["methods.async.C=null", "methods.async.F=null"], r"methods.async: its tray budget is left to measurement .* Fix: set methods.async.C=<n> methods.async.F=<n>"),
    (["methods.tree.temperature=1"], r"methods.tree.temperature=1.0: d3d.bench times greedy decoding"),
])
def test_bad_input_fails_in_one_line_naming_its_key(override, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        bind_bench(compose("bench", override, tmp_path))


def test_ratios_are_of_medians_and_the_break_even_tau_is_per_call():
    rows = []
    for prompt, (gen, ar, tree) in enumerate([(10.0, 9.0, 20.0), (12.0, 12.0, 18.0), (8.0, 10.0, 20.0)]):
        rows += [{"method": "generate", "prompt": prompt, "repeat": 0, "tokens_per_s": gen, "equal_to_reference": True,
                  "new_tokens": 8},
                 {"method": "ar", "prompt": prompt, "repeat": 0, "tokens_per_s": ar, "equal_to_reference": True,
                  "tau": 1.0, "drafter_share": 0.0, "new_tokens": 8},
                 {"method": "tree", "prompt": prompt, "repeat": 0, "tokens_per_s": tree, "tau": 3.0,
                  "equal_to_reference": prompt != 2, "drafter_share": 0.25, "wall_ms": 100.0, "draft_ms": 25.0,
                  "verify_ms": 75.0, "tray_ms": 0.0, "new_tokens": 8,
                  "divergence": None if prompt != 2 else {"kind": "numerical"}}]
    s = summarise(rows, ["generate", "ar", "tree"])
    by = {e["method"]: e for e in s["methods"]}
    assert s["baselines"] == ["generate", "ar"] and s["prompts"] == 3
    assert by["tree"]["x_generate"] == pytest.approx(20.0 / 10.0) and by["tree"]["x_ar"] == pytest.approx(20.0 / 10.0)
    assert by["ar"]["x_generate"] == pytest.approx(10.0 / 10.0)
    # per call: 3 * 10/20, 3 * 12/18, 3 * 8/20 -> median 1.5
    assert by["tree"]["tau_to_match"] == pytest.approx(1.5) and by["ar"]["tau_to_match"] is None
    assert by["tree"]["equal_rate"] == pytest.approx(2 / 3) and by["tree"]["drafter_share"] == 0.25
    table = summary_markdown(s)
    assert ("| tree | 20.0 | 2.00 | 2.00 | 3.00 | 1.50 | — | 0.67 / 0.33 / 0.00 (3 calls, 24 tokens) | 100 (25 / 75 / 0) "
            "| 0.25 | — |") in table


def test_differing_calls_are_shared_out_by_their_class_and_old_rows_say_unclassified():
    def row(equal, kind="absent"):
        return {"equal_to_reference": equal, **({} if kind == "absent" else
                                                {"divergence": None if equal else {"kind": kind}})}

    rows = [row(True, None), row(False, "numerical"), row(False, "real"), row(False, "real")]
    assert difference_shares(rows) == {"equal_rate": 0.25, "near_tie_rate": 0.25, "real_rate": 0.5}
    old = [row(True), row(False)]  # rows of a run before d3d.bench classified differences
    assert difference_shares(old) == {"equal_rate": 0.5, "near_tie_rate": None, "real_rate": None}
    assert "0.50 / not classified (2 calls, 16 tokens)" in shares({**difference_shares(old), "calls": 2, "new_tokens": 16})


def test_the_fastest_row_with_drafts_is_found_per_drafter():
    blank = dict.fromkeys(["tau", "tau_to_match", "hit_rate", "equal_rate", "wall_ms", "warmup_s"])
    entry = lambda m, tps, share: {**blank, "method": m, "tokens_per_s": tps, "drafter_share": share,
                                   "x_generate": tps / 10}
    s = {"baselines": ["generate"], "prompts": 1, "methods": [
        entry("generate", 10.0, None), entry("ar", 30.0, 0.0), entry("sync", 12.0, 0.3), entry("tree", 15.0, 0.25),
        entry("sync@full", 14.0, 0.35), entry("tree@full", 13.0, 0.3)]}
    # ar is fastest of all but drafts nothing; each drafter's own best row is kept apart
    assert {k: e["method"] for k, e in best_rows(s).items()} == {"drafter": "tree", "full": "sync@full"}
    assert "drafter: tree 15.0 tokens/s, 1.50x generate, drafter share 0.25; full: sync@full" in summary_markdown(s)
