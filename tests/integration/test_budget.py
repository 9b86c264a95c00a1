"""The budget chooser: offline hit rates equal the real async loop's, and the projection picks
what the round-time model says on a hand case."""

from __future__ import annotations

import pytest

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.budget import hit_rates, round_outcomes
from d3d.decoding.methods import method_row
from d3d.models.drafter_settings import DrafterSettings
from tests.integration.conftest import PROMPTS


# F = all packs a tray for every alternative: a huge packed pass, 1 to 2.5 minutes on 2 cores
@pytest.mark.parametrize("method,shape", [("async", {"C": 3, "F": 1}), ("async", {"C": 4, "F": 2}), ("async", {"C": 6, "F": 3}),
                                          pytest.param("async", {"C": 3, "F": "all"}, marks=pytest.mark.heavy),
                                          ("async_tree", {"tree_nodes": 5, "tree_trays": 6})])
def test_offline_hit_rates_equal_the_async_loop(models, method, shape):
    """Contract-4 style, for any Drafts kind with trays: on the target's own greedy output, the
    offline outcome of every round gives exactly the loop's τ sequence and its hit/miss sequence.
    F = all alternatives makes every covered rejection a hit, so the coverage boundary (slot C-1)
    is what decides."""
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    cfg = DecodeConfig(method=method, block_size=6, max_new_tokens=30,
                       **{k: s.vocab_size - 1 if v == "all" else v for k, v in shape.items()})
    drafts = method_row(method).drafts(cfg, 6, None)
    setting = {k: getattr(cfg, k) for k in drafts.tray_grid[0]}
    for text in PROMPTS:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, drafter, cfg).generate([prompt])
        ids = prompt + res.token_ids[0]
        outcomes = round_outcomes(drafter, drafts, ids, len(prompt), s.mask_token_id, s.vocab_size)
        loop = [r for r in res.rounds if r.hit is not None]
        # the loop's last round has no successor in the response, so the offline walk stops before it
        assert [o.accepted + 1 for o in outcomes] == res.taus()[: len(outcomes)]
        assert [bool(r.hit[0]) for r in loop[: len(outcomes)]] == \
            [hit for hit in (hit_rates([o], drafts, [setting])[tuple(setting.values())] == 1.0 for o in outcomes)]


def test_choose_budget_script_on_the_smoke_setup(tmp_path):
    """The CLI end to end on the tiny model: a choice, a row per budget, the CPU recorded."""
    import json

    from d3d.models.drafter import build_drafter, save_drafter
    from d3d.settings import bind_config
    from tests.conftest import compose, load_script

    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    drafter, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    save_drafter(drafter, tok, tmp_path / "drafter")
    out = tmp_path / "budget.json"
    res = load_script("choose_budget").main(
        ["--drafter", str(tmp_path / "drafter"), "--n", "2", "--max-new-tokens", "24", "--repeats", "1",
         "--out", str(out), "+experiment=smoke", f"paths.root_dir={tmp_path}", f"paths.cache_dir={cfg.paths.cache_dir}"])
    saved = json.loads(out.read_text())
    assert saved["rounds"] > 0 and len(saved["choice"]["table"]) == 15
    best = max(saved["choice"]["table"], key=lambda r: r["projected_speedup"])
    assert (best["C"], best["F"]) == (res["choice"]["C"], res["choice"]["F"])
    assert saved["overlap"] is False and "model" in saved["run"]["cpu"]  # serial on CPU; the CPU named
