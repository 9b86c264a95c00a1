"""Choosing the async budget (C, F) from measurements on this device (`decode.C=auto`).

A packed tray pass of B·((C−1)·F + 2) tokens buys a hit rate h(C, F): on a hit the next round skips
its synchronous draft. Whether that pays depends on the device: on a GPU the packed pass hides
behind verification while it is small enough; on a CPU it runs serially and costs its full price
(DESIGN §5: the budget is chosen by projected speedup, never by hit rate). So:

1. hit rates, exactly and offline: when the calibration responses are the target's greedy
   outputs, a greedy round at anchor a accepts k = min(m(a), B−1) drafts and then emits the
   response's next token t*. With coverage `first`, its outcome has a tray iff k < B−1, slot
   j = k+1 ≤ C−1 and t* is among the top-F tokens of q at slot j other than the draft — i.e. its
   rank there is < F — or k = B−1 and the bonus guess (slot B−1's argmax) is t*. One drafter pass
   per anchor (as the acceptance estimator does) gives every (C, F) at once.
2. pass costs on this device: target step (1 token) and verify (B tokens), the drafter's sync
   draft (one block), and the packed pass for each budget, after a cached prefix.
3. projection per round: sync = draft + verify; async = verify ⊕ packed + (1 − h)·draft, where ⊕
   is a sum when the packed pass runs serially (CPU) and max when it overlaps (CUDA stream).
   Speedup = τ · step / round; τ is the same for sync and async (greedy outputs are identical).
   "No trays" (plain sync) is a candidate too: where no budget beats it, which is always so when
   the packed pass cannot overlap, the choice is to run without trays, and says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout
from d3d.utils.timing import timed

GRID = [(C, F) for C in (2, 4, 8, 12, 16) for F in (1, 2, 5)]


@torch.no_grad()
def round_outcomes(model, ids: list[int], prompt_len: int, block_size: int, mask_id: int,
                   vocab_size: int | None = None) -> list[tuple[int, int, bool]]:
    """(accepted k, rank of the next token among the non-drafted tokens at slot k+1, bonus right)
    for every round of greedy decoding of this response (the acceptance estimator's teacher
    forcing, walked round by round)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    B, L = block_size, len(ids)
    seq = torch.tensor(ids, dtype=torch.long, device=dev)
    cache = DynamicCache(config=model.config)
    hidden_states(model, seq[None, : L - 1], clean_layout(L - 1, device=dev), cache=cache, plain=True)
    out, a = [], prompt_len - 1
    while a < L - 1:
        blocks = torch.full((1, B), mask_id, dtype=torch.long, device=dev)
        blocks[0, 0] = seq[a]
        # cached keys are positions 0..L-2; the block at anchor a sees those < a (the mask's rule)
        h = hidden_states(model, blocks, block_layout(torch.full((1, 1), a, device=dev), B), cache=cache,
                          cache_len=L - 1, plain=False)
        cache.crop(-B)
        logits = logits_at(model, h[0], vocab_size)  # (B, V): slot i predicts the token at a+i+1
        drafts = logits[: B - 1].argmax(-1).tolist()
        truth = ids[a + 1 : a + B]
        k = 0
        while k < min(B - 1, len(truth)) and drafts[k] == truth[k]:
            k += 1
        if a + k + 1 >= L:  # the response ended inside the block: no next round to prepare
            break
        t_star = ids[a + k + 1]
        if k < B - 1:
            row = logits[k].clone()
            row[drafts[k]] = float("-inf")  # the drafted token is no alternative
            rank = int((row > row[t_star]).sum())
            out.append((k, rank, False))
        else:
            out.append((k, -1, int(logits[B - 1].argmax()) == t_star))
        a += k + 1
    return out


def hit_rates(outcomes: list[tuple[int, int, bool]], block_size: int, grid=GRID) -> dict[tuple[int, int], float]:
    """h(C, F) for coverage `first` from round outcomes (see the module docstring)."""
    def hit(k, rank, bonus, C, F):
        if k == block_size - 1:
            return bonus
        return k + 1 <= C - 1 and rank < F

    n = max(len(outcomes), 1)
    return {(C, F): sum(hit(*o, C, F) for o in outcomes) / n for C, F in grid}


def _after_prefix_ms(model, prefix: torch.Tensor, x: torch.Tensor, layout, plain: bool, repeats: int,
                     logits: bool, timer=timed):
    """Median ms of one pass of `x` after a cached `prefix` (1, n). Each repeat gets a fresh cache
    of the prefix, built outside the timed region. `timer`: d3d.utils.timing.timed (wall ms) or
    device_and_host_ms (device and host issue time apart)."""
    from transformers import DynamicCache

    n = prefix.shape[1]

    def cached_prefix():
        cache = DynamicCache(config=model.config)
        hidden_states(model, prefix, clean_layout(n, device=prefix.device), cache=cache, plain=True)
        return cache

    def one(cache):
        h = hidden_states(model, x, layout, cache=cache, cache_len=n, plain=plain)
        if logits:  # the decoding loop reads logits at every position of the pass
            logits_at(model, h)

    return timer(one, prefix.device, repeats, setup=cached_prefix)


@torch.inference_mode()
def clean_pass_ms(model, prefix: torch.Tensor, width: int, repeats: int = 5, logits: bool = True, masked: bool = False,
                  timer=timed):
    """One pass of `width` clean tokens after the prefix: a target step (1) or a verify pass (B).
    Token values do not change the cost; the prefix's last token is repeated. masked: pass the
    (all-visible causal) mask explicitly instead of taking SDPA's unmasked causal path: the same
    output, the attention path a masked verify pass takes."""
    n = prefix.shape[1]
    x = prefix[:, -1:].expand(1, width)
    return _after_prefix_ms(model, prefix, x, clean_layout(width, start=n, device=prefix.device), not masked, repeats,
                            logits, timer)


