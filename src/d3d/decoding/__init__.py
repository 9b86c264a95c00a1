"""Decoding: one verification, one KV-cache discipline, one driver, and a table of methods, each a
shape of drafts (chain, tree) crossed with a schedule (AR, sync, async; d3d.decoding.methods)."""

from d3d.decoding.config import DecodeConfig
from d3d.decoding.engine import GenerationResult, SpecGenerator

__all__ = ["DecodeConfig", "GenerationResult", "SpecGenerator"]
