"""Per-token asymmetric low-bit quantization of Palu latents, with real bit-packing (spec 002 §2.5, App. A Eq. 8).

Each token's latent vector (per group of `group_size` channels, the whole vector by default, as the Palu code's
`lt_group_size=0`) gets its own scale `s` and zero-point, and codes `q ∈ [0, 2^b − 1]`:

    s = (X_max − X_min) / (2^b − 1),   q = clamp(round((X − X_min) / s), 0, 2^b − 1),   X̂ = q·s + X_min

Choices on spec §7 item 5 (granularity, zero-point, dtype):

- The zero-point is stored as a float offset (`X_min`, the `zeros` field), not as Eq. 8's rounded integer
  `z = round(−X_min / s)` clamped to `[0, 2^b − 1]`: that clamp moves the grid off the data for vectors of one sign
  and breaks the `|X − X̂| ≤ s/2` bound. It costs one more byte per group than a uint8 zero-point would.
- Scales and zeros are stored in `meta_dtype` (float16 by default). The offset is rounded *down* and the scale
  *up* to that dtype before the codes are computed, so the grid still covers `[X_min, X_max]` and the bound
  `|X − X̂| ≤ s/2` holds with the stored `s` (up to float32 arithmetic).
- Codes are packed as one little-endian bit stream per token vector: code `i` occupies bits `[i·b, (i+1)·b)`, so
  3-bit codes take exactly 3 bits (8 codes in 3 bytes). The byte count per token is therefore the real one.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def validate_bits(bits: int) -> None:
    if not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"`bits` must be an integer in 1..8 (Palu uses 2, 3 or 4), got {bits!r}.")


def resolve_group_size(dim: int, group_size: int | None) -> int:
    """
    The number of channels sharing one scale and zero-point.

    Args:
        dim (`int`): channels per token vector.
        group_size (`int`, *optional*): `None` or `0` means the whole vector (one scale per token, the Palu default).

    Returns:
        `int`: a divisor of `dim`.
    """
    size = dim if not group_size else group_size
    if size <= 0 or dim % size != 0:
        raise ValueError(f"`group_size` must divide the latent size {dim}, got {group_size!r}; use 0 for one group.")
    return size


def compute_bytes_per_token(
    dim: int, bits: int, group_size: int | None = None, meta_dtype: torch.dtype = torch.float16
) -> int:
    """
    Exact bytes stored for one quantized token vector: packed codes + one scale and one zero per group.

    Args:
        dim (`int`): channels per token vector (for Palu: the group rank `r_g`).
        bits (`int`): code width `b`.
        group_size (`int`, *optional*): channels per scale/zero; `None` or `0` for the whole vector.
        meta_dtype (`torch.dtype`, *optional*, defaults to `torch.float16`): dtype of scales and zeros.

    Returns:
        `int`: `ceil(dim·b / 8) + 2 · (dim / group_size) · sizeof(meta_dtype)`.
    """
    validate_bits(bits)
    num_groups = dim // resolve_group_size(dim, group_size)
    meta_bytes = torch.empty((), dtype=meta_dtype).element_size()
    return math.ceil(dim * bits / 8) + 2 * num_groups * meta_bytes


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """
    Pack integer codes along the last axis into a little-endian bit stream of bytes.

    Args:
        codes (`torch.Tensor` of shape `[..., dim]`): integers in `[0, 2^bits)`.
        bits (`int`): code width.

    Returns:
        `torch.Tensor` of dtype `uint8` and shape `[..., ceil(dim·bits/8)]`.
    """
    validate_bits(bits)
    lead, dim = codes.shape[:-1], codes.shape[-1]
    if 8 % bits == 0 and dim % (8 // bits) == 0:
        # byte-aligned widths (1, 2, 4, 8 bits): whole codes per byte, same stream layout, no bit expansion
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
        grouped = codes.to(torch.int32).reshape(*lead, dim // per_byte, per_byte)
        return (grouped << shifts).sum(-1).to(torch.uint8)
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(*lead, dim * bits)  # [..., dim·bits]
    num_bytes = math.ceil(dim * bits / 8)
    stream = torch.nn.functional.pad(stream, (0, num_bytes * 8 - dim * bits))
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.reshape(*lead, num_bytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """
    Inverse of [`pack_codes`].

    Args:
        packed (`torch.Tensor` of dtype `uint8` and shape `[..., num_bytes]`): the bit stream.
        bits (`int`): code width.
        dim (`int`): number of codes per vector.

    Returns:
        `torch.Tensor` of dtype `uint8` and shape `[..., dim]`.
    """
    validate_bits(bits)
    lead = packed.shape[:-1]
    if 8 % bits == 0 and dim % (8 // bits) == 0:
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
        codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
        return codes.reshape(*lead, dim).to(torch.uint8)
    # 8 codes fill exactly `bits` bytes: read each such run of bytes as one little-endian word and shift the codes out
    # of it, one int32 per code (int64 above 3 bits); expanding every byte to its bits instead would cost 12 bytes per
    # 3-bit code, and this runs over the whole cache at every decoding step. The stream is padded to whole runs.
    words, word_dtype = math.ceil(dim / 8), torch.int32 if bits <= 3 else torch.int64
    runs = torch.nn.functional.pad(packed, (0, words * bits - packed.shape[-1])).reshape(*lead, words, bits)
    byte_shifts = torch.arange(0, 8 * bits, 8, device=packed.device, dtype=word_dtype)
    word = (runs.to(word_dtype) << byte_shifts).sum(-1, keepdim=True, dtype=word_dtype)  # bytes do not overlap
    code_shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=word_dtype)
    codes = ((word >> code_shifts) & (2**bits - 1)).reshape(*lead, words * 8)
    return codes[..., :dim].to(torch.uint8)


@dataclass
class QuantizedLatents:
    """
    Packed per-token quantized latents. All tensor fields share their leading dimensions (for a cache layer:
    `[batch, groups, seq_len]`), so any indexing on those dimensions applies to the three of them alike.

    Args:
        codes (`torch.Tensor` of dtype `uint8`, shape `[..., ceil(dim·bits/8)]`): the packed bit stream per token.
        scales (`torch.Tensor` of shape `[..., dim // group_size]`): step `s` per token and channel group.
        zeros (`torch.Tensor` of shape `[..., dim // group_size]`): float offset (`X_min`) per token and group.
        bits (`int`): code width.
        group_size (`int`): channels per scale/zero.
        dim (`int`): channels per token vector.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    dim: int

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedLatents":
        """Apply `fn` (an operation on leading dimensions only) to codes, scales and zeros alike."""
        return QuantizedLatents(fn(self.codes), fn(self.scales), fn(self.zeros), self.bits, self.group_size, self.dim)

    @property
    def nbytes(self) -> int:
        """True stored bytes: packed codes + scales + zeros."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Shortcut for [`dequantize_per_token`]."""
        return dequantize_per_token(self, dtype)


