"""Generation backends (d3d.models.engines) without an engine installed: the one-line refusals, the
folder and row bookkeeping, the thinking switch, continuous submission (on the stub engine,
tests/stub_engine.py), ranks and their GPUs, the repetition-loop detector. The engine itself runs in
tests/integration/test_engines.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from d3d.errors import ConfigError
from d3d.models import engines


def test_unknown_backend_is_one_line_with_the_choices():
    with pytest.raises(ConfigError, match=r"generate.backend='tgi' is not a backend. Fix: use one of hf, vllm, sglang"):
        engines.check_backend("tgi")


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_missing_engine_names_the_install(monkeypatch, name):
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda module: None)
    with pytest.raises(ConfigError, match=rf"generate.backend={name} needs {name}.*Fix: pip install"):
        engines.check_backend(name)
    engines.check_backend("hf")  # the reference needs nothing more


def test_generate_refuses_a_missing_engine_before_reading_prompts_or_loading(monkeypatch, tmp_path):
    from d3d import generate
    from tests.conftest import compose

    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda module: None)

    def must_not_run(*a, **k):
        raise AssertionError("work started before the backend was checked")

    monkeypatch.setattr(generate, "load_prompt_set", must_not_run)
    monkeypatch.setattr(generate, "load_model", must_not_run)
    cfg = compose("generate", ["+experiment=smoke", "generate.backend=vllm"], tmp_path)
    with pytest.raises(ConfigError, match="needs vllm"):
        generate.run_generate(cfg)


def _meta(tmp_path, settings):
    (tmp_path / "meta.json").write_text(json.dumps({"target": {"name": "t", "path": "t"}, "settings": settings}))


def test_a_folder_from_before_backends_resumes_as_hf_and_refuses_an_engine(tmp_path):
    from d3d.generate import OutputMismatchError, check_output_folder

    old = {"max_new_tokens": 8, "do_sample": False}  # written before `backend` was a setting
    _meta(tmp_path, old)
    target = {"name": "t", "path": "t"}
    check_output_folder(tmp_path, {"target": target, "settings": {**old, "backend": "hf"}}, holds_rows=True)
    with pytest.raises(OutputMismatchError, match="settings"):
        check_output_folder(tmp_path, {"target": target, "settings": {**old, "backend": "vllm"}}, holds_rows=True)


def _rows(tmp_path, backends):
    rows = [{"id": f"p{i}", "prompt_ids": [1, 2], "response_ids": [3, 4],
             "settings": {} if b is None else {"backend": b}} for i, b in enumerate(backends)]
    (tmp_path / "responses.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_training_refuses_a_folder_of_two_backends_unless_told(tmp_path):
    from d3d.data.responses import read_responses, row_backends
    from d3d.examples import load_examples

    _rows(tmp_path, [None, "hf", "vllm"])  # a row without the key is an hf row
    assert row_backends(read_responses(tmp_path)) == {"hf": 2, "vllm": 1}
    with pytest.raises(ConfigError, match=r"mixes responses .*2 rows from hf, 1 rows from vllm.*allow_mixed_backends=true"):
        load_examples(tmp_path, 16)
    assert len(load_examples(tmp_path, 16, allow_mixed_backends=True)) == 3


def test_one_backend_trains(tmp_path):
    from d3d.examples import load_examples

    _rows(tmp_path, ["vllm", "vllm"])
    assert len(load_examples(tmp_path, 16)) == 2


def test_thinking_on_a_template_without_the_switch_is_refused():
    from d3d.data.chat import require_thinking_switch

    plain = SimpleNamespace(chat_template="{{ messages }}", name_or_path="smol")
    with pytest.raises(ConfigError, match="generate.enable_thinking=true but the chat template of 'smol' has no"):
        require_thinking_switch(plain, "generate.enable_thinking")
    require_thinking_switch(SimpleNamespace(chat_template="{% if enable_thinking %}", name_or_path="q3"),
                            "generate.enable_thinking")


def test_every_backend_option_group_is_in_the_config():
    """generate.<engine> holds that engine's constructor options (free-form: the engine checks them)."""
    from d3d.config import compose

    gen = compose("generate").generate
    assert gen.backend == "hf"
    assert set(engines.ENGINES) <= set(gen)


