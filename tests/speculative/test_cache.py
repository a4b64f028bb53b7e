import pytest
import torch


@pytest.mark.parametrize("tail", [[[0, 1, 2], [0, 1, 2]], [[0, 2, 5], [0, 3, 3]], [[0, 0, 0], [0, 4, 1]]])
def test_select_cache_positions_matches_brute_force(tail):
    from transformers import DynamicCache

    from hf_accel.speculative.cache import select_cache_positions

    torch.manual_seed(0)
    prefix, nodes = 4, 6
    cache = DynamicCache()
    tensors = [(torch.randn(2, 3, prefix + nodes, 5), torch.randn(2, 3, prefix + nodes, 5)) for _ in range(2)]
    for i, (k, v) in enumerate(tensors):
        cache.update(k.clone(), v.clone(), i)
    index = torch.tensor(tail)
    select_cache_positions(cache, prefix, index)
    for layer, (k, v) in zip(cache.layers, tensors):
        for b in range(2):
            keep = list(range(prefix)) + [prefix + i for i in tail[b]]
            torch.testing.assert_close(layer.keys[b], k[b][:, keep], rtol=0, atol=0)
            torch.testing.assert_close(layer.values[b], v[b][:, keep], rtol=0, atol=0)


def test_a_cache_without_per_layer_storage_is_refused_in_one_line():
    from hf_accel.speculative.cache import validate_cache_for_speculation

    class LegacyCache:  # e.g. remote code's own cache class, with no `layers`
        key_cache = ()

    with pytest.raises(ValueError, match=r"^speculative decoding needs a cache with per-layer storage") as error:
        validate_cache_for_speculation(LegacyCache())
    assert "got LegacyCache" in str(error.value) and len(str(error.value).splitlines()) == 1


class _PlainLayer:
    """A layer of the cache contract's minimum: `keys` / `values` only (no `batch_select_indices`, no
    `select_positions`); `None` for a layer that caches nothing."""

    def __init__(self, keys=None, values=None):
        self.keys, self.values = keys, values


def test_plain_layers_are_gathered_and_their_rows_selected_and_empty_ones_left_alone():
    from types import SimpleNamespace

    from hf_accel.speculative.cache import select_cache_positions, select_cache_rows

    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4)
    empty = _PlainLayer(torch.zeros(3, 2, 0, 4), torch.zeros(3, 2, 0, 4))
    cache = SimpleNamespace(layers=[_PlainLayer(k.clone(), v.clone()), _PlainLayer(), empty])
    select_cache_positions(cache, 4, torch.tensor([[0, 2], [1, 1], [2, 0]]))
    expected_k = torch.stack([k[0][:, [0, 1, 2, 3, 4, 6]], k[1][:, [0, 1, 2, 3, 5, 5]], k[2][:, [0, 1, 2, 3, 6, 4]]])
    expected_v = torch.stack([v[0][:, [0, 1, 2, 3, 4, 6]], v[1][:, [0, 1, 2, 3, 5, 5]], v[2][:, [0, 1, 2, 3, 6, 4]]])
    torch.testing.assert_close(cache.layers[0].keys, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(cache.layers[0].values, expected_v, rtol=0, atol=0)
    select_cache_rows(cache, torch.tensor([2, 0]))
    torch.testing.assert_close(cache.layers[0].keys, expected_k[[2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(cache.layers[0].values, expected_v[[2, 0]], rtol=0, atol=0)
    assert cache.layers[1].keys is None and cache.layers[1].values is None
    assert cache.layers[2].keys.shape == (2, 2, 0, 4)
