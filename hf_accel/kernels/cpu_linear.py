"""The GEMM layout of the speculative engine's passes on CPU: `x·Wᵀ` (what `nn.Linear` runs) or `(W·xᵀ)ᵀ`.

A verification pass multiplies every weight by a few rows (the draft tree's nodes), and the BLAS kernel that
`torch.nn.functional.linear` reaches for so few rows can cost far more than the layout's other orientation: with
MKL on an AMD EPYC (the 2-core machine of issue 6), `x·Wᵀ` over 2-4 rows took 1.5-1.9x the 1-row step of plain
decoding, and the same product as `(W·xᵀ)ᵀ` 0.8-0.9x of it (`python scripts/pass_cost.py`). Which layout is faster
depends on the BLAS library and the CPU, so it is measured, not assumed: [`transposed_row_counts`] times both on the
model's own weights for each row count of [`ROW_GRID`], once per process, and [`TransposedLinear`] runs the model's
`nn.Linear` layers as `(W·xᵀ)ᵀ` during a pass for the row counts that ran faster that way. One-row passes (plain
decoding, a drafter that proposes nothing) are a matrix-vector product in both layouts and are never touched.

The two layouts sum the same products in different orders: logits differ in the last bits, as they already do
between a one-row and a multi-row pass, so greedy output stays identical to plain decoding under the engine's
contract (a near-tie is the one way it could flip, and is reported).
"""

import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F


ROW_GRID = (2, 4, 8, 16, 32, 64)  # row counts measured; a pass's count takes the decision of the nearest (log scale)

_DECISIONS: dict[tuple, frozenset[int]] = {}  # per weight shapes, dtype and thread count: measured once


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight · xᵀ)ᵀ`, for `x` of any leading shape."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, rows.t()).t()
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def grid_point(rows: int) -> int | None:
    """The [`ROW_GRID`] count whose decision a pass over `rows` rows takes (nearest in log scale); `None` outside
    the grid (one row, or more than its last count)."""
    if rows < 2 or rows > ROW_GRID[-1]:
        return None
    return min(ROW_GRID, key=lambda g: abs(math.log(g) - math.log(rows)))


class TransposedLinear:
    """While entered, the float32 CPU `nn.Linear` layers of `model` run as [`transposed_linear`] for inputs whose row
    count falls on `row_counts` (grid points of [`ROW_GRID`]), and as before for every other input.

    Each layer gets an instance `forward` for the duration (one Python call per layer, where a `TorchFunctionMode`
    would see every tensor operation of the pass: about 8 % of a one-token pass of the default model), removed on
    exit. Layers that already have their own instance `forward` (accelerate's hooks) are left as they are. Another
    thread calling `model` meanwhile also gets the layout: the same products, summed in another order.
    """

    def __init__(self, model, row_counts):
        self.row_counts = frozenset(row_counts)
        self.layers = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        ]
        self.entered = []

    def _forward(self, layer, x):
        if (
            x.dtype == torch.float32
            and x.dim() >= 1
            and grid_point(x.numel() // max(x.shape[-1], 1)) in self.row_counts
        ):
            return transposed_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def __enter__(self):
        self.entered = [layer for layer in self.layers if "forward" not in layer.__dict__]
        for layer in self.entered:
            layer.__dict__["forward"] = functools.partial(self._forward, layer)
        return self

    def __exit__(self, *exc):
        for layer in self.entered:
            layer.__dict__.pop("forward", None)
        self.entered = []


def _linear_weights(model, count: int = 8) -> list[torch.Tensor]:
    """The output projection's weight and the first `count` other `nn.Linear` weights: a decoder layer's worth."""
    weights = []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        weights.append(head.weight)
    for module in model.modules():
        if len(weights) > count:
            break
        if isinstance(module, torch.nn.Linear) and module is not head:
            weights.append(module.weight)
    return [w for w in weights if w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2]


def transposed_row_counts(weights, repeats: int = 3) -> frozenset[int]:
    """The [`ROW_GRID`] counts at which `(W·xᵀ)ᵀ` ran faster than `x·Wᵀ` over `weights` (median of `repeats`,
    the two layouts alternating). Measured once per process for the same weight shapes, dtype and thread count."""
    weights = list(weights)
    if not weights:
        return frozenset()
    key = (tuple(tuple(w.shape) for w in weights), weights[0].dtype, torch.get_num_threads())
    if key not in _DECISIONS:
        generator = torch.Generator().manual_seed(0)
        faster = set()
        with torch.no_grad():
            for rows in ROW_GRID:
                inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=generator) for w in weights}
                times = {F.linear: [], transposed_linear: []}
                for _ in range(repeats + 1):  # the first round warms up
                    for layout, measured in times.items():
                        start = time.perf_counter()
                        for w in weights:
                            layout(inputs[w.shape[1]], w)
                        measured.append(time.perf_counter() - start)
                if statistics.median(times[transposed_linear][1:]) < statistics.median(times[F.linear][1:]):
                    faster.add(rows)
        _DECISIONS[key] = frozenset(faster)
    return _DECISIONS[key]


def verification_layout(model) -> TransposedLinear | None:
    """The layout for the engine's passes over `model`: a [`TransposedLinear`] for the row counts measured faster
    that way, or `None` where nothing changes (a model off the CPU, not in float32, compiled, or where `x·Wᵀ` won
    everywhere)."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return None
    if hasattr(model, "_orig_mod") or torch.compiler.is_compiling():  # a compiled model keeps its traced kernels
        return None
    row_counts = transposed_row_counts(_linear_weights(model))
    return TransposedLinear(model, row_counts) if row_counts else None