def test_a_target_without_a_chat_template_is_one_line():
    """A base model's tokenizer has no chat template: a ValueError, so the CLI showed a traceback (issue 38)."""
    from d3d.data.chat import chat_prompt_ids

    with pytest.raises(ConfigError, match=r"^tokenizer 'base' has no chat template\. Fix: use an instruct/chat model"):
        chat_prompt_ids(SimpleNamespace(chat_template=None, name_or_path="base"), [{"role": "user", "content": "hi"}])


# --- continuous submission (the stub engine behind ContinuousEngine's loop) -------------------------

def _prompts(n, rng):
    return [(SimpleNamespace(id=f"p{i}"), [rng.randrange(3, 260) for _ in range(rng.randrange(2, 9))]) for i in range(n)]


def test_an_engine_is_refilled_as_each_reply_finishes_and_rows_come_out_as_they_finish():
    """While prompts wait, the engine always holds `batch_size` requests: a finished reply's slot is
    refilled at once instead of idling until the batch's longest reply ends."""
    import random

    from tests.stub_engine import StubEngine, plan

    StubEngine.steps.clear()
    window, prompts = 4, _prompts(11, random.Random(0))
    gen = SimpleNamespace(batch_size=window, max_new_tokens=80, do_sample=False)
    engine = StubEngine("-", gen, [2], "float32", 0)
    batches = [(0, prompts[:6]), (1, prompts[6:])]
    out = [row for group in engine.run(batches, done={"p3"}, seed=0) for row in group]
    assert sorted(p.id for p, _, _ in out) == sorted(f"p{i}" for i in range(11) if i != 3)
    assert [p.id for p, _, _ in out] != [p.id for p, _ in prompts if p.id != "p3"]  # in finishing order
    prompt_ids = {p.id: ids for p, ids in prompts}
    for prompt, resp, reason in out:
        kind, tokens = plan(prompt_ids[prompt.id], None, 80, 2)
        assert resp == tokens and reason == ("stop" if kind == "stop" else "length")
    waiting = [live for live, submitted in StubEngine.steps if submitted < 10]  # 10 prompts to do
    assert waiting and all(live == window for live in waiting), StubEngine.steps


# --- ranks and their GPUs ---------------------------------------------------------------------

def test_ranks_come_from_the_launcher_srun_or_the_shard():
    from d3d.generate import data_rank

    assert data_rank(None, {}).__dict__ == {"index": 0, "count": 1, "local": None, "source": "one process"}
    torchrun = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}
    assert (data_rank(None, torchrun).index, data_rank(None, torchrun).count, data_rank(None, torchrun).local) == (5, 16, 1)
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"}
    assert (data_rank(None, step).index, data_rank(None, step).count, data_rank(None, step).local) == (3, 8, 3)
    # a batch script sees the allocation's task count but is one process: it answers everything
    assert data_rank(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).count == 1
    # job 2 of 4 (an array job), each a torchrun of 8 processes: slice 2*8 + 5 of 32
    both = data_rank("2/4", torchrun | {"WORLD_SIZE": "8"})
    assert (both.index, both.count, both.source) == (21, 32, "shard 2/4 x launcher rank 5/8")
    assert data_rank("1/3", {}).__dict__ == {"index": 1, "count": 3, "local": None, "source": "shard 1/3"}


@pytest.mark.parametrize("shard", ["3/3", "1", "a/b", "-1/2", "1/0"])
def test_a_bad_shard_is_one_line(shard):
    from d3d.generate import data_rank

    with pytest.raises(ConfigError, match=rf"^generate.shard='{shard}' is not i/n with 0 <= i < n. Fix: start n jobs"):
        data_rank(shard, {})


def test_each_launched_rank_gets_its_own_gpus():
    from d3d.generate import rank_gpus

    assert rank_gpus(0, 1, None) == ["0"] and rank_gpus(3, 2, None) == ["6", "7"]
    assert rank_gpus(1, 2, ["4", "5", "6", "7"]) == ["6", "7"]  # indexes into what the node lets us see
    assert rank_gpus(2, 2, ["3", "1"]) == ["3", "1"]  # srun --gpus-per-task already bound this task's pair
    with pytest.raises(ConfigError, match=r"rank 2 on this node needs GPUs 4..5 \(2 per engine\) but 4 are visible. "
                                          r"Fix: start at most 2 ranks per node"):
        rank_gpus(2, 2, ["0", "1", "2", "3"])


