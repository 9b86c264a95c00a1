"""Contract 2 on a toy vocabulary, no model: one verification step is lossless, and the sync-free
sampler draws from p. The same property through the decoding loop is in
tests/integration/test_decoding.py."""

from __future__ import annotations

import torch

from d3d.decoding.verify import Sampling, probs, sample_verify


def test_contract2_one_verification_step_is_lossless():
    """Toy vocabulary of 6: the first token out of a verification step follows p exactly."""
    torch.manual_seed(0)
    V, B, n = 6, 3, 60000
    p_logits = torch.randn(1, B, V).expand(n, B, V).clone() * 1.5
    q_logits = torch.randn(1, B - 1, V).expand(n, B - 1, V).clone() * 1.5
    s = Sampling(temperature=1.0)
    q = probs(q_logits, s)
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, B - 1)
    accepted, token = sample_verify(p_logits, drafts, q, s, g)
    first = torch.where(accepted > 0, drafts[:, 0], token)
    emp = torch.bincount(first, minlength=V).float() / n
    exact = probs(p_logits[0, 0], s)
    tv = 0.5 * (emp - exact).abs().sum().item()
    # TV of n=60000 samples from the right law is ~0.005; a wrong residual (e.g. sampling the
    # correction from p instead of norm(max(0, p - q))) shifts it by > 0.05 here.
    assert tv < 0.015, tv
    wrong = torch.where(accepted > 0, drafts[:, 0], torch.multinomial(exact.expand(n, V), 1, generator=g)[:, 0])
    assert 0.5 * ((torch.bincount(wrong, minlength=V).float() / n) - exact).abs().sum().item() > 0.03


def test_sample_draws_from_p():
    """The sync-free sampler (exponential race) against the exact law on a toy vocabulary."""
    from d3d.decoding.verify import sample

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sample(p.expand(60000, 5).clone(), g)
    emp = torch.bincount(draws, minlength=5).float() / 60000
    assert emp[4] == 0 and 0.5 * (emp - p).abs().sum() < 0.01  # noise ~0.004 at n = 60000


# ---------------------------------------------------------------- trees

def toy_tree_case(n, V=5, S=2, nodes=7, seed=0):
    """A tree built from a toy drafter's q, and a toy target whose law after a path is a table:
    p0 at the root, p1[x] after x, p2[x, y] after (x, y). Returns the verify inputs for n copies
    of one tree, and the tables."""
    from d3d.decoding.tree import build_tree
    from d3d.models.masks import tree_ancestors

    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(1, S, V, generator=g) * 1.5, -1)
    tree = build_tree(q, nodes)
    logits = [torch.randn(V, generator=g) * 1.2, torch.randn(V, V, generator=g) * 1.2,
              torch.randn(V, V, V, generator=g) * 1.2]
    node_tok = torch.cat([torch.zeros(1, 1, dtype=torch.long), tree.tokens], 1)
    paths = [()]
    for i in range(1, nodes + 1):
        paths.append(paths[tree.parents[0, i]] + (int(node_tok[0, i]),))
    p_logits = torch.stack([logits[len(path)][path] if path else logits[0] for path in paths])
    anc = tree_ancestors(tree.parents)
    return (p_logits[None].expand(n, -1, -1).clone(), node_tok.expand(n, -1).clone(), anc.expand(n, -1, -1).clone(),
            logits, S)


def tree_output_pairs(accepted, token, path_tok, next_law, g):
    """The first two tokens a sequence gets: the accepted path, then the token; a round that accepts
    nothing gets its second token from the next round, whose first token follows the target's law
    after the first (checked by the first-token law), so it is drawn here from that law."""
    first = torch.where(accepted > 0, path_tok[:, 0], token)
    second_next = torch.multinomial(next_law[first], 1, generator=g)[:, 0]
    second = torch.where(accepted > 1, path_tok[:, 1], torch.where(accepted == 1, token, second_next))
    return first, second


