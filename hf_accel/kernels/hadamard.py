"""Walsh–Hadamard rotations for Palu latents (spec 002 §2.5, Eq. 7).

SVD puts the largest singular directions first, so the first channels of every latent group carry outliers that
stretch the per-token quantization range. An orthonormal rotation `R` folded offline into the factors
(`A → A R`, `B → Rᵀ B`) spreads them over all channels at no runtime cost, and leaves the unquantized
reconstruction `x A B` unchanged.

Non-power-of-two ranks (spec §7 item 6): the Palu code uses stored Paley/Williamson matrices (`had_K`). We use a
**block-diagonal** Hadamard instead, with one normalised Sylvester block per set bit of `r`, largest first
(`96 = 64 + 32`, `352 = 256 + 64 + 32`). It is exactly orthogonal and symmetric, needs no tables, adds no cache
bytes (padding to the next power of two would store extra channels), and its first block, the largest, is the
one that covers the leading outlier channels. Its limit: channels of different blocks are not mixed with each other.
"""

import math

import torch


def compute_hadamard_block_sizes(size: int) -> list[int]:
    """
    Power-of-two block sizes of the block-diagonal Hadamard rotation of `size` channels, largest first.

    Args:
        size (`int`): number of channels (the latent rank `r_g`), at least 1.

    Returns:
        `list[int]`: the set bits of `size`, for example `[64, 32]` for 96 and `[128]` for 128.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"A Hadamard rotation needs a positive integer size, got {size!r}.")
    return [1 << bit for bit in range(size.bit_length() - 1, -1, -1) if size >> bit & 1]


def _sylvester_hadamard(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    # H_{2m} = [[H_m, H_m], [H_m, -H_m]], built in float64 and normalised so that H Hᵀ = I
    matrix = torch.ones(1, 1, dtype=torch.float64, device=device)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return (matrix / math.sqrt(n)).to(dtype)


def hadamard_matrix(size: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """
    The orthonormal (block-diagonal) Walsh–Hadamard matrix used to rotate Palu latents.

    For a power of two it is the normalised Sylvester matrix; otherwise it is block-diagonal over the blocks of
    [`compute_hadamard_block_sizes`]. In both cases it is symmetric and orthogonal, so it is its own inverse.

    Args:
        size (`int`): number of channels `r`.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the result.
        device (*optional*): device of the result.

    Returns:
        `torch.Tensor` of shape `[size, size]` with `H @ H.T == I`.
    """
    blocks = [_sylvester_hadamard(n, torch.float64, device) for n in compute_hadamard_block_sizes(size)]
    return torch.block_diag(*blocks).to(dtype)


def _fwht_power_of_two(x: torch.Tensor) -> torch.Tensor:
    # In-register butterflies over the last axis: log2(n) stages of (a + b, a - b), then 1/sqrt(n)
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        x = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], dim=-2)
        h *= 2
    return x.reshape(*lead, n) / math.sqrt(n)


def apply_hadamard(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """
    Rotate `x` along `dim` by the orthonormal Hadamard matrix of that size, in `O(n log n)`.

    Equal to `x @ hadamard_matrix(n)` along `dim` (the matrix is symmetric, so this is also its inverse).
    Computed in float32 (float64 inputs stay float64) and cast back to the input dtype.

    Args:
        x (`torch.Tensor`): tensor of any shape, for example latents `[batch, groups, seq_len, r]`.
        dim (`int`, *optional*, defaults to `-1`): the channel axis to rotate.

    Returns:
        `torch.Tensor` with the shape and dtype of `x`.
    """
    x_last = x.movedim(dim, -1)
    work = x_last.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    chunks, start = [], 0
    for block in compute_hadamard_block_sizes(x_last.shape[-1]):
        chunks.append(_fwht_power_of_two(work[..., start : start + block]))
        start += block
    return torch.cat(chunks, dim=-1).to(x.dtype).movedim(-1, dim)


def fold_hadamard_into_factors(down_proj: torch.Tensor, up_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Fold the latent rotation into a low-rank pair: `A → A H` and `B → Hᵀ B` (spec 002 Eq. 7).

    Row-vector form of the spec: latent `h = x A`, reconstruction `y = h B`. After folding the cache holds
    `ĥ = h H` and `ĥ (Hᵀ B) = h B`, so unquantized outputs are unchanged. Leading dimensions are groups and are
    rotated independently (one `r_g × r_g` rotation per group, as in the paper). For `nn.Linear` weights, which are
    transposed, pass `down_linear.weight.T` and `up_linear.weight.T` and transpose the results back.

    Args:
        down_proj (`torch.Tensor` of shape `[..., in_features, r]`): the down-projection `A` (per group).
        up_proj (`torch.Tensor` of shape `[..., r, out_features]`): the reconstruction `B` (per group).

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the rotated `(A H, Hᵀ B)`, same shapes and dtypes, computed in float64.

    Example:

    ```python
    >>> A, B = torch.randn(32, 24), torch.randn(24, 16)
    >>> A_rot, B_rot = fold_hadamard_into_factors(A, B)
    >>> torch.allclose(A_rot @ B_rot, A @ B, atol=1e-4)
    True

    ```
    """
    rank = down_proj.shape[-1]
    if up_proj.shape[-2] != rank:
        raise ValueError(
            f"The down-projection has rank {rank} (last axis of {tuple(down_proj.shape)}) but the up-projection has "
            f"{up_proj.shape[-2]} rows ({tuple(up_proj.shape)}); pass A as [..., in, r] and B as [..., r, out]."
        )
    rotation = hadamard_matrix(rank, torch.float64, down_proj.device)
    down_rot = down_proj.to(torch.float64) @ rotation
    up_rot = rotation.T @ up_proj.to(torch.float64)
    return down_rot.to(down_proj.dtype), up_rot.to(up_proj.dtype)
