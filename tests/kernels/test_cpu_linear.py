"""The GEMM layout of the engine's CPU passes (`hf_accel.kernels.cpu_linear`): same products, other orientation."""

import pytest
import torch
import torch.nn.functional as F

from hf_accel.kernels import cpu_linear
from hf_accel.kernels.cpu_linear import (
    ROW_GRID,
    TransposedLinear,
    grid_point,
    transposed_linear,
    transposed_row_counts,
    verification_layout,
)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 4, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_is_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(7, 5, generator=g)
    b = torch.randn(7, generator=g) if bias else None
    out = transposed_linear(x, w, b)
    assert out.shape == F.linear(x, w, b).shape and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(transposed_linear(x.double(), w.double()), F.linear(x.double(), w.double()))


def test_one_row_is_multiplied_as_two(monkeypatch):
    """One row goes to `torch.mm` with a zero row added (a matrix-vector product runs on one core): same values."""
    shapes = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: shapes.append(tuple(b.shape)) or real_mm(a, b))
    x, w = torch.randn(1, 1, 5), torch.randn(7, 5)
    out = transposed_linear(x, w)
    assert shapes == [(5, 2)] and out.shape == (1, 1, 7)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-6, rtol=1e-6)


def test_a_row_count_takes_the_nearest_grid_point_in_log_scale():
    assert [grid_point(r) for r in (0, 1, 2, 3, 5, 6, 11, 12, 32, 33)] == [None, 1, 2, 4, 4, 8, 8, 16, 32, None]


def test_the_layout_routes_only_float32_cpu_calls_on_its_row_counts(monkeypatch):
    routed = []

    def spy(x, weight, bias=None):
        routed.append(x.numel() // x.shape[-1])
        return cpu_linear.__dict__["_real"](x, weight, bias)

    monkeypatch.setitem(cpu_linear.__dict__, "_real", transposed_linear)
    monkeypatch.setattr(cpu_linear, "transposed_linear", spy)
    layer = torch.nn.Linear(6, 4)
    inputs = [torch.randn(rows, 6) for rows in (1, 2, 3, 5, 32, 33)]  # 3 and 5 count as 4; 1 and 2 are not chosen
    with torch.no_grad():
        expected = [F.linear(x, layer.weight, layer.bias) for x in inputs]
        with TransposedLinear(layer, {4, 32}):
            got = [layer(x) for x in inputs]
            layer(torch.ones(1, 4, 6))  # 4 rows in a 3-D input: routed
            with torch.autocast("cpu", torch.bfloat16):  # autocast picks the product's dtype: not routed
                assert layer(torch.ones(4, 6)).dtype == torch.bfloat16
        layer(torch.ones(4, 6))  # after the exit: not routed
        assert "forward" not in layer.__dict__
        with TransposedLinear(layer.double(), {4}):  # float64 weights: not routed
            layer(torch.ones(4, 6, dtype=torch.float64))
        hooked = torch.nn.Linear(6, 4)
        hooked.forward = lambda x: torch.zeros(x.shape[0], 4)  # an instance forward of its own (accelerate's hooks)
        layout = TransposedLinear(hooked, {4})
        with layout:
            assert not hooked(torch.ones(4, 6)).any()
        assert hooked.__dict__["forward"] is not None and not layout.entered
        first, other = torch.nn.Linear(6, 4), torch.nn.Linear(6, 5)  # each routed by its own shape's counts
        model = torch.nn.Sequential(first, other)
        layout = TransposedLinear(model, {"4x6": {1}, "5x6": {2}, "9x9": {4}})
        assert layout.describe() == {"4x6": [1], "5x6": [2], "9x9": [4]}
        with layout:
            first(torch.ones(1, 6)), first(torch.ones(2, 6)), other(torch.ones(1, 6)), other(torch.ones(2, 6))
        with TransposedLinear(model, {"5x6": {2}}):  # a shape not named is never routed
            assert "forward" not in first.__dict__ and "forward" in other.__dict__
        # one collection for every shape, even an iterator (read once, not used up by the first shape)
        assert TransposedLinear(model, iter((1, 2))).describe() == {"4x6": [1, 2], "5x6": [1, 2]}
    assert routed == [3, 5, 32, 4, 1, 2]
    for out, ref in zip(got, expected):
        torch.testing.assert_close(out, ref)


def test_entries_nest_and_the_one_that_installed_the_layout_removes_it():
    layer = torch.nn.Linear(6, 4)
    layout = TransposedLinear(layer, {4})
    with layout:
        with layout:  # nested: the layers already have the layout's forward
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__  # the inner exit removed nothing
        with TransposedLinear(layer, {2}):
            pass
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__ and not layout.entered


def test_the_timed_weights_are_each_tensor_once_up_to_a_budget_per_shape():
    from hf_accel.kernels.cpu_linear import _linear_weights

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 16))
    model[2].weight = model[0].weight  # tied
    model.append(torch.nn.Linear(8, 4).double())
    model.append(torch.nn.Linear(8, 16))
    model.append(torch.nn.Linear(16, 8))
    assert [tuple(w.shape) for w in _linear_weights(model)] == [(16, 8), (8, 16), (16, 8), (8, 16)]
    # the budget is per shape: one 16x8 weight fits, and one 8x16 one
    assert [tuple(w.shape) for w in _linear_weights(model, budget=16 * 8 * 4)] == [(16, 8), (8, 16)]
    assert len(_linear_weights(model, budget=1)) == 2  # one of each shape at least


