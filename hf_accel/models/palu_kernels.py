"""The kernel-side names that `modeling_palu.py` uses, re-exported from `hf_accel.kernels`.

Inside the package this is a thin shim (absolute imports, so transformers does not follow them as relative files).
A converted checkpoint gets a self-contained `palu_kernels.py` instead, written by [`hf_accel.compress.palu.write_palu_kernels_file`] from the sources of `hf_accel.kernels` (quantization,
eager reference kernels, registry and `PaluQuantizedCache`), so the checkpoint loads without hf_accel installed.
"""

from hf_accel.kernels import get_kernel
from hf_accel.kernels.cache import PaluQuantizedCache, PaluQuantizedLayer, reads_in_full_precision


__all__ = ["PaluQuantizedCache", "PaluQuantizedLayer", "get_kernel", "reads_in_full_precision"]
