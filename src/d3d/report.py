"""Evaluation results from rows: summary.json, summary.md, plots, and side-by-side comparisons.

Everything here is recomputed from the per-prompt rows (rows*.jsonl) that d3d.eval writes, so a
summary can always be checked against, or rebuilt from, the raw data:

    python -m d3d.report outputs/eval/runs/<run>/<time>            # re-summarise + redraw plots
    python -m d3d.report compare <folder A> <folder B> [...]       # e.g. λ = 0 against λ = 1; --out FILE too
    python -m d3d.report results [--check]    # docs/results.md's and the README's figures from their records (d3d.figures)

Definitions (docs/design.md, Evaluation): TPOT = decode seconds / new tokens (prefill timed apart);
speedup = TPOT(ar) / TPOT(method) on the same items; speedup_with_prefill does the same with
(prefill + decode) seconds, so a drafter's own prompt prefill — which AR does not pay — is counted
(long prompts, MT-Bench turn 2); τ = tokens / request-rounds. Token-weighted
aggregates divide totals; prompt-weighted ones average per-row values. Rows at concurrency c > 1
are batches of c requests: they feed the load table (throughput and speedup against concurrency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from d3d.acceptance import add_views, compare_views_markdown, plot_views, views_markdown
from d3d.errors import ConfigError, UserError
from d3d.utils.io import read_jsonl, unique, write_json
from d3d.utils.plotting import pyplot, save_figure

# The name of the rows every speedup and equality is measured against: d3d.eval requires this
# method (plain decoding through the same driver) in every run.
BASELINE = "ar"
REFERENCE = "generate"  # transformers' generate, when d3d.eval ran it (eval.reference_generate)


def read_rows(folder: str | Path) -> list[dict]:
    """Every row of a result folder: rows.jsonl, or one rows.rank<r>.jsonl per process; each key once."""
    rows = []
    for path in sorted(Path(folder).glob("rows*.jsonl")):
        rows += list(read_jsonl(path, ROW_FIELDS))
    return unique(rows, row_key)


# A row whose host spent this share of its rounds issuing them was host-bound (the device waited for
# it): the summary flags it, so an eager row on a GPU is never read as the method's speed
HOST_BOUND = 0.9

ROW_FIELDS = ("benchmark", "id", "method")  # what row_key indexes: a row without one is damage (read_jsonl)


def row_key(row: dict) -> tuple:
    """What makes a row one result: a second row with the same key is a duplicate, not a sample."""
    return row["benchmark"], row["id"], row.get("turn", 0), row["method"], row.get("concurrency", 1)


def _mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _finish(row: dict) -> str | None:
    reason = row.get("finish_reason")
    return reason[0] if isinstance(reason, list) else reason


def method_stats(rs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rs)
    correct = [r.get("correct") for r in rs]
    return {
        "rows": len(rs), "new_tokens": tokens,
        "tpot_ms_token_weighted": 1000 * sum(r["decode_s"] for r in rs) / tokens,
        "tpot_ms_prompt_weighted": 1000 * statistics.mean(r["decode_s"] / r["new_tokens"] for r in rs),
        "ms_per_token_with_prefill": 1000 * sum(r["decode_s"] + r["prefill_s"] for r in rs) / tokens,
        "tokens_per_s": tokens / sum(r["decode_s"] for r in rs),
        "tau_token_weighted": tokens / sum(r["rounds"] for r in rs),
        "tau_prompt_weighted": statistics.mean(r["new_tokens"] / r["rounds"] for r in rs),
        "hit_rate": _mean_or_none([r["hit_rate"] for r in rs]),
        "prefill_ms": 1000 * statistics.mean(r["prefill_s"] for r in rs),
        # graphs torch.compile made inside timed calls: 0 when the warm-up compiled every shape (d3d.eval)
        "compiles_in_timed": sum(r.get("compiles") or 0 for r in rs),
        # CUDA: the share of the decode's rounds the host spent issuing them (HOST_BOUND flags it)
        "host_issue_share": _mean_or_none([r.get("host_issue_share") for r in rs]),
        "equal_to_ar": statistics.mean(1.0 if r["equal_to_ar"] else 0.0 for r in rs),
        "accuracy": _mean_or_none([None if c is None else float(c) for c in correct]),
        # graded answers that stopped at eval.max_new_tokens: graded wrong for want of room, not skill
        "cut_graded": sum(1 for r, c in zip(rs, correct) if c is not None and _finish(r) == "length"),
        # graded answers whose tests ran in the answer's own interpreter (d3d.grading.verdict: tests of a shape
        # it cannot split into calls and values compared apart); rows older than that split say neither
        "graded_in_answer": sum(1 for r, c in zip(rs, correct) if c is not None and r.get("compared_apart") is False),
        "task_equal_to_ar": _mean_or_none([None if r.get("task_equal_to_ar") is None else float(r["task_equal_to_ar"])
                                           for r in rs]),
        # async == sync: tokens, and τ per round in fp32 only (`sync_compared`; docs/design.md#losslessness); AR
        # divergences by class (d3d.decoding.divergence)
        "equal_to_sync": _mean_or_none([None if r.get("equal_to_sync") is None else float(r["equal_to_sync"]) for r in rs]),
        "sync_compared": " / ".join(sorted({r["sync_compared"] for r in rs if r.get("sync_compared")})) or None,
        "divergences": {kind: sum(1 for r in rs for d in _divergences(r) if d["kind"] == kind)
                        for kind in ("numerical", "real")},
    }


def _divergences(row: dict) -> list[dict]:
    found = row.get("divergence")
    return [d for d in (found if isinstance(found, list) else [found]) if d]


def _add_speedups(per: dict, rows_of: dict[str, list[dict]], reference: str = BASELINE, prefix: str = "speedup") -> None:
    """Speedup against the reference (AR; or transformers' generate, prefix `speedup_vs_generate`)
    on the items both decoded: in a killed or growing run one method can be an item ahead, and
    TPOTs over different items are not comparable."""
    if reference not in per:
        return
    item = lambda r: (r.get("id"), r.get("turn", 0))
    ar = {item(r): r for r in rows_of[reference]}
    for name, m in per.items():
        pairs = [(ar[item(r)], r) for r in rows_of[name] if item(r) in ar]
        if not pairs:
            continue
        a, b = (method_stats(list(side)) for side in zip(*pairs))
        m[f"{prefix}_token_weighted"] = a["tpot_ms_token_weighted"] / b["tpot_ms_token_weighted"]
        m[f"{prefix}_prompt_weighted"] = a["tpot_ms_prompt_weighted"] / b["tpot_ms_prompt_weighted"]
        m[f"{prefix}_with_prefill"] = a["ms_per_token_with_prefill"] / b["ms_per_token_with_prefill"]
        m[f"{prefix}_items"] = len(pairs)


def tau_histogram(rows: list[dict]) -> dict[str, dict[int, int]]:
    """Accepted tokens per round (τ of each round), counted per method."""
    out: dict[str, Counter] = {}
    for r in rows:
        out.setdefault(r["method"], Counter()).update(r.get("taus") or [])
    return {m: dict(sorted(c.items())) for m, c in sorted(out.items())}


def drafting(method: str) -> bool:
    """Whether a row's method drafts (every method but the AR baseline and transformers' generate)."""
    return method not in (BASELINE, REFERENCE)


def summarise(rows: list[dict], records: dict | None = None) -> dict:
    """Per benchmark and method at concurrency 1, with each drafting row's acceptance views
    (d3d.acceptance; `records`: run.json's methods, for their block sizes); the mean over benchmarks;
    the load table."""
    single = [r for r in rows if r.get("concurrency", 1) == 1]
    out: dict = {"benchmarks": {}}
    for bench in sorted({r["benchmark"] for r in single}):
        per, rows_of = {}, {}
        for method in sorted({r["method"] for r in single if r["benchmark"] == bench}):
            rs = [r for r in single if r["benchmark"] == bench and r["method"] == method and r["new_tokens"] > 0]
            if rs:
                per[method], rows_of[method] = method_stats(rs), rs
        _add_speedups(per, rows_of)
        _add_speedups(per, rows_of, REFERENCE, "speedup_vs_generate")
        out["benchmarks"][bench] = per
    methods = sorted({m for per in out["benchmarks"].values() for m in per})
    out["mean_over_benchmarks"] = {
        m: {k: statistics.mean(per[m][k] for per in out["benchmarks"].values())
            for k in ("speedup_token_weighted", "tau_token_weighted")}
        for m in methods if all("speedup_token_weighted" in per.get(m, {}) for per in out["benchmarks"].values())
    }
    add_views(out, single, drafting, records)
    out["tau_histogram"] = tau_histogram(single)
    out["load"] = load_table(rows)
    return out


def load_table(rows: list[dict]) -> dict:
    """Per concurrency and method over all benchmarks: tokens/s, τ, hit rate, speedup against AR."""
    out: dict = {}
    for c in sorted({r.get("concurrency", 1) for r in rows}):
        per, rows_of = {}, {}
        for method in sorted({r["method"] for r in rows}):
            rs = [r for r in rows if r.get("concurrency", 1) == c and r["method"] == method and r["new_tokens"] > 0]
            if rs:
                per[method], rows_of[method] = method_stats(rs), rs
        _add_speedups(per, rows_of)
        out[str(c)] = per
    return out if len(out) > 1 else {}


# ---------------------------------------------------------------------------- tables


def _fmt(x: float | None, spec: str = ".2f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def summary_markdown(summary: dict) -> str:
    # "× generate": TPOT of transformers' generate over the method's, when eval ran it
    vs_generate = any("speedup_vs_generate_token_weighted" in m for per in summary["benchmarks"].values() for m in per.values())
    lines = ["| benchmark | method | speedup | " + ("× generate | " if vs_generate else "")
             + "with prefill | τ | hit rate | TPOT ms | tok/s | equal to AR | accuracy | rows |",
             "|---|---|---|---|" + ("---|" if vs_generate else "") + "---|---|---|---|---|---|---|"]
    for bench, per in summary["benchmarks"].items():
        for method, m in per.items():
            lines.append(f"| {bench} | {method} | {_fmt(m.get('speedup_token_weighted'))}× | "
                         + (f"{_fmt(m.get('speedup_vs_generate_token_weighted'))}× | " if vs_generate else "")
                         + f"{_fmt(m.get('speedup_with_prefill'))}× | "
                         f"{m['tau_token_weighted']:.2f} | {_fmt(m['hit_rate'])} | {m['tpot_ms_token_weighted']:.1f} | "
                         f"{m['tokens_per_s']:.1f} | {m['equal_to_ar']:.2f} | {_fmt(m.get('accuracy'))} | {m['rows']} |")
    for method, m in summary["mean_over_benchmarks"].items():
        lines.append(f"| **mean** | {method} | {m['speedup_token_weighted']:.2f}× | " + ("| " if vs_generate else "")
                     + f"| {m['tau_token_weighted']:.2f} | | | | | | |")
    notes = [f"{bench}/{method}: equal to sync ({m.get('sync_compared') or 'tokens and tau'}) on "
             f"{m['equal_to_sync']:.2f} of rows" + ("" if m.get("sync_compared") != "tokens" else
                                                   "; τ is not compared in bf16 (docs/design.md#losslessness)")
             for bench, per in summary["benchmarks"].items() for method, m in per.items()
             if m.get("equal_to_sync") is not None]
    notes += [f"{bench}/{method}: differs from AR in {sum(m['divergences'].values())} rows "
              f"({m['divergences']['numerical']} numerical, {m['divergences']['real']} real)"
              for bench, per in summary["benchmarks"].items() for method, m in per.items()
              if sum(m.get("divergences", {}).values())]
    notes += [f"{bench}/{method}: {m['cut_graded']} of {m['rows']} graded answers stopped at eval.max_new_tokens "
              f"before finishing, so its accuracy is not the model's (raise eval.max_new_tokens to measure it)"
              for bench, per in summary["benchmarks"].items() for method, m in per.items() if m.get("cut_graded")]
    notes += [f"{bench}/{method}: {m['graded_in_answer']} of {m['rows']} graded answers were judged by tests that ran in "
              f"the answer's own interpreter, not compared apart (docs/reliability.md, Round 8)"
              for bench, per in summary["benchmarks"].items() for method, m in per.items() if m.get("graded_in_answer")]
    notes += [f"{bench}/{method}: HOST-BOUND, the host spent {m['host_issue_share']:.0%} of its rounds issuing passes the "
              f"device then waited for, so its speedup times the host's Python, not the method (decode.backend=compiled "
              f"replays CUDA graphs)" for bench, per in summary["benchmarks"].items() for method, m in per.items()
              if (m.get("host_issue_share") or 0) >= HOST_BOUND]
    notes += [source["fallback"] for source in summary.get("benchmark_sources", {}).values() if source.get("fallback")]
    notes += [f"tray budget `auto` of {name}: {choice['why']}" for name, choice in summary.get("auto_budget", {}).items()
              if choice.get("why")]  # older run.json files hold the choice without a reason
    notes += summary.get("run_notes", [])  # d3d.eval's stated choices (run.json `notes`: a block, a given budget)
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    lines += views_markdown(summary)  # acceptance per position, per request, per context (d3d.acceptance)
    if summary.get("load"):
        lines += ["", "Load test (all benchmarks, first turns, batches of `concurrency` requests):", "",
                  "| concurrency | method | tok/s | speedup vs AR | τ | hit rate | equal to AR |",
                  "|---|---|---|---|---|---|---|"]
        for c, per in summary["load"].items():
            for method, m in per.items():
                lines.append(f"| {c} | {method} | {m['tokens_per_s']:.1f} | {_fmt(m.get('speedup_token_weighted'))}× "
                             f"| {m['tau_token_weighted']:.2f} | {_fmt(m['hit_rate'])} | {m['equal_to_ar']:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- plots


def plot_summary(summary: dict, out_dir: str | Path, methods_info: dict | None = None) -> list[Path]:
    """PNG files: speedup and τ per benchmark, τ histogram, budget study, load test (when present)."""
    plt = pyplot()
    out_dir = Path(out_dir)
    paths = []
    benches = list(summary["benchmarks"])
    spec_methods = sorted({m for per in summary["benchmarks"].values() for m in per if m != BASELINE})
    if benches and spec_methods:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        width = 0.8 / len(spec_methods)
        for k, method in enumerate(spec_methods):
            xs = [i + k * width for i in range(len(benches))]
            per = [summary["benchmarks"][b].get(method, {}) for b in benches]
            axes[0].bar(xs, [p.get("speedup_token_weighted", 0) for p in per], width, label=method)
            axes[1].bar(xs, [p.get("tau_token_weighted", 0) for p in per], width, label=method)
        for ax, title in zip(axes, ("speedup over AR (token-weighted)", "τ (accepted tokens per round)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(benches))], benches, rotation=20)
            ax.set_title(title)
        axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
        axes[1].legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "speedup_tau.png"))
    hist = {m: h for m, h in summary.get("tau_histogram", {}).items() if m != BASELINE}
    if hist:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for method, h in hist.items():
            total = sum(h.values())
            ks = sorted(int(k) for k in h)
            ax.plot(ks, [h.get(k, h.get(str(k), 0)) / total for k in ks], marker="o", label=method)
        ax.set_xlabel("tokens accepted in a round (τ)")
        ax.set_ylabel("fraction of rounds")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "tau_histogram.png"))
    budgets = _budget_points(summary, methods_info or {})
    if len(budgets) >= 2:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        ax2 = ax.twinx()
        xs = [b[0] for b in budgets]
        ax.plot(xs, [b[1] for b in budgets], "o-", color="C0", label="speedup")
        ax2.plot(xs, [b[2] for b in budgets], "s--", color="C1", label="hit rate")
        for x, y, _, name in budgets:
            ax.annotate(name, (x, y), fontsize=7)
        ax.set_xlabel("tokens in one packed async pass")
        ax.set_ylabel("speedup over AR", color="C0")
        ax2.set_ylabel("tray hit rate", color="C1")
        paths.append(save_figure(fig, out_dir / "budget.png"))
    if summary.get("load"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        cs = [int(c) for c in summary["load"]]
        for method in sorted({m for per in summary["load"].values() for m in per}):
            per = [summary["load"][str(c)].get(method, {}) for c in cs]
            axes[0].plot(cs, [p.get("speedup_token_weighted") for p in per], "o-", label=method)
            axes[1].plot(cs, [p.get("tokens_per_s") for p in per], "o-", label=method)
        axes[0].set_title("speedup over AR at the same concurrency")
        axes[1].set_title("throughput (tokens/s)")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
        axes[1].legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "load.png"))
    return paths + plot_views(summary, out_dir)


def _budget_points(summary: dict, methods_info: dict) -> list[tuple[int, float, float, str]]:
    """(packed tokens, mean speedup, mean hit rate, name) for every async method, by budget."""
    points = []
    for name, info in methods_info.items():
        if not info.get("budget") or name not in summary["mean_over_benchmarks"]:  # no drafter work beside verify
            continue
        hits = [per[name]["hit_rate"] for per in summary["benchmarks"].values() if name in per]
        points.append((int(info["budget"]), summary["mean_over_benchmarks"][name]["speedup_token_weighted"],
                       _mean_or_none(hits) or 0.0, name))
    return sorted(points)


# ---------------------------------------------------------------------------- folders


def methods_info(folder: Path) -> dict:
    run = folder / "run.json"
    return json.loads(run.read_text()).get("methods", {}) if run.is_file() else {}


def benchmark_sources(folder: Path) -> dict:
    """Where each benchmark's items came from (run.json), for summary.json; a source that is not the
    spec's first choice (`fallback`: MATH-500's 311-item offline file for its 500 on the hub) is a
    note in summary.md, since its numbers are on another item set."""
    run = folder / "run.json"
    return json.loads(run.read_text()).get("benchmark_sources", {}) if run.is_file() else {}


def auto_budget_info(folder: Path) -> dict | None:
    """What `eval.async_budgets=[auto]` chose for each method and why (run.json), for the summary's
    notes: the chosen knobs and the projection, without the table and the costs it rests on."""
    run = folder / "run.json"
    chosen = json.loads(run.read_text()).get("auto_budget") if run.is_file() else None
    if chosen and "table" in chosen:  # a run.json written before choices were per method held async's alone
        chosen = {"async_auto": chosen}
    return {name: {k: v for k, v in choice.items() if k not in ("table", "costs")}
            for name, choice in chosen.items()} if chosen else None


def result_rows(folder: str | Path) -> list[dict]:
    """The rows of a result folder; a missing folder, or one where no row was finished, is one line
    with the fix (a missing folder used to compare as an empty column, exit status 0)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder. Fix: pass d3d.eval result folders (each run's eval.out_dir, or "
                        f"its outputs/eval/runs/<run>/<time> folder).")
    rows = read_rows(folder)
    if not rows:
        made = "rows*.jsonl files with no finished row" if any(folder.glob("rows*.jsonl")) else "no rows*.jsonl"
        raise UserError(f"{folder} holds {made}: no d3d.eval run finished a row there (killed before its first, "
                        f"or every request skipped: see its skipped*.jsonl). Fix: run or resume d3d.eval into it "
                        f"(eval.out_dir={folder}), or pass another result folder.")
    return rows