def test_the_layouts_are_measured_once_per_weight_shapes(monkeypatch):
    weights = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(48, 16)]
    monkeypatch.setattr(cpu_linear, "_DECISIONS", {})
    first = transposed_row_counts(weights)
    assert set(first) <= {"48x16", "16x48"} and all(rows and rows <= set(ROW_GRID) for rows in first.values())
    calls = []
    monkeypatch.setattr(cpu_linear, "transposed_linear", lambda *a: calls.append(a))
    assert transposed_row_counts([torch.zeros(48, 16), torch.zeros(16, 48), torch.zeros(48, 16)]) is first
    assert not calls
    assert transposed_row_counts([]) == {}


def test_each_shape_keeps_the_counts_where_its_own_weights_were_faster_transposed(monkeypatch):
    """A fake clock: `(W·xᵀ)ᵀ` is faster for the 48x16 weights at 1 and 8 rows only, for 16x48 nowhere."""
    now = [0.0]
    monkeypatch.setattr(cpu_linear.time, "perf_counter", lambda: now[0])

    def timed(seconds_of):
        def layout(x, w, bias=None):
            now[0] += seconds_of(x.shape[0], tuple(w.shape))

        return layout

    plain = timed(lambda rows, shape: 1.0)
    monkeypatch.setattr(cpu_linear.F, "linear", plain)
    monkeypatch.setattr(
        cpu_linear,
        "transposed_linear",
        timed(lambda rows, shape: 0.5 if shape == (48, 16) and rows in (1, 8) else 0.95),
    )
    monkeypatch.setattr(cpu_linear, "_DECISIONS", {})
    assert transposed_row_counts([torch.zeros(48, 16), torch.zeros(16, 48)]) == {"48x16": {1, 8}}


def test_the_layout_leaves_float64_and_compiled_models_alone(tiny_llama, monkeypatch):
    monkeypatch.setattr(
        cpu_linear, "transposed_row_counts", lambda weights: {cpu_linear.shape_key(w): ROW_GRID for w in weights}
    )
    layout = verification_layout(tiny_llama)
    assert isinstance(layout, TransposedLinear) and set(layout.row_counts.values()) == {frozenset(ROW_GRID)}
    assert len(layout.layers) == sum(type(m) is torch.nn.Linear for m in tiny_llama.modules())
    assert verification_layout(torch.nn.Module()) is None  # no parameters
    assert verification_layout(torch.nn.Linear(2, 2).double()) is None
    assert verification_layout(torch.compile(torch.nn.Linear(2, 2))) is None
    compiled_in_place = torch.nn.Linear(2, 2)
    compiled_in_place.compile()
    assert verification_layout(compiled_in_place) is None
    monkeypatch.setattr(cpu_linear, "transposed_row_counts", lambda weights: {})
    assert verification_layout(tiny_llama) is None  # x·Wᵀ won everywhere
