"""Task-level grading: math answer extraction and code execution in a subprocess."""

from __future__ import annotations

import pytest

from d3d.data.benchmarks import Record, load_benchmark
from d3d.data.prompts import benchmark_spec
from d3d.grading import extract_answer, extract_code, grade, normalise_answer


@pytest.mark.parametrize("text, expected", [
    ("So she has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("The total is \\boxed{1,200} dollars.", "1,200"),
    ("Thus \\boxed{\\frac{3}{4}} and later \\boxed{\\dfrac{1}{2}}", "\\dfrac{1}{2}"),  # the last box
    ("The answer is 42.", "42"),
    ("First 5 then 6, finally 18 eggs", "18"),
    ("no numbers here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("a, b", [("1,000.0", "1000"), ("$18$", "18"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
                                  ("\\text{(B)}", "(B)"), ("0.50", ".5"), ("90^\\circ", "90")])
def test_normalised_answers_match(a, b):
    assert normalise_answer(a) == normalise_answer(b)


def test_different_answers_do_not_match():
    assert normalise_answer("12") != normalise_answer("1.2")
    spec = {"loader": "gsm8k"}
    rec = Record("gsm8k/0", ["q"], "18")
    assert grade(spec, rec, "... so \\boxed{18}")["correct"] is True
    assert grade(spec, rec, "... so \\boxed{19}")["correct"] is False
    assert grade(spec, rec, "I do not know")["correct"] is False
    assert grade(spec, rec, "anything", turn=1)["correct"] is None


def test_extract_code_fenced_unfenced_and_cut_off():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("    return x + 1\n") == "    return x + 1\n"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"


@pytest.fixture(scope="module")
def humaneval(cache_dir):
    return load_benchmark(benchmark_spec("humaneval"), cache_dir)


def test_humaneval_canonical_passes_and_wrong_fails(humaneval):
    spec = benchmark_spec("humaneval")
    rec = humaneval[0]
    body = rec.metadata["canonical_solution"]
    assert grade(spec, rec, f"```python\n{rec.reference['prompt']}{body}```")["correct"] is True
    assert grade(spec, rec, body)["correct"] is True  # a bare body continues the prompt
    wrong = grade(spec, rec, "```python\n" + rec.reference["prompt"] + "    return None\n```")
    assert wrong["correct"] is False and wrong["error"]


def test_code_that_hangs_times_out(humaneval):
    spec = benchmark_spec("humaneval")
    out = grade(spec, humaneval[0], "    while True:\n        pass\n", timeout_s=2)
    assert out == {"answer": None, "correct": False, "error": ["timeout"]}


def test_mbpp_tests_run():
    spec = {"loader": "mbpp"}
    rec = Record("mbpp/1", ["Write add."], {"tests": ["assert add(1, 2) == 3"], "setup": ""})
    assert grade(spec, rec, "```python\ndef add(a, b):\n    return a + b\n```")["correct"] is True
    assert grade(spec, rec, "```python\ndef add(a, b):\n    return a - b\n```")["correct"] is False


def test_mbpp_canonical_solution_from_the_fixture_passes(cache_dir):
    from d3d.data.benchmarks import load_records
    from tests.test_benchmarks import with_local

    spec = with_local("mbpp", "mbpp.jsonl")
    records, _ = load_records(spec, cache_dir)
    for rec in records:
        assert grade(spec, rec, f"```python\n{rec.metadata['canonical_solution']}\n```")["correct"] is True
        assert grade(spec, rec, "```python\npass\n```")["correct"] is False
