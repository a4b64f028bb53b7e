"""Palu-converted causal LMs: grouped low-rank K/V projections that cache latents (spec 002, issue 4).

Each layer's key/value heads are split into `n_g = num_key_value_heads / s` groups of `s` consecutive heads (G-LRD;
`s = 1` is M-LRD, `s = num_key_value_heads` is J-LRD). `k_proj`/`v_proj` become down-projections to one latent per
group (`k_down: D → n_g·r_k`, `v_down: D → n_g·r_v`). The cache stores only the latents, one "head" per group:
`keys [B, n_g, S, r_k]` and `values [B, n_g, S, r_v]`, in an ordinary cache layer (DeepSeek-V3's trick) or, with
`palu_quant_bits > 0`, packed low-bit in a `PaluQuantizedCache` (each token quantized once).

- Keys: the per-group reconstruction `k_up [n_g, r_k, s·d]` rebuilds the pre-RoPE keys, which are RoPE'd at their
  absolute positions inside the `rope_key_scores` kernel (reconstruct-then-RoPE, spec §2.3 / §3.1).
- Values: the reconstruction is folded into `o_proj` offline (Eq. 5), so attention returns `p · H^v` per head
  `[B, H, q, r_v]` and `o_proj` maps `H·r_v → D`.

Kernels come from the registry (`palu_kernel_backend`: `"eager"` plain torch, `"triton"`). Positions of cached keys:
a caller whose cache has masked holes between slots (hf-accel's batched speculative decoding; `generate` with an
attention mask that has zeros after a row's first token) passes every slot's position as `key_positions`: `generate`
does, from the position ids it keeps for the whole sequence (a chunked prefill: from its attention mask). Otherwise
cached tokens are contiguous and end right before the first new token, so cached index `j` of `past_len` has position
`position_ids[:, 0] − past_len + j` (what left padding and tree verification with explicit positions give). This file
is copied into converted checkpoints and imports only from torch, transformers and its siblings.
"""

import importlib
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, StaticLayer
from transformers.generation.utils import ALL_CACHE_NAMES
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRotaryEmbedding,
    rotate_half,
)

from .configuration_palu import PaluLlamaConfig
from .palu_kernels import PaluQuantizedCache, PaluQuantizedLayer, get_kernel, reads_in_full_precision


CACHE_NAME = ALL_CACHE_NAMES[0]  # the cache's name in model inputs: "cache" from transformers 5.24 on


def _check_dynamic_layer(cache, layer_idx: int) -> None:
    """Cached latents are RoPE'd at attention time from slot counts, so every slot must hold a real token: a static
    cache's preallocated slots would shift every position."""
    layers = getattr(cache, "layers", ())
    if layer_idx < len(layers) and isinstance(layers[layer_idx], StaticLayer):
        raise ValueError(
            f"latent-cache models need a dynamic cache, not a {type(cache).__name__} with preallocated slots "
            "(cache_implementation 'static', 'sliding_window' or 'offloaded_static'): drop cache_implementation"
        )


def _key_positions(position_ids, past_len: int, q_len: int, batch: int, device, key_positions=None) -> torch.Tensor:
    """Positions of all keys `[B, past_len + q_len]`: the caller's `key_positions` if given (a cache with holes),
    else inferred, the cache being contiguous up to the first new token."""
    if key_positions is not None:
        return key_positions.expand(batch, -1)
    if position_ids is None:
        return torch.arange(past_len + q_len, device=device)[None].expand(batch, -1)
    past = position_ids[:, :1] - past_len + torch.arange(past_len, device=device)[None]  # [B or 1, past_len]
    return torch.cat([past, position_ids], dim=-1).expand(batch, -1)


# Same as modeling_care.py's, kept twice on purpose: each checkpoint ships only its own converter's files
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


def _masked_softmax(scores: torch.Tensor, attention_mask, past_len: int) -> torch.Tensor:
    # scores [B, H, q, S] float32; attention_mask additive float or boolean (True = attend), [B, 1, q, ≥S], or None
    q_len, total = scores.shape[-2:]
    if attention_mask is None:
        if q_len > 1:  # causal: query i (position past_len + i) sees keys 0..past_len + i
            keep = (
                torch.arange(total, device=scores.device)[None]
                <= past_len + torch.arange(q_len, device=scores.device)[:, None]
            )
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :total], torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask[..., :total].float()
    return torch.softmax(scores, dim=-1)


