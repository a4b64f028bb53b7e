"""Configurations of CARE-converted models (GQA → MLA with per-layer latent ranks).

Each supported family gets a subclass of its own config with a unique `model_type` and three extra fields, so every
original setting (RoPE, norms, biases, sliding windows) keeps its meaning. This file is copied into converted
checkpoints and imports only from transformers.
"""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config


_RANK_HELP = """
    care_k_ranks (`list[int]`): per layer, the width `r_K` of the cached key latent.
    care_v_ranks (`list[int]`): per layer, the width `r_V` of the cached value latent.
    care_absorb_value (`bool`, *optional*, defaults to `False`): the value up-projection is folded into `o_proj`
        (attention runs over the value latent directly).
"""


def _validate_care(config) -> None:
    n = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_key_value_heads * head_dim
    for name in ("care_k_ranks", "care_v_ranks"):
        ranks = getattr(config, name)
        if ranks is None:
            continue
        if len(ranks) != n or not all(1 <= int(r) <= width for r in ranks):
            raise ValueError(f"{name} must list {n} ranks in [1, {width}], got {ranks}")


@strict
class CareLlamaConfig(LlamaConfig):
    __doc__ = "Llama with CARE latent K/V caching." + _RANK_HELP
    model_type = "care_llama"
    _auto_class = "AutoConfig"  # save_pretrained copies this file (see `_auto_class` in modeling_care.py)
    care_k_ranks: list[int] | None = None
    care_v_ranks: list[int] | None = None
    care_absorb_value: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate_care(self)


@strict
class CareMistralConfig(MistralConfig):
    __doc__ = "Mistral with CARE latent K/V caching." + _RANK_HELP
    model_type = "care_mistral"
    _auto_class = "AutoConfig"  # save_pretrained copies this file (see `_auto_class` in modeling_care.py)
    care_k_ranks: list[int] | None = None
    care_v_ranks: list[int] | None = None
    care_absorb_value: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate_care(self)


@strict
class CareQwen2Config(Qwen2Config):
    __doc__ = "Qwen2 with CARE latent K/V caching." + _RANK_HELP
    model_type = "care_qwen2"
    _auto_class = "AutoConfig"  # save_pretrained copies this file (see `_auto_class` in modeling_care.py)
    care_k_ranks: list[int] | None = None
    care_v_ranks: list[int] | None = None
    care_absorb_value: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate_care(self)


@strict
class CareQwen3Config(Qwen3Config):
    __doc__ = "Qwen3 (q/k norm) with CARE latent K/V caching." + _RANK_HELP
    model_type = "care_qwen3"
    _auto_class = "AutoConfig"  # save_pretrained copies this file (see `_auto_class` in modeling_care.py)
    care_k_ranks: list[int] | None = None
    care_v_ranks: list[int] | None = None
    care_absorb_value: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate_care(self)


__all__ = ["CareLlamaConfig", "CareMistralConfig", "CareQwen2Config", "CareQwen3Config"]
