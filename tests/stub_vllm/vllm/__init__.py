"""A stand-in for vLLM on a GPU node (tests/stub_engine.py says what it does and how to use it)."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from tests.stub_engine import LLM, SamplingParams  # noqa: E402,F401
