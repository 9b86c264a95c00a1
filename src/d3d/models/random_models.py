"""Random-weight models, built from a config with no download: the one place they are made.

Two kinds, used by the tests, the smoke experiment, the GPU check and the memory plan:
- a tiny model *folder* (config, weights, byte-level tokenizer, ChatML template) from a TinySpec,
  which the pipeline loads like any other target (`build_tiny_model`, cached by
  d3d.models.target.resolve_model_path);
- an in-memory Qwen3 of a named shape (`random_model`): the published Qwen3-8B / 32B / 1.7B shapes
  time like the trained models (speed does not depend on weight values), and the small shapes
  below serve the checks; `tiny_pair` is the decoding checks' target and lightly perturbed drafter.

Every model is seeded (`torch.manual_seed` right before its init), so the same shape and seed give
the same weights. Needs torch and transformers only (the GPU image has no Hydra, OmegaConf, datasets).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from d3d.models.drafter_settings import DrafterSettings
from d3d.specs import TinySpec
from d3d.utils.io import published

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# Qwen3Config fields of each named shape. The published ones are the hub repos' config.json;
# "toy"/"toy_drafter" differ in structure (layers, tied head) as 1.7B does from 8B, so a compiled
# target and drafter share no graph; "tiny" is the decoding checks' pair (a wide init makes the
# logits peaked: near-ties, which two kernels may break differently, are then rare); "train_check"
# and "memory_plan" are scripts/gpu_train_check.py's and scripts/memory_plan.py's --validate model.
SHAPES = {
    "qwen3_32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=32768),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=32768),
    "qwen3_1p7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False,
                max_position_embeddings=32768),
    "toy_drafter": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                        max_position_embeddings=32768),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                 initializer_range=0.2),
    "train_check": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                        tie_word_embeddings=True),
    "memory_plan": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


def _init(config, seed: int, device, dtype: torch.dtype, attn: str | None):
    """The one seeded init: every factory below ends here."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {} if attn is None else {"attn_implementation": attn}
    with torch.device(device):  # on the device: a 32B model never passes through host memory
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kw)


def random_model(shape: str | dict, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 attn: str = "sdpa"):
    """A random Qwen3 of a named shape (SHAPES) or of the given Qwen3Config fields, in eval mode.
    Initialised on `device` in `dtype`: CPU and CUDA draw different numbers from the same seed, so
    a check that compares devices builds on the CPU and moves the model (`tiny_pair`)."""
    from transformers import Qwen3Config

    fields = SHAPES[shape] if isinstance(shape, str) else shape
    return _init(Qwen3Config(**fields), seed, device, dtype, attn).eval()


def with_shape(name: str, **fields) -> dict:
    """A named shape with some fields changed (scripts/gpu_train_check.py's --layers, --hidden)."""
    return {**SHAPES[name], **fields}


def as_drafter(model, block_size: int):
    """Give a random model d3d drafter settings (mask token = the last id)."""
    vocab = model.config.vocab_size
    DrafterSettings(block_size=block_size, mask_token_id=vocab - 1, vocab_size=vocab,
                    kept_layers=list(range(model.config.num_hidden_layers)), init="random",
                    target="random").attach(model)
    return model


def tiny_pair(device: str, dtype: torch.dtype, block_size: int = 4, seed: int = 0):
    """The tiny random target and a drafter copied from it with a little noise (so drafts are often
    right and the async trays hit). Built in fp32 on the CPU, then moved: the same weights on
    every device and in every dtype (rounded from the same fp32 numbers)."""
    target = random_model("tiny", "cpu", torch.float32, seed).to(device=device, dtype=dtype)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return target, as_drafter(drafter, block_size)


def random_prompts(n: int, vocab: int, seed: int, lengths=(9, 3, 14)) -> list[list[int]]:
    """n prompts of random ids below vocab - 1 (the last id is the drafter's mask), ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


class NoText:
    """Random token ids have no text: the decoding loop only needs decode() and an EOS id."""

    eos_token_id = -1

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return ""


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
    """Write a tiny model folder (config, weights, tokenizer) built from `spec`, any architecture
    transformers knows by `spec.model_type`: the tests and the `smoke` experiment run the real
    pipeline on it."""
    from transformers import AutoConfig

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
    model = _init(config, spec.seed, "cpu", torch.float32, attn=None)  # the default attention, as loaded
    with published(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
    return out_dir
