"""Decode-attention latency of the Palu RoPE-key path against plain SDPA (spec 002 §3.1, §6.9; issue 4).

One decode step (`q_len = 1`) of one attention layer, timed with CUDA events (median of `iters` runs after `warmup`,
the L2 cache overwritten before each run, as the other layers of a decode step would):

- `sdpa_full`: `scaled_dot_product_attention` on an fp16 full key/value cache (the original model);
- `sdpa_reconstructed`: keys `RoPE(H^k B^k)` and values `H^v B^v` rebuilt from the latent cache with PyTorch ops,
  then the same SDPA (Palu without its kernel);
- `palu_fused`: the Triton `rope_key_scores` kernel, softmax, then `p · H^v` per group; the value reconstruction is
  folded into `o_proj` offline (spec §2.3), so no value tensor is rebuilt;
- `palu_fused_v4`: the same with 4-bit packed value latents read by the Triton `dequantize_attend` kernel (the
  paper's "Palu-4bit" RoPE setting quantizes only V);
- `scores_full` / `scores_fused`: the score step alone, `q·Kᵀ` on the full cache against the fused kernel (spec Fig. 6).
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .quant import quantize_per_token


@dataclass
class PaluAttentionBenchConfig:
    """Shapes of the benchmarked layer; defaults follow the Llama-3-8B GQA layout and the spec's latency split."""

    num_heads: int = field(default=32, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=8, metadata={"help": "key/value heads"})
    head_dim: int = field(default=128, metadata={"help": "head dimension"})
    group_size: int = field(default=4, metadata={"help": "key/value heads per latent group (G-LRD gs)"})
    key_keep: float = field(default=0.25, metadata={"help": "kept fraction of key dims (spec: K 75% compressed)"})
    value_keep: float = field(default=0.75, metadata={"help": "kept fraction of value dims (V 25% compressed)"})
    batch_size: int = field(default=1, metadata={"help": "decode batch"})
    seq_lens: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536)
    warmup: int = 10
    iters: int = 50

    def __post_init__(self):
        n_kv, n_heads = self.num_key_value_heads, self.num_heads
        if min(self.group_size, n_kv, n_heads) < 1 or n_kv % self.group_size or n_heads % n_kv:
            raise ValueError(
                f"group_size={self.group_size} must be positive and divide num_key_value_heads={n_kv}, which must be "
                f"positive and divide num_heads={n_heads}, positive too."
            )

    @property
    def groups(self) -> int:
        return self.num_key_value_heads // self.group_size

    def rank(self, keep: float) -> int:
        # per-group rank, rounded to a multiple of 32 as the Palu code does (spec §2.4 step 7)
        full = self.group_size * self.head_dim
        return max(32, min(full, 32 * round(keep * full / 32)))


# Larger than the L2 cache of any current GPU (50 MiB on H100 and H200)
L2_FLUSH_BYTES = 256 * 1024**2


def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")


def _time_ms(fn, warmup: int, iters: int) -> float:
    # The L2 cache is overwritten before every timed run, outside its events: in a real decode step the other layers
    # evict this layer's cache, so back-to-back runs reading it from a warm L2 would favour the smaller latent cache
    flush = _l2_flush_buffer()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _make_inputs(config: PaluAttentionBenchConfig, seq_len: int, device) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    half = {"dtype": torch.float16, "device": device}
    batch, kv, d, groups = config.batch_size, config.num_key_value_heads, config.head_dim, config.groups
    r_k, r_v = config.rank(config.key_keep), config.rank(config.value_keep)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, **half) * scale

    return {
        "query": randn(batch, config.num_heads, 1, d),
        "keys": randn(batch, kv, seq_len, d),
        "values": randn(batch, kv, seq_len, d),
        "latent_keys": randn(batch, groups, seq_len, r_k),
        "latent_values": randn(batch, groups, seq_len, r_v),
        "up_k": randn(groups, r_k, config.group_size * d, scale=r_k**-0.5),
        "up_v": randn(groups, r_v, config.group_size * d, scale=r_v**-0.5),
        "positions": torch.arange(seq_len, device=device).expand(batch, seq_len),
        "inv_freq": 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d),
    }


def _reconstruct(latent, up_proj, head_dim):
    # [B, G, S, r] @ [G, r, s·d] → [B, G·s, S, d]
    batch, groups, seq_len, _ = latent.shape
    full = (latent @ up_proj).view(batch, groups, seq_len, -1, head_dim).transpose(2, 3)
    return full.reshape(batch, -1, seq_len, head_dim)


def _rope(keys, positions, inv_freq):
    # angles in float32: position · inv_freq reaches 65535 at 64K tokens, the edge of the float16 range
    freqs = positions.float()[:, None, :, None] * inv_freq
    cos, sin = freqs.cos().to(keys.dtype), freqs.sin().to(keys.dtype)
    first, second = keys.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _palu_fused(inputs, config: PaluAttentionBenchConfig, scores_kernel, attend_kernel=None):
    # scores → softmax → p · H^v per latent group; all query heads of a group read the same latent values
    scores = scores_kernel(
        inputs["query"], inputs["latent_keys"], inputs["up_k"], inputs["positions"], inputs["inv_freq"],
        scaling=config.head_dim**-0.5,
    )  # fmt: skip
    probs = scores.softmax(-1).to(inputs["latent_values"].dtype)  # [B, H, 1, S]
    if attend_kernel is not None:
        return attend_kernel(probs, inputs["quantized_values"])  # [B, H, 1, r_v]
    batch, groups = probs.shape[0], config.groups
    probs = probs.view(batch, groups, -1, probs.shape[-1])  # [B, G, heads_per_group, S]
    return probs @ inputs["latent_values"]  # [B, G, heads_per_group, r_v]


