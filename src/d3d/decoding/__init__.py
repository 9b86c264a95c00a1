"""Decoding: one verification, one KV-cache discipline, three loops (AR baseline, sync, async)."""

from d3d.decoding.engine import DecodeConfig, GenerationResult, SpecGenerator

__all__ = ["DecodeConfig", "GenerationResult", "SpecGenerator"]
