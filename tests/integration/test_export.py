"""d3d.export on the smoke setup: the folder vLLM loads (vocabulary, mask id, speculative_config) runs
the drafter's causal block as a plain causal LM, and a bidirectional drafter is exported only with its
served τ said. vLLM itself runs it in tests/integration/test_serving.py (slow)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from d3d.errors import ConfigError, UserError
import d3d.export
from d3d.export import not_exported, run_export
from d3d.generate import run_generate
from d3d.models.drafter import attach_draft_head, build_drafter, load_drafter, save_drafter, special_ids
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout
from d3d.settings import bind_config
from tests.conftest import compose

SMOKE = ["+experiment=smoke", "data.limit=6", "generate.max_new_tokens=24", "train.val_size=3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("export_root")
    run_generate(compose("generate", SMOKE, path))
    return path


def drafter(root, rule: str):
    """A tiny drafter with lively weights, saved as a checkpoint of `rule`."""
    cfg = bind_config(compose("train", SMOKE + [f"drafter.block_attention={rule}"], root), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return save_drafter(model, tok, root / f"drafter_{rule}")


def check_profile(out, k: int) -> dict:
    """speculation_profile.json: the served drafter's per-position rates over K positions, from the same
    steps as export.json's served τ (1 + Σ cumulative = τ), each convention said."""
    profile = json.loads((out / "speculation_profile.json").read_text())
    measured = json.loads((out / "export.json").read_text())
    measured = measured.get("measured_full_head") or measured["measured"]
    assert profile["num_speculative_tokens"] == k and profile["positions"] == list(range(1, k + 1))
    assert profile["length_with_bonus"] == list(range(2, k + 2))
    assert len(profile["cumulative"]) == len(profile["conditional"]) == k
    assert 1 + sum(profile["cumulative"]) == pytest.approx(measured[f"tau_served_causal_K{k}"])
    assert profile["conditional"][0] == profile["cumulative"][0]
    assert set(profile["conventions"]) >= {"cumulative", "conditional", "length_with_bonus"}
    return profile


def export(root, folder, rule: str, *extra):
    cfg = compose("export", SMOKE + [f"drafter.checkpoint={folder}", f"drafter.block_attention={rule}",
                                     f"export.out_dir={root}/served_{rule}", *extra], root)
    return run_export(cfg)


