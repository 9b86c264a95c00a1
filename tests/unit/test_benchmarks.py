"""Benchmark registry: loaders on fixtures of every source schema, real shipped data counts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from d3d.data.benchmarks import (
    BenchmarkUnavailable, format_turn, load_benchmark, load_records, seeded_subset,
)
from d3d.settings import shipped_benchmark
from tests.unit.conftest import with_local


@pytest.mark.parametrize("name,fixture,count", [
    ("mbpp", "mbpp.jsonl", 3), ("livecodebench", "livecodebench.jsonl", 2), ("alpaca", "alpaca.jsonl", 3),
    ("gsm8k", "gsm8k_hub.jsonl", 2), ("math500", "math500_hub.jsonl", 2), ("mt_bench", "mt_bench_hub.jsonl", 1),
])
def test_loader_on_fixture(name, fixture, count, cache_dir):
    records, source = load_records(with_local(name, fixture), cache_dir)
    assert source.kind == "local" and source.items == len(records) == count
    assert all(r.id.startswith(name) and r.turns and all(r.turns) for r in records)


def test_fixture_formats(cache_dir):
    gsm, _ = load_records(with_local("gsm8k", "gsm8k_hub.jsonl"), cache_dir)
    assert [r.reference for r in gsm] == ["7", "400"]  # '#### 1,200'-style answers lose commas
    spec = with_local("mbpp", "mbpp.jsonl")
    mbpp, _ = load_records(spec, cache_dir)
    text = format_turn(spec, mbpp[0])
    assert "remove first and last occurrence" in text and 'assert remove_Occ("hello","l") == "heo"' in text
    mt, _ = load_records(with_local("mt_bench", "mt_bench_hub.jsonl"), cache_dir)
    assert mt[0].turns == ["Write a haiku about autumn.", "Now rewrite it about spring."]
    math = shipped_benchmark("gsm8k")
    assert format_turn(math, gsm[0]).endswith("put your final answer within \\boxed{}.")


def test_hub_only_benchmark_is_unavailable_offline(cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BenchmarkUnavailable, match="local_file"):
        load_records(shipped_benchmark("mbpp"), cache_dir)


def test_seeded_subset_is_deterministic_and_ordered(cache_dir):
    records, _ = load_records(with_local("alpaca", "alpaca.jsonl"), cache_dir)
    records = records * 10
    a, b = seeded_subset(records, 5, 3), seeded_subset(records, 5, 3)
    assert [id(r) for r in a] == [id(r) for r in b]
    assert seeded_subset(records, 100, 0) == records


@pytest.mark.parametrize("name,total,subset", [
    ("gsm8k", 1319, 128), ("math500", 311, 128), ("aime24", 30, 30), ("aime25", 30, 30),
    ("humaneval", 164, 164), ("mt_bench", 80, 80),
])
def test_real_shipped_data_counts(name, total, subset, cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the PyPI copy, not the hub
    spec = shipped_benchmark(name)
    records, source = load_records(spec, cache_dir)
    assert source.kind == "offline" and source.items == len(records) == total
    # MATH-500 lists the hub first: its offline items are a fallback, said as such
    assert bool(source.instead_of) == ("hub" in spec.sources[: spec.sources.index("offline")])
    assert len(load_benchmark(spec, cache_dir)) == subset
    assert len({r.id for r in records}) == total


def test_list_command(capsys, cache_dir, monkeypatch):
    from d3d.benchmarks import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "1319" in out and "skipped" in out


def local_spec(tmp_path, text: str, name="gsm8k", filename="bench.jsonl"):
    path = tmp_path / filename
    path.write_text(text)
    return replace(shipped_benchmark(name), local_file=str(path))  # the shipped sources stay listed after local, as in conf/


def test_a_mistyped_local_file_is_refused_not_replaced_by_the_shipped_data(cache_dir, monkeypatch, tmp_path):
    """It used to fall through to the offline copy: rc 0, results attributed to the missing file."""
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = replace(shipped_benchmark("gsm8k"), local_file=str(tmp_path / "gsm8k_typo.jsonl"))
    with pytest.raises(ConfigError, match=r"^benchmark.specs.gsm8k.local_file=.*gsm8k_typo.jsonl: .* is not a file. Fix"):
        load_records(spec, cache_dir)


@pytest.mark.parametrize("text,match", [
    ('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n',
     r"bench.jsonl:2 is not JSON \(.*\)\. Fix: repair or delete that line"),
    ('{"question": "a", "answer": "1"}\n["question", "b"]\n', r"bench.jsonl:2 is a JSON list, not an object"),
    ('{"question": "a", "answer": "1"}\n\n{"qestion": "b", "answer": "2"}\n',
     r"bench.jsonl:3: as a gsm8k item this row needs the field 'question'; its fields are \['answer', 'qestion'\]\. Fix"),
    ("", r"local_file=.*bench.jsonl: .* holds no rows\. Fix"),
])
def test_a_malformed_benchmark_file_names_its_file_and_line(cache_dir, monkeypatch, tmp_path, text, match):
    """A broken line, a misnamed field or an empty file: a JSONDecodeError or a KeyError naming
    neither file nor line before (or, for the empty file, a fall-through to the shipped data)."""
    from d3d.data.benchmarks import MalformedFile

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MalformedFile, match=match):
        load_records(local_spec(tmp_path, text), cache_dir)


def test_a_math_item_without_its_question_is_refused(cache_dir, tmp_path):
    """MATH-style rows read `problem` or `question`: without either the prompt used to be "None"."""
    from d3d.data.benchmarks import MalformedFile

    with pytest.raises(MalformedFile, match=r"bench.jsonl:1: as a math500 item this row needs the field 'problem \(or question\)'"):
        load_records(local_spec(tmp_path, '{"Problm": "1+1", "answer": "2"}\n', "math500"), cache_dir)


def test_a_broken_json_file_names_its_line(cache_dir, tmp_path):
    from d3d.data.benchmarks import MalformedFile

    with pytest.raises(MalformedFile, match=r"bench.json:3 is not JSON"):
        load_records(local_spec(tmp_path, '[\n{"question": "a", "answer": "1"},\n{"question": }\n]\n', filename="bench.json"),
                     cache_dir)


def _hostile_path(tmp_path, kind: str):
    """A benchmark or prompt file path that is no readable UTF-8 file: latin-1 bytes, a directory, a FIFO,
    a symlink loop."""
    import os

    path = tmp_path / f"{kind}.jsonl"
    if kind == "latin1":
        path.write_bytes('{"question": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opening it would block for ever: never opened
    elif kind == "loop":
        os.symlink(tmp_path / "loop_b.jsonl", path)
        os.symlink(path, tmp_path / "loop_b.jsonl")
    return path


@pytest.mark.parametrize("kind, match", [
    ("latin1", r"latin1.jsonl: byte 17 is not UTF-8 \(invalid continuation byte\)\. Fix: save the file as UTF-8"),
    ("directory", r"^benchmark.specs.gsm8k.local_file=.*directory.jsonl: .* is not a file\. Fix"),
    ("fifo", r"^benchmark.specs.gsm8k.local_file=.*fifo.jsonl: .* is not a file\. Fix"),
    ("loop", r"^benchmark.specs.gsm8k.local_file=.*loop.jsonl: .* is not a file\. Fix"),
])
def test_a_benchmark_file_that_is_no_utf8_file_is_one_line(cache_dir, monkeypatch, tmp_path, kind, match):
    """latin-1 bytes were a UnicodeDecodeError traceback naming no file; a symlink loop a RuntimeError
    ("Symlink loop from ...") traceback (issue 38). A directory and a FIFO were already refused."""
    from d3d.errors import ConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = replace(shipped_benchmark("gsm8k"), local_file=str(_hostile_path(tmp_path, kind)))
    with pytest.raises(ConfigError, match=match):
        load_records(spec, cache_dir)


def test_two_items_under_one_id_are_refused_and_a_repeated_item_is_kept(cache_dir, tmp_path):
    """Rows are keyed by (benchmark, id, ...): the second of two math500 items sharing a unique_id never
    ran (the first's row counted as its), silently (issue 38). An item repeated whole stays as it was."""
    from d3d.data.benchmarks import MalformedFile

    a, b = '{"unique_id": "x", "problem": "1+1", "answer": "2"}', '{"unique_id": "x", "problem": "2+2", "answer": "4"}'
    with pytest.raises(MalformedFile, match=r"bench.jsonl:2: id 'math500/x' again, for another item \(first at "
                                            r".*bench.jsonl:1\).* Fix: give each item its own id"):
        load_records(local_spec(tmp_path, f"{a}\n{b}\n", "math500"), cache_dir)
    records, _ = load_records(local_spec(tmp_path, f"{a}\n{a}\n", "math500"), cache_dir)
    assert [r.id for r in records] == ["math500/x", "math500/x"]
