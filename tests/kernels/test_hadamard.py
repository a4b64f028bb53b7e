import math

import pytest
import torch

from hf_accel.kernels.hadamard import (
    apply_hadamard,
    compute_hadamard_block_sizes,
    fold_hadamard_into_factors,
    hadamard_matrix,
)


SIZES = [1, 2, 8, 32, 64, 96, 24, 352, 384]


def test_block_sizes_are_the_set_bits():
    assert compute_hadamard_block_sizes(128) == [128]
    assert compute_hadamard_block_sizes(96) == [64, 32]
    assert compute_hadamard_block_sizes(352) == [256, 64, 32]
    with pytest.raises(ValueError, match="positive integer"):
        compute_hadamard_block_sizes(0)


@pytest.mark.parametrize("size", SIZES)
def test_matrix_is_orthonormal_and_symmetric(size):
    h = hadamard_matrix(size, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(size, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)


def test_power_of_two_entries_are_plus_minus_one_over_sqrt_n():
    h = hadamard_matrix(16, torch.float64)
    torch.testing.assert_close(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))


def test_non_power_of_two_is_block_diagonal():
    h = hadamard_matrix(96, torch.float64)
    assert h[:64, 64:].abs().sum() == 0 and h[64:, :64].abs().sum() == 0
    torch.testing.assert_close(h[64:, 64:], hadamard_matrix(32, torch.float64))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dim", [-1, 1])
def test_fast_transform_matches_matrix(size, dim):
    x = torch.randn(3, size, 5, dtype=torch.float64) if dim == 1 else torch.randn(3, 5, size, dtype=torch.float64)
    expected = (x.movedim(dim, -1) @ hadamard_matrix(size, torch.float64)).movedim(-1, dim)
    torch.testing.assert_close(apply_hadamard(x, dim=dim), expected)
    # self-inverse
    torch.testing.assert_close(apply_hadamard(apply_hadamard(x, dim=dim), dim=dim), x)


def test_rotation_spreads_a_leading_outlier():
    x = torch.zeros(64)
    x[0] = 100.0
    rotated = apply_hadamard(x)
    assert rotated.abs().max() == pytest.approx(100.0 / 8)


@pytest.mark.parametrize("rank", [16, 24, 96])
def test_folded_factors_reproduce_reconstruction(rank):
    torch.manual_seed(0)
    groups, hidden, out = 2, 40, 48
    down, up = torch.randn(groups, hidden, rank), torch.randn(groups, rank, out)
    x = torch.randn(7, hidden)
    down_rot, up_rot = fold_hadamard_into_factors(down, up)
    # latent' = latent · H
    torch.testing.assert_close(x @ down_rot, apply_hadamard(x @ down), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close((x @ down_rot) @ up_rot, (x @ down) @ up, atol=1e-3, rtol=1e-4)


def test_fold_rejects_mismatched_ranks():
    with pytest.raises(ValueError, match="rank 8"):
        fold_hadamard_into_factors(torch.randn(4, 8), torch.randn(6, 4))


def test_float64_matrix_is_exact():
    h = hadamard_matrix(8, torch.float64)
    assert (h.abs() - 1 / math.sqrt(8)).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_transform_keeps_the_input_dtype(dtype):
    x = torch.randn(3, 24).to(dtype)
    out = apply_hadamard(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), x.float() @ hadamard_matrix(24), atol=2e-2, rtol=2e-2)
