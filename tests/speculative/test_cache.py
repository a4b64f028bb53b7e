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
