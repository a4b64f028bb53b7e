"""Equivalence invariants of the verification engine on tiny random Llamas: greedy output == plain `generate`."""

import copy
import functools
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_accel.compat import CACHE_NAME
from hf_accel.speculative import DraftTree, assisted_generate, custom_generate
from hf_accel.speculative.drafters.infinigram import node_depths
from tests.conftest import TINY_CONFIG, make_tiny_llama


class ReferenceDrafter:
    """Drafts from a known continuation (`reference[row]`), as a chain or a tree with wrong siblings mixed in."""

    def __init__(self, reference, depth=4, tree=False, corrupt_every=3, seed=0):
        self.reference, self.depth, self.tree, self.corrupt_every = reference, depth, tree, corrupt_every
        self.rng = random.Random(seed)
        self.results = []

    def propose(self, request):
        trees = []
        for b in range(len(request.rows)):
            row, length = int(request.rows[b]), int(request.lengths[b])
            chain = self.reference[row, length : length + self.depth].tolist()
            if self.corrupt_every and chain and self.rng.randrange(self.corrupt_every) == 0:
                chain[self.rng.randrange(len(chain))] = self.rng.randrange(3, 97)
            tokens, parents = list(chain), list(range(-1, len(chain) - 1))
            if self.tree:  # a wrong sibling at every depth, and a wrong child under it
                for d in range(len(chain)):
                    tokens += [self.rng.randrange(3, 97), self.rng.randrange(3, 97)]
                    parents += [d - 1, len(tokens) - 2]
            trees.append((tokens, parents))
        return DraftTree.from_parent_lists(trees)

    def update(self, result):
        self.results.append(result)


class RandomTreeDrafter:
    """Hypothesis-drawn trees of up to `max_nodes` nodes per row, each node the reference's token at its depth or a
    random one."""

    def __init__(self, data, reference, max_nodes: int = 10):
        self.data, self.reference, self.max_nodes = data, reference, max_nodes

    def propose(self, request):
        draw, trees = self.data.draw, []
        for b in range(len(request.rows)):
            row, length = int(request.rows[b]), int(request.lengths[b])
            parents = [draw(st.integers(-1, i - 1)) for i in range(draw(st.integers(0, self.max_nodes)))]
            tokens = []
            for depth in node_depths(parents):
                good = self.reference[row, length + depth - 1] if length + depth - 1 < self.reference.shape[1] else 5
                tokens.append(int(good) if draw(st.booleans()) else draw(st.integers(0, 96)))
            trees.append((tokens, parents))
        return DraftTree.from_parent_lists(trees)


def _ragged_batch(batch_size=4, width=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (batch_size, width), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for b in range(batch_size):
        pad = (b * 3) % (width - 2)
        attention_mask[b, :pad] = 0
        input_ids[b, :pad] = 0
    return input_ids, attention_mask


@pytest.fixture(params=["linear", "transposed"])
def layout(request, monkeypatch):
    """Both GEMM layouts of the engine's passes, whichever this machine measures faster (`kernels.cpu_linear`)."""
    from hf_accel.kernels.cpu_linear import ROW_GRID, TransposedLinear
    from hf_accel.speculative import engine

    chosen = (lambda model: TransposedLinear(model, ROW_GRID)) if request.param == "transposed" else (lambda m: None)
    monkeypatch.setattr(engine, "verification_layout", chosen)
    return request.param


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_identity_chain_and_tree(tiny_llama, tree, batch_size, layout, prefill):
    input_ids, attention_mask = _ragged_batch(batch_size)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 24, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    drafter = ReferenceDrafter(reference, depth=5, tree=tree)
    out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    stats = out.speculative_stats
    assert stats.mean_accepted > 1.5 and stats.target_forward_passes < 24
    assert drafter.last_stats is stats


def test_per_call_statistics_count_passes_and_tokens_bonus_included(tiny_llama):
    """Issue 6's per-call record, by hand: every draft of 4 is accepted, so after the prefill's token each pass
    commits 5 (the bonus token counts, B.11 item 7: a pass without a draft commits 1), and the prefill is a pass."""
    input_ids, attention_mask = _ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 21, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    drafted = tiny_llama.generate(
        **kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference, 4, corrupt_every=0)
    )
    stats = drafted.speculative_stats.to_dict()
    assert stats["accepted_histogram"] == {"5": 3 * 4} and stats["mean_accepted"] == 5.0
    assert stats["target_forward_passes"] == 1 + 4 and stats["new_tokens"] == 3 * 21 and stats["draft_nodes"] == 48
    assert stats["drafter_time_s"] > 0 and stats["total_time_s"] >= stats["verify_time_s"] > 0
    plain = tiny_llama.generate(
        **kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference, 0, corrupt_every=0)
    )
    stats = plain.speculative_stats.to_dict()
    assert stats["accepted_histogram"] == {"1": 3 * 20} and stats["mean_accepted"] == 1.0
    assert stats["target_forward_passes"] == 21 and stats["draft_nodes"] == 0
    assert torch.equal(drafted, reference) and torch.equal(plain, reference)


def test_a_drafters_update_counts_as_drafter_time(tiny_llama):
    """CP heads and SpecFormer draft in `update`, from the pass's hidden states: that time is the drafter's, not the
    verification's (`scripts/generate_time_split.py` reported it as engine overhead). Each update here takes 20 ms."""
    input_ids, attention_mask = _ragged_batch(2)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 6, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)

    class SlowUpdate(ReferenceDrafter):
        def update(self, result):
            time.sleep(0.02)
            super().update(result)

    drafter = SlowUpdate(reference)
    stats = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter).speculative_stats
    assert stats.drafter_time_s >= 0.02 * len(drafter.results)
    assert stats.total_time_s >= stats.drafter_time_s + stats.verify_time_s and stats.verify_time_s > 0


def test_eos_mid_draft_and_rows_finishing_at_different_times(prefill):
    model = make_tiny_llama()
    input_ids, attention_mask = _ragged_batch(4, seed=3)
    free = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    eos = int(free[0, input_ids.shape[1] + 5])  # a token row 0 emits mid-way
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 20, "do_sample": False,
                  "eos_token_id": eos, "pad_token_id": 0}  # fmt: skip
    reference = model.generate(**kwargs)
    # Draft the EOS-free continuation 8 tokens deep: drafts run past EOS and must be cut there.
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(free, 8, corrupt_every=0))
    assert torch.equal(out, reference)


def test_finished_rows_leave_right_after_the_update_that_reports_them():
    """The protocol's promise to drafters that keep per-row state (CP heads' last hidden state, PPD's guesses,
    SpecFormer's history): after an update, the next request and result hold exactly the rows not finished yet, in
    the same order, named by their original batch index."""
    model = make_tiny_llama()
    input_ids, attention_mask = _ragged_batch(4, seed=3)
    free = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 20, "do_sample": False,
              "eos_token_id": int(free[0, input_ids.shape[1] + 5]), "pad_token_id": 0}  # fmt: skip
    reference = model.generate(**kwargs)

    class RowKeeper(ReferenceDrafter):
        def propose(self, request):
            assert request.rows.tolist() == self.remaining
            self.seen.append(len(self.remaining))
            return super().propose(request)

        def update(self, result):
            assert self.remaining is None or result.rows.tolist() == self.remaining
            self.remaining = [row for row, done in zip(result.rows.tolist(), result.finished.tolist()) if not done]
            super().update(result)

    drafter = RowKeeper(free, depth=4)
    drafter.remaining, drafter.seen = None, []
    assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    assert drafter.remaining == [] and len(set(drafter.seen)) > 2  # rows left at different passes


def test_max_new_tokens_and_max_length_mid_draft(tiny_llama):
    input_ids, attention_mask = _ragged_batch(2)
    for limit in ({"max_new_tokens": 5}, {"max_length": input_ids.shape[1] + 3}):
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **limit)
        reference = tiny_llama.generate(**kwargs)
        long_reference = tiny_llama.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16)
        drafter = ReferenceDrafter(long_reference, depth=8, corrupt_every=0)
        out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(out, reference)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_trees_never_change_greedy_output(tiny_llama, data, layout, prefill):
    input_ids, attention_mask = _ragged_batch(data.draw(st.integers(1, 3)), seed=data.draw(st.integers(0, 5)))
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)

    out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=RandomTreeDrafter(data, reference))
    assert torch.equal(out, reference)


class _ContextFreeProbe:
    """Stochastic drafter with draft probabilities: two i.i.d. siblings from q, one child under the first."""

    def __init__(self, vocab, stochastic):
        self.vocab, self.stochastic = vocab, stochastic
        self.q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(7)), -1)

    def propose(self, request):
        batch_size = len(request.rows)
        if self.stochastic:
            tokens = torch.multinomial(self.q.expand(batch_size, -1), 3, replacement=True)
            probs = self.q.expand(batch_size, 3, -1).clone()
        else:  # deterministic point-mass drafts
            tokens, probs = torch.tensor([[4, 9, 4]]).expand(batch_size, -1), None
        return DraftTree(tokens, torch.tensor([[-1, -1, 0]]).expand(batch_size, -1), draft_probs=probs)


@pytest.mark.parametrize("stochastic", [False, True])
def test_sampling_keeps_target_distribution(stochastic):
    """3000 rows in one call; the first two sampled tokens (the second one verified): joint law vs the exact law."""
    model = make_tiny_llama(seed=1, vocab_size=12)
    prompt = torch.tensor([[3, 5, 7]])
    temperature, top_k = 0.9, 4
    with torch.no_grad():  # exact law of (t1, t2) under temperature + top-k

        def law(ids):
            logits = model(ids).logits[0, -1] / temperature
            logits[logits < logits.topk(top_k).values[-1]] = -float("inf")
            return torch.softmax(logits, -1)

        eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id

        def next_law(ids):  # after EOS, padding
            return torch.nn.functional.one_hot(torch.tensor(pad), 12).float() if eos in ids[0, 3:] else law(ids)

        p1 = law(prompt)
        joint = torch.stack([p1[a] * next_law(torch.cat([prompt, torch.tensor([[a]])], 1)) for a in range(12)])
        # the third token's marginal: it follows the depth-2 node when both draft levels are accepted
        third = sum(
            joint[a, b] * next_law(torch.cat([prompt, torch.tensor([[a, b]])], 1))
            for a in range(12)
            for b in range(12)
        )
    n = 3000
    torch.manual_seed(0)
    out = model.generate(
        prompt.expand(n, -1), max_new_tokens=4, do_sample=True, temperature=temperature, top_k=top_k,
        custom_generate=custom_generate, drafter=_ContextFreeProbe(12, stochastic),
    )  # fmt: skip
    counts = torch.zeros(12, 12)
    for a, b in out[:, 3:5].tolist():
        counts[a, b] += 1
    tv = 0.5 * (counts / n - joint).abs().sum()
    assert tv < 0.07, tv  # sampling noise for ~16 outcomes at n=3000 is ~0.03
    tv_third = 0.5 * (torch.bincount(out[:, 5], minlength=12) / n - third).abs().sum()
    assert tv_third < 0.05, tv_third  # ~4 likely outcomes: noise ~0.02
    assert out.speculative_stats.mean_accepted > 1.0


