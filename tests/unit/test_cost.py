"""The memory bound on decoding passes (d3d.decoding.cost), model-free: shapes written by hand."""

from __future__ import annotations

import pytest

from d3d.decoding import DecodeConfig
from d3d.decoding.cost import GIB, ModelShape, check_fits
from d3d.decoding.methods import method_row
from d3d.errors import ConfigError

# conf/target/tiny_random.yaml's llama (the smoke target) in fp32: 260 tokens, 2 layers of 64
TINY = ModelShape(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=260, tied=True,
                  dtype_bytes=4, eager=False)
SHAPES = {"target": TINY, "drafter": TINY}


def check(memory_gib: float, batch: int = 1, shapes=SHAPES, **decode):
    cfg = DecodeConfig(**{"method": "async", "max_new_tokens": 16, **decode})
    check_fits(cfg, method_row(cfg.method), cfg.method, shapes, batch, int(memory_gib * GIB), "cpu")


def test_the_smoke_case_that_asked_for_17_gb_is_refused_naming_its_settings():
    """decode.block_size=256 decode.C=256: 131072 tray tokens; passed validation and built a 17 GB mask."""
    with pytest.raises(ConfigError) as err:
        check(24, block_size=256, C=256)
    msg = str(err.value)
    assert msg.startswith("decode.block_size=256 decode.C=256 decode.F=2 (method async, batch 1): the drafter's "
                          "widest pass runs 131072 tokens over 131088 keys"), msg
    assert "Fix: lower decode.C or decode.F" in msg and "\n" not in msg


def test_the_shipped_budgets_fit_and_the_bound_moves_with_memory_and_batch():
    check(1, block_size=16, C=12, F=2)  # the paper's 384-token pass: a few MB at this size
    check(1, block_size=16, C=16, F=5)
    # 16 x (11 x 100 + 2) = 17632 tokens: ~1.5 GiB of mask and float bias at batch 1
    check(4, F=100)
    with pytest.raises(ConfigError, match=r"\(method async, batch 4\).*Fix: .* or fewer requests at once"):
        check(4, batch=4, F=100)


def test_eager_attention_counts_the_score_matrix_of_every_head():
    eager = ModelShape(**{**TINY.__dict__, "eager": True})
    check(4, F=100)
    with pytest.raises(ConfigError, match="attention"):
        check(4, shapes={"target": eager, "drafter": eager}, F=100)


@pytest.mark.parametrize("F, ok", [(259, True), (260, False), (1000, False)])
def test_F_is_at_most_the_vocabulary_less_the_drafted_token(F, ok):
    """F above the vocabulary crashed in topk after the models loaded."""
    if ok:
        check(10_000, block_size=2, F=F)
    else:
        with pytest.raises(ConfigError, match=rf"decode.F={F} \(method async\): .* at most 259 .*Fix: set decode.F=2"):
            check(10_000, block_size=2, F=F)


def test_methods_declare_their_widest_pass():
    assert method_row("ar").widest(DecodeConfig(method="ar")) == {"target": 1}
    assert method_row("sync").widest(DecodeConfig(method="sync", block_size=8)) == {"target": 8, "drafter": 16}
    cfg = DecodeConfig(method="async", block_size=16, C=12, F=2)
    budget = method_row("async").budget(cfg)
    assert method_row("async").widest(cfg) == {"target": 16, "drafter": budget} and budget == 384
    # a tree verifies the pending token and every node, whatever the block
    assert method_row("tree").widest(DecodeConfig(method="tree", block_size=4, tree_nodes=31)) == \
        {"target": 32, "drafter": 8}


def test_weights_count_against_the_memory():
    """A 7B-like shape in bf16: its weights alone (~13 GiB) leave a 16 GiB device little room."""
    big = ModelShape(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=151936,
                     tied=False, dtype_bytes=2, eager=False)
    assert 12 * GIB < big.weight_bytes() < 16 * GIB
    check(80, shapes={"target": big, "drafter": big}, block_size=16, C=12, F=2)
    with pytest.raises(ConfigError, match="with the weights"):
        check(16, shapes={"target": big, "drafter": big}, block_size=16, C=12, F=2)


@pytest.mark.parametrize("block, nodes, ok", [(2, 260, True), (2, 261, False), (3, 520, True), (16, 10_000, True)])
def test_a_tree_has_at_most_the_blocks_distinct_nodes(block, nodes, ok):
    """Block 2 has one draft slot, so at most 260 distinct nodes on the smoke vocabulary: more were
    built as copies of a node at score -inf, verified for nothing (issue 38)."""
    for method in ("tree", "async_tree"):
        kw = dict(method=method, block_size=block, tree_nodes=nodes, tree_trays=1)
        if ok:
            check(10_000, **kw)
        else:
            with pytest.raises(ConfigError, match=rf"^decode.tree_nodes={nodes} \(method {method}\): .* at most 260 "
                                                  rf"distinct nodes. Fix: set decode.tree_nodes=260 or fewer"):
                check(10_000, **kw)


