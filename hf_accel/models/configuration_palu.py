"""Configuration of Palu-converted models (grouped low-rank K/V projections that cache latents; spec 002).

A subclass of the original family's config with a unique `model_type` and the Palu fields, so every original
setting (RoPE, norms) keeps its meaning. This file is copied into converted checkpoints and imports only from
transformers and huggingface_hub.
"""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class PaluLlamaConfig(LlamaConfig):
    r"""
    Llama with Palu latent K/V caching.

    The key/value heads of every layer are split into `num_key_value_heads / palu_group_size` groups of
    `palu_group_size` consecutive KV heads (heads `[g·s, (g+1)·s)` form group `g`). Each group caches one key latent of
    width `palu_k_ranks[layer]` and one value latent of width `palu_v_ranks[layer]` per token (spec 002 §2.2: equal
    rank for every group of a layer and projection; K and V may differ).

    Args:
        palu_group_size (`int`, *optional*, defaults to 1): KV heads per group `s` (1: M-LRD, all: J-LRD).
        palu_k_ranks (`list[int]`): per layer, the key latent width `r_g` of each group.
        palu_v_ranks (`list[int]`): per layer, the value latent width `r_g` of each group.
        palu_quant_bits (`int`, *optional*, defaults to 0): 0 caches float latents; 2, 3 or 4 caches per-token
            asymmetric low-bit latents (`PaluQuantizedCache`).
        palu_quant_group_size (`int`, *optional*, defaults to 0): channels per scale/zero-point, 0 for the whole latent
            of a group (the Palu default).
        palu_residual_length (`int`, *optional*, defaults to 0): recent tokens also kept in full precision.
        palu_hadamard (`bool`, *optional*, defaults to `False`): a Walsh–Hadamard rotation is folded into the factors
            (recorded for the model card; the runtime does not depend on it).
        palu_kernel_backend (`str`, *optional*, defaults to `"eager"`): `"eager"` (plain torch), `"triton"`, or
            `"auto"` (Triton for inputs on a CUDA device when it is installed, else eager).
    """

    model_type = "palu_llama"
    _auto_class = "AutoConfig"  # save_pretrained copies this file (see `_auto_class` in modeling_palu.py)
    palu_group_size: int = 1
    palu_k_ranks: list[int] | None = None
    palu_v_ranks: list[int] | None = None
    palu_quant_bits: int = 0
    palu_quant_group_size: int = 0
    palu_residual_length: int = 0
    palu_hadamard: bool = False
    palu_kernel_backend: str = "eager"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _validate_palu(self)


KERNEL_BACKENDS = ("eager", "triton", "auto")


def _validate_palu(config) -> None:
    n_kv, s = config.num_key_value_heads, config.palu_group_size
    if not isinstance(s, int) or s < 1 or n_kv % s != 0:
        raise ValueError(f"palu_group_size must divide num_key_value_heads={n_kv}, got {s!r}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = s * head_dim
    for name in ("palu_k_ranks", "palu_v_ranks"):
        ranks = getattr(config, name)
        if ranks is not None and (len(ranks) != config.num_hidden_layers or not all(1 <= r <= width for r in ranks)):
            raise ValueError(f"{name} must list {config.num_hidden_layers} group ranks in [1, {width}], got {ranks}")
    if config.palu_quant_bits not in (0, 2, 3, 4):
        raise ValueError(f"palu_quant_bits must be 0, 2, 3 or 4, got {config.palu_quant_bits!r}")
    # checked here, at load, not by the quantized cache at the first forward pass
    q, ranks = config.palu_quant_group_size, [*(config.palu_k_ranks or []), *(config.palu_v_ranks or [])]
    if q < 0 or (config.palu_quant_bits and q and any(r % q for r in ranks)):
        raise ValueError(
            f"palu_quant_group_size must be 0 (one scale per latent) or divide every group rank, got {q!r}"
        )
    if config.palu_residual_length < 0:
        raise ValueError(f"palu_residual_length must be a non-negative integer, got {config.palu_residual_length!r}")
    if config.palu_kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"palu_kernel_backend must be one of {KERNEL_BACKENDS}, got {config.palu_kernel_backend!r}")


__all__ = ["PaluLlamaConfig"]
