"""Choosing a tray budget from measurements on this device (d3d.eval does it for every method whose
budget is not given: the shipped async files' null knobs, or an `eval.async_budgets` entry `auto`),
for any Drafts kind that lists outcomes: the chain's (C, F), the tree's tree_trays (Drafts.tray_grid).

A packed tray pass of Drafts.budget tokens buys a hit rate h: on a hit the next round skips its
synchronous draft. Whether that pays depends on the device: on a GPU the packed pass hides behind
verification while it is small enough; on a CPU it runs serially and costs its full price. So the
budget is chosen by projected speedup, never by hit rate (docs/design.md#decoding-decoding, Choosing
the budget):

1. hit rates, exactly and offline: when the calibration responses are the target's greedy
   outputs, a greedy round accepts exactly the drafts that match the response and then emits the
   response's next token. So one drafter pass at each round's anchor (as the acceptance estimator
   does) gives the round: the Drafts kind makes its drafts and accepts them against target logits
   that put the response first at every verified position, as the loop would (`round_outcomes`);
   a budget hits the round iff the outcomes its Drafts lists at that setting hold the round's
   (Drafts.outcomes, the loop's own listing).
2. pass costs on this device: target step (1 token) and verify (the Drafts' width), the drafter's
   sync draft (one block), and the packed pass for each budget (its tokens in whole blocks), after
   a cached prefix.
3. projection per round: sync = draft + verify; async = verify ⊕ packed + (1 − h)·draft, where ⊕
   is a sum when the packed pass runs serially (CPU) and max when it overlaps (CUDA stream).
   Speedup = τ · step / round; τ is the same for sync and async (greedy outputs are identical).
   "No trays" (plain sync) is a candidate too: where no budget beats it, which is always so when
   the packed pass cannot overlap, the choice is to run without trays, and says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from d3d.decoding.drafts import Draft, Drafts
from d3d.decoding.passes import Round, RoundStats
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.forward import hidden_states, logits_at
from d3d.models.masks import block_layout, clean_layout
from d3d.utils.timing import timed


@dataclass(frozen=True)
class Outcome:
    """One greedy round of a response, offline: its drafts and where its verification ended."""

    draft: Draft
    pending: torch.Tensor  # (1,)
    next_pos: torch.Tensor  # (1,)
    accepted: int
    at: torch.Tensor  # (1,) Round.outcome
    token: torch.Tensor  # (1,) the response's token after the accepted drafts


@torch.no_grad()
def round_outcomes(model, drafts: Drafts, ids: list[int], prompt_len: int, mask_id: int,
                   vocab_size: int | None = None) -> list[Outcome]:
    """Every round of greedy decoding of this response with `drafts` (a greedy config) but the last,
    whose successor the response does not hold (the acceptance estimator's teacher forcing, walked
    round by round)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    B, L = drafts.B, len(ids)
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
        logits = logits_at(model, h, vocab_size).float()  # (1, B, V): slot i predicts the token at a+i+1
        r = Round(seq[a : a + 1], torch.full((1,), a, device=dev), RoundStats([0]), None)
        r.draft = drafts.make(r.pending, logits)
        # the target's greedy choice after a verified token at depth j is the response's token a+j+1
        depth = drafts.depths(r.draft)
        truth = torch.where(a + 1 + depth < L, seq[(a + 1 + depth).clamp(max=L - 1)], -1)
        target = torch.zeros(*depth.shape, logits.shape[-1], device=dev)
        target.scatter_(2, truth.clamp(min=0)[..., None], (truth >= 0).float()[..., None])
        drafts.accept(r, target)
        k = int(r.accepted)
        if a + k + 1 >= L:  # the response ended inside the block: no next round to prepare
            break
        out.append(Outcome(r.draft, r.pending, r.next_pos, k, r.outcome, r.token))
        a += k + 1
    return out


def hit_rates(outcomes: list[Outcome], drafts: Drafts, grid: list[dict]) -> dict[tuple, float]:
    """h per setting of the grid (keyed by its values), from offline round outcomes (module docstring)."""
    out = {}
    for setting in grid:
        at = type(drafts)(replace(drafts.cfg, **setting), drafts.B, None)
        hits = 0
        for o in outcomes:
            listed = at.outcomes(o.draft, o.pending, o.next_pos)
            hits += bool(((listed.at == o.at[:, None]) & (listed.token == o.token[:, None])).any())
        out[tuple(setting.values())] = hits / max(len(outcomes), 1)
    return out


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
        if logits:  # the decoding loop reads logits at every position of the pass (a draft vocabulary's N)
            logits_at(model, h, draft_ids=True)

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
def block_pass_ms(drafter, prefix: torch.Tensor, blocks: int, repeats: int = 5, logits: bool = True, timer=timed,
                  block: int | None = None):
    """One drafter pass of `blocks` mask blocks of `block` tokens after the prefix: 1 block is a
    synchronous draft; a tray pass is its budget in whole blocks (a chain's (C-1)*F + 2: the glue
    counted as a block). `block`: the block the loop drafts (decode.block_size); None = the
    drafter's trained block."""
    s = DrafterSettings.of(drafter)
    B, mask_id = int(block or s.block_size), s.mask_token_id
    n, dev = prefix.shape[1], prefix.device
    x = torch.full((1, blocks * B), mask_id, dtype=torch.long, device=dev)
    layout = block_layout(torch.full((1, blocks), n, device=dev), B)
    return _after_prefix_ms(drafter, prefix, x, layout, False, repeats, logits, timer)


