"""Training prompts never overlap an evaluation subset."""

from __future__ import annotations

import pytest

from d3d.data.benchmarks import load_benchmark, normalise_text
from d3d.data.prompts import EmptyPromptSetError, load_prompt_set
from d3d.settings import bind_config, shipped_benchmark
from tests.conftest import FIXTURES, compose

EVAL = ["gsm8k", "math500", "aime24", "aime25", "humaneval", "mt_bench"]


def test_cpu_prompts_disjoint_from_every_eval_subset(cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("generate"), "generate").data
    cfg.limit = None
    prompts = load_prompt_set(cfg, cache_dir, shipped_benchmark)
    assert len(prompts) == (1319 - 128) + (311 - 128)
    train_texts = {normalise_text(p.text) for p in prompts}
    train_ids = {p.id.removeprefix("train/") for p in prompts}
    for name in EVAL:
        for rec in load_benchmark(shipped_benchmark(name), cache_dir):
            assert rec.id not in train_ids
            assert not any(normalise_text(t) in train_texts for t in rec.turns), rec.id


def test_limit_is_seeded(cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = bind_config(compose("generate"), "generate").data
    a = [p.id for p in load_prompt_set(cfg, cache_dir, shipped_benchmark)]
    b = [p.id for p in load_prompt_set(cfg, cache_dir, shipped_benchmark)]
    assert a == b and len(a) == cfg.limit


def test_local_prompt_file(cache_dir):
    cfg = bind_config(compose("generate", ["data=local", f"data.local_file={FIXTURES / 'prompts.jsonl'}"]), "generate").data
    prompts = load_prompt_set(cfg, cache_dir, shipped_benchmark)
    assert [p.id for p in prompts] == ["p0", "p1", "p2", "p3", "p4", "p5"]
    assert prompts[1].messages == [{"role": "user", "content": "Count to five."}]


def test_empty_prompt_set_fails_early(cache_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = bind_config(compose("generate", ["data=local", f"data.local_file={empty}"]), "generate").data
    with pytest.raises(EmptyPromptSetError, match="empty"):
        load_prompt_set(cfg, cache_dir, shipped_benchmark)


@pytest.mark.parametrize("text,match", [
    ('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "yo"\n', r"prompts.jsonl:2 is not JSON"),
    ('{"id": "a", "prompt": "hi"}\n{"id": "b", "promt": "yo"}\n',
     r"prompts.jsonl:2: a prompt row needs 'prompt': .* its fields are \['id', 'promt'\]\. Fix"),
    ('{"id": "a", "messages": [{"role": "system", "content": "x"}]}\n', r"prompts.jsonl:1: a prompt row needs"),
])
def test_a_malformed_prompt_file_names_its_file_and_line(cache_dir, tmp_path, text, match):
    """These were a JSONDecodeError, a KeyError or a StopIteration naming neither file nor line."""
    from d3d.data.benchmarks import MalformedFile

    (tmp_path / "prompts.jsonl").write_text(text)
    cfg = compose("generate", ["data=local", f"data.local_file={tmp_path / 'prompts.jsonl'}"]).data
    with pytest.raises(MalformedFile, match=match):
        load_prompt_set(cfg, cache_dir, shipped_benchmark)


def test_a_missing_prompt_file_is_one_line_with_the_key(cache_dir, tmp_path):
    from d3d.errors import ConfigError

    cfg = compose("generate", ["data=local", f"data.local_file={tmp_path / 'nope.jsonl'}"]).data
    with pytest.raises(ConfigError, match=r"^data.local_file=.*nope.jsonl: .* is not a file\. Fix"):
        load_prompt_set(cfg, cache_dir, shipped_benchmark)


@pytest.mark.parametrize("kind, match", [
    ("latin1", r"latin1.jsonl: byte 17 is not UTF-8 .* Fix: save the file as UTF-8"),
    ("directory", r"^data.local_file=.*directory.jsonl: .* is not a file\. Fix"),
    ("fifo", r"^data.local_file=.*fifo.jsonl: .* is not a file\. Fix"),
    ("loop", r"^data.local_file=.*loop.jsonl: .* is not a file\. Fix"),
])
def test_a_prompt_file_that_is_no_utf8_file_is_one_line(cache_dir, tmp_path, kind, match):
    """latin-1 bytes and a symlink loop were tracebacks (UnicodeDecodeError, RuntimeError) (issue 38)."""
    from d3d.errors import ConfigError
    from tests.unit.test_benchmarks import _hostile_path

    path = _hostile_path(tmp_path, kind)
    cfg = compose("generate", ["data=local", f"data.local_file={path}"]).data
    with pytest.raises(ConfigError, match=match):
        load_prompt_set(cfg, cache_dir, shipped_benchmark)


def test_two_prompts_under_one_id_are_refused(cache_dir, tmp_path):
    """generate keyed the prompts' token ids by id: of two prompts sharing one, both rows got the
    second's response under their own messages, training pairs that never happened (issue 38)."""
    from d3d.data.benchmarks import MalformedFile

    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "hi"}\n{"id": "a", "prompt": "bye"}\n')
    cfg = compose("generate", ["data=local", f"data.local_file={tmp_path / 'prompts.jsonl'}"]).data
    with pytest.raises(MalformedFile, match=r"prompts.jsonl:2: id 'a' again, for another prompt \(first at .*prompts.jsonl:1\)"):
        load_prompt_set(cfg, cache_dir, shipped_benchmark)
