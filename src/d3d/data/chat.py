"""Prompts into token ids through the target's own chat template (one place, every job)."""

from __future__ import annotations


def supports_thinking_flag(tokenizer) -> bool:
    return "enable_thinking" in (tokenizer.chat_template or "")


def require_thinking_switch(tokenizer, key: str) -> None:
    """`enable_thinking=true` on a template without the switch would change nothing, silently."""
    if not supports_thinking_flag(tokenizer):
        from d3d.errors import ConfigError

        raise ConfigError(f"{key}=true but the chat template of {tokenizer.name_or_path!r} has no enable_thinking "
                          f"switch, so it would change nothing. Fix: set {key}=false, or use a target whose "
                          "template has one (Qwen3).")


def chat_prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool = False,
                    system_prompt: str | None = None) -> list[int]:
    """Token ids of `messages` + the assistant header, as the target's template renders them."""
    if tokenizer.chat_template is None:  # a ConfigError: one line from the CLI (a ValueError was a traceback)
        from d3d.errors import ConfigError

        raise ConfigError(
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
    return _eos_ids(tokenizer, getattr(model, "generation_config", None))


def stop_ids(tokenizer, model_path: str) -> list[int]:
    """`eos_ids` read from a model folder's generation_config.json (no weights loaded): the stop ids a
    serving engine is given, the same the hf backend stops at."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the tokenizer's EOS only
        gen = None
    return _eos_ids(tokenizer, gen)


def _eos_ids(tokenizer, gen) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if gen is not None and gen.eos_token_id is not None:
        ids.update([gen.eos_token_id] if isinstance(gen.eos_token_id, int) else gen.eos_token_id)
    return sorted(ids)
