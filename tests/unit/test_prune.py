"""d3d.prune's criterion registry, with a stand-in scorer (no model). Pruning end to end, its
resumes and its baselines are in tests/integration/test_prune.py."""

from __future__ import annotations

import pytest


def test_a_new_pruning_criterion_is_one_registry_entry(tmp_path, monkeypatch):
    """choose_layers dispatches on prune.method through SCORERS: a criterion registered there is
    used with no other change, and an unknown name is refused naming the ones there are."""
    import d3d.prune as p
    from d3d.config import ConfigError

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
