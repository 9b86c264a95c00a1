"""d3d.bench's engine rows without vLLM: the summary (acceptance per position beside d3d's prediction,
equality with the engine's own baseline), the refusals before any model loads, what each bench.engine
key reaches, and a row vLLM cannot run kept with its reason."""

from __future__ import annotations

import json
import subprocess

import pytest

from d3d import bench_engines
from d3d.bench import bind_bench, summary_markdown
from d3d.bench_engines import EngineSettings, check_engines, engine_summary, engines_markdown, run_engines
from d3d.errors import ConfigError
from tests.conftest import compose

PROFILE = {"num_speculative_tokens": 3, "cumulative": [0.9, 0.5, 0.2], "conditional": [0.9, 0.5 / 0.9, 0.4],
           "mean_acceptance_length": 2.6, "steps": 40, "measured_on": "held-out responses"}


def results():
    plain = [[1, 2, 3, 9], [4, 5, 6], [7, 8]]
    return {
        "vllm": {"speculative_config": None, "outputs": plain, "wall_s": 2.0, "tokens_per_s": 4.5, "metrics": {},
                 "version": "0.32.0", "startup_s": 10.0, "warmup_s": 1.0, "prediction": None},
        "vllm_ngram": {"speculative_config": {"method": "ngram"}, "unavailable": "ValueError: no n-gram here",
                       "prediction": None},
        # 10 steps of 3 drafts: 8 accepted the first, 5 the first two, 2 all three -> 15 accepted
        "vllm_d3d": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3},
                     "outputs": [[1, 2, 3, 9], [4, 5, 0], [7, 8]], "wall_s": 1.0, "tokens_per_s": 9.0,
                     "metrics": {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 15,
                                 "num_accepted_tokens_per_pos": [8, 5, 2]},
                     "prediction": PROFILE},
    }


def test_the_engines_acceptance_per_position_stands_beside_d3ds_prediction():
    reference = [[1, 2, 3, 9], [4, 5, 6], [7, 7]]  # the bench's generate row: differs from the engine on prompt 2
    s = engine_summary(results(), reference, "generate")
    rows = {e["row"]: e for e in s["rows"]}
    assert s["baseline"] == "vllm" and list(rows) == ["vllm", "vllm_ngram", "vllm_d3d"]
    d3d = rows["vllm_d3d"]
    assert d3d["acceptance"]["cumulative"] == pytest.approx([0.8, 0.5, 0.2])
    assert d3d["acceptance"]["conditional"] == pytest.approx([0.8, 5 / 8, 2 / 5])
    # vLLM's mean acceptance length is 1 + accepted / drafts: 1 + Σ cumulative, d3d.acceptance's identity
    assert d3d["acceptance"]["mean_acceptance_length"] == pytest.approx(1 + sum(d3d["acceptance"]["cumulative"]))
    assert d3d["predicted"]["cumulative"] == PROFILE["cumulative"] and d3d["predicted"]["mean_acceptance_length"] == 2.6
    assert d3d["equal_rate"] == pytest.approx(2 / 3) and d3d["equal_to_reference_rate"] == pytest.approx(1 / 3)
    assert d3d["x_vllm"] == pytest.approx(2.0) and d3d["new_tokens"] == 9
    assert rows["vllm"]["equal_rate"] == 1.0 and rows["vllm"]["acceptance"] is None
    assert rows["vllm_ngram"] == {"row": "vllm_ngram", "speculative_config": {"method": "ngram"},
                                  "unavailable": "ValueError: no n-gram here"}
    text = "\n".join(engines_markdown(s))
    assert "all 3 prompts submitted at once to the engine's scheduler (continuous batching)" in text
    assert "| vllm_d3d | 10 | 0.80 0.50 0.20 | 0.80 0.62 0.40 | 0.90 0.50 0.20 | 0.90 0.56 0.40 | 2.60 |" in text
    assert "| vllm_ngram | {\"method\": \"ngram\"} | unavailable: ValueError: no n-gram here |" in text
    assert "| vllm_d3d | {\"method\": \"draft_model\", \"num_speculative_tokens\": 3} | 9.0 | 2.00 | 0.67 (3 prompts) | 0.33 " in text
    # the bench's summary.md carries them after d3d's own table
    bench = {"baselines": ["generate"], "prompts": 3, "methods": [], "engines": s}
    assert summary_markdown(bench).endswith(text)


