"""Plain-PyTorch references of the Palu kernels: the CPU path and the test oracle of the Triton versions.

Both functions compute in float32 and return float32, whatever the input dtypes; the Triton versions in
`triton_palu.py` have the same signatures.
"""

import torch

from .quant import QuantizedLatents, dequantize_per_token


def latent_shape(latents: "torch.Tensor | QuantizedLatents") -> tuple[int, ...]:
    """Shape `[..., r]` of plain or packed latents (for packed ones, the shape once dequantized)."""
    if isinstance(latents, QuantizedLatents):
        return (*latents.codes.shape[:-1], latents.dim)
    return tuple(latents.shape)


def _check_rope_shapes(query_states, latent_keys, up_proj, key_positions, inv_freq) -> tuple[int, int]:
    batch, num_heads, _, head_dim = query_states.shape
    groups, rank, width = up_proj.shape
    shape = latent_shape(latent_keys)
    if len(shape) != 4 or shape[0] != batch or shape[1] != groups:
        raise ValueError(f"`latent_keys` must be [batch={batch}, groups={groups}, seq_len, r], got {shape}.")
    if shape[-1] != rank or width % head_dim != 0 or head_dim % 2 != 0:
        raise ValueError(
            f"`up_proj` must be [groups, r={shape[-1]}, kv_heads_per_group * head_dim={head_dim}] with an "
            f"even head_dim, got {tuple(up_proj.shape)}."
        )
    num_key_value_heads = groups * (width // head_dim)
    if num_heads % num_key_value_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_key_value_heads} key/value heads.")
    if tuple(key_positions.shape) != (batch, shape[2]) or inv_freq.numel() != head_dim // 2:
        raise ValueError(
            f"`key_positions` must be [batch, seq_len] = [{batch}, {shape[2]}] and `inv_freq` "
            f"[head_dim // 2 = {head_dim // 2}], got {tuple(key_positions.shape)} and {tuple(inv_freq.shape)}."
        )
    return num_key_value_heads, num_heads // num_key_value_heads


