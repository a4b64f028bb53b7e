"""KV-cache surgery for speculative decoding: keep the accepted tree nodes, drop finished rows.

Contract with cache classes (documented again in [`~hf_accel.speculative.engine`]):

- A cache is any object with a `layers` list (transformers' `Cache`). Each layer stores the sequence on axis `-2`
  of its `keys` and `values` tensors (`[batch, heads, seq, dim]`; an MLA / CARE latent is a one-head entry with its
  own width, so the same code applies).
- If a layer has `select_positions(index)`, the engine calls it instead of touching `keys` / `values`: `index` is a
  `LongTensor` `[batch, kept]` of absolute sequence positions to keep, in order. A quantized latent cache implements
  it to gather its packed storage (and its scales) itself.
- If a layer has `batch_select_indices(indices)` (transformers' `DynamicLayer` has), the engine calls it to drop
  finished rows; otherwise the tensors are indexed on axis 0.
- Layers that keep only a window (`is_sliding`) are refused: gathering would have to know the window's origin. The
  engine serves sliding-window models from full layers and windows its masks instead (an empty sliding cache is
  replaced by a plain `DynamicCache()`).
  So are preallocated layers (`max_cache_len`, a static cache): their length is fixed, so they cannot be cropped.
  So are recurrent layers (`conv_states` / `recurrent_states`: linear attention, SSM and convolution layers of
  hybrid models): a tree pass folds every node into one state, which cannot be rolled back to the accepted path.
  So are transformers' quantized layers (`_quantized_keys`, `cache_implementation="quantized"`) without
  `select_positions`: most of their sequence lives in the quantized storage, not in `keys` / `values`.
  So are other `DynamicLayer` subclasses that change `crop` without `select_positions`: they cache more per token
  than `keys` / `values` (a sparse-attention indexer's keys), which a gather of `keys` / `values` would leave behind.
"""

import torch
from transformers import DynamicLayer

from ..compat import CACHE_NAME


def refuse_filled_cache(cache) -> None:
    """Raises `ValueError` for a cache that already holds tokens: both loops start from an empty one."""
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"speculative decoding starts from an empty cache; pass no `{CACHE_NAME}` (or an empty one): to continue "
            "a conversation, pass its whole text as the prompt"
        )


def validate_cache_for_speculation(cache) -> None:
    """Raises `ValueError` if the engine cannot crop / gather this cache."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(
            f"speculative decoding needs a cache with per-layer storage (`cache.layers`), got {type(cache).__name__};"
            " use transformers' DynamicCache or a Cache subclass whose layers implement `select_positions`"
        )
    for i, layer in enumerate(layers):
        if getattr(layer, "max_cache_len", None) is not None and not hasattr(layer, "select_positions"):
            raise ValueError(
                f"cache layer {i} is preallocated ({type(layer).__name__}, e.g. cache_implementation='static'); "
                "speculative decoding crops and gathers the cache: use the default dynamic cache"
            )
        if hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states"):
            raise ValueError(
                f"cache layer {i} holds recurrent states ({type(layer).__name__}: linear attention, SSM or "
                "convolution layers of a hybrid model), which a draft tree cannot be verified against or rolled back "
                "in; speculative decoding supports attention-only models"
            )
        if hasattr(layer, "_quantized_keys") and not hasattr(layer, "select_positions"):
            raise ValueError(
                f"cache layer {i} is quantized ({type(layer).__name__}, cache_implementation='quantized'); "
                "speculative decoding gathers the cache: use the default dynamic cache"
            )
        if getattr(layer, "is_sliding", False) and not hasattr(layer, "select_positions"):
            raise ValueError(
                f"cache layer {i} is a sliding-window layer; speculative decoding cannot gather it. Pass no "
                f"`{CACHE_NAME}` (the engine masks windows itself), or a layer class implementing `select_positions`."
            )
        if _keeps_more_than_keys_and_values(layer) and not hasattr(layer, "select_positions"):
            raise ValueError(
                f"cache layer {i} ({type(layer).__name__}) keeps per-token state besides `keys` / `values` (its class "
                "crops more, e.g. a sparse-attention indexer's keys), which gathering the accepted nodes would leave "
                "behind; speculative decoding supports layers whose tokens are all in `keys` / `values`"
            )


def _keeps_more_than_keys_and_values(layer) -> bool:
    """Whether a `DynamicLayer` subclass changes `crop`: transformers' layers that cache more per token than
    `keys` / `values` (the indexer keys of sparse-attention layers: GLM-MoE-DSA, DeepSeek-V3.2, MiniMax-M3-VL) crop it too."""
    return isinstance(layer, DynamicLayer) and type(layer).crop is not DynamicLayer.crop


def _gather_seq(tensor: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`tensor[b, ..., index[b, k], :]` for a `[B, ..., S, D]` tensor and a `[B, K]` index -> `[B, ..., K, D]`."""
    shape = list(tensor.shape)
    expand_index = index.view(index.shape[0], *([1] * (tensor.dim() - 3)), index.shape[1], 1)
    shape[-2] = index.shape[1]
    return tensor.gather(-2, expand_index.expand(shape))


def _keep_tail(tensor: torch.Tensor, prefix_length: int, index: torch.LongTensor | None, kept: int) -> torch.Tensor:
    """`[B, H, S, D]` -> the first `prefix_length` positions, then the tail positions `index` `[B, kept]` (relative
    to `prefix_length`; `None` when they are `0, 1, ..., kept - 1`, as for an accepted chain).

    The prefix is never copied: the gathered nodes overwrite the tail's first `kept` slots, and the result is a view
    of the first `prefix_length + kept` positions (the cache's next update concatenates into a new tensor anyway).
    """
    if index is not None:
        tensor[..., prefix_length : prefix_length + kept, :] = _gather_seq(tensor[..., prefix_length:, :], index)
    return tensor[..., : prefix_length + kept, :]


def select_cache_positions(cache, prefix_length: int, tail_index: torch.LongTensor) -> None:
    """Keeps the first `prefix_length` positions of every row plus, per row, the tail positions `tail_index`.

    Args:
        cache (`Cache`): the cache after the verification pass (`prefix_length + num_nodes` positions per layer).
        prefix_length (`int`): positions cached before the verification pass, all kept.
        tail_index (`torch.LongTensor` of shape `(batch_size, kept)`): per row, indices *relative to
            `prefix_length`* of the tree nodes to keep, in path order. Rows that accepted fewer nodes repeat an
            index; the engine masks those slots out, so their content does not matter.
    """
    absolute = None
    kept = tail_index.shape[1]
    in_place = torch.equal(tail_index, torch.arange(kept, device=tail_index.device).expand_as(tail_index))
    for layer in cache.layers:
        if hasattr(layer, "select_positions"):
            if absolute is None:
                batch_size = tail_index.shape[0]
                prefix = torch.arange(prefix_length, device=tail_index.device).expand(batch_size, prefix_length)
                absolute = torch.cat([prefix, tail_index + prefix_length], dim=1)
            layer.select_positions(absolute)
            continue
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        index = None if in_place else tail_index.to(layer.keys.device)
        layer.keys = _keep_tail(layer.keys, prefix_length, index, kept)
        layer.values = _keep_tail(layer.values, prefix_length, index, kept)


def select_cache_rows(cache, rows: torch.LongTensor) -> None:
    """Keeps only the batch rows `rows` (in that order) of every layer."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows.to(layer.keys.device) if layer.keys is not None else rows)
        elif layer.keys is not None:
            layer.keys = layer.keys[rows]
            layer.values = layer.values[rows]
