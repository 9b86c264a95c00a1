"""What a reply answers: the final answer of a math reply, the code of a code reply, and the program
(answer, tests) a code benchmark's record makes of that code."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Callable

from d3d.data.benchmarks import Record


# ---------------------------------------------------------------------------- math answers


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The model's final answer: boxed, then '####', then 'answer is', then the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1]
            num = NUMBER.search(tail)
            if num:
                return num.group(0)
    nums = NUMBER.findall(text)
    return nums[-1] if nums else None


def normalise_answer(ans: str) -> str:
    """Strip LaTeX dressing, units of formatting, and trailing zeros so '1,000.0' == '1000'."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|\s)", "", s)
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace(" ", "").replace("\\%", "").replace("%", "").rstrip(".")
    if re.fullmatch(r"-?[\d,]*\.?\d+", s):
        s = format(Decimal(s.replace(",", "")).normalize(), "f")
    return s


def math_correct(text: str, reference: str | None) -> tuple[str | None, bool | None]:
    if reference is None:
        return None, None
    answer = extract_answer(text)
    if answer is None:
        return None, False
    return answer, normalise_answer(answer) == normalise_answer(str(reference))


# ---------------------------------------------------------------------------- code answers

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The fenced code blocks of a reply, joined; the whole reply when it has none (or an unclosed one)."""
    blocks = CODE_BLOCK.findall(text)
    if blocks:
        return "\n\n".join(blocks)
    if "```" in text:  # cut off before the closing fence
        return text.split("```", 1)[1].split("\n", 1)[-1]
    return text


def humaneval_program(record: Record, text: str) -> tuple[str, str]:
    """(answer, tests): a reply that restates the function is complete; else it is the body after the prompt."""
    ref = record.reference
    code = extract_code(text)
    answer = code if f"def {ref['entry_point']}" in code else ref["prompt"] + code
    return answer, f"{ref['test']}\n\ncheck({ref['entry_point']})\n"


def mbpp_program(record: Record, text: str) -> tuple[str, str]:
    """(answer, tests): the benchmark's setup code runs first, as part of the answer's program."""
    ref = record.reference
    return "\n".join([ref.get("setup") or "", extract_code(text)]) + "\n", "\n".join(ref["tests"]) + "\n"


# How a code benchmark's reply and tests become (answer, tests), by its parser (`spec.loader`): the
# test format is the parser's. A code benchmark without one (LiveCodeBench: stdin tests) is not checked.
PROGRAMS: dict[str, Callable[[Record, str], tuple[str, str]]] = {"humaneval": humaneval_program, "mbpp": mbpp_program}
