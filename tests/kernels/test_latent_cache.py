import pytest
import torch

import hf_accel.kernels.cache as cache_module
from hf_accel.compat import CACHE_NAME
from hf_accel.kernels.cache import PaluQuantizedCache, PaluQuantizedLayer
from hf_accel.kernels.quant import compute_bytes_per_token, dequantize_per_token, quantize_per_token


B, G, RK, RV = 2, 2, 16, 24


def _latents(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, G, tokens, RK, generator=gen), torch.randn(B, G, tokens, RV, generator=gen)


def _qdq(x, bits=3):
    return dequantize_per_token(quantize_per_token(x, bits))


class _Reference:
    """Dense oracle: raw latents plus, per position, whether the layer serves it in full precision."""

    def __init__(self, window, bits=3):
        self.window, self.bits, self.k, self.v, self.fp = window, bits, None, None, None

    def append(self, k, v):
        fp = torch.ones(B, k.shape[2], dtype=torch.bool)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        self.fp = fp if self.fp is None else torch.cat([self.fp, fp], 1)
        self.fp[:, : max(0, self.fp.shape[1] - self.window)] = False

    def select(self, index):
        gather = lambda t: t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
        self.k, self.v, self.fp = gather(self.k), gather(self.v), self.fp.gather(1, index)
        # the window is the trailing run of positions that are full precision in every row
        trailing = self.fp.all(0).flip(0).int().cumprod(0).sum()
        self.fp[:] = False
        self.fp[:, self.fp.shape[1] - trailing :] = True

    def states(self):
        pick = lambda raw: torch.where(self.fp[:, None, :, None], raw, _qdq(raw, self.bits))
        return pick(self.k), pick(self.v)


def _check(layer, ref):
    keys, values = layer.get_states()
    exp_k, exp_v = ref.states()
    torch.testing.assert_close(keys, exp_k, atol=1e-6, rtol=0)
    torch.testing.assert_close(values, exp_v, atol=1e-6, rtol=0)
    assert layer.get_seq_length() == exp_k.shape[2]


@pytest.mark.parametrize("window", [0, 3])
def test_update_returns_dequantized_with_window(window):
    layer, ref = PaluQuantizedLayer(bits=3, residual_length=window), _Reference(window)
    for step, tokens in enumerate([5, 1, 1, 2]):
        k, v = _latents(tokens, step)
        keys, values = layer.update(k, v)
        ref.append(k, v)
        torch.testing.assert_close(keys, ref.states()[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(values, ref.states()[1], atol=1e-6, rtol=0)
    assert layer.keys.shape[2] == window


def test_each_token_quantized_once(monkeypatch):
    seen = []
    real = cache_module.quantize_per_token
    monkeypatch.setattr(cache_module, "quantize_per_token", lambda x, *a: seen.append(x.shape[2]) or real(x, *a))
    layer = PaluQuantizedLayer(bits=2, residual_length=2)
    k, v = _latents(4, 0)
    layer.update(k, v)
    codes_before = layer.quantized_keys.codes.clone()
    for step in range(3):
        layer.update(*_latents(1, step + 1))
    assert sum(seen) == 2 * (4 + 3)  # keys and values, each token once (the empty init quantizes 0 tokens)
    torch.testing.assert_close(layer.quantized_keys.codes[:, :, :4], codes_before)


def test_residual_zero_is_independent_of_append_grouping():
    k, v = _latents(7, 0)
    one_shot = PaluQuantizedLayer(bits=3)
    one_shot.update(k, v)
    stepwise = PaluQuantizedLayer(bits=3)
    for t in range(7):
        keys, values = stepwise.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    torch.testing.assert_close(keys, one_shot.get_states()[0], atol=0, rtol=0)
    torch.testing.assert_close(values, one_shot.get_states()[1], atol=0, rtol=0)


@pytest.mark.parametrize("window", [0, 4])
def test_crop(window):
    layer, ref = PaluQuantizedLayer(bits=4, residual_length=window), _Reference(window, bits=4)
    k, v = _latents(9, 1)
    layer.update(k, v)
    ref.append(k, v)
    layer.crop(-2)  # remove two tokens
    ref.select(torch.arange(7).expand(B, -1))
    _check(layer, ref)
    layer.crop(0)  # transformers 5: nothing to remove
    _check(layer, ref)
    layer.crop(5)  # keep the first five
    ref.select(torch.arange(5).expand(B, -1))
    _check(layer, ref)
    layer.update(*_latents(2, 2))
    ref.append(*_latents(2, 2))
    _check(layer, ref)


@pytest.mark.parametrize("window", [0, 3, 6])
def test_select_positions_after_tree_verification(window):
    layer, ref = PaluQuantizedLayer(bits=3, residual_length=window), _Reference(window)
    prefix, tree = _latents(6, 3), _latents(4, 4)
    for k, v in (prefix, tree):
        layer.update(k, v)
        ref.append(k, v)
    # rows accept different tree nodes (cache positions 6..9), same S_keep
    index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 8], [0, 1, 2, 3, 4, 5, 7, 9]])
    layer.select_positions(index)
    ref.select(index)
    _check(layer, ref)
    assert layer.get_seq_length() == 8
    layer.update(*_latents(1, 5))
    ref.append(*_latents(1, 5))
    _check(layer, ref)


