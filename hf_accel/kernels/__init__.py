"""Kernels with plain-PyTorch references (the CPU path and test oracle) and optional Triton versions.

Palu pieces (spec 002), for the converter and the Palu attention:

- `hadamard`: `hadamard_matrix(r)`, `apply_hadamard(x)`, `fold_hadamard_into_factors(A, B)` (block-diagonal
  Walsh–Hadamard for ranks that are not powers of two).
- `quant`: `quantize_per_token(x, bits, group_size)` → `QuantizedLatents` (packed codes, scales, zeros),
  `dequantize_per_token`, `compute_bytes_per_token`.
- `cache`: `PaluQuantizedCache` / `PaluQuantizedLayer` (each token quantized once, optional full-precision window,
  `get_cache_bytes`, `crop`, `select_positions`, batch ops; `key_scores` / `attend_values` read the packed latents
  through the kernels).
- kernels, by name through `get_kernel(name, backend)` with backend `"eager"`, `"triton"` or `"auto"`:
  `rope_key_scores` (latent × B → RoPE → q·kᵀ, plain or packed latents), `dequantize_matmul` (packed latents × B),
  `dequantize_attend` (probabilities × packed value latents).

For the speculative engine: `cpu_linear`, the GEMM layout (`x·Wᵀ` or `(W·xᵀ)ᵀ`) its CPU passes run `nn.Linear` in,
measured per machine.
"""

import hashlib
import importlib.util
from pathlib import Path

from .registry import get_kernel, list_kernels, register_kernel, resolve_auto_backend


# The modules a converted Palu checkpoint's self-contained `palu_kernels.py` is written from
# (`hf_accel.compress.palu.write_palu_kernels_file`).
CHECKPOINT_SOURCES = ("quant.py", "reference.py", "registry.py", "cache.py")


def checkpoint_sources_hash() -> str:
    """sha256 of [`CHECKPOINT_SOURCES`]: a checkpoint written from the same sources uses this package's kernels (and so
    its Triton backend) and cache classes instead of its own copies; one from other sources (an older or newer
    hf_accel) keeps its copies, which match its modeling code. Line endings are read as `\n`: the same sources checked
    out with `\r\n` (git's autocrlf on Windows) hash the same."""
    digest = hashlib.sha256()
    for name in CHECKPOINT_SOURCES:
        digest.update((Path(__file__).parent / name).read_text(encoding="utf-8").encode("utf-8"))
    return digest.hexdigest()


def is_triton_available() -> bool:
    """Whether the optional `triton` package is installed (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


def _eager_loader(name: str):
    def load():
        from . import reference

        return getattr(reference, name)

    return load


def _triton_loader(name: str):
    def load():
        # avoid eager triton import: only this backend needs it
        if not is_triton_available():
            raise ImportError(
                f"The 'triton' backend of kernel {name!r} needs the `triton` package: `pip install 'hf-accel[triton]'`, "
                "or select the 'eager' backend."
            )
        from . import triton_palu

        return getattr(triton_palu, name)

    return load


for _name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend"):
    register_kernel(_name, "eager", _eager_loader(_name))
    register_kernel(_name, "triton", _triton_loader(_name))

__all__ = [
    "CHECKPOINT_SOURCES",
    "checkpoint_sources_hash",
    "get_kernel",
    "is_triton_available",
    "list_kernels",
    "register_kernel",
    "resolve_auto_backend",
]
