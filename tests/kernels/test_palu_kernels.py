import os
import subprocess
import sys
import textwrap

import pytest
import torch


# Without a GPU the Triton kernels run on CPU through the interpreter; it must be set before triton is imported
# (hf_accel imports triton only when a triton backend is requested).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INTERPRETER_TOO_LATE = DEVICE == "cpu" and "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from hf_accel import kernels
from hf_accel.kernels import get_kernel, is_triton_available, list_kernels
from hf_accel.kernels.hadamard import apply_hadamard, fold_hadamard_into_factors
from hf_accel.kernels.quant import QuantizedLatents, dequantize_per_token, quantize_per_token
from tests.conftest import LargestStorage


require_triton = pytest.mark.skipif(
    not is_triton_available() or _INTERPRETER_TOO_LATE,
    reason="needs the optional `triton` package, and on CPU TRITON_INTERPRET=1 set before triton is first imported "
    "(run `TRITON_INTERPRET=1 pytest ...`)",
)

# Triton's CPU interpreter multiplies the raw bit patterns of bfloat16 operands in `tl.dot` (triton-lang/triton#11584,
# "not supported yet"): bfloat16 kernels are checked on a GPU only
GPU_ONLY_BF16 = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter does not support bfloat16 tl.dot")


def _inv_freq(head_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _rope_inputs(batch=2, heads=4, kv_heads=2, groups=1, q_len=1, seq_len=10, rank=12, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q_len, head_dim, generator=gen)
    latent = torch.randn(batch, groups, seq_len, rank, generator=gen)
    up_proj = torch.randn(groups, rank, (kv_heads // groups) * head_dim, generator=gen) / rank**0.5
    positions = torch.randint(0, 4000, (batch, seq_len), generator=gen)
    return query, latent, up_proj, positions, _inv_freq(head_dim)


def _hf_scores(query, latent, up_proj, positions, inv_freq, kv_heads, attention_scaling=1.0):
    # independent oracle: rebuild keys, rotate with transformers' own RoPE helpers, repeat_kv for GQA
    batch, groups, seq_len, _ = latent.shape
    head_dim = query.shape[-1]
    keys = (latent @ up_proj).view(batch, groups, seq_len, kv_heads // groups, head_dim)
    keys = keys.permute(0, 1, 3, 2, 4).reshape(batch, kv_heads, seq_len, head_dim)
    emb = torch.cat([positions[..., None].float() * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
    _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    keys = repeat_kv(keys, query.shape[1] // kv_heads)
    return query @ keys.transpose(-1, -2)


@pytest.mark.parametrize("groups,kv_heads,heads", [(1, 2, 4), (2, 2, 6), (1, 1, 3), (2, 4, 4)])
def test_rope_reference_matches_transformers_rope(groups, kv_heads, heads):
    inputs = _rope_inputs(heads=heads, kv_heads=kv_heads, groups=groups, q_len=3)
    expected = _hf_scores(*inputs, kv_heads=kv_heads, attention_scaling=0.9)
    scores = get_kernel("rope_key_scores")(*inputs, attention_scaling=0.9, scaling=0.5)
    torch.testing.assert_close(scores, 0.5 * expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    ],
)  # fmt: skip
def test_rope_reference_matches_the_model_rotary_embedding(rope_parameters):
    # a model's own cos/sin (θ, YaRN attention scaling, llama3 frequencies) from its inv_freq and attention_scaling
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rope_parameters=rope_parameters,
    )  # fmt: skip
    rotary = LlamaRotaryEmbedding(config)
    query, latent, up_proj, positions, _ = _rope_inputs(seq_len=7)
    positions = positions % 256
    cos, sin = rotary(latent, positions)
    keys = (latent @ up_proj).view(2, 1, 7, 2, 8).permute(0, 1, 3, 2, 4).reshape(2, 2, 7, 8)
    _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    expected = query @ repeat_kv(keys, 2).transpose(-1, -2)
    actual = get_kernel("rope_key_scores")(
        query, latent, up_proj, positions, rotary.inv_freq, attention_scaling=rotary.attention_scaling
    )
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_len", [1, 3])
def test_rope_reference_does_not_repeat_keys_per_query_head(q_len):
    # every decoding step scores the whole cache: GQA query heads share their key head's rebuilt keys, so nothing
    # the kernel makes is larger than those keys or the scores (a copy of the keys per query head would be 4 times
    # the keys here)
    query, latent, up_proj, positions, inv_freq = _rope_inputs(heads=8, kv_heads=2, q_len=q_len, seq_len=64)
    expected = _hf_scores(query, latent, up_proj, positions, inv_freq, kv_heads=2)
    with LargestStorage() as mode:
        scores = get_kernel("rope_key_scores")(query, latent, up_proj, positions, inv_freq)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4)
    batch, kv_heads, seq_len, head_dim = 2, 2, 64, query.shape[-1]
    keys_bytes = batch * kv_heads * seq_len * head_dim * 4  # float32
    assert mode.largest <= max(keys_bytes, scores.numel() * 4)


def test_rope_reference_accepts_packed_latents():
    query, latent, up_proj, positions, inv_freq = _rope_inputs(groups=2, kv_heads=2, rank=16)
    packed = quantize_per_token(latent, 3)
    expected = get_kernel("rope_key_scores")(query, dequantize_per_token(packed), up_proj, positions, inv_freq)
    torch.testing.assert_close(get_kernel("rope_key_scores")(query, packed, up_proj, positions, inv_freq), expected)


def test_rope_reference_is_invariant_to_folded_hadamard():
    query, _, up_proj, positions, inv_freq = _rope_inputs(rank=24)
    down = torch.randn(16, 24)
    x = torch.randn(2, 1, 10, 16)
    down_rot, up_rot = fold_hadamard_into_factors(down, up_proj[0])
    plain = get_kernel("rope_key_scores")(query, x @ down, up_proj, positions, inv_freq)
    rotated = get_kernel("rope_key_scores")(query, x @ down_rot, up_rot[None], positions, inv_freq)
    torch.testing.assert_close(rotated, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x @ down_rot, apply_hadamard(x @ down), atol=1e-5, rtol=1e-5)


def test_rope_reference_rejects_bad_shapes():
    query, latent, up_proj, positions, inv_freq = _rope_inputs()
    with pytest.raises(ValueError, match="latent_keys"):
        get_kernel("rope_key_scores")(query, latent[0], up_proj, positions, inv_freq)
    with pytest.raises(ValueError, match="multiple"):
        get_kernel("rope_key_scores")(query[:, :3], latent, up_proj, positions, inv_freq)
    with pytest.raises(ValueError, match="key_positions"):
        get_kernel("rope_key_scores")(query, latent, up_proj, positions[:, :3], inv_freq)
    with pytest.raises(
        ValueError, match=r"^`up_proj` must be \[groups, r=12, kv_heads_per_group \* head_dim=8\] with an even"
    ):
        get_kernel("rope_key_scores")(query, latent, up_proj[:, :11], positions, inv_freq)  # rank 11, latents 12
    with pytest.raises(ValueError, match="with an even head_dim"):
        get_kernel("rope_key_scores")(query[..., :7], latent, up_proj[..., :14], positions, inv_freq[:3])


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=require_triton)])
def test_kernels_on_empty_latents_return_empty_results(backend):
    # no cached token: scores [B, H, q, 0] and rebuilt rows [B, G, 0, N]; the eager scores failed to reshape
    query, latent, up_proj, positions, inv_freq = (t.to(DEVICE) for t in _rope_inputs(seq_len=0))
    scores = get_kernel("rope_key_scores", backend)
    for latents in (latent, quantize_per_token(latent, 3)):
        out = scores(query, latents, up_proj, positions, inv_freq)
        assert out.shape == (2, 4, 1, 0) and out.dtype == torch.float32 and out.device == query.device
    packed = _quantized(seq_len=0).apply(lambda t: t.to(DEVICE))
    out = get_kernel("dequantize_matmul", backend)(packed, torch.randn(2, 24, 20, device=DEVICE))
    assert out.shape == (2, 2, 0, 20) and out.dtype == torch.float32


def _quantized(batch=2, groups=2, seq_len=9, rank=24, bits=3, group_size=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return quantize_per_token(torch.randn(batch, groups, seq_len, rank, generator=gen) * 3, bits, group_size)


@pytest.mark.parametrize("weight_batch", [None, 1, 2])
def test_dequantize_matmul_reference(weight_batch):
    quantized = _quantized()
    shape = (2, 24, 20) if weight_batch is None else (weight_batch, 2, 24, 20)
    weight = torch.randn(*shape)
    expected = dequantize_per_token(quantized) @ weight
    torch.testing.assert_close(get_kernel("dequantize_matmul")(quantized, weight), expected)
    with pytest.raises(ValueError, match="weight"):
        get_kernel("dequantize_matmul")(quantized, torch.randn(2, 23, 20))
    flat = quantized.apply(lambda t: t[0])  # [groups, seq_len, ...]: no batch axis
    with pytest.raises(
        ValueError, match=r"^Quantized latents must be \[batch, groups, seq_len, \.\.\.\], got \(2, 9, "
    ):
        get_kernel("dequantize_matmul")(flat, weight)


def test_registry():
    assert list_kernels() == {
        name: ["eager", "triton"] for name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend")
    }
    with pytest.raises(ValueError, match="Unknown kernel"):
        get_kernel("flash")
    with pytest.raises(ValueError, match="no 'cuda' backend"):
        get_kernel("rope_key_scores", "cuda")
    with pytest.raises(ValueError, match="already"):
        kernels.register_kernel("rope_key_scores", "eager", lambda: None)


def test_auto_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.resolve_auto_backend() == "eager"
    assert get_kernel("dequantize_matmul", "auto") is get_kernel("dequantize_matmul", "eager")


def test_auto_backend_keeps_cpu_inputs_on_the_eager_kernels(monkeypatch):
    # a GPU visible and triton installed, but the model on the CPU: the Triton kernels cannot read CPU tensors
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else find_spec(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels.resolve_auto_backend() == kernels.resolve_auto_backend("cuda:0") == "triton"
    assert kernels.resolve_auto_backend(torch.device("cpu")) == "eager"
    for name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend"):
        assert get_kernel(name, "auto", "cpu") is get_kernel(name, "eager")


def test_package_import_does_not_import_triton():
    code = "import sys, hf_accel.kernels, hf_accel.kernels.cache; assert 'triton' not in sys.modules"
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(kernels.__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


def test_triton_backend_without_triton_raises_clear_import_error(monkeypatch):
    monkeypatch.setattr(kernels, "is_triton_available", lambda: False)
    with pytest.raises(ImportError, match="pip install 'hf-accel\\[triton\\]'"):
        get_kernel("dequantize_matmul", "triton")


@pytest.mark.skipif(not is_triton_available(), reason="needs the optional `triton` package")
def test_compiled_triton_kernels_on_cpu_inputs_raise_a_clear_error():
    # palu_kernel_backend="triton" on a CPU model, outside Triton's interpreter: Triton's own error was "0 active
    # drivers ([]). There should only be one." on a machine without a GPU
    code = textwrap.dedent(
        """
        import torch
        from hf_accel.kernels import get_kernel
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
        args = torch.randn(1, 4, 1, 8), torch.randn(1, 1, 5, 6), torch.randn(1, 6, 16), torch.arange(5)[None], inv_freq
        for dtype in (torch.float32, torch.float64):  # float64's tl.dot does not compile, on a GPU either
            try:
                get_kernel("rope_key_scores", "triton")(*[t.to(dtype) if t.is_floating_point() else t for t in args])
            except ValueError as error:
                print(error)
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(kernels.__file__)))
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout + result.stderr
    assert lines[0].startswith("The 'triton' Palu kernels need their inputs on a GPU, got CPU tensors")
    assert lines[1].startswith("The 'triton' Palu kernels take float32, float16 or bfloat16 inputs, got float64")


ROPE_CASES = [
    # batch, heads, kv_heads, groups, q_len, seq_len, rank, head_dim
    (1, 4, 2, 1, 1, 70, 40, 8),  # two sequence tiles, rank not a multiple of the block
    (2, 6, 2, 2, 3, 17, 16, 32),  # G-LRD with 2 groups, GQA 3:1, tree of 3 queries
    (1, 2, 2, 1, 9, 5, 8, 64),  # J-LRD, 18 query rows: two query blocks
]


@require_triton
@pytest.mark.parametrize("case", ROPE_CASES)
def test_triton_rope_key_scores_matches_reference(case):
    batch, heads, kv_heads, groups, q_len, seq_len, rank, head_dim = case
    inputs = _rope_inputs(batch, heads, kv_heads, groups, q_len, seq_len, rank, head_dim, seed=seq_len)
    expected = get_kernel("rope_key_scores", "eager")(*inputs, attention_scaling=1.1, scaling=0.3)
    actual = get_kernel("rope_key_scores", "triton")(
        *[t.to(DEVICE) for t in inputs], attention_scaling=1.1, scaling=0.3
    )
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@require_triton
def test_triton_rope_key_scores_at_far_positions():
    # RoPE angles up to 1e6 radians (a 1M-token context): the kernel's cos/sin (libdevice's precise ones, which reduce
    # the angle themselves) must match the reference's of the same float32 angle; a faster sin/cos must keep this
    query, latent, up_proj, _, inv_freq = _rope_inputs(1, 4, 2, 1, 2, 64, 16, 32, seed=7)
    positions = torch.randint(0, 1_000_000, (1, 64), generator=torch.Generator().manual_seed(7))
    expected = get_kernel("rope_key_scores", "eager")(query, latent, up_proj, positions, inv_freq)
    actual = get_kernel("rope_key_scores", "triton")(
        *[t.to(DEVICE) for t in (query, latent, up_proj, positions, inv_freq)]
    )
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@require_triton
@pytest.mark.parametrize("bits,group_size", [(2, None), (3, 8)])
def test_triton_rope_key_scores_on_packed_latents(bits, group_size):
    query, latent, up_proj, positions, inv_freq = _rope_inputs(2, 6, 2, 2, 2, 70, 24, 16, seed=bits)
    packed = quantize_per_token(latent, bits, group_size)
    expected = get_kernel("rope_key_scores", "eager")(query, packed, up_proj, positions, inv_freq, scaling=0.25)
    on_device = [t.to(DEVICE) for t in (query, up_proj, positions, inv_freq)]
    packed = packed.apply(lambda t: t.to(DEVICE))
    actual = get_kernel("rope_key_scores", "triton")(on_device[0], packed, *on_device[1:], scaling=0.25)
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@require_triton
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY_BF16)])
def test_triton_rope_key_scores_half_precision(dtype):
    query, latent, up_proj, positions, inv_freq = _rope_inputs(2, 4, 2, 1, 2, 20, 16, 16, seed=1)
    half = [query.to(dtype), latent.to(dtype), up_proj.to(dtype)]
    expected = get_kernel("rope_key_scores", "eager")(*half, positions, inv_freq)  # float32 sums of the half inputs
    actual = get_kernel("rope_key_scores", "triton")(*[t.to(DEVICE) for t in half + [positions, inv_freq]]).cpu()
    # the kernel rounds each rebuilt key to the query's dtype for the tensor-core q·k dot: an error of that rounding
    # (2^-11 or 2^-8 of a key) relative to the largest score; on an H100, bf16 gave 1.7e-3
    tolerance = {torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert actual.dtype == torch.float32 and (actual - expected).abs().max() <= tolerance * expected.abs().max()


@require_triton
@pytest.mark.parametrize(
    "bits,group_size,rank,seq_len,n_out,weight_batch",
    [(2, None, 24, 9, 20, None), (3, 8, 40, 33, 40, 2), (4, 16, 32, 5, 8, 1)],
)
def test_triton_dequantize_matmul_matches_reference(bits, group_size, rank, seq_len, n_out, weight_batch):
    quantized = _quantized(seq_len=seq_len, rank=rank, bits=bits, group_size=group_size, seed=bits)
    shape = (2, rank, n_out) if weight_batch is None else (weight_batch, 2, rank, n_out)
    weight = torch.randn(*shape)
    expected = get_kernel("dequantize_matmul", "eager")(quantized, weight)
    actual = get_kernel("dequantize_matmul", "triton")(quantized.apply(lambda t: t.to(DEVICE)), weight.to(DEVICE))
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@require_triton
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY_BF16)])
def test_triton_dequantize_kernels_half_precision(dtype):
    # half weights/probabilities: the dequantized tile is rounded to their dtype for the tensor-core dot, so the
    # result differs from the float32 reference by that rounding only
    quantized = _quantized(seq_len=33, rank=40, bits=3, group_size=8, seed=5)
    on_device = quantized.apply(lambda t: t.to(DEVICE))
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    weight = torch.randn(2, 40, 24).to(dtype)
    expected = get_kernel("dequantize_matmul", "eager")(quantized, weight)
    actual = get_kernel("dequantize_matmul", "triton")(on_device, weight.to(DEVICE)).cpu()
    assert actual.dtype == torch.float32 and (actual - expected).abs().max() <= tolerance * expected.abs().max()
    probs = torch.rand(2, 6, 3, 30).softmax(-1).to(dtype)
    expected = get_kernel("dequantize_attend", "eager")(probs, quantized)
    actual = get_kernel("dequantize_attend", "triton")(probs.to(DEVICE), on_device).cpu()
    assert actual.dtype == torch.float32 and (actual - expected).abs().max() <= tolerance * expected.abs().max()


def test_dequantize_attend_reference():
    quantized = _quantized(groups=2, seq_len=9, rank=24)
    probs = torch.rand(2, 6, 2, 7).softmax(-1)  # 3 heads per group, 2 queries, first 7 of 9 tokens
    values = dequantize_per_token(quantized)[:, :, :7]
    expected = torch.stack([probs[:, h] @ values[:, h // 3] for h in range(6)], dim=1)
    torch.testing.assert_close(get_kernel("dequantize_attend")(probs, quantized), expected)
    with pytest.raises(ValueError, match="multiple of 2 heads"):
        get_kernel("dequantize_attend")(probs[:, :5], quantized)
    with pytest.raises(
        ValueError, match=r"^Expected probs \[batch, num_heads, q_len, S'\] and latents .*got \(6, 2, 7\) and"
    ):
        get_kernel("dequantize_attend")(probs[0], quantized)
    with pytest.raises(ValueError, match=r"got \(2, 6, 2, 7\) and \(2, 9, \d+\)\.$"):
        get_kernel("dequantize_attend")(probs, quantized.apply(lambda t: t[0]))


@require_triton
@pytest.mark.parametrize(
    "bits,group_size,heads,q_len,used,seq_len,rank",
    [
        (4, None, 4, 1, 70, 70, 40),
        (3, 8, 6, 3, 20, 25, 24),
        (2, None, 2, 1, 0, 4, 16),
        (3, None, 2, 9, 5, 5, 32),
        (3, None, 6, 9, 40, 40, 24),  # 27 query rows per group: two row tiles, each over two key splits
    ],
)
def test_triton_dequantize_attend_matches_reference(bits, group_size, heads, q_len, used, seq_len, rank):
    quantized = _quantized(groups=2, seq_len=seq_len, rank=rank, bits=bits, group_size=group_size, seed=used)
    probs = torch.rand(2, heads, q_len, used).softmax(-1) if used else torch.zeros(2, heads, q_len, 0)
    expected = get_kernel("dequantize_attend", "eager")(probs, quantized)
    actual = get_kernel("dequantize_attend", "triton")(probs.to(DEVICE), quantized.apply(lambda t: t.to(DEVICE)))
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not is_triton_available(), reason="needs the optional `triton` package")
@pytest.mark.parametrize(
    "batch,groups,heads,q_len,used,rank",
    [
        (1, 2, 32, 1, 65536, 384),  # decoding, Llama-3-8B-shaped layer at gs 4: the keys are split to fill the GPU
        (1, 2, 32, 4096, 4096, 384),  # its 4,096-token prefill: split by keys alone, 22 buffers of 201 MB (4.4 GB)
        (8, 8, 32, 16, 2048, 96),
        (1, 1, 1, 1, 10**7, 8),
        (4, 3, 9, 200, 300, 200),
    ],
)
def test_dequantize_attend_partial_sums_stay_near_the_output_size(batch, groups, heads, q_len, used, rank):
    from hf_accel.kernels.triton_palu import attend_launch_plan

    row_tiles, rank_tiles, num_splits, split_len = attend_launch_plan(
        batch, groups, heads // groups * q_len, rank, used, 16, 32, 32
    )
    assert row_tiles * 16 >= heads // groups * q_len and rank_tiles * 32 >= rank
    assert (num_splits - 1) * split_len < used <= num_splits * split_len  # every key read, no empty split
    assert max(rank_tiles, num_splits) <= 65535  # CUDA's limit on grid axes 1 and 2
    output_bytes = batch * heads * q_len * rank * 4
    assert num_splits * output_bytes <= output_bytes + 4 * 2**20
    if q_len == 1 and used > 32 * 512:
        assert num_splits > 1


@require_triton
def test_triton_kernels_put_long_sequences_on_grid_axis_0(monkeypatch):
    # CUDA allows 65,535 programs on grid axes 1 and 2: sequence tiles there failed to launch past 2-4M tokens
    from hf_accel.kernels import triton_palu

    grids = []

    class _Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    for name in ("_rope_key_scores_kernel", "_dequantize_matmul_kernel", "_dequantize_attend_kernel"):
        monkeypatch.setattr(triton_palu, name, _Recorder())
    seq_len = 65536 * 64 + 1
    query, latent, up_proj = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, seq_len, 1), torch.zeros(1, 1, 2)
    triton_palu.rope_key_scores(query, latent, up_proj, torch.zeros(1, seq_len, dtype=torch.long), _inv_freq(2))
    codes = torch.zeros(1, 1, seq_len, 1, dtype=torch.uint8)
    scales = torch.zeros(1, 1, seq_len, 1, dtype=torch.float16)
    quantized = QuantizedLatents(codes, scales, scales.clone(), bits=4, dim=1, group_size=1)
    triton_palu.dequantize_matmul(quantized, torch.zeros(1, 1, 1))
    assert len(grids) == 2
    for grid in grids:
        assert all(axis <= 65535 for axis in grid[1:]), grid
        assert grid[0] >= seq_len // 64


@pytest.mark.skipif(not is_triton_available(), reason="needs the optional `triton` package")
def test_triton_kernels_compile_for_h100_without_a_gpu():
    # the interpreter does not lower the kernels: compile them for sm_90 in a process without TRITON_INTERPRET
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(kernels.__file__)))
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(os.path.dirname(__file__), "compile_triton_kernels.py")
    result = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("compiled ") == 4


@require_triton
@pytest.mark.parametrize("window", [0, 3])
def test_cache_fused_reads_with_triton_backend(window):
    from hf_accel.kernels.cache import PaluQuantizedLayer

    gen = torch.Generator().manual_seed(window)
    layer = PaluQuantizedLayer(bits=4, residual_length=window)
    positions, inv_freq = torch.arange(10).expand(1, -1), _inv_freq(16)
    for start, tokens in ((0, 9), (9, 1)):
        states = (torch.randn(1, 2, tokens, r, generator=gen).to(DEVICE) for r in (16, 24))
        layer.append(*states, positions[:, start : start + tokens].to(DEVICE))
    query, up_proj = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(2, 16, 16, generator=gen)
    args = [t.to(DEVICE) for t in (query, up_proj, positions, inv_freq)]
    torch.testing.assert_close(
        layer.key_scores(*args, backend="triton").cpu(), layer.key_scores(*args).cpu(), atol=1e-4, rtol=1e-4
    )
    probs = torch.rand(1, 4, 1, 10, generator=gen).softmax(-1).to(DEVICE)
    torch.testing.assert_close(
        layer.attend_values(probs, args[2], backend="triton").cpu(),
        layer.attend_values(probs, args[2]).cpu(),
        atol=1e-5,
        rtol=1e-4,
    )


@require_triton
def test_triton_kernels_launch_on_their_inputs_device(monkeypatch):
    # Triton launches on the current CUDA device: a layer on cuda:1 (device_map="auto") must make cuda:1 current
    from hf_accel.kernels import triton_palu

    guard = triton_palu._launch_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    launched_on = []
    real_guard = triton_palu._launch_guard
    monkeypatch.setattr(
        triton_palu, "_launch_guard", lambda device, *inputs: launched_on.append(device) or real_guard(device, *inputs)
    )
    query, latent, up_proj, positions, inv_freq = [t.to(DEVICE) for t in _rope_inputs()]
    quantized = _quantized(groups=1, seq_len=10, rank=12).apply(lambda t: t.to(DEVICE))
    triton_palu.rope_key_scores(query, latent, up_proj, positions, inv_freq)
    triton_palu.dequantize_matmul(quantized, up_proj)
    triton_palu.dequantize_attend(torch.rand(2, 4, 1, 10, device=DEVICE).softmax(-1), quantized)
    assert launched_on == [query.device] * 3


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not is_triton_available(), reason="needs two CUDA GPUs")
def test_triton_rope_key_scores_on_the_second_gpu():
    inputs = _rope_inputs(seq_len=70, rank=40)
    expected = get_kernel("rope_key_scores", "eager")(*inputs)
    with torch.cuda.device(0):
        actual = get_kernel("rope_key_scores", "triton")(*[t.to("cuda:1") for t in inputs])
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@require_triton
def test_rope_probe_angle_reduction_keeps_the_scores_at_large_positions(tmp_path):
    # scripts/probe_palu_rope_cost.py times GPU-only fast sin/cos on angles reduced mod 2π; the reduction itself must
    # not change the scores, checked here with the precise functions at positions up to 4·10^5 (~6·10^4 turns)
    import runpy
    from pathlib import Path

    probe = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "probe_palu_rope_cost.py"))
    reduced = probe["variant_module"]("reduced", tmp_path, sincos=probe["REDUCE"] + probe["SINCOS"])
    query, latent, up_proj, positions, inv_freq = _rope_inputs(head_dim=16, seq_len=40)
    positions = positions * 100  # < 4·10^5
    expected = _hf_scores(*(t.double() for t in (query, latent, up_proj)), positions, inv_freq.double(), kv_heads=2)
    got = reduced.rope_key_scores(query, latent, up_proj, positions, inv_freq)
    base = get_kernel("rope_key_scores", "triton")(query, latent, up_proj, positions, inv_freq)
    scale = expected.abs().max()
    # fp32 angles at 4·10^5 rad are themselves off by ~0.02 rad: the reduced variant must match the shipped kernel
    assert (got - base).abs().max() / scale < 1e-4
    assert (got.double() - expected).abs().max() / scale < 0.1
