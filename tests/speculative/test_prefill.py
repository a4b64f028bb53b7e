"""The grouped prefill of a ragged batch: the split is optimal, and the filled cache is one batched prefill's."""

import contextlib
import itertools
import random

import pytest
import torch
from transformers import DynamicCache

from hf_accel.compat import CACHE_NAME
from hf_accel.speculative import custom_generate, prefill
from hf_accel.speculative.prefill import grouped_prefill, plan_prefill, prefill_groups
from tests.conftest import make_tiny_llama
from tests.speculative.test_engine import ReferenceDrafter


def _partitions(items):
    """Every set partition of `items` (brute force)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def _cost(groups, lengths, overhead):
    return sum(overhead + len(g) * max(lengths[b] for b in g) for g in groups)


@pytest.mark.parametrize("overhead", [0, 3, 32, 1000])
@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_the_cheapest_of_all_partitions(overhead, seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 5, 40, 41, 100, 300]) for _ in range(rng.randrange(1, 7))]
    groups = prefill_groups(lengths, overhead)
    assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))
    best = min(_cost(p, lengths, overhead) for p in _partitions(list(range(len(lengths)))))
    assert _cost(groups, lengths, overhead) == best


def test_ties_keep_one_group_and_a_large_overhead_never_splits():
    assert prefill_groups([7, 7, 7], 0) == [[0, 1, 2]]
    assert prefill_groups([5, 300, 10], 10_000) == [[0, 2, 1]]
    assert prefill_groups([5, 300, 10, 290], 32) == [[0, 2], [3, 1]]


def _batch(lengths, width=None, seed=0):
    width = width or max(lengths)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (len(lengths), width), generator=g)
    attention_mask = torch.zeros_like(input_ids)
    for b, length in enumerate(lengths):
        attention_mask[b, width - length :] = 1
        input_ids[b, : width - length] = 0
    return input_ids, attention_mask


def test_grouped_prefill_fills_the_cache_of_one_batched_prefill():
    model = make_tiny_llama()
    input_ids, attention_mask = _batch([40, 3, 38, 5, 40])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batched = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     **{CACHE_NAME: batched}, output_hidden_states=True)  # fmt: skip
        grouped = DynamicCache(config=model.config)
        groups = plan_prefill(model, attention_mask, position_ids, grouped)
        assert groups == [[1, 3], [2, 0, 4]]

        def forward(cache, **inputs):
            return model(**inputs, **{CACHE_NAME: cache}, output_hidden_states=True)

        logits, hidden = grouped_prefill(
            forward, groups, input_ids, attention_mask, position_ids, grouped, (0, -1), True
        )
    real = attention_mask.bool()
    torch.testing.assert_close(logits[:, -1], full.logits[:, -1])
    for layer in (0, -1):
        torch.testing.assert_close(hidden[layer][real], full.hidden_states[layer][real])
        assert not hidden[layer][~real].any()
    assert grouped.get_seq_length() == batched.get_seq_length() == input_ids.shape[1]
    for mine, theirs in zip(grouped.layers, batched.layers):
        for name in ("keys", "values"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real])
            assert not a.transpose(1, 2)[~real].any()  # padding slots: zeros, masked


def test_one_batched_pass_where_grouping_cannot_help_or_does_not_apply(monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(prefill, "PASS_OVERHEAD_TOKENS", {"cpu": 0})
    _, mask = _batch([40, 3, 38])
    cache = DynamicCache(config=model.config)
    assert plan_prefill(model, mask, None, cache) == [[1], [2], [0]]
    assert plan_prefill(model, torch.ones_like(mask), None, cache) is None  # no padding
    assert plan_prefill(model, mask[:1], None, cache) is None  # one row
    assert plan_prefill(model, None, None, cache) is None
    assert plan_prefill(model, mask.flip(-1), None, cache) is None  # padding on the right
    interior = mask.clone()
    interior[0, 5] = 0
    assert plan_prefill(model, interior, None, cache) is None  # a hole inside a prompt
    assert plan_prefill(model, mask, torch.arange(40)[None], cache) is None  # positions shared by every row

    class OwnCache(DynamicCache):
        pass

    assert plan_prefill(model, mask, None, OwnCache(config=model.config)) is None
    monkeypatch.setattr(prefill, "PASS_OVERHEAD_TOKENS", {})  # a device type without a measured overhead
    assert plan_prefill(model, mask, None, cache) is None


@contextlib.contextmanager
def _input_shapes(model):
    """The shape of `input_ids` of every forward call of `model` while entered, in order."""
    shapes = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


def test_a_ragged_batch_on_a_cpu_is_prefilled_in_groups_and_decodes_as_generate():
    """With the shipped overhead: prompts of 6 and 60 tokens run as two passes, and the text is `generate`'s."""
    model = make_tiny_llama()
    input_ids, attention_mask = _batch([60, 6, 58, 4])
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = model.generate(**kwargs)
    with _input_shapes(model) as calls:
        drafter = ReferenceDrafter(reference, depth=4, tree=True)
        out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    assert calls[:2] == [torch.Size([2, 6]), torch.Size([2, 60])]
    assert out.speculative_stats.prefill_time_s > 0


def test_dynamic_rope_ragged_batches_are_prefilled_in_one_pass(prefill):
    """Dynamic NTK RoPE sets a pass's frequencies from its largest position: prompts of 60 and 6 tokens share the
    longer one's in `generate`'s batched prefill, while a group of short prompts prefilled alone would get the
    original ones (the cached keys of the short rows differed, in review): such models keep the one batched prefill.
    (Past `max_position_embeddings` at batch > 1 the text itself may differ from plain `generate`'s: see README.)"""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = make_tiny_llama(max_position_embeddings=32, initializer_range=0.3, vocab_size=500, rope_parameters=rope)
    input_ids, attention_mask = _batch([60, 6, 58, 4])
    with _input_shapes(model) as calls:
        drafter = ReferenceDrafter(input_ids, depth=0)
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, custom_generate=custom_generate,
                       drafter=drafter)  # fmt: skip
    assert calls[0] == input_ids.shape
