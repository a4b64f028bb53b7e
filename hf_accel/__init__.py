"""hf-accel: smaller KV caches and fewer target forward passes, inside the Hugging Face stack."""

from .loading import DEFAULT_MODEL, load_model_and_tokenizer, resolve_model


__version__ = "0.2.0"
__all__ = ["DEFAULT_MODEL", "load_model_and_tokenizer", "resolve_model"]
