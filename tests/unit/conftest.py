"""Helpers that several unit modules share: a shipped benchmark spec pointed at one of tests/fixtures/."""

from __future__ import annotations

from d3d.data.prompts import benchmark_spec
from tests.conftest import FIXTURES


def with_local(name: str, fixture: str) -> dict:
    spec = benchmark_spec(name)
    spec["local_file"] = str(FIXTURES / fixture)
    spec["sources"] = ["local"]
    return spec