def test_draft_probabilities_over_a_smaller_vocabulary_are_padded():
    """A draft model whose vocabulary is a prefix of the target's (an embedding padded to a multiple) drafts with
    zero probability on the extra ids; a larger one is refused in one line (it was a `torch.cat` size error)."""
    model = make_tiny_llama(seed=1, vocab_size=12)

    class Padded(_ContextFreeProbe):
        def __init__(self, vocab, pad):
            super().__init__(vocab, stochastic=True)
            self.pad = pad

        def propose(self, request):
            tree = super().propose(request)
            probs = torch.nn.functional.pad(tree.draft_probs, (0, self.pad))
            return DraftTree(tree.input_ids, tree.parent, draft_probs=probs)

    outs = []
    for drafter in (_ContextFreeProbe(10, stochastic=True), Padded(10, pad=2)):
        torch.manual_seed(0)
        outs.append(model.generate(torch.tensor([[3, 5, 7]] * 4), max_new_tokens=6, do_sample=True,
                                   custom_generate=custom_generate, drafter=drafter))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="cover 14 token ids, the target's logits only 12"):
        model.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=6, do_sample=True, custom_generate=custom_generate,
                       drafter=Padded(12, pad=2))  # fmt: skip


def test_sampling_is_reproducible_with_seed(tiny_llama):
    input_ids, attention_mask = _ragged_batch(2)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": True,
                  "temperature": 0.7, "custom_generate": custom_generate}  # fmt: skip
    reference = tiny_llama.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(tiny_llama.generate(**kwargs, drafter=ReferenceDrafter(reference)))
    assert torch.equal(outs[0], outs[1])


def test_seeded_sampled_text_does_not_depend_on_the_draft_trees(tiny_llama):
    """Sampling draws per output position: with deterministic drafts, a seeded run gives the same text whatever the
    drafter proposes (nothing, random trees, trees that hold the text), hence whatever the drafter learned or timed."""
    input_ids, attention_mask = _ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": True,
              "temperature": 0.8, "custom_generate": custom_generate}  # fmt: skip

    class NoDraft:
        def propose(self, request):
            return None

    torch.manual_seed(5)
    reference = tiny_llama.generate(**kwargs, drafter=NoDraft())
    for drafter in (ReferenceDrafter(reference, tree=False), ReferenceDrafter(reference, tree=True, seed=3)):
        torch.manual_seed(5)
        out = tiny_llama.generate(**kwargs, drafter=drafter)
        assert torch.equal(out, reference)
        assert out.speculative_stats.mean_accepted > 1.5  # the drafts were used


@pytest.mark.parametrize("pad", [0, 3])
def test_seeded_sampled_text_of_the_assisted_loop_does_not_depend_on_the_drafts(tiny_llama, pad):
    """transformers' assisted loop sampled every candidate position from torch's generator at once, so the randomness a
    pass used depended on how long the draft was, which the ngram drafter sizes from measured pass times: the same seed
    gave another text on most runs. It now samples per output position, as hf-accel's loop does: the same text."""
    input_ids = torch.tensor([[0] * pad + [5, 6, 7, 8] * 3 + [5, 6]])
    kwargs = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "max_new_tokens": 24,
              "do_sample": True, "temperature": 0.9}  # fmt: skip
    reference = ReferenceDrafter(tiny_llama.generate(input_ids, max_new_tokens=24), corrupt_every=0)

    class NoDraft:
        def propose(self, request):
            return None

    torch.manual_seed(11)
    expected = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=NoDraft())
    for drafter in (NoDraft(), ReferenceDrafter(expected, depth=3), ReferenceDrafter(expected, depth=6), reference):
        torch.manual_seed(11)
        out = tiny_llama.generate(**kwargs, custom_generate=assisted_generate, drafter=drafter)
        assert torch.equal(out, expected)


def test_sampled_assisted_scores_keep_the_sampled_tokens_log_probabilities(tiny_llama):
    """With `output_scores`, each step's scores are `-inf` but at the sampled token, which keeps its log-probability
    under the processed distribution (temperature 0.9 here), so `compute_transition_scores` gives exactly that."""
    input_ids = torch.tensor([[5, 6, 7, 8] * 3 + [5, 6]])
    torch.manual_seed(3)
    out = tiny_llama.generate(
        input_ids, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=0, custom_generate=assisted_generate,
        drafter=ReferenceDrafter(tiny_llama.generate(input_ids, max_new_tokens=10), corrupt_every=0),
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    new = out.sequences[0, input_ids.shape[1] :]
    with torch.no_grad():
        logits = tiny_llama(out.sequences[:, :-1]).logits[0, input_ids.shape[1] - 1 :].float()
    expected = torch.log_softmax(logits / 0.9, -1).gather(1, new[:, None])[:, 0]
    scores = torch.cat(out.scores)
    assert (scores.isfinite().sum(-1) == 1).all() and torch.equal(scores.argmax(-1), new)
    transition = tiny_llama.compute_transition_scores(out.sequences, out.scores)[0]
    torch.testing.assert_close(transition, expected, atol=1e-4, rtol=1e-4)


class CollectingStreamer:
    """A streamer that keeps what it is given: every token in order, each `put`'s shape, and how often it ended."""

    def __init__(self):
        self.tokens, self.shapes, self.ends = [], [], 0

    def put(self, value):
        self.tokens += value.flatten().tolist()
        self.shapes.append(tuple(value.shape))

    def end(self):
        self.ends += 1


def test_streamer_receives_exactly_the_output(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=12, do_sample=False)
    streamer = CollectingStreamer()
    out = tiny_llama.generate(input_ids, max_new_tokens=12, streamer=streamer, custom_generate=custom_generate,
                              drafter=ReferenceDrafter(reference))  # fmt: skip
    assert streamer.ends == 1 and streamer.tokens == out[0].tolist() == reference[0].tolist()
    # several tokens of one row come as `[1, n]`, as transformers' assisted loop puts them: a 1-D tensor is one token
    # per row in `generate`'s own loop, so a batch-aware streamer read `[n]` as n rows
    assert all(len(shape) == 2 and shape[0] == 1 for shape in streamer.shapes[1:])
    assert any(shape[1] > 1 for shape in streamer.shapes[1:])


def test_streaming_a_batch_is_refused_in_one_line(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]] * 2)
    reference = tiny_llama.generate(input_ids, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match=r"^streaming supports batch size 1, got 2; drop `streamer=` or the batch$"):
        tiny_llama.generate(input_ids, max_new_tokens=4, streamer=CollectingStreamer(), custom_generate=custom_generate,
                            drafter=ReferenceDrafter(reference))  # fmt: skip


def test_the_streamer_is_found_in_the_frame_of_generate_only():
    """transformers feeds a callable `custom_generate` no `streamer`: it is read from the enclosing `generate` frame,
    one that also holds `custom_generate` (not a user's own `generate` wrapper with a streamer of its own)."""
    from hf_accel.speculative.generate import _generate_argument

    assert _generate_argument("streamer") is None  # no enclosing `generate`: a direct call

    def generate(streamer, custom_generate=None):  # as `GenerationMixin.generate`'s frame
        return _generate_argument("streamer")

    assert generate("the call's streamer") == "the call's streamer"

    def generate(streamer):  # another function of that name
        return _generate_argument("streamer")

    assert generate("a wrapper's streamer") is None


