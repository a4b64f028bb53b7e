"""Activation-aware low-rank factorization of a projection weight (CARE Stage 2–3 and 5; Palu's whitened SVD).

Everything here is pure math on tensors, row-vector convention as in the CARE spec: a projection is `y = x W` with
`W` of shape `[in, out]` (`linear.weight.T`). A factorization scales the input space by an invertible `S` with
`SᵀS = C` (the weighting of the error), takes the SVD of `S W`, and returns

    down = S⁻¹ U Σ   [in, R]      up = Vᵀ   [R, out]      sigma = Σ   [R]

so that `down[:, :r] @ up[:r]` is the best rank-`r` approximation of `W` under `‖S (W − Ŵ)‖_F` (Eckart–Young). The
three methods share this path and differ only in `S`: plain SVD (`S = I`), ASVD (`S = diag(mean|x|)^α`), and CARE /
SVD-LLM whitening (`S = √C_λ`, the symmetric root of the shrunk second moment).
"""

from dataclasses import dataclass

import torch


@dataclass
class LowRankFactors:
    """The full-rank whitened SVD of one weight; `truncate(r)` gives the rank-`r` down/up pair.

    Attributes:
        down (`torch.Tensor` of shape `[in, R]`): `S⁻¹ U Σ`, the down-projection (Σ absorbed, spec Eq. 3.11).
        up (`torch.Tensor` of shape `[R, out]`): `Vᵀ`, the up-projection (spec Eq. 3.12).
        sigma (`torch.Tensor` of shape `[R]`): singular values of `S W`, descending.
    """

    down: torch.Tensor
    up: torch.Tensor
    sigma: torch.Tensor

    @property
    def max_rank(self) -> int:
        return self.sigma.numel()

    def truncate(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(down [in, rank], up [rank, out])`; raises `ValueError` for a rank outside [1, max_rank]."""
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside [1, {self.max_rank}] (the matrix's largest rank)")
        return self.down[:, :rank], self.up[:rank]

    def keep_ranks(self, rank: int) -> "LowRankFactors":
        """The first `rank` ranks in tensors of their own (`truncate` gives views, which keep the full-rank factors
        alive); raises `ValueError` for a rank outside [1, max_rank]."""
        down, up = self.truncate(rank)
        return LowRankFactors(down=down.clone(), up=up.clone(), sigma=self.sigma[:rank].clone())


def check_shrinkage(alpha: float, lam_frac: float) -> None:
    """Refuses a shrinkage that is not a convex mix with a non-negative ridge (`C_λ` would not be PSD)."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    if not lam_frac >= 0.0:
        raise ValueError(f"lam_frac must be non-negative, got {lam_frac}")


def shrink_moment(moment: torch.Tensor, alpha: float = 0.05, lam_frac: float = 1e-2) -> torch.Tensor:
    """Ledoit–Wolf style shrinkage `C_λ = (1 − α) C + α λ I` with `λ = lam_frac · λ_max(C)` (spec Eq. 3.8).

    Args:
        moment (`torch.Tensor` of shape `[D, D]`): the uncentred second moment `C`, symmetric PSD.
        alpha (`float`, *optional*, defaults to 0.05): shrinkage weight α.
        lam_frac (`float`, *optional*, defaults to 0.01): λ as a fraction of the largest eigenvalue of `C`.
    """
    moment = moment.double()
    lam = lam_frac * torch.linalg.eigvalsh(moment).max().clamp_min(0.0)
    eye = torch.eye(moment.shape[0], dtype=moment.dtype, device=moment.device)
    return (1.0 - alpha) * moment + alpha * lam * eye


def symmetric_sqrt(matrix: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(S, S⁻¹)` with `S = Q Λ^½ Qᵀ` the symmetric root of a symmetric positive-definite `matrix`.

    Eigenvalues below `eps · λ_max` are clamped so the inverse stays finite (the spec asks for condition numbers
    below 1e12).
    """
    evals, evecs = torch.linalg.eigh(matrix.double())
    evals = evals.clamp_min(eps * evals.max().clamp_min(eps))
    root = evals.sqrt()
    return (evecs * root) @ evecs.T, (evecs / root) @ evecs.T


def factorize(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    out_scale_inv: torch.Tensor | None = None,
) -> LowRankFactors:
    """Full SVD of `S W` (or `S W B`), returned as down/up factors of `W` (all ranks; truncate later).

    With an output weighting `B` the truncation minimises `‖S (W − Ŵ) B‖_F`: `S W B = U Σ Vᵀ`, `down = S⁻¹ U Σ / β`,
    `up = β Vᵀ B⁻¹` with `β = ‖B‖₂`, so that the scale of `B` (loss gradients can be tiny) stays in `sigma` and out of
    the factors, which a float16 checkpoint could not hold.

    Args:
        weight (`torch.Tensor` of shape `[in, out]`): `W = linear.weight.T`.
        scale (`torch.Tensor` of shape `[in, in]` or `[in]`, *optional*): `S`; a vector means `diag(S)` (ASVD);
            `None` means `S = I` (plain SVD).
        scale_inv (`torch.Tensor`, *optional*): `S⁻¹` when `scale` is a matrix (computed if omitted).
        out_scale, out_scale_inv (`torch.Tensor` of shape `[out, out]`, *optional*): `B` and `B⁻¹`.

    Returns:
        [`LowRankFactors`] in float64.
    """
    weight = weight.double()
    if scale is None:
        scaled, unscale = weight, None
    elif scale.dim() == 1:
        scaled = scale.double()[:, None] * weight  # diag(s) W
        unscale = lambda m: m / scale.double()[:, None]
    else:
        inv = torch.linalg.inv(scale.double()) if scale_inv is None else scale_inv.double()
        scaled = scale.double() @ weight
        unscale = lambda m: inv @ m
    if out_scale is not None:
        out_inv = torch.linalg.inv(out_scale.double()) if out_scale_inv is None else out_scale_inv.double()
        scaled = scaled @ out_scale.double()
    u, sigma, vt = torch.linalg.svd(scaled, full_matrices=False)  # u [in, R], sigma [R], vt [R, out]
    down = u * sigma
    down = down if unscale is None else unscale(down)
    up = vt
    if out_scale is not None:
        beta = torch.linalg.matrix_norm(out_scale.double(), ord=2)
        down, up = down / beta, beta * (vt @ out_inv)
    return LowRankFactors(down=down, up=up, sigma=sigma)


def whitened_factorize(
    weight: torch.Tensor, moment: torch.Tensor, alpha: float = 0.05, lam_frac: float = 1e-2
) -> LowRankFactors:
    """CARE's covariance-weighted SVD: `factorize(W, √C_λ)` (spec Stage 2–3 and 5)."""
    scale, scale_inv = symmetric_sqrt(shrink_moment(moment, alpha, lam_frac))
    return factorize(weight, scale, scale_inv)


def asvd_scale(abs_mean: torch.Tensor, alpha: float = 0.5, eps: float = 1e-6) -> torch.Tensor:
    """ASVD's diagonal input scaling `diag(mean_t |x_t|)^α` (Yuan et al. 2023; spec A.5, α = 0.5)."""
    return abs_mean.double().clamp_min(eps) ** alpha
