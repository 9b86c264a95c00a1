"""drafter.block_attention=causal through every pass: the contracts (greedy == generate, the T = 1
law, estimator == loop) for every registered method with a causal drafter, each method's rounds
equal to its reference schedule's (a tray drafts what a synchronous pass would, so the tray pass
builds the causal mask too), and a checkpoint's rule refused when a run asks for the other.
The drafter is the `models` one with the same weights (tests/integration/conftest.py)."""

from __future__ import annotations

import pytest

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.methods import METHODS, drafts_of, method_row
from d3d.decoding.verify import Sampling
from d3d.errors import ConfigError
from d3d.estimator import greedy_rounds, match_lengths
from d3d.models.drafter import build_drafter, save_drafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.settings import bind_config
from tests.conftest import compose
from tests.integration.conftest import PROMPTS, reference, two_token_tv

DRAFTING = [name for name, row in METHODS.items() if row.needs_drafter]


def config(method: str, **kw) -> DecodeConfig:
    return DecodeConfig(method=method, block_size=6, C=3, F=2, tree_nodes=5, tree_trays=4, **kw)


@pytest.mark.parametrize("method", DRAFTING)
def test_greedy_equals_generate_and_the_reference_rounds_with_a_causal_drafter(causal_models, models, method):
    target, drafter, tok = causal_models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]

    def run(name, d=drafter):
        return SpecGenerator(target, tok, d, config(name, max_new_tokens=24)).generate(prompts)

    res = run(method)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 24, tok.eos_token_id), (method, row)
    ref = method_row(method).reference
    if ref is not None:  # async: a hit serves exactly the block a causal synchronous draft would
        assert res.taus() == run(ref).taus()
    # the rule is in force: the same weights drafting bidirectionally accept differently
    assert res.taus() != run(method, models[1]).taus()


@pytest.mark.parametrize("method", DRAFTING)
def test_the_t1_law_of_two_tokens_with_a_causal_drafter(causal_models, method):
    """The loop at T = 1 on a 2-token horizon: the joint law of (x1, x2) is the target's."""
    target, drafter, tok = causal_models
    prompt = tok("ab")["input_ids"]
    n = 3000
    s = Sampling(temperature=1.0, top_k=4)  # top-k keeps the support small enough to test
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method=method, block_size=4, C=3, F=2, temperature=1.0,
                                                           top_k=4, tree_nodes=4, tree_trays=6, max_new_tokens=2),
                        seed=0).generate([prompt] * n)
    tv = two_token_tv(target, prompt, s, res.token_ids)
    assert tv < 0.06, tv  # 16 outcomes, n = 3000: sampling noise gives TV ~0.03


@pytest.mark.parametrize("method", [m for m in DRAFTING if method_row(m).reference is None])
def test_the_estimator_equals_the_loop_with_a_causal_drafter(causal_models, method):
    """Offline τ (the estimator and pruning's scorer read the rule from the model too) is the loop's,
    round by round, for each drafts shape."""
    target, drafter, tok = causal_models
    s = DrafterSettings.of(drafter)
    cfg = config(method, max_new_tokens=40)
    for text in PROMPTS:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, drafter, cfg).generate([prompt])
        ids = prompt + res.token_ids[0]
        m = match_lengths(drafter, ids, len(prompt), 6, s.mask_token_id, s.vocab_size, drafts=drafts_of(cfg))
        assert greedy_rounds(m, len(prompt), len(ids), 6) == res.taus(), text


def test_a_checkpoint_loads_with_its_block_rule_and_the_other_is_refused(tmp_path):
    """The rule is saved with the drafter and is the default of a run that loads it; asking for the
    other one is one line naming both at bind, and the loader's check stays behind it."""
    from dataclasses import replace

    cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.block_attention=causal"], tmp_path), "train")
    model, tok = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    assert DrafterSettings.of(model).block_attention == "causal"
    save_drafter(model, tok, tmp_path / "d")
    again = bind_config(compose("train", ["+experiment=smoke", f"drafter.checkpoint={tmp_path / 'd'}"], tmp_path),
                        "train")
    assert again.drafter.block_attention == "causal"  # no drafter.block_attention: the checkpoint's
    loaded, _ = build_drafter(again.drafter, again.target, again.paths.cache_dir, dtype="float32")
    assert DrafterSettings.of(loaded).block_attention == "causal"
    with pytest.raises(ConfigError, match=r"^drafter.block_attention=bidirectional was set, but the checkpoint .* was "
                                          r"trained with drafter.block_attention=causal. Fix: drop the override"):
        bind_config(compose("train", ["+experiment=smoke", f"drafter.checkpoint={tmp_path / 'd'}",
                                      "drafter.block_attention=bidirectional"], tmp_path), "train")
    other = replace(again.drafter, block_attention="bidirectional")  # a spec built by hand meets the loader's check
    with pytest.raises(ConfigError, match="with drafter.block_attention=causal.*Fix: set drafter.block_attention=causal"):
        build_drafter(other, again.target, again.paths.cache_dir, dtype="float32")


def test_a_block_rule_that_does_not_exist_is_refused_at_bind():
    with pytest.raises(ConfigError, match="drafter.block_attention=sideways"):
        bind_config(compose("train", ["+experiment=smoke", "drafter.block_attention=sideways"]), "train")


@pytest.mark.parametrize("method", ["sync", "async"])
def test_the_static_backend_builds_the_causal_mask_too(causal_models, method):
    """decode.backend=static builds its mask in its own pass (d3d.decoding.kv.static_pass): the eager rounds."""
    target, drafter, tok = causal_models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    run = lambda backend: SpecGenerator(target, tok, drafter, config(method, backend=backend,  # noqa: E731
                                                                     max_new_tokens=24)).generate(prompts)
    eager, static = run("eager"), run("static")
    assert static.token_ids == eager.token_ids and static.taus() == eager.taus()
