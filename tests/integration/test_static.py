"""decode.backend=static|compiled: preallocated KV buffers and compiled passes give the eager loop's
tokens (greedy: `generate`'s), on every method (trees included), batched and ragged, and reuse their graphs."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.kv import StaticKVState
from tests.integration.conftest import PROMPTS, reference

CASES = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("sync", 6, 1, 0), ("async", 6, 3, 2), ("async", 4, 4, 1)]


def prompts_for(tok, batch: int) -> list[list[int]]:
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:batch]]
    if batch > 1:
        prompts[1] = prompts[1][:2]  # ragged: rows of different lengths, finishing at different rounds
    return prompts


def generator(models, method, B, C, F, backend, seed=0, n=30, **kw) -> SpecGenerator:
    target, drafter, tok = models
    cfg = DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=n, backend=backend, **kw)
    return SpecGenerator(target, tok, None if method == "ar" else drafter, cfg, seed=seed)


@pytest.mark.parametrize("method,B,C,F", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_static_backend_greedy_equals_generate(models, method, B, C, F, batch):
    """The static state's mask (stale slots hidden, new slots at the cache's length), its crops and
    its row selection, checked against transformers' own greedy decoding."""
    target, _, tok = models
    prompts = prompts_for(tok, batch)
    gen = generator(models, method, B, C, F, "static")
    res = gen.generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), (method, row)
    assert gen.passes.buffer_pool  # static buffers, pooled for the next call
    # The same buffers again, with prompts of one length: the ragged call's short row left slots whose
    # positions lag their index (it was left-padded), stale but marked visible: the mask hides them.
    even = [tok(PROMPTS[2] + PROMPTS[3])["input_ids"]] * batch
    again = gen.generate(even)
    assert again.token_ids == [reference(target, tok, even[0], 30, tok.eos_token_id)] * batch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["sync", "async", "tree", "async_tree"])
def test_static_backend_equals_eager_and_is_device_clean(models, method, temperature):
    """Same rounds and τ as the eager loop (sampled too: same seed, same draws), with the default
    device set to `meta`, so a tensor made without naming the model's device fails (the GPU trap)."""
    _, _, tok = models
    prompts = prompts_for(tok, 3)
    kw = dict(temperature=temperature, seed=3, tree_nodes=6, tree_trays=4)
    eager = generator(models, method, 4, 3, 2, "eager", **kw).generate(prompts)
    torch.set_default_device("meta")
    try:
        static = generator(models, method, 4, 3, 2, "static", **kw).generate(prompts)
    finally:
        torch.set_default_device(None)
    assert static.token_ids == eager.token_ids and static.taus() == eager.taus()


TREES = [("tree", 8, 1), ("async_tree", 8, 5), ("async_tree", 3, 2)]


@pytest.mark.parametrize("method,nodes,trays", TREES)
@pytest.mark.parametrize("batch", [1, 3])
def test_trees_on_the_static_backend_greedy_equal_generate(models, method, nodes, trays, batch):
    """A tree's caches keep the accepted path's slots, not a prefix (KVState.keep_path): in the static
    buffers they are gathered into place at one shape per round. Greedy: generate's tokens (ragged
    rows retiring inside and out of their bucket), and the eager loop's very rounds."""
    target, _, tok = models
    prompts = prompts_for(tok, batch)
    static = generator(models, method, 6, 1, 0, "static", tree_nodes=nodes, tree_trays=trays).generate(prompts)
    eager = generator(models, method, 6, 1, 0, "eager", tree_nodes=nodes, tree_trays=trays).generate(prompts)
    for row, p in enumerate(prompts):
        assert static.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), (method, row)
    assert static.taus() == eager.taus() and max(static.taus()) > 1  # paths were kept: the rounds say something


@pytest.mark.heavy  # inductor compiles the tree's verify, draft and tray passes: ~1-3 min on 2 busy cores
@pytest.mark.parametrize("method", ["tree", "async_tree"])
def test_trees_on_the_compiled_backend_greedy_equal_generate(models, method):
    """decode.backend=compiled: the tree's passes compiled (their masks carry the tree), the path's
    slots moved between compiled passes; generate's tokens on a ragged batch, the eager loop's rounds."""
    target, _, tok = models
    prompts = prompts_for(tok, 2)  # two rows: every batch bucket is graphs to compile (slow)
    res = generator(models, method, 6, 1, 0, "compiled", tree_nodes=8, tree_trays=5).generate(prompts)
    eager = generator(models, method, 6, 1, 0, "eager", tree_nodes=8, tree_trays=5).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), (method, row)
    assert res.taus() == eager.taus()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.heavy  # inductor compiles every batch size: 20 s on 2 idle cores, 70 s on busy ones
def test_compiled_backend_equals_eager_and_reuses_its_graphs(models):
    """torch.compile over the static passes (inductor on CPU; CUDA graphs on a GPU): the eager
    loop's tokens with a ragged batch whose rows retire (new batch sizes), and later calls with
    prompts of other lengths compile nothing (their buffers have the first call's capacity)."""
    _, _, tok = models
    prompts = prompts_for(tok, 2)  # two rows, not three: every batch size is graphs to compile (slow)
    eager = generator(models, "sync", 4, 1, 0, "eager").generate(prompts)
    gen = generator(models, "sync", 4, 1, 0, "compiled")
    first = gen.generate(prompts)
    assert first.token_ids == eager.token_ids and first.taus() == eager.taus()
    eager_gen = generator(models, "sync", 4, 1, 0, "eager")
    for i, text in enumerate(PROMPTS[1:]):  # batch 1, prompts of other lengths, within the same capacity
        ids = [tok(text)["input_ids"]]
        before = graphs_compiled()
        assert gen.generate(ids).token_ids == eager_gen.generate(ids).token_ids
        if i:  # the first batch-1 call may compile its shapes; later ones find them
            assert graphs_compiled() == before, "a call of shapes already compiled compiled again"


