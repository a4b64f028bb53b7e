"""Speculative decoding inside `model.generate`: one verification engine, draft trees, and drafters."""

from .engine import DraftRequest, SpeculativeEngine, SpeculativeStats, VerifyResult
from .generate import DrafterCandidateGenerator, assisted_generate, custom_generate
from .tree import DraftTree


__all__ = [
    "DraftRequest",
    "DraftTree",
    "DrafterCandidateGenerator",
    "SpeculativeEngine",
    "SpeculativeStats",
    "VerifyResult",
    "assisted_generate",
    "custom_generate",
]
