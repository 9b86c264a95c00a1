"""Data: benchmarks (evaluation) and prompt sets (training), offline-first."""

from d3d.data.benchmarks import (
    BenchmarkUnavailable, Record, format_turn, load_benchmark, load_records, seeded_subset,
)
from d3d.data.prompts import EmptyPromptSetError, Prompt, load_prompt_set

__all__ = ["BenchmarkUnavailable", "EmptyPromptSetError", "Prompt", "Record", "format_turn",
           "load_benchmark", "load_prompt_set", "load_records", "seeded_subset"]
