"""The tree of drafts built from one drafter pass (d3d.decoding.tree), model-free."""

from __future__ import annotations

import itertools

import pytest
import torch

from d3d.decoding.tree import build_tree, expected_accepted


def random_q(b, S, V, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, S, V, generator=g) * 2, dim=-1)


def paths(tree, row):
    """Each node's path of tokens from the root (a tuple), by walking the parent pointers."""
    out = [()]
    for i in range(1, tree.nodes + 1):
        out.append(out[tree.parents[row, i]] + (int(tree.tokens[row, i - 1]),))
    return out


def test_budget_parents_first_chain_contained_distinct_siblings():
    for seed, (b, S, V, n) in enumerate([(3, 5, 7, 15), (2, 3, 4, 9), (1, 15, 50, 31), (2, 6, 9, 3)]):
        q = random_q(b, S, V, seed)
        tree = build_tree(q, n)
        assert tree.tokens.shape == (b, n) and tree.parents.shape == (b, n + 1)
        for r in range(b):
            par = tree.parents[r].tolist()
            assert par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i)  # parents before children
            ps = paths(tree, r)
            assert len(set(ps)) == n + 1  # no node twice: siblings carry distinct tokens
            assert [len(p) for p in ps] == tree.depth[r].tolist() and max(map(len, ps)) <= S
            chain = tuple(q[r].argmax(-1).tolist())
            deepest = int(tree.depth[r].max())
            assert all(chain[:d] in ps for d in range(1, deepest + 1)), "the chain (top-1 per slot) to the tree's depth"


def test_the_tree_maximises_the_expected_accepted_length():
    """Against enumeration: the nodes of highest path probability (the best ancestor-closed set,
    since a path's probability only falls as it grows)."""
    for seed in range(6):
        S, V, n = 3, 4, 10
        q = random_q(1, S, V, 10 + seed)[0]
        prob = lambda path: float(torch.prod(torch.stack([q[k, t] for k, t in enumerate(path)])))
        every = [p for d in range(1, S + 1) for p in itertools.product(range(V), repeat=d)]
        top = sorted(every, key=prob, reverse=True)[:n]
        best = sum(map(prob, top))
        tree = build_tree(q[None], n)
        assert set(paths(tree, 0)[1:]) == set(top)
        assert abs(float(expected_accepted(tree)[0]) - best) < 1e-5


def test_deterministic_and_ties_to_the_first_found():
    q = torch.full((2, 4, 5), 0.2)  # every candidate of a depth ties
    a, b = build_tree(q, 12), build_tree(q.clone(), 12)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    ps = paths(a, 0)
    # the chain is token 0 (the first of the ties) at every slot, and ties go to it at every depth
    assert ps[1] == (0,) and all((0,) * d in ps for d in range(1, int(a.depth.max()) + 1))
    assert a.depth.max() == 2  # 5 depth-1 nodes (0.2 each), then 7 of depth 2 (0.04)


def test_top_k_is_a_stable_sort_prefix_under_ties():
    """top_k_stable against the full stable sort it replaces, on laws with many exact ties (values
    drawn from a few levels) across the k-th place: values and indices equal, seeds swept."""
    from d3d.decoding.tree import top_k_stable

    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        levels = torch.rand(4, generator=g)
        q = levels[torch.randint(0, 4, (2, 3, 97), generator=g)]
        for k in (1, 5, 15, 40, 97):
            ref_p, ref_t = (t[..., :k] for t in torch.sort(q, dim=-1, descending=True, stable=True))
            p, t = top_k_stable(q, k)
            assert torch.equal(p, ref_p) and torch.equal(t, ref_t), (seed, k)


def test_a_token_of_zero_probability_is_left_out_not_drafted():
    """Row 0 gives two tokens mass at slot 0 and one at slot 1 (a draft vocabulary's or top-k's zeros
    elsewhere): it has 4 nodes to draft, so of 6 the last 2 are left out (parent -1, depth 0, score
    -inf), where they used to be drafted at a clamped score of about -87. Row 1, with mass everywhere,
    fills all 6 beside it."""
    q = torch.zeros(2, 2, 8)
    q[0, 0, 3], q[0, 0, 5], q[0, 1, 2] = 0.6, 0.4, 1.0
    q[1] = random_q(1, 2, 8, 0)[0]
    tree = build_tree(q, 6)
    live = tree.parents[:, 1:] >= 0
    assert live.sum(1).tolist() == [4, 6]
    slot = (tree.depth[:, 1:] - 1).clamp(min=0)
    drafted_q = q[torch.arange(2)[:, None], slot, tree.tokens]  # each node's q at its slot
    assert (drafted_q[live] > 0).all()  # every node drafted has mass
    assert sorted(paths(tree, 0)[1:5]) == [(3,), (3, 2), (5,), (5, 2)]
    assert tree.depth[0, 5:].tolist() == [0, 0] and torch.isinf(tree.score[0, 5:]).all()
    assert expected_accepted(tree)[0].item() == pytest.approx(0.6 + 0.6 + 0.4 + 0.4)

