"""The GEMM layout of the speculative engine's passes on CPU: `x·Wᵀ` (what `nn.Linear` runs) or `(W·xᵀ)ᵀ`.

A verification pass multiplies every weight by a few rows (the draft tree's nodes), and the BLAS kernel that
`torch.nn.functional.linear` reaches for so few rows can cost far more than the other orientation: with MKL on an
AMD EPYC (the 2-core machine of issue 6), a pass over 2-4 tokens in `x·Wᵀ` took 1.47-2.04x the one-token step of
plain decoding, and in `(W·xᵀ)ᵀ` 0.67-0.82x of it (`python scripts/pass_cost.py`). A one-row product is a
matrix-vector product, which that BLAS runs on one core: the default model's output projection (49,152 x 576) took
7.2 ms for one row and 3.0 ms for two in `(W·xᵀ)ᵀ`, so one row is run as two (a zero row added) where that is faster.

Which layout is faster depends on the BLAS library, the CPU and the weight's shape, so it is measured, not assumed:
[`transposed_row_counts`] times both layouts for each weight shape of the model (the weights of that shape, up to
128 MB of them, streamed from memory as in a pass) and each row count of [`ROW_GRID`], once per process, and keeps
`(W·xᵀ)ᵀ` where it was at least 10 % faster. Decided per shape, the output projection (most of a pass's
products at 8-16 rows) takes the faster layout even where the small projections of the layers do not; decided over
all weights at once (session 27), 8 and 16 rows went one way or the other from one process to the next.
[`TransposedLinear`] runs the model's `nn.Linear` layers in it during the engine's passes over those row counts.

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


ROW_GRID = (1, 2, 4, 8, 16, 32)  # row counts measured; a pass's count takes the decision of the nearest (log scale)
MARGIN = 0.9  # `(W·xᵀ)ᵀ` is kept where it took at most this fraction of `x·Wᵀ`'s time: noise does not flip a tie
SHAPE_BUDGET = 128 * 2**20  # bytes of weights timed per shape (one weight at least): a large model streams more

_DECISIONS: dict[tuple, dict[str, frozenset[int]]] = {}  # per weight shapes, dtype and threads: measured once


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight · xᵀ)ᵀ`, for `x` of any leading shape; one row is multiplied
    as two (a zero row added), a matrix-matrix product rather than a matrix-vector one."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = torch.cat([rows, torch.zeros_like(rows)])
    out = torch.mm(weight, rows.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.t())
    out = out[:, :1] if single else out
    return out.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


def grid_point(rows: int) -> int | None:
    """The [`ROW_GRID`] count whose decision a pass over `rows` rows takes (nearest in log scale); `None` outside
    the grid (no rows, or more than its last count)."""
    if rows < 1 or rows > ROW_GRID[-1]:
        return None
    return min(ROW_GRID, key=lambda g: abs(math.log(g) - math.log(rows)))


def shape_key(weight: torch.Tensor) -> str:
    """`"OUTxIN"`: how a weight shape is named in the layout's decisions."""
    return "x".join(map(str, weight.shape))