@torch.inference_mode()
def block_pass_ms(drafter, prefix: torch.Tensor, blocks: int, repeats: int = 5, logits: bool = True, timer=timed):
    """One drafter pass of `blocks` mask blocks after the prefix: 1 block is a synchronous draft;
    (C-1)*F + 2 blocks cost what one packed async pass does (the glue counted as a block)."""
    B, mask_id = int(drafter.config.d3d["block_size"]), int(drafter.config.d3d["mask_token_id"])
    n, dev = prefix.shape[1], prefix.device
    x = torch.full((1, blocks * B), mask_id, dtype=torch.long, device=dev)
    layout = block_layout(torch.full((1, blocks), n, device=dev), B)
    return _after_prefix_ms(drafter, prefix, x, layout, False, repeats, logits, timer)


def pass_costs(target, drafter, prefix: list[int], block_size: int, grid=GRID, repeats: int = 5) -> dict:
    """Median ms of each pass the loops run, after a cached prefix, on the models' device."""
    ids = torch.tensor([prefix], dtype=torch.long, device=next(target.parameters()).device)
    return {"step_ms": clean_pass_ms(target, ids, 1, repeats), "verify_ms": clean_pass_ms(target, ids, block_size, repeats),
            "draft_ms": block_pass_ms(drafter, ids, 1, repeats),
            "packed_ms": {f"{C}x{F}": block_pass_ms(drafter, ids, packed_blocks(block_size, C, F), repeats)
                          for C, F in grid}}


def packed_blocks(block_size: int, C: int, F: int) -> int:
    """Blocks in async's packed pass at budget (C, F): the method's own budget, in blocks."""
    from d3d.decoding import DecodeConfig

    return DecodeConfig(method="async", block_size=block_size, C=C, F=F).budget // block_size


@dataclass
class BudgetChoice:
    C: int
    F: int
    projected_speedup: float
    sync_speedup: float
    table: list[dict]
    trays: bool = True  # False: no budget beats plain synchronous drafting here, so run without trays
    why: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def choose(costs: dict, hits: dict[tuple[int, int], float], tau: float, overlap: bool) -> BudgetChoice:
    """The budget with the highest projected speedup (module docstring, step 3), or no trays at all
    when synchronous drafting projects at least as fast: a tray pass that cannot overlap
    verification (a CPU) costs its full price every round, so async must not lose to sync there."""
    step, verify, draft = costs["step_ms"], costs["verify_ms"], costs["draft_ms"]
    sync = tau * step / (draft + verify)
    table = []
    for (C, F), h in hits.items():
        packed = costs["packed_ms"][f"{C}x{F}"]
        both = max(verify, packed) if overlap else verify + packed
        table.append({"C": C, "F": F, "hit_rate": h, "packed_ms": packed, "round_ms": both + (1 - h) * draft,
                      "projected_speedup": tau * step / (both + (1 - h) * draft)})
    best = max(table, key=lambda r: r["projected_speedup"])
    choice = BudgetChoice(best["C"], best["F"], best["projected_speedup"], sync, table)
    # the τ at which a sync round (draft + verify) yields as many tokens per second as AR steps do
    even = f"; sync breaks even at τ = {(draft + verify) / step:.2f} (τ here {tau:.2f})"
    if best["projected_speedup"] <= sync:
        where = "runs after verification (no overlap on this device)" if not overlap else "does not hide behind verification"
        choice.trays = False
        choice.why = (f"no trays: the packed pass {where}, so the best budget, C={best['C']} F={best['F']} "
                      f"(hit rate {best['hit_rate']:.2f}), projects {best['projected_speedup']:.2f}x against "
                      f"sync's {sync:.2f}x; the method runs as synchronous drafting" + even)
    else:
        choice.why = (f"C={best['C']} F={best['F']}: projected {best['projected_speedup']:.2f}x against sync's "
                      f"{sync:.2f}x (hit rate {best['hit_rate']:.2f})" + even)
    return choice


def greedy_pairs(target, tok, prompt_ids: list[list[int]], max_new_tokens: int, eos: list[int]) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy response, prompt length) per prompt: calibration text for
    the offline hit rates (they are exact on the target's own greedy output)."""
    from d3d.decoding import DecodeConfig, SpecGenerator

    ar = SpecGenerator(target, tok, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens), eos)
    return [(ids + ar.generate([ids]).token_ids[0], len(ids)) for ids in prompt_ids]


def calibrate(target, drafter, pairs: list[tuple[list[int], int]], block_size: int, overlap: bool, grid=GRID,
              repeats: int = 5) -> tuple[BudgetChoice, dict]:
    """Steps 1-3 of the module docstring on calibration pairs: the choice, and what it rests on
    (τ, rounds, pass costs)."""
    mask_id, vocab = int(drafter.config.d3d["mask_token_id"]), int(drafter.config.d3d["vocab_size"])
    outcomes = [o for ids, n in pairs for o in round_outcomes(drafter, ids, n, block_size, mask_id, vocab)]
    tau = sum(k + 1 for k, _, _ in outcomes) / max(len(outcomes), 1)
    costs = pass_costs(target, drafter, pairs[0][0][: max(pairs[0][1], 64)], block_size, grid, repeats)
    return choose(costs, hit_rates(outcomes, block_size, grid), tau, overlap), \
        {"tau": tau, "rounds": len(outcomes), "costs": costs}
