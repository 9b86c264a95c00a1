"""What an inference engine's parallel-draft pass makes of a d3d drafter (docs/serving.md): the
speculative_config vLLM takes, the drafter run with causal blocks whatever it was trained with, and
its τ there, offline: as the estimator counts it (`served_taus`) and as vLLM counts its steps
(`engine_tau`). Used by d3d.export, scripts/served_tau.py and the serving test."""

from __future__ import annotations

from pathlib import Path

import torch

from d3d.estimator import estimate_acceptance, match_lengths
from d3d.models.drafter import block_attention_as
from d3d.models.drafter_settings import DrafterSettings


def speculative_config(folder: Path, k: int) -> dict:
    """What vLLM takes (`LLM(..., speculative_config=...)`, `vllm serve --speculative-config '<json>'`)."""
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k, "parallel_drafting": True}


def served_taus(model, examples, k: int) -> dict:
    """Greedy τ on `examples` (target greedy responses) as d3d decodes the drafter (its own rule, its
    block of B) and as vLLM serves it (causal, K drafts: the estimator's block of K+1), with the
    served steps counted by τ."""
    s = DrafterSettings.of(model)
    own = estimate_acceptance(model, examples, s.block_size, s.mask_token_id, s.vocab_size).tau
    with block_attention_as(model, "causal"):  # how vLLM's parallel-draft pass drafts
        served = estimate_acceptance(model, examples, k + 1, s.mask_token_id, s.vocab_size)
    # the served steps by τ (1..K+1): d3d.export's speculation profile, its per-position rates
    return {f"tau_d3d_{s.block_attention}_B{s.block_size}": own, f"tau_served_causal_K{k}": served.tau,
            f"tau_histogram_served_causal_K{k}": served.histogram(k + 1), "responses": len(examples)}


def engine_rounds(m: torch.Tensor, new_tokens: int, k: int) -> list[int]:
    """τ of each speculative step of vLLM's greedy run of `new_tokens` tokens, from m(a) (the drafter's
    leading drafts equal to the target's greedy continuation, d3d.estimator.match_lengths, anchors
    from the first generated token on), counted as vLLM counts them: its prefill makes the first
    token without a draft; each step then commits its accepted drafts + 1 (its mean acceptance length
    is their mean) and counts the drafts the target accepted even past the last token it returns, so
    m(a) must be read on a continuation longer than the output and τ is not cut at the end."""
    taus, made = [], 1
    while made < new_tokens:
        tau = 1 + min(int(m[made - 1]), k)
        taus.append(tau)
        made += tau
    return taus


@torch.no_grad()
def engine_tau(model, prompts: list[list[int]], continuations: list[list[int]], new_tokens: int, k: int) -> float:
    """vLLM's mean acceptance length for a greedy run of `new_tokens` tokens per prompt, predicted
    offline: the drafter served causally (as exported), `continuations` the target's greedy tokens
    (at least new_tokens + k + 1 of them, so every step's drafts have a truth to match)."""
    s = DrafterSettings.of(model)
    taus = []
    with block_attention_as(model, "causal"):  # how vLLM's parallel-draft pass drafts
        for p, c in zip(prompts, continuations):
            if len(c) < new_tokens + k + 1:
                raise ValueError(f"a continuation of {len(c)} tokens: at least {new_tokens + k + 1} needed")
            m = match_lengths(model, p + c, len(p) + 1, k + 1, s.mask_token_id, s.vocab_size)
            taus += engine_rounds(m, new_tokens, k)
    return sum(taus) / len(taus)