def test_an_engine_drives_tensor_times_pipeline_parallel_gpus():
    assert engines.engine_gpus("vllm", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}) == 8
    assert engines.engine_gpus("sglang", {"tp_size": 2}) == 2
    assert engines.engine_gpus("hf", {"tensor_parallel_size": 8}) == 1


# --- the repetition-loop detector and what readers do with it --------------------------------------

def test_the_loop_detector_finds_a_short_period_repeated_over_the_tail():
    from d3d.data.responses import repetition_loop

    rng = __import__("random").Random(1)
    prose = [rng.randrange(1000) for _ in range(300)]
    assert repetition_loop(prose) is None
    assert repetition_loop(prose + [7, 8, 9] * 22) == 3  # 66 tokens of period 3
    assert repetition_loop(prose + [7, 8, 9] * 20) is None  # 60 tokens: under the 64-token floor
    assert repetition_loop(prose + [5] * 64) == 1 and repetition_loop(prose + [5] * 20) is None
    period = [rng.randrange(1000) for _ in range(64)]
    assert repetition_loop(prose + period * 3) == 64  # the longest period, three times
    assert repetition_loop(prose + period * 2) is None  # twice is a quotation, not yet a loop
    assert repetition_loop(prose + [1, 2] * 40) == 2  # the shortest period (4 fits too)
    assert repetition_loop(prose + [7, 8, 9] * 30 + [2]) is None  # left the loop and stopped at EOS
    assert repetition_loop([4] * 10) is None


