"""A serving engine without a model, for the generation tests (tests/unit/test_engines.py,
tests/integration/test_generate.py, tests/multiproc/generate_worker.py). Each engine step adds one
token to every request in flight, so short replies finish first, as in a continuously batched
engine. A reply is a pure function of the prompt ids (and, when sampling, of the prompt's seed), of
one of three kinds: a repetition loop that runs to max_new_tokens, a reply that stops at EOS, or
non-repeating tokens cut at max_new_tokens. It comes in two forms, which answer alike:

- `StubEngine`, in the test's own process behind the real `ContinuousEngine` loop (`use_stub`):
  sharding, continuous submission, GPU pinning, resume and the report run as on a GPU node, cheaply.
- A fake `vllm` package (tests/stub_vllm/vllm: `LLM`, `SamplingParams`) that d3d's own VLLMBackend
  drives, and that starts like vLLM on a GPU node: its engine core is a process of its own, started
  by fork unless VLLM_WORKER_MULTIPROC_METHOD=spawn (vLLM's default; like vLLM it switches to spawn
  by itself when CUDA is initialised in the parent), and a forked core refuses to start, with
  vLLM's "Cannot re-initialize CUDA in forked subprocess", when its parent made a CUDA probe that
  initialises the driver. A CPU torch never initialises CUDA, so the stand-in records the probes
  itself (`record_cuda_probes`): `torch.cuda.is_available()` unless PYTORCH_NVML_BASED_CUDA_CHECK=1,
  and CUDA's lazy init (which `init`, `current_device`, `set_device`, `get_device_properties`,
  `get_device_name`, `get_device_capability`, `mem_get_info`, `synchronize` ... run first).
  `device_count()` asks NVML first and is not a probe.

  In a test's process: `use_stub_vllm(monkeypatch)`. From a CLI run (also under torchrun): put
  tests/stub_vllm first on PYTHONPATH. Its sitecustomize records every probe from the interpreter's
  first line, and `import vllm` finds the fake:

      PYTHONPATH=$PWD/tests/stub_vllm:$PWD/src torchrun --nproc_per_node 2 -m d3d.generate \
          +experiment=smoke generate.backend=vllm

  Each engine prints `[stub vllm] engine core pid N started by fork|spawn, CUDA_VISIBLE_DEVICES=...`
  on stderr; a refused start is a RuntimeError in the rank, as vLLM's.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import multiprocessing
import os
import random
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

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
        keep_start_env(monkeypatch)
    StubEngine.steps.clear()
    StubEngine.gpus.clear()
    StubEngine.worlds.clear()


# --- CUDA probes, recorded where a CPU torch cannot show them ------------------------------------

FORK_ERROR = ("RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
              "you must use the 'spawn' start method")


def record_cuda_probes(monkeypatch=None) -> list[tuple[str, str]]:
    """From now on, note each call of this process that initialises CUDA on a GPU node, as (kind,
    where): kind "driver" (is_available without the NVML check; torch.cuda.is_initialized() stays
    False) or "init" (the lazy init). The list lives on torch.cuda itself: a forked child inherits
    it, and every importer of this file sees one list. Returns it (emptied)."""
    import torch.cuda as cuda

    probes = getattr(cuda, "_stub_probes", None)
    if probes is not None:
        probes.clear()
        return probes
    probes, available, lazy_init = [], cuda.is_available, cuda._lazy_init

    def is_available():
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
            probes.append(("driver", _caller("torch.cuda.is_available()")))
        return available()

    def _lazy_init():
        probes.append(("init", _caller("CUDA's lazy init")))
        return lazy_init()

    for name, value in (("is_available", is_available), ("_lazy_init", _lazy_init), ("_stub_probes", probes)):
        if monkeypatch is not None:  # undone when the test ends
            monkeypatch.setattr(cuda, name, value, raising=False)
        else:
            setattr(cuda, name, value)
    return probes


def cuda_probes() -> list[tuple[str, str]]:
    """The probes recorded in this process so far (none where nothing records them)."""
    import torch.cuda as cuda

    return list(getattr(cuda, "_stub_probes", []))


def _caller(what: str) -> str:
    """`what` and the innermost frame that made the call outside torch and this file."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/torch/" not in f.filename and not f.filename.endswith("stub_engine.py")]
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    return f"{what} at {where}"


