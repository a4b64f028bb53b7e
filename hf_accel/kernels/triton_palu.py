"""Triton versions of the Palu kernels; same signatures as `reference.py` (spec 002 §3.1, §3.2).

Imported only through the kernel registry (`get_kernel(name, "triton")`), never at package import. On CPU they run
under the Triton interpreter (`TRITON_INTERPRET=1`), which is how the tests check them against the references.

Design differences with the Palu code's `_abx_fwd` (spec §3.1):
- one program per (batch row, latent group, sequence tile) computes the RoPE angles once, then for each key/value
  head of the group rebuilds the key tile **once** and scores it against all `num_heads / num_key_value_heads ·
  q_len` query rows of that head (GQA and tree verification), instead of one program per query head rebuilding
  the same tile again;
- positions are read per token (`key_positions`), not assumed to be `0..L-1`, and RoPE uses the model's
  `inv_freq` and `attention_scaling`, so θ and the scaled rope types are covered;
- any head_dim (even), any rank, any number of heads, batch > 1.
"""

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .quant import QuantizedLatents
from .reference import (
    _check_dequantize_attend_shapes,
    _check_dequantize_matmul_shapes,
    _check_rope_shapes,
    latent_shape,
)


def _launch_guard(device: torch.device, *inputs: torch.Tensor):
    """Make `device` current for a launch: Triton launches on the current CUDA device, not on its inputs' (a layer on
    `cuda:1` under `device_map="auto"` while `cuda:0` is current would fail or run on the wrong GPU). CPU inputs run
    only in Triton's interpreter; compiled, Triton's own error names neither them nor the fix ("0 active drivers").
    Nor does it for float64 `inputs`, whose `tl.dot` does not compile (a `CompilationError` pointing into the kernel)."""
    compiled = isinstance(_dequantize_tile, JITFunction)  # not Triton's interpreter
    if compiled and any(t.dtype == torch.float64 for t in inputs):
        raise ValueError(
            "The 'triton' Palu kernels take float32, float16 or bfloat16 inputs, got float64: use the 'eager' backend "
            "(palu_kernel_backend='eager') for a float64 model"
        )
    if device.type == "cpu" and compiled:
        raise ValueError(
            "The 'triton' Palu kernels need their inputs on a GPU, got CPU tensors: use the 'eager' backend (or "
            "'auto', which picks it for CPU inputs), or set TRITON_INTERPRET=1 before triton is imported to run "
            "Triton's interpreter."
        )
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # float32 inputs: exact IEEE products (TF32 would cost ~1e-3 relative error); half inputs: tensor cores
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dequantize_tile(codes_ptr, scales_ptr, zeros_ptr, token, rr, mask, num_bytes, num_qgroups, group_size, BITS):
    # code c of a token sits at bits [c·BITS, (c+1)·BITS) of its little-endian stream, possibly across two bytes
    byte, shift = (rr * BITS) // 8, (rr * BITS) % 8
    byte_ptrs = codes_ptr + token[:, None] * num_bytes + byte[None, :]
    low = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    high = tl.load(byte_ptrs + 1, mask=mask & (byte + 1 < num_bytes)[None, :], other=0).to(tl.int32)
    codes = ((low | (high << 8)) >> shift[None, :]) & ((1 << BITS) - 1)
    meta = token[:, None] * num_qgroups + (rr // group_size)[None, :]
    scales = tl.load(scales_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    zeros = tl.load(zeros_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scales + zeros  # X̂ = q·s + X_min


@triton.jit
def _rebuild_key_tile(
    latent_ptr, codes_ptr, scales_ptr, zeros_ptr, token, up_base, mask_s, offs_h, mask_h, rank, up_row,
    num_bytes, num_qgroups, group_size,
    HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BITS: tl.constexpr, QUANTIZED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # K_tile = H_tile · B_head, as its two rotate_half halves [BLOCK_S, BLOCK_HALF] each, accumulated in float32
    acc1 = tl.zeros((BLOCK_S, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_S, BLOCK_HALF), dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        mask_r = rr < rank
        mask = mask_s[:, None] & mask_r[None, :]
        if QUANTIZED:  # packed low-bit latents, dequantized in registers
            x = _dequantize_tile(
                codes_ptr, scales_ptr, zeros_ptr, token, rr, mask, num_bytes, num_qgroups, group_size, BITS
            )
        else:
            x = tl.load(latent_ptr + token[:, None] * rank + rr[None, :], mask=mask, other=0.0)
        w_ptrs = up_base + rr[:, None] * up_row + offs_h[None, :]
        w_mask = mask_r[:, None] & mask_h[None, :]
        w1 = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w2 = tl.load(w_ptrs + HALF, mask=w_mask, other=0.0)
        x = x.to(w1.dtype)
        acc1 = _dot(x, w1, acc1, IEEE)
        acc2 = _dot(x, w2, acc2, IEEE)
    return acc1, acc2


@triton.jit
def _store_head_scores(
    q_ptr, out_ptr, k1, k2, b, j, offs_s, mask_s, offs_h, mask_h, num_heads, num_kv_heads, q_len, seq_len, scaling,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # every query row (head, t) of key/value head j reads the rebuilt tile: num_heads / num_kv_heads · q_len rows
    num_rep = num_heads // num_kv_heads
    num_rows = num_rep * q_len
    offs_m = tl.arange(0, BLOCK_Q)
    for m0 in range(0, num_rows, BLOCK_Q):
        m = m0 + offs_m
        mask_m = m < num_rows
        row = (b * num_heads + j * num_rep + m // q_len) * q_len + m % q_len  # flat (b, head, t)
        q_ptrs = q_ptr + row[:, None] * HEAD_DIM + offs_h[None, :]
        q_mask = mask_m[:, None] & mask_h[None, :]
        q1 = tl.load(q_ptrs, mask=q_mask, other=0.0)
        q2 = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0)
        scores = tl.zeros((BLOCK_Q, BLOCK_S), dtype=tl.float32)
        scores = _dot(q1, tl.trans(k1.to(q1.dtype)), scores, IEEE)
        scores = _dot(q2, tl.trans(k2.to(q1.dtype)), scores, IEEE)
        out_ptrs = out_ptr + row[:, None] * seq_len + offs_s[None, :]
        tl.store(out_ptrs, scores * scaling, mask=mask_m[:, None] & mask_s[None, :])


@triton.jit
def _rope_key_scores_kernel(
    q_ptr, latent_ptr, codes_ptr, scales_ptr, zeros_ptr, up_ptr, pos_ptr, inv_freq_ptr, out_ptr,
    num_heads, num_kv_heads, q_len, seq_len, rank, kv_per_group, groups, attention_scaling, scaling,
    num_bytes, num_qgroups, group_size, seq_tiles,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BITS: tl.constexpr, QUANTIZED: tl.constexpr,
    IEEE_K: tl.constexpr, IEEE_Q: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (b · groups + g) · seq_tiles + sequence tile
    pid_bg = pid // seq_tiles
    b, g = pid_bg // groups, pid_bg % groups
    offs_s = (pid % seq_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < seq_len
    offs_h = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < HALF
    # RoPE angles at each token's absolute position, computed once for all key/value heads of the group
    pos = tl.load(pos_ptr + b * seq_len + offs_s, mask=mask_s, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_h, mask=mask_h, other=0.0)
    freqs = pos[:, None] * inv_freq[None, :]
    cos, sin = tl.cos(freqs) * attention_scaling, tl.sin(freqs) * attention_scaling
    token = pid_bg * seq_len + offs_s  # flat (b, g, s) latent row
    up_row = kv_per_group * HEAD_DIM
    for i in range(kv_per_group):  # head i of the group; its re-reads of the latent tile should hit L1/L2
        up_base = up_ptr + g * rank * up_row + i * HEAD_DIM
        acc1, acc2 = _rebuild_key_tile(
            latent_ptr, codes_ptr, scales_ptr, zeros_ptr, token, up_base, mask_s, offs_h, mask_h, rank, up_row,
            num_bytes, num_qgroups, group_size, HALF, BLOCK_S, BLOCK_R, BLOCK_HALF, BITS, QUANTIZED, IEEE_K,
        )  # fmt: skip
        # reconstruct-then-RoPE (spec §2.3 decode step 2), transformers' rotate_half layout
        k1 = acc1 * cos - acc2 * sin
        k2 = acc2 * cos + acc1 * sin
        _store_head_scores(
            q_ptr, out_ptr, k1, k2, b, g * kv_per_group + i, offs_s, mask_s, offs_h, mask_h,
            num_heads, num_kv_heads, q_len, seq_len, scaling, HEAD_DIM, HALF, BLOCK_S, BLOCK_Q, IEEE_Q,
        )  # fmt: skip


def rope_key_scores(
    query_states: torch.Tensor,
    latent_keys: "torch.Tensor | QuantizedLatents",
    up_proj: torch.Tensor,
    key_positions: torch.LongTensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Triton version of [`~hf_accel.kernels.reference.rope_key_scores`]; same arguments and result."""
    num_kv_heads, _ = _check_rope_shapes(query_states, latent_keys, up_proj, key_positions, inv_freq)
    batch, num_heads, q_len, head_dim = query_states.shape
    groups, rank, width = up_proj.shape
    seq_len = latent_shape(latent_keys)[2]
    out = torch.empty(batch, num_heads, q_len, seq_len, dtype=torch.float32, device=query_states.device)
    if out.numel() == 0:
        return out
    quantized = isinstance(latent_keys, QuantizedLatents)
    if quantized:
        codes, scales, zeros = (t.contiguous() for t in (latent_keys.codes, latent_keys.scales, latent_keys.zeros))
        latent = codes  # unused by the kernel on this path
        packing = (codes.shape[-1], scales.shape[-1], latent_keys.group_size, latent_keys.bits)
    else:  # the packed-code pointers are unused on this path
        latent = codes = scales = zeros = latent_keys.contiguous()
        packing = (1, 1, 1, 8)
    half, block_s = head_dim // 2, 64
    seq_tiles = triton.cdiv(seq_len, block_s)
    grid = (batch * groups * seq_tiles,)  # on axis 0 (CUDA allows 65,535 programs on axes 1 and 2: 4M tokens)
    with _launch_guard(out.device, query_states, latent, up_proj):
        _rope_key_scores_kernel[grid](
            query_states.contiguous(), latent, codes, scales, zeros, up_proj.contiguous(), key_positions.contiguous(),
            inv_freq.float().contiguous(), out,
            num_heads, num_kv_heads, q_len, seq_len, rank, width // head_dim, groups,
            float(attention_scaling), float(scaling), *packing[:3], seq_tiles,
            HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_S=block_s,
            BLOCK_R=32, BLOCK_Q=16, BITS=packing[3], QUANTIZED=quantized,
            IEEE_K=up_proj.dtype == torch.float32, IEEE_Q=query_states.dtype == torch.float32,
        )  # fmt: skip
    return out


@triton.jit
def _dequantize_matmul_kernel(
    codes_ptr, scales_ptr, zeros_ptr, w_ptr, out_ptr,
    groups, seq_len, rank, n_out, num_bytes, num_qgroups, group_size, w_batch_stride, seq_tiles,
    BITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (b · groups + g) · seq_tiles + sequence tile
    pid_bg = pid // seq_tiles
    b, g = pid_bg // groups, pid_bg % groups
    offs_s = (pid % seq_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_s, mask_n = offs_s < seq_len, offs_n < n_out
    token = pid_bg * seq_len + offs_s  # flat (b, g, s) token row
    w_base = w_ptr + b * w_batch_stride + g * rank * n_out
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        mask = mask_s[:, None] & (rr < rank)[None, :]
        x = _dequantize_tile(
            codes_ptr, scales_ptr, zeros_ptr, token, rr, mask, num_bytes, num_qgroups, group_size, BITS
        )  # X̂ tile [BLOCK_S, BLOCK_R], float32, never written to memory
        w = tl.load(
            w_base + rr[:, None] * n_out + offs_n[None, :], mask=(rr < rank)[:, None] & mask_n[None, :], other=0.0
        )
        acc = _dot(x.to(w.dtype), w, acc, IEEE)
    out_ptrs = out_ptr + token[:, None] * n_out + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=mask_s[:, None] & mask_n[None, :])


def dequantize_matmul(quantized: QuantizedLatents, weight: torch.Tensor) -> torch.Tensor:
    """Triton version of [`~hf_accel.kernels.reference.dequantize_matmul`]; same arguments and result."""
    _check_dequantize_matmul_shapes(quantized, weight)
    batch, groups, seq_len, num_bytes = quantized.codes.shape
    rank, n_out = weight.shape[-2:]
    out = torch.empty(batch, groups, seq_len, n_out, dtype=torch.float32, device=quantized.codes.device)
    if out.numel() == 0:
        return out
    w_batch_stride = groups * rank * n_out if weight.dim() == 4 and weight.shape[0] > 1 else 0
    block_s, block_n = 32, 32
    seq_tiles = triton.cdiv(seq_len, block_s)
    grid = (batch * groups * seq_tiles, triton.cdiv(n_out, block_n))  # sequence tiles on axis 0, as above
    with _launch_guard(out.device, weight):
        _dequantize_matmul_kernel[grid](
            quantized.codes.contiguous(), quantized.scales.contiguous(), quantized.zeros.contiguous(),
            weight.contiguous(), out,
            groups, seq_len, rank, n_out, num_bytes, quantized.scales.shape[-1], quantized.group_size, w_batch_stride,
            seq_tiles,
            BITS=quantized.bits, BLOCK_S=block_s, BLOCK_R=32, BLOCK_N=block_n, IEEE=weight.dtype == torch.float32,
        )  # fmt: skip
    return out


@triton.jit
def _dequantize_attend_kernel(
    probs_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr,
    groups, num_heads, q_len, used_len, seq_len, rank, num_bytes, num_qgroups, group_size, split_len, split_stride,
    row_tiles,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (b · groups + g) · row_tiles + tile of the group's query rows
    pid_bg = pid // row_tiles
    b, g = pid_bg // groups, pid_bg % groups
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    split = tl.program_id(2)
    start = split * split_len  # this program's slice of the keys (split-K over the sequence)
    end = tl.minimum(start + split_len, used_len)
    heads_per_group = num_heads // groups
    m = (pid % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows (head of the group, t) of this program
    mask_m = m < heads_per_group * q_len
    row = (b * num_heads + g * heads_per_group + m // q_len) * q_len + m % q_len  # flat (b, head, t)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < end
        token = pid_bg * seq_len + offs_s
        values = _dequantize_tile(
            codes_ptr, scales_ptr, zeros_ptr, token, offs_r, mask_s[:, None] & mask_r[None, :],
            num_bytes, num_qgroups, group_size, BITS,
        )  # fmt: skip
        p = tl.load(
            probs_ptr + row[:, None] * used_len + offs_s[None, :],
            mask=mask_m[:, None] & mask_s[None, :],
            other=0.0,
        )
        acc = _dot(p, values.to(p.dtype), acc, IEEE)
    out_ptrs = out_ptr + split.to(tl.int64) * split_stride + row[:, None] * rank + offs_r[None, :]  # [B, H, q_len, r]
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


def attend_launch_plan(
    batch: int, groups: int, rows_per_group: int, rank: int, used_len: int, block_m: int, block_r: int, block_s: int
) -> tuple[int, int, int, int]:
    """`(row_tiles, rank_tiles, num_splits, split_len)` of `dequantize_attend`'s grid `(batch · groups · row_tiles,
    rank_tiles, num_splits)`.

    Every program computes one `[block_m, block_r]` tile of a group's query rows (`num_heads / groups · q_len`) over
    one slice of `split_len` keys. The keys are split (split-K) only until about 512 programs fill the GPU, so a
    decoding step (one tile of rows per group) reads a long cache in parallel, while a prefill, whose row tiles
    already fill it, is not split: its partial sums, one `[batch, num_heads, q_len, rank]` float32 buffer per split,
    stay about the size of the output (splitting by keys alone gave a 4,096-token prefill of a Llama-3-8B-shaped layer
    22 of them, 4.4 GB).
    """
    row_tiles, rank_tiles = triton.cdiv(rows_per_group, block_m), triton.cdiv(rank, block_r)
    seq_tiles = max(1, triton.cdiv(used_len, block_s))
    num_splits = max(1, min(seq_tiles, triton.cdiv(512, batch * groups * row_tiles * rank_tiles)))
    split_len = triton.cdiv(seq_tiles, num_splits) * block_s
    return row_tiles, rank_tiles, max(1, triton.cdiv(used_len, split_len)), split_len


def dequantize_attend(probs: torch.Tensor, quantized: QuantizedLatents) -> torch.Tensor:
    """Triton version of [`~hf_accel.kernels.reference.dequantize_attend`]; same arguments and result."""
    _check_dequantize_attend_shapes(probs, quantized)
    batch, num_heads, q_len, used_len = probs.shape
    groups, seq_len, num_bytes = quantized.codes.shape[1:]
    rank = quantized.dim
    block_m, block_s, block_r = 16, 32, 32
    row_tiles, r_tiles, num_splits, split_len = attend_launch_plan(
        batch, groups, num_heads // groups * q_len, rank, used_len, block_m, block_r, block_s
    )
    # partial sums of the key splits, added in a fixed order (deterministic)
    partial = torch.zeros(num_splits, batch, num_heads, q_len, rank, dtype=torch.float32, device=probs.device)
    if partial.numel() == 0 or used_len == 0:
        return partial.sum(0)
    grid = (batch * groups * row_tiles, r_tiles, num_splits)
    with _launch_guard(partial.device, probs):
        _dequantize_attend_kernel[grid](
            probs.contiguous(), quantized.codes.contiguous(), quantized.scales.contiguous(),
            quantized.zeros.contiguous(), partial,
            groups, num_heads, q_len, used_len, seq_len, rank, num_bytes, quantized.scales.shape[-1],
            quantized.group_size, split_len, batch * num_heads * q_len * rank, row_tiles,
            BITS=quantized.bits, BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_R=block_r, IEEE=probs.dtype == torch.float32,
        )  # fmt: skip
    return partial[0] if num_splits == 1 else partial.sum(0)
