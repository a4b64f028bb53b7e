"""Drafters for hf-accel's verification engine, and the registry the CLI and the benchmark use.

A method string is `<name>[:<artifact>]`; [`build_drafter`] turns it into a drafter object. The drafters are
registered at the end of this module, one [`register_drafter`] call each (`ngram`, `ngram-chain`); a drafter of
another package registers with the same call.
"""

from collections.abc import Callable

from .index import InfinigramIndex, build_index, tokenizer_fingerprint
from .infinigram import InfinigramConfig, InfinigramDrafter


_DRAFTERS: dict[str, Callable] = {}


def register_drafter(name: str, factory: Callable) -> None:
    """Registers `factory(artifact: str | None, model, tokenizer) -> drafter` under `name`."""
    if not name or ":" in name:
        raise ValueError(f"a drafter name must be non-empty and contain no ':', got {name!r}")
    if name in ("vanilla", "pld"):
        raise ValueError(f"{name!r} is a benchmark baseline, not a drafter name")
    _DRAFTERS[name] = factory


def available_drafters() -> list[str]:
    return sorted(_DRAFTERS)


def build_drafter(name: str, artifact: str | None, model, tokenizer):
    """Builds the drafter named `name` (e.g. `ngram`) with an optional artifact (e.g. an index directory).

    Args:
        name (`str`): a registered drafter name (see [`available_drafters`]).
        artifact (`str`, *optional*): path of the drafter's artifact (`ngram`: an index directory, a shipped index's
            name such as `smollm2-135m-chat-build`, or a pushed index's repo id; none drafts from the context only).
        model (`PreTrainedModel`): the target model.
        tokenizer (`PreTrainedTokenizerBase`): the target's tokenizer (an index built with another is refused).

    Example:

    ```python
    >>> drafter = build_drafter("ngram", "/path/to/index", model, tokenizer)
    >>> model.generate(**inputs, custom_generate=custom_generate, drafter=drafter, max_new_tokens=128)
    ```
    """
    if name not in _DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _DRAFTERS[name](artifact, model, tokenizer)


def _build_ngram(artifact, model, tokenizer):
    return InfinigramDrafter(artifact, tokenizer=tokenizer)


def _build_ngram_chain(artifact, model, tokenizer):
    return InfinigramDrafter(artifact, tokenizer=tokenizer, config=InfinigramConfig(tree=False))


register_drafter("ngram", _build_ngram)
register_drafter("ngram-chain", _build_ngram_chain)

__all__ = [
    "InfinigramConfig",
    "InfinigramDrafter",
    "InfinigramIndex",
    "available_drafters",
    "build_drafter",
    "build_index",
    "register_drafter",
    "tokenizer_fingerprint",
]
