"""The one room where a drafter's saved facts are read (d3d.models.drafter_settings, d3d.models.drafter):
its settings from a folder without loading it, its draft map, and the served block rule switched and
put back. The rule that nothing else reads them is in tests/unit/test_architecture.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from d3d.models.drafter import DraftHead, block_attention_as
from d3d.models.drafter_settings import DrafterSettings, draft_map
from d3d.models.forward import causal_blocks


def test_a_folders_settings_are_read_from_its_config_alone(tmp_path):
    saved = DrafterSettings(block_size=4, mask_token_id=9, vocab_size=10, draft_vocab=6, block_attention="causal")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "d3d": asdict(saved)}))
    assert DrafterSettings.of_folder(tmp_path) == saved
    assert DrafterSettings.of(SimpleNamespace(config=SimpleNamespace(d3d=asdict(saved)))) == saved
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "pard_token": 9}))  # a PARD-format folder
    assert DrafterSettings.of_folder(tmp_path) is None
    (tmp_path / "config.json").write_text('{"vocab_size": 1')  # torn
    assert DrafterSettings.of_folder(tmp_path) is None
    assert DrafterSettings.of_folder(tmp_path / "nowhere") is None
    plain = SimpleNamespace(config=SimpleNamespace())  # the target: no settings
    assert DrafterSettings.of(plain, required=False) is None
    with pytest.raises(ValueError, match="no d3d settings"):
        DrafterSettings.of(plain)


def test_the_draft_map_of_a_model_or_its_head():
    d2t = torch.tensor([0, 3, 5])
    head = DraftHead(torch.randn(3, 4), d2t)
    model = SimpleNamespace(get_output_embeddings=lambda: head)
    assert torch.equal(draft_map(model), d2t) and torch.equal(draft_map(head), d2t)
    assert draft_map(torch.nn.Linear(4, 6)) is None  # a full head


def test_the_served_rule_is_switched_for_the_duration_and_put_back():
    model = SimpleNamespace(config=SimpleNamespace(d3d=asdict(DrafterSettings(block_attention="bidirectional"))))
    with pytest.raises(RuntimeError):
        with block_attention_as(model, "causal"):
            assert causal_blocks(model)
            raise RuntimeError("a pass failed")
    assert not causal_blocks(model) and DrafterSettings.of(model).block_attention == "bidirectional"
