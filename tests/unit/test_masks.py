"""The one mask builder against a brute-force reference written with plain loops."""

from __future__ import annotations

import random

import pytest
import torch

from d3d.models.masks import CLEAN, PAD, block_layout, build_mask, clean_layout, concat, pad_layout


def brute_force(tokens: list[dict], cache_len: int, causal: bool = False) -> list[list[bool]]:
    """tokens: dicts with kind ('clean'|'block'|'pad'), pos, block, anchor. Keys = cache + tokens.
    `causal`: drafter.block_attention=causal, a block token sees its block only up to its own position."""
    keys = [{"kind": "clean", "pos": p, "block": None} for p in range(cache_len)] + tokens
    rows = []
    for qi, q in enumerate(tokens):
        row = []
        for ki, k in enumerate(keys):
            if q["kind"] == "pad":
                ok = ki == cache_len + qi
            elif k["kind"] == "pad":
                ok = False
            elif q["kind"] == "clean":
                ok = k["kind"] == "clean" and k["pos"] <= q["pos"]
            else:  # block query
                ok = (k["kind"] == "clean" and k["pos"] < q["anchor"]) or (
                    k["kind"] == "block" and k["block"] == q["block"] and (not causal or k["pos"] <= q["pos"]))
            row.append(ok)
        rows.append(row)
    return rows


def describe(layout) -> list[dict]:
    out = []
    for pos, block, limit in zip(layout.pos[0].tolist(), layout.block[0].tolist(), layout.limit[0].tolist()):
        kind = "clean" if block == CLEAN else "pad" if block == PAD else "block"
        out.append({"kind": kind, "pos": pos, "block": block, "anchor": limit})
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_training_layout_matches_brute_force(causal):
    rng = random.Random(0)
    for _ in range(20):
        L, B = rng.randint(2, 12), rng.randint(1, 5)
        anchors = sorted(rng.sample(range(L), rng.randint(0, min(L, 4))))
        layout = concat(clean_layout(L), block_layout(torch.tensor([anchors], dtype=torch.long), B))
        layout = pad_layout(layout, layout.shape[1] + rng.randint(0, 3))
        got = build_mask(layout, causal_blocks=causal)[0, 0].tolist()
        assert got == brute_force(describe(layout), 0, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_cached_layouts_match_brute_force(causal):
    """Inference: committed tokens (causal) + blocks / async trays over a KV cache."""
    rng = random.Random(1)
    for _ in range(20):
        cache, commit, B = rng.randint(0, 8), rng.randint(0, 5), rng.randint(1, 4)
        anchors = [cache + rng.randint(0, commit) for _ in range(rng.randint(1, 4))]
        layout = concat(clean_layout(commit, start=cache), block_layout(torch.tensor([anchors]), B))
        got = build_mask(layout, cache_len=cache, causal_blocks=causal)[0, 0].tolist()
        assert got == brute_force(describe(layout), cache, causal)


def test_a_causal_block_is_the_causal_mask_of_prefix_and_block():
    """What an engine's parallel-draft pass computes: a causal block after its prefix sees exactly
    what plain causal attention over [prefix, anchor, MASK ...] sees, and the bidirectional one more."""
    cache, B = 5, 4
    block = block_layout(torch.tensor([[cache]]), B)
    plain = build_mask(clean_layout(B, start=cache), cache_len=cache, causal_blocks=False)
    assert torch.equal(build_mask(block, cache_len=cache, causal_blocks=True), plain)
    assert not torch.equal(build_mask(block, cache_len=cache, causal_blocks=False), plain)


def test_hand_checked_case():
    # clean x0 x1 x2, one block of 2 anchored at position 2: [x2, M] sees x0, x1 and itself.
    layout = concat(clean_layout(3), block_layout(torch.tensor([[2]]), 2))
    m = build_mask(layout, causal_blocks=False)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 1],
        [1, 1, 0, 1, 1],
    ]
    assert layout.pos[0].tolist() == [0, 1, 2, 2, 3]


def test_left_padded_cache_is_hidden():
    layout = clean_layout(2, start=3)
    valid = torch.tensor([[False, True, True]])
    m = build_mask(layout, cache_len=3, cache_valid=valid, causal_blocks=False)[0, 0].int().tolist()
    assert m == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]


def tree_brute_force(parents: list[int], root_pos: int, cache_pos: list[int], cache_valid: list[bool]):
    """A tree of clean tokens after a cache, with loops: node i sees a valid cached key at a position
    <= its own (root + depth) and, of the tree, the nodes met walking up its parent pointers."""
    def path(i):
        seen = [i]
        while parents[seen[-1]] >= 0:
            seen.append(parents[seen[-1]])
        return seen

    rows, positions = [], []
    for i in range(len(parents)):
        pos = root_pos + len(path(i)) - 1
        positions.append(pos)
        rows.append([ok and p <= pos for p, ok in zip(cache_pos, cache_valid)] + [j in path(i) for j in range(len(parents))])
    return rows, positions


def test_tree_mask_matches_brute_force_on_random_trees():
    """Each node sees the committed prefix, the pending token (the root) and its ancestors only, at
    position root + depth; several rows of a batch carry different trees and caches."""
    from d3d.models.masks import tree_ancestors, tree_layout

    rng = random.Random(2)
    for _ in range(30):
        b, t, cache = rng.randint(1, 3), rng.randint(1, 17), rng.randint(0, 6)
        parents = [[-1] + [rng.randrange(i) for i in range(1, t)] for _ in range(b)]
        valid = [[rng.random() < 0.8 for _ in range(cache)] for _ in range(b)]
        cpos = [sorted(rng.sample(range(cache + 3), cache)) for _ in range(b)]
        root = [max(p, default=-1) + 1 + rng.randint(0, 2) for p in cpos]
        anc = tree_ancestors(torch.tensor(parents))
        layout = tree_layout(torch.tensor(root), anc)
        got = build_mask(layout, cache_valid=torch.tensor(valid, dtype=torch.bool).reshape(b, cache),
                         cache_pos=torch.tensor(cpos, dtype=torch.long).reshape(b, cache), tree=anc,
                         causal_blocks=False)
        for r in range(b):
            want, positions = tree_brute_force(parents[r], root[r], cpos[r], valid[r])
            assert got[r, 0].tolist() == want, (parents[r], r)
            assert layout.pos[r].tolist() == positions


def test_a_tree_that_is_a_chain_has_the_causal_mask():
    from d3d.models.masks import tree_ancestors, tree_layout

    anc = tree_ancestors(torch.tensor([[-1, 0, 1, 2, 3]]))
    layout = tree_layout(torch.tensor([4]), anc)
    assert torch.equal(build_mask(layout, cache_len=4, tree=anc, causal_blocks=False),
                       build_mask(clean_layout(5, start=4), cache_len=4, causal_blocks=False))