class TransposedLinear:
    """While entered, the float32 CPU `nn.Linear` layers of `model` run as [`transposed_linear`] for inputs whose row
    count falls on the grid points chosen for their weight's shape, and as before for every other input (and under
    autocast, which picks its own dtype for the product).

    Args:
        model (`nn.Module`): its `nn.Linear` layers are routed.
        row_counts (`dict` or iterable): grid points of [`ROW_GRID`] per weight shape (`{"OUTxIN": rows}`,
            [`shape_key`]; a shape not named is never routed), or one collection of grid points for every shape.

    Each layer gets an instance `forward` for the duration (one Python call per layer, where a `TorchFunctionMode`
    would see every tensor operation of the pass: about 8 % of a one-token pass of the default model), removed when
    the entry that installed it exits. Entries may nest (the engine's own passes run one at a time). Layers that
    already have their own instance `forward` (accelerate's hooks) are left as they are. Another thread calling
    `model` meanwhile also gets the layout: the same products, summed in another order.
    """

    def __init__(self, model, row_counts):
        self.layers = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        ]
        if not isinstance(row_counts, dict):
            row_counts = dict.fromkeys({shape_key(m.weight) for m in self.layers}, frozenset(row_counts))
        self.row_counts = {shape: frozenset(rows) for shape, rows in row_counts.items() if rows}
        # every row count each shape's layers take, resolved once: a pass calls `_forward` once per layer
        self.routed_rows = {
            shape: frozenset(r for r in range(1, ROW_GRID[-1] + 1) if grid_point(r) in rows)
            for shape, rows in self.row_counts.items()
        }
        self.entered = []  # per entry still open, innermost last: the layers it gave a `forward`

    def _forward(self, layer, routed_rows, x):
        if (
            x.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
            and x.dim() >= 1
            and x.numel() // max(x.shape[-1], 1) in routed_rows
        ):
            return transposed_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def describe(self) -> dict[str, list[int]]:
        """The grid points routed, per weight shape (what `bench generate --json` records)."""
        return {shape: sorted(rows) for shape, rows in sorted(self.row_counts.items())}

    def __enter__(self):
        installed = []
        try:
            for layer in self.layers:
                routed_rows = self.routed_rows.get(shape_key(layer.weight))
                if routed_rows and "forward" not in layer.__dict__:
                    layer.__dict__["forward"] = functools.partial(self._forward, layer, routed_rows)
                    installed.append(layer)
        finally:  # an interrupt halfway still leaves the exit something to remove
            self.entered.append(installed)
        return self

    def __exit__(self, *exc):
        for layer in self.entered.pop():
            layer.__dict__.pop("forward", None)


def _linear_weights(model, budget: int = SHAPE_BUDGET) -> list[torch.Tensor]:
    """The float32 CPU `nn.Linear` weights of `model` in module order, each tensor once (tied ones too), up to `budget`
    bytes of each shape (one weight of a shape at least, the default model's 113 MB output projection too): what a
    pass reads, or its first layers' worth of a large model."""
    weights, seen, total = [], set(), {}
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in seen:
            continue
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
            continue
        shape = shape_key(w)
        if shape in total and total[shape] + w.nbytes > budget:
            continue
        weights.append(w)
        seen.add(id(w))
        total[shape] = total.get(shape, 0) + w.nbytes
    return weights


def transposed_row_counts(weights, repeats: int = 3) -> dict[str, frozenset[int]]:
    """Per weight shape ([`shape_key`]), the [`ROW_GRID`] counts at which `(W·xᵀ)ᵀ` took at most [`MARGIN`] of
    `x·Wᵀ`'s time over the `weights` of that shape (medians of `repeats`, the two layouts alternating); shapes where it
    never did are left out. Measured once per process for the same weight shapes, dtype and thread count."""
    weights = list(weights)
    if not weights:
        return {}
    key = (tuple(tuple(w.shape) for w in weights), weights[0].dtype, torch.get_num_threads())
    if key not in _DECISIONS:
        generator = torch.Generator().manual_seed(0)
        by_shape = {}
        for w in weights:
            by_shape.setdefault(shape_key(w), []).append(w)
        decisions = {}
        with torch.no_grad():
            for shape, group in by_shape.items():
                faster = set()
                for rows in ROW_GRID:
                    x = torch.randn(rows, group[0].shape[1], generator=generator)
                    times = {F.linear: [], transposed_linear: []}
                    for _ in range(repeats + 1):  # the first round warms up
                        for layout, measured in times.items():
                            start = time.perf_counter()
                            for w in group:
                                layout(x, w)
                            measured.append(time.perf_counter() - start)
                    transposed, plain = (statistics.median(times[f][1:]) for f in (transposed_linear, F.linear))
                    if transposed <= MARGIN * plain:
                        faster.add(rows)
                if faster:
                    decisions[shape] = frozenset(faster)
        _DECISIONS[key] = decisions
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