def test_return_dict_in_generate_gives_the_sequences_and_the_statistics(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    plain = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    drafter = ReferenceDrafter(plain.sequences, corrupt_every=0)
    out = tiny_llama.generate(input_ids, max_new_tokens=8, return_dict_in_generate=True,
                              custom_generate=custom_generate, drafter=drafter)  # fmt: skip
    assert type(out) is type(plain) and torch.equal(out.sequences, plain.sequences)
    assert out.past_key_values is None  # the engine's cache is not the one plain `generate` returns (docstring)
    assert out.speculative_stats is drafter.last_stats and out.speculative_stats.new_tokens == 8


def test_a_direct_call_with_synced_gpus_is_refused_in_one_line(tiny_llama):
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    input_ids = torch.tensor([[5, 6, 7, 8]])
    args = (LogitsProcessorList(), StoppingCriteriaList(), GenerationConfig(max_length=8))
    with pytest.raises(
        ValueError, match=r"^speculative decoding does not support `synced_gpus=True` \(a model sharded"
    ):
        custom_generate(tiny_llama, input_ids, *args, synced_gpus=True, drafter=ReferenceDrafter(input_ids))


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_a_direct_call_without_what_generate_prepares_is_one_line(tiny_llama, loop):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(TypeError, match=rf"^{loop.__name__} runs inside `model.generate\(\.\.\., custom_generate="):
        loop(tiny_llama, input_ids, drafter=ReferenceDrafter(input_ids))


@pytest.mark.parametrize("passed", [None, True, False])
def test_synced_gpus_is_decided_as_generate_decides_it(tiny_llama, monkeypatch, passed):
    """`generate` drops `synced_gpus` for a callable `custom_generate`, the value it computes for a model sharded by
    DeepSpeed ZeRO-3 across processes included: the loop decides it as `generate` does, and refuses it, instead of
    letting processes that finish at different passes hang."""
    from transformers.integrations import deepspeed

    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    plain = tiny_llama.generate(input_ids, max_new_tokens=4, do_sample=False, synced_gpus=False)
    call = functools.partial(tiny_llama.generate, input_ids, max_new_tokens=4, custom_generate=custom_generate,
                             drafter=ReferenceDrafter(plain))  # fmt: skip
    if passed is False:  # the caller's explicit value wins, as in `generate`
        assert torch.equal(call(synced_gpus=False), plain)
        return
    with pytest.raises(ValueError, match=r"^speculative decoding does not support `synced_gpus=True`"):
        call() if passed is None else call(synced_gpus=True)


def test_chain_drafter_in_transformers_assisted_loop(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=16, do_sample=False)
    out = tiny_llama.generate(input_ids, max_new_tokens=16, custom_generate=assisted_generate,
                              drafter=ReferenceDrafter(reference, depth=4))  # fmt: skip
    assert torch.equal(out, reference)


def test_the_candidate_generator_drafts_the_first_chain_of_a_tree_and_refuses_batches():
    """Used alone (no stopping criteria, no padding mask: its defaults), the adapter drafts the chain under the root's
    first child, past its siblings and padding nodes; transformers' loop runs one row, so a batch is refused."""
    from transformers import GenerationConfig

    from hf_accel.speculative.generate import DrafterCandidateGenerator

    class Fixed:
        def propose(self, request):
            return tree

    # node 0 under the root, 1 its sibling, 2 under 0, 3 under 1, 4 (padding) and 5 under 2
    tree = DraftTree.from_parent_lists([([11, 12, 13, 14, 15, 16], [-1, -1, 0, 1, 2, 2])])
    tree.node_mask[0, 4] = False
    generator = DrafterCandidateGenerator(Fixed(), GenerationConfig(max_length=20), prompt_length=4)
    candidates, logits = generator.get_candidates(torch.tensor([[5, 6, 7, 8]]))
    assert candidates.tolist() == [[5, 6, 7, 8, 11, 13, 16]] and logits is None
    message = r"^transformers' assisted loop supports batch size 1; use `custom_generate` for batches$"
    with pytest.raises(ValueError, match=message):
        generator.get_candidates(torch.tensor([[5, 6, 7, 8]] * 2))


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_begin_gets_the_prompt_and_its_padding_mask_before_anything_else(tiny_llama, loop):
    """The protocol's `begin(input_ids, attention_mask, generation_config)`, once per call before the prefill, in both
    loops alike: transformers' assisted loop was handed an all-ones mask, and requests whose context held the left
    padding, so a drafter took pad tokens for the prompt's."""
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8]])
    attention_mask = (input_ids != 0).long()
    reference = tiny_llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)

    class Recording(ReferenceDrafter):
        begun, contexts = [], []

        def begin(self, input_ids, attention_mask, generation_config):
            assert not self.results and not self.contexts  # before the prefill and every proposal
            self.begun.append((input_ids.tolist(), attention_mask.tolist(), generation_config.max_length))

        def propose(self, request):
            self.contexts.append(request.context(0).tolist())
            return super().propose(request)

    drafter = Recording(reference, corrupt_every=0)
    out = tiny_llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, custom_generate=loop,
                              drafter=drafter)  # fmt: skip
    assert torch.equal(out, reference)
    assert drafter.begun == [([[0, 0, 5, 6, 7, 8]], [[0, 0, 1, 1, 1, 1]], 14)]
    assert drafter.contexts and all(context[:4] == [5, 6, 7, 8] for context in drafter.contexts)


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_a_stop_point_inside_an_accepted_draft_ends_the_text_and_the_stream_there(tiny_llama, loop):
    """A criterion that looks at the text's end, as a stop string does (`StopStringCriteria`, the way stop strings
    reach a callable `custom_generate`): transformers' assisted loop asks it once per pass, after every accepted token,
    so a stop point inside an accepted draft was never seen and decoding went on to `max_new_tokens`."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class EndsWith(StoppingCriteria):
        def __init__(self, tokens):
            self.tokens = tokens

        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([row[-len(self.tokens) :].tolist() == self.tokens for row in input_ids])

    input_ids = torch.tensor([[5, 6, 7, 8]])
    free = tiny_llama.generate(input_ids, max_new_tokens=24, do_sample=False)
    kwargs = {
        "max_new_tokens": 24,
        "do_sample": False,
        "stopping_criteria": StoppingCriteriaList([EndsWith(free[0, 12:14].tolist())]),
    }
    reference = tiny_llama.generate(input_ids, **kwargs)
    assert reference.shape[1] <= 14  # plain `generate` stops at the pattern's first occurrence
    for depth in (3, 8, 12):
        streamer = CollectingStreamer()
        out = tiny_llama.generate(input_ids, **kwargs, custom_generate=loop, streamer=streamer,
                                  drafter=ReferenceDrafter(free, depth=depth, corrupt_every=0))  # fmt: skip
        assert torch.equal(out, reference)
        assert streamer.tokens == reference[0].tolist() and streamer.ends == 1


def test_transformers_assisted_loop_refuses_drafters_that_read_the_pass_in_one_line(tiny_llama):
    """transformers' assisted loop hands a drafter neither hidden states (CP heads, SpecFormer) nor the logits of
    auxiliary inputs (PPD): such a drafter failed with a KeyError of its own, or PPD's prompt tokens were dropped."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False)

    class NeedsHidden(ReferenceDrafter):
        requires_hidden_states = (-1,)

    class Auxiliary(ReferenceDrafter):
        def propose(self, request):
            tree = super().propose(request)
            tree.aux_embeds, tree.aux_parent = torch.zeros(1, 1, 32), torch.tensor([[-1]])
            return tree

    class PrefillAuxiliary(ReferenceDrafter):  # PPD's prompt tokens in the prefill: its first guesses come from them
        def propose_prefill(self, request):
            return _aux_only(torch.zeros(1, 1, 32), torch.tensor([[-1]]))

    drafters = {"hidden states": NeedsHidden(reference), "auxiliary inputs": Auxiliary(reference),
                "prefill": PrefillAuxiliary(reference)}  # fmt: skip
    for reason, drafter in drafters.items():
        with pytest.raises(ValueError, match=f"{reason}.*use `custom_generate`"):
            tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=assisted_generate, drafter=drafter)


def test_a_drafter_name_instead_of_a_drafter_is_refused_in_one_line(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    for loop in (custom_generate, assisted_generate):
        for drafter in (None, "ngram"):
            with pytest.raises(TypeError, match="needs a drafter object.*build_drafter"):
                tiny_llama.generate(input_ids, max_new_tokens=4, custom_generate=loop, drafter=drafter)


def test_transformers_assisted_loop_refuses_inputs_embeds(tiny_llama):
    """With `inputs_embeds`, transformers' assisted loop runs its first pass on the prompt's embeddings alone, not
    prompt + draft, and accepts drafts against the wrong logits: refused, as by the engine."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=12, do_sample=False)
    embeds = tiny_llama.get_input_embeddings()(input_ids)
    with pytest.raises(ValueError, match="needs `input_ids`"):
        tiny_llama.generate(input_ids, inputs_embeds=embeds, max_new_tokens=12, custom_generate=assisted_generate,
                            drafter=ReferenceDrafter(reference, corrupt_every=0))  # fmt: skip


def test_model_inputs_the_engine_does_not_feed_are_refused_in_one_line():
    """A vision-language model's `pixel_values` reach the callable with the other model inputs; the engine runs the
    model on tokens alone, so it would decode as if there were no image."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tests.conftest import TINY_CONFIG

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TINY_CONFIG), image_token_id=96)
    model = LlavaForConditionalGeneration(config).eval()
    input_ids = torch.tensor([[5, 6, 96, 96, 96, 96, 7, 8]])  # four image tokens: one per 4x4 patch
    kwargs = {"input_ids": input_ids, "pixel_values": torch.randn(1, 3, 8, 8), "max_new_tokens": 8, "do_sample": False}
    reference = model.generate(**kwargs)
    with pytest.raises(ValueError, match="no images.*would ignore `mm_encoder_outputs`"):  # the encoded images
        model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference))
    del kwargs["pixel_values"]  # text only: nothing is dropped
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference))
    assert torch.equal(out, reference)


