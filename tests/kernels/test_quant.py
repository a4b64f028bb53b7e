import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.kernels.hadamard import apply_hadamard
from hf_accel.kernels.quant import (
    cat_quantized,
    compute_bytes_per_token,
    dequantize_per_token,
    pack_codes,
    quantize_per_token,
    unpack_codes,
)
from tests.conftest import LargestStorage


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dim", [1, 8, 13, 64])
@pytest.mark.parametrize("tokens", [4, 0])  # 0: an empty slice of a cache
def test_pack_round_trip_and_size(bits, dim, tokens):
    codes = torch.randint(0, 2**bits, (3, tokens, dim), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, tokens, math.ceil(dim * bits / 8))
    torch.testing.assert_close(unpack_codes(packed, bits, dim), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_aligned_fast_path_matches_generic_bit_stream(bits):
    # the same codes with one code too many for whole bytes take the generic path: the layouts must agree
    codes = torch.randint(0, 2**bits, (5, 17), dtype=torch.uint8)
    aligned, generic = pack_codes(codes[:, :16], bits), pack_codes(codes, bits)
    torch.testing.assert_close(generic[:, : aligned.shape[1]], aligned)


def test_unpacking_3_bit_codes_takes_one_int32_per_code():
    # every decoding step unpacks the whole cache: no intermediate may expand the codes to their bits (12 bytes per
    # 3-bit code as int32), only to one int32 per code, as the byte-aligned widths do
    codes = torch.randint(0, 8, (2, 4, 64, 24), dtype=torch.uint8)
    packed = pack_codes(codes, 3)
    with LargestStorage() as mode:
        unpacked = unpack_codes(packed, 3, 24)
    assert torch.equal(unpacked, codes)
    assert mode.largest <= 4 * codes.numel()


def test_pack_layout_is_little_endian_bit_stream():
    # codes 1..8 at 3 bits: bits 001 010 011 100 101 110 111 000 → 3 bytes
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack_codes(codes, 3).tolist() == [stream & 255, stream >> 8 & 255, stream >> 16 & 255]


def _check_bound(x, bits, group_size, meta_dtype):
    q = quantize_per_token(x, bits, group_size, meta_dtype)
    err = (x.float() - dequantize_per_token(q)).abs()
    size = q.group_size
    step = q.scales.float().repeat_interleave(size, dim=-1)
    slack = 1e-6 * (x.float().abs() + q.zeros.float().abs().repeat_interleave(size, dim=-1)) + 1e-30
    assert (err <= step / 2 + slack).all(), (err - step / 2).max()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_error_bound_half_a_step(bits, group_size, meta_dtype):
    torch.manual_seed(bits)
    x = torch.randn(4, 3, 10, 64) * torch.logspace(-2, 2, 64)
    _check_bound(x, bits, group_size, meta_dtype)


def test_error_bound_on_one_signed_and_constant_vectors():
    x = torch.stack([torch.rand(32) + 5.0, -torch.rand(32) - 5.0, torch.full((32,), 0.3), torch.zeros(32)])
    for bits in (2, 3, 4):
        _check_bound(x, bits, None, torch.float16)
    q = quantize_per_token(torch.full((1, 32), 0.25), 2)
    torch.testing.assert_close(dequantize_per_token(q), torch.full((1, 32), 0.25))


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    dim=st.sampled_from([8, 24, 32]),
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-50, 50),
    seed=st.integers(0, 2**16),
)
def test_error_bound_property(bits, dim, scale, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, dim, generator=gen) * scale + offset
    _check_bound(x, bits, None, torch.float16)


def test_exact_values_on_grid():
    # a vector on the 2-bit grid {0, 1, 2, 3}·0.5 − 1 comes back exactly
    x = torch.tensor([[-1.0, -0.5, 0.0, 0.5, 0.5, -1.0, 0.0, -0.5]])
    q = quantize_per_token(x, 2)
    torch.testing.assert_close(dequantize_per_token(q), x)
    assert q.scales.item() == 0.5 and q.zeros.item() == -1.0
    assert unpack_codes(q.codes, 2, 8).tolist() == [[0, 1, 2, 3, 3, 0, 2, 1]]


@pytest.mark.parametrize("bits,group_size,expected", [(3, None, 24 + 4), (2, None, 16 + 4), (4, 16, 32 + 16)])
def test_bytes_per_token_is_exact(bits, group_size, expected):
    q = quantize_per_token(torch.randn(6, 64), bits, group_size)
    assert compute_bytes_per_token(64, bits, group_size) == expected
    assert q.nbytes == 6 * expected