def test_training_may_leave_looping_rows_out(tmp_path):
    from d3d.data.responses import read_responses
    from d3d.settings import bind_config
    from d3d.examples import load_examples
    from tests.conftest import compose

    rows = [{"id": "loop", "prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6] * 30},
            {"id": "ok", "prompt_ids": [1, 2], "response_ids": list(range(3, 120))}]
    (tmp_path / "responses.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["id"] for r in read_responses(tmp_path)] == ["loop", "ok"]
    assert [r["id"] for r in read_responses(tmp_path, drop_looping=True)] == ["ok"]
    # what d3d.train and d3d.prune read (the Arrow cache), under train.drop_looping
    assert len(load_examples(tmp_path, 512)) == 2
    assert [len(e.ids) for e in load_examples(tmp_path, 512, drop_looping=True)] == [2 + 117]
    cfg = bind_config(compose("train", ["train.drop_looping=true"]), "train")
    assert cfg.train.drop_looping is True


def test_a_prompt_answered_differently_in_two_shards_is_one_line(tmp_path):
    from d3d.data.responses import ConflictingShards, read_responses

    row = {"id": "p1", "prompt_ids": [1], "response_ids": [2, 3]}
    (tmp_path / "responses.rank0.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "responses.rank3.jsonl").write_text(json.dumps({**row, "response_ids": [2, 4]}) + "\n")
    with pytest.raises(ConflictingShards, match=r"prompt 'p1' has different responses in responses.rank0.jsonl and "
                                                r"responses.rank3.jsonl .*Fix: delete the shard files of one run"):
        read_responses(tmp_path)


# --- starting an engine: no CUDA probe before it, spawn by default ----------------------------------

def _unset(monkeypatch, *keys):
    for key in keys:  # absent during the test, as before it afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_the_stand_in_refuses_a_fork_after_a_cuda_probe_as_vllm_does(monkeypatch):
    """The stand-in itself (tests/stub_engine.py): a parent that asked torch.cuda.is_available()
    forks an engine core that cannot start; asked through NVML, or spawned, the core starts."""
    import torch

    from tests.stub_engine import LLM, SamplingParams, plan, use_stub_vllm

    probes = use_stub_vllm(monkeypatch)
    _unset(monkeypatch, "PYTORCH_NVML_BASED_CUDA_CHECK")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    torch.cuda.is_available()
    assert [kind for kind, _ in probes] == ["driver"] and "test_engines.py" in probes[0][1]
    with pytest.raises(RuntimeError, match=r"Cannot re-initialize CUDA in forked subprocess.*test_engines.py"):
        LLM("m")
    probes.clear()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    torch.cuda.is_available()
    assert probes == []
    llm = LLM("m")
    llm.llm_engine.add_request("a", {"prompt_token_ids": [5, 6, 7]},
                               SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=[2]))
    outputs = []
    while not outputs:
        outputs = llm.llm_engine.step()

    assert outputs[0].request_id == "a" and list(outputs[0].outputs[0].token_ids) == plan([5, 6, 7], None, 80, 2)[1]
    assert LLM.started[-1]["method"] == "fork"
    with pytest.raises(TypeError, match="'detokenise'"):
        SamplingParams(detokenise=False)


def test_resolving_an_engine_rank_s_device_and_dtype_makes_no_cuda_probe(monkeypatch):
    """`target.device=auto` / `target.dtype=auto` for an engine used to ask torch.cuda.is_available(),
    which initialises the driver on a GPU node: the engine's forked core then dies at start."""
    from d3d.generate import dtype_name
    from d3d.models.target import pick_device
    from tests.stub_engine import record_cuda_probes

    probes = record_cuda_probes(monkeypatch)
    _unset(monkeypatch, "PYTORCH_NVML_BASED_CUDA_CHECK")
    assert dtype_name("auto", "auto") in ("float32", "bfloat16") and pick_device("auto").type == "cpu"
    assert dtype_name("bfloat16", "auto") == "bfloat16"
    assert probes == []


def test_an_engine_starts_by_spawn_and_asks_nvml_unless_the_user_said_otherwise():
    env = {}
    engines.prepare_start("vllm", env)
    assert env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    engines.prepare_start("vllm", env)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    env = {}
    engines.prepare_start("sglang", env)
    assert env == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env = {}
    engines.prepare_start("hf", env)
    assert env == {}


def test_vllm_is_asked_for_no_text_d3d_would_discard(monkeypatch):
    """The rows' text is decoded by d3d from the ids: vLLM's detokenizer only cost time."""
    from tests.stub_engine import use_stub_vllm

    use_stub_vllm(monkeypatch)
    backend = object.__new__(engines.VLLMBackend)
    for sampled in (False, True):
        backend._gen, backend._stop_ids = SimpleNamespace(max_new_tokens=8, do_sample=sampled, temperature=0.7,
                                                          top_p=0.9, top_k=0), [2]
        assert backend._params(seed=1).detokenize is False


def test_sglang_runs_on_a_loop_of_its_own_even_in_a_thread(monkeypatch):
    """asyncio.get_event_loop() with no current loop is deprecated (an error in a thread that set
    none, and from Python 3.14 everywhere); the backend makes its loop current before SGLang, which
    looks the current loop up itself, is built."""
    import asyncio
    import sys
    import threading
    import types

    class Engine:
        def __init__(self, **kwargs):
            self.loop = asyncio.get_event_loop()  # as SGLang's engine does

        async def async_generate(self, input_ids, sampling_params):
            assert asyncio.get_running_loop() is self.loop
            await asyncio.sleep(0)
            return {"output_ids": [input_ids[0], 2]}

        def shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    gen = SimpleNamespace(batch_size=2, max_new_tokens=8, do_sample=False, temperature=0.0, top_p=1.0, top_k=0,
                          sglang={})
    result = {}

    def in_thread():
        try:
            backend = engines.SGLangBackend("m", gen, [2], "bfloat16", 0)
            batches = [(0, [(SimpleNamespace(id=f"p{i}"), [10 + i, 11]) for i in range(3)])]
            result["rows"] = sorted((p.id, ids) for rows in backend.run(batches, set(), 0) for p, ids, _ in rows)
            backend.close()
        except Exception as err:  # noqa: BLE001  (reported to the test's thread)
            result["error"] = err

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert result["rows"] == [("p0", [10, 2]), ("p1", [11, 2]), ("p2", [12, 2])]
