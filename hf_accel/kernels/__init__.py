"""Kernels with plain-PyTorch references (the CPU path and test oracle) and optional Triton versions."""

import importlib.util

from .registry import get_kernel, list_kernels, register_kernel, resolve_auto_backend


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

__all__ = ["get_kernel", "is_triton_available", "list_kernels", "register_kernel", "resolve_auto_backend"]
