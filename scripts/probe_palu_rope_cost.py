"""How much of the fused Palu score kernel's time RoPE's sin/cos take, and how launch settings move it (CUDA GPU).

    python scripts/probe_palu_rope_cost.py --json

Times `_rope_key_scores_kernel` alone (one Llama-3-8B-shaped layer, batch 1, fp16, as `bench_palu_kernels.py`; CUDA
events, median of 50 runs, L2 flushed before each) at gs 1 and 4, 16K and 64K tokens:

- `base`: the kernel as shipped, over a few tile sizes, warp counts and pipeline stages;
- `norope`: cos/sin replaced by constants (wrong scores: the lower bound of what RoPE can cost);
- `fast`: libdevice's `fast_cosf`/`fast_sinf` on the unreduced angles instead of the precise functions;
- `fast_reduced`: the same on the angles first reduced to [-π, π] (`_angle_mod_2pi`: two FMAs with 2π split into a
  short head and a tail). The reduction is checked on CPU, with the precise functions in Triton's interpreter
  (tests/kernels/test_palu_kernels.py).

`err` is the largest error against the eager reference relative to its largest score. The variants are built by
rewriting the kernel module's source in a temporary file; needs a CUDA GPU and triton.
"""

import importlib.util
import json
import tempfile
from functools import partial
from pathlib import Path

import torch
import triton

from hf_accel.cli import OneLineErrorParser
from hf_accel.kernels import benchmark, triton_palu
from hf_accel.kernels.reference import rope_key_scores


SINCOS = "cos, sin = tl.cos(freqs) * attention_scaling, tl.sin(freqs) * attention_scaling"
FAST = "cos, sin = libdevice.fast_cosf(freqs) * attention_scaling, libdevice.fast_sinf(freqs) * attention_scaling"
REDUCE = "freqs = _angle_mod_2pi(freqs)\n    "  # a statement before the sin/cos line, at its indentation
VARIANTS = {
    "norope": "cos, sin = freqs * 0 + attention_scaling, freqs * 0",
    "fast": FAST,
    "fast_reduced": REDUCE + FAST,
}
# 2π = head + tail with an 8-bit head (6.28125 = 201/32): `turns * head` is exact even without a fused multiply-add
# while turns < 2^16 (angles up to 4·10^5 rad)
ANGLE_MOD_2PI = """

@triton.jit
def _angle_mod_2pi(angle):
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    return tl.fma(turns, -0.0019353071795864769, tl.fma(turns, -6.28125, angle))
"""
LAUNCHES = [(64, 4, None), (128, 4, None), (128, 8, None), (32, 4, None), (64, 4, 1), (128, 4, 2)]


def variant_module(name: str, folder: Path, sincos: str | None = None):
    """`triton_palu` with the score kernel's sin/cos line replaced by `sincos` (default: `VARIANTS[name]`)."""
    source = Path(triton_palu.__file__).read_text(encoding="utf-8")
    if SINCOS not in source:
        raise SystemExit("the score kernel's sin/cos line changed: update this probe")
    source = source.replace(SINCOS, sincos or VARIANTS[name]).replace("from .", "from hf_accel.kernels.")
    source += ANGLE_MOD_2PI
    source = source.replace(
        "import triton.language as tl\n", "import triton.language as tl\nfrom triton.language.extra import libdevice\n"
    )
    path = folder / f"palu_{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"palu_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(module, x, block_s, warps, stages):
    query, latent, up_proj = x["query"], x["latent_keys"], x["up_k"]
    batch, heads, q_len, head_dim = query.shape
    groups, rank, width = up_proj.shape
    seq_len = latent.shape[2]
    out = torch.empty(batch, heads, q_len, seq_len, dtype=torch.float32, device=query.device)
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
    half = head_dim // 2
    module._rope_key_scores_kernel[(batch * groups, triton.cdiv(seq_len, block_s))](
        query, latent, latent, latent, latent, up_proj, x["positions"], x["inv_freq"], out,
        heads, width // head_dim * groups, q_len, seq_len, rank, width // head_dim, groups, 1.0, 1.0, 1, 1, 1,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_S=block_s,
        BLOCK_R=32, BLOCK_Q=16, BITS=8, QUANTIZED=False, IEEE_K=False, IEEE_Q=False, **options,
    )  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of one line per row")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": None, "error": "no CUDA GPU available", "rows": []}))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        modules = {"base": triton_palu, **{name: variant_module(name, Path(folder)) for name in VARIANTS}}
        for group_size in (1, 4):
            config = benchmark.PaluAttentionBenchConfig(group_size=group_size)
            for seq_len in (16384, 65536):
                x = benchmark._make_inputs(config, seq_len, "cuda")
                expected = rope_key_scores(x["query"], x["latent_keys"], x["up_k"], x["positions"], x["inv_freq"])
                for name, module in modules.items():
                    for block_s, warps, stages in LAUNCHES if name == "base" else LAUNCHES[:1]:
                        scores = launch(module, x, block_s, warps, stages)
                        err = float((scores - expected).abs().max() / expected.abs().max())
                        ms = benchmark._time_ms(partial(launch, module, x, block_s, warps, stages), 10, 50)
                        row = {"gs": group_size, "S": seq_len, "variant": name, "block_s": block_s, "warps": warps}
                        rows.append({**row, "stages": stages, "ms": ms, "err": err})
                        if not args.json:
                            print(rows[-1], flush=True)
    if args.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
