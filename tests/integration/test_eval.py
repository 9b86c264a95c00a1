"""d3d.eval end to end on the smoke setup: rows, MT-Bench turns, resume, summary from rows."""

from __future__ import annotations

import json

import pytest

from d3d.decoding.methods import method_row
from d3d.eval import read_settings, run_eval
from d3d.report import compare_markdown, main as report_main, methods_info, read_rows, summarise
from d3d.utils.io import read_jsonl
from d3d.settings import bind_config
from tests.conftest import compose

SMOKE = ["+experiment=smoke", "eval.n=2", "eval.max_new_tokens=12", "decode.C=3", "decode.F=2", "decode.block_size=4"]


def methods_of(cfg):
    """Each method's decode config, as d3d.eval builds them from a composed config."""
    from d3d.settings import method_configs

    return method_configs(cfg, bind_config(cfg, "eval").eval)


def evaluate(tmp_path, *extra):
    cfg = compose("eval", SMOKE + [f"eval.out_dir={tmp_path}/ev", *extra], tmp_path)
    return run_eval(cfg)


def test_eval_gsm8k_and_mt_bench_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "benchmark=all")
    rows = list(read_jsonl(out / "rows.jsonl"))
    benches = {r["benchmark"] for r in rows}
    assert benches == {"gsm8k", "math500", "aime25", "humaneval", "mt_bench"}  # mbpp, livecodebench skipped
    mt = [r for r in rows if r["benchmark"] == "mt_bench"]
    assert {r["turn"] for r in mt} == {0, 1} and len(mt) == 2 * 2 * 3
    assert all(r["equal_to_ar"] for r in rows)  # greedy: every method returns the AR tokens
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["gsm8k"]["ar"]["speedup_token_weighted"] == pytest.approx(1.0)
    assert summary["benchmarks"] == json.loads(json.dumps(summarise(rows, methods_info(out))["benchmarks"]))
    for method in ("sync", "async"):  # the acceptance views of real rows: B - 1 positions, 1 + Σ cumulative = τ
        views = summary["benchmarks"]["gsm8k"][method]
        assert len(views["acceptance"]["cumulative"]) == 3
        assert 1 + sum(views["acceptance"]["cumulative"]) == pytest.approx(views["tau_token_weighted"])
        assert views["tau_per_request"]["requests"] == 2 and views["tau_by_context"]
    assert "| gsm8k | async |" in (out / "summary.md").read_text()
    # task-level check: graded where cheap (math, code), ungraded MT-Bench, same verdicts as AR
    graded = [r for r in rows if r["benchmark"] in ("gsm8k", "humaneval")]
    assert all(isinstance(r["correct"], bool) for r in graded)
    assert all(r["correct"] is None for r in mt)
    assert all(r["task_equal_to_ar"] in (True, None) for r in rows)
    assert {p.name for p in out.glob("*.png")} >= {"speedup_tau.png", "tau_histogram.png", "acceptance.png"}


def test_resume_skips_finished_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.n=1")
    first = list(read_jsonl(out / "rows.jsonl"))
    out = evaluate(tmp_path, "eval.n=2")
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert rows[: len(first)] == first and len(rows) == 2 * len(first)
    assert len({(r["id"], r["method"]) for r in rows}) == len(rows)
    # other settings in the same folder would mix incomparable rows: refused, naming what differs
    from d3d.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_new_tokens, methods\.async\.block_size, methods\.sync\.block_size differ.*new eval.out_dir"):
        evaluate(tmp_path, "eval.n=2", "eval.max_new_tokens=10", "decode.block_size=3")
    assert list(read_jsonl(out / "rows.jsonl")) == rows  # nothing lost or added


