"""d3d.bench end to end on tiny random models: every kind of row, greedy equality, the drafter's share,
resume, the refusals before any model loads."""

from __future__ import annotations

import json

import pytest

from d3d.bench import run_bench
from d3d.errors import ConfigError
from d3d.models.drafter import attach_draft_head, build_drafter, load_drafter, save_drafter, special_ids
from d3d.settings import bind_config
from tests.conftest import compose

TINY = ["target=tiny_random", "drafter=tiny_random", "bench.max_new_tokens=8", "bench.progress=false"]


@pytest.fixture
def drafter(tmp_path):
    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    return save_drafter(model, tok, tmp_path / "drafter")


def rows_of(folder):
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]


def test_every_row_kind_interleaved_equal_and_resumable(tmp_path, drafter, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    overrides = [*TINY, "bench=decode", "bench.methods=[generate,assisted,prompt_lookup,ar,sync,tree,async]",
                 f"drafter.checkpoint={drafter}", f"+bench.also_drafters.again={drafter}",
                 "bench.assistant=tiny_random", "bench.n_prompts=2", "bench.pass_cost=false",
                 "methods.sync.block_size=4", "methods.async.block_size=4", "methods.async.C=3", "methods.async.F=1",
                 "methods.tree.tree_nodes=3"]
    out = run_bench(compose("bench", overrides, tmp_path))
    summary = json.loads((out / "summary.json").read_text())
    by = {e["method"]: e for e in summary["methods"]}
    # peers first, then our rows without trays, those with trays last; another drafter's rows beside
    assert list(by) == ["generate", "assisted", "prompt_lookup", "ar", "sync", "sync@again", "tree", "tree@again",
                        "async", "async@again"]
    assert summary["baselines"] == ["generate", "ar"]
    assert all(e["equal_rate"] == 1.0 for e in by.values())  # greedy, fp32: every call returns generate's tokens
    assert by["sync@again"]["tau"] == by["sync"]["tau"]  # the same weights: the same rounds
    assert by["ar"]["drafter_share"] == 0.0 and all(0 < by[m]["drafter_share"] < 1 for m in by if "sync" in m or "tree" in m)
    assert by["generate"]["x_generate"] == 1.0 and by["ar"]["x_ar"] == 1.0
    rows = rows_of(out)
    assert len(rows) == 2 * len(by)
    # interleaved: every row on prompt 0 is written before any on prompt 1
    assert [r["prompt"] for r in rows] == [0] * len(by) + [1] * len(by)
    # the τ to match generate: per call against generate's call on the same prompt, median over calls
    gen = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "generate"}
    want = sorted(r["tau"] * gen[r["prompt"]] / r["tokens_per_s"] for r in rows if r["method"] == "tree")
    assert by["tree"]["tau_to_match"] == pytest.approx(sum(want) / 2) and by["generate"]["tau_to_match"] is None
    assert "τ to match generate" in (out / "summary.md").read_text()
    assert json.loads((out / "run.json").read_text())["run"]["cpu"]["model"]

    run_bench(compose("bench", overrides, tmp_path))  # finished prompts are not run again
    assert len(rows_of(out)) == len(rows)
    with pytest.raises(ConfigError, match="max_new_tokens differ"):  # nor mixed with other settings
        run_bench(compose("bench", [*overrides, "bench.max_new_tokens=6"], tmp_path))


def test_a_call_that_leaves_generate_is_counted_unequal_and_classified(tmp_path, drafter, monkeypatch):
    """The equality column is the losslessness evidence behind the README's figures: a row whose
    tokens differ from generate's must read unequal, its first difference classified by the target's
    logit margin (here a token the target did not pick: real)."""
    import d3d.bench as bench

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loop = bench.our_loop

    def broken(gen):  # sync's loop with its 4th token replaced: a decoding bug
        run = loop(gen)
        if gen.cfg.method != "sync":
            return run

        def wrong(ids, n):
            new, extra = run(ids, n)
            return new[:3] + [(new[3] + 1) % 200 + 4] + new[4:], extra
        return wrong

    monkeypatch.setattr(bench, "our_loop", broken)
    out = run_bench(compose("bench", [*TINY, "bench.methods=[generate,sync]", f"drafter.checkpoint={drafter}",
                                      "bench.n_prompts=1", "bench.pass_cost=false", "methods.sync.block_size=4"],
                            tmp_path))
    by = {e["method"]: e for e in json.loads((out / "summary.json").read_text())["methods"]}
    assert (by["generate"]["equal_rate"], by["generate"]["near_tie_rate"], by["generate"]["real_rate"]) == (1.0, 0, 0)
    assert (by["sync"]["equal_rate"], by["sync"]["near_tie_rate"], by["sync"]["real_rate"]) == (0.0, 0.0, 1.0)
    assert by["sync"]["calls"] == 1 and by["sync"]["new_tokens"] == 8
    rows = [r for r in rows_of(out) if r["method"] == "sync"]
    assert all(not r["equal_to_reference"] and r["divergence"]["index"] == 3 and r["divergence"]["kind"] == "real"
               for r in rows)
    assert "| sync |" in (out / "summary.md").read_text() and "0.00 / 0.00 / 1.00 (1 call, 8 tokens)" in (
        out / "summary.md").read_text()


