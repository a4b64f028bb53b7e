import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.compress.ranks import (
    budget_from_kv_keep,
    relative_energy_gains,
    uniform_ranks,
    water_fill,
    water_fill_greedy,
)


def _brute_force(gains, budget, caps, floors):
    best, best_value = None, -float("inf")
    for ranks in itertools.product(*[range(f, c + 1) for f, c in zip(floors, caps)]):
        if sum(ranks) != budget:
            continue
        value = sum(float(g[:r].sum()) for g, r in zip(gains, ranks))
        if value > best_value + 1e-12:
            best, best_value = list(ranks), value
    return best, best_value


gain_lists = st.lists(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(gain_lists, st.data())
def test_water_fill_is_optimal_and_equals_greedy(raw, data):
    gains = [torch.tensor(sorted(g, reverse=True), dtype=torch.float64) for g in raw]
    caps = [data.draw(st.integers(1, len(g))) for g in gains]
    floors = [data.draw(st.integers(0, c)) for c in caps]
    budget = data.draw(st.integers(sum(floors), sum(caps)))
    ranks = water_fill(gains, budget, caps, floors)
    assert sum(ranks) == budget
    assert all(f <= r <= c for r, f, c in zip(ranks, floors, caps))
    assert ranks == water_fill_greedy(gains, budget, caps, floors)
    _, best_value = _brute_force(gains, budget, caps, floors)
    assert sum(float(g[:r].sum()) for g, r in zip(gains, ranks)) == pytest.approx(best_value, abs=1e-9)


def test_water_fill_matches_sorted_closed_form_of_the_spec():
    """Spec Stage 4: take the top `B − 2L` of all σ with m ≥ 2; r = 1 + count (caps automatically respected)."""
    g = torch.Generator().manual_seed(0)
    sigmas = [torch.sort(torch.rand(8, generator=g, dtype=torch.float64), descending=True).values for _ in range(6)]
    budget = 20
    pool = sorted(((float(s[m]), i) for i, s in enumerate(sigmas) for m in range(1, len(s))), reverse=True)
    expected = [1] * 6
    for _, i in pool[: budget - 6]:
        expected[i] += 1
    assert water_fill(sigmas, budget) == expected


def test_tie_break_is_lower_matrix_then_lower_rank():
    gains = [torch.ones(4, dtype=torch.float64) for _ in range(3)]
    assert water_fill(gains, 5, floors=0) == [4, 1, 0]
    assert water_fill(gains, 5, caps=[2, 4, 4], floors=0) == [2, 3, 0]


def test_water_fill_rejects_infeasible_budget():
    gains = [torch.ones(3), torch.ones(3)]
    with pytest.raises(ValueError, match="budget"):
        water_fill(gains, 7)
    with pytest.raises(ValueError, match="budget"):
        water_fill(gains, 1)  # below the floors (1 each)
    for fill in (water_fill, water_fill_greedy):  # a caps or floors list that misses a matrix used to drop it
        with pytest.raises(ValueError, match="zip"):
            fill(gains, 3, caps=[3])
        with pytest.raises(ValueError, match="zip"):
            fill(gains, 3, floors=[1])


@pytest.mark.parametrize("kv_keep", [0.0, -0.1, 1.5, float("nan"), True])
def test_kv_keep_outside_unit_interval_is_an_error(kv_keep):
    with pytest.raises(ValueError, match="kv_keep"):
        budget_from_kv_keep([4, 4], kv_keep)


def test_uniform_and_budget():
    assert uniform_ranks([192, 192], 0.5) == [96, 96]
    assert uniform_ranks([10, 10], 0.01) == [1, 1]
    assert budget_from_kv_keep([192] * 4, 0.25) == 192


def test_relative_energy_is_per_matrix_fraction():
    gains = relative_energy_gains([torch.tensor([3.0, 1.0]), torch.tensor([30.0, 10.0])])
    assert torch.allclose(gains[0], gains[1]) and torch.allclose(
        gains[0].sum(), torch.tensor(1.0, dtype=torch.float64)
    )


def test_budget_rounds_to_nearest_and_keeps_one_rank_per_matrix():
    assert budget_from_kv_keep([10, 10, 10], 0.49) == 15  # 14.7 rounds up, not down
    assert budget_from_kv_keep([10, 10, 10, 10], 0.01) == 4  # 0.4 would leave matrices without a rank


def test_uniform_ranks_stop_at_the_cap():
    # a [32, 64] projection has rank 32: kv_keep 1.0 of its width is its cap
    assert uniform_ranks([64, 64], 1.0, caps=[32, 64]) == [32, 64]


def test_water_fill_clips_caps_and_floors():
    gains = [torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    assert water_fill(gains, 5, caps=[4, 4]) == [2, 3]  # a cap above the matrix's rank is its rank
    assert water_fill(gains, 5, caps=[2, 3], floors=[3, 3]) == [2, 3]  # a floor above the cap is the cap


def test_water_fill_separates_gains_closer_than_float32():
    gains = [torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0 + 1e-12], dtype=torch.float64)]
    assert water_fill(gains, 1, floors=0) == [0, 1]


def test_tie_break_holds_for_many_equal_gains():
    gains = [torch.ones(64, dtype=torch.float64) for _ in range(8)]
    assert water_fill(gains, 100, floors=0) == [64, 36, 0, 0, 0, 0, 0, 0]


def test_relative_energy_values():
    gains = relative_energy_gains([torch.tensor([3.0, 1.0])])
    torch.testing.assert_close(gains[0], torch.tensor([0.9, 0.1], dtype=torch.float64))
