import pytest
import torch

from hf_accel.compress.factorize import (
    asvd_scale,
    factorize,
    shrink_moment,
    symmetric_sqrt,
    whitened_factorize,
)


def _activation_error(x, w, w_hat):
    return ((x.double() @ (w.double() - w_hat)) ** 2).sum() / x.shape[0]


def _random_problem(seed=0, n=64, d_in=6, d_out=5):
    g = torch.Generator().manual_seed(seed)
    # correlated, anisotropic inputs so that whitening matters
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64) @ torch.randn(
        d_in, d_in, generator=g, dtype=torch.float64
    )
    w = torch.randn(d_in, d_out, generator=g, dtype=torch.float64)
    return x, w


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_whitened_svd_error_is_the_discarded_energy(rank):
    x, w = _random_problem()
    f = whitened_factorize(w, x.T @ x / x.shape[0], alpha=0.0)
    down, up = f.truncate(rank)
    err = _activation_error(x, w, down @ up)
    assert torch.allclose(err, (f.sigma[rank:] ** 2).sum(), rtol=1e-8)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_whitened_svd_is_the_brute_force_minimiser(rank):
    """Gradient descent on rank-`rank` factor pairs from many starts never beats the closed form (and reaches it)."""
    x, w = _random_problem(seed=rank)
    f = whitened_factorize(w, x.T @ x / x.shape[0], alpha=0.0)
    closed = _activation_error(x, w, f.down[:, :rank] @ f.up[:rank]).item()
    best = float("inf")
    for start in range(4):
        g = torch.Generator().manual_seed(100 + start)
        a = torch.randn(w.shape[0], rank, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(rank, w.shape[1], generator=g, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([a, b], lr=0.05)
        for _ in range(1500):
            opt.zero_grad()
            loss = _activation_error(x, w, a @ b)
            loss.backward()
            opt.step()
        best = min(best, _activation_error(x, w, (a @ b).detach()).item())
    assert closed <= best + 1e-9
    assert best == pytest.approx(closed, rel=1e-3)
    # ... and plain (unweighted) SVD is worse under the activation metric
    plain = factorize(w)
    assert _activation_error(x, w, plain.down[:, :rank] @ plain.up[:rank]).item() >= closed - 1e-12


def test_two_sided_error_is_the_discarded_energy():
    x, w = _random_problem(seed=3)
    g = torch.Generator().manual_seed(7)
    grads = torch.randn(50, w.shape[1], generator=g, dtype=torch.float64)
    s, s_inv = symmetric_sqrt(x.T @ x / x.shape[0])
    b, b_inv = symmetric_sqrt(grads.T @ grads / grads.shape[0])
    f = factorize(w, s, s_inv, b, b_inv)
    down, up = f.truncate(2)
    err = ((s @ (w - down @ up) @ b) ** 2).sum()
    assert torch.allclose(err, (f.sigma[2:] ** 2).sum(), rtol=1e-8)
    assert torch.allclose(f.down @ f.up, w, atol=1e-9)  # full rank is exact


def test_diagonal_scale_matches_matrix_scale():
    x, w = _random_problem(seed=4)
    scale = asvd_scale(x.abs().mean(0))
    f_vec, f_mat = factorize(w, scale), factorize(w, torch.diag(scale))
    assert torch.allclose(f_vec.down[:, :2] @ f_vec.up[:2], f_mat.down[:, :2] @ f_mat.up[:2], atol=1e-10)


def test_shrinkage():
    x, _ = _random_problem()
    c = x.T @ x / x.shape[0]
    assert torch.allclose(shrink_moment(c, alpha=0.0), c)
    shrunk = shrink_moment(c, alpha=0.1, lam_frac=0.01)
    lam_max = torch.linalg.eigvalsh(c).max()
    assert torch.linalg.eigvalsh(shrunk).min() >= 0.1 * 0.01 * lam_max - 1e-12
    s, s_inv = symmetric_sqrt(shrunk)
    assert torch.allclose(s @ s, shrunk, atol=1e-9) and torch.allclose(
        s @ s_inv, torch.eye(6, dtype=s.dtype), atol=1e-9
    )


def test_truncate_rejects_bad_rank():
    f = factorize(torch.randn(6, 5))
    with pytest.raises(ValueError, match="outside"):
        f.truncate(6)
    with pytest.raises(ValueError, match="outside"):
        f.truncate(0)


def test_shrinkage_is_the_convex_mix_with_a_ridge_at_a_fraction_of_the_largest_eigenvalue():
    # C = diag(4, 1): λ_max = 4, λ = 0.25 · 4 = 1, C_λ = 0.5 C + 0.5 · 1 · I
    c = torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64))
    expected = torch.diag(torch.tensor([2.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(shrink_moment(c, alpha=0.5, lam_frac=0.25), expected)


def test_whitened_factorize_weights_by_the_shrunk_moment():
    # (√C_λ W)ᵀ(√C_λ W) = Wᵀ C_λ W: the σ² are its eigenvalues, with C_λ written out by hand
    x, w = _random_problem(seed=5)
    c = x.T @ x / x.shape[0]
    alpha, lam_frac = 0.3, 0.2
    c_lam = (1 - alpha) * c + alpha * lam_frac * torch.linalg.eigvalsh(c).max() * torch.eye(6, dtype=c.dtype)
    f = whitened_factorize(w, c, alpha=alpha, lam_frac=lam_frac)
    expected = torch.linalg.eigvalsh(w.T @ c_lam @ w).flip(0)
    torch.testing.assert_close(f.sigma**2, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(f.down @ f.up, w, atol=1e-9, rtol=1e-9)


def test_symmetric_sqrt_clamps_relative_to_the_largest_eigenvalue():
    # a dead channel (eigenvalue 0) next to a large one: S's condition number stays at 1/√eps = 1e6, not 1e12+
    s, s_inv = symmetric_sqrt(torch.diag(torch.tensor([1e6, 0.0], dtype=torch.float64)))
    torch.testing.assert_close(torch.diag(s), torch.tensor([1e3, 1e-3], dtype=torch.float64))
    torch.testing.assert_close(s @ s_inv, torch.eye(2, dtype=torch.float64))


def test_asvd_scale_is_the_clamped_mean_to_the_power_alpha():
    scale = asvd_scale(torch.tensor([4.0, 0.0, 9.0]), alpha=0.5, eps=1e-6)
    torch.testing.assert_close(scale, torch.tensor([2.0, 1e-3, 3.0], dtype=torch.float64))
    torch.testing.assert_close(asvd_scale(torch.tensor([4.0]), alpha=1.0), torch.tensor([4.0], dtype=torch.float64))


def test_two_sided_with_a_non_symmetric_output_weighting():
    # B need not be symmetric: the truncation minimises ‖(W − Ŵ) B‖_F all the same
    _, w = _random_problem(seed=6)
    g = torch.Generator().manual_seed(8)
    b = torch.randn(w.shape[1], w.shape[1], generator=g, dtype=torch.float64) + 3 * torch.eye(w.shape[1])
    f = factorize(w, out_scale=b)
    down, up = f.truncate(2)
    err = (((w - down @ up) @ b) ** 2).sum()
    assert torch.allclose(err, (torch.linalg.svdvals(w @ b)[2:] ** 2).sum(), rtol=1e-8)


def test_two_sided_factors_do_not_carry_the_scale_of_the_output_weighting():
    """A tiny B (loss gradients of 1e-10, or none: a calibration of one repeated token) stays in sigma: the factors
    keep the weight's scale, so a float16 checkpoint holds them."""
    x, w = _random_problem(seed=5)
    s, s_inv = symmetric_sqrt(x.T @ x / x.shape[0])
    b = torch.randn(w.shape[1], w.shape[1], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    b = b @ b.T + torch.eye(w.shape[1], dtype=torch.float64)
    ref = factorize(w, s, s_inv, b, torch.linalg.inv(b))
    tiny = factorize(w, s, s_inv, 1e-10 * b, 1e10 * torch.linalg.inv(b))
    torch.testing.assert_close(tiny.sigma, 1e-10 * ref.sigma)  # gains in loss units
    torch.testing.assert_close(tiny.down, ref.down)
    torch.testing.assert_close(tiny.up, ref.up)
    assert tiny.up.abs().max() < 1e3 and torch.allclose(tiny.down @ tiny.up, w, atol=1e-9)