def write_report(folder: str | Path, extra: dict | None = None) -> dict:
    """(Re)compute summary.json, summary.md and the plots of a result folder from its rows."""
    folder = Path(folder)
    rows = result_rows(folder)
    summary = summarise(rows, methods_info(folder))
    summary["methods"] = methods_info(folder)
    if auto_budget_info(folder):
        summary["auto_budget"] = auto_budget_info(folder)
    if benchmark_sources(folder):
        summary["benchmark_sources"] = benchmark_sources(folder)
    run = folder / "run.json"
    if run.is_file() and json.loads(run.read_text()).get("notes"):
        summary["run_notes"] = json.loads(run.read_text())["notes"]
    summary.update(extra or {})
    summary["plots"] = [str(p.name) for p in plot_summary(summary, folder, summary["methods"])]
    write_json(folder / "summary.json", summary)
    (folder / "summary.md").write_text(summary_markdown(summary))
    return summary


def compare_markdown(folders: list[Path], labels: list[str] | None = None) -> str:
    """One row per (benchmark, method), one column pair (speedup, τ) per result folder; then each
    drafting row's acceptance views side by side (d3d.acceptance)."""
    labels = labels or [f.parent.name if f.name[:4].isdigit() else f.name for f in folders]
    summaries = [summarise(result_rows(f), methods_info(f)) for f in folders]
    keys = sorted({(b, m) for s in summaries for b, per in s["benchmarks"].items() for m in per})
    head = "| benchmark | method | " + " | ".join(f"{lab} speedup | {lab} τ" for lab in labels) + " |"
    lines = [head, "|---|---|" + "---|---|" * len(folders)]
    for bench, method in keys:
        cells = []
        for s in summaries:
            m = s["benchmarks"].get(bench, {}).get(method)
            cells += ["—", "—"] if m is None else [f"{_fmt(m.get('speedup_token_weighted'))}×", f"{m['tau_token_weighted']:.2f}"]
        lines.append(f"| {bench} | {method} | " + " | ".join(cells) + " |")
    lines += compare_views_markdown(labels, summaries)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m d3d.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="result folder(s); start with the word 'compare' to compare")
    parser.add_argument("--labels", nargs="*", help="column labels for compare (default: folder names)")
    parser.add_argument("--out", help="compare: also write the table to this file")
    parser.add_argument("--check", action="store_true", help="results: compare the pages with their render, write nothing")
    args = parser.parse_args(argv)
    try:
        _main(parser, args)
    # what and the fix are in the message (a damaged file is a CorruptFile, a ConfigError); a traceback would bury it
    except (UserError, ConfigError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.folders == ["results"]:  # the pages' figures from docs/results/index.yaml's records
        from d3d.figures import render

        differ = render(check=args.check)
        print("\n".join(f"{'differs from its render' if args.check else 'rendered'}: {p}" for p in differ)
              or "every page equals its render")
        if args.check and differ:
            sys.exit(1)
        return
    if args.folders[0] == "compare":
        folders = [Path(f) for f in args.folders[1:]]
        if len(folders) < 2:
            parser.error("compare needs two or more result folders")
        table = compare_markdown(folders, args.labels)
        if args.out:
            Path(args.out).write_text(table)
        print(table)
        return
    for folder in args.folders:
        summary = write_report(folder)
        print(f"{folder}:\n{summary_markdown(summary)}plots: {', '.join(summary['plots']) or 'none'}\n")


if __name__ == "__main__":
    main()
