"""A quantized latent cache for Palu, in transformers' `Cache` interface (spec 002 §2.5, §3.2; issue 4).

Each layer stores latents `[batch, groups, seq_len, r]` (keys and values may have different `r`; a plain KV
cache `[batch, heads, seq_len, head_dim]` works the same way). Every token is quantized **once**, when it is
appended (per token and channel group, [`quantize_per_token`]); history is never re-quantized. This differs from
transformers' `QuantizedLayer` (KIVI), which re-quantizes the whole history at every flush of its residual buffer.

With `residual_length = R > 0` the layer also keeps a full-precision copy of the most recent tokens, at most `R`
(the latency cache of the Palu code keeps such a buffer). Those tokens are served in full precision and fall back
to their (already computed) codes when they leave the window. Their codes are stored from the start, so the window
costs `R` extra full-precision vectors, which `get_cache_bytes` counts.

Rollback operations (`crop`, `select_positions`) never bring a token back into the window: a position keeps its
full-precision copy only if it had one and is still among the trailing positions of every row. Because a token's
codes do not depend on the other tokens, a cache with `residual_length=0` returns the same values whatever the order
and grouping of appends, so speculative verification sees exactly what plain decoding sees. With a window, the
values depend on when tokens left it, as for any residual-window cache.
"""

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .quant import QuantizedLatents, cat_quantized, quantize_per_token, resolve_group_size, validate_bits


