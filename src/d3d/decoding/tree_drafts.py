"""A tree of drafts as a Drafts kind (decode.method=tree, async_tree; docs/design.md, Trees of drafts).

`tree_nodes` drafts from the drafter's block logits (d3d.decoding.tree: best-first by path
probability, the chain inside), verified in one target pass of tree_nodes + 1 tokens, each node
seeing the prefix, the pending token and its ancestors at position pending + depth. Acceptance
takes the longest matching path (greedy) or multi-candidate rejection sampling (T > 0; the
candidates are deterministic, so q only shapes the tree), and the caches keep the accepted path's
slots (KVState.keep_path, on every backend). An outcome is (the node n the accepted path ends at,
the token t after it); t is never a child of n (a child's token would have extended the path), so those pairs get
no tray. Trays go to the `tree_trays` outcomes likeliest under the drafter's own law,
P(reach n) * q_{depth(n)}(t), the law the tree was built by (a leaf's outcome is its bonus). Tray
(n, t) sits at position pending + depth(n) + 1 and sees the prefix, n's path and itself.
"""

from __future__ import annotations

import torch

from d3d.decoding.drafts import Draft, Drafts, Outcomes
from d3d.decoding.tree import build_tree
from d3d.decoding.verify import Sampling, probs, tree_greedy_verify, tree_path, tree_sample_verify
from d3d.errors import ConfigError
from d3d.models.masks import tree_ancestors, tree_layout


class TreeDrafts(Drafts):
    keys = ("block_size", "tree_nodes")
    tray_keys = ("tree_trays",)
    tray_grid = tuple({"tree_trays": t} for t in (1, 2, 4, 8, 16, 23, 32, 64))

    @classmethod
    def width(cls, cfg):
        return cfg.tree_nodes + 1  # the pending token and every node

    @classmethod
    def budget(cls, cfg):
        """The glue (the verified tokens) + B per tray."""
        return cls.width(cfg) + cfg.tree_trays * cfg.block_size

    @classmethod
    def narrower(cls, cfg, where, trays):
        if not trays:
            return f"lower {where}.tree_nodes (the verify pass is tree_nodes + 1 tokens) or {where}.block_size"
        return (f"lower {where}.tree_trays or {where}.tree_nodes (the tray pass is tree_nodes + 1 + "
                f"B * tree_trays tokens), or set {where}.block_size to the drafter's training block size")

    @classmethod
    def check_vocab(cls, cfg, vocab, name, where, trays):
        slots, most = cls.block_size(cfg) - 1, 0  # distinct nodes: v per slot along every path, v + v^2 + ...
        for depth in range(1, slots + 1):
            most += vocab ** depth
            if most >= cfg.tree_nodes:
                break
        if cfg.tree_nodes > most:  # build_tree would leave the rest out: verify slots spent on nothing
            raise ConfigError(f"{where}.tree_nodes={cfg.tree_nodes} (method {name}): a block of {slots + 1} has {slots} "
                              f"draft slot(s) of a {vocab}-token vocabulary, so a tree has at most {most} distinct nodes. "
                              f"Fix: set {where}.tree_nodes={most} or fewer, or a larger {where}.block_size.")

    def make(self, pending, logits):
        s = self.cfg.sampling
        # the drafter's law at every block slot: greedy scores the tree by its plain softmax,
        # sampling by the q it would sample from; the draft slots shape the tree, and the trays
        # read all B (slot B-1: the bonus after the deepest nodes)
        law = probs(logits[:, : self.B], Sampling(1.0) if s.greedy else s)
        tree = build_tree(law[:, : self.B - 1], self.cfg.tree_nodes)
        return Draft(tree.tokens, logits, None, torch.cat([pending[:, None], tree.tokens], dim=1),
                     tree_ancestors(tree.parents), law, tree)

    def verify(self, passes, tgt, r):
        d = r.draft
        h = tgt.forward(d.nodes, tree_layout(r.next_pos, d.ancestors), tree=d.ancestors)
        return passes.target_logits(h)

    def accept(self, r, p_logits):
        s, d = self.cfg.sampling, r.draft
        if s.greedy:
            r.accepted, r.token, r.outcome = tree_greedy_verify(p_logits, d.nodes, d.ancestors)
        else:
            r.accepted, r.token, r.outcome = tree_sample_verify(p_logits, d.nodes, d.ancestors, s, self.gen)
        path_nodes, r.path = tree_path(d.ancestors, r.outcome, d.nodes, self.B - 1)
        r.kept = torch.cat([torch.zeros_like(path_nodes[:, :1]), path_nodes], dim=1)  # pending, then the path

    def depths(self, d):
        return d.tree.depth

    def outcomes(self, d, pending, next_pos):
        tree = d.tree
        b, g, v = len(pending), d.nodes.shape[1], d.law.shape[-1]
        # q after each node: slot depth(n) predicts the token after node n (slot B-1: the bonus)
        after = d.law.gather(1, tree.depth[:, :, None].expand(-1, -1, v))  # (b, g, V), the law the tree was built by
        # a child's token ends no path at its parent (a node left out, parent -1, names the root and
        # its first child's token: already a child)
        children = tree.parents[:, 1:].clamp(min=0) * v + tree.tokens
        after = after.reshape(b, g * v).scatter(1, children, 0.0).reshape(b, g, v)
        k = min(self.cfg.tree_trays, v)
        top_q, top_t = after.topk(k, dim=-1)  # (b, g, k): each node's likeliest outcomes
        law = tree.score.exp()[:, :, None] * top_q  # P(reach n) * q(t)
        pick = law.reshape(b, g * k).topk(min(self.cfg.tree_trays, g * k), dim=-1).indices
        node, tok = pick // k, top_t.reshape(b, g * k).gather(1, pick)
        return Outcomes(glue=d.nodes, glue_layout=tree_layout(next_pos, d.ancestors), at=node, token=tok,
                        pos=next_pos[:, None] + tree.depth.gather(1, node) + 1, glue_sees=d.ancestors,
                        sees=d.ancestors.gather(1, node[:, :, None].expand(-1, -1, g)))

    def match_depth(self, logits, truth):
        """The depth of the deepest node of the block's tree whose path is the response's: greedy
        tree acceptance takes the longest path matching the target's argmax."""
        tree = build_tree(probs(logits.float(), Sampling(1.0)), self.cfg.tree_nodes)
        anc = tree_ancestors(tree.parents)
        depth = tree.depth
        want = truth.gather(1, (depth[:, 1:] - 1).clamp(min=0))  # the response's token at each node's slot
        ok = torch.cat([torch.ones_like(depth[:, :1], dtype=torch.bool), tree.tokens == want], dim=1)
        on_truth = ~(anc & ~ok[:, None, :]).any(-1)  # every node of its path is the response's
        return torch.where(on_truth, depth, 0).max(dim=1).values
