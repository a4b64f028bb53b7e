"""Packed grouped-query SDPA: transformers' `sdpa` attention's output, without `repeat_kv`, only where it applies."""

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_accel.kernels import gqa_attention
from hf_accel.kernels.gqa_attention import MAX_PACKED_QUERIES, packed_gqa_attention, packed_gqa_sdpa
from tests.conftest import make_tiny_llama


class _Module:
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch=2, kv_heads=2, groups=3, queries=5, cached=11, dim=8, per_head_mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, queries, kv_heads * groups, dim, generator=g).transpose(1, 2)  # as the model makes it
    key = torch.randn(batch, kv_heads, cached, dim, generator=g)
    value = torch.randn(batch, kv_heads, cached, dim, generator=g)
    allowed = torch.rand(batch, kv_heads * groups if per_head_mask else 1, queries, cached, generator=g) < 0.7
    allowed[..., 0] = True  # every query sees something
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return query, key, value, mask


@pytest.mark.parametrize("groups,queries", [(3, 2), (3, 5), (2, 7), (4, 3)])
def test_packed_attention_equals_transformers_sdpa(groups, queries):
    query, key, value, mask = _inputs(groups=groups, queries=queries)
    module = _Module(groups)
    calls = []

    def fallback(*args, **kwargs):
        calls.append(args)
        return sdpa_attention_forward(*args, **kwargs)

    packed, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=0.3, fallback=fallback)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert not calls and packed.shape == reference.shape == (2, queries, 2 * groups, 8)
    torch.testing.assert_close(packed, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "case",
    ["one query", "no groups", "no mask", "per-head mask", "dropout", "too many queries", "softcap", "attentions"],
)
def test_everything_else_goes_to_the_replaced_function(case):
    queries = {"one query": 1, "too many queries": MAX_PACKED_QUERIES + 1}.get(case, 4)
    query, key, value, mask = _inputs(queries=queries, per_head_mask=case == "per-head mask", groups=3)
    module = _Module(1 if case == "no groups" else 3)
    if case == "no groups":
        key, value = key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1)
    kwargs = {"dropout": 0.1} if case == "dropout" else {}
    kwargs |= {"softcap": 30.0} if case == "softcap" else {}
    kwargs |= {"output_attentions": True} if case == "attentions" else {}
    calls = []
    packed_gqa_sdpa(module, query, key, value, None if case == "no mask" else mask,
                    fallback=lambda *a, **k: calls.append(k) or (None, None), **kwargs)  # fmt: skip
    assert len(calls) == 1


def test_the_registration_is_restored_after_the_last_entry_even_on_error():
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with packed_gqa_attention():
        inside = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert inside is not sdpa_attention_forward
        with packed_gqa_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is inside
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is inside  # the outer entry still runs
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with pytest.raises(RuntimeError), packed_gqa_attention():
        raise RuntimeError
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert gqa_attention._INSTALLED["count"] == 0


def test_a_users_own_sdpa_function_is_never_bypassed():
    calls = []

    def mine(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = mine
    try:
        with packed_gqa_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is mine
            query, key, value, mask = _inputs(queries=4)  # what would be packed
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Module(3), query, key, value, mask)
        assert calls == [query.shape] and ALL_ATTENTION_FUNCTIONS["sdpa"] is mine
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_a_registration_made_while_a_pass_runs_is_kept():
    def mine(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    try:
        with packed_gqa_attention():
            ALL_ATTENTION_FUNCTIONS["sdpa"] = mine
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is mine
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_only_the_thread_inside_an_engine_pass_packs(monkeypatch):
    """Another thread's model meanwhile runs transformers' own `sdpa`, untouched."""
    packed = []

    def counting(*args, **kwargs):
        packed.append(threading.get_ident())
        return packed_gqa_sdpa(*args, **kwargs)

    monkeypatch.setattr(gqa_attention, "packed_gqa_sdpa", counting)
    query, key, value, mask = _inputs(queries=4)
    inside, done = threading.Event(), threading.Event()

    def engine_pass():
        with packed_gqa_attention():
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Module(3), query, key, value, mask)
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=engine_pass)
    thread.start()
    assert inside.wait(10)
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_Module(3), query, key, value, mask)  # this thread: not in a pass
    done.set()
    thread.join()
    assert packed == [thread.ident]
    torch.testing.assert_close(out, sdpa_attention_forward(_Module(3), query, key, value, mask)[0], rtol=0, atol=0)


def test_the_engines_tree_passes_run_packed_and_plain_generate_does_not(monkeypatch):
    from hf_accel.speculative import custom_generate
    from tests.speculative.test_engine import ReferenceDrafter, _ragged_batch

    model = make_tiny_llama()  # 4 query heads on 2 KV heads
    packed = []

    def counting(module, query, *args, **kwargs):
        packed.append(query.shape[2])
        return packed_gqa_sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(gqa_attention, "packed_gqa_sdpa", counting)
    input_ids, attention_mask = _ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": False}
    reference = model.generate(**kwargs)
    assert not packed
    drafter = ReferenceDrafter(reference, depth=4, tree=True)
    assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    assert max(packed) > 1 and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_a_local_entry_of_transformers_own_sdpa_is_put_back():
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    try:
        with packed_gqa_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
        assert ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] is sdpa_attention_forward
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
