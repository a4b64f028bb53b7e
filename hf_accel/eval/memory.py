"""What a KV cache really holds, measured from its tensors (any cache class: dynamic, latent, quantized latent)."""

import torch

from ..compat import CACHE_NAME


def cache_bytes(cache) -> int:
    """Total bytes held by a cache: a layer (or cache) that knows its true size (packed codes, scales, zero-points,
    full-precision window) reports it through `get_cache_bytes()`; otherwise its `keys`/`values` tensors count."""
    if hasattr(cache, "get_cache_bytes"):
        return cache.get_cache_bytes()
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "get_cache_bytes"):
            total += layer.get_cache_bytes()
            continue
        for tensor in (layer.keys, layer.values):
            if torch.is_tensor(tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def cache_bytes_per_token(cache, batch_size: int = 1) -> float:
    """Bytes per cached token and sequence, all layers together.

    Args:
        cache (`Cache`): a transformers cache after at least one forward pass.
        batch_size (`int`, *optional*, defaults to 1): the number of sequences the cache holds.
    """
    return cache_bytes(cache) / (batch_size * cache.get_seq_length())


@torch.no_grad()
def measure_cache_bytes_per_token(model, input_ids: torch.Tensor, cache=None) -> float:
    """Fills a cache with `input_ids` (`[B, S]`) as `generate` does, a prefill of all but the last token and one
    decoding step, and returns its bytes per token and sequence (a cache that drops what no later query reads at
    each step, like Palu's full-precision window, is measured at its decoding size).

    Args:
        cache (`Cache`, *optional*): the (empty) cache to fill; the model's default cache otherwise.
    """
    input_ids = input_ids.to(next(model.parameters()).device)
    if input_ids.shape[1] > 1:
        cache = model(input_ids=input_ids[:, :-1], **{CACHE_NAME: cache}, use_cache=True)[CACHE_NAME]
    out = model(input_ids=input_ids[:, -1:], **{CACHE_NAME: cache}, use_cache=True)
    return cache_bytes_per_token(out[CACHE_NAME], input_ids.shape[0])