def test_resume_refuses_a_drafter_retrained_in_place(tmp_path, monkeypatch):
    """Same checkpoint path, other weights (a rerun of d3d.train into the same folder): refused."""
    import torch

    from d3d.errors import ConfigError
    from d3d.models.drafter import build_drafter, load_drafter, save_drafter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("eval", SMOKE, tmp_path), "eval")
    folder = save_drafter(*build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32"), tmp_path / "d")
    evaluate(tmp_path, "eval.n=1", f"drafter.checkpoint={folder}", "eval.methods=[ar,sync]")
    model, tok = load_drafter(folder, dtype="float32")
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    save_drafter(model, tok, folder)
    with pytest.raises(ConfigError, match=r"\(drafter_weights differ\)"):
        evaluate(tmp_path, "eval.n=1", f"drafter.checkpoint={folder}", "eval.methods=[ar,sync]")


def test_eval_cli_writes_into_its_run_folder(tmp_path):
    import subprocess
    import sys

    from tests.conftest import CACHE_DIR, ROOT

    proc = subprocess.run([sys.executable, "-m", "d3d.eval", *SMOKE, "eval.n=1", f"paths.root_dir={tmp_path}",
                           f"paths.cache_dir={CACHE_DIR}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "eval" / "runs").glob("*/*/summary.md"))
    assert len(runs) == 1 and "| gsm8k | ar |" in runs[0].read_text()
    # Hydra's folder is new each run, so a rerun never resumes it: the start message says how to
    assert f"a new folder for each run: a killed run resumes only if rerun with eval.out_dir={runs[0].parent}" in proc.stdout


def test_load_test_and_budget_study(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.n=4", "eval.concurrency=[1,2]", "eval.async_budgets=[2x1,3x2]")
    rows = read_rows(out)
    assert {r["method"] for r in rows} == {"ar", "sync", "async_c2_f1", "async_c3_f2"}
    batched = [r for r in rows if r["concurrency"] == 2]
    assert len(batched) == 2 * 4 and all(len(r["token_ids"]) == 2 for r in batched)
    assert all(r["equal_to_ar"] for r in rows)
    ar = [r for r in batched if r["method"] == "ar"]
    assert all(r["rounds"] == r["new_tokens"] for r in ar)  # AR: one token per request-round
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["load"]) == {"1", "2"}
    assert summary["load"]["2"]["ar"]["speedup_token_weighted"] == pytest.approx(1.0)
    assert {"budget.png", "load.png"} <= set(summary["plots"])
    assert "Load test" in (out / "summary.md").read_text()


def test_also_drafters_run_every_speculative_method_again_beside_the_first(tmp_path, monkeypatch):
    """eval.also_drafters.other=<folder>: sync and async run with that drafter too, as rows sync@other and
    async@other on the same items, lossless, and async@other is compared with sync@other (its own
    drafter's loop: τ per round equal in fp32), not with the first drafter's sync. Changing that
    drafter's weights refuses a resume; a missing folder is one line before any model loads."""
    import torch

    from d3d.errors import ConfigError
    from d3d.models.drafter import build_drafter, load_drafter, save_drafter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("eval", SMOKE, tmp_path), "eval")
    first = save_drafter(*build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32"), tmp_path / "d1")
    model, tok = load_drafter(first, dtype="float32")
    with torch.no_grad():  # a drafter that always drafts token 0 (all logits tie): τ 1 where the first's is not
        model.get_output_embeddings().weight.zero_()
    other = save_drafter(model, tok, tmp_path / "d2")
    args = [f"drafter.checkpoint={first}", f"+eval.also_drafters.other={other}", "eval.methods=[ar,sync,async]",
            "eval.async_budgets=[2x1]"]
    rows = read_rows(evaluate(tmp_path, *args))
    by = {m: [r for r in rows if r["method"] == m] for m in {r["method"] for r in rows}}
    assert set(by) == {"ar", "sync", "async_c2_f1", "sync@other", "async_c2_f1@other"}
    assert all(r["equal_to_ar"] for r in rows)
    assert [r["taus"] for r in by["sync@other"]] != [r["taus"] for r in by["sync"]]  # another drafter drafted
    assert [r.get("equal_to_sync") for r in by["async_c2_f1@other"]] == [True, True]
    run = json.loads((tmp_path / "ev" / "run.json").read_text())
    assert run["methods"]["sync@other"]["drafter"] == str(other)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    save_drafter(model, tok, other)
    with pytest.raises(ConfigError, match=r"also_drafters\.other\.drafter_weights"):
        evaluate(tmp_path, *args)
    with pytest.raises(ConfigError, match="nowhere"):
        evaluate(tmp_path, "+eval.also_drafters.x=" + str(tmp_path / "nowhere"))


@pytest.mark.parametrize("nodes", [5, 3])
def test_async_tree_rows_are_compared_with_the_tree_rows(tmp_path, monkeypatch, nodes):
    """eval.methods=[ar,tree,async_tree]: the async tree is its tree plus trays, so its greedy fp32
    rows equal the tree's in tokens and τ per round (`equal_to_sync`), when both grow trees of the
    same size; with another tree_nodes there is nothing to compare (None, not a false "unequal").
    The C x F budget study is async's: it leaves the async tree one method."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.methods=[ar,tree,async_tree]", "eval.async_budgets=[2x1]",
                   "methods.tree.tree_nodes=5", f"methods.async_tree.tree_nodes={nodes}", "methods.async_tree.tree_trays=4")
    rows = read_rows(out)
    assert {r["method"] for r in rows} == {"ar", "tree", "async_tree"} and all(r["equal_to_ar"] for r in rows)
    compared = [r.get("equal_to_sync") for r in rows if r["method"] == "async_tree"]
    assert compared == ([True] * 2 if nodes == 5 else [None] * 2)
    assert all(r.get("sync_compared") == "tokens and tau" for r in rows if r["method"] == "async_tree" and nodes == 5)


def test_compare_two_result_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = evaluate(tmp_path, "eval.n=1", "eval.methods=[ar,sync]")
    b = run_eval(compose("eval", SMOKE + [f"eval.out_dir={tmp_path}/ev2", "eval.n=1", "eval.methods=[ar,sync]",
                                          "decode.block_size=2"], tmp_path))
    table = compare_markdown([a, b], ["B4", "B2"])
    assert "| gsm8k | sync |" in table and "B4 speedup" in table and "B2 τ" in table
    report_main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp.md")])
    assert (tmp_path / "cmp.md").read_text() == compare_markdown([a, b], None)
    assert "| gsm8k | sync |" in capsys.readouterr().out


def test_unknown_method_and_bad_budget_are_named(tmp_path):
    from d3d.errors import ConfigError

    with pytest.raises(ConfigError, match="conf/decode/fast.yaml"):
        methods_of(compose("eval", SMOKE + ["eval.methods=[ar,fast]"], tmp_path))
    with pytest.raises(ConfigError, match="write CxF"):
        methods_of(compose("eval", SMOKE + ["eval.async_budgets=[8by2]"], tmp_path))


def test_a_budget_entry_sets_the_tray_knobs_of_the_methods_it_fits(tmp_path):
    """eval.async_budgets entries are the values of a Drafts kind's tray knobs joined by x: 2x1 sets
    the chain's C and F, 8 the tree's tree_trays; neither touches the other's method, nor sync."""
    methods = methods_of(compose("eval", SMOKE + ["eval.methods=[ar,sync,async,async_tree]",
                                                   "eval.async_budgets=[2x1,8]"], tmp_path))
    assert list(methods) == ["ar", "sync", "async_c2_f1", "async_tree_tree_trays8"]
    assert (methods["async_c2_f1"].C, methods["async_c2_f1"].F) == (2, 1)
    assert methods["async_tree_tree_trays8"].tree_trays == 8 and methods["async_tree_tree_trays8"].method == "async_tree"


@pytest.mark.slow
def test_accelerate_two_processes_split_and_merge(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import CACHE_DIR, ROOT, free_port

    # torchrun starts two real processes (gloo); `accelerate launch --cpu --num_processes 2` starts one here.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "d3d.eval",
           *SMOKE, "eval.n=3", "eval.methods=[ar,sync]", f"eval.out_dir={tmp_path}/ev", f"paths.root_dir={tmp_path}",
           f"paths.cache_dir={CACHE_DIR}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "ev").glob("rows*.jsonl"))
    assert shards == ["rows.rank0.jsonl", "rows.rank1.jsonl"]
    rows = read_rows(tmp_path / "ev")
    assert len({r["id"] for r in rows if r["benchmark"] == "gsm8k"}) == 3  # every item once, none twice
    assert len(rows) == len({(r["benchmark"], r["id"], r["turn"], r["method"]) for r in rows})
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["benchmarks"]["gsm8k"]["sync"]["rows"] == 3


def test_hub_only_loaders_end_to_end_on_fixtures(tmp_path, monkeypatch):
    from tests.conftest import FIXTURES

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = []
    for name in ("mbpp", "livecodebench", "alpaca"):
        local += [f"benchmark.specs.{name}.local_file={FIXTURES / (name + '.jsonl')}", f"benchmark.specs.{name}.sources=[local]"]
    out = evaluate(tmp_path, "benchmark=all_plus", "benchmark.suite=[mbpp,livecodebench,alpaca]", "eval.methods=[ar,sync]",
                   *local)
    rows = read_rows(out)
    assert {r["benchmark"] for r in rows} == {"mbpp", "livecodebench", "alpaca"}
    assert all(isinstance(r["correct"], bool) for r in rows if r["benchmark"] == "mbpp")  # tests executed
    assert all(r["correct"] is None for r in rows if r["benchmark"] != "mbpp")
    assert all(r["equal_to_ar"] for r in rows)


def test_methods_share_sampling_and_block_size(tmp_path):
    """One eval run compares like with like: the composed decode group's sampling reaches every method
    (AR too) and its block size every speculative method, whichever group was composed."""

    for group in ["async", "sync"]:
        cfg = compose("eval", ["+experiment=smoke", f"decode={group}", "decode.block_size=4", "decode.temperature=1.0",
                               "decode.top_p=0.9", "decode.top_k=7"], tmp_path)
        methods = methods_of(cfg)
        assert [m.method for m in methods.values()] == ["ar", "sync", "async"]
        for dc in methods.values():
            assert (dc.temperature, dc.top_p, dc.top_k) == (1.0, 0.9, 7)
        assert method_row("ar").block_size(methods["ar"]) == 1  # the block AR runs, whatever B is lent
        assert methods["sync"].block_size == methods["async"].block_size == 4
    # method-specific keys stay with their own method: C and F set on the composed async group only
    methods = methods_of(compose("eval", ["+experiment=smoke", "decode.C=3", "decode.F=1"], tmp_path))
    assert (methods["async"].C, methods["async"].F) == (3, 1)
    # sync reads no tray keys (its class's `keys`): no packed budget, and its record holds none
    assert method_row("sync").budget(methods["sync"]) == 0 and not {"C", "F"} & set(read_settings(methods["sync"]))
    # an AR group lends sampling, not its B = 1
    methods = methods_of(compose("eval", ["+experiment=smoke", "decode=ar", "decode.temperature=1.0"], tmp_path))
    assert methods["sync"].block_size == 16 and methods["sync"].temperature == 1.0


def test_sampled_eval_resumed_gives_the_rows_of_an_uninterrupted_run(tmp_path, monkeypatch):
    """T = 1: every row draws from its own stream, so a run grown (or resumed) item by item samples
    exactly what one uninterrupted run samples (before: one stream per process, most rows differed)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sampled = SMOKE + ["decode.temperature=1", "eval.methods=[ar,sync]"]

    def run(folder, n):
        return run_eval(compose("eval", sampled + [f"eval.out_dir={tmp_path}/{folder}", f"eval.n={n}"], tmp_path))

    tokens = lambda out: {(r["id"], r["method"]): r["token_ids"] for r in read_rows(out)}
    whole = tokens(run("whole", 2))
    run("grown", 1)
    grown = tokens(run("grown", 2))
    assert len(whole) == 4 and grown == whole


@pytest.mark.parametrize("change", ["benchmark.specs.gsm8k.template='Q: {question}'", "eval.exec_timeout_s=3",
                                    "benchmark.specs.gsm8k.seed=1"])
def test_resume_refuses_a_changed_template_subset_or_timeout(tmp_path, monkeypatch, change):
    """Each changes a prompt, the items or a verdict: resuming would mix old and new rows in one summary."""
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    evaluate(tmp_path, "eval.n=1", "eval.methods=[ar]")
    key = change.split("=")[0].replace("benchmark.specs.", "benchmarks.").replace("eval.", "")
    with pytest.raises(ConfigError, match=rf"\({key} differ\)"):
        evaluate(tmp_path, "eval.n=1", "eval.methods=[ar]", change)


def test_eval_settings_are_checked_before_any_model_loads(tmp_path, monkeypatch):
    """Before: eval.max_new_tokens=0 wrote empty rows; decode.top_p=0 crashed mid-run."""
    import d3d.eval
    from d3d.errors import ConfigError

    monkeypatch.setattr(d3d.eval, "load_models", lambda *a: pytest.fail("models loaded before the check"))
    for bad, message in [("eval.max_new_tokens=0", "eval.max_new_tokens=0: an integer >= 1"),
                         ("decode.top_p=0", r"decode.top_p=0(\.0)?: a number in \(0, 1\]"),
                         ("decode.block_size=0", "decode.block_size=0"), ("eval.n=0", "eval.n=0")]:
        with pytest.raises(ConfigError, match=message):
            evaluate(tmp_path, bad)


@pytest.mark.parametrize("bad, message", [
    # 256 x (255 x 8 + 2) = 522752 tray tokens: a mask of ~1 TiB, so refused on any machine
    (["decode.block_size=256", "decode.C=256", "decode.F=8"],
     r"^decode.block_size=256 decode.C=256 decode.F=8 \(method async, batch 1\): the drafter's widest pass runs "
     r"522752 tokens .* Fix: lower decode.C or decode.F"),
    (["decode.F=300"], r"^decode.F=300 \(method async\): .* at most 259"),  # crashed in topk after loading
])
def test_a_pass_the_device_cannot_hold_is_refused_before_any_model_loads(tmp_path, monkeypatch, bad, message):
    """The packed pass had no bound: `decode.block_size=256 decode.C=256` passed validation and built a
    17 GB mask at toy size; F above the vocabulary failed after the models loaded."""
    import d3d.eval
    from d3d.errors import ConfigError

    monkeypatch.setattr(d3d.eval, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    with pytest.raises(ConfigError, match=message):
        evaluate(tmp_path, *bad)


@pytest.mark.parametrize("local, match", [
    ("typo.jsonl", r"benchmark.specs.gsm8k.local_file=.*typo.jsonl: .* is not a file"),  # used to run the shipped data
    ("broken.jsonl", r"broken.jsonl:2 is not JSON"),  # a traceback after the models loaded
    ("renamed.jsonl", r"renamed.jsonl:1: as a gsm8k item this row needs the field 'question'"),
])
def test_benchmark_files_are_checked_before_any_model_loads(tmp_path, monkeypatch, local, match):
    import d3d.eval
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "answer": "1"}\n{"question": \n')
    (tmp_path / "renamed.jsonl").write_text('{"q": "a", "answer": "1"}\n')
    monkeypatch.setattr(d3d.eval, "load_models", lambda *a: pytest.fail("models loaded before the check"))
    with pytest.raises(ConfigError, match=match):
        evaluate(tmp_path, "benchmark=gsm8k", f"benchmark.specs.gsm8k.local_file={tmp_path / local}")


def test_nothing_to_run_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    """Every benchmark unavailable here: the models used to load, then "holds no rows" as a traceback."""
    import d3d.eval
    from d3d.errors import UserError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(d3d.eval, "load_models", lambda *a: pytest.fail("models loaded with nothing to run"))
    with pytest.raises(UserError, match=r"no benchmark of this run can be read here \(mbpp: .*\. Fix: set benchmark"):
        evaluate(tmp_path, "benchmark=mbpp")


def test_the_targets_own_folder_as_drafter_is_one_line_with_the_fix(tmp_path):
    """A plain HF model (no config.d3d) given as the drafter: a ValueError traceback before."""
    from d3d.errors import ConfigError
    from d3d.models import resolve_model_path
    from d3d.settings import bind_config

    cfg = bind_config(compose("eval", SMOKE, tmp_path), "eval")
    target = resolve_model_path(cfg.target, cfg.paths.cache_dir)
    with pytest.raises(ConfigError, match=r"is a plain model \(its config.json has no d3d settings\), not a d3d drafter\. Fix"):
        evaluate(tmp_path, f"drafter.checkpoint={target}")


def test_a_sandbox_that_cannot_run_here_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """Where bwrap is missing, grading code stops in one line naming the fix (eval.sandbox=bwrap)."""
    import shutil

    import d3d.eval
    import d3d.grading.sandbox
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real(name, *a, **k))
    monkeypatch.setattr(d3d.eval, "load_models", lambda *a, **k: pytest.fail("the models loaded"))
    d3d.grading.sandbox.isolation.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"eval.sandbox=bwrap: graded code cannot be sandboxed here \(bwrap not "
                                              r"found\)\. Fix: install bubblewrap"):
            evaluate(tmp_path, "benchmark=humaneval", "eval.n=1", "eval.methods=[ar]")
    finally:
        d3d.grading.sandbox.isolation.cache_clear()


def test_run_json_records_the_graders_sandbox_and_the_unsafe_mode_warns(tmp_path, monkeypatch, capsys):
    """Nothing recorded which protections graded code had; eval.sandbox=unsafe_subprocess (no
    sandbox, by its name) is recorded in run.json and said in one line."""
    from d3d.grading.sandbox import isolation

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "benchmark=humaneval", "eval.n=1", "eval.methods=[ar]", "eval.sandbox=unsafe_subprocess")
    assert json.loads((out / "run.json").read_text())["grading"] == json.loads(json.dumps(isolation("unsafe_subprocess")))
    assert json.loads((out / "summary.json").read_text())["config"]["eval"]["sandbox"] == "unsafe_subprocess"
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning: eval.sandbox=unsafe_subprocess" in line]
    assert len(warnings) == 1 and "unsandboxed" in warnings[0]


def test_a_run_folder_given_as_drafter_names_its_final(tmp_path):
    from d3d.errors import ConfigError

    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"is a run folder, not a drafter. Fix: drafter.checkpoint={tmp_path}/run/final"):
        evaluate(tmp_path, f"drafter.checkpoint={tmp_path}/run")
    with pytest.raises(ConfigError, match="does not exist"):
        evaluate(tmp_path, f"drafter.checkpoint={tmp_path}/nowhere")


def test_cli_user_error_is_one_line_and_exit_2_traceback_when_verbose(tmp_path):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "d3d.eval", "+experiment=smoke", "decode.block_size=0", f"eval.out_dir={tmp_path}/ev",
           f"paths.root_dir={tmp_path}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 2
    assert quiet.stderr.strip().splitlines()[-1].startswith("error: decode.block_size=0: an integer in [2, 256]")
    assert "Traceback" not in quiet.stderr
    loud = subprocess.run(cmd, capture_output=True, text=True, env={**env, "HYDRA_FULL_ERROR": "1"}, timeout=300)
    assert loud.returncode != 0 and "Traceback" in loud.stderr


def test_a_new_method_is_placed_by_its_class_not_by_its_name(tmp_path, monkeypatch):
    """Eval asks a method's class (d3d.decoding.methods), never its name: a method registered under a
    new name and composed by Hydra under `methods` is bound with the keys its class declares and
    lent the run's values of those it reads. A drafter-free method that verifies no block borrows
    sampling only; one that verifies blocks (prompt lookup, say) the block size too; an Async
    subclass both, and the budget grid."""
    from d3d.errors import ConfigError
    from d3d.decoding.drafts import Chain, NoDrafts
    from d3d.decoding.methods import METHODS, Method
    from d3d.decoding.schedules import AR, Async, Schedule

    monkeypatch.setitem(METHODS, "plain", Method(NoDrafts, type("Plain", (AR,), {})))
    monkeypatch.setitem(METHODS, "lookup", Method(Chain, type("Lookup", (Schedule,), {"needs_drafter": False})))
    monkeypatch.setitem(METHODS, "trays", Method(Chain, type("Trays", (Async,), {})))
    new = ["+methods.plain={method: plain}", "+methods.lookup={method: lookup, block_size: 8}",
           "+methods.trays={method: trays, block_size: 16, C: 3, F: 1}"]
    cfg = compose("eval", ["+experiment=smoke", "decode=sync", "decode.block_size=4", "decode.temperature=1.0", *new,
                           "eval.methods=[ar,plain,lookup,trays]", "eval.async_budgets=[2x1,3x2]"], tmp_path)
    methods = methods_of(cfg)
    assert list(methods) == ["ar", "plain", "lookup", "trays_c2_f1", "trays_c3_f2"]
    assert methods["plain"].temperature == 1.0 and set(read_settings(methods["plain"])) == set(read_settings(methods["ar"]))
    assert (methods["lookup"].block_size, methods["lookup"].temperature) == (4, 1.0)
    assert all(methods[n].block_size == 4 and methods[n].temperature == 1.0 for n in ("trays_c2_f1", "trays_c3_f2"))
    assert (methods["trays_c3_f2"].C, methods["trays_c3_f2"].F) == (3, 2)
    # what its class does not declare, its file cannot hold
    cfg = compose("eval", ["+experiment=smoke", "+methods.plain={method: plain, block_size: 4}", "eval.methods=[ar,plain]"],
                  tmp_path)
    with pytest.raises(ConfigError, match=r"methods\.plain\.block_size: method plain does not read it"):
        methods_of(cfg)


@pytest.mark.parametrize("trays", [True, False])
def test_auto_budget_is_chosen_on_this_device_and_kept_on_resume(tmp_path, monkeypatch, trays):
    """eval.async_budgets=[auto, 2x1]: the auto method gets the budget d3d.decoding.budget picks
    (recorded in run.json with its table), or runs as sync when no budget beats sync (on a CPU),
    sits beside the grid it is compared with, and a resumed run keeps the recorded choice instead
    of re-timing (its rows must not mix two budgets). Which way the choice goes on the tiny model
    depends on this machine's timings, so both ways are forced."""
    import d3d.decoding.budget as budget
    from d3d.decoding.drafts import Chain

    real_choose = budget.choose

    def forced(costs, hits, tau, overlap, knobs):
        choice = real_choose(costs, hits, tau, overlap, knobs)
        choice.trays, choice.why = trays, choice.why if trays else "no trays: forced by the test"
        return choice

    monkeypatch.setattr(budget, "choose", forced)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.n=1", "eval.auto_budget_prompts=2", "eval.async_budgets=[auto,2x1]")
    run = json.loads((out / "run.json").read_text())
    choice = run["auto_budget"]["async_auto"]
    assert len(choice["table"]) == len(Chain.tray_grid) and choice["rounds"] > 0
    best = max(choice["table"], key=lambda r: r["projected_speedup"])
    assert (best["C"], best["F"]) == (choice["C"], choice["F"])
    if choice["trays"]:
        assert (run["methods"]["async_auto"]["C"], run["methods"]["async_auto"]["F"]) == (best["C"], best["F"])
    else:  # sync projected at least as fast (a CPU cannot overlap the packed pass): no trays, said why
        assert run["methods"]["async_auto"]["method"] == "sync" and "C" not in run["methods"]["async_auto"]
        assert "no trays" in (out / "summary.md").read_text()
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert {r["method"] for r in rows} == {"ar", "sync", "async_auto", "async_c2_f1"}
    assert all(r["equal_to_ar"] for r in rows)

    def must_not_run(*a, **k):
        raise AssertionError("a resumed run re-timed the budget")

    monkeypatch.setattr(budget, "choose", must_not_run)
    out = evaluate(tmp_path, "eval.n=2", "eval.auto_budget_prompts=2", "eval.async_budgets=[auto,2x1]")
    again = json.loads((out / "run.json").read_text())
    assert again["auto_budget"]["async_auto"] == choice and again["methods"]["async_auto"] == run["methods"]["async_auto"]


def test_async_measures_its_budget_unless_given_and_each_row_says_which(tmp_path, monkeypatch):
    """With nothing said, async's tray budget is measured here (the decode file's null knobs) and
    its rows say so; a given budget and a block other than the drafter's trained one are stated
    choices, in the rows, run.json's notes and summary.md."""
    import d3d.decoding.budget as budget

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the choice's plumbing, not its timings (test_auto_budget_is_chosen_on_this_device_and_kept_on_resume
    # times them): equal pass costs, so the serial CPU projection finds no budget beating sync
    monkeypatch.setattr(budget, "pass_costs", lambda target, drafter, prefix, drafts, grid, repeats=5: {
        "step_ms": 1.0, "verify_ms": 1.0, "draft_ms": 1.0, "packed_ms": {budget.label(s): 1.0 for s in grid}})
    # SMOKE gives a budget and a block: here the shipped defaults are left alone
    out = run_eval(compose("eval", ["+experiment=smoke", "eval.n=1", "eval.max_new_tokens=12", "eval.auto_budget_prompts=1",
                                    f"eval.out_dir={tmp_path}/auto"], tmp_path))
    run = json.loads((out / "run.json").read_text())
    assert set(run["auto_budget"]) == {"async"} and run["methods"]["async"]["budget_by"] == "auto"
    rows = [r for r in read_jsonl(out / "rows.jsonl") if r["method"] == "async"]
    assert rows and all(r["budget"] == {"by": "auto", "setting": "none", "tokens": 0} for r in rows)
    assert run["methods"]["async"]["method"] == "sync"  # no trays: it ran as its reference, and says why
    assert "tray budget `auto` of async: no trays" in (out / "summary.md").read_text()
    assert not any("budget" in r for r in read_jsonl(out / "rows.jsonl") if r["method"] in ("ar", "sync"))
    assert run["notes"] == []  # the drafter's own block, a measured budget: nothing to state
    given = evaluate(tmp_path / "given", "eval.n=1", "decode.C=2", "decode.F=1", "decode.block_size=4")
    run = json.loads((given / "run.json").read_text())
    assert "auto_budget" not in run and run["methods"]["async"]["budget_by"] == "given"
    rows = [r for r in read_jsonl(given / "rows.jsonl") if r["method"] == "async"]
    assert rows and all(r["budget"] == {"by": "given", "setting": "2x1", "tokens": 4 * (1 * 1 + 2)} for r in rows)
    summary = (given / "summary.md").read_text()
    assert "async: tray budget given (2x1, 12 tokens a packed pass)" in summary
    assert "sync, async: blocks of 4, a stated choice (decode.block_size=4); the drafter was trained with 16" in summary


def test_an_over_long_prompt_is_skipped_with_its_reason_not_the_run(tmp_path, monkeypatch):
    """One prompt past the context used to abort the whole eval, on every rerun. Now it is listed
    in skipped.jsonl with the reason, and the other items are decoded and summarised."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from d3d.data.benchmarks import load_benchmark
    from d3d.data.chat import chat_prompt_ids
    from d3d.models import load_tokenizer, resolve_model_path

    cfg = bind_config(compose("eval", SMOKE + ["eval.n=4"], tmp_path), "eval")
    tok = load_tokenizer(resolve_model_path(cfg.target, cfg.paths.cache_dir))
    from d3d.data.benchmarks import first_turn_messages, iter_specs

    spec = next(iter(iter_specs(cfg.benchmark)))
    lengths = sorted(len(chat_prompt_ids(tok, first_turn_messages(spec, r))) for r in load_benchmark(spec, cfg.paths.cache_dir, n=4))
    assert lengths[0] < lengths[-1]
    limit = lengths[-1] + 12 + 1  # the longest fits AR's 1-token step but not a 4-token block
    out = evaluate(tmp_path, "eval.n=4", f"target.tiny.max_position_embeddings={limit}")
    skipped = list(read_jsonl(out / "skipped.jsonl"))
    assert skipped and {s["method"] for s in skipped} <= {"sync", "async"}
    assert all("exceeds the target's context" in s["reason"] for s in skipped)
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert len([r for r in rows if r["method"] == "ar"]) == 4 and (out / "summary.json").is_file()


def test_every_method_decodes_on_the_runs_backend(tmp_path, monkeypatch):
    """`decode.backend=static` reaches every method, the AR baseline too (a speedup must never be the
    backend's), is recorded per method in run.json, and the rows still equal AR's (greedy)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for group in ["async", "ar"]:
        methods = methods_of(compose("eval", ["+experiment=smoke", f"decode={group}", "decode.backend=static"], tmp_path))
        assert {name: dc.backend for name, dc in methods.items()} == {"ar": "static", "sync": "static", "async": "static"}
    out = evaluate(tmp_path, "decode.backend=static")
    rows = list(read_jsonl(out / "rows.jsonl"))
    assert rows and all(r["equal_to_ar"] for r in rows)
    recorded = json.loads((out / "run.json").read_text())["resume_key"]["methods"]
    assert {name: m["backend"] for name, m in recorded.items()} == {"ar": "static", "sync": "static", "async": "static"}


def test_eval_loads_the_target_with_its_attention_backend(tmp_path, monkeypatch):
    """target.attn_implementation reaches the model eval decodes with (it used to be dropped, so a
    flash_attention_2 setting silently ran SDPA); eager differs from the sdpa default on a CPU too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from d3d.utils.io import resolve_path
    from d3d.eval import load_models
    from d3d.models.target import process_state

    cfg = compose("eval", SMOKE + ["target.attn_implementation=eager"], tmp_path)
    _, target, _ = load_models(bind_config(cfg, "eval"), methods_of(cfg), resolve_path(cfg.paths.cache_dir),
                               process_state(cfg.dist.timeout_s))
    assert target.config._attn_implementation == "eager"


def test_reference_generate_rows_time_transformers_generate_beside_our_methods(tmp_path, monkeypatch):
    """eval.reference_generate=true: a `generate` row per item from transformers' own generate, in
    the same process and dtype; its greedy tokens equal our AR loop's (fp32), every method gets a
    speedup against it, and summary.md shows the column. Not in the load test (one request at a time)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = evaluate(tmp_path, "eval.n=2", "eval.reference_generate=true", "eval.concurrency=[1,2]")
    rows = list(read_jsonl(out / "rows.jsonl"))
    ref = [r for r in rows if r["method"] == "generate"]
    assert len(ref) == 2 and all(r["concurrency"] == 1 for r in ref)
    assert all(r["equal_to_ar"] and r["new_tokens"] > 0 and r["decode_s"] > 0 for r in ref)
    assert all(r["taus"] == [1] * r["new_tokens"] for r in ref)  # one token per step
    summary = json.loads((out / "summary.json").read_text())
    per = summary["benchmarks"]["gsm8k"]
    assert per["generate"]["speedup_vs_generate_token_weighted"] == pytest.approx(1.0)
    assert all("speedup_vs_generate_token_weighted" in m for m in per.values())
    assert "× generate" in (out / "summary.md").read_text()
    assert json.loads((out / "run.json").read_text())["methods"]["generate"]["method"] == "transformers generate"


def test_another_target_under_the_same_name_is_refused(tmp_path, monkeypatch):
    """The resume key held the target's name and dtype only: a target with other weights saved under
    the same target.name was mixed into the folder's rows."""
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    evaluate(tmp_path, "eval.n=1", "eval.methods=[ar]")
    with pytest.raises(ConfigError, match=r"holds rows made with other settings \(target_weights differ\)"):
        evaluate(tmp_path, "eval.n=1", "eval.methods=[ar]", "target.tiny.num_hidden_layers=3")


def test_thinking_on_a_template_without_the_switch_is_refused_before_loading(tmp_path, monkeypatch):
    """eval.enable_thinking=true with a target whose template has no switch changed nothing, silently."""
    import d3d.eval
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(d3d.eval, "load_models", lambda *a, **k: pytest.fail("the models loaded first"))
    with pytest.raises(ConfigError, match=r"^eval.enable_thinking=true but the chat template of .* has no enable_thinking switch"):
        evaluate(tmp_path, "eval.n=1", "eval.methods=[ar]", "eval.enable_thinking=true")


def test_a_run_that_would_skip_every_request_or_a_drafter_of_another_vocabulary_is_refused_before_loading(
        tmp_path, monkeypatch):
    """eval.max_new_tokens past the target's context skipped every request after the models loaded, then
    failed with "holds no rows"; a drafter checkpoint built for another vocabulary was a ValueError
    traceback (TokenizerMismatchError) after both loaded (issue 38). Now one line each, before any weight."""
    import d3d.eval
    from d3d.errors import ConfigError
    from d3d.utils.io import resolve_path
    from d3d.models.target import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(d3d.eval, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    with pytest.raises(ConfigError, match=r"^eval.max_new_tokens=5000: .* the target's context of 2048 tokens, so every "
                                          r"request would be skipped. Fix: set eval.max_new_tokens=2043 or less"):
        evaluate(tmp_path, "eval.max_new_tokens=5000")
    typed = bind_config(compose("eval", SMOKE, tmp_path), "eval")
    config = json.loads((resolve_path(resolve_model_path(typed.target, typed.paths.cache_dir)) / "config.json").read_text())
    other = tmp_path / "other_vocab"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "d3d": {"block_size": 4, "vocab_size": 999}}))
    with pytest.raises(ConfigError, match=rf"^drafter.checkpoint={other}: the drafter was built for a target with 999 "
                                          r"logits; target tiny_random has 260\. Fix: "):
        evaluate(tmp_path, f"drafter.checkpoint={other}")


def test_a_tokenizer_mismatch_is_a_config_error():
    """TokenizerMismatchError was a bare ValueError: the CLI showed a traceback, not its one line (issue 38)."""
    from d3d.config import USER_ERRORS
    from d3d.models.drafter import TokenizerMismatchError

    assert issubclass(TokenizerMismatchError, USER_ERRORS)
