"""`d3d.eval drafter.checkpoint=<folder>` with no other drafter key runs the drafter as it was trained:
causal blocks (it was refused: "this run sets bidirectional"), its draft vocabulary and its trained
block, greedy rows equal to AR."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from d3d.eval import run_eval
from d3d.models.drafter import attach_draft_head, build_drafter, save_drafter, special_ids
from d3d.settings import bind_config
from d3d.utils.io import read_jsonl
from tests.conftest import compose

EVAL = ["+experiment=smoke", "eval.n=1", "eval.max_new_tokens=12", "eval.methods=[ar,sync]"]


def test_eval_runs_a_causal_draft_vocabulary_checkpoint_as_trained(tmp_path, monkeypatch):
    """One drafter saved with both facts unlike the defaults (causal blocks, a draft vocabulary) and
    a block of 4: one eval run, with only drafter.checkpoint, takes all three."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.block_attention=causal", "drafter.block_size=4"],
                              tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    rows_of_head = model.get_output_embeddings().weight.shape[0]
    d2t = torch.tensor(sorted(set(range(0, rows_of_head, 3)) | set(special_ids(tok, rows_of_head))))
    attach_draft_head(model, d2t)
    folder = save_drafter(model, tok, tmp_path / "drafter")
    out = run_eval(compose("eval", EVAL + [f"eval.out_dir={tmp_path}/ev", f"drafter.checkpoint={folder}"], tmp_path))
    ran = OmegaConf.load(out / "config.yaml").drafter
    assert (ran.block_attention, ran.block_size, ran.draft_vocab) == ("causal", 4, len(d2t))
    run = json.loads((out / "run.json").read_text())
    assert run["methods"]["sync"]["block_size"] == 4 and run["notes"] == []  # its trained block: no stated choice
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert {r["method"] for r in rows} == {"ar", "sync"} and all(r["equal_to_ar"] for r in rows)
