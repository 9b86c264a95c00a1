"""A tree of drafts from one drafter pass (decode.method=tree, docs/design.md, One seam for methods).

A D3D drafter gives, in one pass, a distribution q_k for every slot k of the block. The chain
verifies only the argmax of each slot; a tree spends the same verify pass on several candidates
per slot. The tree is rooted at the pending token (node 0); a node at depth k carries a token for
slot k-1 of the block. The score of a node is the product of q over its path: under the drafter's
own law, the probability that verification accepts it, so the sum of the scores of the draft nodes
is the expected number of accepted drafts. Best-first expansion (DDTree's, for DFlash's blocks)
takes the highest-scoring node whose parent is already in, until the node budget is spent.

The approximation DDTree makes too: q_k is conditioned on the block [anchor, MASK x (B-1)], not on
the path sampled before slot k, so a child's candidates and their probabilities are slot k's
whatever its parent's token is (the drafter has no other distribution to offer from one pass).

The chain (top-1 at every slot) is in the tree down to the tree's depth: its node at depth d has
the highest score of all depth-d nodes (a product of per-slot maxima), and ties go to it, so no
depth-d node enters before it. So greedy, a tree accepts at least what the chain of its depth would
on the same pass. The whole (B-1)-deep chain is not forced in: at a verify width of B it would
leave no node for anything else (the tree would be the chain); best-first trades the chain's
unlikely deep slots for likely alternatives near the root, which is what a tree is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    """A batch of trees of the same size. Index 0 is the root (the pending token); node i >= 1 has
    token tokens[:, i-1]. Every parent comes before its children (parents[:, i] < i).

    A node left out (`build_tree`: no candidate of non-zero probability was left for it) keeps its
    index, so every row has N nodes and every pass one shape, but is in no tree: parent -1, depth 0,
    score -inf. Verification never accepts it (it is no root's child, and the root, index 0, wins
    the ties at depth 0) and no tray is keyed by it (its score gives its outcomes zero weight)."""

    tokens: torch.Tensor  # (b, N) the draft nodes' tokens (a node left out: slot 0's first token, never verified)
    parents: torch.Tensor  # (b, N+1) parent index per node, -1 for the root and a node left out
    depth: torch.Tensor  # (b, N+1) 0 for the root; node i verifies slot depth-1 of the block
    score: torch.Tensor  # (b, N+1) log of the product of q along the path (0 for the root, -inf: left out)

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]


def build_tree(q: torch.Tensor, nodes: int) -> Tree:
    """The `nodes` draft nodes of highest path probability, the chain winning ties (module docstring).

    q (b, S, V): the drafter's distribution at each of the S = B-1 draft slots. Deterministic: ties
    go to the candidate found first. Batched on q's device, one small step per node, no host sync.

    Candidates: a node n at depth d with rank r (the r-th likeliest token of slot d-1) offers two:
    its first child (depth d+1, rank 0) and its next sibling (depth d, rank r+1, same parent).
    Every node of the best set is reachable that way (a node's better-ranked siblings and its
    parent have higher scores), so popping the best candidate `nodes` times is the greedy optimum
    for a score that shrinks along every path and along every sibling list.

    A token of zero probability at its slot (outside a draft vocabulary, or cut by top-k / top-p)
    is never a candidate: once only such are left, the remaining nodes are left out (Tree), so a
    tree never drafts what the drafter gives no mass."""
    b, S, V = q.shape
    dev = q.device
    k = min(nodes, V)
    top_p, top_tok = top_k_stable(q, k)  # (b, S, k): the rank-r candidate of each slot
    logp = top_p.log()  # -inf at zero probability: a score no pick takes (the loop below checks)
    n_cand = 2 * nodes + 1
    rows = torch.arange(b, device=dev)
    # the candidate pool: score, depth (of the node it would be), rank, parent index, chain flag
    c_score = torch.full((b, n_cand), float("-inf"), device=dev)
    c_depth = torch.zeros(b, n_cand, dtype=torch.long, device=dev)
    c_rank = torch.zeros(b, n_cand, dtype=torch.long, device=dev)
    c_parent = torch.zeros(b, n_cand, dtype=torch.long, device=dev)
    c_chain = torch.zeros(b, n_cand, dtype=torch.bool, device=dev)
    # the root's first child: slot 0's top-1, on the chain
    c_score[:, 0], c_depth[:, 0], c_chain[:, 0] = logp[:, 0, 0], 1, True
    tokens = torch.zeros(b, nodes, dtype=torch.long, device=dev)
    parents = torch.full((b, nodes + 1), -1, dtype=torch.long, device=dev)
    depth = torch.zeros(b, nodes + 1, dtype=torch.long, device=dev)
    score = torch.zeros(b, nodes + 1, device=dev)
    used = 1
    for i in range(1, nodes + 1):
        # the best-scoring candidate; of equal ones the chain's, else the first found
        top = c_score.max(dim=1, keepdim=True).values
        live = top[:, 0] > float("-inf")  # a candidate of non-zero probability is left: else node i is left out
        best = c_score == top
        chain_best = best & c_chain
        pick = torch.where(chain_best.any(dim=1), chain_best.long().argmax(dim=1), best.long().argmax(dim=1))
        d, r, par, sc, on_chain = (t[rows, pick] for t in (c_depth, c_rank, c_parent, c_score, c_chain))
        tokens[:, i - 1] = torch.where(live, top_tok[rows, (d - 1).clamp(min=0), r], top_tok[:, 0, 0])
        parents[:, i] = torch.where(live, par, -1)
        depth[:, i], score[:, i] = torch.where(live, d, 0), sc
        c_score[rows, pick], c_chain[rows, pick] = float("-inf"), False
        if used + 2 > n_cand:  # the last node: its offers could never be taken
            continue
        # its first child (if the block has a slot for it) and its next sibling (if ranked)
        child_ok = live & (d < S)
        child_score = sc + logp[rows, d.clamp(max=S - 1), 0]
        c_score[:, used] = torch.where(child_ok, child_score, float("-inf"))
        c_depth[:, used], c_rank[:, used], c_parent[:, used] = d + 1, 0, i
        c_chain[:, used] = on_chain & child_ok
        sib_ok = live & (r + 1 < k)  # (a left-out row's -inf score minus -inf would be NaN)
        sib_score = sc - logp[rows, d - 1, r] + logp[rows, d - 1, (r + 1).clamp(max=k - 1)]
        c_score[:, used + 1] = torch.where(sib_ok, sib_score, float("-inf"))
        c_depth[:, used + 1], c_rank[:, used + 1], c_parent[:, used + 1] = d, r + 1, par
        used += 2
    return Tree(tokens, parents, depth, score)


def top_k_stable(q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of a stable descending sort of q's last dim (values, indices): ties in index
    order, as argmax breaks them, so the tree's rank-0 candidate is the chain's token. A full sort of
    a 152k-token vocabulary costs ~80 ms a round on 2 CPU cores (more than the tree saves); topk is
    cheap but breaks ties in no stated order, so it is asked for a key with no ties among the
    candidates that matter. With t the k-th largest value, every value above t is in (fewer than k
    of them), and of the values equal to t the lowest indices fill the rest: key = V above t,
    -index at t, -inf below. Then the k chosen are put in order by a stable sort of k entries."""
    V = q.shape[-1]
    t = q.topk(k, dim=-1).values[..., -1:]  # the k-th largest value: exact whatever the tie order
    index = torch.arange(V, device=q.device, dtype=torch.float32)  # exact up to 2^24 tokens
    key = torch.where(q > t, float(V), torch.where(q == t, -index, float("-inf")))
    chosen = key.topk(k, dim=-1).indices.sort(dim=-1).values  # the set, in index order
    vals = q.gather(-1, chosen)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), chosen.gather(-1, order)


def expected_accepted(tree: Tree) -> torch.Tensor:
    """Drafts accepted in expectation under the drafter's own law (b,): the sum of the node scores."""
    return tree.score[:, 1:].exp().sum(dim=1)