def test_text_only_modality_types_of_a_vlm_are_not_refused():
    """A VLM's processor returns `mm_token_type_ids` with the text (0 = text, 1 = image, ...); a text-only call's are
    all zeros, the tokens the engine feeds, so greedy output equals generate's. A real image token is still refused."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    text = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}  # fmt: skip
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 2, "spatial_merge_size": 1,
              "temporal_patch_size": 1}  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=90, video_token_id=91,
                           vision_start_token_id=92, vision_end_token_id=93)  # fmt: skip
    model = Qwen2VLForConditionalGeneration(config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7], [0, 0, 9, 10, 5, 6, 7, 8, 9]])
    kwargs = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "max_new_tokens": 10}
    types = torch.zeros_like(input_ids)
    reference = model.generate(**kwargs, mm_token_type_ids=types, do_sample=False)
    out = model.generate(**kwargs, mm_token_type_ids=types, custom_generate=custom_generate,
                         drafter=ReferenceDrafter(reference))  # fmt: skip
    assert torch.equal(out, reference)
    types[0, 3] = 1
    with pytest.raises(ValueError, match="would ignore `mm_token_type_ids`"):
        model.generate(**kwargs, mm_token_type_ids=types, custom_generate=custom_generate,
                       drafter=ReferenceDrafter(reference))  # fmt: skip


def test_output_flags_run_without_a_dict_and_are_refused_with_one(tiny_llama):
    """`output_attentions` / `output_hidden_states` reach the callable as model inputs too; without
    `return_dict_in_generate` plain `generate` returns the tokens alone, so they change nothing; with it, they are
    refused as outputs the engine does not return."""
    input_ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    for flag in ("output_attentions", "output_hidden_states"):
        reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False, **{flag: True})
        out = tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate,
                                  drafter=ReferenceDrafter(reference), **{flag: True})  # fmt: skip
        assert torch.equal(out, reference)
        with pytest.raises(ValueError, match=f"`{flag}=True` is not supported"):
            tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate, return_dict_in_generate=True,
                                drafter=ReferenceDrafter(reference), **{flag: True})  # fmt: skip


def test_static_and_quantized_caches_are_refused_in_one_line(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="preallocated"):
        tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate, cache_implementation="static",
                            drafter=ReferenceDrafter(reference))  # fmt: skip
    # transformers' FP8 quantized cache needs no extra package; its states live outside `keys` / `values`
    with pytest.raises(ValueError, match="quantized"):
        tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate, drafter=ReferenceDrafter(
            reference), cache_implementation="quantized", cache_config={"backend": "fp8"})  # fmt: skip


def test_continuing_from_a_filled_cache_is_refused_in_one_line(tiny_llama):
    """Multi-turn: a second call given the first one's cache. transformers' assisted loop would feed the whole prompt
    on top of the cached tokens (it decoded garbage); the engine starts from an empty cache. Both refuse."""
    input_ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    first = tiny_llama.generate(input_ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    follow_up = torch.cat([first.sequences, input_ids], dim=1)
    reference = tiny_llama.generate(follow_up, max_new_tokens=8, do_sample=False)
    for loop in (custom_generate, assisted_generate):
        cache = copy.deepcopy(first[CACHE_NAME])
        with pytest.raises(ValueError, match="starts from an empty cache"):
            tiny_llama.generate(follow_up, **{CACHE_NAME: cache}, max_new_tokens=8, custom_generate=loop,
                                drafter=ReferenceDrafter(reference))  # fmt: skip
        out = tiny_llama.generate(
            follow_up, max_new_tokens=8, custom_generate=loop, drafter=ReferenceDrafter(reference)
        )
        assert torch.equal(out, reference)


def test_unsupported_calls_are_refused_in_one_line(tiny_llama):
    from transformers import BloomConfig, BloomForCausalLM

    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False)
    forward = tiny_llama.forward
    tiny_llama.forward = lambda *args, **kwargs: forward(*args, **kwargs)  # a wrapped instance forward still runs
    out = tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate,
                              drafter=ReferenceDrafter(reference))  # fmt: skip
    assert torch.equal(out, reference)
    del tiny_llama.forward
    with pytest.raises(ValueError, match="needs `input_ids`"):
        tiny_llama.generate(inputs_embeds=tiny_llama.get_input_embeddings()(input_ids), max_new_tokens=8,
                            custom_generate=custom_generate, drafter=ReferenceDrafter(reference))  # fmt: skip
    bloom = BloomForCausalLM(BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)).eval()
    with pytest.raises(ValueError, match="ALiBi"):
        bloom.generate(
            input_ids, max_new_tokens=8, custom_generate=custom_generate, drafter=ReferenceDrafter(reference)
        )

    class WrongRows(ReferenceDrafter):
        def propose(self, request):
            return DraftTree.from_parent_lists([([5], [-1])] * (len(request.rows) + 1))

    with pytest.raises(ValueError, match="proposed 3 rows for 2 active rows"):
        tiny_llama.generate(input_ids.repeat(2, 1), max_new_tokens=8, custom_generate=custom_generate,
                            drafter=WrongRows(reference))  # fmt: skip


def test_generation_modes_the_engine_cannot_run_are_refused(tiny_llama):
    from transformers import SynthIDTextWatermarkingConfig

    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False)
    refused = [  # each is silently ignored or miscomputed if run as greedy search
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive"),
        ({"dola_layers": "high"}, "dola"),
        ({"num_beams": 2}, "needs num_beams=1, got 2"),  # its mode check would name beam search, not the argument
        ({"guidance_scale": 1.5}, "guidance_scale"),  # a stateful processor assuming one new token per call
        # another one: SynthID's state appends the last token of every call, rejected drafts included
        ({"watermarking_config": SynthIDTextWatermarkingConfig(keys=[654, 400, 836], ngram_len=3)}, "SynthID"),
    ]
    for loop in (custom_generate, assisted_generate):
        for kwargs, message in refused:
            with pytest.raises(ValueError, match=message):
                tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=loop,
                                    drafter=ReferenceDrafter(reference), **kwargs)  # fmt: skip

    class OutOfVocabulary(ReferenceDrafter):
        def propose(self, request):
            return DraftTree.from_parent_lists([([500, 6], [-1, 0])] * len(request.rows))

    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate,
                            drafter=OutOfVocabulary(reference))  # fmt: skip


def test_a_peft_model_with_lora_on_the_embeddings_keeps_greedy_identity():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_tiny_llama(seed=3), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    input_ids, attention_mask = _ragged_batch(2, seed=1)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False}
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference, tree=True))
    assert torch.equal(out, reference)


def _two_lora_adapters(**config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # init_lora_weights=False: random B, so each adapter changes the logits
    model = get_peft_model(make_tiny_llama(seed=3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                init_lora_weights=False, **config))  # fmt: skip
    model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model.eval()


def test_peft_mixed_adapter_batches_are_refused_in_one_line_beyond_one_row():
    """PEFT's `adapter_names` reach the LoRA layers through hooks sized to the prompt's rows: once a row finished and
    left the batch, PEFT raised "Length of `adapter_names` should be the same as the number of inputs" mid-call."""
    model = _two_lora_adapters()
    input_ids, attention_mask = _ragged_batch(3, seed=1)
    kwargs = {"max_new_tokens": 10, "do_sample": False, "eos_token_id": 24, "pad_token_id": 0}
    names = ["default", "second", "__base__"]
    reference = model.generate(input_ids=input_ids, attention_mask=attention_mask, adapter_names=names, **kwargs)
    with pytest.raises(ValueError, match=r"mixed-adapter batches \(`adapter_names`\) run with batch size 1"):
        model.generate(input_ids=input_ids, attention_mask=attention_mask, adapter_names=names, **kwargs,
                       custom_generate=custom_generate, drafter=ReferenceDrafter(reference))  # fmt: skip
    row = input_ids[1:2, attention_mask[1].bool()]  # one row: the adapter list never changes size
    reference = model.generate(input_ids=row, adapter_names=["second"], **kwargs)
    out = model.generate(input_ids=row, adapter_names=["second"], **kwargs, custom_generate=custom_generate,
                         drafter=ReferenceDrafter(reference, tree=True))  # fmt: skip
    assert torch.equal(out, reference)


def test_peft_poly_task_batches_are_refused_in_one_line_beyond_one_row():
    """Poly's `task_ids` reach its layers through a hook closing over the prompt's rows: once a row finished and left
    the batch, the engine crashed mid-call in Poly's `bmm` ("Expected size for first two dimensions ...")."""
    from peft import PolyConfig, get_peft_model

    config = PolyConfig(target_modules=["q_proj", "v_proj"], r=4, n_tasks=3, n_skills=2, task_type="CAUSAL_LM")
    model = get_peft_model(make_tiny_llama(seed=3), config)
    torch.manual_seed(0)  # Poly's B starts at zero: random weights, so each task changes the logits
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter))
    model.eval()
    input_ids, attention_mask = _ragged_batch(3, seed=1)
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": 24, "pad_token_id": 0}
    task_ids = torch.tensor([0, 1, 2])
    reference = model.generate(input_ids=input_ids, attention_mask=attention_mask, task_ids=task_ids, **kwargs)
    with pytest.raises(ValueError, match="Poly's `task_ids` run with batch size 1"):
        model.generate(input_ids=input_ids, attention_mask=attention_mask, task_ids=task_ids, **kwargs,
                       custom_generate=custom_generate, drafter=ReferenceDrafter(reference))  # fmt: skip
    row = input_ids[1:2, attention_mask[1].bool()]  # one row: the task list never changes size
    reference = model.generate(input_ids=row, task_ids=task_ids[1:2], **kwargs)
    out = model.generate(input_ids=row, task_ids=task_ids[1:2], **kwargs, custom_generate=custom_generate,
                         drafter=ReferenceDrafter(reference, tree=True))  # fmt: skip
    assert torch.equal(out, reference)


def test_peft_activated_lora_is_refused_in_one_line():
    """aLoRA adapts only the last `offset` tokens of each forward pass: a verification pass over a chain longer than
    the offset scored its first tokens without the adapter, and both loops silently decoded other text."""
    model = _two_lora_adapters(alora_invocation_tokens=[40, 41], task_type="CAUSAL_LM")
    input_ids = torch.tensor([[5, 6, 7, 8, 40, 41, 9, 10]])
    reference = model.generate(input_ids=input_ids, max_new_tokens=12, do_sample=False)
    for loop in (custom_generate, assisted_generate):
        with pytest.raises(ValueError, match="does not support aLoRA"):
            model.generate(input_ids=input_ids, max_new_tokens=12, do_sample=False, custom_generate=loop,
                           drafter=ReferenceDrafter(reference, depth=6, corrupt_every=0))  # fmt: skip


def test_peft_xlora_is_refused_in_one_line(tmp_path):
    """X-LoRA runs the model twice in every forward pass (a scaling pass, then the real one), both on the cache it
    is given: the engine's cache held every token twice and its first verification pass crashed on the mask's size
    ("The size of tensor a (17) must match ..."); transformers' assisted loop said only that it needs a cache."""
    from peft import LoraConfig, XLoraConfig, get_peft_model

    adapters = {}
    for i in range(2):
        torch.manual_seed(i)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(make_tiny_llama(seed=3), lora).save_pretrained(tmp_path / str(i))
        adapters[str(i)] = str(tmp_path / str(i))
    base = make_tiny_llama(seed=3, initializer_range=0.3)
    base.config.use_cache = False  # X-LoRA refuses a model that caches
    config = XLoraConfig(task_type="CAUSAL_LM", hidden_size=TINY_CONFIG["hidden_size"], adapters=adapters)
    model = get_peft_model(base, config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    reference = model.generate(input_ids=input_ids, max_new_tokens=10, do_sample=False)
    for loop in (custom_generate, assisted_generate):
        with pytest.raises(ValueError, match="does not support X-LoRA"):
            model.generate(input_ids=input_ids, max_new_tokens=10, do_sample=False, custom_generate=loop,
                           drafter=ReferenceDrafter(reference))  # fmt: skip


@pytest.mark.parametrize("peft_type", ["prompt", "prefix"])
def test_peft_prompt_learning_is_refused_in_one_line(peft_type):
    """PEFT feeds its virtual tokens (or KV prefix) through `prepare_inputs_for_generation`, which the engine never
    calls: it decoded as if there were no adapter, and transformers' assisted loop crashed on the shapes."""
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model

    config = (PromptTuningConfig if peft_type == "prompt" else PrefixTuningConfig)(
        task_type="CAUSAL_LM", num_virtual_tokens=4
    )
    model = get_peft_model(make_tiny_llama(seed=2), config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = model.generate(input_ids=input_ids, max_new_tokens=8, do_sample=False)
    for loop in (custom_generate, assisted_generate):
        with pytest.raises(ValueError, match="PEFT prompt learning"):
            model.generate(input_ids=input_ids, max_new_tokens=8, do_sample=False, custom_generate=loop,
                           drafter=ReferenceDrafter(reference))  # fmt: skip


def test_stopping_criteria_see_the_whole_batch_and_answer_per_row(tiny_llama):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class PerRowLimit(StoppingCriteria):  # row b stops at its own length: the criterion must see every row
        def __init__(self, limits):
            self.limits = torch.tensor(limits)

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[-1] >= self.limits

    input_ids, attention_mask = _ragged_batch(3, seed=4)
    criteria = StoppingCriteriaList([PerRowLimit([11, 14, 17])])
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = tiny_llama.generate(**kwargs, stopping_criteria=criteria)
    for tree in (False, True):
        out = tiny_llama.generate(**kwargs, stopping_criteria=criteria, custom_generate=custom_generate,
                                  drafter=ReferenceDrafter(reference, tree=tree))  # fmt: skip
        assert torch.equal(out, reference)


def test_ngram_drafter_drafts_in_transformers_assisted_loop(tiny_llama):
    # the n-gram drafter measures a plain pass before drafting: the assisted loop must report pass times to it
    from hf_accel.speculative.drafters import InfinigramConfig, InfinigramDrafter

    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4])
    reference = tiny_llama.generate(input_ids, max_new_tokens=30, do_sample=False)
    drafter, sizes = InfinigramDrafter(None, config=InfinigramConfig(tree=False)), []
    propose = drafter.propose
    drafter.propose = lambda request: sizes.append(getattr(tree := propose(request), "num_nodes", 0)) or tree
    out = tiny_llama.generate(input_ids, max_new_tokens=30, custom_generate=assisted_generate, drafter=drafter)
    assert torch.equal(out, reference) and max(sizes) > 0