@pytest.mark.heavy  # inductor with the weights frozen in, for two models: 12 s on 2 idle cores, 50 s on busy ones
def test_frozen_backend_keeps_each_models_own_weights(models):
    """backend=frozen folds the weights into the graph. The target and its drafter (a perturbed copy)
    have the same shapes, so a graph reused across them would draft with the target's weights:
    greedy tokens would still be right (lossless), but τ would not be the eager loop's."""
    _, _, tok = models
    prompts = prompts_for(tok, 3)
    eager = generator(models, "sync", 4, 1, 0, "eager").generate(prompts)
    frozen = generator(models, "sync", 4, 1, 0, "frozen").generate(prompts)
    assert frozen.token_ids == eager.token_ids and frozen.taus() == eager.taus()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["compiled", "frozen"])
@pytest.mark.parametrize("method,B,C,F", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_backend_greedy_equals_generate(models, method, B, C, F, batch, backend):
    target, _, tok = models
    prompts = prompts_for(tok, batch)
    res = generator(models, method, B, C, F, backend).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), (method, row)


def capacities(gen, model) -> list[int]:
    """The capacities of the static buffers pooled for `model` (Passes.buffer_pool)."""
    return sorted(cap for (m, _, cap) in gen.passes.buffer_pool if m == id(model))


def test_static_capacity_is_a_power_of_two_that_fits_the_call(models):
    """Buffers are sized per call (longest prompt + max_new_tokens + block + the widest pass),
    rounded up to a power of two so calls of similar lengths share compiled shapes; a longer call
    gets bigger buffers instead of overflowing."""
    target, _, tok = models
    gen = generator(models, "sync", 4, 1, 0, "static", n=8)
    gen.generate([tok(PROMPTS[0])["input_ids"]])
    assert capacities(gen, target) == [256]
    long_prompt = tok(PROMPTS[0])["input_ids"] * 40
    res = gen.generate([long_prompt], max_new_tokens=8)
    big = capacities(gen, target)[-1]
    assert big >= len(long_prompt) + 8 + 4 + 8 and big & (big - 1) == 0
    assert len(res.token_ids[0]) == 8


def test_sliding_window_models_are_refused_by_static_backends():
    """A sliding-window layer's static cache keeps a window of slots, not our slots: refused, named."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from d3d.errors import ConfigError

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="decode.backend=static: Qwen3ForCausalLM has sliding-window layers"):
        StaticKVState(model, 1, 256, compiled=False)
    cfg.use_sliding_window = False
    cfg.layer_types = ["full_attention"] * 2
    StaticKVState(AutoModelForCausalLM.from_config(cfg), 1, 256, compiled=False)  # the same model without: fine


def test_a_row_retiring_inside_its_bucket_keeps_the_buffers(models):
    """Batch buckets: 3 rows live in 4-row buffers (a power of two); 4 rows losing one keep their
    buffers (same shape, same addresses: what CUDA graphs read) with the kept rows moved to the
    front; 2 rows leave the bucket for 2-row buffers."""
    from d3d.models.masks import CLEAN, Layout

    target, _, _ = models
    assert StaticKVState(target, 3, 256, compiled=False).rows == 4
    state = StaticKVState(target, 4, 256, compiled=False)
    ids = torch.arange(4 * 5).reshape(4, 5) % 50 + 1
    pos = torch.arange(5).expand(4, 5)
    state.forward(ids, Layout(pos, torch.full_like(pos, CLEAN), pos + 1), causal=True)
    keys = state.cache.layers[0].keys
    before, address = keys[[0, 2, 3]].clone(), keys.data_ptr()
    state.select(torch.tensor([0, 2, 3]))
    assert (state.rows, state.batch, tuple(state.pos.shape)) == (4, 3, (3, 5))
    assert state.cache.layers[0].keys.data_ptr() == address and torch.equal(state.cache.layers[0].keys[:3], before)
    state.select(torch.tensor([0, 2]))
    assert (state.rows, state.batch) == (2, 2) and torch.equal(state.cache.layers[0].keys[:2], before[[0, 2]])


def test_compiled_calls_of_one_bucket_share_their_graphs(models):
    """A call of 3 requests after one of 4 compiles no graph: both run 4-row passes. Counted with
    the GPU check's counting torch.compile backend (it compiles nothing, so this is fast)."""
    from tests.conftest import load_script

    count_graphs = load_script("gpu_check").count_graphs
    _, _, tok = models
    ids = tok(PROMPTS[0])["input_ids"]
    gen = generator(models, "sync", 4, 1, 0, "compiled", n=8)
    eager = generator(models, "sync", 4, 1, 0, "eager", n=8).generate([ids] * 3)
    four = count_graphs(lambda: gen.generate([ids] * 4))
    out = []
    both = count_graphs(lambda: out.append((gen.generate([ids] * 4), gen.generate([ids] * 3))))
    assert sum(four.values()) > 0 and both == four
    assert out[0][1].token_ids == eager.token_ids and out[0][1].taus() == eager.taus()
