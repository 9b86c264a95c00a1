"""A serving engine without a model, for the generation tests (tests/unit/test_engines.py,
tests/integration/test_generate.py, tests/multiproc/generate_worker.py): it stands in for vLLM
behind the real `ContinuousEngine` loop, so sharding, continuous submission, GPU pinning, resume
and the report run as they do on a GPU node.

Each engine step adds one token to every request in flight, so short replies finish first, as in a
continuously batched engine. A reply is a pure function of the prompt ids (and, when sampling, of
the prompt's seed), of one of three kinds: a repetition loop that runs to max_new_tokens, a reply
that stops at EOS, or non-repeating tokens cut at max_new_tokens.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import replace

from d3d.models import engines


def plan(prompt_ids: list[int], seed: int | None, max_new_tokens: int, eos: int) -> tuple[str, list[int]]:
    """(kind, tokens) the stub answers `prompt_ids` with; `seed` None when greedy."""
    h = int.from_bytes(hashlib.sha256(repr((list(prompt_ids), seed)).encode()).digest()[:8], "big")
    rng = random.Random(h)
    kind = ("loop", "stop", "cut")[h % 3]
    # token ids of the tiny test tokenizer (260), never its EOS (2): random tails never repeat for 64 tokens
    words = [rng.randrange(3, 260) for _ in range(max_new_tokens)]
    if kind == "loop":
        return kind, (words[:5] * max_new_tokens)[:max_new_tokens]
    if kind == "stop":
        n = min(2 + h % 10, max_new_tokens - 1)
        return kind, words[:n] + [eos]
    return kind, words


class StubEngine(engines.ContinuousEngine):
    name = "vllm"
    steps: list[tuple[int, int]] = []  # (requests in flight, requests submitted so far) at each step
    gpus: list[str | None] = []  # CUDA_VISIBLE_DEVICES each engine saw when it started
    worlds: list[str | None] = []  # WORLD_SIZE each engine saw (a launcher's, unless the rank dropped it)

    def __init__(self, model_path: str, gen, stop_ids: list[int], dtype: str, seed: int) -> None:
        super().__init__(gen, stop_ids)
        self._live: dict[str, list[int]] = {}  # key -> the tokens still to emit
        self._emitted: dict[str, list[int]] = {}
        self._submitted = 0
        StubEngine.gpus.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        StubEngine.worlds.append(os.environ.get("WORLD_SIZE"))

    def _submit(self, key: str, prompt_ids: list[int], seed: int) -> None:
        g = self._gen
        _, tokens = plan(prompt_ids, seed if g.do_sample else None, g.max_new_tokens, self._stop_ids[0])
        self._live[key], self._emitted[key] = list(tokens), []
        self._submitted += 1

    def _step(self) -> list[tuple[str, list[int]]]:
        StubEngine.steps.append((len(self._live), self._submitted))
        finished = []
        for key, todo in list(self._live.items()):
            self._emitted[key].append(todo.pop(0))
            if not todo:
                del self._live[key]
                finished.append((key, self._emitted.pop(key)))
        return finished

    def close(self) -> None:
        pass


def use_stub(monkeypatch=None) -> None:
    """Make `generate.backend=vllm` run the stub (with vLLM's option keys: tensor_parallel_size...)."""
    stub = replace(engines.ENGINES["vllm"], module="d3d", cls=StubEngine)
    if monkeypatch is None:
        engines.ENGINES["vllm"] = stub
    else:
        monkeypatch.setitem(engines.ENGINES, "vllm", stub)
    StubEngine.steps.clear()
    StubEngine.gpus.clear()
    StubEngine.worlds.clear()
