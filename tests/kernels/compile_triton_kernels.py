"""Compile every Palu Triton kernel ahead of time for an sm_90 (H100) target; no GPU needed.

The interpreter tests check the kernels' arithmetic on CPU, but not that they lower to GPU code (block shapes of
`tl.dot`, dtypes, constexpr branches). Run as a script with TRITON_INTERPRET unset; prints one line per kernel
and exits 1 if any fails.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_accel.kernels import triton_palu


def _compile(kernel, pointers, integers, constexprs, floats=()) -> None:
    signature = {name: dtype for name, dtype in pointers.items()}
    signature.update({name: "i32" for name in integers})
    signature.update({name: "fp32" for name in floats})
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))


def _cases():
    packed = {"codes_ptr": "*u8", "scales_ptr": "*fp16", "zeros_ptr": "*fp16"}
    yield (
        "dequantize_matmul",
        lambda: _compile(
            triton_palu._dequantize_matmul_kernel,
            {**packed, "w_ptr": "*fp16", "out_ptr": "*fp32"},
            ["groups", "seq_len", "rank", "n_out", "num_bytes", "num_qgroups", "group_size", "w_batch_stride"]
            + ["seq_tiles"],
            {"BITS": 3, "BLOCK_S": 32, "BLOCK_R": 32, "BLOCK_N": 32, "IEEE": False},
        ),
    )
    yield (
        "dequantize_attend",
        lambda: _compile(
            triton_palu._dequantize_attend_kernel,
            {"probs_ptr": "*fp16", **packed, "out_ptr": "*fp32"},
            ["groups", "num_heads", "q_len", "used_len", "seq_len", "rank", "num_bytes", "num_qgroups", "group_size"]
            + ["split_len", "split_stride", "row_tiles"],
            {"BITS": 4, "BLOCK_M": 16, "BLOCK_S": 32, "BLOCK_R": 32, "IEEE": False},
        ),
    )
    for quantized in (False, True):
        pointers = {"q_ptr": "*fp16", "latent_ptr": "*fp16", **packed, "up_ptr": "*fp16", "pos_ptr": "*i64"}
        pointers.update({"inv_freq_ptr": "*fp32", "out_ptr": "*fp32"})
        constexprs = {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_S": 64, "BLOCK_R": 32, "BLOCK_Q": 16}
        constexprs.update({"BITS": 4, "QUANTIZED": quantized, "IEEE_K": False, "IEEE_Q": False})
        integers = ["num_heads", "num_kv_heads", "q_len", "seq_len", "rank", "kv_per_group", "groups"]
        yield (
            f"rope_key_scores(quantized={quantized})",
            lambda p=pointers, c=constexprs, i=integers: _compile(
                triton_palu._rope_key_scores_kernel,
                p,
                i + ["num_bytes", "num_qgroups", "group_size", "seq_tiles"],
                c,
                floats=["attention_scaling", "scaling"],
            ),
        )


def main() -> int:
    failures = 0
    for name, build in _cases():
        try:
            build()
            print(f"compiled {name}")
        except Exception as error:  # noqa: BLE001 (report every kernel, not just the first failure)
            failures += 1
            print(f"FAILED {name}: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