@pytest.mark.parametrize("offloaded", [False, True])
def test_hidden_states_and_auxiliary_inputs_reach_the_drafter(tiny_llama, offloaded):
    """A PPD-like drafter: aux embeddings under the last draft node; CP-like: last-layer hidden states. Offloaded
    by accelerate, the model's weights are on the meta device and its hooks bring inputs to where it runs."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=10, do_sample=False)
    embed = tiny_llama.get_input_embeddings().weight.detach().clone()
    if offloaded:
        from accelerate import cpu_offload

        cpu_offload(tiny_llama, execution_device=torch.device("cpu"))
        assert tiny_llama.device.type == "meta"

    class AuxDrafter(ReferenceDrafter):
        requires_hidden_states = (-1,)

        def propose(self, request):
            tree = super().propose(request)
            n = tree.num_nodes
            tree.aux_embeds = embed[[11, 12]][None].expand(len(request.rows), -1, -1)
            tree.aux_parent = torch.tensor([[n - 1, n]]).expand(len(request.rows), -1)  # a chain under the leaf
            return tree

    drafter = AuxDrafter(reference, depth=3, corrupt_every=0)
    out = tiny_llama.generate(input_ids, max_new_tokens=10, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    prefill, first = drafter.results[0], drafter.results[1]
    assert prefill.is_prefill and prefill.hidden_states[-1].shape == (1, 4, 32)
    assert first.aux_logits.shape == (1, 2, 97)
    assert first.hidden_states[-1].shape == (1, int(first.path_length[0]), 32)
    # The aux logits are those of the sequence continued with the aux tokens' embeddings.
    committed = reference[:, : 4 + 1 + 3]  # prompt, first token, 3 accepted drafts
    expected = tiny_llama(torch.cat([committed, torch.tensor([[11, 12]])], 1)).logits[0, -2:]
    torch.testing.assert_close(first.aux_logits[0], expected, atol=1e-5, rtol=1e-5)


def _aux_only(aux_embeds, aux_parent):
    """A draft tree with auxiliary inputs and no draft nodes (what `propose_prefill` returns)."""
    empty = torch.zeros((aux_embeds.shape[0], 0), dtype=torch.long)
    return DraftTree(empty, empty.clone(), aux_embeds=aux_embeds, aux_parent=aux_parent)


class PrefillGuessDrafter(ReferenceDrafter):
    """PPD's prefill in miniature: the prefill's auxiliary inputs are the embeddings (`embed`) of `aux_tokens` `[B, 3]`,
    the first two a chain under the last prompt token, the third a second chain; the first pass drafts the guesses
    of the first chain's logits, later passes draft from `reference`. It also reads the last layer's hidden states
    (as CP heads and SpecFormer do: the prompt's, never the aux inputs')."""

    requires_hidden_states = (-1,)

    def __init__(self, reference, embed, aux_tokens, **kwargs):
        super().__init__(reference, **kwargs)
        self.embed, self.aux_tokens = embed, aux_tokens

    def propose_prefill(self, request):
        rows = request.rows
        return _aux_only(self.embed[self.aux_tokens[rows]], torch.tensor([[-1, 0, -1]]).expand(len(rows), -1))

    def propose(self, request):
        if len(self.results) > 1:
            return super().propose(request)
        prefill = self.results[0]
        index = [prefill.rows.tolist().index(row) for row in request.rows.tolist()]
        return DraftTree.from_chains(prefill.aux_logits[index, :2].argmax(-1).tolist())


@torch.no_grad()
def prefill_aux_logits_alone(model, input_ids, attention_mask, aux_tokens):
    """`[B, 3, V]`: what [`PrefillGuessDrafter`]'s aux inputs must score, each row's real prompt (padding dropped)
    continued by its first chain, and by its second, in plain forwards."""
    rows = []
    for b in range(len(input_ids)):
        real = input_ids[b, attention_mask[b].bool()]
        chain = model(torch.cat([real, aux_tokens[b, :2]])[None]).logits[0, -2:]
        alone = model(torch.cat([real, aux_tokens[b, 2:]])[None]).logits[0, -1:]
        rows.append(torch.cat([chain, alone]))
    return torch.stack(rows)


def test_auxiliary_inputs_of_the_prefill_give_the_first_pass_its_draft(tiny_llama):
    """PPD runs its prompt tokens in the prefill (spec 004 §5.2): their logits are the first step's guesses, so the
    first verification pass has a draft. Here the prompt tokens are the embeddings of the two tokens greedy decoding
    will give first (one chain under the last prompt token) and of a wrong one (a second chain): the chain's logits
    then predict the two tokens after them, which the first pass must accept. Without `propose_prefill` the prefill
    ran the prompt alone and the first pass was a plain decoding step. The aux logits are those of the real prompt
    (left padding dropped) continued by the aux tokens."""
    input_ids, attention_mask = _ragged_batch(3)
    width = input_ids.shape[1]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    embed = tiny_llama.get_input_embeddings().weight.detach().clone()
    aux_tokens = torch.stack([reference[:, width], reference[:, width + 1], torch.full((3,), 11)], dim=1)

    drafter = PrefillGuessDrafter(reference, embed, aux_tokens, tree=True)
    out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    prefill, first = drafter.results[0], drafter.results[1]
    assert prefill.is_prefill and prefill.aux_logits.shape == (3, 3, 97)
    assert prefill.hidden_states[-1].shape == (3, width, 32)
    assert [len(tokens) for tokens in first.new_tokens] == [3, 3, 3]  # two guesses accepted, then the bonus token
    expected = prefill_aux_logits_alone(tiny_llama, input_ids, attention_mask, aux_tokens)
    torch.testing.assert_close(prefill.aux_logits, expected, atol=1e-5, rtol=1e-5)


def test_auxiliary_inputs_near_max_length_are_capped_at_max_depth_only(tiny_llama):
    """Aux inputs up to `max_depth` keep the text's positions next to `max_length` (their logits are the text's);
    deeper ones sit at `max_depth`, where they could only seed drafts that no later pass verifies."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=4, do_sample=False)
    embed = tiny_llama.get_input_embeddings().weight.detach().clone()

    max_depths = []

    class UnderTheRoot(ReferenceDrafter):
        def propose(self, request):
            max_depths.append(int(request.max_depth[0]))
            return _aux_only(embed[[11, 12, 13]][None], torch.tensor([[-1, 0, 1]]))

    drafter = UnderTheRoot(reference)
    out = tiny_llama.generate(input_ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    assert max_depths == [2, 1, 0]  # one token a pass: the roots are the 5th, 6th and 7th tokens
    result = drafter.results[2]  # max_depth 1: the aux chain's first input keeps its position, the others are capped
    expected = tiny_llama(torch.cat([reference[:, :6], torch.tensor([[11]])], 1)).logits[0, -1]
    torch.testing.assert_close(result.aux_logits[0, 0], expected, atol=1e-5, rtol=1e-5)


def test_prefill_auxiliary_inputs_stay_inside_a_position_table():
    """Prefill aux inputs deeper than the first pass could commit sit at that depth, as a pass's do: GPT-2's learned
    positions end where `max_length` does, and a chain of 10 prompt tokens under a 16-token prompt would index past
    them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=24, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    input_ids, attention_mask = _ragged_batch(2, width=16)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_length": 24, "do_sample": False}
    reference = model.generate(**kwargs)

    class DeepPrefill(ReferenceDrafter):
        def propose_prefill(self, request):
            rows = len(request.rows)
            return _aux_only(torch.zeros(rows, 10, 32), torch.arange(-1, 9).expand(rows, -1))

    drafter = DeepPrefill(reference)
    assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    assert drafter.results[0].aux_logits.shape == (2, 10, 97)


@pytest.mark.parametrize("proposal", [None, DraftTree(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0))])
def test_a_prefill_proposal_without_auxiliary_inputs_runs_the_prompt_alone(tiny_llama, proposal):
    input_ids, attention_mask = _ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)

    class NothingForThePrefill(ReferenceDrafter):
        def propose_prefill(self, request):
            return proposal

    drafter = NothingForThePrefill(reference)
    assert torch.equal(tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    assert drafter.results[0].is_prefill and drafter.results[0].aux_logits is None


@pytest.mark.parametrize(
    "proposal, message",
    [
        (DraftTree(torch.tensor([[11]]), torch.tensor([[-1]])), "1 draft nodes"),
        (_aux_only(torch.zeros(1, 2, 32), torch.tensor([[-1, 1]])), "topologically ordered"),
        (_aux_only(torch.zeros(1, 2, 16), torch.tensor([[-1, 0]])), "width 16"),
        (_aux_only(torch.zeros(1, 2, 32), torch.tensor([[-1]])), "aux_embeds"),
    ],
)
def test_malformed_prefill_proposals_are_refused_in_one_line(tiny_llama, proposal, message):
    class Malformed(ReferenceDrafter):
        def propose_prefill(self, request):
            return proposal

    with pytest.raises(ValueError, match=message):
        tiny_llama.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, custom_generate=custom_generate,
                            drafter=Malformed(torch.zeros(1, 12, dtype=torch.long)))  # fmt: skip


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"aux_embeds": torch.zeros(2, 2, 32)}, "need both"),  # was dropped silently: no aux logits came back
        ({"aux_parent": torch.tensor([[-1, 0]] * 2)}, "need both"),
        ({"aux_embeds": torch.zeros(2, 3, 32), "aux_parent": torch.tensor([[-1, 0]] * 2)}, "aux_embeds"),
        ({"aux_embeds": torch.zeros(2, 2, 32), "aux_parent": torch.tensor([[-1, 0]])}, "aux_parent"),
        ({"aux_embeds": torch.zeros(2, 2, 16), "aux_parent": torch.tensor([[-1, 0]] * 2)}, "width 16"),
        ({"draft_probs": torch.full((2, 2, 97), 1 / 97)}, "draft_probs"),
    ],
)
def test_draft_trees_with_inconsistent_fields_are_refused_in_one_line(tiny_llama, fields, message):
    class Malformed:
        def propose(self, request):
            return DraftTree(torch.tensor([[11], [12]]), torch.tensor([[-1], [-1]]), **fields)

    with pytest.raises(ValueError, match=message):
        tiny_llama.generate(torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]]), max_new_tokens=4, do_sample=True,
                            custom_generate=custom_generate, drafter=Malformed())  # fmt: skip


@pytest.mark.parametrize("processor", [{"repetition_penalty": 1.5}, {"min_new_tokens": 8, "no_repeat_ngram_size": 2}])
def test_context_dependent_processors_keep_greedy_identity(processor):
    """Processors that read the context see each tree node's own path (left-padded batch of 2)."""
    model = make_tiny_llama(seed=2)
    input_ids, attention_mask = _ragged_batch(2, seed=4)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": False}
    free = model.generate(**kwargs)
    reference = model.generate(**kwargs, **processor)
    for drafts_from in (free, reference):
        drafter = ReferenceDrafter(drafts_from, depth=4, tree=True)
        out = model.generate(**kwargs, **processor, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(out, reference)


def test_a_subclass_of_a_context_free_processor_that_reads_the_context_keeps_greedy_identity():
    """Context-free processors are known by exact class: a user's subclass of one may read `input_ids` and must be
    run per node with the node's own path (it was run once on a dummy context, and the output differed)."""
    from transformers import LogitsProcessorList, TopKLogitsWarper

    class NoRecentRepeat(TopKLogitsWarper):  # top-k, then none of the context's last 3 tokens again
        def __call__(self, input_ids, scores):
            scores = super().__call__(input_ids, scores)
            return scores.scatter(1, input_ids[:, -3:], -float("inf"))

    model = make_tiny_llama(seed=2)
    input_ids, attention_mask = _ragged_batch(2, seed=4)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": False}
    free = model.generate(**kwargs)
    processors = LogitsProcessorList([NoRecentRepeat(top_k=50)])
    reference = model.generate(**kwargs, logits_processor=processors)
    assert not torch.equal(reference, free)  # the processor changes the text
    for drafts_from in (free, reference):
        drafter = ReferenceDrafter(drafts_from, depth=4, tree=True)
        out = model.generate(**kwargs, logits_processor=processors, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(out, reference)


def test_a_nan_score_does_not_count_as_forbidding_a_draft_node():
    """Only `-inf` forbids a node: greedy `generate` picks a NaN score (argmax), so a node whose parent's processed
    score is NaN can be committed and its own scores must be processed with its path (they were left raw)."""
    from transformers import LogitsProcessorList, TopKLogitsWarper

    class NanAfterForty(TopKLogitsWarper):  # token 9 is NaN after token 40, and token 81 is forbidden after 9
        def __call__(self, input_ids, scores):
            scores = super().__call__(input_ids, scores)
            scores[input_ids[:, -1] == 40, 9] = float("nan")
            scores[input_ids[:, -1] == 9, 81] = -float("inf")
            return scores

    model = make_tiny_llama(seed=2)
    input_ids, attention_mask = _ragged_batch(2, seed=4)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 24, "do_sample": False}
    processors = LogitsProcessorList([NanAfterForty(top_k=50)])
    reference = model.generate(**kwargs, logits_processor=processors)
    assert 9 in reference[:, input_ids.shape[1] :]  # the NaN token is chosen
    drafter = ReferenceDrafter(reference, depth=4, tree=True)
    out = model.generate(**kwargs, logits_processor=processors, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)


def _candidates_constraint(candidates: dict, prompt_length: int):
    """A `prefix_allowed_tokens_fn` that makes row `batch_id` write one of `candidates[batch_id]` (a trie), then pad;
    like most constraint functions it knows no continuation of a prefix it forbids (`[]`: transformers raises)."""

    def allowed(batch_id, sent):
        done = sent[prompt_length:].tolist()
        if 2 in done:  # EOS written: the row is padded
            return [0]
        return sorted({c[len(done)] for c in candidates[batch_id] if c[: len(done)] == done and len(c) > len(done)})

    return allowed


@pytest.mark.parametrize("loop", ["chain", "tree"])
def test_processors_never_see_a_draft_path_they_forbid(loop):
    """A draft node whose token the constraint forbids can never be committed: its own scores were processed all the
    same, with the forbidden path as context, and a trie-style `prefix_allowed_tokens_fn` returned `[]` there, which
    transformers turns into a ValueError."""
    model = make_tiny_llama(seed=2)
    input_ids, attention_mask = _ragged_batch(1, seed=4)
    candidates = {0: [[5, 6, 7, 8, 2], [5, 9, 9, 2], [11, 12, 2]]}
    kwargs = {
        "input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False,
        "prefix_allowed_tokens_fn": _candidates_constraint(candidates, input_ids.shape[1]),
    }  # fmt: skip
    reference = model.generate(**kwargs)
    drafter = ReferenceDrafter(reference, depth=4, tree=loop == "tree", corrupt_every=1)  # a wrong token every pass
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("tree", [False, True])
def test_prefix_allowed_tokens_fn_is_asked_about_each_row_with_its_own_batch_id(tree):
    """Context-dependent processors run each row's nodes in a full-size batch holding that row's context at every
    index: `prefix_allowed_tokens_fn` was asked for every `batch_id` about that context, and a row whose constraint
    has no answer for another row's text (`[]`) made transformers raise at the first pass of a ragged batch."""
    model = make_tiny_llama(seed=2)
    input_ids, attention_mask = _ragged_batch(3, seed=4)
    candidates = {0: [[5, 6, 7, 8, 2], [5, 9, 9, 2]], 1: [[20, 21, 22, 2], [20, 30, 2]], 2: [[40, 41, 42, 43, 44, 2]]}
    kwargs = {
        "input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False,
        "prefix_allowed_tokens_fn": _candidates_constraint(candidates, input_ids.shape[1]),
    }  # fmt: skip
    reference = model.generate(**kwargs)
    drafter = ReferenceDrafter(reference, depth=3, tree=tree)
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)


def test_hybrid_recurrent_models_are_refused_in_one_line():
    """A tree pass folds every draft node into a linear-attention / convolution state that cannot be rolled back."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = Lfm2ForCausalLM(config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="recurrent states"):
        model.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate,
                       drafter=ReferenceDrafter(reference))  # fmt: skip


def test_sparse_attention_indexer_caches_are_refused_in_one_line():
    """A DSA model's cache layers (`DynamicIndexedLayer`) also keep an indexer key per token, which gathering the
    accepted nodes of `keys` / `values` left behind: after a rejected draft, the next pass failed deep in the indexer
    (`The size of tensor a (28) must match the size of tensor b (27)`)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    config = GlmMoeDsaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=256, mlp_layer_types=None,
        layer_types=None, indexer_types=None, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = GlmMoeDsaForCausalLM(config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    reference = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match="DynamicIndexedLayer.*per-token state besides"):
        model.generate(input_ids, max_new_tokens=20, custom_generate=custom_generate,
                       drafter=ReferenceDrafter(reference))  # fmt: skip


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_drafts_deeper_than_the_budget_stay_inside_a_position_table(loop):
    """A drafter may ignore `max_depth`; GPT-2's learned positions end where `max_length` does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=24, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    input_ids, attention_mask = _ragged_batch(2 if loop is custom_generate else 1, width=16)  # assisted: batch 1
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_length": 24, "do_sample": False}
    reference = model.generate(**kwargs)

    class TooDeep(ReferenceDrafter):
        def propose(self, request):
            return DraftTree.from_chains(
                [
                    (self.reference[int(r), int(n) :].tolist() + [5] * 12)[:12]
                    for r, n in zip(request.rows, request.lengths)
                ]
            )

    out = model.generate(**kwargs, custom_generate=loop, drafter=TooDeep(reference))
    assert torch.equal(out, reference)


def test_given_position_ids_are_continued_as_by_generate(prefill):
    """`generate` continues the prompt's `position_ids` (one past the last); with learned positions (GPT-2) a decode
    that restarted at the count of real tokens gives other text."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    input_ids, attention_mask = _ragged_batch(2)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor([[20], [5]])  # a row offset each
    for rows in (1, 2):
        kwargs = {"input_ids": input_ids[:rows], "attention_mask": attention_mask[:rows],
                  "position_ids": position_ids[:rows], "max_new_tokens": 12, "do_sample": False}  # fmt: skip
        reference = model.generate(**kwargs)
        for tree in (False, True):
            drafter = ReferenceDrafter(reference, tree=tree)
            assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)


