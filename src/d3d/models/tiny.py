"""A tiny random-weight causal LM with a byte-level tokenizer and a ChatML template.

Built from a TinySpec in about a second, with no download: the tests and the `smoke`
experiment run the real pipeline on it. Weights are seeded, so the same config gives the same model.
"""

from __future__ import annotations

from pathlib import Path
import torch

from d3d.specs import TinySpec
from d3d.utils.io import published

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def build_byte_tokenizer():
    """Every byte is one token (no merges), plus ChatML specials; any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(spec: TinySpec, out_dir: str | Path) -> Path:
    """Write a tiny model folder (config, weights, tokenizer) built from `spec`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    tok = build_byte_tokenizer()
    config = AutoConfig.for_model(
        spec.model_type,
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    if spec.model_type in ("qwen3",):
        config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with published(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
    return out_dir
