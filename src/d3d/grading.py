"""Task-level checks: is an answer right? Used to show losslessness at the task level (DESIGN §7).

At T = 0 a lossless method returns the AR tokens, so its verdicts must equal AR's; a verdict that
differs is a bug even if the token comparison were somehow fooled. Cheap checks only:
- math (GSM8K, MATH-500, AIME): the final answer (\\boxed{...}, "####", "answer is", else the last
  number) compared with the reference after light normalisation;
- code (HumanEval, MBPP): the completion's code run against the benchmark's tests in a separate
  Python process with a time limit (never in this process: model output is untrusted code).
Other benchmarks (MT-Bench, LiveCodeBench, Alpaca) get `None`: no cheap reference check exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from decimal import Decimal
from typing import Any, Mapping

from d3d.data.benchmarks import Record

MATH_LOADERS = {"gsm8k", "math500", "aime24", "aime25"}
CODE_LOADERS = {"humaneval", "mbpp"}

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


# ---------------------------------------------------------------------------- code execution

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The fenced code blocks of a reply, joined; the whole reply when it has none (or an unclosed one)."""
    blocks = CODE_BLOCK.findall(text)
    if blocks:
        return "\n\n".join(blocks)
    if "```" in text:  # cut off before the closing fence
        return text.split("```", 1)[1].split("\n", 1)[-1]
    return text


def run_python(program: str, timeout_s: float) -> tuple[bool, str]:
    """Run a program in a fresh interpreter (isolated mode, temp cwd); passed = exit status 0."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "check.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, capture_output=True, text=True,
                                  timeout=timeout_s, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False, "timeout"
    return proc.returncode == 0, proc.stderr[-500:]


def humaneval_program(record: Record, text: str) -> str:
    ref = record.reference
    code = extract_code(text)
    # A reply that restates the function is complete; else it is the body after the prompt.
    body = code if f"def {ref['entry_point']}" in code else ref["prompt"] + code
    return f"{body}\n\n{ref['test']}\n\ncheck({ref['entry_point']})\n"


def mbpp_program(record: Record, text: str) -> str:
    ref = record.reference
    return "\n".join([ref.get("setup") or "", extract_code(text), *ref["tests"]]) + "\n"


# ---------------------------------------------------------------------------- one entry point


def grade(spec: Mapping[str, Any], record: Record, text: str, turn: int = 0,
          timeout_s: float = 10.0) -> dict[str, Any]:
    """{"answer": ..., "correct": True/False/None} for one reply (None: not checkable)."""
    loader = spec["loader"]
    if turn > 0 or record.reference is None:
        return {"answer": None, "correct": None}
    if loader in MATH_LOADERS:
        answer, ok = math_correct(text, record.reference)
        return {"answer": answer, "correct": ok}
    if loader in CODE_LOADERS:
        program = humaneval_program(record, text) if loader == "humaneval" else mbpp_program(record, text)
        ok, err = run_python(program, timeout_s)
        return {"answer": None, "correct": ok, **({} if ok else {"error": err.strip().splitlines()[-1:]})}
    return {"answer": None, "correct": None}