def test_hidden_states_and_best_node_follow_the_accepted_path(tiny_llama):
    """A wrong node comes first in every tree, so the accepted path is not the tree's first nodes: the hidden states
    handed back are the target's own at the root and the accepted nodes (a plain forward over the committed text),
    and `best_node` is the drafter-numbered node whose path holds the accepted drafts."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=12, do_sample=False)

    class WrongFirst(ReferenceDrafter):
        requires_hidden_states = (0, -1)

        def __init__(self, reference):
            super().__init__(reference, depth=3, corrupt_every=0)
            self.proposals = []

        def propose(self, request):
            length = int(request.lengths[0])
            chain = self.reference[0, length : length + self.depth].tolist()
            tokens = [(chain[0] + 1) % 97 if chain else 5] + chain  # node 0: a wrong child of the root
            parents = [-1] + [-1] + list(range(1, len(chain)))
            self.proposals.append((tokens, parents))
            return DraftTree.from_parent_lists([(tokens, parents)])

    drafter = WrongFirst(reference)
    out = tiny_llama.generate(input_ids, max_new_tokens=12, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    full = tiny_llama(reference, output_hidden_states=True).hidden_states
    length = input_ids.shape[1] + 1  # committed after the prefill
    for result, (tokens, parents) in zip(drafter.results[1:], drafter.proposals):
        node, path = int(result.best_node[0]), []
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        assert path == result.new_tokens[0][:-1]
        kept = int(result.path_length[0])
        for layer in (0, -1):
            torch.testing.assert_close(
                result.hidden_states[layer][0, :kept], full[layer][0, length - 1 : length - 1 + kept]
            )
        length += len(result.new_tokens[0])
    assert max(len(r.new_tokens[0]) for r in drafter.results[1:]) > 2  # drafts were accepted past the wrong node


def test_hidden_states_are_the_committed_positions_in_order_at_the_prefill_too(tiny_llama, prefill):
    """In a left-padded batch, every result (the prefill's included) hands back the committed positions in order,
    `path_length[b]` of them, padded on the right: `[b, path_length[b] - 1]` is the position whose logits chose the
    row's last token (what CP heads read), and the pieces joined are the target's states over the committed text
    (what SpecFormer's own causal layer appends)."""
    input_ids, attention_mask = _ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)

    class Reader(ReferenceDrafter):
        requires_hidden_states = (-1,)

    drafter = Reader(reference, tree=True)
    assert torch.equal(tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    history = {row: [] for row in range(3)}
    for result in drafter.results:
        hidden = result.hidden_states[-1]
        for b, row in enumerate(result.rows.tolist()):
            last = hidden[b, int(result.path_length[b]) - 1]
            assert int(tiny_llama.lm_head(last).argmax()) == result.new_tokens[b][-1]
            history[row].append(hidden[b, : int(result.path_length[b])])
    for row in range(3):
        text = reference[row, int((attention_mask[row] == 0).sum()) : -1]
        expected = tiny_llama(text[None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(torch.cat(history[row]), expected, atol=1e-5, rtol=1e-5)


def test_hidden_states_the_target_does_not_have_are_refused_in_one_line(tiny_llama):
    """A drafter built for a deeper target (SpecFormer's hooks `(0, 17, -2, -1)` of a 36-layer Qwen3) asks this
    2-layer model (3 hidden states) for layers it has not: one line naming them, not an IndexError in the prefill."""

    class DeepHooks(ReferenceDrafter):
        requires_hidden_states = (0, 17, -4, -1)

    with pytest.raises(ValueError, match=r"hidden states \[17, -4\] \(`requires_hidden_states`\), the target has 3 "):
        tiny_llama.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, custom_generate=custom_generate,
                            drafter=DeepHooks(torch.zeros(1, 12, dtype=torch.long)))  # fmt: skip


def test_each_row_is_verified_against_its_own_draft_probabilities():
    """Rows draft different tokens from different point masses: a row's draft of `x` (probability 1 under its own
    `q`) is accepted with probability `p(x)`, not 1 as under another row's `q` that gives `x` no mass. Oracle: the
    target's exact `p(x)` after each row's first sampled token."""
    model = make_tiny_llama(seed=1, vocab_size=12)
    prompt, x, y, n = torch.tensor([[3, 5, 7]]), 4, 9, 400

    class RowProbs:
        def propose(self, request):
            tokens = torch.tensor([[x if int(r) % 2 else y] for r in request.rows])
            probs = torch.nn.functional.one_hot(tokens, 12).float()  # [B, 1, V]: each row's own point mass
            return DraftTree(tokens, torch.full_like(tokens, -1), draft_probs=probs)

    torch.manual_seed(0)
    out = model.generate(prompt.expand(n, -1), max_new_tokens=3, do_sample=True, top_k=0,
                         custom_generate=custom_generate, drafter=RowProbs())  # fmt: skip
    odd = out[1::2]
    odd = odd[odd[:, 3] != model.generation_config.eos_token_id]
    with torch.no_grad():
        p_x = torch.softmax(model(odd[:, :4]).logits[:, -1], -1)[:, x]
    freq, expected = float((odd[:, 4] == x).float().mean()), float(p_x.mean())
    assert abs(freq - expected) < 4 * (expected * (1 - expected) / len(odd)) ** 0.5 + 0.01, (freq, expected)


def test_negative_draft_token_ids_are_refused_in_one_line(tiny_llama):
    input_ids = torch.tensor([[5, 6, 7, 8]])

    class Negative:
        def propose(self, request):
            return DraftTree.from_parent_lists([([6, -1], [-1, 0])] * len(request.rows))

    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate, drafter=Negative())


@pytest.mark.parametrize("token", [-1, TINY_CONFIG["vocab_size"]])
def test_draft_ids_outside_the_vocabulary_are_refused_in_one_line_in_transformers_assisted_loop(tiny_llama, token):
    """A drafter of another vocabulary (an index of another tokenizer, shared with a second model) in transformers'
    assisted loop: refused as in hf-accel's own, not an IndexError from the embedding."""

    class OtherVocabulary:
        def propose(self, request):
            return DraftTree.from_parent_lists([([6, token], [-1, 0])])

    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        tiny_llama.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, custom_generate=assisted_generate,
                            drafter=OtherVocabulary())  # fmt: skip


def test_a_filled_sliding_window_cache_is_refused_in_one_line():
    """The engine serves sliding-window models from full layers (test_families); a sliding cache layer that already
    holds tokens keeps only its window, which the engine cannot gather (it was a tensor size error in attention)."""
    from transformers import DynamicCache, MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**TINY_CONFIG, "sliding_window": 4})
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cache = DynamicCache(config=config)
    model(input_ids[:, :3], **{CACHE_NAME: cache})
    with pytest.raises(ValueError, match="sliding-window layer"):
        model.generate(input_ids, **{CACHE_NAME: cache}, max_new_tokens=8, custom_generate=custom_generate,
                       drafter=ReferenceDrafter(input_ids, tree=True))  # fmt: skip