def test_ar_backends_preset_makes_exact_tokens_per_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = run_bench(compose("bench", [*TINY, "bench=ar_backends", "bench.repeats=2", "bench.backends=[eager,static]",
                                      "bench.max_new_tokens=6"], tmp_path))
    rows = rows_of(out)
    assert [r["method"] for r in rows] == ["generate", "ar", "ar[static]"] * 2  # repeats take turns
    assert all(r["new_tokens"] == 6 and r["equal_to_reference"] for r in rows)


def test_a_pass_the_device_cannot_hold_is_refused_before_the_models_load(tmp_path, monkeypatch):
    import d3d.bench as bench

    monkeypatch.setattr(bench, "load_models", lambda *a, **k: pytest.fail("the models loaded before the check"))
    with pytest.raises(ConfigError, match=r"block_size=256"):
        run_bench(compose("bench", [*TINY, "bench.methods=[ar,async]", "methods.async.block_size=256",
                                    "methods.async.C=256", "methods.async.F=8"], tmp_path))


def test_a_missing_drafter_folder_is_said_before_the_models_load(tmp_path, monkeypatch):
    import d3d.bench as bench

    monkeypatch.setattr(bench, "load_models", lambda *a, **k: pytest.fail("the models loaded before the check"))
    with pytest.raises(ConfigError, match=r"^bench.also_drafters.unpruned=.*does not exist"):
        run_bench(compose("bench", [*TINY, f"+bench.also_drafters.unpruned={tmp_path}/nowhere"], tmp_path))


def test_a_checkpoint_of_another_block_rule_is_refused_before_the_models_load(tmp_path, drafter, monkeypatch):
    """d3d.bench holds a trained drafter by the handle d3d.eval holds it by (SavedDrafter): a run that asks
    for a block rule the drafter was not trained with is refused before anything loads."""
    import d3d.bench as bench

    monkeypatch.setattr(bench, "load_models", lambda *a, **k: pytest.fail("the models loaded before the check"))
    with pytest.raises(ConfigError, match=r"block_attention"):
        run_bench(compose("bench", [*TINY, "bench.methods=[ar,sync]", f"drafter.checkpoint={drafter}",
                                    "drafter.block_attention=causal"], tmp_path))


def test_a_trained_drafter_loads_as_eval_loads_it_and_is_named_by_its_weights(tmp_path, drafter, monkeypatch):
    """The configured attention backend (the target's, which the drafter copies), and the resume key names
    the drafter by its weights' fingerprint, as d3d.eval's does: a drafter retrained into the same folder is
    another drafter."""
    import d3d.bench as bench
    from d3d.models.drafter import weights_fingerprint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, methods = bench.bind_bench(compose("bench", [*TINY, "bench.methods=[ar,sync]", f"drafter.checkpoint={drafter}",
                                                      f"+bench.also_drafters.again={drafter}",
                                                      "target.attn_implementation=eager"], tmp_path))
    _, _, target, model, also = bench.load_models(cfg, methods, bench.resolve_path(cfg.paths.cache_dir))
    assert model.config._attn_implementation == "eager" == also["again"].config._attn_implementation
    key = bench.resume_key(cfg, {})
    named = {"drafter": str(drafter.resolve()), "drafter_weights": weights_fingerprint(drafter)}
    assert {k: key[k] for k in named} == named and key["also_drafters"] == {"again": named}


def test_a_draft_vocabulary_drafter_beside_the_full_head_reports_each_pass_and_best_row(tmp_path, drafter, monkeypatch):
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_drafter(drafter, dtype="float32")
    V = model.get_output_embeddings().weight.shape[0]
    d2t = torch.tensor(sorted(set(range(0, V, 3)) | set(special_ids(tok, V))))
    attach_draft_head(model, d2t)
    dv = save_drafter(model, tok, tmp_path / "dv")
    out = run_bench(compose("bench", [*TINY, "bench.methods=[generate,ar,sync,tree]", f"drafter.checkpoint={dv}",
                                      f"+bench.also_drafters.full={drafter}", "bench.n_prompts=2",
                                      "methods.sync.block_size=4", "methods.tree.tree_nodes=3"], tmp_path))
    summary = json.loads((out / "summary.json").read_text())
    blocks = summary["pass_cost"]["drafter_block"]
    assert {k: v["head_rows"] for k, v in blocks.items()} == {"drafter": len(d2t), "drafter@full": V}
    assert all(v["ms"] > 0 for v in blocks.values())
    by = {e["method"]: e for e in summary["methods"]}
    assert set(summary["best_with_drafts"]) == {"drafter", "full"}
    for label, method in summary["best_with_drafts"].items():  # the fastest drafting row of each drafter
        mine = [e for m, e in by.items() if e["drafter_share"] and (m.endswith("@full") == (label == "full"))]
        assert by[method]["tokens_per_s"] == max(e["tokens_per_s"] for e in mine)
    text = (out / "summary.md").read_text()
    best = next(line for line in text.splitlines() if line.startswith("Fastest row with drafts per drafter: "))
    assert "drafter: " in best and "full: " in best and f", {len(d2t)} head rows)" in text
