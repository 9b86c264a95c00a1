"""The budget chooser's round-time model on a hand case (no model: the pass costs and hit rates are
given). Its offline hit rates against the real async loop are in tests/integration/test_budget.py."""

from __future__ import annotations

import pytest

from d3d.decoding.budget import choose


def test_choose_follows_the_round_model():
    costs = {"step_ms": 10.0, "verify_ms": 12.0, "draft_ms": 8.0, "packed_ms": {"4x1": 6.0, "8x2": 20.0}}
    hits = {(4, 1): 0.3, (8, 2): 0.7}
    serial = choose(costs, hits, tau=3.0, overlap=False, knobs=("C", "F"))
    # serial: 4x1 -> 12 + 6 + 0.7*8 = 23.6 ms; 8x2 -> 12 + 20 + 0.3*8 = 34.4 ms
    assert serial.settings == {"C": 4, "F": 1} and serial.projected_speedup == pytest.approx(30 / 23.6)
    assert serial.sync_speedup == pytest.approx(30 / 20)
    # sync's 20 ms round beats every serial budget: run without trays, and say so
    assert not serial.trays and serial.why.startswith("no trays") and "1.50x" in serial.why
    assert "breaks even at τ = 2.00" in serial.why  # (8 + 12) / 10: a sync round costs two AR steps
    overlapped = choose(costs, hits, tau=3.0, overlap=True, knobs=("C", "F"))
    # overlapped: 4x1 -> 12 + 5.6 = 17.6; 8x2 -> 20 + 2.4 = 22.4
    assert overlapped.settings == {"C": 4, "F": 1} and overlapped.trays
    costs["packed_ms"]["8x2"] = 12.0  # now the big budget hides behind verify: 12 + 2.4 = 14.4
    assert choose(costs, hits, 3.0, overlap=True, knobs=("C", "F")).settings == {"C": 8, "F": 2}
