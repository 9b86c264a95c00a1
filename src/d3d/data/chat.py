"""Prompts into token ids through the target's own chat template (one place, every job)."""

from __future__ import annotations


def supports_thinking_flag(tokenizer) -> bool:
    return "enable_thinking" in (tokenizer.chat_template or "")


def chat_prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool = False,
                    system_prompt: str | None = None) -> list[int]:
    """Token ids of `messages` + the assistant header, as the target's template renders them."""
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template. Fix: use an instruct/chat "
            "model as the target, or set tokenizer.chat_template."
        )
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]
    kwargs = {"enable_thinking": enable_thinking} if supports_thinking_flag(tokenizer) else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(tokenizer, model=None) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.eos_token_id is not None:
        ids.update([gen.eos_token_id] if isinstance(gen.eos_token_id, int) else gen.eos_token_id)
    return sorted(ids)
