"""d3d.eval's warm-up: with decode.backend=compiled every shape a timed call runs (its pass widths,
batch buckets and capacity) is compiled before the first timed call, so no decode_s holds a compile.
Counted with dynamo's own counter (`counters["stats"]["unique_graphs"]`) around every timed call."""

from __future__ import annotations

import json

import pytest

import d3d.eval as ev
from d3d.decoding import SpecGenerator
from d3d.eval import run_eval
from d3d.utils.io import read_jsonl
from tests.conftest import compose, load_script

# byte-level tiny target: gsm8k prompts of ~300-600 tokens, so the real calls' capacity (1024) is not the
# 256 a short warm-up prompt gets; concurrency 3 runs in the 4-row bucket and, as rows finish, 2 and 1
RUN = ["+experiment=smoke", "eval.n=3", "eval.max_new_tokens=12", "decode.C=3", "decode.F=2", "decode.block_size=4",
       "decode.backend=compiled", "eval.concurrency=[1,3]", "eval.methods=[ar,sync,async]"]


def compiles_in_timed_calls(tmp_path, monkeypatch, run) -> tuple[list[int], dict]:
    """Run `run()`; the graphs dynamo compiled inside each SpecGenerator call made after eval's
    warm-up returned (the timed calls), and the warm-up's report."""
    from torch._dynamo.utils import counters

    timed, state = [], {"warm": False, "report": None}
    real_generate, real_warm_up = SpecGenerator.generate, ev.warm_up

    def generate(self, *args, **kw):
        before = counters["stats"]["unique_graphs"]
        out = real_generate(self, *args, **kw)
        if state["warm"]:
            timed.append(counters["stats"]["unique_graphs"] - before)
        return out

    def warm_up(*args, **kw):
        state["report"] = real_warm_up(*args, **kw)
        state["warm"] = True
        return state["report"]

    monkeypatch.setattr(SpecGenerator, "generate", generate)
    monkeypatch.setattr(ev, "warm_up", warm_up)
    run()
    return timed, state["report"]


def check_no_compile_after_warm_up(tmp_path, monkeypatch, run, methods=("ar", "sync", "async"), buckets=(1, 2, 4)):
    timed, report = compiles_in_timed_calls(tmp_path, monkeypatch, run)
    out = tmp_path / "ev"
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert timed and len(timed) == len(rows)
    assert sum(r["graphs_compiled"] for r in report.values()) > 0  # the warm-up compiled: the count can fail
    assert timed == [0] * len(timed), f"graphs compiled inside timed calls: {timed}"
    assert [r["compiles"] for r in rows] == [0] * len(rows)
    run_json = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert run_json["warmup"] == summary["warmup"] == report and set(report) == set(methods)
    assert all(r["seconds"] > 0 for r in report.values())
    # concurrency 1 and 3: buckets 1, and 4 -> 2 -> 1 as rows finish; reserves past the 256 floor
    assert all({b for b, _ in r["calls"]} == set(buckets) and min(n for _, n in r["calls"]) > 256 for r in report.values())
    assert summary["benchmarks"]["gsm8k"]["sync"]["compiles_in_timed"] == 0


def evaluate(tmp_path, monkeypatch, *extra):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return lambda: run_eval(compose("eval", RUN + [f"eval.out_dir={tmp_path}/ev", "eval.progress=false", *extra],
                                    tmp_path))


def test_compiled_eval_compiles_nothing_inside_a_timed_call(tmp_path, monkeypatch):
    """dynamo with a backend that compiles nothing (the GPU check's counting backend: it traces
    each graph, as inductor's input, and runs it as traced), so the default suite affords it."""
    count_graphs = load_script("gpu_check").count_graphs
    graphs = count_graphs(lambda: check_no_compile_after_warm_up(tmp_path, monkeypatch, evaluate(tmp_path, monkeypatch)))
    assert sum(graphs.values()) > 0


@pytest.mark.heavy  # inductor compiles each (width, bucket, capacity) graph: minutes on 2 busy cores
def test_compiled_eval_with_inductor_compiles_nothing_inside_a_timed_call(tmp_path, monkeypatch):
    """The same with inductor, on fewer shapes (ar and sync, buckets 1 and 2): each is a real compile."""
    import torch._dynamo

    torch._dynamo.reset()
    run = evaluate(tmp_path, monkeypatch, "eval.methods=[ar,sync]", "eval.concurrency=[1,2]", "eval.n=2")
    check_no_compile_after_warm_up(tmp_path, monkeypatch, run, ("ar", "sync"), (1, 2))


@pytest.mark.heavy  # five methods' graphs traced (no inductor): ~1-2 min on 2 busy cores
def test_compiled_eval_runs_trees_equal_to_ar_and_compiles_them_in_the_warm_up(tmp_path, monkeypatch):
    """decode.backend=compiled with every method, trees included (their accepted path's slots moved in
    the static buffers between compiled passes): every row's greedy tokens equal AR's, and the warm-up
    traces the trees' shapes too (none inside a timed call). The counting backend, as above."""
    count_graphs = load_script("gpu_check").count_graphs
    methods = ("ar", "sync", "async", "tree", "async_tree")
    run = evaluate(tmp_path, monkeypatch, f"eval.methods=[{','.join(methods)}]", "methods.tree.tree_nodes=5",
                   "methods.async_tree.tree_nodes=5", "methods.async_tree.tree_trays=4")
    graphs = count_graphs(lambda: check_no_compile_after_warm_up(tmp_path, monkeypatch, run, methods))
    assert sum(graphs.values()) > 0
    rows = list(read_jsonl(tmp_path / "ev" / "rows.jsonl"))
    assert {r["method"] for r in rows} == set(methods) and all(r["equal_to_ar"] for r in rows)