@pytest.mark.parametrize("window", [0, 2, 5])
def test_random_operation_sequences_match_the_oracle(window):
    gen = torch.Generator().manual_seed(window)
    for trial in range(6):
        layer, ref = PaluQuantizedLayer(bits=2, residual_length=window), _Reference(window, bits=2)
        for step in range(8):
            length = layer.get_seq_length()
            op = int(torch.randint(0, 3, (1,), generator=gen)) if length > 2 else 0
            if op == 0:
                k, v = _latents(int(torch.randint(1, 4, (1,), generator=gen)), 100 * trial + step)
                layer.update(k, v)
                ref.append(k, v)
            elif op == 1:
                keep = int(torch.randint(1, length, (1,), generator=gen))
                layer.crop(keep - length)
                ref.select(torch.arange(keep).expand(B, -1))
            else:  # keep a common prefix, then a different sorted subset of the tail per row
                prefix, tail = length // 2, length - length // 2
                size = int(torch.randint(1, tail + 1, (1,), generator=gen))
                picks = [torch.randperm(tail, generator=gen)[:size].sort().values + prefix for _ in range(B)]
                index = torch.cat([torch.arange(prefix).expand(B, -1), torch.stack(picks)], dim=1)
                layer.select_positions(index)
                ref.select(index)
            _check(layer, ref)


def test_select_positions_rejects_bad_index():
    layer = PaluQuantizedLayer()
    layer.update(*_latents(3, 0))
    with pytest.raises(ValueError, match="outside"):
        layer.select_positions(torch.tensor([[0, 3], [0, 1]]))
    with pytest.raises(ValueError, match="shape"):
        layer.select_positions(torch.tensor([0, 1]))


@pytest.mark.parametrize("window", [0, 2])
def test_batch_select_and_reorder(window):
    layer = PaluQuantizedLayer(bits=3, residual_length=window)
    layer.update(*_latents(5, 0))
    keys, values = layer.get_states()
    layer.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(layer.get_states()[0], keys[[1, 0]], atol=0, rtol=0)
    layer.batch_select_indices(torch.tensor([1]))  # row 1 after the reorder: the original row 0
    torch.testing.assert_close(layer.get_states()[1], values[[0]], atol=0, rtol=0)
    layer.batch_repeat_interleave(2)
    torch.testing.assert_close(layer.get_states()[0], keys[[0, 0]], atol=0, rtol=0)


@pytest.mark.parametrize("bits,window", [(2, 0), (3, 0), (4, 5)])
def test_true_bytes(bits, window):
    layer = PaluQuantizedLayer(bits=bits, residual_length=window)
    layer.update(*_latents(9, 0))
    per_token = compute_bytes_per_token(RK, bits) + compute_bytes_per_token(RV, bits)
    full = (RK + RV) * 4 * min(window, 9)
    positions = B * min(window, 9) * 8  # the window's int64 positions, one per row and token
    assert layer.get_cache_bytes() == B * G * (9 * per_token) + B * G * full + positions


