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
