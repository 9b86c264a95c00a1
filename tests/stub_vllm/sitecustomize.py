"""With tests/stub_vllm first on PYTHONPATH, every Python process records its CUDA probes from its
start, and `import vllm` finds the stand-in (tests/stub_engine.py says what it does)."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)  # `tests` importable, after everything the process would import anyway

from tests.stub_engine import record_cuda_probes  # noqa: E402

record_cuda_probes()
