"""Acceptance views of a drafting row, recomputed from the rows d3d.eval writes (docs/design.md,
Evaluation): per draft position, per request and per context length. Rows store τ of every round
in order (`taus`: tokens committed that round) and the prompt's length (`prompt_tokens`), which is
all these views need, so a run made before they existed gets them too.

Conventions. A round commits its accepted drafts and one token from the target (the correction, or
the bonus when every draft was accepted): τ = accepted + 1. Draft position k (k = 1..K, K = B - 1
drafts of a block of B) counts a round as accepting k when accepted >= k; the target's token is the
"1 +" and never a position. So, round-weighted over every round of a row:

    cumulative[k-1]  = P(accepted >= k)                    (vLLM's per-position acceptance, over steps)
    conditional[k-1] = P(accepted >= k | accepted >= k - 1)
    1 + sum(cumulative) = mean τ per round                  (tokens / rounds: the row's tau_token_weighted)

A request's last round counts what it committed (cut by EOS or max_new_tokens), as τ does. Engines
that count lengths with the bonus token (a speculation profile's "length" i + 2 for draft position
i, counted from 0) shift these by one: d3d.export's speculation profile gives both (speculation_profile).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

# τ per request: these quantiles of the rows' own τ (tokens / rounds), so the spread is not a mean
QUANTILES = {"min": 0.0, "p10": 0.1, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p90": 0.9, "max": 1.0}
# τ by context: buckets of the context a round starts from (prompt + committed), doubling from here
FIRST_CONTEXT_BUCKET = 128

CONVENTIONS = {
    "cumulative": "P(accepted drafts >= k) for draft position k = 1..K, over rounds; the target's own token "
                  "(correction or bonus) is not a position, so 1 + sum = mean tokens per round",
    "conditional": "P(accepted drafts >= k | accepted drafts >= k - 1) for k = 1..K, over rounds",
}


def position_rates(taus: list[int], positions: int) -> dict:
    """Cumulative and conditional acceptance per draft position 1..`positions` from τ of each round
    (accepted = τ - 1). A position no round reached has conditional None (nothing to condition on)."""
    accepted = Counter(max(int(t) - 1, 0) for t in taus)
    rounds = len(taus)
    at_least = [sum(n for a, n in accepted.items() if a >= k) for k in range(positions + 1)]  # at_least[0] = rounds
    return {"cumulative": [at_least[k] / rounds if rounds else None for k in range(1, positions + 1)],
            "conditional": [at_least[k] / at_least[k - 1] if at_least[k - 1] else None
                            for k in range(1, positions + 1)],
            "rounds": rounds}


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def tau_per_request(rows: list[dict]) -> dict:
    """Quantiles of the rows' τ (one row = one request at concurrency 1)."""
    taus = sorted(r["new_tokens"] / r["rounds"] for r in rows if r.get("rounds"))
    return {"requests": len(taus), **({name: quantile(taus, q) for name, q in QUANTILES.items()} if taus else {})}


def context_bucket(context: int) -> tuple[int, int]:
    """[from, to) of the bucket holding a round that starts from `context` tokens."""
    if context < FIRST_CONTEXT_BUCKET:
        return 0, FIRST_CONTEXT_BUCKET
    lo = FIRST_CONTEXT_BUCKET
    while lo * 2 <= context:
        lo *= 2
    return lo, lo * 2


def tau_by_context(rows: list[dict]) -> list[dict]:
    """Mean τ of the rounds starting from a context in each bucket: round i of a request starts from
    its prompt plus the tokens the rounds before it committed. Rows without a prompt length are left out."""
    buckets: dict[tuple[int, int], list] = {}
    for r in rows:
        context = r.get("prompt_tokens")
        if not isinstance(context, int):
            continue
        for t in r.get("taus") or []:
            entry = buckets.setdefault(context_bucket(context), [0, 0, set()])
            entry[0] += t
            entry[1] += 1
            entry[2].add(id(r))
            context += t
    return [{"from": lo, "to": hi, "rounds": n, "requests": len(reqs), "tau": tokens / n}
            for (lo, hi), (tokens, n, reqs) in sorted(buckets.items())]


