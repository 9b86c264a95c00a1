"""d3d.generate end to end on a tiny random model: rows, resume after a kill, bad input; data-parallel
shards on the stub engine (tests/stub_engine.py), in process and under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from d3d.errors import ConfigError
from d3d.data.prompts import EmptyPromptSetError
from d3d.data.responses import read_responses
from d3d.generate import OutputMismatchError, run_generate
from d3d.models.generation import split_response
from d3d.utils.io import read_jsonl
from d3d.settings import bind_config
from tests.conftest import CACHE_DIR, FIXTURES, ROOT, Killed, compose, kill_on, torchrun

LOCAL = ["+experiment=smoke", "data=local", f"data.local_file={FIXTURES / 'prompts.jsonl'}"]


def test_generate_writes_rows_that_match_plain_generate(tmp_path, cache_dir):
    import torch
    from d3d.data.chat import chat_prompt_ids
    from d3d.models import load_model, load_tokenizer, resolve_model_path

    cfg = compose("generate", LOCAL + ["generate.batch_size=4"], tmp_path)
    out = run_generate(cfg)
    rows = read_responses(out)
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(6)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["target"]["name"] == "tiny_random" and meta["settings"]["do_sample"] is False
    # Batched (left-padded) greedy rows equal unbatched greedy generation of the same prompt.
    path = resolve_model_path(bind_config(cfg, "generate").target, cache_dir)
    tok, model = load_tokenizer(path), load_model(path, "float32", "cpu")
    for row in rows[:3]:
        ids = chat_prompt_ids(tok, row["messages"])
        assert ids == row["prompt_ids"]
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        expect, _ = split_response(ref, [tok.eos_token_id], tok.pad_token_id)
        assert row["response_ids"] == expect
        assert row["finish_reason"] in ("stop", "length")


def test_resume_skips_finished_ids(tmp_path, cache_dir):
    run_generate(compose("generate", LOCAL + ["generate.limit=3"], tmp_path))
    out = run_generate(compose("generate", LOCAL, tmp_path))
    ids = [r["id"] for r in read_responses(out)]
    assert sorted(ids) == [f"p{i}" for i in range(6)] and len(ids) == len(set(ids))
    assert json.loads((out / "report.json").read_text())["ranks"]["0"]["new_rows"] == 3


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path, cache_dir):
    """SIGKILL a real CLI run after its first batch is on disk, tear its last line, re-run."""
    args = [sys.executable, "-m", "d3d.generate", *LOCAL, "generate.batch_size=1",
            "generate.max_new_tokens=64", f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    out = tmp_path / "data" / "responses" / "tiny_random" / "local"
    shard = out / "responses.rank0.jsonl"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not shard.exists() or len(list(read_jsonl(shard))) < 1):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = len(list(read_jsonl(shard)))
    assert 1 <= before
    with open(shard, "a") as f:  # a write torn by the kill
        f.write('{"id": "p9", "response": "tor')
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ids = [r["id"] for r in read_responses(out)]
    assert sorted(ids) == [f"p{i}" for i in range(6)], ids


def test_folder_from_another_target_is_refused(tmp_path, cache_dir):
    out = run_generate(compose("generate", LOCAL + ["generate.limit=1"], tmp_path))
    meta = json.loads((out / "meta.json").read_text())
    meta["target"]["name"] = "some_other_model"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OutputMismatchError, match="delete"):
        run_generate(compose("generate", LOCAL, tmp_path))


def test_changed_settings_are_refused(tmp_path, cache_dir):
    run_generate(compose("generate", LOCAL + ["generate.limit=1"], tmp_path))
    with pytest.raises(OutputMismatchError, match="settings"):
        run_generate(compose("generate", LOCAL + ["generate.max_new_tokens=8"], tmp_path))


def test_prompt_longer_than_context_fails_before_generating(tmp_path, cache_dir):
    cfg = compose("generate", LOCAL + ["generate.max_new_tokens=4000"], tmp_path)
    with pytest.raises(ConfigError, match="context"):
        run_generate(cfg)
    assert not list((tmp_path / "data" / "responses").rglob("*.jsonl"))


def test_empty_prompt_set(tmp_path, cache_dir):
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises(EmptyPromptSetError):
        run_generate(compose("generate", ["+experiment=smoke", "data=local", f"data.local_file={empty}"], tmp_path))


def test_smoke_experiment_cli(tmp_path):
    """The real CLI on the smoke experiment (offline math prompts, tiny model)."""
    proc = subprocess.run(
        [sys.executable, "-m", "d3d.generate", "+experiment=smoke", f"paths.root_dir={tmp_path}",
         f"paths.cache_dir={CACHE_DIR}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_responses(tmp_path / "data" / "responses" / "tiny_random" / "cpu_math")
    assert len(rows) == 8 and all(r["id"].startswith("train/") for r in rows)
    assert list((tmp_path / "outputs" / "generate" / "runs").glob("tiny_random-cpu_math/*/.hydra/config.yaml"))


def test_a_sampled_run_resumed_after_a_kill_writes_the_uninterrupted_rows(tmp_path, cache_dir, monkeypatch):
    """do_sample: batches are cut from the whole prompt set and each draws from its own seeded
    stream, so a run killed after its first batch and resumed gives exactly the rows of a run that
    was never interrupted (it used to redraw from wherever the process's stream stood)."""
    from d3d.models import engines

    sampled = LOCAL + ["generate.do_sample=true", "generate.batch_size=2", "generate.temperature=1.0"]
    whole = {r["id"]: r["response_ids"] for r in read_responses(run_generate(
        compose("generate", sampled + [f"generate.out_dir={tmp_path}/whole"], tmp_path)))}
    real, calls = engines.generate_batch, []

    def killed_after_one(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands in for a kill after the first batch reached the disk
        return real(*args, **kw)

    monkeypatch.setattr(engines, "generate_batch", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        run_generate(compose("generate", sampled + [f"generate.out_dir={tmp_path}/cut"], tmp_path))
    monkeypatch.setattr(engines, "generate_batch", real)
    first = {r["id"] for r in read_responses(tmp_path / "cut")}
    assert len(first) == 2
    resumed = {r["id"]: r["response_ids"] for r in read_responses(run_generate(
        compose("generate", sampled + [f"generate.out_dir={tmp_path}/cut"], tmp_path)))}
    assert resumed == whole and len(set(map(tuple, whole.values()))) > 1  # real samples, all equal


def test_another_target_under_the_same_name_is_refused(tmp_path, cache_dir):
    """Other weights (here: one more layer) or another dtype saved under the same target.name used
    to be mixed into the folder: its resume key held the name only."""
    run_generate(compose("generate", LOCAL + ["generate.limit=1"], tmp_path))
    with pytest.raises(OutputMismatchError, match=r"already holds responses with target = .*'weights'"):
        run_generate(compose("generate", LOCAL + ["generate.limit=2", "target.tiny.num_hidden_layers=3"], tmp_path))
    with pytest.raises(OutputMismatchError, match=r"'dtype': 'float32'.* but this run has target = .*'dtype': 'bfloat16'"):
        run_generate(compose("generate", LOCAL + ["generate.limit=2", "target.dtype=bfloat16"], tmp_path))
    run_generate(compose("generate", LOCAL + ["generate.limit=2"], tmp_path))  # the same target resumes


def test_a_start_that_wrote_no_row_does_not_bind_the_folder(tmp_path, cache_dir):
    """A run that failed after meta.json and before its first row (a crash in the first batch) left a
    folder that refused every rerun with other settings, though it held no response to mix."""
    import d3d.generate as g
    from d3d.models import engines

    def crash(*a, **k):
        raise RuntimeError("out of memory in the first batch")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engines, "generate_batch", crash)
        with pytest.raises(RuntimeError):
            run_generate(compose("generate", LOCAL + ["generate.max_new_tokens=8"], tmp_path))
    out = run_generate(compose("generate", LOCAL + ["generate.max_new_tokens=12"], tmp_path))
    assert json.loads((out / "meta.json").read_text())["settings"]["max_new_tokens"] == 12
    assert len(read_responses(out)) == 6
    with pytest.raises(g.OutputMismatchError):  # with rows, the folder binds as before
        run_generate(compose("generate", LOCAL + ["generate.max_new_tokens=8"], tmp_path))


# --- data parallel on the stub engine --------------------------------------------------------

# the stub stands in for vLLM: 80 new tokens, so its looping replies pass the detector's 64-token floor
STUB = LOCAL + ["generate.backend=vllm", "generate.max_new_tokens=80", "generate.batch_size=1", "generate.progress=false"]


def _answers(folder) -> dict[str, tuple]:
    return {r["id"]: (r["prompt_ids"], r["response_ids"], r["finish_reason"]) for r in read_responses(folder)}


@pytest.mark.parametrize("sampled", [False, True])
def test_two_shards_one_killed_and_resumed_equal_one_process(tmp_path, cache_dir, monkeypatch, sampled):
    """generate.shard=0/2 and 1/2 (two independent jobs, run here one after the other): each writes
    its own shard; shard 1, killed after its first row, resumes; the union is the one-process run's
    rows, and training reads both shards as one set."""
    from d3d.examples import load_examples
    from d3d.utils.io import JsonlWriter
    from tests.stub_engine import StubEngine, plan, use_stub

    use_stub(monkeypatch)
    args = STUB + (["generate.do_sample=true"] if sampled else [])
    whole = _answers(run_generate(compose("generate", args + [f"generate.out_dir={tmp_path}/one"], tmp_path)))
    split = args + [f"generate.out_dir={tmp_path}/two"]
    run_generate(compose("generate", split + ["generate.shard=0/2"], tmp_path))
    with monkeypatch.context() as m:  # shard 1 dies before writing its second row
        m.setattr(JsonlWriter, "write", kill_on(2, JsonlWriter.write))
        with pytest.raises(Killed):
            run_generate(compose("generate", split + ["generate.shard=1/2"], tmp_path))
    shards = [read_jsonl(tmp_path / "two" / f"responses.rank{r}.jsonl") for r in (0, 1)]
    first, cut = (list(rows) for rows in shards)
    assert len(first) == 3 and len(cut) == 1  # batches 0, 2, 4 and 1, 3, 5 of six one-prompt batches
    run_generate(compose("generate", split + ["generate.shard=1/2"], tmp_path))
    second = list(read_jsonl(tmp_path / "two" / "responses.rank1.jsonl"))
    assert len(second) == 3 and not {r["id"] for r in first} & {r["id"] for r in second}
    assert _answers(tmp_path / "two") == whole and len(whole) == 6
    engines_started = len(StubEngine.gpus)
    run_generate(compose("generate", split + ["generate.shard=0/2"], tmp_path))  # all answered: no engine
    assert len(StubEngine.gpus) == engines_started
    if not sampled:  # the stub's own answers (greedy ignores the seed)
        kinds = {pid: plan(p, None, 80, 2)[0] for pid, (p, _, _) in whole.items()}
        assert set(kinds.values()) == {"loop", "stop", "cut"}, kinds  # the report below has each to count
        report = json.loads((tmp_path / "two" / "report.json").read_text())
        assert (report["rows"], report["looping"], report["cut"]) == (
            6, sum(k == "loop" for k in kinds.values()), sum(k != "stop" for k in kinds.values()))
        assert sorted(report["ranks"]) == ["0", "1"] and report["ranks"]["1"]["new_rows"] == 2
    assert len(load_examples(tmp_path / "two", 384)) == 6


def test_a_launched_rank_pins_its_engine_to_its_own_gpus(tmp_path, cache_dir, monkeypatch):
    """Rank 1 of 2 on a node with GPUs 0-3 visible, tensor parallel 2: its engine sees GPUs 2,3 only,
    and not the launcher's world (vLLM would take itself for one rank of a torch.distributed job)."""
    from tests.stub_engine import StubEngine, use_stub

    use_stub(monkeypatch)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}.items():
        monkeypatch.setenv(key, value)
    out = run_generate(compose("generate", STUB + ["generate.vllm.tensor_parallel_size=2"], tmp_path))
    assert StubEngine.gpus == ["2,3"] and StubEngine.worlds == [None]
    part = json.loads((out / "report.json").read_text())["ranks"]["1"]
    assert (part["gpus"], part["source"], part["new_rows"]) == ("2,3", "launcher rank 1/2", 3)
    assert [p.name for p in out.glob("responses.rank*.jsonl")] == ["responses.rank1.jsonl"]


@pytest.mark.heavy
def test_two_torchrun_ranks_one_killed_resume_to_the_one_process_rows(tmp_path, cache_dir, monkeypatch):
    """torchrun --nproc_per_node 2 (real processes, ranks from torchrun's environment): rank 1 is
    SIGKILLed after its first row, which ends the job; the rerun resumes both ranks; the union equals
    a one-process run, each rank ran its engine on its own GPUs, training reads both shards."""
    from d3d.examples import load_examples
    from tests.stub_engine import use_stub

    use_stub(monkeypatch)
    whole = _answers(run_generate(compose("generate", STUB + [f"generate.out_dir={tmp_path}/one"], tmp_path)))
    worker = ROOT / "tests" / "multiproc" / "generate_worker.py"
    folder = tmp_path / "two"
    args = [tmp_path, *STUB, f"generate.out_dir={folder}", "generate.vllm.tensor_parallel_size=2"]
    killed = torchrun(2, worker, "--kill-rank-1-after", 1, *args)
    assert killed.returncode != 0 and len(list(read_jsonl(folder / "responses.rank1.jsonl"))) == 1, killed.stderr[-3000:]
    done = torchrun(2, worker, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = [{r["id"] for r in read_jsonl(folder / f"responses.rank{r}.jsonl")} for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 3 and not shards[0] & shards[1]
    assert _answers(folder) == whole
    report = json.loads((folder / "report.json").read_text())
    assert {k: v["gpus"] for k, v in report["ranks"].items()} == {"0": "0,1", "1": "2,3"}
    assert "in a repetition loop" in done.stdout and len(load_examples(folder, 384)) == 6


# --- an engine that starts like vLLM on a GPU node (tests/stub_engine.py, the fake `vllm`) ------------

def test_an_engine_forked_after_generate_resolved_its_target_starts(tmp_path, cache_dir, monkeypatch):
    """The fake vLLM forks its engine core (here as the user asked: VLLM_WORKER_MULTIPROC_METHOD=fork)
    and the core refuses to start if d3d.generate probed CUDA first, as vLLM's does on a GPU node.
    It used to: `target.dtype=auto` went through torch.cuda.is_available(). The rows are the stub's."""
    from tests.stub_engine import LLM, use_stub, use_stub_vllm

    probes = use_stub_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")  # the check that initialises the driver
    auto = ["target.dtype=auto", "target.device=auto"]  # as the GPU overlays' targets
    out = run_generate(compose("generate", STUB + auto + [f"generate.out_dir={tmp_path}/engine"], tmp_path))
    assert probes == [] and [(s["method"], s["detokenize"]) for s in LLM.started] == [("fork", {False})]
    use_stub(monkeypatch)  # the same replies, in this process
    assert _answers(out) == _answers(run_generate(compose(
        "generate", STUB + auto + [f"generate.out_dir={tmp_path}/stub"], tmp_path)))


@pytest.mark.heavy
def test_two_torchrun_ranks_of_the_cli_start_their_engines_as_on_a_gpu_node(tmp_path, cache_dir):
    """`torchrun --nproc_per_node 2 -m d3d.generate ... generate.backend=vllm`, the README's command,
    with the fake vLLM switched on by PYTHONPATH (tests/stub_engine.py): each rank starts its engine
    core by d3d's default (spawn), and would have been refused after a probe in a fork; the two
    shards hold the rows of one in-process run on the stub."""
    from tests.stub_engine import STUB_VLLM, use_stub

    folder = tmp_path / "two"
    auto = ["target.dtype=auto", "target.device=auto"]  # as the GPU overlays' targets
    args = [*STUB, *auto, f"generate.out_dir={folder}", f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    env = {"PYTHONPATH": os.pathsep.join([str(STUB_VLLM), *sys.path]), "CUDA_VISIBLE_DEVICES": "0,1"}
    done = torchrun(2, "d3d.generate", *args, module=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("started by spawn") == 2, done.stderr[-3000:]
    with pytest.MonkeyPatch.context() as m:
        use_stub(m)
        whole = _answers(run_generate(compose("generate", STUB + auto + [f"generate.out_dir={tmp_path}/one"],
                                              tmp_path)))
    assert _answers(folder) == whole and len(whole) == 6
    report = json.loads((folder / "report.json").read_text())
    assert {k: v["gpus"] for k, v in report["ranks"].items()} == {"0": "0", "1": "1"}


# --- the report: every lock without flock, counts kept per shard, a no-op rerun -----------------------

def test_generate_ends_without_flock(tmp_path, cache_dir, monkeypatch):
    """On a filesystem without flock (Lustre without `flock`, NFS without lockd) every run ended in
    `OSError: [Errno 37] No locks available` from report.json's lock, the one lock without the
    O_CREAT|O_EXCL fallback, and so did every rerun."""
    import errno
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    out = run_generate(compose("generate", LOCAL + ["generate.limit=2"], tmp_path))
    assert json.loads((out / "report.json").read_text())["rows"] == 2
    assert not list(out.glob("*.held"))  # every lock file went with its release


def test_the_report_counts_only_new_rows_and_a_no_op_rerun_keeps_its_throughput(tmp_path, cache_dir, monkeypatch):
    """report.json used to re-read every shard under one lock (minutes at 100k rows): now each shard's
    counts are kept beside it and only rows added since are read. The counts equal a full recount,
    also after a shard was cut under them. A rerun with nothing to answer wrote 0 tok/s over the
    run that answered."""
    import d3d.generate as g

    use_args = STUB + [f"generate.out_dir={tmp_path}/out"]
    from tests.stub_engine import use_stub

    use_stub(monkeypatch)
    run_generate(compose("generate", use_args + ["generate.limit=4"], tmp_path))
    tallied, real = [], g.tally
    monkeypatch.setattr(g, "tally", lambda rows: tallied.append(len(rows)) or real(rows))
    out = run_generate(compose("generate", use_args, tmp_path))
    assert sum(tallied) == 2 + 2  # the 2 new rows as they were written, then as the report counts them

    def recount():
        rows = read_responses(out)
        return {"rows": len(rows), **real(rows)}

    report = json.loads((out / "report.json").read_text())
    assert {k: report[k] for k in ("rows", "tokens", "cut", "looping")} == recount() and report["rows"] == 6
    speed = report["tokens_per_s"]
    assert speed > 0
    run_generate(compose("generate", use_args, tmp_path))  # nothing left to answer
    again = json.loads((out / "report.json").read_text())
    assert again["tokens_per_s"] == speed and again["ranks"] == report["ranks"]
    shard = out / "responses.rank0.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text("".join(lines[:-1]))  # a row cut from under the counts: it is answered again
    run_generate(compose("generate", use_args, tmp_path))
    final = json.loads((out / "report.json").read_text())
    assert {k: final[k] for k in ("rows", "tokens", "cut", "looping")} == recount() and final["rows"] == 6