def _measure_length(config: PaluAttentionBenchConfig, seq_len: int, scores_kernel, device, attend_kernel=None) -> dict:
    x = _make_inputs(config, seq_len, device)
    x["quantized_values"] = quantize_per_token(x["latent_values"], bits=4)
    d, num_rep = config.head_dim, config.num_heads // config.num_key_value_heads

    def sdpa_full():
        return F.scaled_dot_product_attention(x["query"], x["keys"], x["values"], enable_gqa=True)

    def sdpa_reconstructed():
        keys = _rope(_reconstruct(x["latent_keys"], x["up_k"], d), x["positions"], x["inv_freq"])
        values = _reconstruct(x["latent_values"], x["up_v"], d)
        return F.scaled_dot_product_attention(x["query"], keys, values, enable_gqa=True)

    def scores_full():
        query = x["query"].view(config.batch_size, config.num_key_value_heads, num_rep, d)
        return query @ x["keys"].transpose(-1, -2)

    def scores_fused():
        return scores_kernel(x["query"], x["latent_keys"], x["up_k"], x["positions"], x["inv_freq"])

    runs = {
        "sdpa_full_ms": sdpa_full,
        "sdpa_reconstructed_ms": sdpa_reconstructed,
        "palu_fused_ms": lambda: _palu_fused(x, config, scores_kernel),
        "palu_fused_v4_ms": lambda: _palu_fused(x, config, scores_kernel, attend_kernel),
        "scores_full_ms": scores_full,
        "scores_fused_ms": scores_fused,
    }
    timings = {name: _time_ms(fn, config.warmup, config.iters) for name, fn in runs.items()}
    timings["speedup_vs_full"] = timings["sdpa_full_ms"] / timings["palu_fused_ms"]
    timings["speedup_v4_vs_full"] = timings["sdpa_full_ms"] / timings["palu_fused_v4_ms"]
    timings["speedup_vs_reconstructed"] = timings["sdpa_reconstructed_ms"] / timings["palu_fused_ms"]
    timings["scores_speedup"] = timings["scores_full_ms"] / timings["scores_fused_ms"]
    return {"seq_len": seq_len, **timings}


def _check_fused_matches_reference(config: PaluAttentionBenchConfig, scores_kernel, device) -> float:
    # largest relative error of the fused scores against the eager reference, on a short cache
    from .reference import rope_key_scores

    x = _make_inputs(config, 512, device)
    args = (x["query"], x["latent_keys"], x["up_k"], x["positions"], x["inv_freq"])
    expected = rope_key_scores(*args)
    return float((scores_kernel(*args) - expected).abs().max() / expected.abs().max())


def run_palu_attention_benchmark(config: PaluAttentionBenchConfig) -> dict:
    """
    Time one decode step of Palu attention against plain SDPA at each length of `config.seq_lens`.

    Args:
        config ([`PaluAttentionBenchConfig`]): layer shapes, lengths and timing repeats.

    Returns:
        `dict` with `gpu` (the device name), `config`, `max_rel_error` of the fused scores against the reference,
        and one entry per length in `results`. With no CUDA GPU: `{"gpu": None, "error": ..., "results": []}`.
    """
    if not torch.cuda.is_available():
        return {"gpu": None, "error": "no CUDA GPU available", "config": asdict(config), "results": []}
    from .registry import get_kernel

    scores_kernel = get_kernel("rope_key_scores", "triton")
    attend_kernel = get_kernel("dequantize_attend", "triton")
    device = torch.device("cuda")
    report = {"gpu": torch.cuda.get_device_name(device), "config": asdict(config)}
    report["ranks"] = {"key": config.rank(config.key_keep), "value": config.rank(config.value_keep)}
    report["max_rel_error"] = _check_fused_matches_reference(config, scores_kernel, device)
    report["results"] = [_measure_length(config, n, scores_kernel, device, attend_kernel) for n in config.seq_lens]
    return report


def format_report(report: dict) -> str:
    """A human table of [`run_palu_attention_benchmark`]'s result."""
    if report["gpu"] is None:
        return f"No GPU: {report['error']}. The Palu kernel benchmark needs a CUDA GPU; nothing was measured."
    header = (
        f"{'seq_len':>8} {'sdpa_full':>10} {'sdpa_rebuilt':>12} {'palu_fused':>11} {'x_full':>7} {'x_rebuilt':>9} "
        f"{'palu_v4':>9} {'x_v4':>6} "
        f"{'scores_full':>11} {'scores_fused':>12} {'x_scores':>8}"
    )
    error = f"{report['max_rel_error']:.2e}"
    lines = [f"GPU: {report['gpu']}  ranks: {report['ranks']}  fused-vs-reference max rel. error: {error}", header]
    for row in report["results"]:
        lines.append(
            f"{row['seq_len']:>8} {row['sdpa_full_ms']:>10.4f} {row['sdpa_reconstructed_ms']:>12.4f} "
            f"{row['palu_fused_ms']:>11.4f} {row['speedup_vs_full']:>7.2f} {row['speedup_vs_reconstructed']:>9.2f} "
            f"{row['palu_fused_v4_ms']:>9.4f} {row['speedup_v4_vs_full']:>6.2f} "
            f"{row['scores_full_ms']:>11.4f} {row['scores_fused_ms']:>12.4f} {row['scores_speedup']:>8.2f}"
        )
    lines.append("times in ms (median); x_* = speedup of the Palu path")
    return "\n".join(lines)
