"""The pages' figures are their records': docs/results.md's front table and the README's headline
equal their render from docs/results/index.yaml, and a record that changes makes them differ."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from d3d.errors import ConfigError
from d3d.figures import FIELD, INDEX, load_index, lookup, render, rendered_pages
from tests.conftest import ROOT


def test_every_page_equals_its_render():
    for page, (now, new) in rendered_pages(root=ROOT).items():
        assert now == new, f"{page.relative_to(ROOT)} differs from its render: run `python -m d3d.report results`"


def test_every_figure_is_quoted_and_every_record_is_read():
    index = load_index(ROOT / INDEX)
    used = {m.group(1) for block in index.blocks.values() for m in FIELD.finditer(block.text)}
    assert sorted(set(index.figures) - used) == []
    assert sorted(set(index.records) - {f.record for f in index.figures.values()}) == []


def copy_of_the_pages(tmp_path):
    index = load_index(ROOT / INDEX)
    for rel in ["docs/results/index.yaml", *{b.page for b in index.blocks.values()},
                *(f"docs/results/{r.file}" for r in index.records.values())]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_a_changed_record_makes_both_pages_differ(tmp_path):
    root = copy_of_the_pages(tmp_path)
    record = root / "docs/results/decode_cpu_qwen_amx_trees.json"
    data = json.loads(record.read_text())
    lookup(data, "summary/method=d3d_tree_n15", "test")["ratio"] = 2.5  # the AMX tree's speedup
    record.write_text(json.dumps(data))
    assert sorted(p.relative_to(root).as_posix() for p in render(check=True, root=root)) == ["README.md", "docs/results.md"]
    render(root=root)  # the render writes the new figure between the marks, nowhere else
    readme = (root / "README.md").read_text()
    assert "**2.50× `generate`**" in readme and render(check=True, root=root) == []
    outside = re.sub(r"<!-- figures:(\w+) -->.*?<!-- /figures:\1 -->", "", readme, flags=re.S)
    assert outside == re.sub(r"<!-- figures:(\w+) -->.*?<!-- /figures:\1 -->", "", (ROOT / "README.md").read_text(),
                             flags=re.S)


def test_a_number_edited_by_hand_differs_from_the_render(tmp_path):
    root = copy_of_the_pages(tmp_path)
    page = root / "docs/results.md"
    page.write_text(page.read_text().replace("(10 tokens)", "(10 tokens) 9.99", 1))
    assert [p.relative_to(root).as_posix() for p in render(check=True, root=root)] == ["docs/results.md"]


@pytest.mark.parametrize("key,match", [
    ("summary/method=d3d_tree_n99/ratio", r"0 elements with method=d3d_tree_n99"),
    ("summary/method=d3d_tree_n15/speed", r"no 'speed' there"),
])
def test_a_key_path_that_finds_nothing_is_named(key, match):
    data = json.loads((ROOT / "docs/results/decode_cpu_qwen_amx_trees.json").read_text())
    with pytest.raises(ConfigError, match=match):
        lookup(data, key, "figures.x")


def test_a_page_without_its_marks_is_refused(tmp_path):
    root = copy_of_the_pages(tmp_path)
    (root / "README.md").write_text("# d3d\n")
    with pytest.raises(ConfigError, match=r"README.md has no <!-- figures:readme_figures -->"):
        render(check=True, root=root)


def test_the_machine_is_named_from_the_record_and_a_record_without_one_says_so(tmp_path):
    root = copy_of_the_pages(tmp_path)
    results = rendered_pages(root=root)[root / "docs/results.md"][1]
    assert "Qwen2.5-Coder 1.5B / 0.5B, fp32: CPU not recorded" in results  # decode_cpu_qwen.json holds no CPU
    assert "SmolLM2-135M, fp32: AMD EPYC (family/model not recorded), AVX2, no native bf16" in results
    assert "(family 25 model 17 from its study's lscpu, not the record; Zen 4), AVX-512 BF16" in results
    record = root / "docs/results/decode_cpu_qwen_amx_trees.json"
    data = json.loads(record.read_text())
    data["run"]["cpu"] |= {"model": "Some Xeon", "vendor": "GenuineIntel", "family": 6, "model_number": 143}
    record.write_text(json.dumps(data))
    readme = rendered_pages(root=root)[root / "README.md"][1]
    assert "Some Xeon (family 6 model 143), AMX, native bf16" in readme  # the record's own, the study's unused


def test_equality_shares_give_calls_tokens_and_the_class_of_each_difference(tmp_path):
    root = copy_of_the_pages(tmp_path)
    readme = rendered_pages(root=root)[root / "README.md"][1]
    # records of scripts/bench_decode.py: counted from their rows, differences never classified
    assert "token for token: 1.00, 4 of 4 calls (256 tokens)" in readme
    assert "Equal to `generate` in 3 of 6 calls (576 tokens); the 3 that differ not classified" in readme
    record = root / "docs/results/bench_prune_qwen_zen4.json"
    data = json.loads(record.read_text())
    row = lookup(data, "summary/method=d3d_tree_n15@unpruned", "test")
    row |= {"calls": 6, "new_tokens": 570, "equal_rate": 4 / 6, "near_tie_rate": 1 / 6, "real_rate": 1 / 6}
    record.write_text(json.dumps(data))
    readme = rendered_pages(root=root)[root / "README.md"][1]
    assert ("Equal to `generate` in 4 of 6 calls (570 tokens); of the 2 that differ, 1 near-tie bf16 flips, "
            "1 real differences") in readme