class PaluAttentionMixin:
    """Latent grouped K/V for a family's attention class; put it first in the bases."""

    rotary_class: type = LlamaRotaryEmbedding

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        hidden = self.q_proj.in_features
        self.group_size = config.palu_group_size
        self.num_groups = config.num_key_value_heads // self.group_size
        if config.palu_k_ranks is None or config.palu_v_ranks is None:
            raise ValueError(
                "this model needs `palu_k_ranks` and `palu_v_ranks` in its config (`hf-accel convert palu` writes them)"
            )
        self.rank_k, self.rank_v = config.palu_k_ranks[layer_idx], config.palu_v_ranks[layer_idx]
        # diff with LlamaAttention: k_proj / v_proj → grouped latent down-projections A^k, A^v (all groups stacked)
        del self.k_proj, self.v_proj
        self.k_down = nn.Linear(hidden, self.num_groups * self.rank_k, bias=False)
        self.v_down = nn.Linear(hidden, self.num_groups * self.rank_v, bias=False)
        # B^k per group (row-vector form): latent [.., r_k] @ k_up[g] → the group's s pre-RoPE key heads [.., s·d]
        self.k_up = nn.Parameter(torch.zeros(self.num_groups, self.rank_k, self.group_size * self.head_dim))
        # diff with LlamaAttention: B^v folded into o_proj per query head (Eq. 5): [B, S, H·r_v] → [B, S, D]
        self.o_proj = nn.Linear(config.num_attention_heads * self.rank_v, hidden, bias=config.attention_bias)
        # Keys are RoPE'd after reconstruction, at cached positions: the kernel needs inv_freq
        self.rotary_emb = self.rotary_class(config=config)

    def _new_quantized_layer(self) -> PaluQuantizedLayer:
        config = self.config
        return PaluQuantizedLayer(config.palu_quant_bits, config.palu_quant_group_size, config.palu_residual_length)

    def _quantized_layer(self, cache) -> PaluQuantizedLayer:
        if cache is None:  # no cache (e.g. perplexity): a scratch layer quantizes exactly as a cache would
            return self._new_quantized_layer()
        layers = cache.layers
        while len(layers) <= self.layer_idx:  # a cache that builds its layers lazily
            layers.append(self._new_quantized_layer())
        if not isinstance(layers[self.layer_idx], PaluQuantizedLayer):
            if layers[self.layer_idx].get_seq_length() > 0:
                raise ValueError(
                    "This Palu model quantizes its latents but got a cache that already holds float entries; pass a "
                    "`PaluQuantizedCache` (or no cache) instead."
                )
            layers[self.layer_idx] = self._new_quantized_layer()
        return layers[self.layer_idx]

    def _attend(self, probs: torch.Tensor, latent_v: torch.Tensor) -> torch.Tensor:
        # probs [B, H, q, S] · value latents [B, n_g, S, r_v], query head h reading group h // (H / n_g)
        bsz, _, q_len, total = probs.shape
        grouped = probs.reshape(bsz, self.num_groups, -1, total)  # [B, n_g, H/n_g · q, S]
        return (grouped @ latent_v.float()).view(bsz, -1, q_len, self.rank_v)  # [B, H, q, r_v]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,  # the cache's name before transformers 5.24
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = cache if cache is not None else past_key_values
        key_positions = kwargs.pop("key_positions", None)  # [B, past + q] from hf-accel's engine, or inferred
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)  # [B, H, q, d]
        cos, sin = position_embeddings
        query_states = query_states * cos.unsqueeze(1) + rotate_half(query_states) * sin.unsqueeze(1)

        # diff with LlamaAttention: the cache stores the latents, one "head" per group: [B, n_g, q, r]
        latent_k = self.k_down(hidden_states).view(bsz, q_len, self.num_groups, self.rank_k).transpose(1, 2)
        latent_v = self.v_down(hidden_states).view(bsz, q_len, self.num_groups, self.rank_v).transpose(1, 2)
        # the Triton kernels have no backward pass: with gradients on (training), the eager kernels' autograd
        backend = "eager" if torch.is_grad_enabled() else self.config.palu_kernel_backend
        rope = {"attention_scaling": self.rotary_emb.attention_scaling, "scaling": self.scaling}
        inv_freq = self.rotary_emb.inv_freq

        quantized = self.config.palu_quant_bits
        layer = self._quantized_layer(cache) if quantized else None
        # with gradients on and nothing cached yet (training, whether or not the model made itself a cache), the
        # straight-through path below: the cache path reads codes, which carry no gradient
        if quantized and (layer.get_seq_length() > 0 or not torch.is_grad_enabled()):
            past_len = layer.get_seq_length()
            positions = _key_positions(position_ids, past_len, q_len, bsz, hidden_states.device, key_positions)
            layer.append(latent_k, latent_v, positions[:, past_len:])  # each new token is quantized once
            scores = layer.key_scores(query_states, self.k_up, positions, inv_freq, backend=backend, **rope)
            probs = _masked_softmax(scores, attention_mask, past_len)
            attn_output = layer.attend_values(probs, positions, backend=backend)  # [B, H, q, r_v]
            layer.release_window(positions, q_len)  # what no later query reads (any pass may be rolled back)
        else:
            past_len = 0
            if cache is not None and not quantized:
                _check_dynamic_layer(cache, self.layer_idx)
                past_len = cache.get_seq_length(self.layer_idx)
                latent_k, latent_v = cache.update(latent_k, latent_v, self.layer_idx)
            positions = _key_positions(position_ids, past_len, q_len, bsz, hidden_states.device, key_positions)
            kernel = get_kernel("rope_key_scores", backend, hidden_states.device)
            full_precision = None  # [B, 1, q, S]: the reads a quantized model's full-precision window serves
            if quantized:  # training (gradients on, empty cache): the cache's reads, rounding passed straight through
                if cache is not None:  # the cache keeps what the cache path would have stored
                    layer.append(latent_k, latent_v, positions)
                    layer.release_window(positions, q_len)
                float_k, float_v = latent_k, latent_v
                latent_k, latent_v = layer.straight_through(latent_k), layer.straight_through(latent_v)
                if layer.residual_length:
                    full_precision = reads_in_full_precision(positions, positions[:, -q_len:], layer.residual_length)
                    full_precision = full_precision[:, None]
            scores = kernel(query_states, latent_k, self.k_up, positions, inv_freq, **rope)  # [B, H, q, S]
            if full_precision is not None:
                float_scores = kernel(query_states, float_k, self.k_up, positions, inv_freq, **rope)
                scores = torch.where(full_precision, float_scores, scores)
            probs = _masked_softmax(scores, attention_mask, past_len)
            if full_precision is None:
                attn_output = self._attend(probs, latent_v)  # [B, H, q, r_v]
            else:
                attn_output = self._attend(probs.masked_fill(full_precision, 0.0), latent_v)
                attn_output = attn_output + self._attend(probs.masked_fill(~full_precision, 0.0), float_v)

        attn_output = attn_output.to(hidden_states.dtype).transpose(1, 2).reshape(bsz, q_len, -1)  # [B, q, H·r_v]
        # the attention weights [B, H, q, S], as eager attention returns them (`output_attentions=True` records them)
        return self.o_proj(attn_output), probs.to(hidden_states.dtype)