# --- the fake vLLM: an engine core in a process of its own -----------------------------------------

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """vLLM's SamplingParams: its keys (a key vLLM does not know is a TypeError there too) and defaults."""

    DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "max_tokens": 16,
                "min_tokens": 0, "stop": None, "stop_token_ids": None, "ignore_eos": False, "logprobs": None,
                "detokenize": True, "skip_special_tokens": True, "output_kind": RequestOutputKind.CUMULATIVE}

    def __init__(self, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(self.DEFAULTS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        self.__dict__.update({**self.DEFAULTS, **kwargs})


def engine_core(conn, forked: bool) -> None:
    """vLLM's engine core process: refuses to start in a fork of a parent that touched CUDA, else
    takes requests ("add") and runs steps ("step") until told to stop."""
    if forked and cuda_probes():
        conn.send(("error", f"{FORK_ERROR} (the parent's first probe: {cuda_probes()[0][1]})"))
        return
    conn.send(("ready", os.getpid()))
    live: dict[str, list[int]] = {}
    emitted: dict[str, list[int]] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "add":
            _, key, prompt_ids, p = msg
            seed = p["seed"] if p["temperature"] > 0 else None
            live[key], emitted[key] = list(plan(prompt_ids, seed, p["max_tokens"], p["stop_token_ids"][0])[1]), []
        elif msg[0] == "step":
            finished = []
            for key, todo in list(live.items()):
                emitted[key].append(todo.pop(0))
                if not todo:
                    del live[key]
                    finished.append((key, emitted.pop(key)))
            conn.send(finished)
        else:
            return


class LLM:
    """vLLM's offline `LLM`, as far as d3d's VLLMBackend uses it: `LLM(model=..., **options)` starts
    the engine core; `llm_engine.add_request` and `llm_engine.step` feed and step it."""

    started: list[dict] = []  # per engine: its start method, what it saw, the detokenize flags it was sent

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto", seed: int = 0, **options) -> None:
        method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        if method == "fork" and any(kind == "init" for kind, _ in cuda_probes()):
            method = "spawn"  # vLLM's own switch when torch.cuda.is_initialized()
        ctx = multiprocessing.get_context(method)
        self._conn, theirs = ctx.Pipe()
        self._core = ctx.Process(target=engine_core, args=(theirs, method == "fork"), daemon=True)
        self._core.start()
        theirs.close()
        status, detail = self._conn.recv()
        if status == "error":
            self._core.join()
            raise RuntimeError(f"Engine core initialization failed. See root cause above. Root cause: {detail}")
        self.record = {"method": method, "pid": detail, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                       "world": os.environ.get("WORLD_SIZE"), "dtype": dtype, "options": options, "detokenize": set()}
        LLM.started.append(self.record)
        print(f"[stub vllm] engine core pid {detail} started by {method}, CUDA_VISIBLE_DEVICES="
              f"{self.record['gpus']}", file=sys.stderr, flush=True)
        self.llm_engine = self

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        self.record["detokenize"].add(params.detokenize)
        self._conn.send(("add", request_id, list(prompt["prompt_token_ids"]), dict(params.__dict__)))

    def step(self) -> list:
        self._conn.send(("step",))
        return [SimpleNamespace(request_id=key, finished=True, outputs=[SimpleNamespace(token_ids=ids)])
                for key, ids in self._conn.recv()]

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None and not conn.closed:
            try:
                conn.send(("stop",))
            except OSError:
                pass
            conn.close()
            self._core.join(timeout=10)


STUB_VLLM = Path(__file__).resolve().parent / "stub_vllm"


def use_stub_vllm(monkeypatch) -> list[tuple[str, str]]:
    """In this process until the test ends: `import vllm` gives the fake, and CUDA probes are recorded
    from now on. Returns the probe list (empty)."""
    keep_start_env(monkeypatch)
    monkeypatch.syspath_prepend(str(STUB_VLLM))  # also where a spawned engine core finds it
    for name in ("vllm", "vllm.sampling_params"):
        monkeypatch.setitem(sys.modules, name, None)  # gone again when the test ends
        del sys.modules[name]
    importlib.import_module("vllm.sampling_params")
    LLM.started.clear()
    return record_cuda_probes(monkeypatch)


def keep_start_env(monkeypatch) -> None:
    """d3d.generate sets an engine's start variables in os.environ (engines.prepare_start): put them
    back as they were when the test ends, so no later test inherits them."""
    for key in ("PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_WORKER_MULTIPROC_METHOD"):  # what prepare_start sets
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not os.environ[key]:
            monkeypatch.delenv(key)
