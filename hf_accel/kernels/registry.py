"""Kernel registry: every kernel has an eager reference and optional fast backends, picked by a config string.

Backends are registered as loaders (zero-argument callables returning the function), so that optional packages
such as triton are imported only when their backend is asked for (STYLE.md points 5 and 10).
"""

import importlib.util
from collections.abc import Callable

import torch


_KERNEL_LOADERS: dict[str, dict[str, Callable[[], Callable]]] = {}


def register_kernel(name: str, backend: str, loader: Callable[[], Callable]) -> None:
    """
    Register `loader` as backend `backend` of kernel `name`.

    Args:
        name (`str`): kernel name, e.g. `"rope_key_scores"`.
        backend (`str`): backend key, e.g. `"eager"` or `"triton"`.
        loader (`Callable[[], Callable]`): returns the kernel function; may raise `ImportError`.
    """
    backends = _KERNEL_LOADERS.setdefault(name, {})
    if backend in backends:
        raise ValueError(f"Kernel {name!r} already has a {backend!r} backend.")
    backends[backend] = loader


def list_kernels() -> dict[str, list[str]]:
    """Registered kernels and their backends."""
    return {name: sorted(backends) for name, backends in _KERNEL_LOADERS.items()}


def get_kernel(name: str, backend: str = "eager", device: torch.device | str | None = None) -> Callable:
    """
    The function of kernel `name` for `backend`; all backends of a kernel share one signature.

    Args:
        name (`str`): a registered kernel name.
        backend (`str`, *optional*, defaults to `"eager"`): `"eager"` (plain PyTorch, runs anywhere), `"triton"`, or
            `"auto"` (see [`resolve_auto_backend`]). Both backends compute the same result within float tolerance.
        device (`torch.device` or `str`, *optional*): where the kernel's inputs are, for `"auto"`: inputs on the CPU
            get the eager kernel even where a GPU is visible.

    Raises:
        `ValueError`: unknown kernel or backend. `ImportError`: the backend's package is missing.
    """
    if backend == "auto":
        backend = resolve_auto_backend(device)
    if name not in _KERNEL_LOADERS:
        raise ValueError(f"Unknown kernel {name!r}; registered kernels: {sorted(_KERNEL_LOADERS)}.")
    backends = _KERNEL_LOADERS[name]
    if backend not in backends:
        raise ValueError(f"Kernel {name!r} has no {backend!r} backend; choose one of {sorted(backends)}.")
    return backends[backend]()


def resolve_auto_backend(device: torch.device | str | None = None) -> str:
    """`"triton"` when the `triton` package is installed and the inputs are on a CUDA device (`device`; without it,
    when one is visible), else `"eager"`: the Triton kernels cannot read CPU tensors."""
    has_triton = importlib.util.find_spec("triton") is not None
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "triton" if has_triton and on_cuda else "eager"