class PaluLlamaAttention(PaluAttentionMixin, LlamaAttention):
    rotary_class = LlamaRotaryEmbedding


class _SavesOwnKernelsMixin:
    """`save_pretrained` (and its push to the Hub) writes the checkpoint's self-contained `palu_kernels.py`."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        _write_own_kernels(save_directory)

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # save_pretrained(push_to_hub=True) uploads before it returns: the kernels must be self-contained by then
        _write_own_kernels(working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)


class PaluLlamaModel(_SavesOwnKernelsMixin, LlamaModel):
    """The bare decoder (`AutoModel`, feature extraction) with Palu attention in every layer. It loads the `model.`
    weights of a causal LM checkpoint, as `LlamaModel` does."""

    config_class = PaluLlamaConfig
    _accepts_key_positions = True
    _auto_class = "AutoModel"  # as `PaluLlamaForCausalLM._auto_class`: save_pretrained writes the code files too
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config: PaluLlamaConfig):
        super().__init__(config)
        for idx, layer in enumerate(self.layers):
            layer.self_attn = PaluLlamaAttention(config, idx)  # diff with LlamaModel
        self.post_init()


class PaluLlamaForCausalLM(_SavesOwnKernelsMixin, LlamaForCausalLM):
    config_class = PaluLlamaConfig
    # Cached keys are RoPE'd at attention time: with masked holes between cache slots (batched speculative
    # decoding), hf-accel's engine passes every slot's position as `key_positions`.
    _accepts_key_positions = True
    # Set on a checkpoint's class by from_pretrained; set here too, so that save_pretrained of a model converted in
    # this process also writes its code files (its config's auto_map names them)
    _auto_class = "AutoModelForCausalLM"
    # Scores are computed by the Palu kernels, which read transformers' eager (additive) masks
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config: PaluLlamaConfig):
        super().__init__(config)
        for idx, layer in enumerate(self.model.layers):
            layer.self_attn = PaluLlamaAttention(config, idx)  # diff with LlamaForCausalLM
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
        return inputs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # diff with LlamaForCausalLM: a quantized Palu model decodes into a PaluQuantizedCache
        if self.config.palu_quant_bits and generation_config.cache_implementation == "offloaded":
            raise ValueError(
                "a quantized Palu model decodes into its own quantized latent cache, which does not offload to the "
                "CPU; drop cache_implementation='offloaded'"
            )
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_NAME)
        if (
            self.config.palu_quant_bits
            and type(cache) is DynamicCache
            and not getattr(cache, "_is_user_defined", False)
        ):
            model_kwargs[CACHE_NAME] = make_palu_cache(self.config)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
        # diff with LlamaForCausalLM: a quantized model swaps its own growing latent layers into any cache, a static one
        # too, after `generate` has judged that cache compileable; a compiled step would meet shapes that change
        if self.config.palu_quant_bits:
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)


def _write_own_kernels(folder) -> None:
    if __package__ == "hf_accel.models":  # the package's palu_kernels.py, copied by save_pretrained, is a shim over
        palu = importlib.import_module("hf_accel.compress.palu")  # hf_accel (not an import statement: a checkpoint's
        palu.write_palu_kernels_file(Path(folder) / "palu_kernels.py")  # files must not require hf_accel)


def make_palu_cache(config):
    """The cache a Palu model decodes into: a `DynamicCache` of float latents, or a `PaluQuantizedCache`."""
    if not config.palu_quant_bits:
        return DynamicCache(config=config)
    return PaluQuantizedCache(
        config, config.palu_quant_bits, config.palu_quant_group_size, config.palu_residual_length
    )


__all__ = ["PaluLlamaForCausalLM", "PaluLlamaModel", "make_palu_cache"]