class PaluQuantizedLayer(DynamicLayer):
    """
    One layer of quantized latents with an optional full-precision window of recent tokens.

    `self.keys` / `self.values` hold the full-precision window `[batch, groups, window, r]`;
    `self.quantized_keys` / `self.quantized_values` hold the codes of **every** cached token.

    Args:
        bits (`int`, *optional*, defaults to 3): code width (2, 3 or 4 for Palu).
        group_size (`int`, *optional*): channels per scale/zero-point; `None` or `0` for the whole latent vector.
        residual_length (`int`, *optional*, defaults to 0): most recent tokens also kept in full precision.
        meta_dtype (`torch.dtype`, *optional*, defaults to `torch.float16`): dtype of scales and zero-points.
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        bits: int = 3,
        group_size: int | None = None,
        residual_length: int = 0,
        meta_dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        validate_bits(bits)  # at construction, not mid-generation
        if not isinstance(residual_length, int) or residual_length < 0:
            raise ValueError(f"`residual_length` must be a non-negative integer, got {residual_length!r}.")
        self.bits, self.group_size, self.meta_dtype = bits, group_size, meta_dtype
        self.residual_length = residual_length
        self.quantized_keys: QuantizedLatents | None = None
        self.quantized_values: QuantizedLatents | None = None

    def _quantize(self, states: torch.Tensor) -> QuantizedLatents:
        return quantize_per_token(states, self.bits, self.group_size, self.meta_dtype)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for states in (key_states, value_states):
            resolve_group_size(states.shape[-1], self.group_size)  # fail early on an incompatible group size
        self.dtype, self.device = key_states.dtype, key_states.device
        # Empty window [B, G, 0, r]: new tensors, not views (a view would keep the whole prefill's latents alive)
        self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self.values = value_states.new_empty((*value_states.shape[:-2], 0, value_states.shape[-1]))
        self.quantized_keys = self._quantize(self.keys)
        self.quantized_values = self._quantize(self.values)
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """
        Quantize the new tokens once and store them, without reading the cache back.

        Args:
            key_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_k]`): new key latents.
            value_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_v]`): new value latents.
        """
        if not self.is_initialized or self.get_seq_length() == 0:
            # (re)initialize from the real shapes: `Cache.early_initialization` may have used placeholder ones
            self.lazy_initialization(key_states, value_states)
        self.quantized_keys = cat_quantized([self.quantized_keys, self._quantize(key_states)], dim=-2)
        self.quantized_values = cat_quantized([self.quantized_values, self._quantize(value_states)], dim=-2)
        if self.residual_length > 0:
            self.keys = self._slide_window(self.keys, key_states)
            self.values = self._slide_window(self.values, value_states)

    def _slide_window(self, window: torch.Tensor, new_states: torch.Tensor) -> torch.Tensor:
        # [B, G, W, r] + [B, G, T, r] → the last `residual_length` tokens, in storage of their own (a view of the
        # concatenation would keep a whole prefill alive, and `get_cache_bytes` would under-count it)
        merged = torch.cat([window, new_states.to(self.dtype)], dim=-2)
        if merged.shape[-2] <= self.residual_length:
            return merged
        return merged[..., -self.residual_length :, :].clone()

    def _read(self, quantized: QuantizedLatents, window: torch.Tensor) -> torch.Tensor:
        dequantized = quantized.dequantize(self.dtype)  # [B, G, S, r]
        num_window = window.shape[-2]
        if num_window == 0:
            return dequantized
        return torch.cat([dequantized[..., : dequantized.shape[-2] - num_window, :], window], dim=-2)

    def get_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values as the attention sees them: dequantized, window tokens in full precision."""
        return self._read(self.quantized_keys, self.keys), self._read(self.quantized_values, self.values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Append the new tokens (quantized once) and return all cached keys and values.

        Args:
            key_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_k]`): new key latents.
            value_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_v]`): new value latents.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: keys `[batch, groups, seq_len, r_k]` and values, dequantized except
            for the full-precision window, in the dtype of the first states appended.
        """
        self.append(key_states, value_states)
        return self.get_states()

    def key_scores(
        self,
        query_states: torch.Tensor,
        up_proj: torch.Tensor,
        key_positions: torch.LongTensor,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        scaling: float = 1.0,
        backend: str = "eager",
    ) -> torch.Tensor:
        """
        Scores of RoPE'd queries against the cached key latents, without materialising the keys (spec 002 §3.1).

        Tokens in codes go through the `rope_key_scores` kernel on packed latents; window tokens use their
        full-precision copy. Arguments are those of [`~hf_accel.kernels.reference.rope_key_scores`] (`key_positions`
        covers every cached token), plus the kernel `backend`.

        Returns:
            `torch.Tensor` of shape `[batch, num_heads, q_len, seq_len]`, float32.
        """
        from .registry import get_kernel

        kernel = get_kernel("rope_key_scores", backend)
        num_coded = self.get_seq_length() - self.window_length
        coded = self.quantized_keys
        if self.window_length:  # a slice of the codes: the kernel makes it contiguous (one copy of the bytes)
            coded = coded.apply(lambda t: t[..., :num_coded, :])
        rope = {"attention_scaling": attention_scaling, "scaling": scaling}
        if self.window_length == 0:
            return kernel(query_states, coded, up_proj, key_positions, inv_freq, **rope)
        window = kernel(query_states, self.keys, up_proj, key_positions[:, num_coded:], inv_freq, **rope)
        if num_coded == 0:  # every token is still in the window (a prompt shorter than it)
            return window
        scores = kernel(query_states, coded, up_proj, key_positions[:, :num_coded], inv_freq, **rope)
        return torch.cat([scores, window], dim=-1)

    def attend_values(self, probs: torch.Tensor, backend: str = "eager") -> torch.Tensor:
        """
        `probs · V̂` against the cached value latents, without dequantizing them to memory (spec 002 §3.2).

        Args:
            probs (`torch.Tensor` of shape `[batch, num_heads, q_len, seq_len]`): attention probabilities; query head
                `h` reads latent group `h // (num_heads / groups)`.
            backend (`str`, *optional*, defaults to `"eager"`): kernel backend, see [`get_kernel`].

        Returns:
            `torch.Tensor` of shape `[batch, num_heads, q_len, r_v]`, float32; `o_proj` (with `B^v` folded in) follows.
        """
        from .registry import get_kernel

        num_coded = self.get_seq_length() - self.window_length
        if self.window_length == 0:
            return get_kernel("dequantize_attend", backend)(probs, self.quantized_values)
        batch, num_heads, q_len, _ = probs.shape
        grouped = probs[..., num_coded:].float().reshape(batch, self.values.shape[1], -1, self.window_length)
        window = (grouped @ self.values.float()).view(batch, num_heads, q_len, -1)
        if num_coded == 0:  # every token is still in the window
            return window
        return get_kernel("dequantize_attend", backend)(probs[..., :num_coded], self.quantized_values) + window

    def get_seq_length(self) -> int:
        """Number of cached tokens."""
        return 0 if not self.is_initialized else self.quantized_keys.codes.shape[-2]

    @property
    def window_length(self) -> int:
        """Number of trailing tokens currently served in full precision (`≤ residual_length`)."""
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_cache_bytes(self) -> int:
        """True stored bytes: packed codes, scales and zero-points of keys and values, plus the window."""
        if not self.is_initialized:
            return 0
        window = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return self.quantized_keys.nbytes + self.quantized_values.nbytes + window

    def reset(self) -> None:
        """Drop every cached token."""
        super().reset()
        self.quantized_keys = self.quantized_values = None

    def _apply(self, fn) -> None:
        # `fn` acts on leading dimensions only, so it applies to codes, scales, zeros and the window alike
        self.quantized_keys, self.quantized_values = self.quantized_keys.apply(fn), self.quantized_values.apply(fn)
        self.keys, self.values = fn(self.keys), fn(self.values)

    def crop(self, max_length: int) -> None:
        """
        Keep the first `max_length` tokens, or remove `-max_length` tokens when it is negative.

        `crop(0)` is a no-op, as transformers 5 calls it to mean "nothing to remove"; use `reset()` to empty the layer.
        Window tokens that are cropped away are not replaced by older ones (their full-precision copy is gone).
        """
        length = self.get_seq_length()
        if max_length == 0 or length == 0:
            return
        keep = max(0, length + max_length) if max_length < 0 else min(max_length, length)
        window_keep = max(0, self.keys.shape[-2] - (length - keep))
        self.quantized_keys = self.quantized_keys.apply(lambda t: t[..., :keep, :])
        self.quantized_values = self.quantized_values.apply(lambda t: t[..., :keep, :])
        self.keys, self.values = self.keys[..., :window_keep, :], self.values[..., :window_keep, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices`."""
        if self.is_initialized:
            self._apply(lambda t: t[indices.to(t.device), ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows for beam search (exact: codes are moved, never re-quantized)."""
        if self.is_initialized:
            self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row `repeats` times."""
        if self.is_initialized:
            self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def select_positions(self, index: torch.LongTensor, check_bounds: bool = True) -> None:
        """
        Keep, per batch row, the cache positions `index` (in that order); the layer's length becomes `S_keep`.

        Used by the speculative engine after verifying a draft tree. A kept position keeps its full-precision copy
        only if, in every row, it lies in the trailing run of positions that had one. Without a window
        (`residual_length=0`) and with `check_bounds=False` it makes no host synchronisation.

        Args:
            index (`torch.LongTensor` of shape `[batch, S_keep]`): absolute cache positions to keep, per row.
            check_bounds (`bool`, *optional*, defaults to `True`): raise a `ValueError` on positions outside the
                cache (one host synchronisation); [`PaluQuantizedCache.select_positions`] checks once for all layers.
        """
        if not self.is_initialized:
            return
        length, batch = self.get_seq_length(), self.quantized_keys.codes.shape[0]
        if index.dim() != 2 or index.shape[0] != batch:
            raise ValueError(f"`index` must have shape [batch={batch}, S_keep], got {tuple(index.shape)}.")
        index = index.to(self.quantized_keys.codes.device)
        if check_bounds and index.numel() and bool((index < 0).any() | (index >= length).any()):
            raise ValueError(f"`index` holds positions outside [0, {length}): {index.min()}..{index.max()}.")
        window_start = length - self.keys.shape[-2]
        window_keep = 0 if self.keys.shape[-2] == 0 else _count_trailing_true(index >= window_start)
        window_index = index[:, index.shape[1] - window_keep :] - window_start
        self.quantized_keys = self.quantized_keys.apply(functools.partial(_gather_positions, index=index))
        self.quantized_values = self.quantized_values.apply(functools.partial(_gather_positions, index=index))
        self.keys = _gather_positions(self.keys, window_index)
        self.values = _gather_positions(self.values, window_index)

    def offload(self):
        """Move the layer to CPU."""
        if self.is_initialized:
            self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        """Move the layer back to its device."""
        if self.is_initialized and self.keys.device != self.device:
            self._apply(lambda t: t.to(self.device, non_blocking=True))


def _count_trailing_true(mask: torch.Tensor) -> int:
    # Smallest, over rows, number of trailing True values of a [B, S] mask
    if mask.shape[1] == 0:
        return 0
    return int(mask.flip(1).int().cumprod(1).sum(1).min())


def _gather_positions(states: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    # states [B, G, S, X], index [B, S_keep] → [B, G, S_keep, X]
    batch, groups, _, width = states.shape
    expanded = index[:, None, :, None].expand(batch, groups, index.shape[1], width)
    return states.gather(2, expanded.to(states.device))


class PaluQuantizedCache(Cache):
    """
    A [`~transformers.Cache`] of [`PaluQuantizedLayer`]s: per-token quantized latents, each token quantized once.

    Args:
        config (`PreTrainedConfig`, *optional*): the model config; gives the number of layers. Without it, layers
            are created lazily as `update` reaches them.
        bits (`int`, *optional*, defaults to 3): code width (2, 3 or 4).
        group_size (`int`, *optional*): channels per scale/zero-point; `None` or `0` for the whole latent vector.
        residual_length (`int`, *optional*, defaults to 0): recent tokens also kept in full precision.
        meta_dtype (`torch.dtype`, *optional*, defaults to `torch.float16`): dtype of scales and zero-points.

    Example:

    ```python
    >>> cache = PaluQuantizedCache(bits=3)
    >>> keys, values = cache.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 48), layer_idx=0)
    >>> cache.get_seq_length(), cache.get_cache_bytes()
    (5, 380)

    ```
    """

    def __init__(
        self,
        config=None,
        bits: int = 3,
        group_size: int | None = None,
        residual_length: int = 0,
        meta_dtype: torch.dtype = torch.float16,
    ):
        make_layer = functools.partial(PaluQuantizedLayer, bits, group_size, residual_length, meta_dtype)
        make_layer()  # validate the arguments now
        if config is None:
            super().__init__(layer_class_to_replicate=make_layer)
        else:
            num_layers = config.get_text_config(decoder=True).num_hidden_layers
            super().__init__(layers=[make_layer() for _ in range(num_layers)])

    def select_positions(self, index: torch.LongTensor) -> None:
        """Keep the cache positions `index` (`[batch, S_keep]`) in every layer, see [`PaluQuantizedLayer.select_positions`]."""
        for layer_idx, layer in enumerate(self.layers):
            layer.select_positions(index, check_bounds=layer_idx == 0)

    def get_cache_bytes(self) -> int:
        """True stored bytes over all layers: codes, scales, zero-points and full-precision windows."""
        return sum(layer.get_cache_bytes() for layer in self.layers)
