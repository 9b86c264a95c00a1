"""Figures quoted in Markdown pages, rendered from the records that hold them
(`python -m d3d.report results`; `--check` only compares).

An index (docs/results/index.yaml) names every record (its file under docs/results/, what ran, the
command that made it), every figure (a record and a key path into it) and every block of a
page: Markdown text whose `{figure}` fields the render fills with the figure's value, `{figure.cpu}`
with the machine as its record names it (d3d.utils.hardware.cpu_label: "CPU not recorded" where the
record holds none), `{figure.setup}` with what ran there, `{figure.record}` with a link to the
record, `{figure.command}` with the command that made it, `{figure.rerun}` with the one that makes
it again today. A figure shown as `shares` is a benchmark row's equality with its baseline: how many
of how many calls and tokens, and how the differing ones divide into near-tie flips and real
differences, or that they were not classified (records made before d3d.bench classified them). A block lives in
its page between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`; the render replaces what
is between the marks, so the prose around them stays hand-written and every number inside them is
one record's. tests/unit/test_figures.py fails when a checked-in page
differs from its render: a record that changed, or a number edited by hand.

A key path is segments joined by `/`: a mapping's key, a list's index, or `field=value` for the
element of a list whose `field` equals `value` (e.g. `summary/method=d3d_tree_n15/ratio`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from d3d.errors import ConfigError

INDEX = Path("docs/results/index.yaml")
FIELD = re.compile(r"\{([a-z0-9_]+)(?:\.(cpu|setup|record|command|rerun))?\}")


@dataclass
class Record:
    file: str  # under the index's folder
    setup: str  # what ran (models, dtype); the machine comes from the record itself
    command: str  # the command that made it, as it ran
    rerun: Optional[str] = None  # the command that makes it again today, where that changed (a bench preset)
    study: Optional[str] = None  # the study that reads it, under the index's folder
    cpu_key: str = "run/cpu"  # where the record keeps cpu_info(); a record without it: "CPU not recorded"
    # `lscpu`'s family and model where the record predates them and its study quotes them: the label
    # names them as the study's, not the record's
    study_family: Optional[int] = None
    study_model: Optional[int] = None


@dataclass
class Figure:
    record: str
    key: str
    format: str = ".2f"  # or "shares": the key names a benchmark's summary row (see the module's docstring)
    divide: float = 1.0  # e.g. 60: seconds recorded, minutes quoted


@dataclass
class Block:
    page: str  # relative to the repository root
    text: str


@dataclass
class Index:
    records: dict[str, Record]
    figures: dict[str, Figure]
    blocks: dict[str, Block] = field(default_factory=dict)


def load_index(path: Path) -> Index:
    """The index, typed by OmegaConf's structured configs (an unknown key or a wrong type is one line)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Index), OmegaConf.load(path)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}. Fix: see the index's header for its fields.") from None


def lookup(data: Any, key: str, where: str) -> Any:
    """The value at key path `key` in `data` (the module docstring says the syntax)."""
    node = data
    for seg in key.split("/"):
        name, eq, want = seg.partition("=")
        if eq and isinstance(node, list):
            found = [x for x in node if isinstance(x, dict) and str(x.get(name)) == want]
            if len(found) != 1:
                raise ConfigError(f"{where}: key {key!r}: {len(found)} elements with {name}={want}. Fix: name one.")
            node = found[0]
        elif isinstance(node, list) and seg.lstrip("-").isdigit():
            node = node[int(seg)]
        elif isinstance(node, dict) and seg in node:
            node = node[seg]
        else:
            raise ConfigError(f"{where}: key {key!r}: no {seg!r} there. Fix: correct the key path in the index.")
    return node


def shares(entry: dict, data: dict) -> str:
    """A summary row's equality with its baseline: calls and tokens it rests on, and the differing
    calls by class. Records of scripts/bench_decode.py keep no counts in the row: its rows give them."""
    calls, tokens = entry.get("calls"), entry.get("new_tokens")
    if calls is None or tokens is None:
        rows = [r for r in data.get("rows", []) if r.get("method") == entry.get("method")]
        calls, tokens = len(rows), sum(r["new_tokens"] for r in rows)
    equal = round(entry["equal_rate"] * calls)
    text = f"{equal} of {calls} calls ({tokens} tokens)"
    if equal == calls:
        return text
    if entry.get("near_tie_rate") is None:
        differ = "the 1 that differs" if calls - equal == 1 else f"the {calls - equal} that differ"
        return f"{text}; {differ} not classified (an older record: d3d.bench did not classify differences then)"
    near, real = round(entry["near_tie_rate"] * calls), round(entry["real_rate"] * calls)
    return f"{text}; of the {calls - equal} that differ, {near} near-tie bf16 flips, {real} real differences"


