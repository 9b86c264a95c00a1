"""Batched generation with the target's own `generate` (what d3d.generate writes, and what
scripts/bench_generate.py times): left padding, EOS cut, the generation settings of `generate.*`.
"""

from __future__ import annotations

import torch

from d3d.data.chat import eos_ids
from d3d.data.prompts import Prompt
from d3d.specs import GenerateSettings


def generation_kwargs(gen: GenerateSettings, tokenizer, model) -> dict:
    """`generate.*` (max_new_tokens, do_sample, temperature, top_p, top_k) as a GenerationConfig."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=gen.max_new_tokens, do_sample=gen.do_sample,
        eos_token_id=eos_ids(tokenizer, model), pad_token_id=tokenizer.pad_token_id,
    )
    if gen.do_sample:
        config.temperature = gen.temperature
        config.top_p = gen.top_p
        config.top_k = gen.top_k or None
    return {"generation_config": config}


def split_response(new_ids: list[int], stop_ids: list[int], pad_id: int | None) -> tuple[list[int], str]:
    """Cut a generated row at its first EOS (kept: the drafter learns to end too)."""
    for i, tok in enumerate(new_ids):
        if tok in stop_ids:
            return new_ids[: i + 1], "stop"
    if pad_id is not None and pad_id not in stop_ids:
        new_ids = [t for t in new_ids if t != pad_id]
    return new_ids, "length"


@torch.inference_mode()
def generate_batch(model, tokenizer, batch: list[tuple[Prompt, list[int]]], kwargs: dict) -> list[tuple[list[int], str]]:
    """Left-padded batched generation; returns (response ids, finish reason) per prompt."""
    width = max(len(ids) for _, ids in batch)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, ids) in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device), **kwargs)
    stop = kwargs["generation_config"].eos_token_id
    stop = [] if stop is None else [stop] if isinstance(stop, int) else list(stop)
    return [split_response(out[row, width:].tolist(), stop, pad) for row in range(len(batch))]
