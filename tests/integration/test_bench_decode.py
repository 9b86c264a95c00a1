"""scripts/bench_decode.py end to end on the smoke setup: every method row, greedy equality."""

from __future__ import annotations

import json

import pytest

from d3d.models.drafter import build_drafter, save_drafter
from d3d.settings import bind_config
from tests.conftest import compose, load_script


def smoke_drafter(tmp_path):
    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    return cfg, save_drafter(model, tok, tmp_path / "drafter")


def test_bench_decode_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, drafter = smoke_drafter(tmp_path)
    out = tmp_path / "bench.json"
    res = load_script("bench_decode").main([
        "--drafter", str(drafter), "--n-prompts", "2", "--max-new-tokens", "8", "--block-sizes", "4", "2",
        "--budgets", "3x1", "--trees", "3", "--async-trees", "3x2", "--assistant", "tiny_random", "--out", str(out),
        "+experiment=smoke", f"paths.root_dir={tmp_path}", f"paths.cache_dir={cfg.paths.cache_dir}"])
    names = [s["method"] for s in res["summary"]]
    assert names == ["hf_generate", "hf_assisted(tiny_random)", "hf_prompt_lookup", "d3d_ar", "d3d_sync_b4",
                     "d3d_sync_b2", "d3d_tree_n3", "d3d_async_c3_f1(16tok)", "d3d_async_tree_n3_t2(12tok)"]
    # greedy, fp32: every method returns generate's tokens on every prompt
    assert all(s["equal_rate"] == 1.0 for s in res["summary"])
    assert set(res["pass_cost"]["target_ms"]) == {1, 2, 4, 8, 16}
    assert all(v > 0 for v in res["pass_cost"]["drafter_ms"].values())
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 2 * len(names) and out.with_suffix(".md").exists()
    # the τ each of our methods needs to match generate: its τ scaled by generate's speed over its own on
    # the same prompt, median over prompts; none for transformers' methods (they report no τ)
    rows = saved["rows"]
    for s in res["summary"]:
        mine = [r for r in rows if r["method"] == s["method"]]
        if s["method"].startswith("hf_"):
            assert s["tau_to_match_base"] is None
            continue
        gen = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "hf_generate"}
        want = sorted(r["tau"] * gen[r["prompt"]] / r["tokens_per_s"] for r in mine)
        assert s["tau_to_match_base"] == pytest.approx((want[0] + want[1]) / 2) and s["base"] == "hf_generate"
    assert "τ to match hf_generate" in out.with_suffix(".md").read_text()


def test_only_keeps_the_ar_baseline(tmp_path, monkeypatch):
    """`--only d3d_async` used to lose every measurement at the end (no baseline to divide by);
    a second backend adds tagged rows of the same methods, equal to the eager reference."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, drafter = smoke_drafter(tmp_path)
    res = load_script("bench_decode").main([
        "--drafter", str(drafter), "--n-prompts", "1", "--max-new-tokens", "8", "--block-sizes", "4",
        "--budgets", "3x1", "--async-trees", "2x1", "--only", "d3d_async", "--backends", "eager", "static", "--out", str(tmp_path / "b.json"),
        "+experiment=smoke", f"paths.root_dir={tmp_path}", f"paths.cache_dir={cfg.paths.cache_dir}"])
    # the async tree runs on the eager backend only (its caches keep a path's slots): no [static] row
    assert [s["method"] for s in res["summary"]] == ["d3d_ar", "d3d_async_c3_f1(16tok)", "d3d_async_tree_n2_t1(7tok)",
                                                     "d3d_async_c3_f1(16tok)[static]"]
    assert all(s["equal_rate"] == 1.0 for s in res["summary"]) and res["summary"][0]["ratio"] == 1.0


def test_bench_ar_interleaved_smoke(tmp_path, monkeypatch):
    """scripts/bench_ar.py: generate and our AR loop per backend, interleaved, same tokens."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose("eval", ["+experiment=smoke"], tmp_path)
    out = tmp_path / "ar.json"
    res = load_script("bench_ar").main(["--tokens", "6", "--repeats", "2", "--backends", "eager", "static",
                                        "--out", str(out), "+experiment=smoke", f"paths.root_dir={tmp_path}",
                                        f"paths.cache_dir={cfg.paths.cache_dir}"])
    assert [r["method"] for r in res["rows"]] == ["hf_generate", "d3d_ar[eager]", "d3d_ar[static]"]
    assert all(r["equal_rate"] == 1.0 and len(r["per_repeat_s"]) == 2 for r in res["rows"])
    assert json.loads(out.read_text())["run"]["cpu"] and out.with_suffix(".md").exists()


def test_a_budget_the_device_cannot_hold_is_refused_before_the_models_load(tmp_path, monkeypatch):
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, drafter = smoke_drafter(tmp_path)
    script = load_script("bench_decode")
    monkeypatch.setattr(script, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    with pytest.raises(ConfigError, match=r"^decode.block_size=256 decode.C=256 decode.F=8 \(method d3d_async_c256_f8"):
        script.main(["--drafter", str(drafter), "--block-sizes", "256", "--budgets", "256x8",
                     "--out", str(tmp_path / "bench.json"), "+experiment=smoke",
                     f"paths.root_dir={tmp_path}", f"paths.cache_dir={cfg.paths.cache_dir}"])


def test_another_drafter_runs_beside_with_the_drafters_share_of_the_round(tmp_path, monkeypatch):
    """--also-drafters label=folder adds that drafter's sync and tree rows on the same prompts (a pruned
    drafter against the unpruned one); every speculative row reports the drafter's share of a round."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, drafter = smoke_drafter(tmp_path)
    res = load_script("bench_decode").main([
        "--drafter", str(drafter), "--also-drafters", f"again={drafter}", "--n-prompts", "1", "--max-new-tokens", "8",
        "--block-sizes", "4", "--budgets", "3x1", "--trees", "3", "--no-hf-baselines", "--out", str(tmp_path / "b.json"),
        "+experiment=smoke", f"paths.root_dir={tmp_path}", f"paths.cache_dir={cfg.paths.cache_dir}"])
    by = {s["method"]: s for s in res["summary"]}
    assert set(by) == {"d3d_ar", "d3d_sync_b4", "d3d_sync_b4@again", "d3d_tree_n3", "d3d_tree_n3@again",
                       "d3d_async_c3_f1(16tok)"}
    assert by["d3d_sync_b4@again"]["tau"] == by["d3d_sync_b4"]["tau"]  # the same weights: the same rounds
    assert all(0 < by[m]["drafter_share"] < 1 for m in by if m != "d3d_ar") and by["d3d_ar"]["drafter_share"] == 0.0
    assert set(res["pass_cost"]["drafter_ms@again"]) == set(res["pass_cost"]["drafter_ms"])