def machine(rec: Record, data: Any) -> str:
    """The machine a record ran on, as the record names it (see cpu_label), family and model from its
    study where the index gives them and the record does not hold them."""
    from d3d.utils.hardware import cpu_label

    def at(key):
        try:
            return lookup(data, key, "")
        except ConfigError:
            return None

    cpu, cuda = at(rec.cpu_key), at("run/cuda")
    if cpu and cpu.get("family") is None and rec.study_family is not None:
        cpu = {**cpu, "family": rec.study_family, "model_number": rec.study_model}
        return cpu_label(cpu, cuda, noted="from its study's lscpu, not the record")
    return cpu_label(cpu, cuda)


def load_records(index: Index, folder: Path) -> dict[str, Any]:
    """{record name: its data}, each file read once."""
    loaded: dict[str, Any] = {}
    for name, rec in index.records.items():
        path = folder / rec.file
        if not path.is_file():
            raise ConfigError(f"records.{name}.file={rec.file}: {path} does not exist. Fix: correct the file name.")
        loaded[name] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def figure_values(index: Index, folder: Path) -> dict[str, str]:
    """Every figure of the index, formatted, read from its record."""
    loaded = load_records(index, folder)
    out = {}
    for name, fig in index.figures.items():
        if fig.record not in index.records:
            raise ConfigError(f"figures.{name}.record={fig.record}: no such record in the index. Fix: add it under records.")
        value = lookup(loaded[fig.record], fig.key, f"figures.{name}")
        rec = index.records[fig.record]
        if fig.format == "shares":
            if not isinstance(value, dict) or "equal_rate" not in value:
                raise ConfigError(f"figures.{name}: {fig.key!r} in {rec.file} is not a benchmark row with an equal_rate. "
                                  f"Fix: point the key at a summary row.")
            out[name] = shares(value, loaded[fig.record])
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"figures.{name}: {fig.key!r} in {rec.file} is {value!r}, not a number. Fix: point the key "
                              f"at a number.")
        out[name] = format(value / fig.divide, fig.format)
    return out


def render_block(index: Index, name: str, values: dict[str, str], folder: Path, root: Path,
                 machines: dict[str, str]) -> str:
    """A block's text with its fields filled in; record links relative to the block's page."""
    block = index.blocks[name]
    page_dir = (root / block.page).parent

    def fill(m: re.Match) -> str:
        fig, attr = m.group(1), m.group(2)
        if fig not in index.figures:
            raise ConfigError(f"blocks.{name}: field {{{fig}}} names no figure. Fix: add figures.{fig}, or correct it.")
        if attr is None:
            return values[fig]
        rec = index.records[index.figures[fig].record]
        if attr == "record":
            link = os.path.relpath(folder / rec.file, page_dir)
            return f"[{rec.file}]({link})"
        return {"cpu": machines[index.figures[fig].record], "setup": rec.setup, "command": rec.command,
                "rerun": rec.rerun or rec.command}[attr]

    return FIELD.sub(fill, block.text).rstrip("\n")


def marks(name: str) -> tuple[str, str]:
    return f"<!-- figures:{name} -->", f"<!-- /figures:{name} -->"


def rendered_pages(index_path: Path = INDEX, root: Path = Path(".")) -> dict[Path, tuple[str, str]]:
    """{page: (its text now, its text rendered)} for every page with a block."""
    index_path = root / index_path if not index_path.is_absolute() else index_path
    if not index_path.is_file():
        raise ConfigError(f"{index_path} does not exist: the pages' figures are rendered in a checkout. Fix: run "
                          f"`python -m d3d.report results` from the repository's root.")
    index = load_index(index_path)
    folder = index_path.parent
    values = figure_values(index, folder)
    records = load_records(index, folder)
    machines = {name: machine(rec, records[name]) for name, rec in index.records.items()}
    pages: dict[Path, tuple[str, str]] = {}
    for name, block in index.blocks.items():
        page = root / block.page
        if page not in pages:
            text = page.read_text(encoding="utf-8")
            pages[page] = (text, text)
        now, new = pages[page]
        start, end = marks(name)
        i, j = new.find(start), new.find(end)
        if i < 0 or j < i:
            raise ConfigError(f"blocks.{name}: {block.page} has no {start} ... {end} pair. Fix: put the two marks where "
                              f"the block goes.")
        new = new[: i + len(start)] + "\n" + render_block(index, name, values, folder, root, machines) + "\n" + new[j:]
        pages[page] = (now, new)
    return pages


def render(check: bool = False, root: Path = Path(".")) -> list[Path]:
    """Write every page whose blocks differ from their render (check: write nothing); the pages that differed."""
    differ = []
    for page, (now, new) in rendered_pages(root=root).items():
        if now != new:
            differ.append(page)
            if not check:
                page.write_text(new, encoding="utf-8")
    return differ