def vllm_here(monkeypatch, present: bool):
    """check_engines as if vLLM were (or were not) installed in this environment."""
    real = bench_engines.importlib.util.find_spec
    monkeypatch.setattr(bench_engines.importlib.util, "find_spec",
                        lambda name: (object() if present else None) if name == "vllm" else real(name))


@pytest.fixture
def with_vllm(monkeypatch):
    vllm_here(monkeypatch, True)


def settings(export=None):
    return EngineSettings(export=export, options={"enforce_eager": True}, env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def test_the_preset_binds_and_refuses_a_bench_without_vllm_before_any_model_loads(tmp_path, monkeypatch):
    vllm_here(monkeypatch, False)
    cfg, _ = bind_bench(compose("bench", ["bench=engines"], tmp_path))
    assert cfg.bench.engines == {"vllm": None, "vllm_ngram": {"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4}, "vllm_d3d": "export"}
    with pytest.raises(ConfigError, match=r"vLLM is not installed in this environment .* Fix: run the bench with"):
        check_engines(cfg.bench.engines, cfg.bench.engine, cfg.bench.methods)


@pytest.mark.parametrize("rows,export,match", [
    ({"vllm_ngram": {"method": "ngram"}}, None, r"no row without speculation.*Fix: add one"),
    ({"vllm": None, "x": "eagle"}, None, r"bench.engines.x='eagle': a row is null"),
    ({"vllm": None, "x": {"num_speculative_tokens": 4}}, None, r"bench.engines.x=.*with a method"),
    ({"vllm": None, "d": "export"}, None, r"bench.engine.export: unset"),
    ({"vllm": None, "d": "export"}, "nowhere", r"bench.engine.export=nowhere: no speculative_config.json"),
    ({"tree": None}, None, r"bench.engines.tree: a d3d row of the bench has that name"),
])
def test_bad_engine_rows_fail_in_one_line(rows, export, match, with_vllm):
    with pytest.raises(ConfigError, match=match):
        check_engines(rows, settings(export), ["generate", "tree"])


def test_each_engine_key_reaches_the_rows_process_and_a_dead_one_is_kept_with_its_reason(tmp_path, monkeypatch):
    export = tmp_path / "served"
    export.mkdir()
    (export / "speculative_config.json").write_text(json.dumps(
        {"method": "draft_model", "model": "/where/it/was", "num_speculative_tokens": 3, "parallel_drafting": True}))
    (export / "speculation_profile.json").write_text(json.dumps(PROFILE))
    seen = {}

    def fake_run(args, env, **kw):
        job = json.loads(open(args[-2]).read())
        seen[job["speculative_config"] and job["speculative_config"]["method"]] = (job, env)
        if job["speculative_config"] is None:  # the baseline's process answers; the other one dies without a word
            open(args[-1], "w").write(json.dumps({"outputs": [[1]], "wall_s": 1.0, "tokens_per_s": 1.0}))
            return subprocess.CompletedProcess(args, 0, "", "")
        return subprocess.CompletedProcess(args, -9, "", "starting\nKilled: out of memory\n")

    monkeypatch.setattr(bench_engines.subprocess, "run", fake_run)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = settings(str(export))
    out = run_engines({"vllm": None, "vllm_d3d": "export"}, engine, "/target", "float32", [[5, 6]], [7], 8, [2],
                      tmp_path / "out")
    job, env = seen["draft_model"]
    assert job["speculative_config"]["model"] == str(export)  # the folder as it lies now, not where it was exported
    assert job["options"] == {"enforce_eager": True} and job["stop_ids"] == [2] and job["max_new_tokens"] == 8
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert out["vllm_d3d"]["prediction"] == PROFILE and out["vllm"]["prediction"] is None
    assert out["vllm_d3d"]["unavailable"] == "the engine's process exited with -9: Killed: out of memory"
    assert out["vllm"]["outputs"] == [[1]]
