"""vllm.sampling_params of the stand-in (tests/stub_engine.py)."""

from tests.stub_engine import RequestOutputKind, SamplingParams  # noqa: F401
