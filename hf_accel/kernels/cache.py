"""A quantized latent cache for Palu, in transformers' `Cache` interface (spec 002 §2.5, §3.2; issue 4).

Each layer stores latents `[batch, groups, seq_len, r]` (keys and values may have different `r`; a plain KV
cache `[batch, heads, seq_len, head_dim]` works the same way). Every token is quantized **once**, when it is
appended (per token and channel group, [`quantize_per_token`]); history is never re-quantized. This differs from
transformers' `QuantizedLayer` (KIVI), which re-quantizes the whole history at every flush of its residual buffer.

With `residual_length = R > 0` the layer also keeps a full-precision copy of recent tokens (the latency cache of
the Palu code keeps such a buffer); their codes are stored from the start, and `get_cache_bytes` counts the copies.
**A query at position `p` reads a key in full precision iff the key's position is `> p − R`** (itself and its
`R − 1` predecessors), from codes otherwise: what one-token-at-a-time decoding with an `R`-token window reads. The
rule is per query, by position, so a prefill scores every position as decoding would, and a speculative
verification pass (many queries, a tree, a batch with masked holes) reads exactly what plain decoding reads: greedy
output is unchanged. The Palu attention ([`key_scores`], [`attend_values`] with positions) applies it; the layer
keeps the copies some later query may still need ([`release_window`]: `R` between decoding steps, the whole
prompt from a prefill to the first step, since any pass may be rolled back) and their positions. The
generic `update` (any model) serves the last `R` slots instead.

Rollback operations (`crop`, `select_positions`) keep the full-precision copies of the kept tokens that had one.
"""

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .quant import QuantizedLatents, cat_quantized, quantize_per_token, resolve_group_size, validate_bits


# The position of a token whose position is unknown: below any query's window (`-1` is not, for queries at `p < R − 1`)
_NEVER_READ = torch.iinfo(torch.long).min


