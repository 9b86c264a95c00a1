"""Helpers that several unit modules share: a shipped benchmark spec pointed at one of tests/fixtures/."""

from __future__ import annotations

from dataclasses import replace

from d3d.settings import shipped_benchmark
from d3d.specs import BenchmarkSpec
from tests.conftest import FIXTURES


def with_local(name: str, fixture: str) -> BenchmarkSpec:
    return replace(shipped_benchmark(name), local_file=str(FIXTURES / fixture), sources=["local"])
