"""When a speculative output differs from plain AR decoding: numerics, or a bug?

In fp32 on the CPU greedy speculative decoding equals AR token for token (contract 1). In bf16
(any GPU run) it need not: a verify pass over B tokens and an AR step over one token use different
kernels, so the target's logits differ in their last bits, and where two tokens nearly tie the
argmax can flip. From there the two continuations are different texts, both "the target's greedy
output" up to rounding. A correct engine can therefore report "not equal" in bf16, and a broken one
can hide among such rows. This module tells them apart at the first differing position i:

    run the target once over prompt + the common prefix (AR's first i tokens);
    numerical  = both AR's token and the other token are within `tolerance` of the top-1 logit
                 (a near-tie that rounding can flip);
    real       = anything else: the other method emitted a token the target clearly did not pick.

tolerance = ULPS x eps(dtype) x max(1, |top-1 logit|): a few units in the last place of the
logit's magnitude in the dtype the target runs in (bf16 eps = 2^-7, fp32 eps = 2^-23). ULPS = 8
is our choice; it is a parameter. A row's `divergence` records the position, both tokens, the
top-1/top-2 margin, the gap between the two tokens' logits, the tolerance and the class.
"""

from __future__ import annotations

import torch

ULPS = 8.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (or where the shorter one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tolerance(dtype: torch.dtype, top1: float, ulps: float = ULPS) -> float:
    return ulps * torch.finfo(dtype).eps * max(1.0, abs(top1))


@torch.inference_mode()
def classify(target, prompt_ids: list[int], reference: list[int], other: list[int], ulps: float = ULPS) -> dict | None:
    """None when `other` equals `reference` (AR's tokens); else the first divergence, classified."""
    i = first_difference(reference, other)
    if i is None:
        return None
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(reference[:i])], dtype=torch.long, device=device)
    logits = target(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    top1, top2 = float(top.values[0]), float(top.values[1])
    tol = tolerance(target.dtype, top1, ulps)
    info = {"index": i, "tokens": [reference[i] if i < len(reference) else None, other[i] if i < len(other) else None],
            "top1_top2_margin": top1 - top2, "tolerance": tol, "dtype": str(target.dtype).replace("torch.", "")}
    if None in info["tokens"]:  # one output stopped (EOS, stop string) where the other went on
        info.update(gap=None, kind="real")
        return info
    behind = [top1 - float(logits[t]) for t in info["tokens"]]
    info["gap"] = abs(behind[0] - behind[1])
    info["kind"] = "numerical" if max(behind) <= tol else "real"
    return info


class RealDivergence(RuntimeError):
    """A greedy speculative output left the target's greedy output by more than rounding."""
