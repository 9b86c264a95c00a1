"""AR/spec divergences classified by the target's logit margin (numerical vs real), and the eval
rows that carry them: async equal to sync (tokens; τ too in fp32), a real divergence stops the run loudly."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding.divergence import RealDivergence, classify
from d3d.settings import bind_config
from tests.conftest import compose


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


def test_eval_rows_carry_async_equal_to_sync_and_stop_on_a_real_divergence(tmp_path, monkeypatch):
    """End to end: fp32 async rows equal sync bit for bit; then a verifier that accepts one draft
    too many (a lossless bug) makes the run fail loudly, after the offending row is written."""
    import json

    from d3d.decoding import drafts  # the chain's accept (Chain.accept) calls greedy_verify
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

    real = drafts.greedy_verify

    monkeypatch.setattr(drafts, "greedy_verify", lambda p, d: _lax(real, p, d))
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
