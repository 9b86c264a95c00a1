"""Decoding: one verification, one KV-cache discipline, one driver, one step class per method
(AR baseline, sync, async; d3d.decoding.methods)."""

from d3d.decoding.engine import GenerationResult, SpecGenerator
from d3d.decoding.methods import DecodeConfig

__all__ = ["DecodeConfig", "GenerationResult", "SpecGenerator"]
