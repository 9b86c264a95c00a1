"""AR/spec divergences classified by the target's logit margin (numerical vs real), and the eval
rows that carry them: async equal to sync (tokens; τ too in fp32), a real divergence stops the run loudly."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding.divergence import RealDivergence, classify, first_difference, tolerance
from d3d.settings import bind_config
from tests.conftest import compose


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_tolerance_scales_with_the_dtype_and_the_logit():
    assert tolerance(torch.bfloat16, 20.0) == pytest.approx(8 * 2**-7 * 20)
    assert tolerance(torch.float32, 0.1) == pytest.approx(8 * 2**-23)  # |logit| < 1 counts as 1


@pytest.fixture(scope="module")
def target():
    from d3d.models import load_model, load_tokenizer, resolve_model_path

    cfg = bind_config(compose("train", ["+experiment=smoke"]), "train")
    path = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    model = load_model(path, "float32", "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model, load_tokenizer(path)


def _greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_classify_runner_up_is_numerical_only_within_rounding(target):
    model, tok = target
    prompt = tok("2+2=")["input_ids"]
    ref = _greedy(model, prompt, 6)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:3]])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    assert order[0] == ref[3]
    runner_up, last = ref[:3] + [order[1]], ref[:3] + [order[-1]]
    margin = float(logits[order[0]] - logits[order[1]])
    # fp32: 8 ulps of a logit is ~1e-5, far below any real margin: a flip to the runner-up is real
    d = classify(model, prompt, ref, runner_up)
    assert d["index"] == 3 and d["tokens"] == [ref[3], order[1]] and d["kind"] == "real"
    assert d["top1_top2_margin"] == pytest.approx(margin, rel=1e-4) and d["gap"] == pytest.approx(margin, rel=1e-4)
    # with a tolerance wider than the margin (a coarse dtype), the same flip is a near-tie: numerical
    wide = margin / (torch.finfo(torch.float32).eps * max(1.0, float(logits.max()))) * 1.01
    assert classify(model, prompt, ref, runner_up, ulps=wide)["kind"] == "numerical"
    assert classify(model, prompt, ref, last, ulps=wide)["kind"] == "real"  # the worst token is never a tie
    assert classify(model, prompt, ref, list(ref)) is None
    assert classify(model, prompt, ref, ref[:2])["kind"] == "real"  # one stopped where the other went on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_sync_compares_tau_in_fp32_only(dtype):
    """An async row with sync's tokens but another τ (a near-tie draft flipped by bf16 SDPA's key
    layout, DESIGN §10) is equal to sync in bf16, where τ is not compared, and not in fp32; the
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


def test_eval_rows_carry_async_equal_to_sync_and_stop_on_a_real_divergence(tmp_path, monkeypatch):
    """End to end: fp32 async rows equal sync bit for bit; then a verifier that accepts one draft
    too many (a lossless bug) makes the run fail loudly, after the offending row is written."""
    import json

    from d3d.decoding import engine
    from d3d.eval import run_eval
    from d3d.utils.io import read_jsonl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["+experiment=smoke", "eval.n=1", "eval.max_new_tokens=12", "decode.C=3", "decode.F=2",
            "decode.block_size=4"]
    out = run_eval(compose("eval", base + [f"eval.out_dir={tmp_path}/ok"], tmp_path))
    rows = list(read_jsonl(out / "rows.jsonl"))
    asyn = [r for r in rows if r["method"] == "async"]
    assert asyn and all(r["equal_to_sync"] is True for r in asyn)
    assert all("divergence" not in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["gsm8k"]["async"]["equal_to_sync"] == 1.0
    assert summary["benchmarks"]["gsm8k"]["sync"]["divergences"] == {"numerical": 0, "real": 0}

    real = engine.greedy_verify

    monkeypatch.setattr(engine, "greedy_verify", lambda p, d: _lax(real, p, d))
    with pytest.raises(RealDivergence, match="not numerics"):
        run_eval(compose("eval", base + ["eval.methods=[ar,sync]", f"eval.out_dir={tmp_path}/bad"], tmp_path))
    bad = [r for r in read_jsonl(tmp_path / "bad" / "rows.jsonl") if r["method"] == "sync"]
    assert bad and bad[0]["divergence"]["kind"] == "real"


def _lax(real, p_logits, drafts):
    """Greedy verification with a bug: the first rejected draft is accepted anyway."""
    accepted, token = real(p_logits, drafts)
    n = drafts.shape[1]
    if n == 0:
        return accepted, token
    rejected = accepted < n
    more = torch.where(rejected, accepted + 1, accepted)
    nxt = p_logits.argmax(-1).gather(1, more[:, None]).squeeze(1)
    return more, torch.where(rejected, nxt, token)
