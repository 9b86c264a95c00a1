"""The README's front is what a newcomer reads first: the quickstart up to the next section fits 40
lines and holds exactly two commands, they and `make bench` are Makefile targets, the tree's command (after
the demo) binds with the tree
among its methods, the glossary defines the words the front uses, and no line speaks of how or where
the project was built."""

from __future__ import annotations

import re
import shlex

from d3d.settings import bind_config, method_configs
from tests.conftest import ROOT, compose

README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    return README[start + 1: README.find("\n## ", start + 1)]


def test_the_quickstart_up_to_the_next_section_is_at_most_40_lines():
    assert len(section("Quickstart").rstrip("\n").splitlines()) <= 40


def test_the_front_commands_are_makefile_targets():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"`?make ([a-z][\w-]*)", section("Quickstart")))
    assert {"demo", "test", "bench"} <= named and named <= targets


def test_the_quickstart_has_exactly_two_commands_for_a_fresh_machine():
    fresh = section("Quickstart").split("\n### ")[0]  # what a fresh machine runs, before "After the demo"
    blocks = re.findall(r"```bash\n(.*?)```", fresh, flags=re.S)
    commands = [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]


def test_the_trees_command_runs_the_tree(tmp_path):
    line = next(b for b in re.findall(r"```bash\n(.*?)```", section("Quickstart").split("\n### After the demo")[1], flags=re.S)
                if "d3d.eval" in b).strip()
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "d3d.eval"]
    cfg = compose("eval", argv[3:], tmp_path)
    methods = method_configs(cfg, bind_config(cfg, "eval").eval)
    assert [dc.method for dc in methods.values()] == ["ar", "tree"]


def test_the_glossary_defines_the_fronts_words():
    terms = re.findall(r"^- \*\*([^*]+)\*\*:", section("Glossary"), flags=re.M)
    assert {"block (B)", "τ", "tray", "hit", "retention", "draft vocabulary"} <= set(terms)


def test_the_gpu_section_follows_the_glossary():
    heads = re.findall(r"^## (.+)$", README, flags=re.M)
    assert heads[:3] == ["Quickstart (CPU only, no GPU, no Hugging Face Hub)", "Glossary", "On a GPU node (Qwen3)"]


def test_no_line_speaks_of_how_or_where_the_project_was_built():
    assert not re.search(r"\b(session|helper|lent|issue #?\d+)", README, flags=re.I)