def test_cat_and_apply_on_leading_dims():
    x = torch.randn(2, 3, 5, 16)
    a, b = quantize_per_token(x[:, :, :2], 3), quantize_per_token(x[:, :, 2:], 3)
    full = cat_quantized([a, b], dim=-2)
    torch.testing.assert_close(full.dequantize(), quantize_per_token(x, 3).dequantize())
    picked = full.apply(lambda t: t[:, :, [4, 0]])
    torch.testing.assert_close(picked.dequantize(), full.dequantize()[:, :, [4, 0]])


def test_invalid_arguments():
    with pytest.raises(ValueError, match="bits"):
        quantize_per_token(torch.randn(4, 8), 9)
    with pytest.raises(ValueError, match="group_size"):
        quantize_per_token(torch.randn(4, 8), 2, group_size=3)


def test_hadamard_lowers_error_on_svd_like_outliers():
    # leading outlier channels, as SVD latents have (spec 002 Fig. 4): rotation must cut the 3-bit error
    torch.manual_seed(0)
    x = torch.randn(256, 64) * torch.cat([torch.full((4,), 30.0), torch.ones(60)])
    plain = (dequantize_per_token(quantize_per_token(x, 3)) - x).pow(2).mean()
    rotated = apply_hadamard(x)
    rot_err = (apply_hadamard(dequantize_per_token(quantize_per_token(rotated, 3))) - x).pow(2).mean()
    assert rot_err < 0.5 * plain


@pytest.mark.parametrize("row", [[0.0, 5e5, 1.0, 2.0], [-7e4, 0.0, 1.0, 2.0]])
def test_float16_metadata_saturates_instead_of_overflowing(row):
    """Latents beyond the float16 range clip (finite) rather than turning the whole token into NaN."""
    x = torch.tensor([row])
    q = quantize_per_token(x, 3)
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all()
    out = dequantize_per_token(q)
    assert torch.isfinite(out).all()
    assert (out - x).abs()[0, 2:].max() <= q.scales.float().max()  # small entries stay within a step
    wide = quantize_per_token(x, 3, meta_dtype=torch.float32)  # float32 metadata keeps the bound
    assert ((dequantize_per_token(wide) - x).abs() <= wide.scales / 2 + 1e-3).all()


@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.bfloat16])
def test_stored_grid_covers_the_range(meta_dtype):
    # zero rounded down and step rounded up to meta_dtype: X_min ≥ zero and zero + (2^b − 1)·step ≥ X_max
    torch.manual_seed(0)
    x = torch.randn(64, 32) * 3 + 1
    for bits in (2, 3, 4):
        q = quantize_per_token(x, bits, meta_dtype=meta_dtype)
        zeros, steps = q.zeros.double()[:, 0], q.scales.double()[:, 0]
        assert (zeros <= x.double().amin(-1)).all()
        top = zeros + (2**bits - 1) * steps
        assert (top >= x.double().amax(-1) - 1e-6 * x.double().abs().amax(-1)).all()


def test_saturated_latent_takes_the_top_code():
    # 5e5 exceeds what a float16 step can reach at 3 bits: it is clipped to the last grid point, code 7
    q = quantize_per_token(torch.tensor([[0.0, 5e5, 1.0, 2.0]]), 3)
    assert unpack_codes(q.codes, 3, 4)[0, 1] == 7
    assert dequantize_per_token(q)[0, 1] == 7 * q.scales.float().item() + q.zeros.float().item()


def test_constant_vector_gets_a_positive_step_and_code_zero():
    q = quantize_per_token(torch.zeros(2, 16), 3)
    assert (q.scales > 0).all() and (unpack_codes(q.codes, 3, 16) == 0).all()


@pytest.mark.parametrize("dim,bits", [(13, 3), (5, 2), (7, 4), (3, 5)])
def test_bytes_per_token_rounds_the_bit_stream_up(dim, bits):
    q = quantize_per_token(torch.randn(4, dim), bits)
    assert compute_bytes_per_token(dim, bits) == math.ceil(dim * bits / 8) + 4 == q.nbytes // 4


def test_cat_along_the_channel_axis_is_refused():
    a = quantize_per_token(torch.randn(2, 3, 8), 3)
    with pytest.raises(ValueError, match="leading dimension"):
        cat_quantized([a, a], dim=-1)
    with pytest.raises(ValueError, match="leading dimension"):
        cat_quantized([a, a], dim=2)