def pass_costs(target, drafter, prefix: list[int], drafts: Drafts, grid: list[dict], repeats: int = 5) -> dict:
    """Median ms of each pass the loops run, after a cached prefix, on the models' device: the packed
    pass of each setting as its budget in whole blocks. Every drafter pass is timed at the block the
    loop will draft (the Drafts' B), the one its budgets are counted in."""
    ids = torch.tensor([prefix], dtype=torch.long, device=next(target.parameters()).device)
    cfg, B = drafts.cfg, drafts.B
    blocks = lambda setting: -(-type(drafts).budget(replace(cfg, **setting)) // B)  # noqa: E731
    return {"step_ms": clean_pass_ms(target, ids, 1, repeats),
            "verify_ms": clean_pass_ms(target, ids, type(drafts).width(cfg), repeats),
            "draft_ms": block_pass_ms(drafter, ids, 1, repeats, block=B),
            "packed_ms": {label(setting): block_pass_ms(drafter, ids, blocks(setting), repeats, block=B)
                          for setting in grid}}


def label(setting: dict) -> str:
    """A setting's name in the tables: its values joined by x (C=4, F=1: 4x1)."""
    return "x".join(str(v) for v in setting.values())


@dataclass
class BudgetChoice:
    settings: dict  # the tray knobs chosen (C, F | tree_trays)
    projected_speedup: float
    sync_speedup: float
    table: list[dict]
    trays: bool = True  # False: no budget beats plain synchronous drafting here, so run without trays
    why: str = ""

    def as_dict(self) -> dict:
        """Flat: the chosen knobs beside the rest (what run.json records)."""
        out = asdict(self)
        return {**out.pop("settings"), **out}


def choose(costs: dict, hits: dict[tuple, float], tau: float, overlap: bool, knobs: tuple[str, ...]) -> BudgetChoice:
    """The budget with the highest projected speedup (module docstring, step 3), or no trays at all
    when synchronous drafting projects at least as fast: a tray pass that cannot overlap
    verification (a CPU) costs its full price every round, so async must not lose to sync there.
    `hits` is keyed by the values of the tray knobs `knobs`."""
    step, verify, draft = costs["step_ms"], costs["verify_ms"], costs["draft_ms"]
    sync = tau * step / (draft + verify)
    table = []
    for values, h in hits.items():
        setting = dict(zip(knobs, values))
        packed = costs["packed_ms"][label(setting)]
        both = max(verify, packed) if overlap else verify + packed
        table.append({**setting, "hit_rate": h, "packed_ms": packed, "round_ms": both + (1 - h) * draft,
                      "projected_speedup": tau * step / (both + (1 - h) * draft)})
    best = max(table, key=lambda r: r["projected_speedup"])
    chosen = {k: best[k] for k in knobs}
    named = " ".join(f"{k}={v}" for k, v in chosen.items())
    choice = BudgetChoice(chosen, best["projected_speedup"], sync, table)
    # the τ at which a sync round (draft + verify) yields as many tokens per second as AR steps do
    even = f"; sync breaks even at τ = {(draft + verify) / step:.2f} (τ here {tau:.2f})"
    if best["projected_speedup"] <= sync:
        where = "runs after verification (no overlap on this device)" if not overlap else "does not hide behind verification"
        choice.trays = False
        choice.why = (f"no trays: the packed pass {where}, so the best budget, {named} "
                      f"(hit rate {best['hit_rate']:.2f}), projects {best['projected_speedup']:.2f}x against "
                      f"sync's {sync:.2f}x; the method drafts synchronously, without trays" + even)
    else:
        choice.why = (f"{named}: projected {best['projected_speedup']:.2f}x against sync's "
                      f"{sync:.2f}x (hit rate {best['hit_rate']:.2f})" + even)
    return choice


def greedy_pairs(target, tok, prompt_ids: list[list[int]], max_new_tokens: int, eos: list[int]) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy response, prompt length) per prompt: calibration text for
    the offline hit rates (they are exact on the target's own greedy output)."""
    from d3d.decoding import DecodeConfig, SpecGenerator

    ar = SpecGenerator(target, tok, None, DecodeConfig(method="ar", max_new_tokens=max_new_tokens), eos)
    return [(ids + ar.generate([ids]).token_ids[0], len(ids)) for ids in prompt_ids]


def calibrate(target, drafter, pairs: list[tuple[list[int], int]], drafts: Drafts, overlap: bool,
              repeats: int = 5, progress: bool = True, grid: list[dict] | None = None) -> tuple[BudgetChoice, dict]:
    """Steps 1-3 of the module docstring on calibration pairs for `drafts` (a greedy config of a
    method with trays) over `grid` (default: its Drafts' tray grid; d3d.eval passes the settings
    whose passes fit the device): the choice, and what it rests on (τ, rounds, pass costs).
    Minutes for a 1.5B target on a CPU (the Qwen pair on a Zen 4 EPYC: 3 to 4), so a bar per response."""
    from tqdm.auto import tqdm

    s = DrafterSettings.of(drafter)
    mask_id, vocab = s.mask_token_id, s.vocab_size
    grid = list(grid or drafts.tray_grid)
    outcomes = [o for ids, n in tqdm(pairs, desc="budget: rounds per response", unit="response", disable=not progress)
                for o in round_outcomes(drafter, drafts, ids, n, mask_id, vocab)]
    tau = sum(o.accepted + 1 for o in outcomes) / max(len(outcomes), 1)
    costs = pass_costs(target, drafter, pairs[0][0][: max(pairs[0][1], 64)], drafts, grid, repeats)
    return choose(costs, hit_rates(outcomes, drafts, grid), tau, overlap, tuple(grid[0])), \
        {"tau": tau, "rounds": len(outcomes), "costs": costs}

