"""d3d.prune's criterion registry, with a stand-in scorer (no model). Pruning end to end, its
resumes and its baselines are in tests/integration/test_prune.py."""

from __future__ import annotations

import pytest


def test_a_new_pruning_criterion_is_one_registry_entry(tmp_path, monkeypatch):
    """choose_layers dispatches on prune.method through SCORERS: a criterion registered there is
    used with no other change, and an unknown name is refused naming the ones there are."""
    import d3d.prune as p
    from d3d.errors import ConfigError

    from types import SimpleNamespace

    monkeypatch.setitem(p.SCORERS, "first", lambda model, calib, s, pc, record, acc: [1.0] + [0.0] * 9)
    pc = SimpleNamespace(method="first", layers_per_step=1, step_safe_retention=0.99)
    layers, scores = p.choose_layers(None, [], None, pc, 1.0)
    assert layers == [0] and scores[0] == 1.0
    assert {"acceptance", "last", "similarity"} <= set(p.SCORERS)  # the shipped ones, at least
    with pytest.raises(ConfigError, match=f"prune.method='nope': no such pruning criterion. Fix: use one of "
                                          f"{', '.join(sorted(p.SCORERS))}"):
        p.choose_layers(None, [], None, SimpleNamespace(method="nope"), 1.0)


def test_a_step_removes_by_tau_safety_or_as_many_layers_as_the_baseline_rule_allows(monkeypatch):
    """Acceptance-guided: the best layer, then the next best whose removal alone keeps
    step_safe_retention of τ. A proxy or a rule (similarity, last) says nothing of τ: its
    layers_per_step best go together, so baselines and acceptance remove equal counts a step."""
    import d3d.prune as p
    from types import SimpleNamespace

    taus = [1.0, 2.0, 1.99, 1.5, 2.1, 1.95]  # τ without each layer; τ now 2.0
    monkeypatch.setitem(p.SCORERS, "acceptance", lambda *a: taus)
    monkeypatch.setitem(p.SCORERS, "similarity", lambda *a: taus)
    pc = SimpleNamespace(method="acceptance", layers_per_step=3, step_safe_retention=0.99)
    assert p.choose_layers(None, [], None, pc, 2.0) == ([1, 2, 4], taus)  # 1.95 < 0.99 * 2.0
    assert p.choose_layers(None, [], None, SimpleNamespace(**{**vars(pc), "step_safe_retention": 1.0}), 2.0)[0] == [1, 4]
    assert p.choose_layers(None, [], None, SimpleNamespace(**{**vars(pc), "method": "similarity"}), 2.0)[0] == [1, 2, 4]
    pc_last = SimpleNamespace(**{**vars(pc), "method": "last"})
    six_layers = SimpleNamespace(base_model=SimpleNamespace(layers=[None] * 6))
    assert p.choose_layers(six_layers, [], None, pc_last, 2.0) == ([3, 4, 5], None)  # the last three, one step


@pytest.mark.parametrize("overlay", ["qwen3_8b_d8b", "qwen3_32b_d8b"])
def test_the_8b_overlays_remove_five_of_36_layers_as_the_paper_does(overlay):
    """prune.num_layers counts layers to REMOVE: D3D-31D-p8B keeps 31 of 36, so the 8B overlays remove 5
    (they used to say 31, read as removals: 5 layers left). The count is read from the config alone."""
    import d3d.prune as p
    from d3d.settings import bind_config
    from tests.conftest import compose

    cfg = bind_config(compose("prune", [f"+experiment={overlay}", "drafter.checkpoint=null"]), "prune")
    layers = p.starting_layers(cfg)
    assert (layers, layers - cfg.prune.num_layers) == (36, 31)


@pytest.mark.parametrize("num_layers, layers, message", [
    (4, 4, r"^prune.num_layers=4 would remove every layer of a 4-layer drafter. Fix: set prune.num_layers=3 or fewer"),
    (31, 36, r"^prune.num_layers=31 would leave 5 of the drafter's 36 layers \(fewer than a quarter\): it counts the "
             r"layers to REMOVE, not those kept. Fix: prune.num_layers=5 keeps 31; at most 27 may go"),
])
def test_a_layer_count_read_as_layers_kept_is_refused_in_one_line(num_layers, layers, message):
    """Removing every layer, or so many that fewer than a quarter stay (num_layers misread as the
    layers to keep), is refused with the fix; a quarter left, or the paper's 5 of 36, passes."""
    import d3d.prune as p
    from d3d.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        p.check_layer_count(num_layers, layers)
    p.check_layer_count(27, 36)
    p.check_layer_count(3, 4)  # one of four left: a quarter


def test_the_layer_count_is_checked_before_the_drafter_loads(tmp_path, monkeypatch):
    """A drafter checkpoint's config.json says its layer count: a misread prune.num_layers is refused
    before its weights load (at 8B that was minutes of loading, then the refusal)."""
    import json

    import d3d.prune as p
    from d3d.errors import ConfigError
    from d3d.settings import bind_config
    from tests.conftest import compose

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "d3d": {}}))
    raw = compose("prune", ["+experiment=smoke", f"drafter.checkpoint={folder}", "prune.num_layers=31"], tmp_path)
    assert p.starting_layers(bind_config(raw, "prune")) == 36
    monkeypatch.setattr(p, "fp32_drafter", lambda *a, **k: pytest.fail("the drafter loaded before the check"))
    monkeypatch.setattr(p, "held_out", lambda *a, **k: pytest.fail("the responses loaded before the check"))
    with pytest.raises(ConfigError, match=r"^prune.num_layers=31 would leave 5 of the drafter's 36 layers"):
        p.run_prune(raw)


def test_the_deployed_copy_costs_its_own_bytes_and_takes_no_gradient(monkeypatch):
    """as_deployed (pruning's scoring, τ and latencies in the decode dtype) casts one parameter at a
    time: beside the fp32 drafter it allocates the bf16 copy (half the fp32 bytes), not a second fp32
    copy first (1.5x: 61 GiB at 8B where the plan counted 44); ties hold; no parameter takes a gradient."""
    import torch

    from d3d.models.drafter import as_deployed
    from d3d.models.random_models import random_model
    from tests.conftest import load_script

    monkeypatch.setenv("D3D_CPU_BF16", "1")  # a CPU that decodes in bf16, as a GPU does
    model = random_model("memory_plan", "cpu", torch.float32, seed=0, attn="sdpa")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    fp32 = sum(p.untyped_storage().nbytes() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    kept = []
    peak = load_script("memory_plan").measured_peak(lambda: kept.append(as_deployed(model)))
    deployed = kept[0]
    assert next(deployed.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    assert not any(p.requires_grad for p in deployed.parameters())
    assert deployed.get_output_embeddings().weight is deployed.get_input_embeddings().weight
    assert peak < 0.6 * fp32, (peak / fp32)
