"""Divergence bookkeeping without a model: the first differing token, the rounding tolerance per
dtype, and what "equal to sync" compares in each dtype. Classifying real divergences with the
target's logits is in tests/integration/test_divergence.py."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding.divergence import first_difference, tolerance


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_tolerance_scales_with_the_dtype_and_the_logit():
    assert tolerance(torch.bfloat16, 20.0) == pytest.approx(8 * 2**-7 * 20)
    assert tolerance(torch.float32, 0.1) == pytest.approx(8 * 2**-23)  # |logit| < 1 counts as 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_sync_compares_tau_in_fp32_only(dtype):
    """An async row with sync's tokens but another τ (a near-tie draft flipped by bf16 SDPA's key
    layout, docs/design.md#losslessness) is equal to sync in bf16, where τ is not compared, and not in fp32; the
    summary says what was compared."""
    from types import SimpleNamespace

    from d3d.decoding import DecodeConfig
    from d3d.eval import compare_with_references
    from d3d.report import summary_markdown, method_stats

    model = torch.nn.Linear(2, 2).to(dtype)
    gen = SimpleNamespace(cfg=DecodeConfig(method="async"), target=model, drafter=model)
    sync = {"token_ids": [5, 6, 7, 8], "taus": [2, 2], "concurrency": 1}
    row = {"token_ids": [5, 6, 7, 8], "taus": [1, 3], "concurrency": 1, "equal_to_ar": True}
    compare_with_references(row, gen, None, sync, [[1, 2]])
    fp32 = dtype == torch.float32
    assert row["equal_to_sync"] is not fp32 and row["sync_compared"] == ("tokens and tau" if fp32 else "tokens")
    stats = {k: 0.0 for k in ("speedup_token_weighted", "speedup_with_prefill", "tau_token_weighted", "hit_rate",
                              "tpot_ms_token_weighted", "tokens_per_s", "equal_to_ar", "accuracy")}
    stats.update(rows=1, equal_to_sync=float(row["equal_to_sync"]), sync_compared=row["sync_compared"], divergences={})
    md = summary_markdown({"benchmarks": {"gsm8k": {"async": stats}}, "mean_over_benchmarks": {}})
    assert f"equal to sync ({row['sync_compared']})" in md and ("not compared in bf16" in md) is not fp32
    row["decode_s"] = row["prefill_s"] = 1.0
    row.update(new_tokens=4, rounds=2, hit_rate=None, correct=None)
    assert method_stats([row])["sync_compared"] == row["sync_compared"]