@pytest.mark.parametrize("mask", [None, 7])  # the trained id (inside this vocabulary), or moved into row 7
def test_a_causal_drafter_exports_as_a_plain_causal_lm_with_its_drafts(root, capsys, mask):
    folder = drafter(root, "causal")
    out = export(root, folder, "causal", *([f"export.mask_token_id={mask}"] if mask is not None else []))
    spec = json.loads((out / "speculative_config.json").read_text())
    original, _ = load_drafter(folder, dtype="float32")
    s = DrafterSettings.of(original)
    assert spec == {"method": "draft_model", "model": str(out), "num_speculative_tokens": s.block_size - 1,
                    "parallel_drafting": True}
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == spec  # printed for the user too, after each stage's name as it starts
    assert [line.split(":")[0] for line in printed[:-1] if line.startswith("[d3d.export]")] == [
        f"[d3d.export] {stage}" for stage in ("load", "measure", "convert", "write", "check")]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == s.vocab_size and 0 <= config["mask_token_id"] < s.vocab_size
    assert config["mask_token_id"] == (s.mask_token_id if mask is None else mask)
    assert config["tie_word_embeddings"] == (mask is None)  # a moved mask row is not the head's row
    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert served.get_output_embeddings().weight.shape[0] == s.vocab_size
    # vLLM's pass: the committed tokens, then [last committed, MASK x (K-1)], plain causal attention,
    # the served mask id; d3d's: the trained mask id in its causal block. The same K drafts' logits.
    ids = torch.randint(4, 200, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    k, a = spec["num_speculative_tokens"], len(ids) - 1
    with torch.no_grad():
        vllm_like = served(torch.tensor([ids + [config["mask_token_id"]] * (k - 1)])).logits[0, a:]
        from transformers import DynamicCache

        cache = DynamicCache(config=original.config)
        hidden_states(original, torch.tensor([ids[:a]]), clean_layout(a), cache=cache)
        h = hidden_states(original, torch.tensor([[ids[a]] + [s.mask_token_id] * (s.block_size - 1)]),
                          block_layout(torch.tensor([[a]]), s.block_size), cache=cache, cache_len=a)
        d3d = logits_at(original, h[0, :k], s.vocab_size)
    torch.testing.assert_close(vllm_like, d3d, atol=1e-4, rtol=1e-4)
    record = json.loads((out / "export.json").read_text())
    assert record["trained_block_attention"] == "causal" and record["measured"]["responses"] == 3
    check_profile(out, k)
    assert "mask_convention" in record and record["mask_convention"] is None  # not a Qwen3 vocabulary
    # d3d loads the export as the drafter vLLM runs (causal, the served mask id)
    again = DrafterSettings.of(load_drafter(out, dtype="float32")[0])
    assert (again.block_attention, again.mask_token_id) == ("causal", config["mask_token_id"])
    assert not_exported(out) == []  # every file it wrote is one d3d.export knows it writes, so it replaces them


def spoil_config(folder):
    config = json.loads((folder / "config.json").read_text())
    config["mask_token_id"] += 1  # vLLM would write another token into the block than the drafter was served with
    (folder / "config.json").write_text(json.dumps(config))


def spoil_weights(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] += 1.0  # one number of one layer, as a bad disk or a bug might
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checked(root):
    """A causal drafter and its export, which the spoiled exports below must leave as it is."""
    folder = drafter(root, "causal")
    return folder, export(root, folder, "causal", f"export.out_dir={root}/served_checked")


@pytest.mark.parametrize("spoil, said", [(spoil_config, "config.json's mask_token_id"),
                                         (spoil_weights, "other logits than the converted drafter's")])
def test_an_export_that_does_not_reload_as_converted_is_refused_and_the_last_one_stays(root, checked, monkeypatch,
                                                                                      spoil, said):
    """The last stage reloads the folder written (<out>.partial) as d3d loads it, before it replaces
    the export at <out>: its served rule, a probe's logits and its served τ must be the converted drafter's."""
    folder, out = checked
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    write = d3d.export.write

    def spoiled(target, served):
        write(target, served)
        spoil(target)

    monkeypatch.setattr(d3d.export, "write", spoiled)
    with pytest.raises(UserError, match=f"does not reload as the drafter converted: {said}"):
        export(root, folder, "causal", f"export.out_dir={out}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept


def test_an_out_dir_holding_a_users_files_is_refused_before_the_drafter_loads(root, monkeypatch):
    folder = drafter(root, "causal")
    out = root / "served_users"
    out.mkdir()
    (out / "export.json").write_text("{}")
    (out / "README.md").write_text("mine")
    monkeypatch.setattr(d3d.export.SavedDrafter, "load", lambda *a, **k: pytest.fail("the drafter loaded"))
    with pytest.raises(ConfigError, match="holds an export and also README.md, which d3d.export did not write"):
        export(root, folder, "causal", f"export.out_dir={out}")
    assert (out / "README.md").read_text() == "mine"


def test_a_draft_vocabulary_drafter_exports_with_a_full_head_and_its_tau_both_ways(root, caplog):
    model, tok = load_drafter(drafter(root, "causal"), dtype="float32")
    s = DrafterSettings.of(model)
    d2t = torch.tensor(sorted(set(range(0, s.vocab_size, 2)) | set(special_ids(tok, s.vocab_size, s.mask_token_id))))
    attach_draft_head(model, d2t)
    dv = save_drafter(model, tok, root / "drafter_dv")
    with caplog.at_level(logging.INFO, logger="d3d.export"):
        out = export(root, dv, "causal", "export.out_dir=" + str(root / "served_dv"))
    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    head = served.get_output_embeddings().weight.detach()
    assert head.shape[0] == s.vocab_size and json.loads((out / "config.json").read_text())["vocab_size"] == s.vocab_size
    torch.testing.assert_close(head[d2t], model.get_output_embeddings().weight.detach())  # its rows at their ids
    outside = torch.ones(s.vocab_size, dtype=torch.bool).index_fill_(0, d2t, False)
    assert not head[outside].any()  # and nothing anywhere else
    record = json.loads((out / "export.json").read_text())
    assert record["draft_vocab"] == len(d2t) and set(record["measured_full_head"]) == set(record["measured"])
    assert all(1.0 <= record[m]["tau_served_causal_K15"] <= 16 for m in ("measured", "measured_full_head"))
    assert "served as a head of" in caplog.text
    check_profile(out, 15)  # the full head's steps: what vLLM runs
    assert DrafterSettings.of(load_drafter(out, dtype="float32")[0]).draft_vocab is None  # d3d reads a full head


def test_a_bidirectional_drafter_is_exported_with_its_served_tau_said(root, caplog):
    folder = drafter(root, "bidirectional")
    with caplog.at_level(logging.WARNING, logger="d3d.export"):
        out = export(root, folder, "bidirectional", "export.num_speculative_tokens=2")
    record = json.loads((out / "export.json").read_text())
    served = record["measured"]["tau_served_causal_K2"]
    assert f"its τ is {served:.3f} there (K=2)" in caplog.text
    assert 1.0 <= served <= 3.0 and record["speculative_config"]["num_speculative_tokens"] == 2
    check_profile(out, 2)


def test_a_bidirectional_drafter_without_responses_to_measure_is_refused(root, tmp_path):
    folder = drafter(root, "bidirectional")
    with pytest.raises(ConfigError, match="trained with bidirectional blocks.*Fix: run d3d.generate"):
        export(root, folder, "bidirectional", f"train.responses_dir={tmp_path}/none")


@pytest.mark.parametrize("extra, message", [
    (["drafter.block_attention=causal"], "trained with drafter.block_attention=bidirectional"),
    (["export.num_speculative_tokens=99"], "export.num_speculative_tokens=99: a drafter trained on blocks of"),
    (["export.mask_token_id=100000000"], "export.mask_token_id=100000000: vLLM needs it inside"),
])
def test_bad_export_settings_are_refused_in_one_line(root, extra, message):
    folder = drafter(root, "bidirectional")
    cfg = compose("export", SMOKE + [f"drafter.checkpoint={folder}", f"export.out_dir={root}/x", *extra], root)
    with pytest.raises(ConfigError, match=message):
        run_export(cfg)
