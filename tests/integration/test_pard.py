"""A PARD-format drafter in d3d's loop: a causal LM with a mask id in its config.json and no d3d
settings loads with drafter.checkpoint=<folder> (d3d.models.drafter.pard_settings) and decodes with
every method, greedy rows equal to AR. Two such folders made here (no PARD weights can be downloaded):
a d3d export read back without its d3d settings (its `mask_token_id`), and a plain HF causal LM
folder built by the test with a `pard_token`."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from d3d.errors import ConfigError
from d3d.eval import run_eval
from d3d.export import run_export
from d3d.models.drafter import build_drafter, check_is_drafter, load_drafter, save_drafter
from d3d.utils.checkpoints import MASK_ID_KEYS, named_mask_id
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.target import load_tokenizer, resolve_model_path
from d3d.settings import bind_config
from d3d.utils.io import read_jsonl
from tests.conftest import compose

SMOKE = ["+experiment=smoke", "eval.n=1", "eval.max_new_tokens=12", "decode.block_size=4", "decode.C=3", "decode.F=2",
         "drafter.block_size=4",
         "drafter.block_attention=causal"]


def lively(model):
    """Weights moved off the target's, so drafts are sometimes rejected and the loop's rejection paths run."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def exported_without_d3d(root):
    """A causal d3d drafter exported (its mask id written as config.json's `mask_token_id`, where vLLM
    reads it), then stripped of its d3d settings: the PARD format as another tool would read it."""
    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.block_attention=causal",
                                        "drafter.block_size=4"], root), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    source = save_drafter(lively(model), tok, root / "drafter")
    out = run_export(compose("export", ["+experiment=smoke", f"drafter.checkpoint={source}",
                                        "drafter.block_attention=causal", f"export.out_dir={root}/served",
                                        f"train.responses_dir={root}/none"], root))
    config = json.loads((out / "config.json").read_text())
    del config["d3d"]
    (out / "config.json").write_text(json.dumps(config))
    return out, "mask_token_id", config["mask_token_id"]


def foreign_folder(root):
    """A plain HF causal LM folder of the target's family with a `pard_token` and nothing of d3d's."""
    cfg = bind_config(compose("eval", SMOKE, root), "eval")
    path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    model = lively(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    out = root / "pard"
    model.save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    mask_id = config["vocab_size"] - 1
    (out / "config.json").write_text(json.dumps({**config, "pard_token": mask_id}))
    return out, "pard_token", mask_id


@pytest.mark.heavy  # two tiny-model evals, ~40 s on 2 cores
@pytest.mark.parametrize("make", [exported_without_d3d, foreign_folder])
def test_a_pard_format_drafter_decodes_in_d3ds_loop_equal_to_ar(tmp_path, monkeypatch, caplog, make):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, key, mask_id = make(tmp_path)
    assert "d3d" not in json.loads((folder / "config.json").read_text())
    model, _ = load_drafter(folder, dtype="float32", block_size=4)
    s = DrafterSettings.of(model)
    assert (s.block_attention, s.mask_token_id, s.block_size, s.init) == ("causal", mask_id, 4, f"pard:{key}")
    with caplog.at_level(logging.INFO, logger="d3d.models.drafter"):
        # no drafter.block_attention: a PARD folder's causal rule is its default (d3d.utils.checkpoints.saved_defaults)
        as_given = [o for o in SMOKE if not o.startswith("drafter.block_attention")]
        out = run_eval(compose("eval", as_given + [f"drafter.checkpoint={folder}", "eval.methods=[ar,sync,async,tree]",
                                                   f"eval.out_dir={tmp_path}/ev"], tmp_path))
    assert f"mask id {mask_id} from config.json's {key}" in caplog.text
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert {r["method"] for r in rows} == {"ar", "sync", "async", "tree"}
    assert all(r["equal_to_ar"] for r in rows)  # greedy: the PARD drafter's rows are the target's tokens
    assert any(t > 1 for r in rows if r["method"] == "sync" for t in r["taus"])  # it drafted, and some were accepted
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["benchmarks"]["gsm8k"]["sync"]["acceptance"]["cumulative"]) == 3


def test_a_pard_folder_is_refused_with_a_bidirectional_rule_and_without_a_block(tmp_path):
    """PARD drafts with causal blocks: asking d3d for bidirectional ones is refused before loading, as for a
    causal d3d drafter; the folder does not say its block, so a command that gives none (export, prune) is
    told which ones read it."""
    from d3d.models.drafter import check_block_attention

    folder, _, _ = foreign_folder(tmp_path)
    check_is_drafter(folder)  # a drafter, not a plain model
    with pytest.raises(ConfigError, match="was trained with drafter.block_attention=causal"):
        check_block_attention(folder, "bidirectional")
    with pytest.raises(ConfigError, match="PARD-format drafter .*only d3d.eval and d3d.bench decode one.* Fix:"):
        load_drafter(folder, dtype="float32")


def test_the_mask_id_key_is_read_in_vllms_order():
    """Two public Qwen3 conventions (PARD-2's 151670 under pard_token, SDAR-derived configs' 151669 under
    mask_token_id): whichever the folder names, and where it names two, the first of MASK_ID_KEYS."""
    assert named_mask_id({"pard_token": 151670}) == ("pard_token", 151670)
    assert named_mask_id({"mask_token_id": 151669}) == ("mask_token_id", 151669)
    assert named_mask_id({"pard_token": 151670, "mask_token_id": 151669}) == ("mask_token_id", 151669)
    assert named_mask_id({"dflash_config": {"mask_token_id": 3}, "mask_token_id": 5}) == ("dflash_config.mask_token_id", 3)
    assert named_mask_id({"vocab_size": 10}) is None
    assert MASK_ID_KEYS.index("mask_token_id") < MASK_ID_KEYS.index("pard_token")


def test_an_export_records_which_convention_its_mask_id_is():
    from d3d.models.drafter import mask_convention

    assert "SDAR" in mask_convention(151669, 151936) and "PARD-2" in mask_convention(151670, 151936)
    assert mask_convention(151669, 49152) is None and mask_convention(16, 49152) is None


def test_a_mask_id_outside_the_folders_rows_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "num_hidden_layers": 1, "pard_token": 10}))
    with pytest.raises(ConfigError, match="mask id 10 \\(config.json's pard_token\\) lies outside its 10 embedding rows"):
        check_is_drafter(tmp_path)
