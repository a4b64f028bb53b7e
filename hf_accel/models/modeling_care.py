"""CARE-converted causal LMs: multi-head latent attention that caches low-rank K/V latents.

Each layer's `k_proj`/`v_proj` becomes a down-projection to a latent (`k_down: D → r_K`, `v_down: D → r_V`) and an
up-projection back to the GQA width (`k_up`, `v_up: r → g·d`). Only the latents are cached, DeepSeek-V3 style: the key
latent is stored as a one-head `keys` entry `[B, 1, S, r_K]` and the value latent as a one-head `values` entry
`[B, 1, S, r_V]` of an ordinary cache layer, so `generate`, batching, beam reordering and sequence-axis crop/gather
work unchanged, with `r_K + r_V` numbers per token per layer. Keys are rebuilt from the latent, k-normed (Qwen3), and
then RoPE'd at their positions (spec A.4 Stage 5: RoPE is applied to the reconstructed keys). The value
up-projection can be folded into `o_proj` (`care_absorb_value`).

Positions of cached keys: a caller whose cache has masked holes between slots (hf-accel's batched speculative decoding;
`generate` with an attention mask that has zeros after a row's first token, e.g. a padded continuation of a batch)
passes every slot's position as `key_positions` `[B, past_len + q_len]`: `generate` does, from the position ids it
keeps for the whole sequence (a chunked prefill: from its attention mask). Otherwise cached tokens are contiguous and
end right before the first new token, so a cached token at index `j` of `past_len` has position `position_ids[:, 0] −
past_len + j`; new tokens use `position_ids` as given (tree verification works). This file is copied into converted
checkpoints and imports only from torch and transformers.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import ALL_CACHE_NAMES
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralForCausalLM,
    MistralModel,
    MistralRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2Model, Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3Model, Qwen3RotaryEmbedding

from .configuration_care import CareLlamaConfig, CareMistralConfig, CareQwen2Config, CareQwen3Config


CACHE_NAME = ALL_CACHE_NAMES[0]  # the cache's name in model inputs: "cache" from transformers 5.24 on


def _check_dynamic_layer(cache, layer_idx: int) -> None:
    """Cached latents are RoPE'd at attention time from slot counts, so every slot must hold a real token: a static
    cache's preallocated slots would shift every position (silently wrong output)."""
    layers = getattr(cache, "layers", ())
    if layer_idx < len(layers) and isinstance(layers[layer_idx], StaticLayer):
        raise ValueError(
            f"latent-cache models need a dynamic cache, not a {type(cache).__name__} with preallocated slots "
            "(cache_implementation 'static', 'sliding_window' or 'offloaded_static'): drop cache_implementation"
        )


def _key_positions(position_ids, past_len: int, q_len: int, device, key_positions=None) -> torch.Tensor:
    """Positions of all keys `[B or 1, past_len + q_len]`: the last `past_len + q_len` of the caller's `key_positions`
    if given (a cache with holes; a sliding-window layer returns only its latest slots), else inferred, the cache
    being contiguous up to the first new token."""
    if key_positions is not None:
        return key_positions[:, key_positions.shape[1] - past_len - q_len :]
    if position_ids is None:
        return torch.arange(past_len + q_len, device=device)[None]
    past = position_ids[:, :1] - past_len + torch.arange(past_len, device=device)[None]  # [B, past_len]
    return torch.cat([past, position_ids], dim=-1)


def _generation_key_positions(all_position_ids, cache, position_ids, attention_mask=None):
    """`generate`'s position ids of the whole sequence `[B, past + new]` where they cover exactly the cached tokens
    and the new ones (`position_ids`, the slice the model gets), to pass as `key_positions`; else `None`. A chunked
    prefill passes the chunk's position ids only, with the 2D mask up to the chunk's end: the positions `generate`
    derives from that mask, where they agree with the chunk's."""
    if cache is None or all_position_ids is None or position_ids is None or all_position_ids.dim() != 2:
        return None
    past_len = cache.get_seq_length()
    if past_len == 0:
        return None
    total = past_len + position_ids.shape[-1]
    if all_position_ids.shape[-1] == total:
        return all_position_ids
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[-1] != total:
        return None
    from_mask = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as `generate` derives
    from_mask = from_mask.to(position_ids)
    return from_mask if torch.equal(from_mask[:, past_len:], position_ids.expand_as(from_mask[:, past_len:])) else None


