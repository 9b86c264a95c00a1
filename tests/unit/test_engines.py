"""Generation backends (d3d.models.engines) without an engine installed: the one-line refusals, the
folder and row bookkeeping, the thinking switch. The engine itself runs in tests/integration/test_engines.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from d3d.config import ConfigError
from d3d.models import engines


def test_unknown_backend_is_one_line_with_the_choices():
    with pytest.raises(ConfigError, match=r"generate.backend='tgi' is not a backend. Fix: use one of hf, vllm, sglang"):
        engines.check_backend("tgi")


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_missing_engine_names_the_install(monkeypatch, name):
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda module: None)
    with pytest.raises(ConfigError, match=rf"generate.backend={name} needs {name}.*Fix: pip install"):
        engines.check_backend(name)
    engines.check_backend("hf")  # the reference needs nothing more


def test_an_engine_refuses_several_processes(monkeypatch):
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda module: object())
    engines.check_backend("vllm", num_processes=1)
    with pytest.raises(ConfigError, match="runs in one process .2 were launched"):
        engines.check_backend("vllm", num_processes=2)


def test_generate_refuses_a_missing_engine_before_reading_prompts_or_loading(monkeypatch, tmp_path):
    from d3d import generate
    from tests.conftest import compose

    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda module: None)

    def must_not_run(*a, **k):
        raise AssertionError("work started before the backend was checked")

    monkeypatch.setattr(generate, "load_prompt_set", must_not_run)
    monkeypatch.setattr(generate, "load_model", must_not_run)
    cfg = compose("generate", ["+experiment=smoke", "generate.backend=vllm"], tmp_path)
    with pytest.raises(ConfigError, match="needs vllm"):
        generate.run_generate(cfg)


def _meta(tmp_path, settings):
    (tmp_path / "meta.json").write_text(json.dumps({"target": {"name": "t", "path": "t"}, "settings": settings}))


def test_a_folder_from_before_backends_resumes_as_hf_and_refuses_an_engine(tmp_path):
    from d3d.generate import OutputMismatchError, check_output_folder

    old = {"max_new_tokens": 8, "do_sample": False}  # written before `backend` was a setting
    _meta(tmp_path, old)
    target = {"name": "t", "path": "t"}
    check_output_folder(tmp_path, {"target": target, "settings": {**old, "backend": "hf"}}, holds_rows=True)
    with pytest.raises(OutputMismatchError, match="settings"):
        check_output_folder(tmp_path, {"target": target, "settings": {**old, "backend": "vllm"}}, holds_rows=True)


def _rows(tmp_path, backends):
    rows = [{"id": f"p{i}", "prompt_ids": [1, 2], "response_ids": [3, 4],
             "settings": {} if b is None else {"backend": b}} for i, b in enumerate(backends)]
    (tmp_path / "responses.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_training_refuses_a_folder_of_two_backends_unless_told(tmp_path):
    from d3d.data.responses import read_responses, row_backends
    from d3d.training import load_examples

    _rows(tmp_path, [None, "hf", "vllm"])  # a row without the key is an hf row
    assert row_backends(read_responses(tmp_path)) == {"hf": 2, "vllm": 1}
    with pytest.raises(ConfigError, match=r"mixes responses .*2 rows from hf, 1 rows from vllm.*allow_mixed_backends=true"):
        load_examples(tmp_path, 16)
    assert len(load_examples(tmp_path, 16, allow_mixed_backends=True)) == 3


def test_one_backend_trains(tmp_path):
    from d3d.training import load_examples

    _rows(tmp_path, ["vllm", "vllm"])
    assert len(load_examples(tmp_path, 16)) == 2


def test_thinking_on_a_template_without_the_switch_is_refused():
    from d3d.data.chat import require_thinking_switch

    plain = SimpleNamespace(chat_template="{{ messages }}", name_or_path="smol")
    with pytest.raises(ConfigError, match="generate.enable_thinking=true but the chat template of 'smol' has no"):
        require_thinking_switch(plain, "generate.enable_thinking")
    require_thinking_switch(SimpleNamespace(chat_template="{% if enable_thinking %}", name_or_path="q3"),
                            "generate.enable_thinking")


def test_every_backend_option_group_is_in_the_config():
    """generate.<engine> holds that engine's constructor options (free-form: the engine checks them)."""
    from d3d.config import compose

    gen = compose("generate").generate
    assert gen.backend == "hf"
    assert set(engines.ENGINES) <= set(gen)


def test_a_target_without_a_chat_template_is_one_line():
    """A base model's tokenizer has no chat template: a ValueError, so the CLI showed a traceback (issue 38)."""
    from d3d.data.chat import chat_prompt_ids

    with pytest.raises(ConfigError, match=r"^tokenizer 'base' has no chat template\. Fix: use an instruct/chat model"):
        chat_prompt_ids(SimpleNamespace(chat_template=None, name_or_path="base"), [{"role": "user", "content": "hi"}])
