"""A figure rendered from a record is written in its rendered block only. `python -m d3d.report
results` rewrites what lies between a block's marks and nothing else, so a copy typed by hand into the
prose of README.md or docs/*.md would stay behind, stale, the day its record changes.

Every figure of docs/results/index.yaml is looked for in that prose as the pages write such a figure:
a speedup as `2.03×`, a τ as `τ 3.56`, a throughput as `5.12 tok/s`, a wall time as `39.8 min`. The
studies under docs/results/, where each figure was first measured, are not searched. Values with
fewer than three significant digits (1.00, 0.58, 8.0) are left out: other measurements in the prose
share them by chance (a sweep's `0.62×`, a retention of 0.99), while a three-digit value in the same
unit is the figure itself."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

from d3d.figures import INDEX, figure_values, load_index, marks
from tests.conftest import ROOT

# How the pages write each kind of figure, by the last segment of its key path (or its divisor)
UNIT = {"ratio": "{n}×", "x_generate": "{n}×", "projected_speedup": "{n}×", "sync_speedup": "{n}×",
        "tau": "τ {n}", "tokens_per_s": "{n} tok/s", "minutes": "{n} min",
        "peak_rss_gb": "{n} GiB"}  # pipeline.json's peaks are GiB (its peak_rss_unit)


def telling(value: str) -> bool:
    """Three significant digits at least, and not a whole number."""
    number = Decimal(value).normalize()
    return number != number.to_integral_value() and len(number.as_tuple().digits) >= 3


def written_forms(root: Path = ROOT) -> dict[str, list[str]]:
    """{a pattern of a figure as the prose would write it: the figures it is}."""
    index = load_index(root / INDEX)
    values = figure_values(index, (root / INDEX).parent)
    out: dict[str, list[str]] = {}
    for name, fig in index.figures.items():
        if fig.format == "shares" or not telling(values[name]):
            continue
        kind = "minutes" if fig.divide == 60 else fig.key.rsplit("/", 1)[-1]
        assert kind in UNIT, f"figures.{name}: key {fig.key!r} is of no kind UNIT knows: add how the pages write it"
        n = r"(?<![\w.])" + re.escape(values[name]) + r"(?!\.?\d)"
        form = re.escape(UNIT[kind]).replace(re.escape("{n}"), n).replace(r"\ ", r"\s*")
        out.setdefault(form, []).append(name)
    return out


def prose(text: str) -> str:
    """The page with its rendered blocks blanked out (their lines kept, so line numbers hold)."""
    for name in re.findall(r"<!-- figures:(\w+) -->", text):
        start, end = marks(name)
        i, j = text.index(start), text.index(end)
        text = text[:i] + re.sub(r"[^\n]", "", text[i:j]) + text[j:]
    return text


def hand_typed(root: Path = ROOT) -> list[str]:
    """'page:line: what was typed (figures)' for every rendered figure written outside its block."""
    forms = written_forms(root)
    found = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(prose(page.read_text(encoding="utf-8")).splitlines(), 1):
            for form, names in forms.items():
                for m in re.finditer(form, line):
                    found.append(f"{page.relative_to(root)}:{n}: {m.group(0)} ({', '.join(names)})")
    return found


def test_no_rendered_figure_is_typed_by_hand_outside_its_block():
    found = hand_typed()
    assert not found, ("figures rendered from records, typed by hand outside their blocks (say it in words, or "
                       "quote it in a rendered block through docs/results/index.yaml):\n" + "\n".join(found))


def test_the_search_finds_a_copy_and_leaves_the_rest_alone(tmp_path):
    """The search on a copy of the pages: clean as checked in, then one figure typed back into the
    README's prose in each unit (seen failing: each copy is named, with its figure); the same numbers
    in another unit, a version or a longer number are not copies."""
    import shutil

    index = load_index(ROOT / INDEX)
    for rel in ["README.md", "docs/results.md", "docs/results/index.yaml",
                *(f"docs/results/{r.file}" for r in index.records.values())]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert hand_typed(tmp_path) == []
    v = figure_values(index, tmp_path / INDEX.parent)
    speed, tau, minutes = v["amx_tree"], v["amx_tree_tau"], v["avx2_demo_min"]  # 2.03, 3.56, 39.8 as recorded
    assert telling(speed) and telling(tau) and telling(minutes) and not telling("1.00") and not telling("0.58")
    readme = tmp_path / "README.md"
    text = readme.read_text()
    readme.write_text(text + f"\nOther units: {speed} GiB, v{speed}, {speed}1×, {tau}.0, {minutes} GiB.\n")
    assert hand_typed(tmp_path) == []
    readme.write_text(text + f"\nThe tree ran at {speed}× `generate` there, τ {tau}, in {minutes} minutes.\n")
    found = [f.split(": ", 1)[1] for f in hand_typed(tmp_path)]
    assert found == [f"{speed}× (amx_tree)", f"τ {tau} (amx_tree_tau)", f"{minutes} min (avx2_demo_min)"], found