@pytest.mark.parametrize("attention", ["flash_attention_2", "kernels-community/flash-attn2", "paged|sdpa"])
def test_attention_without_4d_masks_is_refused_in_one_line(tiny_llama, attention):
    """FlashAttention (and paged) kernels ignore the tree mask: a tree would be attended to as one causal sequence."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=4, do_sample=False)
    tiny_llama.config._attn_implementation = attention
    try:
        with pytest.raises(ValueError, match="takes no 4D attention mask"):
            tiny_llama.generate(input_ids, max_new_tokens=4, custom_generate=custom_generate,
                                drafter=ReferenceDrafter(reference))  # fmt: skip
    finally:
        tiny_llama.config._attn_implementation = "sdpa"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_identity_on_a_gpu(tree):
    # float32 on CUDA: the verification pass (SDPA with a tree mask over many tokens) and one-token decoding run other
    # kernels, whose sums round differently; the tiny model's greedy margins are far above that
    from hf_accel.speculative.drafters import build_drafter

    model = make_tiny_llama().cuda()
    input_ids, attention_mask = (t.cuda() for t in _ragged_batch(4))
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 24, "do_sample": False}
    reference = model.generate(**kwargs)
    for drafter in (ReferenceDrafter(reference, depth=5, tree=tree), build_drafter("ngram", None, model, None)):
        assert torch.equal(model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prompts_on_the_cpu_for_a_model_on_a_gpu():
    """`generate` takes CPU inputs for a model on a GPU (it moves each forward's inputs): so does the engine, whose
    bookkeeping, like `generate`'s, stays on the inputs' device."""
    from hf_accel.speculative.drafters import build_drafter

    model = make_tiny_llama().cuda()
    input_ids, attention_mask = _ragged_batch(4)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 24, "do_sample": False}
    reference = model.generate(**kwargs)
    assert reference.device.type == "cpu"
    for drafter in (ReferenceDrafter(reference, depth=5, tree=True), build_drafter("ngram", None, model, None)):
        out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
        assert out.device.type == "cpu" and torch.equal(out, reference)


def test_a_model_whose_forward_takes_no_logits_to_keep_keeps_greedy_identity():
    """`generate` passes `logits_to_keep` only to a forward that names it (older remote code does not): so does the
    engine's prefill, instead of raising on the unexpected keyword."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class WithoutLogitsToKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, output_hidden_states=None, return_dict=None):  # fmt: skip
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                **{CACHE_NAME: cache if cache is not None else past_key_values}, inputs_embeds=inputs_embeds,
                use_cache=use_cache, output_hidden_states=output_hidden_states,
            )  # fmt: skip

    torch.manual_seed(0)
    model = WithoutLogitsToKeep(LlamaConfig(**TINY_CONFIG)).eval()
    input_ids, attention_mask = _ragged_batch(2)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": False}
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, custom_generate=custom_generate, drafter=ReferenceDrafter(reference, tree=True))
    assert torch.equal(out, reference)


class SkewedDrafter(ReferenceDrafter):
    """Row 0 drafts its reference continuation (all accepted), the other rows a wrong first token (none accepted):
    every pass leaves `depth` holes in the other rows."""

    def propose(self, request):
        trees = []
        for b in range(len(request.rows)):
            row, length = int(request.rows[b]), int(request.lengths[b])
            chain = self.reference[row, length : length + self.depth].tolist()
            if row != 0 and chain:
                chain = [3 + (chain[0] - 2) % 94] + chain[1:]  # another token in [3, 97)
            trees.append((chain, list(range(-1, len(chain) - 1))))
        return DraftTree.from_parent_lists(trees)


def count_hole_closings(monkeypatch) -> list:
    """Spies on the engine's `_close_holes`: the returned list gets one entry per call that shortened the cache."""
    from hf_accel.speculative import engine

    closed, close = [], engine._close_holes

    def spy(state, cache, **kwargs):
        before = state.past_mask.shape[1]
        close(state, cache, **kwargs)
        if len(state.rows) and state.past_mask.shape[1] < before:
            closed.append(before - state.past_mask.shape[1])

    monkeypatch.setattr(engine, "_close_holes", spy)
    return closed


def test_close_holes_moves_valid_slots_to_the_end_in_order():
    from types import SimpleNamespace

    from transformers import DynamicCache

    from hf_accel.speculative.engine import _close_holes

    past_mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.bool)
    cache = DynamicCache()
    slots = torch.arange(8.0).view(1, 1, 8, 1).expand(2, 2, 8, 3) + torch.tensor([0.0, 100.0]).view(2, 1, 1, 1)
    cache.update(slots.clone(), -slots.clone(), 0)
    state = SimpleNamespace(rows=torch.arange(2), past_mask=past_mask.clone())
    _close_holes(state, cache)
    # 6 valid slots at most: the cache keeps 6, each row's valid slots last and in order, its holes first
    assert state.past_mask.tolist() == [[False, False, True, True, True, True], [True] * 6]
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert keys[0, 0, 2:, 0].tolist() == [1, 2, 4, 7] and keys[1, 0, :, 0].tolist() == [100, 101, 102, 103, 104, 106]
    assert torch.equal(values, -keys)
    # fewer holes than 1/8 of the slots: left as they are
    state.past_mask[0, :2] = True
    _close_holes(state, cache)
    assert state.past_mask.shape[1] == 6 and cache.get_seq_length() == 6