class CareAttentionMixin:
    """Latent K/V for a family's attention class; put it first in the bases (`class X(CareAttentionMixin, Base)`)."""

    rotary_class: type = LlamaRotaryEmbedding

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.care_k_ranks is None or config.care_v_ranks is None:
            raise ValueError(
                "this model needs `care_k_ranks` and `care_v_ranks` in its config (`hf-accel convert care` writes them)"
            )
        rank_k, rank_v = config.care_k_ranks[layer_idx], config.care_v_ranks[layer_idx]
        hidden, width = self.k_proj.in_features, self.k_proj.out_features
        kv_bias = self.k_proj.bias is not None
        # diff with LlamaAttention: k_proj / v_proj → latent down- and up-projections
        del self.k_proj, self.v_proj
        self.k_down = nn.Linear(hidden, rank_k, bias=False)
        self.k_up = nn.Linear(rank_k, width, bias=kv_bias)
        self.v_down = nn.Linear(hidden, rank_v, bias=False)
        self.absorb_value = bool(config.care_absorb_value)
        if self.absorb_value:
            # o_proj reads the value latent of every query head: [B, S, n_h·r_V] → [B, S, D]
            o_bias = self.o_proj.bias is not None or kv_bias
            self.o_proj = nn.Linear(config.num_attention_heads * rank_v, hidden, bias=o_bias)
        else:
            self.v_up = nn.Linear(rank_v, width, bias=kv_bias)
        # Keys are RoPE'd after reconstruction, at cached positions the caller's cos/sin do not cover.
        self.rotary_emb = self.rotary_class(config=config)

    def _keys_from_latent(self, latent_k: torch.Tensor, positions: torch.Tensor, key_position_embeddings=None):
        # latent_k: [B, 1, T, r_K] → keys [B, g, T, d]
        bsz, _, total, _ = latent_k.shape
        keys = self.k_up(latent_k[:, 0]).view(bsz, total, -1, self.head_dim)  # [B, T, g, d]
        if hasattr(self, "k_norm"):  # Qwen3: per-head RMSNorm before RoPE
            keys = self.k_norm(keys)
        keys = keys.transpose(1, 2)  # [B, g, T, d]
        if key_position_embeddings is None:
            cos, sin = self.rotary_emb(keys, positions)  # [B or 1, T, d]
        else:  # cos/sin of the caller's `key_positions`, computed once for all layers: the last T are this layer's
            cos, sin = (t[:, t.shape[1] - total :].to(keys.dtype) for t in key_position_embeddings)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return keys * cos + rotate_half(keys) * sin

    def _values_from_latent(self, latent_v: torch.Tensor) -> torch.Tensor:
        # latent_v: [B, 1, T, r_V] → values [B, g, T, d], or the latent itself broadcast to g heads [B, g, T, r_V]
        n_kv = self.config.num_key_value_heads
        if self.absorb_value:
            return latent_v.expand(-1, n_kv, -1, -1)
        bsz, _, total, _ = latent_v.shape
        return self.v_up(latent_v[:, 0]).view(bsz, total, n_kv, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,  # the cache's name before transformers 5.24
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        key_positions = kwargs.pop("key_positions", None)  # [B, past + q] from hf-accel's engine, or inferred
        key_position_embeddings = kwargs.pop("key_position_embeddings", None)  # their cos/sin, from `generate`
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            query_states = self.q_norm(query_states)
        query_states = query_states.transpose(1, 2)  # [B, n_h, S, d]
        cos, sin = position_embeddings
        query_states = query_states * cos.unsqueeze(1) + rotate_half(query_states) * sin.unsqueeze(1)

        # diff with LlamaAttention: the cache stores the latents, one "head" each: [B, 1, S, r_K] and [B, 1, S, r_V]
        latent_k = self.k_down(hidden_states).unsqueeze(1)
        latent_v = self.v_down(hidden_states).unsqueeze(1)
        if cache is not None:
            _check_dynamic_layer(cache, self.layer_idx)
            latent_k, latent_v = cache.update(latent_k, latent_v, self.layer_idx)
        q_len = input_shape[-1]
        past_len = latent_k.shape[-2] - q_len
        positions = _key_positions(position_ids, past_len, q_len, hidden_states.device, key_positions)
        key_states = self._keys_from_latent(latent_k, positions, key_position_embeddings)
        value_states = self._values_from_latent(latent_v)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self._care_sliding_window(),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _care_sliding_window(self):
        if hasattr(self, "sliding_window"):  # Qwen2 / Qwen3: per layer type
            return self.sliding_window
        return getattr(self.config, "sliding_window", None)  # Mistral: global; Llama: none


class CareLlamaAttention(CareAttentionMixin, LlamaAttention):
    rotary_class = LlamaRotaryEmbedding


class CareMistralAttention(CareAttentionMixin, MistralAttention):
    rotary_class = MistralRotaryEmbedding


class CareQwen2Attention(CareAttentionMixin, Qwen2Attention):
    rotary_class = Qwen2RotaryEmbedding


class CareQwen3Attention(CareAttentionMixin, Qwen3Attention):
    rotary_class = Qwen3RotaryEmbedding


class CareModelMixin:
    """A family's bare decoder (`AutoModel`, feature extraction) with CARE attention in every layer; put it first in
    the bases. It loads the `model.` weights of a causal LM checkpoint, as a family's `LlamaModel` does."""

    care_attention_class: type
    _accepts_key_positions = True
    _auto_class = "AutoModel"  # as `CareForCausalLMMixin._auto_class`: save_pretrained writes the code files too

    def __init__(self, config):
        super().__init__(config)
        for idx, layer in enumerate(self.layers):
            layer.self_attn = self.care_attention_class(config, idx)  # diff with the family's Model
        self.post_init()


class CareForCausalLMMixin:
    """A family's causal LM with CARE attention in every layer; put it first in the bases."""

    care_attention_class: type
    # Cached keys are RoPE'd at attention time: with masked holes between cache slots (batched speculative
    # decoding), hf-accel's engine passes every slot's position as `key_positions` (see the module docstring).
    _accepts_key_positions = True
    # Set on a checkpoint's class by from_pretrained; set here too, so that save_pretrained of a model converted in
    # this process also writes its code files (its config's auto_map names them)
    _auto_class = "AutoModelForCausalLM"

    def __init__(self, config):
        super().__init__(config)
        for idx, layer in enumerate(self.model.layers):
            layer.self_attn = self.care_attention_class(config, idx)  # diff with the family's ForCausalLM
        self.post_init()

    def prepare_inputs_for_generation(self, *args, **kwargs):
        # `generate` keeps every token's position but passes the model the new tokens' only: where the attention mask
        # has holes after a row's first token, cached positions cannot be told from slot counts, so pass them all
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        key_positions = _generation_key_positions(
            kwargs.get("position_ids"),
            inputs.get(CACHE_NAME),
            inputs.get("position_ids"),
            kwargs.get("attention_mask"),
        )
        if key_positions is not None:
            inputs["key_positions"] = key_positions
            # every layer RoPEs its rebuilt keys at these positions: their cos/sin once per step, not once per layer
            rotary = self.model.layers[0].self_attn.rotary_emb
            inputs["key_position_embeddings"] = rotary(rotary.inv_freq.new_empty(0, dtype=self.dtype), key_positions)
        return inputs


class CareLlamaModel(CareModelMixin, LlamaModel):
    config_class = CareLlamaConfig
    care_attention_class = CareLlamaAttention


class CareMistralModel(CareModelMixin, MistralModel):
    config_class = CareMistralConfig
    care_attention_class = CareMistralAttention


class CareQwen2Model(CareModelMixin, Qwen2Model):
    config_class = CareQwen2Config
    care_attention_class = CareQwen2Attention


class CareQwen3Model(CareModelMixin, Qwen3Model):
    config_class = CareQwen3Config
    care_attention_class = CareQwen3Attention


class CareLlamaForCausalLM(CareForCausalLMMixin, LlamaForCausalLM):
    config_class = CareLlamaConfig
    care_attention_class = CareLlamaAttention


class CareMistralForCausalLM(CareForCausalLMMixin, MistralForCausalLM):
    config_class = CareMistralConfig
    care_attention_class = CareMistralAttention


class CareQwen2ForCausalLM(CareForCausalLMMixin, Qwen2ForCausalLM):
    config_class = CareQwen2Config
    care_attention_class = CareQwen2Attention


class CareQwen3ForCausalLM(CareForCausalLMMixin, Qwen3ForCausalLM):
    config_class = CareQwen3Config
    care_attention_class = CareQwen3Attention


__all__ = [
    "CareLlamaForCausalLM",
    "CareLlamaModel",
    "CareMistralForCausalLM",
    "CareMistralModel",
    "CareQwen2ForCausalLM",
    "CareQwen2Model",
    "CareQwen3ForCausalLM",
    "CareQwen3Model",
]