def test_early_initialization_placeholder_shapes_are_replaced():
    cache = PaluQuantizedCache(bits=3)
    cache.layers.append(PaluQuantizedLayer(bits=3))
    cache.early_initialization(batch_size=B, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    keys, values = cache.update(*_latents(3, 0), layer_idx=0)
    assert keys.shape == (B, G, 3, RK) and values.shape == (B, G, 3, RV)


def test_window_length():
    layer = PaluQuantizedLayer(residual_length=4)
    assert layer.window_length == 0
    layer.update(*_latents(3, 0))
    assert layer.window_length == 3
    layer.update(*_latents(3, 1))
    assert layer.window_length == 4


@pytest.mark.parametrize("window", [0, 2])
def test_batch_rows_equal_single_row_runs(window):
    batched = PaluQuantizedLayer(bits=3, residual_length=window)
    rows = [PaluQuantizedLayer(bits=3, residual_length=window) for _ in range(B)]
    for step, tokens in enumerate([4, 1, 2]):
        k, v = _latents(tokens, step)
        keys, values = batched.update(k, v)
        for row, layer in enumerate(rows):
            row_keys, row_values = layer.update(k[row : row + 1], v[row : row + 1])
            torch.testing.assert_close(keys[row : row + 1], row_keys, atol=0, rtol=0)
            torch.testing.assert_close(values[row : row + 1], row_values, atol=0, rtol=0)


@pytest.mark.parametrize("window", [0, 3, 10])  # 10: every token still in the window (a prompt shorter than it)
def test_fused_reads_apply_the_window_rule_per_query(window):
    """Query at position p reads keys and values at positions > p − R in full precision, the others from codes."""
    from hf_accel.kernels import get_kernel

    layer = PaluQuantizedLayer(bits=3, residual_length=window)
    (k1, v1), (k2, v2) = _latents(6, 0), _latents(2, 1)
    positions = torch.arange(8).expand(B, -1)
    layer.append(k1, v1, positions[:, :6])
    layer.release_window(positions[:, :6], 6)
    layer.append(k2, v2, positions[:, 6:])  # a 2-token pass: queries at positions 6 and 7
    raw_k, raw_v = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
    heads, head_dim = 2 * G, 8
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(B, heads, 2, head_dim, generator=gen)
    up_proj = torch.randn(G, RK, head_dim, generator=gen)  # one key/value head per group
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    probs = torch.rand(B, heads, 2, 8, generator=gen).softmax(-1)
    actual_scores = layer.key_scores(query, up_proj, positions, inv_freq, scaling=0.5)
    actual_out = layer.attend_values(probs, positions)
    for i, p in enumerate((6, 7)):
        full = ((torch.arange(8) > p - window) & (window > 0))[None, None, :, None]
        keys, values = torch.where(full, raw_k, _qdq(raw_k)), torch.where(full, raw_v, _qdq(raw_v))
        expected = get_kernel("rope_key_scores")(
            query[:, :, i : i + 1], keys, up_proj, positions, inv_freq, scaling=0.5
        )
        torch.testing.assert_close(actual_scores[:, :, i : i + 1], expected, atol=1e-5, rtol=1e-5)
        expected = probs[:, :, i : i + 1].reshape(B, G, -1, 8) @ values
        torch.testing.assert_close(actual_out[:, :, i : i + 1], expected.view(B, heads, 1, RV), atol=1e-5, rtol=1e-5)


def test_release_window_keeps_what_later_queries_read():
    layer = PaluQuantizedLayer(bits=3, residual_length=4)
    positions = torch.arange(20).expand(B, -1)
    layer.append(*_latents(10, 0), positions[:, :10])
    layer.release_window(positions[:, :10], 10)  # any pass may be rolled back (transformers crops its first)
    assert layer.window_positions[0].tolist() == list(range(10))
    layer.append(*_latents(5, 1), positions[:, 10:15])  # queries from 10 on: 7, 8, 9 are still read
    assert layer.window_positions[0].tolist() == list(range(7, 15))
    layer.release_window(positions[:, :15], 5)  # a draft of 5 rooted at 10, wholly cropped or not: queries from 10 on
    assert layer.window_positions[0].tolist() == list(range(7, 15))
    layer.crop(11)  # the root kept: the next query is at 11
    layer.append(*_latents(1, 2), positions[:, 11:12])
    layer.release_window(positions[:, :12], 1)
    assert layer.window_positions[0].tolist() == list(range(8, 12))


def test_release_window_with_masked_holes_keeps_every_readable_copy():
    # Batched verification leaves holes that repeat an earlier position: readable copies are not a suffix of slots
    layer = PaluQuantizedLayer(bits=3, residual_length=4)
    positions = torch.tensor([[5, 6, 7, 4, 4, 8], [3, 4, 5, 6, 7, 8]])
    layer.append(*_latents(6, 0), positions)
    layer.release_window(positions, 1)  # the next query at 8 (this one again, if cropped) reads 5, 6, 7, 8
    assert layer.window_positions.tolist() == [[5, 6, 7, 4, 4, 8], [3, 4, 5, 6, 7, 8]]
    layer.crop(5)
    layer.append(*_latents(1, 1), torch.tensor([[9], [9]]))
    layer.release_window(torch.tensor([[5, 6, 7, 4, 4, 9], [3, 4, 5, 6, 7, 9]]), 1)  # queries from 9 on: 6, 7, 8
    assert layer.window_positions.tolist() == [[6, 7, 4, 4, 9], [4, 5, 6, 7, 9]]


def test_invalid_construction():
    with pytest.raises(ValueError, match="bits"):
        PaluQuantizedCache(bits=16)
    with pytest.raises(ValueError, match="residual_length"):
        PaluQuantizedLayer(residual_length=-1)
    with pytest.raises(ValueError, match="group_size"):
        PaluQuantizedLayer(group_size=5).update(*_latents(1, 0))


def test_cache_drives_a_llama_forward_and_generate(tiny_llama):
    from transformers import DynamicCache

    ids = torch.randint(3, 97, (2, 12))
    cache = PaluQuantizedCache(tiny_llama.config, bits=8)
    out = tiny_llama(ids, **{CACHE_NAME: cache}, use_cache=True)
    ref = tiny_llama(ids, **{CACHE_NAME: DynamicCache()}, use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-2, rtol=0)
    assert cache.get_seq_length() == 12 and cache.get_cache_bytes() > 0
    cache.crop(-3)
    assert cache.get_seq_length() == 9
    cache.select_positions(torch.tensor([[0, 1, 2, 5], [0, 1, 3, 4]]))
    assert cache.get_seq_length() == 4
    generated = tiny_llama.generate(ids, **{CACHE_NAME: PaluQuantizedCache(bits=4)}, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 16)


def test_the_empty_window_holds_no_prefill_memory():
    """Without a window, the layer must not keep views of the prefill's float latents alive."""
    layer = PaluQuantizedLayer(3)
    k, v = _latents(50, seed=0)
    layer.update(k, v)
    assert layer.keys.shape[-2] == 0 and layer.values.shape[-2] == 0
    assert layer.keys.untyped_storage().nbytes() == 0 and layer.values.untyped_storage().nbytes() == 0


def test_straight_through_reads_the_codes_forward_and_passes_gradients_back():
    layer = PaluQuantizedLayer(bits=3)
    states = torch.randn(2, 3, 5, 8, requires_grad=True)
    read = layer.straight_through(states)
    expected = layer._quantize(states.detach()).dequantize(torch.float32)
    torch.testing.assert_close(read, expected, rtol=0, atol=1e-6)
    weights = torch.randn_like(read)
    (read * weights).sum().backward()
    assert torch.equal(states.grad, weights)  # the identity: rounding is skipped in the backward pass


def test_select_positions_in_any_order_keeps_only_the_trailing_window_run():
    # index order is free: a window slot (4 or 5) placed before a coded one (0, 1) loses its full-precision copy
    layer, ref = PaluQuantizedLayer(bits=3, residual_length=3), _Reference(3)
    k, v = _latents(6, 0)
    layer.update(k, v)
    ref.append(k, v)
    index = torch.tensor([[5, 0, 4], [4, 1, 5]])
    layer.select_positions(index)
    ref.select(index)
    _check(layer, ref)
    assert layer.window_length == 1


def test_release_window_drops_every_copy_no_later_query_reads():
    layer = PaluQuantizedLayer(bits=3, residual_length=2)
    layer.append(*_latents(4, 0), torch.arange(4).expand(B, -1))
    layer.release_window(torch.full((B, 1), 10), 1)  # the next queries are at 10 or later: 0..3 are read from codes
    assert layer.window_length == 0 and layer.window_positions.shape == (B, 0)


def test_tokens_appended_without_positions_are_read_from_codes():
    from hf_accel.kernels import get_kernel

    layer = PaluQuantizedLayer(bits=3, residual_length=4)
    k, v = _latents(3, 0)
    layer.append(k, v)  # positions unknown: no query reads their full-precision copies
    head_dim, positions = 8, torch.arange(3).expand(B, -1)
    gen = torch.Generator().manual_seed(1)
    query, up_proj = torch.randn(B, G, 1, head_dim, generator=gen), torch.randn(G, RK, head_dim, generator=gen)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    expected = get_kernel("rope_key_scores")(query, _qdq(k), up_proj, positions, inv_freq)
    torch.testing.assert_close(layer.key_scores(query, up_proj, positions, inv_freq), expected, atol=1e-5, rtol=1e-5)
    probs = torch.rand(B, G, 1, 3, generator=gen).softmax(-1)
    torch.testing.assert_close(layer.attend_values(probs, positions), probs @ _qdq(v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("residual_length", [0, 2])
def test_checkpoints_older_than_the_sources_hash_read_values_without_positions(residual_length):
    # a Palu checkpoint converted before its palu_kernels.py checked the sources hash takes this class from an installed
    # hf_accel whatever its version, and its modeling code calls `attend_values(probs, backend=...)`: without a window
    # the positions are not needed, and with one that code's reads (by slot) are refused in one line
    layer = PaluQuantizedLayer(bits=3, residual_length=residual_length)
    k, v = _latents(3, 0)
    layer.append(k, v)  # that code appends without positions too
    probs = torch.rand(B, G, 1, 3, generator=torch.Generator().manual_seed(1)).softmax(-1)
    if residual_length:
        with pytest.raises(ValueError, match="by slot, not by position.*`hf-accel convert palu`"):
            layer.attend_values(probs, backend="eager")
    else:
        torch.testing.assert_close(layer.attend_values(probs, backend="eager"), probs @ _qdq(v), atol=1e-5, rtol=1e-5)


def test_checkpoints_that_said_whether_a_pass_was_committed_release_as_every_pass_is_rolled_back():
    # Palu checkpoints converted between 1aaf36b and 556d9c7 call `release_window(..., committed=past_len == 0)` on the
    # installed hf_accel's layer: a TypeError in plain generate. The flag is ignored: a prefill, too, keeps what a
    # query after a crop of it reads
    layer, ref = PaluQuantizedLayer(bits=3, residual_length=2), PaluQuantizedLayer(bits=3, residual_length=2)
    k, v = _latents(6, 0)
    positions = torch.arange(6).expand(B, -1)
    for each, kwargs in ((layer, {"committed": True}), (ref, {})):
        each.append(k, v, positions)
        each.release_window(positions, 6, **kwargs)
    assert layer.window_length == ref.window_length == 6 and torch.equal(layer.window_positions, ref.window_positions)


def test_an_empty_layer_holds_nothing_and_its_row_operations_are_no_ops():
    layer = PaluQuantizedLayer(bits=3, residual_length=2)
    layer.batch_select_indices(torch.tensor([0]))
    layer.reorder_cache(torch.tensor([0]))
    layer.batch_repeat_interleave(2)
    layer.select_positions(torch.zeros(1, 0, dtype=torch.long))
    layer.offload()
    layer.prefetch()
    assert not layer.is_initialized and layer.quantized_keys is None
    assert layer.get_seq_length() == 0 and layer.window_length == 0 and layer.get_cache_bytes() == 0
    assert PaluQuantizedCache(bits=3).get_cache_bytes() == 0


@pytest.mark.parametrize("window", [0, 2])
def test_reset_empties_the_layer_for_a_new_sequence(window):
    layer, ref = PaluQuantizedLayer(bits=3, residual_length=window), _Reference(window)
    layer.update(*_latents(5, 0))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.get_cache_bytes() == 0 and layer.quantized_values is None
    layer.update(*_latents(3, 1))
    ref.append(*_latents(3, 1))
    _check(layer, ref)


@pytest.mark.parametrize("window", [0, 3])
def test_offload_and_prefetch_on_the_cpu_keep_the_states(window):
    layer = PaluQuantizedLayer(bits=3, residual_length=window)
    layer.update(*_latents(5, 0))
    keys, values = layer.get_states()
    layer.offload()
    layer.prefetch()
    torch.testing.assert_close(layer.get_states(), (keys, values), atol=0, rtol=0)


def test_selecting_no_position_empties_a_layer_with_a_window():
    layer = PaluQuantizedLayer(bits=3, residual_length=3)
    layer.update(*_latents(5, 0))
    layer.select_positions(torch.zeros(B, 0, dtype=torch.long))
    assert layer.get_seq_length() == 0 and layer.window_length == 0
    assert layer.get_cache_bytes() == 0
    ref = _Reference(3)
    layer.update(*_latents(2, 1))
    ref.append(*_latents(2, 1))
    _check(layer, ref)