def test_contract2_tree_acceptance_is_lossless_on_a_toy_vocabulary():
    """Multi-candidate rejection over a best-first (deterministic) tree: the first token and the
    pair of the first two follow the target's law. n = 60000: TV of the right law's samples is ~0.005
    (first token) and ~0.01 (the 25 pairs); the wrong rules below move them by more than 0.03."""
    from d3d.decoding.verify import tree_path, tree_sample_verify

    n, V = 60000, 5
    p_logits, node_tok, anc, logits, S = toy_tree_case(n, V)
    s = Sampling(temperature=1.0)
    g = torch.Generator().manual_seed(3)
    accepted, token, best = tree_sample_verify(p_logits, node_tok, anc, s, g)
    _, path_tok = tree_path(anc, best, node_tok, S)
    p0, p1 = probs(logits[0], s), probs(logits[1], s)
    first, second = tree_output_pairs(accepted, token, path_tok, p1, g)
    tv = lambda x, law, k: 0.5 * ((torch.bincount(x, minlength=k).float() / len(x)) - law.reshape(-1)).abs().sum().item()
    exact_pair = p0[:, None] * p1  # P(x, y) = p0(x) p1(y | x)
    assert tv(first, p0, V) < 0.015, tv(first, p0, V)
    assert tv(first * V + second, exact_pair, V * V) < 0.025, tv(first * V + second, exact_pair, V * V)
    assert (accepted >= 1).float().mean() > 0.3 and (accepted == 2).any()  # the tree did its work
    # a wrong correction (drawn from p, not the residual) is detected
    wrong = torch.where(accepted > 0, path_tok[:, 0], torch.multinomial(p0.expand(n, V), 1, generator=g)[:, 0])
    assert tv(wrong, p0, V) > 0.03


def test_greedy_tree_acceptance_on_a_chain_equals_greedy_verify():
    from d3d.decoding.verify import greedy_verify, tree_greedy_verify, tree_path
    from d3d.models.masks import tree_ancestors

    g = torch.Generator().manual_seed(5)
    b, B, V = 64, 6, 4
    p_logits = torch.randn(b, B, V, generator=g)
    drafts = torch.where(torch.rand(b, B - 1, generator=g) < 0.7, p_logits[:, :-1].argmax(-1),
                         torch.randint(0, V, (b, B - 1), generator=g))
    anc = tree_ancestors(torch.arange(-1, B - 1).expand(b, B))
    node_tok = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafts], 1)
    a, tok, best = tree_greedy_verify(p_logits, node_tok, anc)
    a_ref, tok_ref = greedy_verify(p_logits, drafts)
    assert torch.equal(a, a_ref) and torch.equal(tok, tok_ref) and len(set(a.tolist())) > 2
    nodes, path = tree_path(anc, best, node_tok, B - 1)
    for r in range(b):
        assert path[r, : a[r]].tolist() == drafts[r, : a[r]].tolist() and nodes[r, : a[r]].tolist() == list(range(1, a[r] + 1))


def test_greedy_tree_acceptance_takes_a_second_choice():
    """A tree with two children of the root: the target's argmax is the second; that path is taken."""
    from d3d.decoding.verify import tree_greedy_verify, tree_path
    from d3d.models.masks import tree_ancestors

    anc = tree_ancestors(torch.tensor([[-1, 0, 1, 0, 3]]))  # root -> 1 -> 2 ; root -> 3 -> 4
    node_tok = torch.tensor([[9, 1, 2, 3, 4]])
    p_logits = torch.full((1, 5, 10), -5.0)
    for node, want in ((0, 3), (3, 4), (4, 7), (1, 2), (2, 8)):
        p_logits[0, node, want] = 5.0
    a, tok, best = tree_greedy_verify(p_logits, node_tok, anc)
    assert (a.item(), tok.item(), best.item()) == (2, 7, 4)
    assert tree_path(anc, best, node_tok, 2)[1].tolist() == [[3, 4]]


def test_probs_keeps_the_hand_computed_top_k_and_top_p_sets():
    """The sampling-law tests take `probs` as their reference, so `probs` itself is checked here
    against sets worked out by hand: token ids 0..3 hold p = 0.15, 0.5, 0.05, 0.3 (not in order, so
    the cut is scattered back to the right ids). top-p keeps the smallest prefix, by falling p, whose
    mass reaches top_p, the token that crosses it included; top-k keeps the k largest; both renormalise."""
    p = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = p.log()
    cases = [
        (Sampling(1.0), [0.15, 0.5, 0.05, 0.3]),
        (Sampling(1.0, top_p=0.3), [0.0, 1.0, 0.0, 0.0]),  # 0.5 alone reaches 0.3
        (Sampling(1.0, top_p=0.7), [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # 0.5 < 0.7: 0.3 crosses it and is kept
        (Sampling(1.0, top_p=0.9), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),  # 0.8 < 0.9: 0.15 crosses
        (Sampling(1.0, top_k=2), [0, 0.5 / 0.8, 0, 0.3 / 0.8]),
        (Sampling(1.0, top_k=3, top_p=0.6), [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # top-k first: 0.5/0.95 < 0.6, 0.3 crosses
        (Sampling(2.0), (p.sqrt() / p.sqrt().sum()).tolist()),  # T = 2: p ∝ p^(1/2)
    ]
    for s, want in cases:
        torch.testing.assert_close(probs(logits, s), torch.tensor(want), msg=str(s))
        torch.testing.assert_close(probs(logits[None, None], s)[0, 0], torch.tensor(want))  # batched alike