def test_a_trees_nodes_are_counted_in_the_draft_vocabulary():
    """A drafter with a draft vocabulary of 4 tokens drafts from those only (the rest have q = 0), so
    block 2 holds at most 4 distinct nodes, not the target's 260 (issue 59)."""
    from dataclasses import replace

    shapes = {"target": TINY, "drafter": replace(TINY, head=4, tied=False)}
    check(10_000, shapes=shapes, method="tree", block_size=2, tree_nodes=4)
    with pytest.raises(ConfigError, match=r"^decode.tree_nodes=5 \(method tree\): .* of a 4-token vocabulary, so a "
                                          r"tree has at most 4 distinct nodes. Fix: set decode.tree_nodes=4 or fewer"):
        check(10_000, shapes=shapes, method="tree", block_size=2, tree_nodes=5)


def test_the_shipped_methods_fit_qwen3_8b_on_an_h200_at_concurrency_16():
    """Sane settings are never refused: Qwen3-8B with the Qwen3-1.7B drafter in bf16, the pipeline's
    max_new_tokens (2048), every shipped decode file at 16 requests at once, on an H200's 139 GiB."""
    from transformers import Qwen3Config

    from d3d.models.random_models import SHAPES

    shapes = {model: ModelShape.of_config(Qwen3Config(**SHAPES[name]), 2, "sdpa")
              for model, name in (("target", "qwen3_8b"), ("drafter", "qwen3_1p7b"))}
    for kw in ({"method": "ar"}, {"method": "sync"}, {"method": "async", "C": 12, "F": 2},
               {"method": "tree", "tree_nodes": 15}, {"method": "async_tree", "tree_nodes": 15, "tree_trays": 23}):
        cfg = DecodeConfig(**{"block_size": 16, "max_new_tokens": 2048, **kw})
        check_fits(cfg, method_row(cfg.method), cfg.method, shapes, 16, 139 * GIB, "cuda")


def qwen3_pair(target: str) -> dict:
    from transformers import Qwen3Config

    from d3d.models.random_models import SHAPES

    return {model: ModelShape.of_config(Qwen3Config(**SHAPES[name]), 2, "sdpa")
            for model, name in (("target", target), ("drafter", "qwen3_1p7b"))}


H100 = 81559 * 2**20  # what torch reports for an 80 GB H100


def test_the_papers_load_test_is_counted_per_device_and_told_which_placement_fits():
    """The paper's load test (Qwen3-1.7B drafter, Qwen3-32B target, 16 requests, async 12x2) needs
    82.3 GiB on one 80 GB H100: refused, naming the placement that fits (the drafter on a GPU of its
    own); with that placement each device holds its own model and the check passes."""
    from d3d.decoding.cost import Placement

    shapes, cfg = qwen3_pair("qwen3_32b"), DecodeConfig(method="async", block_size=16, C=12, F=2, max_new_tokens=2048)
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, method_row("async"), "async", shapes, 16, H100, "cuda:0")
    msg = str(err.value)
    assert "needs about 82.3 GiB" in msg and "of this device (cuda:0)" in msg and "\n" not in msg
    assert msg.endswith("or put the drafter on a GPU of its own (drafter.device=cuda:1: it needs 12.9 GiB, "
                        "the target alone 69.4 GiB)."), msg
    two = Placement({"cuda:0": 1.0}, "cuda:1", {"cuda:0": H100, "cuda:1": H100})
    check_fits(cfg, method_row("async"), "async", shapes, 16, 0, "", placement=two)


def test_a_target_no_device_holds_is_told_how_many_gpus_to_spread_over():
    """Qwen3-32B with its drafter on 40 GB devices: the target alone does not fit one; the refusal
    names the number of GPUs target.device_map=auto needs, and that placement passes."""
    import re

    from d3d.decoding.cost import Placement

    shapes, cfg = qwen3_pair("qwen3_32b"), DecodeConfig(method="sync", block_size=16, max_new_tokens=2048)
    a100 = 40 * 10**9
    with pytest.raises(ConfigError, match=r"or spread the target over \d+ GPUs \(target.device_map=auto") as err:
        check_fits(cfg, method_row("sync"), "sync", shapes, 1, a100, "cuda:0")
    k = int(re.search(r"over (\d+) GPUs", str(err.value)).group(1))
    assert "and put the drafter on a GPU of its own" in str(err.value)
    devices = [f"cuda:{i}" for i in range(k + 1)]
    spread = Placement({d: 1 / k for d in devices[:k]}, devices[k], {d: a100 for d in devices})
    check_fits(cfg, method_row("sync"), "sync", shapes, 1, 0, "", placement=spread)
    with pytest.raises(ConfigError):  # one GPU fewer does not hold it
        fewer = Placement({d: 1 / (k - 1) for d in devices[: k - 1]}, devices[k], {d: a100 for d in devices})
        check_fits(cfg, method_row("sync"), "sync", shapes, 1, 0, "", placement=fewer)
