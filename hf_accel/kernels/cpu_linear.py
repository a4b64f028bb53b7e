"""The GEMM layout of the speculative engine's passes on CPU: `x·Wᵀ` (what `nn.Linear` runs) or `(W·xᵀ)ᵀ`.

A verification pass multiplies every weight by a few rows (the draft tree's nodes), and the BLAS kernel that
`torch.nn.functional.linear` reaches for so few rows can cost far more than the other orientation: with MKL on an
AMD EPYC (the 2-core machine of issue 6), a pass over 2-4 tokens in `x·Wᵀ` took 1.47-2.04x the one-token step of
plain decoding, and in `(W·xᵀ)ᵀ` 0.67-0.82x of it (`python scripts/pass_cost.py`). Which layout is faster depends on
the BLAS library and the CPU, so it is measured, not assumed: [`transposed_row_counts`] times both layouts over the
model's own weights (up to 512 MB of them, streamed from memory as in a pass) for each row count of [`ROW_GRID`],
once per process, and keeps `(W·xᵀ)ᵀ` where it was at least 10 % faster; [`TransposedLinear`] runs the model's
`nn.Linear` layers in it during the engine's passes over those row counts. One-row passes (plain decoding, a drafter
that proposes nothing) are a matrix-vector product in both layouts and are never touched.

The two layouts sum the same products in different orders: logits differ in the last bits, as they already do
between a one-row and a multi-row pass. A greedy token could flip only on an exact near-tie, which `hf-accel bench
generate` would show as a non-identical output; none has in any run.
"""

import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F


ROW_GRID = (2, 4, 8, 16, 32)  # row counts measured; a pass's count takes the decision of the nearest (log scale)
MARGIN = 0.9  # `(W·xᵀ)ᵀ` is kept where it took at most this fraction of `x·Wᵀ`'s time: noise does not flip a tie
WEIGHT_BUDGET = 512 * 2**20  # bytes of weights timed: a large model's passes stream more, at the same speed

_DECISIONS: dict[tuple, frozenset[int]] = {}  # per weight shapes, dtype and thread count: measured once


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight · xᵀ)ᵀ`, for `x` of any leading shape."""
    rows = x.reshape(-1, x.shape[-1]).t()
    out = torch.mm(weight, rows) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows)
    return out.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


def grid_point(rows: int) -> int | None:
    """The [`ROW_GRID`] count whose decision a pass over `rows` rows takes (nearest in log scale); `None` outside
    the grid (one row, or more than its last count)."""
    if rows < 2 or rows > ROW_GRID[-1]:
        return None
    return min(ROW_GRID, key=lambda g: abs(math.log(g) - math.log(rows)))


class TransposedLinear:
    """While entered, the float32 CPU `nn.Linear` layers of `model` run as [`transposed_linear`] for inputs whose row
    count falls on `row_counts` (grid points of [`ROW_GRID`]), and as before for every other input (and under
    autocast, which picks its own dtype for the product).

    Each layer gets an instance `forward` for the duration (one Python call per layer, where a `TorchFunctionMode`
    would see every tensor operation of the pass: about 8 % of a one-token pass of the default model), removed when
    the entry that installed it exits. Entries may nest (the engine's own passes run one at a time). Layers that
    already have their own instance `forward` (accelerate's hooks) are left as they are. Another thread calling
    `model` meanwhile also gets the layout: the same products, summed in another order.
    """

    def __init__(self, model, row_counts):
        self.row_counts = frozenset(row_counts)
        # every row count the layout takes, resolved once: a pass calls `_forward` once per layer
        self.routed_rows = frozenset(r for r in range(2, ROW_GRID[-1] + 1) if grid_point(r) in self.row_counts)
        self.layers = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        ]
        self.entered = []  # per entry still open, innermost last: the layers it gave a `forward`

    def _forward(self, layer, x):
        if (
            x.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
            and x.dim() >= 1
            and x.numel() // max(x.shape[-1], 1) in self.routed_rows
        ):
            return transposed_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def __enter__(self):
        installed = []
        try:
            for layer in self.layers:
                if "forward" not in layer.__dict__:
                    layer.__dict__["forward"] = functools.partial(self._forward, layer)
                    installed.append(layer)
        finally:  # an interrupt halfway still leaves the exit something to remove
            self.entered.append(installed)
        return self

    def __exit__(self, *exc):
        for layer in self.entered.pop():
            layer.__dict__.pop("forward", None)


def _linear_weights(model, budget: int = WEIGHT_BUDGET) -> list[torch.Tensor]:
    """The float32 CPU `nn.Linear` weights of `model` in module order, each tensor once (tied ones too), until
    `budget` bytes: what a pass reads, or its first layers' worth of a large model."""
    weights, seen, total = [], set(), 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in seen:
            continue
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
            continue
        if weights and total + w.nbytes > budget:
            break
        weights.append(w)
        seen.add(id(w))
        total += w.nbytes
    return weights


def transposed_row_counts(weights, repeats: int = 3) -> frozenset[int]:
    """The [`ROW_GRID`] counts at which `(W·xᵀ)ᵀ` took at most [`MARGIN`] of `x·Wᵀ`'s time over `weights` (medians
    of `repeats`, the two layouts alternating). Measured once per process for the same weight shapes, dtype and thread
    count."""
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
                if statistics.median(times[transposed_linear][1:]) <= MARGIN * statistics.median(times[F.linear][1:]):
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
    compiled = hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
    if compiled or torch.compiler.is_compiling():  # `torch.compile(model)`, `model.compile()`: traced kernels stay
        return None
    row_counts = transposed_row_counts(_linear_weights(model))
    return TransposedLinear(model, row_counts) if row_counts else None