def draft_positions(rows: list[dict], record: dict | None) -> int:
    """K: the block's drafts (block_size - 1 in the method's run.json record), or the most any round
    accepted where a run.json is missing or a round accepted more."""
    observed = max((int(t) - 1 for r in rows for t in r.get("taus") or []), default=0)
    recorded = int(record["block_size"]) - 1 if record and record.get("block_size") else 0
    return max(recorded, observed)


def views(rows: list[dict], record: dict | None = None) -> dict:
    """The three views of one drafting row (a benchmark's rows of one method at concurrency 1)."""
    taus = [t for r in rows for t in r.get("taus") or []]
    rates = position_rates(taus, draft_positions(rows, record))
    return {"acceptance": {"conditional": rates["conditional"], "cumulative": rates["cumulative"],
                           "rounds": rates["rounds"]},
            "tau_per_request": tau_per_request(rows), "tau_by_context": tau_by_context(rows)}


def add_views(summary: dict, rows: list[dict], drafting, records: dict | None = None) -> None:
    """Put the views beside each drafting row of `summary["benchmarks"]` (`drafting(method)`: whether
    a method drafts), from the same rows its numbers come from; `records`: run.json's methods."""
    for bench, per in summary["benchmarks"].items():
        for method, stats in per.items():
            if not drafting(method):
                continue
            rs = [r for r in rows if r["benchmark"] == bench and r["method"] == method
                  and r.get("concurrency", 1) == 1 and r["new_tokens"] > 0]
            stats.update(views(rs, (records or {}).get(method)))


def speculation_profile(tau_histogram: list[int], k: int, measured_on: str) -> dict:
    """The drafter's measured profile as an engine serving it with K = `k` drafts a step sees it
    (d3d.export writes it as speculation_profile.json): `tau_histogram[t - 1]` = steps that committed
    t tokens. Positions are draft positions 1..K in this module's convention; `length_with_bonus`
    gives the other one (draft position k = index k - 1 ends a committed length of k + 1)."""
    taus = [t for t, n in enumerate(tau_histogram, 1) for _ in range(n)]
    rates = position_rates(taus, k)
    return {"num_speculative_tokens": k, "measured_on": measured_on, "steps": rates["rounds"],
            "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
            "positions": list(range(1, k + 1)), "length_with_bonus": [p + 1 for p in range(1, k + 1)],
            "cumulative": rates["cumulative"], "conditional": rates["conditional"],
            "conventions": {**CONVENTIONS,
                            "length_with_bonus": "the tokens a step commits when drafts 1..k are accepted, the "
                                                 "target's bonus token included (0-based position i -> length i + 2)"}}


# ---------------------------------------------------------------------------- tables


def _rates(values: list) -> str:
    return " ".join("—" if v is None else f"{v:.2f}" for v in values)


def views_markdown(summary: dict) -> list[str]:
    """summary.md's lines for the views of every drafting row (none when no row drafts)."""
    rows = [(b, m, s) for b, per in summary["benchmarks"].items() for m, s in per.items() if "acceptance" in s]
    if not rows:
        return []
    lines = ["", "Acceptance per draft position k = 1, 2, … (round-weighted; cumulative P(≥ k accepted), "
             "conditional P(k | k − 1); 1 + Σ cumulative = τ) and τ per request (quantiles over requests):", "",
             "| benchmark | method | τ | cumulative by k | conditional by k | τ per request p10 / p50 / p90 |",
             "|---|---|---|---|---|---|"]
    for bench, method, s in rows:
        q = s["tau_per_request"]
        spread = " / ".join(f"{q[k]:.2f}" for k in ("p10", "p50", "p90")) if q["requests"] else "—"
        lines.append(f"| {bench} | {method} | {s['tau_token_weighted']:.2f} | {_rates(s['acceptance']['cumulative'])} "
                     f"| {_rates(s['acceptance']['conditional'])} | {spread} |")
    lines += ["", "τ by context length (the context a round starts from; rounds in brackets):", "",
              "| benchmark | method | " + "τ by context |", "|---|---|---|"]
    for bench, method, s in rows:
        cells = ", ".join(f"{b['from']}–{b['to']}: {b['tau']:.2f} ({b['rounds']})" for b in s["tau_by_context"])
        lines.append(f"| {bench} | {method} | {cells or '— (rows without prompt_tokens)'} |")
    return lines


