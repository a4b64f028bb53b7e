"""Probe: runs an hf-accel command or script with every `nn.Linear` of the loaded model on MKL's pre-packed fp32
GEMM (`torch.ops.mkl._mkl_linear`, the weights packed once), to test whether a cheaper multi-token verification pass
raises the speculative speedup on CPU.

Unpacked, MKL's fp32 GEMM repacks each weight on every call once a pass has 4 or more rows (the step in
`scripts/pass_cost.py`'s curve); packed once, a pass over 4-16 tokens costs less. Every method in a `bench generate`
run uses the same packed model, so the ratios stay like for like. Not part of the library: packing doubles the
weights' memory and the packed copies go stale if the weights change.

Usage:
    python scripts/probe_mkl_packed.py scripts/pass_cost.py --json
    python scripts/probe_mkl_packed.py hf-accel bench generate --prompts humaneval --offset 100 --limit 64 \\
        --methods vanilla,ngram:hf_accel/data/indexes/smollm2-135m-code-build --json
"""

import runpy
import sys

import torch

import hf_accel.loading


def pack_linear_weights(model, rows_hint: int = 16) -> None:
    """Replaces the forward of every float32 `nn.Linear` of `model` by MKL's packed GEMM (inference only)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), rows_hint)

            def forward(x, module=module, packed=packed):
                rows = x.numel() // x.shape[-1]
                return torch.ops.mkl._mkl_linear(x, packed, module.weight, module.bias, rows)

            module.forward = forward


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or not torch.backends.mkl.is_available():
        print(
            "usage: probe_mkl_packed.py (hf-accel ARGS... | SCRIPT.py ARGS...); needs torch with MKL", file=sys.stderr
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    load = hf_accel.loading.load_model_and_tokenizer

    def load_packed(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        pack_linear_weights(model)
        return model, tokenizer

    hf_accel.loading.load_model_and_tokenizer = load_packed  # callers import it from the module when they run
    if argv[0] == "hf-accel":
        from hf_accel.cli import main as cli_main

        return cli_main(argv[1:])
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