def cat_quantized(items: list[QuantizedLatents], dim: int) -> QuantizedLatents:
    """Concatenate quantized latents along a leading dimension `dim` (for example the sequence axis, `-2`)."""
    first = items[0]
    if dim >= first.codes.dim() - 1 or dim == -1:
        raise ValueError(f"Quantized latents can only be concatenated along a leading dimension, got dim={dim}.")
    cat = lambda name: torch.cat([getattr(item, name) for item in items], dim=dim)
    return QuantizedLatents(cat("codes"), cat("scales"), cat("zeros"), first.bits, first.group_size, first.dim)


def _round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    # Nearest representable value in `dtype` on the requested side of `x` (direction -inf: below, +inf: above),
    # saturated to the dtype's finite range: never inf, so a latent beyond it is clipped instead of becoming NaN
    finfo = torch.finfo(dtype)
    x = x.clamp(finfo.min, finfo.max)
    rounded = x.to(dtype)
    wrong_side = rounded.float() > x if direction < 0 else rounded.float() < x
    stepped = torch.nextafter(rounded, torch.full_like(rounded, direction))
    return torch.where(wrong_side, stepped, rounded)


def quantize_per_token(
    x: torch.Tensor, bits: int, group_size: int | None = None, meta_dtype: torch.dtype = torch.float16
) -> QuantizedLatents:
    """
    Asymmetric per-token (per channel group) `bits`-bit quantization with packed codes (spec 002 Eq. 8).

    Guarantees `|x − dequantize(quantize(x))| ≤ scales/2` element-wise, with the stored (rounded) scales.

    Args:
        x (`torch.Tensor` of shape `[..., dim]`): latents; each vector along the last axis is a token.
        bits (`int`): code width, 2, 3 or 4 for Palu.
        group_size (`int`, *optional*): channels per scale/zero; `None` or `0` for the whole vector.
        meta_dtype (`torch.dtype`, *optional*, defaults to `torch.float16`): dtype of scales and zeros. They
            saturate at its largest finite value: a token whose latents reach beyond ±65504 (float16) is clipped
            (finite, but the error bound no longer holds); use `torch.float32` for such latents.

    Returns:
        [`QuantizedLatents`] with codes `[..., ceil(dim·bits/8)]` and scales/zeros `[..., dim // group_size]`.

    Example:

    ```python
    >>> q = quantize_per_token(torch.randn(2, 5, 64), bits=3)
    >>> q.codes.shape, q.scales.shape
    (torch.Size([2, 5, 24]), torch.Size([2, 5, 1]))

    ```
    """
    validate_bits(bits)
    dim = x.shape[-1]
    size = resolve_group_size(dim, group_size)
    grouped = x.float().reshape(*x.shape[:-1], dim // size, size)  # [..., num_groups, group_size]
    levels = 2**bits - 1
    zeros = _round_to_dtype(grouped.amin(-1), meta_dtype, float("-inf"))
    scales = (grouped.amax(-1) - zeros.float()) / levels
    # A constant vector equal to its stored offset has range 0: any positive step gives code 0 and no error
    scales = _round_to_dtype(torch.where(scales > 0, scales, torch.ones_like(scales)), meta_dtype, float("inf"))
    codes = torch.round((grouped - zeros.float().unsqueeze(-1)) / scales.float().unsqueeze(-1)).clamp_(0, levels)
    packed = pack_codes(codes.reshape(*x.shape[:-1], dim), bits)
    return QuantizedLatents(packed, scales, zeros, bits, size, dim)


def dequantize_per_token(quantized: QuantizedLatents, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """
    Rebuild latents from [`QuantizedLatents`]: `X̂ = q·s + X_min` per token and channel group.

    Args:
        quantized ([`QuantizedLatents`]): the packed latents.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the result.

    Returns:
        `torch.Tensor` of shape `[..., dim]`.
    """
    codes = unpack_codes(quantized.codes, quantized.bits, quantized.dim).float()
    lead = codes.shape[:-1]
    grouped = codes.reshape(*lead, quantized.dim // quantized.group_size, quantized.group_size)
    values = grouped * quantized.scales.float().unsqueeze(-1) + quantized.zeros.float().unsqueeze(-1)
    return values.reshape(*lead, quantized.dim).to(dtype)