def compare_views_markdown(labels: list[str], summaries: list[dict]) -> list[str]:
    """The views of two or more runs side by side: per (benchmark, drafting row) that any run has,
    cumulative and conditional acceptance by position, τ per request and τ by context, one column per run."""
    keys = sorted({(b, m) for s in summaries for b, per in s["benchmarks"].items() for m, st in per.items()
                   if "acceptance" in st})
    lines = []
    for bench, method in keys:
        views_of = [s["benchmarks"].get(bench, {}).get(method) for s in summaries]
        positions = max(len(v["acceptance"]["cumulative"]) for v in views_of if v)
        lines += ["", f"### {bench} / {method}", "",
                  "| k | " + " | ".join(f"{lab} cumulative | {lab} conditional" for lab in labels) + " |",
                  "|---|" + "---|---|" * len(labels)]
        for k in range(positions):
            cells = []
            for v in views_of:
                acc = v["acceptance"] if v else {"cumulative": [], "conditional": []}
                cells += [_rates(acc[kind][k : k + 1]) or "—" for kind in ("cumulative", "conditional")]
            lines.append(f"| {k + 1} | " + " | ".join(cells) + " |")
        lines += ["", "| τ per request | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for name in ("requests", *QUANTILES):
            cells = ["—" if not v or name not in v["tau_per_request"] else
                     (str(v["tau_per_request"][name]) if name == "requests" else f"{v['tau_per_request'][name]:.2f}")
                     for v in views_of]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        buckets = sorted({(b["from"], b["to"]) for v in views_of if v for b in v["tau_by_context"]})
        if buckets:
            lines += ["", "| context | " + " | ".join(f"{lab} τ (rounds)" for lab in labels) + " |",
                      "|---|" + "---|" * len(labels)]
            for lo, hi in buckets:
                cells = []
                for v in views_of:
                    hit = [b for b in (v["tau_by_context"] if v else []) if (b["from"], b["to"]) == (lo, hi)]
                    cells.append(f"{hit[0]['tau']:.2f} ({hit[0]['rounds']})" if hit else "—")
                lines.append(f"| {lo}–{hi} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------- plots


def plot_views(summary: dict, out_dir: str | Path) -> list[Path]:
    """acceptance.png: cumulative and conditional acceptance by position, τ per request (p10–p90,
    median marked) and τ by context, one line per benchmark/drafting row."""
    from d3d.utils.plotting import pyplot, save_figure

    rows = [(f"{b}/{m}", s) for b, per in summary["benchmarks"].items() for m, s in per.items() if "acceptance" in s]
    if not rows:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for i, (name, s) in enumerate(rows):
        for ax, kind in zip(axes[:2], ("cumulative", "conditional")):
            values = s["acceptance"][kind]
            ax.plot(range(1, len(values) + 1), [float("nan") if v is None else v for v in values], marker="o",
                    label=name)
        q = s["tau_per_request"]
        if q["requests"]:
            axes[2].plot([i, i], [q["p10"], q["p90"]], color=f"C{i % 10}", lw=3)
            axes[2].plot([i], [q["p50"]], "o", color=f"C{i % 10}")
        ctx = s["tau_by_context"]
        if ctx:
            axes[3].plot([b["to"] for b in ctx], [b["tau"] for b in ctx], marker="o", label=name)
    axes[0].set_title("P(≥ k drafts accepted)")
    axes[1].set_title("P(k accepted | k − 1 accepted)")
    for ax in axes[:2]:
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[2].set_title("τ per request (p10–p90, median)")
    axes[2].set_xticks(range(len(rows)), [name for name, _ in rows], rotation=20, fontsize=7)
    axes[3].set_title("τ by context length")
    axes[3].set_xlabel("context at the round's start (bucket's upper end, tokens)")
    axes[3].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    return [save_figure(fig, Path(out_dir) / "acceptance.png")]
