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

    monkeypatch.setitem(p.SCORERS, "first", lambda model, calib, s, pc, record: [1.0] + [0.0] * 9)
    pc = SimpleNamespace(method="first", layers_per_step=1, step_safe_retention=0.99)
    layers, scores = p.choose_layers(None, [], None, pc, 1.0)
    assert layers == [0] and scores[0] == 1.0
    assert {"acceptance", "last", "similarity"} <= set(p.SCORERS)  # the shipped ones, at least
    with pytest.raises(ConfigError, match=f"prune.method='nope': no such pruning criterion. Fix: use one of "
                                          f"{', '.join(sorted(p.SCORERS))}"):
        p.choose_layers(None, [], None, SimpleNamespace(method="nope"), 1.0)