@pytest.mark.parametrize("tree", [False, True])
def test_closing_the_holes_of_rows_that_accept_less_keeps_greedy_identity(tiny_llama, monkeypatch, tree):
    closed = count_hole_closings(monkeypatch)
    input_ids, attention_mask = _ragged_batch(4)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 40, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    drafter = SkewedDrafter(reference, depth=6) if not tree else ReferenceDrafter(reference, depth=6, tree=True)
    assert torch.equal(tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    assert closed


def test_overlapping_assisted_calls_on_one_model_each_run_their_own_drafter(tiny_llama):
    """Two threads in transformers' assisted loop on one model: a call that finishes while the other runs leaves that
    one its candidate generator (its end removed the other's shadow method, whose own end then raised
    AttributeError)."""
    import threading

    prompts = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10, 11, 12, 13]])]
    references = [tiny_llama.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]
    started, other_done, outs, errors = threading.Event(), threading.Event(), [], []

    class WaitingDrafter(ReferenceDrafter):
        def propose(self, request):
            started.set()
            other_done.wait(60)  # the other call runs whole while this one is in flight
            return super().propose(request)

    def first():
        try:
            drafter = WaitingDrafter(references[0], corrupt_every=0)
            outs.append(tiny_llama.generate(prompts[0], max_new_tokens=12, custom_generate=assisted_generate,
                                            drafter=drafter))  # fmt: skip
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(60)
    second = tiny_llama.generate(prompts[1], max_new_tokens=12, custom_generate=assisted_generate,
                                 drafter=ReferenceDrafter(references[1], corrupt_every=0))  # fmt: skip
    other_done.set()
    thread.join(60)
    assert not errors and torch.equal(outs[0], references[0]) and torch.equal(second, references[1])
    assert "_get_candidate_generator" not in vars(tiny_llama)


def test_one_drafter_serving_threads_gives_each_call_its_own_stats(tiny_llama):
    """One drafter serving `generate` calls in several threads at once (as the Hub loader's cached one does): each
    output carries its own call's stats, and a thread that only started the calls (a `TextIteratorStreamer` user)
    reads the last one's as `drafter.last_stats` after joining them."""
    import threading

    from hf_accel.speculative.drafters import InfinigramDrafter

    drafter = InfinigramDrafter(None)
    prompts = [torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]]), torch.tensor([[9, 10, 11, 12, 13]])]
    outs, errors = [None, None], []

    def run(i):
        try:
            outs[i] = tiny_llama.generate(prompts[i], max_new_tokens=6 + 4 * i, do_sample=False,
                                          custom_generate=custom_generate, drafter=drafter)  # fmt: skip
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert [out.speculative_stats.new_tokens for out in outs] == [6, 10]
    assert any(drafter.last_stats is out.speculative_stats for out in outs)
    copy.deepcopy(drafter)


def test_a_drafter_s_last_stats_never_describe_an_earlier_call(tiny_llama):
    """`drafter.last_stats` after a call that raised (a stopping criterion interrupting it) or ran in transformers'
    assisted loop is `None`, not the statistics of the call before; the drafter then decodes the next call exactly."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_accel.speculative.drafters import InfinigramDrafter

    class Interrupt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > 12:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    input_ids, attention_mask = _ragged_batch(2)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    drafter = InfinigramDrafter(None)
    tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert drafter.last_stats is not None
    with pytest.raises(KeyboardInterrupt):
        tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter,
                            stopping_criteria=StoppingCriteriaList([Interrupt()]))  # fmt: skip
    assert drafter.last_stats is None
    out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference) and drafter.last_stats is out.speculative_stats
    tiny_llama.generate(input_ids[:1], max_new_tokens=8, custom_generate=assisted_generate, drafter=drafter)
    assert drafter.last_stats is None


@pytest.mark.parametrize("family", ["gpt2", "opt"])
@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_drafts_past_a_position_table_are_not_verified_when_eos_comes_first(family, loop):
    """`max_new_tokens` runs past GPT-2's / OPT's position table, but the text reaches EOS before it: plain `generate`
    stops there; drafts placed past the table's end made the model index out of it (IndexError)."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.5,
                            bos_token_id=1, eos_token_id=2)  # fmt: skip
        model = GPT2LMHeadModel(config).eval()
    else:
        config = OPTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, init_std=0.5)  # fmt: skip
        model = OPTForCausalLM(config).eval()
    input_ids = torch.randint(3, 97, (1, 55))
    free = model.generate(input_ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
    # a token first emitted at position 57 to 60 (the table ends at 63): drafts 12 deep reach past the end
    eos = next(int(t) for i, t in enumerate(free[57:], 57) if t not in free[55:i])
    kwargs = {"input_ids": input_ids, "max_new_tokens": 30, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    reference = model.generate(**kwargs)
    assert 58 <= reference.shape[1] <= 61
    drafter = ReferenceDrafter(torch.cat([free, torch.randint(3, 97, (40,))])[None], depth=12, corrupt_every=0)
    assert torch.equal(model.generate(**kwargs, custom_generate=loop, drafter=drafter), reference)


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_dynamic_rope_past_max_position_embeddings_keeps_greedy_identity(loop):
    """Dynamic NTK RoPE grows its frequencies with the largest position of each pass once past
    `max_position_embeddings`: a pass holding drafts beyond its root RoPE'd the root (and every node) with frequencies
    plain decoding only reaches later, and the text changed there."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = make_tiny_llama(max_position_embeddings=64, initializer_range=0.3, vocab_size=500, rope_parameters=rope)
    input_ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": input_ids, "max_new_tokens": 60, "do_sample": False}
    reference = model.generate(**kwargs)
    drafter = ReferenceDrafter(reference, depth=8, corrupt_every=3)
    assert torch.equal(model.generate(**kwargs, custom_generate=loop, drafter=drafter), reference)


def _tiny_longrope_phi3():
    """A Phi-3 whose longrope switches to its long factors past 64 tokens (Phi-3-mini-128k: past 4,096)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    config = Phi3Config(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters=rope,
    )  # fmt: skip
    return Phi3ForCausalLM(config).eval()


@pytest.mark.parametrize("loop", [custom_generate, assisted_generate])
def test_generation_across_a_longrope_switch_is_refused_in_one_line(loop):
    """Phi-3's `generate` recomputes the whole cache with the long factors when the sequence passes
    `original_max_position_embeddings`, and a pass's factors follow its largest position: speculative text differed
    from plain greedy there. Calls that start past the switch, or end before it, run (and stay identical)."""
    model = _tiny_longrope_phi3()
    generator = torch.Generator().manual_seed(0)
    short, long = (
        torch.randint(3, 500, (1, 40), generator=generator),
        torch.randint(3, 500, (1, 70), generator=generator),
    )
    for input_ids, max_new_tokens in ((short, 24), (long, 30)):
        kwargs = {"input_ids": input_ids, "max_new_tokens": max_new_tokens, "do_sample": False}
        reference = model.generate(**kwargs)
        drafter = ReferenceDrafter(reference, depth=8, corrupt_every=3)
        assert torch.equal(model.generate(**kwargs, custom_generate=loop, drafter=drafter), reference)
    with pytest.raises(ValueError, match="longrope"):
        model.generate(short, max_new_tokens=60, custom_generate=loop, drafter=ReferenceDrafter(reference))


@pytest.mark.parametrize("renamed", ["_assisted_decoding", "_get_candidate_generator"])
def test_assisted_loop_without_transformers_private_methods_is_refused_in_one_line(tiny_llama, monkeypatch, renamed):
    """`assisted_generate` drives transformers' private `_assisted_decoding` and shadows `_get_candidate_generator`;
    with either renamed (a later transformers), the shadow was ignored and transformers' own builder failed deep
    inside with `'NoneType' object has no attribute 'device'`, or the call failed on a missing attribute."""
    from transformers import GenerationMixin

    method = getattr(GenerationMixin, renamed)
    monkeypatch.delattr(GenerationMixin, renamed)
    monkeypatch.setattr(GenerationMixin, renamed + "_v2", method, raising=False)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match=f"private {renamed}.*use `custom_generate`"):
        tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=assisted_generate,
                            drafter=ReferenceDrafter(input_ids))  # fmt: skip
    assert "_get_candidate_generator" not in vars(tiny_llama)


def test_only_the_hidden_states_a_drafter_reads_are_kept_during_the_pass(tiny_llama, monkeypatch):
    """The target ran with `output_hidden_states=True`, which holds every layer's states over the whole pass (at a
    long prefill of a large model, more than the cache); it now names the layers, and transformers keeps only those."""
    input_ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_llama.generate(input_ids, max_new_tokens=8, do_sample=False)
    seen = []
    forward = tiny_llama.model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append([h is not None for h in out.hidden_states])
        return out

    monkeypatch.setattr(tiny_llama.model, "forward", recording)

    class LastAndFirst(ReferenceDrafter):
        requires_hidden_states = (0, -1)

    drafter = LastAndFirst(reference)
    out = tiny_llama.generate(input_ids, max_new_tokens=8, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    layers = tiny_llama.config.num_hidden_layers
    assert seen and all(kept == [True] + [False] * (layers - 1) + [True] for kept in seen)
    assert all(set(r.hidden_states) == {0, -1} for r in drafter.results)


def test_hidden_states_a_model_drops_by_its_config_s_layer_count_are_refused_in_one_line():
    """The engine names the drafter's layers (`output_hidden_states=[0, -1]`), and transformers resolves `-1` with
    `config.num_hidden_layers`: a model whose layers were cut after loading (config not updated) returned `None` there,
    and the prefill failed with `'NoneType' object has no attribute 'to'`."""
    model = make_tiny_llama(num_hidden_layers=3)
    model.model.layers = model.model.layers[:2]  # pruned; the config still counts 3 layers

    class LastAndFirst(ReferenceDrafter):
        requires_hidden_states = (0, -1)

    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"^the target returned no hidden states \[-1\] .*`num_hidden_layers`") as err:
        model.generate(input_ids, max_new_tokens=4, custom_generate=custom_generate,
                       drafter=LastAndFirst(torch.zeros(1, 12, dtype=torch.long)))  # fmt: skip
    assert len(str(err.value).splitlines()) == 1