def rope_key_scores(
    query_states: torch.Tensor,
    latent_keys: "torch.Tensor | QuantizedLatents",
    up_proj: torch.Tensor,
    key_positions: torch.LongTensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    scaling: float = 1.0,
) -> torch.Tensor:
    """
    Attention scores against keys rebuilt from Palu latents, then RoPE'd at their positions (spec 002 §2.3, §3.1).

    `score[b, h, t, ℓ] = scaling · q[b, h, t] · RoPE_ℓ(latent[b, g, ℓ] · B[g, :, i·d:(i+1)·d])`, where key/value head
    `j = h // (num_heads / num_key_value_heads)` (GQA) is head `i = j % s` of group `g = j // s`, and `s` is the number
    of key/value heads per group. RoPE uses transformers' `rotate_half` layout with `cos/sin(position · inv_freq) ·
    attention_scaling`, so any rope type that only changes `inv_freq` and `attention_scaling` (default, linear,
    llama3, yarn) is covered. The query is **not** rotated here: pass it already RoPE'd at its own positions.

    Args:
        query_states (`torch.Tensor` of shape `[batch, num_heads, q_len, head_dim]`): RoPE'd queries.
        latent_keys (`torch.Tensor` or [`QuantizedLatents`] of shape `[batch, groups, seq_len, r]`): cached pre-RoPE
            key latents, plain or packed low-bit (then dequantized on the fly, spec §3.2).
        up_proj (`torch.Tensor` of shape `[groups, r, kv_heads_per_group * head_dim]`): key reconstruction `B^k`.
        key_positions (`torch.LongTensor` of shape `[batch, seq_len]`): absolute position of every cached token.
        inv_freq (`torch.Tensor` of shape `[head_dim // 2]`): rotary inverse frequencies.
        attention_scaling (`float`, *optional*, defaults to 1.0): factor on cos and sin (YaRN-style rope types).
        scaling (`float`, *optional*, defaults to 1.0): factor on the scores, e.g. `head_dim ** -0.5`.

    Returns:
        `torch.Tensor` of shape `[batch, num_heads, q_len, seq_len]`, float32, unmasked and before softmax.
    """
    num_key_value_heads, num_rep = _check_rope_shapes(query_states, latent_keys, up_proj, key_positions, inv_freq)
    if isinstance(latent_keys, QuantizedLatents):
        latent_keys = dequantize_per_token(latent_keys, torch.float32)
    batch, groups, seq_len, _ = latent_keys.shape
    head_dim = query_states.shape[-1]
    keys = latent_keys.float() @ up_proj.float()  # [B, G, S, s·d]
    keys = keys.view(batch, groups, seq_len, num_key_value_heads // groups, head_dim)  # [B, G, S, s, d]
    keys = keys.transpose(2, 3)  # [B, G, s, S, d]
    keys = keys.reshape(batch, num_key_value_heads, seq_len, head_dim)
    freqs = key_positions.float()[:, None, :, None] * inv_freq.float()  # [B, 1, S, d/2]
    cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
    first, second = keys[..., : head_dim // 2], keys[..., head_dim // 2 :]
    keys = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    # GQA without repeating the keys per query head: query head h = j·num_rep + i reads key head j
    q_len = query_states.shape[2]
    grouped = query_states.float().reshape(batch, num_key_value_heads, num_rep * q_len, head_dim)
    scores = grouped @ keys.transpose(-1, -2)  # [B, KV, num_rep·q, S]
    return scores.view(batch, num_key_value_heads * num_rep, q_len, seq_len) * scaling


def dequantize_matmul(quantized: QuantizedLatents, weight: torch.Tensor) -> torch.Tensor:
    """
    Multiply packed low-bit latents by a per-group weight: `dequantize(quantized) @ weight` (spec 002 §3.2).

    With `weight = B` (the up-projection of each group) it rebuilds keys or values from the quantized cache; with a
    per-batch weight, e.g. fused non-RoPE queries `q̃ᵀ` (Eq. 6), it gives scores directly.

    Args:
        quantized ([`QuantizedLatents`]): latents of shape `[batch, groups, seq_len, r]` (codes, scales, zeros).
        weight (`torch.Tensor` of shape `[groups, r, N]` or `[batch, groups, r, N]`): right-hand factor.

    Returns:
        `torch.Tensor` of shape `[batch, groups, seq_len, N]`, float32.
    """
    _check_dequantize_matmul_shapes(quantized, weight)
    return dequantize_per_token(quantized, torch.float32) @ weight.float()


def _check_dequantize_matmul_shapes(quantized: QuantizedLatents, weight: torch.Tensor) -> None:
    if quantized.codes.dim() != 4:
        raise ValueError(
            f"Quantized latents must be [batch, groups, seq_len, ...], got {tuple(quantized.codes.shape)}."
        )
    batch, groups = quantized.codes.shape[:2]
    expected_lead = [(groups,), (batch, groups), (1, groups)]
    if (
        weight.dim() not in (3, 4)
        or tuple(weight.shape[:-2]) not in expected_lead
        or weight.shape[-2] != quantized.dim
    ):
        raise ValueError(
            f"`weight` must be [groups={groups}, r={quantized.dim}, N] or [batch={batch}, groups, r, N], "
            f"got {tuple(weight.shape)}."
        )


def dequantize_attend(probs: torch.Tensor, quantized: QuantizedLatents) -> torch.Tensor:
    """
    Attention-weighted sum of packed low-bit value latents: `probs · dequantize(H^v)` per group (spec 002 §3.2).

    This is Palu's value path: the value reconstruction `B^v` is folded into `o_proj` offline, so attention only
    needs `p · Ĥ^v`, and each latent row is read once for all the query heads of its group. Query head `h` reads
    group `h // (num_heads / groups)`. Only the first `probs.shape[-1]` cached tokens are read, so a caller with a
    full-precision window adds `probs[..., S':] @ window` itself.

    Args:
        probs (`torch.Tensor` of shape `[batch, num_heads, q_len, S']`): attention probabilities, `S' ≤ seq_len`.
        quantized ([`QuantizedLatents`]): value latents of shape `[batch, groups, seq_len, r]`.

    Returns:
        `torch.Tensor` of shape `[batch, num_heads, q_len, r]`, float32.
    """
    _check_dequantize_attend_shapes(probs, quantized)
    batch, num_heads, q_len, used = probs.shape
    groups = quantized.codes.shape[1]
    values = dequantize_per_token(quantized, torch.float32)[:, :, :used]  # [B, G, S', r]
    grouped = probs.float().reshape(batch, groups, num_heads // groups * q_len, used)  # [B, G, heads/G · q_len, S']
    return (grouped @ values).view(batch, num_heads, q_len, quantized.dim)


def _check_dequantize_attend_shapes(probs: torch.Tensor, quantized: QuantizedLatents) -> None:
    if quantized.codes.dim() != 4 or probs.dim() != 4:
        raise ValueError(
            f"Expected probs [batch, num_heads, q_len, S'] and latents [batch, groups, seq_len, ...], got "
            f"{tuple(probs.shape)} and {tuple(quantized.codes.shape)}."
        )
    batch, groups, seq_len = quantized.codes.shape[:3]
    if probs.shape[0] != batch or probs.shape[1] % groups != 0 or probs.shape[-1] > seq_len:
        raise ValueError(
            f"`probs` {tuple(probs.shape)} must have batch {batch}, a multiple of {groups} heads and at most "
            f"{seq_len} keys."
        )