def reads_in_full_precision(
    key_positions: torch.LongTensor, query_positions: torch.LongTensor, residual_length: int
) -> torch.BoolTensor:
    """`[B, q, S]`: whether query `i` reads key `j` in full precision, i.e. `position_j > position_i − R` (the window
    rule of this module's docstring); from its codes otherwise."""
    return key_positions[:, None, :] > query_positions[:, :, None] - residual_length


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
        self.window_positions = torch.zeros((key_states.shape[0], 0), dtype=torch.long, device=key_states.device)
        self.quantized_keys = self._quantize(self.keys)
        self.quantized_values = self._quantize(self.values)
        self.is_initialized = True

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.LongTensor | None = None
    ) -> None:
        """
        Quantize the new tokens once and store them, without reading the cache back. With a window, their
        full-precision copies are kept too, until [`release_window`] (or `update`'s sliding) drops them.

        Args:
            key_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_k]`): new key latents.
            value_states (`torch.Tensor` of shape `[batch, groups, new_tokens, r_v]`): new value latents.
            positions (`torch.LongTensor` of shape `[batch, new_tokens]`, *optional*): their positions, which decide
                which queries read them in full precision (unknown: never).
        """
        if not self.is_initialized or self.get_seq_length() == 0:
            # (re)initialize from the real shapes: `Cache.early_initialization` may have used placeholder ones
            self.lazy_initialization(key_states, value_states)
        self.quantized_keys = cat_quantized([self.quantized_keys, self._quantize(key_states)], dim=-2)
        self.quantized_values = cat_quantized([self.quantized_values, self._quantize(value_states)], dim=-2)
        if self.residual_length > 0:
            if positions is None:
                positions = torch.full(key_states.shape[:1] + key_states.shape[2:3], _NEVER_READ, dtype=torch.long)
            elif self.window_length:  # no query of this pass, or of a later one, is below its first position
                self._drop_unreadable(positions.to(self.window_positions).amin(-1))
            self.keys = torch.cat([self.keys, key_states.to(self.dtype)], dim=-2)
            self.values = torch.cat([self.values, value_states.to(self.dtype)], dim=-2)
            self.window_positions = torch.cat([self.window_positions, positions.to(self.window_positions)], dim=-1)

    def _keep_window(self, length: int) -> None:
        # Keep the last `length` full-precision copies, in storage of their own (a view would keep the dropped ones
        # alive, and `get_cache_bytes` would under-count them)
        if self.keys.shape[-2] > length:
            self.keys, self.values = (t[..., t.shape[-2] - length :, :].clone() for t in (self.keys, self.values))
            self.window_positions = self.window_positions[:, self.window_positions.shape[1] - length :].clone()

    def _float_mask(self, query_positions: torch.LongTensor) -> torch.Tensor:
        # [B, q, W]: which window tokens each query reads in full precision
        return reads_in_full_precision(self.window_positions, query_positions, self.residual_length)

    def straight_through(self, states: torch.Tensor) -> torch.Tensor:
        """
        `states` as this layer's codes read them back (quantized, then dequantized to float32), with the rounding
        passed straight through to gradients: codes carry none, so training a quantized model reads latents this way
        (forward as the cache, backward as float latents).
        """
        read = self._quantize(states.detach()).dequantize(torch.float32)
        return states.float() + (read - states.detach().float())

    def release_window(self, key_positions: torch.LongTensor, num_queries: int, committed: bool | None = None) -> None:
        """
        Drop the full-precision copies that no later query can read, after a pass.

        A later query has a position at or above the earliest query of this pass: a verification pass may keep only
        its root, transformers' assisted generation crops even its first pass (so a prefill is no exception), and a
        caller may roll a whole pass back with `crop` and run its first position again.

        Args:
            key_positions (`torch.LongTensor` of shape `[batch, seq_len]`): the pass's positions of every slot; the
                last `num_queries` are its queries.
            num_queries (`int`): tokens of the pass.
            committed (`bool`, *optional*): ignored. Palu checkpoints converted between commits 1aaf36b and 556d9c7
                take this class from an installed hf_accel and pass it (whether the pass was a prefill, then kept
                whole: transformers' assisted generation crops even a prefill).
        """
        if self.window_length:
            queries = key_positions[:, key_positions.shape[1] - num_queries :].to(self.window_positions)
            self._drop_unreadable(queries.amin(-1))

    def _drop_unreadable(self, lowest_query: torch.LongTensor) -> None:
        # Keep every copy from the earliest one that a query at position >= lowest_query[b] reads, in any row (masked
        # holes repeat an earlier position, so readable copies need not be a suffix of the slots)
        readable = self.window_positions > (lowest_query - self.residual_length)[:, None]  # [B, W]
        width = readable.shape[1]
        first = torch.where(readable.any(-1), readable.int().argmax(-1), width)
        self._keep_window(width - int(first.min()))

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
        self._keep_window(self.residual_length)  # any model: the last R slots are served in full precision
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

        Every token goes through the `rope_key_scores` kernel on packed latents; where the window rule of this
        module's docstring says so, a window token's full-precision copy scores instead. Arguments are those of
        [`~hf_accel.kernels.reference.rope_key_scores`] (`key_positions` covers every cached token, the last
        `q_len` being the queries'), plus the kernel `backend`.

        Returns:
            `torch.Tensor` of shape `[batch, num_heads, q_len, seq_len]`, float32.
        """
        from .registry import get_kernel

        kernel = get_kernel("rope_key_scores", backend, query_states.device)
        rope = {"attention_scaling": attention_scaling, "scaling": scaling}
        scores = kernel(query_states, self.quantized_keys, up_proj, key_positions, inv_freq, **rope)
        width = self.window_length
        if width == 0:
            return scores
        total = scores.shape[-1]
        window = kernel(query_states, self.keys, up_proj, key_positions[:, total - width :], inv_freq, **rope)
        use_float = self._float_mask(key_positions[:, total - query_states.shape[-2] :])[:, None]  # [B, 1, q, W]
        tail = torch.where(use_float, window, scores[..., total - width :])
        return torch.cat([scores[..., : total - width], tail], dim=-1)

    def attend_values(
        self, probs: torch.Tensor, key_positions: torch.LongTensor | None = None, backend: str = "eager"
    ) -> torch.Tensor:
        """
        `probs · V̂` against the cached value latents, without dequantizing them to memory (spec 002 §3.2).

        Args:
            probs (`torch.Tensor` of shape `[batch, num_heads, q_len, seq_len]`): attention probabilities; query head
                `h` reads latent group `h // (num_heads / groups)`.
            key_positions (`torch.LongTensor` of shape `[batch, seq_len]`, *optional*): positions of every cached token
                (the last `q_len` are the queries'), for the window rule, as in [`key_scores`]; needed with a window
                only. Palu checkpoints converted before commit 6e23d05 take this class from an installed hf_accel
                and call it without them.
            backend (`str`, *optional*, defaults to `"eager"`): kernel backend, see [`get_kernel`].

        Returns:
            `torch.Tensor` of shape `[batch, num_heads, q_len, r_v]`, float32; `o_proj` (with `B^v` folded in) follows.
        """
        from .registry import get_kernel

        attend = get_kernel("dequantize_attend", backend, probs.device)
        width = self.window_length
        if width == 0:
            return attend(probs, self.quantized_values)
        if key_positions is None:
            raise ValueError(
                "this Palu checkpoint's modeling code reads its full-precision window by slot, not by position (it "
                "was converted by an older hf-accel); convert the model again with `hf-accel convert palu`"
            )
        batch, num_heads, q_len, total = probs.shape
        use_float = self._float_mask(key_positions[:, total - q_len :])[:, None]  # [B, 1, q, W]
        tail = probs[..., total - width :]
        float_probs = torch.where(use_float, tail, 0.0).float()
        coded_probs = torch.cat([probs[..., : total - width], torch.where(use_float, 0.0, tail)], dim=-1)
        grouped = float_probs.reshape(batch, self.values.shape[1], -1, width)
        window = (grouped @ self.values.float()).view(batch, num_heads, q_len, -1)
        return attend(coded_probs, self.quantized_values) + window

    def get_seq_length(self) -> int:
        """Number of cached tokens."""
        return 0 if not self.is_initialized else self.quantized_keys.codes.shape[-2]

    @property
    def window_length(self) -> int:
        """Number of trailing tokens currently served in full precision (`≤ residual_length`)."""
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_cache_bytes(self) -> int:
        """True stored bytes: packed codes, scales and zero-points of keys and values, plus the window (its latents
        and their positions)."""
        if not self.is_initialized:
            return 0
        window = sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.window_positions))
        return self.quantized_keys.nbytes + self.quantized_values.nbytes + window

    def reset(self) -> None:
        """Drop every cached token."""
        super().reset()
        self.quantized_keys = self.quantized_values = None

    def _apply(self, fn) -> None:
        # `fn` acts on leading dimensions only, so it applies to codes, scales, zeros and the window alike
        self.quantized_keys, self.quantized_values = self.quantized_keys.apply(fn), self.quantized_values.apply(fn)
        self.keys, self.values, self.window_positions = fn(self.keys), fn(self.values), fn(self.window_positions)

    def crop(self, max_length: int) -> None:
        """
        Keep the first `max_length` tokens, or remove `-max_length` tokens when it is negative.

        `crop(0)` is a no-op, as transformers 5 calls it to mean "nothing to remove"; use `reset()` to empty the layer.
        The kept tokens keep their full-precision copies.
        """
        length = self.get_seq_length()
        if max_length == 0 or length == 0:
            return
        keep = max(0, length + max_length) if max_length < 0 else min(max_length, length)
        window_keep = max(0, self.keys.shape[-2] - (length - keep))
        self.quantized_keys = self.quantized_keys.apply(lambda t: t[..., :keep, :])
        self.quantized_values = self.quantized_values.apply(lambda t: t[..., :keep, :])
        self.keys, self.values = self.keys[..., :window_keep, :], self.values[..., :window_keep, :]
        self.window_positions = self.window_positions[:, :window_keep]

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
        self.window_positions = self.window_positions.gather(1, window_index.to(self.window_positions.device))

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
