import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters.index import (
    INDEX_FILES,
    SEPARATOR,
    InfinigramIndex,
    build_index,
    reversed_suffix_array,
    tokenizer_fingerprint,
)
from hf_accel.speculative.drafters.infinigram import (
    InfinigramConfig,
    InfinigramDrafter,
    build_weighted_trie,
    context_matches,
    select_tree_nodes,
)


class FakeTokenizer:
    def __init__(self, vocab_size, name="fake", shift=0):
        self.vocab = {f"t{i + shift}": i for i in range(vocab_size)}
        self.name_or_path = name

    def get_vocab(self):
        return self.vocab


def _brute_longest_suffix(docs, context):
    best = 0
    for m in range(1, len(context) + 1):
        pattern = list(context[-m:])
        if any(doc[i : i + m] == pattern for doc in docs for i in range(len(doc) - m + 1)):
            best = m
        else:
            break
    return best


def _brute_continuations(docs, context, m, depth):
    pattern, out = list(context[-m:]), []
    for doc in docs:
        for i in range(len(doc) - m + 1):
            if doc[i : i + m] == pattern:
                out.append(tuple(doc[i + m : i + m + depth]))
    return sorted(out)


@pytest.fixture
def small_index(tmp_path):
    rng = np.random.default_rng(0)
    # Ids beyond 65,535 on purpose: 32-bit storage.
    alphabet = np.array([3, 7, 70000, 70001, 123456])
    docs = [rng.choice(alphabet, size=rng.integers(5, 40)).tolist() for _ in range(30)]
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(200000))
    build_index(docs, tmp_path / "idx", name, vocab_hash, vocab_size, sources=["unit"])
    return docs, InfinigramIndex(tmp_path / "idx")


@pytest.mark.parametrize("dense_range", [2048, 1])  # 1: every range takes the binary-search path
def test_index_round_trip_matches_brute_force(small_index, monkeypatch, dense_range):
    from hf_accel.speculative.drafters import index as index_module

    monkeypatch.setattr(index_module, "_DENSE_RANGE", dense_range)
    docs, index = small_index
    assert index.header.num_documents == 30 and index.header.num_tokens == sum(map(len, docs)) + 30
    rng = np.random.default_rng(1)
    for _ in range(40):
        doc = docs[rng.integers(len(docs))]
        start = rng.integers(len(doc))
        context = doc[max(0, start - 12) : start + 1] if rng.random() < 0.7 else rng.choice([3, 7, 70000], 6).tolist()
        m, lo, hi = index.longest_suffix(context)
        assert m == _brute_longest_suffix(docs, context)
        if m:
            conts = index.continuations(lo, hi, depth=4, max_support=10**6)
            got = sorted(tuple(int(t) for t in row if t >= 0) for row in conts)
            assert got == _brute_continuations(docs, context, m, 4)


def test_unknown_token_and_empty_context(small_index):
    _, index = small_index
    assert index.longest_suffix([]) == (0, 0, 0)
    assert index.longest_suffix([5]) == (0, 0, 0)


def test_tokenizer_mismatch_is_refused(small_index):
    _, index = small_index
    index.check_tokenizer(FakeTokenizer(200000))
    with pytest.raises(ValueError, match="different tokenizer|vocabulary hash"):
        index.check_tokenizer(FakeTokenizer(200000, shift=1))
    with pytest.raises(ValueError, match="Rebuild the index"):
        InfinigramDrafter(index, tokenizer=FakeTokenizer(1000))


@pytest.mark.parametrize(
    "option, message",
    [
        ({"min_match": 0}, r"min_match must be an integer >= 1, got 0"),
        ({"max_nodes": 2.5}, r"max_nodes must be an integer >= 1, got 2\.5"),
        ({"max_depth": True}, r"max_depth must be an integer >= 1, got True"),
        ({"min_match": 4, "max_match": 3}, r"max_match 3 is below min_match 4"),
        ({"threshold": 1.5}, r"threshold must be in \[0, 1\], got 1\.5"),
        ({"threshold": float("nan")}, r"threshold must be in \[0, 1\], got nan"),
        ({"prior": -1.0}, r"prior must be finite and non-negative, got -1\.0"),
        ({"alpha": float("inf")}, r"alpha must be finite and non-negative, got inf"),
        ({"context_weight": 0.0}, r"context_weight must be finite and positive, got 0\.0"),
    ],
)
def test_drafting_knobs_outside_their_range_are_refused_in_one_line(option, message):
    """`min_match=0` silently drafted nothing: B.3's unigram fallback is not drafted."""
    with pytest.raises(ValueError, match=rf"^InfinigramConfig\.{message}$"):
        InfinigramConfig(**option)


def test_context_matches_brute_force():
    for short in ([], [5]):  # no earlier position to match
        ends, lengths = context_matches(np.array(short, dtype=np.int64))
        assert ends.tolist() == lengths.tolist() == [] and ends.dtype == lengths.dtype == np.int64
    rng = np.random.default_rng(2)
    for _ in range(30):
        context = rng.integers(0, 4, size=rng.integers(2, 40))
        ends, lengths = context_matches(context, max_match=64)
        expected = {}
        for i in range(len(context) - 1):
            length = 0
            while length <= i and context[i - length] == context[len(context) - 1 - length]:
                length += 1
            if length:
                expected[i] = length
        assert dict(zip(ends.tolist(), lengths.tolist())) == expected


def test_simulated_acceptance_keeps_the_first_deepest_matching_path():
    """Greedy verification accepts the deepest path of nodes that match the target; a sibling with the same token as a
    node on it (numbered after it) matches too, at a depth no deeper, and does not replace it."""
    from hf_accel.speculative.drafters.simulate import accepted_length, accepted_nodes

    tokens, parents = [5, 6, 5, 7], [-1, 0, -1, 1]  # node 2 repeats node 0
    assert accepted_length(tokens, parents, [5, 6, 7, 9]) == 3
    assert accepted_nodes(tokens, parents, [5, 6, 7]) == {0, 1, 3}
    assert accepted_length(tokens, parents, [5, 6, 8]) == 2 and accepted_nodes(tokens, parents, [5, 6, 8]) == {0, 1}
    assert accepted_nodes(tokens, parents, [5, 8]) == {0} and accepted_nodes(tokens, parents, [4]) == set()


def test_trie_and_selection():
    conts = np.array([[1, 2, 3], [1, 2, 4], [5, -1, -1]])
    tokens, parents, weights = build_weighted_trie(conts, np.array([1.0, 2.0, 0.5]))
    # level order: (root,1) (root,5) | (0,2) | (2,3) (2,4)
    assert tokens == [1, 5, 2, 3, 4] and parents == [-1, -1, 0, 2, 2] and weights == [3.0, 0.5, 3.0, 1.0, 2.0]
    scores = [w / 3.5 for w in weights]
    assert select_tree_nodes(parents, scores, 3, 0.1, chain=False) == [0, 2, 4]
    assert select_tree_nodes(parents, scores, 8, 0.1, chain=True) == [0, 2, 4]
    assert select_tree_nodes(parents, scores, 8, 0.0, chain=False) == [0, 1, 2, 3, 4]
    pruned = build_weighted_trie(conts, np.array([1.0, 2.0, 0.5]), min_weight=1.5)
    assert pruned == ([1, 2, 4], [-1, 0, 1], [3.0, 3.0, 2.0])


@pytest.mark.parametrize("tree, calibrate", [(False, True), (True, True), (True, False)])
def test_infinigram_greedy_identity_tiny_model(tiny_llama, tmp_path, tree, calibrate):
    """Context-only and indexed drafting never change greedy output (batch 3, ragged); uncalibrated, the drafter sizes
    its trees by the raw node scores."""
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 5, 6], [8, 9, 10, 8, 9, 10, 8], [0, 11, 12, 13, 11, 12, 13]])
    attention_mask = (input_ids != 0).long()
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 30, "do_sample": False}
    reference = tiny_llama.generate(**kwargs)
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(97))
    build_index([row.tolist() for row in reference], tmp_path / "idx", name, vocab_hash, vocab_size)
    for index in (None, tmp_path / "idx"):
        config = InfinigramConfig(tree=tree, adaptive_cost=False, calibrate=calibrate)
        drafter = InfinigramDrafter(index, FakeTokenizer(97), config)
        out = tiny_llama.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
        assert torch.equal(out, reference)
    assert out.speculative_stats.mean_accepted > 3  # the index holds these very outputs
    assert (drafter.calibrator is None) == (not calibrate)


def test_the_drafters_package_says_where_its_drafters_register():
    """Its docstring said every drafter module registers itself; infinigram.py registers nothing, the package does,
    and a newcomer adding a drafter looked for the call in the wrong file."""
    from hf_accel.speculative import drafters

    registered = [line for line in drafters.__doc__.splitlines() if "register_drafter" in line]
    assert registered and "Each drafter module" not in drafters.__doc__
    assert all(f"`{name}`" in drafters.__doc__ for name in drafters.available_drafters())


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "a drafter name must be non-empty and contain no ':', got ''"),
        ("ngram:v2", "a drafter name must be non-empty and contain no ':', got 'ngram:v2'"),  # `name:artifact`
        ("vanilla", "'vanilla' is a benchmark baseline, not a drafter name"),
        ("pld", "'pld' is a benchmark baseline, not a drafter name"),
    ],
)
def test_a_drafter_name_that_method_strings_cannot_name_is_refused(name, message):
    from hf_accel.speculative.drafters import available_drafters, register_drafter

    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        register_drafter(name, lambda artifact, model, tokenizer: None)
    assert name not in available_drafters()


def test_the_ngram_chain_drafter_drafts_one_path():
    from hf_accel.speculative.drafters import build_drafter

    chain, tree = build_drafter("ngram-chain", None, None, None), build_drafter("ngram", None, None, None)
    assert isinstance(chain, InfinigramDrafter) and chain.index is None
    context = np.array([5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6])  # three continuations of `5 6`
    tokens, parents, _ = chain.draft_row(context, 3, 8)
    assert tokens and parents == list(range(-1, len(tokens) - 1))
    assert len(set(tree.draft_row(context, 3, 8)[1])) < len(tree.draft_row(context, 3, 8)[1])  # siblings


def test_registry_and_index_build_cli(tmp_path, capsys):
    import json

    from hf_accel.cli import main
    from hf_accel.speculative.drafters import available_drafters, build_drafter

    assert "ngram" in available_drafters()
    with pytest.raises(ValueError, match="unknown drafter"):
        build_drafter("nope", None, None, None)
    text = tmp_path / "a.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    assert main(["index", "build", "--out", str(tmp_path / "idx"), "--text", str(text), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] > 100 and result["documents"] == 1 and result["build_tokens_per_s"] > 0
    # A Hub-ready artifact: card naming the base model, and custom_generate/ drafting from this index
    card = (tmp_path / "idx" / "README.md").read_text()
    assert (
        result["model_card"] == str(tmp_path / "idx" / "README.md") and "HuggingFaceTB/SmolLM2-135M-Instruct" in card
    )
    generate_py = (tmp_path / "idx" / "custom_generate" / "generate.py").read_text()
    assert "DRAFTER = 'ngram'" in generate_py and f"ARTIFACT = {str((tmp_path / 'idx').resolve())!r}" in generate_py
    from transformers import AutoTokenizer

    from hf_accel.loading import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    drafter = build_drafter("ngram", str(tmp_path / "idx"), None, tokenizer)
    assert drafter.index.header.num_documents == 1
    with pytest.raises(ValueError, match="Rebuild the index"):
        build_drafter("ngram", str(tmp_path / "idx"), None, FakeTokenizer(49152))
    # Rebuilt in place for a local model directory (no Hub id, no card): the earlier card and custom_generate/
    # described the index it replaced, and would have been published with it
    local = ["--model", resolve_model("smollm2-135m"), "--out", str(tmp_path / "idx"), "--text", str(text), "--json"]
    assert main(["index", "build", *local]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model_card"] is None
    assert sorted(os.listdir(tmp_path / "idx")) == sorted(INDEX_FILES)


def test_width_choice_follows_the_cost_model():
    from hf_accel.speculative.cost import PassCostModel, interpolate_cost
    from hf_accel.speculative.drafters.infinigram import choose_tree_width

    points = ((1, 1.0), (2, 1.3), (16, 1.45), (32, 2.0), (64, 4.1))
    assert interpolate_cost(1, points) == 1.0 and interpolate_cost(24, points) == pytest.approx(1.725)
    assert interpolate_cost(96, points) == pytest.approx(6.2)
    assert interpolate_cost(8, [(1, 1.5)]) == 1.5  # one point: constant (it raised IndexError)
    assert interpolate_cost(300, [(1, 1.0), (8, 1.02), (16, 1.01)]) == 1.01  # a noisy dip is not extrapolated to 0
    for bad in ((), ((1, 1.0), (1, 1.2)), ((0, 1.0),), ((1, 0.0),)):  # ZeroDivisionError, IndexError, nonsense
        with pytest.raises(ValueError, match="pass cost curve"):
            PassCostModel(bad)
    cost = PassCostModel(points, adaptive=False)
    assert choose_tree_width([[0.2]], cost, 16) == 0  # 1.2 tokens for 1.3x the time: not worth it
    assert choose_tree_width([[0.9, 0.8, 0.7] + [0.05] * 13], cost, 16) == 15  # nearly free up to 16 tokens
    # batch 8: the padded width multiplies the pass size
    assert choose_tree_width([[0.9, 0.6, 0.3, 0.1]] * 8, cost, 16) == 2


def test_cost_model_learns_from_observed_passes():
    from hf_accel.speculative.cost import PassCostModel
    from hf_accel.speculative.drafters.infinigram import choose_tree_width

    model = PassCostModel(((1, 1.0), (2, 1.3), (16, 1.45), (32, 2.0), (64, 4.1)))
    scores = [[0.9, 0.8, 0.7] + [0.05] * 13]
    assert model.needs_anchor(1) and choose_tree_width(scores, model, 16) == 15
    model.observe(1, 0.2)
    model.observe(16, 0.6)  # 16 tokens cost 3x a plain pass on this (loaded) machine
    assert not model.needs_anchor(1)
    # one time each: no count is settled yet, so every observed one counts; 2 lies on the line from 1 to 16, and 32
    # is scaled from 16 by the default shape
    assert model.cost(16) == 0.6 and model.cost(2) == pytest.approx(0.2 + 0.4 / 15)
    assert model.cost(32) == pytest.approx(0.6 * 2.0 / 1.45)
    assert choose_tree_width(scores, model, 16) == 3  # only the confident nodes are worth it now


def test_one_slow_pass_does_not_price_a_token_count_for_good():
    """A count's own times are its estimate only once it has `min_samples` of them, and then their median: one 241 ms
    pass at 5 tokens (session 28) no longer keeps the drafter off 5 tokens."""
    from hf_accel.speculative.cost import PassCostModel

    model = PassCostModel()
    for _ in range(5):
        model.observe(4, 0.031)
        model.observe(8, 0.051)
    model.observe(5, 0.241)
    assert model.cost(5) == pytest.approx(0.036)  # on the line from 4 to 8 tokens
    model.observe(5, 0.035)
    model.observe(5, 0.036)
    assert model.cost(5) == 0.036  # the median of three
    for _ in range(5):
        model.observe(4, 0.041)  # a slower machine now: only the last `window` times count
    assert model.cost(4) == 0.041
    with pytest.raises(ValueError, match="min_samples"):
        PassCostModel(window=2, min_samples=3)


def test_cost_model_estimates_while_another_thread_observes_a_new_pass_size(monkeypatch):
    """One drafter serving `generate` calls in two threads: a pass size observed in one while the other's `cost`
    scans the observed sizes (simulated here at each median it takes) failed that thread's `generate` with
    'dictionary changed size during iteration'."""
    from hf_accel.speculative import cost

    model = cost.PassCostModel()
    model.observe(1, 0.2)
    model.observe(16, 0.6)
    expected = model.cost(12)  # between the observed sizes 1 and 16
    median = cost.statistics.median

    def median_while_another_thread_observes(times):
        model.observe(1000 + len(model.observed), 1.0)
        return median(times)

    monkeypatch.setattr(cost.statistics, "median", median_while_another_thread_observes)
    model.observe(16, 0.6)  # the same median; the cached estimates are dropped, so they are scanned again
    assert model.cost(12) == expected and len(model.observed) > 2


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("humaneval", ("humaneval", 0, None)),
        ("humaneval[:100]", ("humaneval", 0, 100)),
        ("humaneval[100:]", ("humaneval", 100, None)),
        ("data/my prompts.jsonl[10:30]", ("data/my prompts.jsonl", 10, 20)),
    ],
)
def test_self_distill_prompt_slices(source, expected):
    from hf_accel.speculative.cli import parse_prompt_slice

    assert parse_prompt_slice(source) == expected


def test_empty_prompt_slice_is_an_error():
    from hf_accel.speculative.cli import parse_prompt_slice

    with pytest.raises(ValueError, match="empty prompt slice"):
        parse_prompt_slice("humaneval[5:5]")


def test_index_loads_by_hub_id_from_the_cache_offline(small_index, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from hf_accel.hub import populate_hub_cache

    docs, index = small_index
    cache = tmp_path / "hub"
    populate_hub_cache(index.path, "hf-accel-test/tiny-index", cache_dir=cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = InfinigramIndex("hf-accel-test/tiny-index")
    assert loaded.path != index.path and loaded.header == index.header
    context = np.array(docs[0][:6])
    assert loaded.longest_suffix(context, 64) == index.longest_suffix(context, 64)
    with pytest.raises(FileNotFoundError, match="no Hub repository of that id"):
        InfinigramIndex("hf-accel-test/missing-index")


def _fingerprint():
    return tokenizer_fingerprint(FakeTokenizer(200000))


def test_failed_rebuild_keeps_the_old_index_and_a_new_dir_is_removed(small_index, tmp_path, monkeypatch):
    import pydivsufsort

    _, index = small_index
    before = {p.name: p.read_bytes() for p in index.path.iterdir()}

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(pydivsufsort, "divsufsort", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_index([[3, 7, 3]], index.path, *_fingerprint())
    assert {p.name: p.read_bytes() for p in index.path.iterdir()} == before  # no scratch dir, same files
    fresh = tmp_path / "new" / "deeper" / "idx"
    with pytest.raises(KeyboardInterrupt):
        build_index([[3, 7, 3]], fresh, *_fingerprint())
    assert not (tmp_path / "new").exists()  # nor the parents it created


def test_suffix_array_is_pydivsufsort_s_in_20_bytes_a_token():
    """The index sorts the ids' big-endian bytes itself and keeps the token-boundary suffixes a chunk at a time: the
    array pydivsufsort gives for the ids, at 20 bytes a token at the peak, where pydivsufsort's own handling of uint32
    ids took 44 (an offset copy of the ids and a whole `array % 4`: 0.7 GB more at 3·10^7 tokens)."""
    import tracemalloc

    from pydivsufsort import divsufsort

    rng = np.random.default_rng(0)
    for vocab in (5, 128_256):  # repeats everywhere; ids past 16 bits
        tokens = rng.integers(0, vocab, 50_000).astype("<u4")
        tokens[::97] = SEPARATOR
        expected = divsufsort(np.ascontiguousarray(tokens[::-1]))
        assert np.array_equal(reversed_suffix_array(tokens, chunk=1000), expected)
    tracemalloc.start()  # sees numpy's and ctypes' buffers
    try:
        reversed_suffix_array(tokens, chunk=len(tokens) // 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 22 * len(tokens)


def test_an_index_with_files_of_the_wrong_size_is_refused(small_index):
    _, index = small_index
    sa = index.path / "sa.bin"
    original = sa.read_bytes()
    sa.write_bytes(original[:-4])
    with pytest.raises(ValueError, match=r"sa\.bin should hold .* but it has"):
        InfinigramIndex(index.path)
    sa.write_bytes(sa.read_bytes()[:-1])  # not a whole number of entries
    with pytest.raises(ValueError, match=r"sa\.bin should hold"):
        InfinigramIndex(index.path)
    sa.write_bytes(original)
    (index.path / "first.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(ValueError, match=r"first\.npy cannot be read"):
        InfinigramIndex(index.path)
    (index.path / "first.npy").write_bytes(b"")  # a download cut short: numpy raises EOFError
    with pytest.raises(ValueError, match=r"first\.npy cannot be read"):
        InfinigramIndex(index.path)


def test_index_build_cli_errors_are_one_line_and_come_before_loading(tmp_path, capsys):
    from hf_accel.cli import main

    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--out", str(tmp_path / "o")], "nothing to index: pass --text FILE..., --dataset NAME, or --self-distill"),
        (["--out", str(a_file), "--text", str(text)], "existing file"),
        (["--out", str(tmp_path / "o"), "--text", str(tmp_path / "missing.txt")], "not found"),
        # the model does not exist: these must fail on the options first
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--self-distill", "x", "--batch-size", "0"],
         "at least 1"),
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--self-distill", "x", "--samples", "-1"],
         "--samples must be at least 0"),
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--self-distill", "x", "--samples", "2",
          "--temperature", "0"], "--temperature must be positive"),
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--self-distill", "x[3:1]"], "empty prompt"),
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--self-distill", "/no/such.jsonl"], "not found"),
        (["--model", "./no-such-model", "--out", str(tmp_path / "o"), "--text", str(text)], "no-such-model"),
        (["--out", str(tmp_path / "o"), "--dataset", "hf-accel-test/no-such-dataset"], "cannot load dataset"),
        (["--out", str(tmp_path / "used"), "--text", str(text)], "holds files that are not an index"),
    ]  # fmt: skip
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "model.safetensors").write_text("x")  # e.g. a checkpoint
    for argv, message in cases:
        assert main(["index", "build", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


class _CharTokenizer:
    """A left-padding character tokenizer for self-distillation on the tiny model."""

    pad_token_id = 0

    def __call__(self, texts, **kwargs):
        ids = [[1 + (ord(c) % 90) for c in text] for text in texts]
        width = max(map(len, ids))
        rows = [[0] * (width - len(r)) + r for r in ids]
        return {
            "input_ids": torch.tensor(rows),
            "attention_mask": torch.tensor([[int(t != 0) for t in r] for r in rows]),
        }


def test_self_distill_resumes_after_a_truncated_last_line(tiny_llama, tmp_path):
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, self_distill

    Tok = _CharTokenizer

    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello", "xyz!"])]

    class Broken(Tok):
        def __call__(self, texts, **kwargs):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        self_distill(tiny_llama, Broken(), prompts, tmp_path / "sd", max_new_tokens=4, use_speculation=False)
    assert not (tmp_path / "sd").exists()  # a failed first batch leaves no empty --out
    answers = self_distill(tiny_llama, Tok(), prompts, tmp_path, max_new_tokens=4, batch_size=2, use_speculation=False)
    cache = tmp_path / SELF_DISTILL_CACHE
    lines = cache.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    cache.write_text("".join(lines[:2]) + lines[2][:10])  # killed in the middle of the last line
    again = self_distill(tiny_llama, Tok(), prompts, tmp_path, max_new_tokens=4, batch_size=2, use_speculation=False)
    assert again == answers
    records = [json.loads(line) for line in cache.read_text().splitlines()]  # the cut line is gone, not glued
    assert sorted(r["tokens"] for r in records) == sorted(answers)
    cache.write_text("".join(lines).rstrip("\n"))  # saved by hand without a final newline: every record kept

    class NothingToGenerate(Tok):
        def __call__(self, texts, **kwargs):
            raise AssertionError(f"regenerated {texts}")

    cached = self_distill(tiny_llama, NothingToGenerate(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)
    assert cached == answers and cache.read_text() == "".join(lines)
    cache.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not a self-distillation record"):
        self_distill(tiny_llama, Tok(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)


def test_a_killed_build_is_rebuilt_and_its_staging_dir_removed(small_index, tmp_path, capsys):
    from hf_accel.cli import main

    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    killed = tmp_path / "killed"
    (killed / ".staging-abc").mkdir(parents=True)  # a build killed before its swap: nothing else in --out
    (killed / ".staging-abc" / "tokens.u32").write_bytes(b"\0" * 8)
    live = killed / f".staging-{os.getppid()}-xyz"  # a running process's (pytest's parent): left alone
    live.mkdir()
    elsewhere = killed / ".staging-999999999@another_host-xyz"  # another machine's, on shared storage: left alone
    elsewhere.mkdir()
    half = tmp_path / "half"
    shutil.copytree(small_index[1].path, half)
    (half / "header.json").unlink()  # a rebuild killed in its swap (the header goes first)
    for out in (killed, half):
        assert main(["index", "build", "--out", str(out), "--text", str(text)]) == 0, capsys.readouterr().err
        kept = sorted(p.name for p in out.glob(".staging-*"))
        assert kept == (sorted([live.name, elsewhere.name]) if out == killed else [])
        assert InfinigramIndex(out).header.num_documents == 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: {**h, "added_later": 1}, None),  # unknown keys are ignored
        (lambda h: [1], "format version"),
        (lambda h: {k: v for k, v in h.items() if k != "vocab_size"}, "not a valid index header"),
        (lambda h: {**h, "sa_dtype": "nonsense"}, "not a valid index header"),
        (lambda h: {**h, "num_tokens": "12"}, "not a valid index header"),
        (lambda h: {**h, "num_tokens": 0, "num_documents": 0}, "not a valid index header"),  # numpy: empty mmap
        (lambda h: {**h, "num_documents": h["num_tokens"]}, "not a valid index header"),
        (lambda h: {**h, "vocab_size": True}, "not a valid index header"),
        (None, "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # json: RecursionError
    ],
)
def test_a_malformed_header_is_one_clear_error(small_index, tmp_path, edit, message):
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    header = json.loads((path / "header.json").read_text())
    text = edit if isinstance(edit, str) else "{not json" if edit is None else json.dumps(edit(header))
    (path / "header.json").write_text(text)
    if message is None:
        assert InfinigramIndex(path).header.num_tokens == header["num_tokens"]
    else:
        with pytest.raises(ValueError, match=message):
            InfinigramIndex(path)


def test_a_header_larger_than_the_cap_is_refused_before_it_is_read(small_index, tmp_path):
    # header.json was read whole: an untrusted index directory could hand a file of any size (a sparse one costs no
    # disk); one byte past the cap, even of valid JSON (trailing whitespace), is one clear error
    cap = 1 << 24  # 16 MiB
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    text = (path / "header.json").read_text()
    (path / "header.json").write_text(text + " " * (cap - len(text)))
    assert InfinigramIndex(path).header.num_tokens == small_index[1].header.num_tokens  # at the cap: read
    with open(path / "header.json", "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"header.json is larger than an index header's 16,777,216 bytes; not read"):
        InfinigramIndex(path)


def test_sources_too_long_for_a_header_are_refused_before_the_build(tmp_path):
    # a header over the cap would be written and then refused by every load: the build refuses it first, writing nothing
    sources = [f"/data/shard-{i:07d}.txt" for i in range(700_000)]
    with pytest.raises(ValueError, match="`sources` take .* bytes of JSON; a header holds at most 16,777,216"):
        build_index([[3, 7, 3]], tmp_path / "idx", *_fingerprint(), sources=sources)
    assert not (tmp_path / "idx").exists()
    build_index([[3, 7, 3]], tmp_path / "idx", *_fingerprint(), sources=sources[:1000])
    assert len(InfinigramIndex(tmp_path / "idx").header.sources) == 1000


def test_a_first_table_of_another_index_is_refused(small_index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    first = np.load(path / "first.npy")
    np.save(path / "first.npy", first.astype(np.float64))
    with pytest.raises(ValueError, match="does not match the header"):
        InfinigramIndex(path)
    np.save(path / "first.npy", first[:-1].tolist() + [first[-1] + 1])
    with pytest.raises(ValueError, match="does not match the header"):
        InfinigramIndex(path)


def test_text_files_are_tokenized_in_chunks_as_a_whole(tmp_path):
    import textwrap

    from hf_accel.loading import load_tokenizer
    from hf_accel.speculative.drafters.build import iter_text_file_documents

    tokenizer = load_tokenizer("smollm2-135m")  # byte-level BPE: spaces and indentation glue to what follows
    path = tmp_path / "a.txt"
    blank_line_then_long = "Title\n\n" + "lorem ipsum dolor " * 60 + "\n"  # the last line break is in the run
    for text in (Path(textwrap.__file__).read_text(), "word " * 3000, blank_line_then_long):
        path.write_text(text)
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        for chunk_chars in (500, 2000):
            assert next(iter_text_file_documents([path], tokenizer, chunk_chars=chunk_chars)) == whole
    with pytest.raises(ValueError, match="chunk_chars must be positive"):  # it looped forever
        next(iter_text_file_documents([path], tokenizer, chunk_chars=0))
    # whitespace runs longer than a chunk (a cut inside one changes how the tokenizer splits it): the chunk grows
    long_runs = (
        "word " + " " * 100 + "next word here\n" * 50,
        "alpha beta " * 30 + " " * 600 + "gamma delta\n" * 40,
        "alpha beta. " * 30 + "\n" * 600 + "gamma delta\n" * 40,
        ("def f():\n" + " " * 400 + "return 1\n") * 10,
        "some words here\n" * 20 + " " * 700,  # the text ends in the run: the chunk takes the rest
        "some words here\n" * 20 + " " * 701 + "end",
        " " * 1000,
        "alpha beta\n" * 30 + "\n" * 300 + "   gamma\n" * 20,  # one piece: a window must hold the whole run
        "x" * 600,  # one word: it is not cut
        "some words here\n" * 20 + "y" * 700,  # the text ends in a word longer than the chunk: the rest is one chunk
    )
    for text in long_runs:
        path.write_text(text)
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        for chunk_chars in (100, 300):
            assert next(iter_text_file_documents([path], tokenizer, chunk_chars=chunk_chars)) == whole


def test_text_file_chunks_of_a_tokenizer_no_cut_satisfies_end_at_whitespace(tmp_path):
    """A tokenizer that adds a piece to every call (a prefix space) never tokenizes a cut's two sides as their whole:
    chunks then end at the last whitespace before their end, not inside a word; a missing file is named."""
    from hf_accel.speculative.drafters.build import iter_text_file_documents

    def prefixing(text, add_special_tokens=False):
        return {"input_ids": [0] + [ord(c) for c in text]}

    path = tmp_path / "a.txt"
    path.write_text("ab cd ef gh")
    pieces = ["ab", " cd", " ef", " gh"]  # chunks of about 4 characters, each cut before a space
    expected = [token for piece in pieces for token in prefixing(piece)["input_ids"]]
    assert next(iter_text_file_documents([path], prefixing, chunk_chars=4)) == expected
    with pytest.raises(FileNotFoundError, match=r"^text file not found: .*missing\.txt$"):
        next(iter_text_file_documents([tmp_path / "missing.txt"], prefixing))


def test_text_file_chunks_keep_the_tokens_of_a_llama3_style_tokenizer(tmp_path):
    """Llama 3 and Qwen pre-tokenizers glue line breaks to the punctuation before them (`.` + `\\n\\n` is one piece):
    a cut before a line break would split such a piece."""
    import textwrap

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_accel.speculative.drafters.build import iter_text_file_documents

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    text = Path(textwrap.__file__).read_text()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator([text], trainers.BpeTrainer(vocab_size=1000, initial_alphabet=alphabet))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    path = tmp_path / "a.txt"
    path.write_text(text)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    for chunk_chars in (500, 2000):
        assert next(iter_text_file_documents([path], tokenizer, chunk_chars=chunk_chars)) == whole
    # a run longer than the chunk, then the text's last word and line break (`.` + `\n` is one piece): the cut past
    # the line break is the end of the text
    for text in ("alpha beta " * 30 + " " * 600 + "end.\n", " " * 1000):
        path.write_text(text)
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert next(iter_text_file_documents([path], tokenizer, chunk_chars=100)) == whole


def test_the_self_distillation_cache_is_per_model_weights(tmp_path):
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, _cache_key, self_distill
    from tests.conftest import make_tiny_llama

    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello"])]
    cache = tmp_path / SELF_DISTILL_CACHE
    legacy = {"key": _cache_key("m", "abc", 4), "question_id": "0", "tokens": [7, 7]}  # written before fingerprints
    cache.write_text(json.dumps(legacy) + "\n")

    def run(model):
        return self_distill(model, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, model_name="m",
                            use_speculation=False)  # fmt: skip

    first = run(make_tiny_llama(seed=0))
    assert first[0] == [7, 7]  # trusted
    assert run(make_tiny_llama(seed=0)) == first  # the same weights: all cached
    other = make_tiny_llama(seed=1)  # another model saved under the same name
    answers = run(other)
    assert answers == [self_distill(other, _CharTokenizer(), [p], tmp_path / "fresh", max_new_tokens=4,
                                    use_speculation=False)[0] for p in prompts]  # fmt: skip
    lines = cache.read_text().splitlines()
    assert len(lines) == 2  # the old answers were replaced, not kept beside the new ones
    cache.write_text(lines[0] + "\n" + "\n".join(lines) + "\n")  # a run killed while replacing left a duplicate
    assert run(other) == answers and len(cache.read_text().splitlines()) == 2


def test_two_self_distillations_rewriting_one_cache_at_once_both_finish(tmp_path, monkeypatch):
    """Another process can rewrite the cache (stamping or replacing records) while this one rewrites it: neither may
    fail, and the file keeps one whole record per prompt that a rerun takes without generating."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters import build
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(seed=0)
    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello", "xyz"])]
    cache = tmp_path / build.SELF_DISTILL_CACHE
    legacy = {"key": build._cache_key("", "abc", 4), "question_id": "0", "tokens": [7, 7]}  # stamped by a rewrite
    cache.write_text(json.dumps(legacy) + "\n")

    def run():
        return build.self_distill(model, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)

    replace, other, waiting = os.replace, [], []

    def other_process_meanwhile(src, dst):
        if not other:  # the other process's whole run, once, while this one is about to swap its rewrite in
            other.append(None)
            _run_now_or_when_the_cache_lock_is_free(tmp_path, lambda: other.__setitem__(0, run()), waiting)
        return replace(src, dst)

    monkeypatch.setattr(build.os, "replace", other_process_meanwhile)
    answers = run()
    for thread in waiting:  # the other run waited for the cache lock, held from this one's re-read to its rename
        thread.join()
    assert other == [answers] and answers[0] == [7, 7]
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    assert sorted(r["question_id"] for r in records) == ["0", "1", "2"]
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("regenerated a cached answer"))
    assert run() == answers


def test_two_self_distillations_of_one_cache_at_once_leave_one_record_per_prompt(tmp_path, monkeypatch):
    """Two `index build --self-distill` sharing one cache, started at once: both read it empty, both answer every prompt
    and append; each prompt's answer was left in the file twice, and heal corpora and simulations take every line."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters import build
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(seed=0)
    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello", "xyz"])]
    cache = tmp_path / build.SELF_DISTILL_CACHE

    def run():
        return build.self_distill(model, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)

    generate, other = model.generate, []

    def the_other_process_finishes_first(*args, **kwargs):  # this run has read the (empty) cache
        monkeypatch.setattr(model, "generate", generate)
        other.append(run())
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", the_other_process_finishes_first)
    answers = run()
    assert other == [answers]
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    assert sorted(r["question_id"] for r in records) == ["0", "1", "2"]
    assert {r["key"]: r["tokens"] for r in records} == {
        build._cache_key("", p.text, 4): a for p, a in zip(prompts, answers)
    }


def test_the_self_distillation_cache_is_per_generation_config(tmp_path):
    """A `generation_config.json` fixed after a first build (another EOS id, a repetition penalty) changes the greedy
    answers with the same weights: the cached answers of the old config must not be reused."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import self_distill
    from tests.conftest import make_tiny_llama

    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello"])]

    def run(model, out):
        return self_distill(model, _CharTokenizer(), prompts, out, max_new_tokens=6, use_speculation=False)

    model = make_tiny_llama(seed=0)
    first = run(model, tmp_path)
    model.generation_config.eos_token_id = first[0][2]  # a token the first answer holds now ends it
    model.generation_config.repetition_penalty = 1.5
    fresh = run(model, tmp_path / "fresh")
    assert fresh != first and run(model, tmp_path) == fresh
    assert len((tmp_path / "self_distill.jsonl").read_text().splitlines()) == 2  # the old answers were replaced


def test_answers_stamped_with_the_weights_only_fingerprint_are_not_regenerated(tmp_path):
    """Caches written before the generation config was part of the stamp hold the weights-only fingerprint: like
    records without a stamp, they are this model's answers, re-stamped, not all generated again."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, _cache_key, model_fingerprint, self_distill
    from tests.conftest import make_tiny_llama

    model, other = make_tiny_llama(seed=0), make_tiny_llama(seed=1)
    prompts = [BenchPrompt(question_id="0", category="t", text="abc")]
    cache = tmp_path / SELF_DISTILL_CACHE
    stamped = {"key": _cache_key("m", "abc", 4), "question_id": "0", "model": model_fingerprint(model), "tokens": [7]}
    cache.write_text(json.dumps(stamped) + "\n")

    def run(model):
        return self_distill(model, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, model_name="m",
                            use_speculation=False)  # fmt: skip

    assert run(model) == [[7]] and run(model) == [[7]]
    assert json.loads(cache.read_text())["model"] != model_fingerprint(model)  # re-stamped with the config
    assert run(other) != [[7]]  # another model's weights-only stamp is still another model's


def test_rewriting_the_self_distillation_cache_keeps_its_permissions(tmp_path):
    """The rewrite goes through a `mkstemp` file, which is private (0600): an index directory shared with others (its
    cache group-readable) must not become unreadable to them because a record was stamped."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, _cache_key, self_distill
    from tests.conftest import make_tiny_llama

    cache = tmp_path / SELF_DISTILL_CACHE
    cache.write_text(json.dumps({"key": _cache_key("m", "abc", 4), "question_id": "0", "tokens": [7]}) + "\n")
    cache.chmod(0o664)
    prompts = [BenchPrompt(question_id="0", category="t", text="abc")]
    answers = self_distill(make_tiny_llama(seed=0), _CharTokenizer(), prompts, tmp_path, max_new_tokens=4,
                           model_name="m", use_speculation=False)  # fmt: skip
    assert answers == [[7]] and "model" in json.loads(cache.read_text())  # stamped: the file was rewritten
    assert cache.stat().st_mode & 0o777 == 0o664


def test_the_self_distillation_cache_is_per_dtype(tmp_path):
    """Weights that bfloat16 holds exactly (a bfloat16 checkpoint loaded in float32) have the same values in both
    dtypes, but not the same greedy answers: answers cached in one dtype were reused in the other."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import model_fingerprint, self_distill
    from tests.conftest import make_tiny_llama

    full = make_tiny_llama(seed=0).to(torch.bfloat16).float()
    half = make_tiny_llama(seed=0).to(torch.bfloat16)
    assert model_fingerprint(full) != model_fingerprint(half)
    prompts = [BenchPrompt(question_id="0", category="t", text="abc")]
    self_distill(full, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)
    calls = []
    generate = half.generate
    half.generate = lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs)
    self_distill(half, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)
    assert calls  # answered again in bfloat16, not taken from the float32 run


def test_sampled_self_distillation_adds_seeded_cached_sampled_answers(tiny_llama, tmp_path):
    """`samples=2` returns the greedy answers (not regenerated when cached), then two sampled answers per prompt: the
    same with the same seed and batches (torch's global generator untouched), others with another seed, cached like
    greedy ones."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, self_distill

    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["abc", "hello", "xyz!"])]
    kwargs = {"max_new_tokens": 8, "batch_size": 2}
    greedy = self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path / "a", **kwargs)

    asked = []  # every prompt text tokenized for generation

    class Counting(_CharTokenizer):
        def __call__(self, texts, **kw):
            asked.extend(texts)
            return super().__call__(texts, **kw)

    state = torch.get_rng_state()
    answers = self_distill(tiny_llama, Counting(), prompts, tmp_path / "a", samples=2, temperature=1.5, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    assert answers[:3] == greedy and len(answers) == 9
    assert sorted(asked) == sorted([p.text for p in prompts] * 2)  # only the sampled answers generated
    assert answers[3:] != greedy * 2  # temperature 1.5 on a random model: sampled answers leave the greedy ones
    again = self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path / "b", samples=2, temperature=1.5, **kwargs)
    assert again == answers
    other = self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path / "c", samples=2, temperature=1.5, seed=1,
                         **kwargs)  # fmt: skip
    assert other[:3] == greedy and other[3:] != answers[3:]
    records = [json.loads(line) for line in (tmp_path / "a" / SELF_DISTILL_CACHE).read_text().splitlines()]
    assert sorted(r.get("sample", "") for r in records) == [""] * 3 + ["1@T1.5:seed0"] * 3 + ["2@T1.5:seed0"] * 3
    asked.clear()
    cached = self_distill(tiny_llama, Counting(), prompts, tmp_path / "a", samples=2, temperature=1.5, **kwargs)
    assert cached == answers and asked == []
    with pytest.raises(ValueError, match="temperature positive"):
        self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path / "a", samples=1, temperature=0.0, **kwargs)


@pytest.mark.parametrize("use_speculation", [False, True])
def test_self_distill_pads_on_the_left_whatever_the_tokenizer_says(tmp_path, use_speculation):
    """A tokenizer as `from_pretrained` gives it (padding on the right) still gets each prompt's own greedy answer."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import _strip_after_eos, self_distill
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    assert tokenizer.padding_side == "right"
    model = make_tiny_llama(vocab_size=len(tokenizer))
    prompts = [BenchPrompt(question_id=str(i), category="t", text=t) for i, t in enumerate(["ab", "hello there"])]
    batched = self_distill(
        model, tokenizer, prompts, tmp_path / "b", max_new_tokens=6, batch_size=2, use_speculation=use_speculation
    )
    for i, prompt in enumerate(prompts):
        inputs = tokenizer(prompt.text, return_tensors="pt", add_special_tokens=False)
        reference = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        assert batched[i] == _strip_after_eos(reference.tolist(), {model.generation_config.eos_token_id})
        assert tokenizer.padding_side == "right"  # the caller's tokenizer is left as it was


def test_index_build_reports_the_documents_tokens_not_the_separators(tmp_path, capsys):
    """The stream holds one separator per document: `tokens` counts what was indexed (it counted separators too)."""
    from hf_accel.cli import main
    from hf_accel.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    texts = ["def add(a, b):\n    return a + b\n", "hello world\n", "x = 1\n"]
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(text)
    expected = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    out = tmp_path / "idx"
    assert main(["index", "build", "--out", str(out), "--text", *map(str, paths), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["tokens"], result["documents"]) == (expected, 3)
    assert f"| `tokens` | `{expected}` |" in (out / "README.md").read_text()
    assert main(["index", "build", "--out", str(out), "--text", *map(str, paths)]) == 0
    assert f"{expected:,} tokens in 3 documents" in capsys.readouterr().out
    assert InfinigramIndex(out).header.num_indexed_tokens == expected


def test_a_document_with_ids_outside_the_vocabulary_is_named_by_its_place(tmp_path):
    """Empty documents are skipped, not renumbered: the error names the bad document's position in the input."""
    with pytest.raises(ValueError, match=r"^document 2 has token ids outside \[0, 200000\)"):
        build_index([[3, 7], [], [3, 200000]], tmp_path / "idx", *_fingerprint())
    assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize(
    "documents, message",
    [
        ([[3, 7], [[1, 2], [3, 4]]], r"^document 1 is not a flat sequence of token ids \(shape \(2, 2\)\)$"),
        ([[3, 7], [[1, 2], [3]]], r"^document 1 is not a flat sequence of token ids"),  # ragged: numpy's own error
        ([[3, 7], "3 7"], r"^document 1 is not a flat sequence of token ids \(shape \(\)\)$"),  # text, not ids
        ([[], np.zeros(0, np.int64)], r"^no tokens to index: every document was empty$"),
    ],
)
def test_documents_that_are_no_token_id_sequences_are_refused_in_one_line(tmp_path, documents, message):
    with pytest.raises(ValueError, match=message) as error:
        build_index(documents, tmp_path / "idx", *_fingerprint())
    assert len(str(error.value).splitlines()) == 1
    assert not (tmp_path / "idx").exists()


def test_documents_of_float_or_bool_values_are_refused_not_truncated(tmp_path):
    for bad, dtype in (([3, 7.5], "float64"), (torch.tensor([True, False]), "bool")):
        with pytest.raises(ValueError, match=f"^document 1 holds {dtype} values, not integer token ids"):
            build_index([[3, 7], bad], tmp_path / "idx", *_fingerprint())
    build_index([torch.tensor([3, 7]), np.array([3], dtype=np.uint16)], tmp_path / "idx", *_fingerprint())
    assert InfinigramIndex(tmp_path / "idx").header.num_indexed_tokens == 3


def test_index_build_puts_everything_in_a_tilde_out_directory(tmp_path, monkeypatch, capsys):
    """`--out=~/idx` (no shell expansion after `=`): the self-distillation cache and the model card went to a `./~/idx`
    directory while the index went to `$HOME/idx`."""
    from hf_accel.cli import main
    from hf_accel.loading import hf_accel_home

    monkeypatch.setenv("HF_ACCEL_HOME", str(hf_accel_home()))  # the converted default model, before HOME moves
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    argv = ["index", "build", "--out=~/idx", "--text", str(text), "--self-distill", "chat_build[:1]"]
    assert main([*argv, "--max-new-tokens", "2"]) == 0, capsys.readouterr().err
    assert not any((tmp_path / "cwd").iterdir())
    out = tmp_path / "home" / "idx"
    assert {"README.md", "self_distill.jsonl", *INDEX_FILES} <= set(os.listdir(out))
    assert InfinigramIndex(out).header.num_documents == 2


def test_context_drafts_continue_the_most_recent_longest_match():
    """Context-only drafting by hand: the draft continues *after* the matched suffix, and with room for one
    occurrence the longest, then most recent, one is kept."""
    drafter = InfinigramDrafter(None, config=InfinigramConfig(threshold=0.0))
    tokens, parents, _ = drafter.draft_row(np.array([5, 6, 7, 8, 5, 6, 7]), depth=3, max_nodes=8)
    assert tokens[:3] == [8, 5, 6] and parents[:3] == [-1, 0, 1]
    # "5 3" occurs twice (continued by 8, then by 9), "3" alone once more (continued by 6)
    context = np.array([5, 3, 8, 5, 3, 9, 3, 6, 4, 5, 3])
    drafter = InfinigramDrafter(None, config=InfinigramConfig(threshold=0.0, max_context_occurrences=1))
    assert drafter.draft_row(context, depth=1, max_nodes=8)[0] == [9]


def test_majority_chain_ties_go_to_the_smallest_token():
    conts = np.array([[9, 1], [4, 2], [6, 3]])  # three equal votes under the root
    tokens, parents, weights = build_weighted_trie(conts, np.ones(3))
    chosen = select_tree_nodes(parents, [w / 3 for w in weights], 8, 0.0, chain=True)
    assert [tokens[n] for n in chosen] == [4, 2]


# few 0: every range is narrowed token by token, never finished whole; dense 1: every range is binary-searched
@pytest.mark.parametrize("few,dense", [(32, 2048), (0, 2048), (32, 1), (0, 1)])
def test_a_match_reaching_the_start_of_the_stream_stops_there(tmp_path, monkeypatch, few, dense):
    from hf_accel.speculative.drafters import index as index_module

    monkeypatch.setattr(index_module, "_FEW", few)
    monkeypatch.setattr(index_module, "_DENSE_RANGE", dense)
    docs = [[5, 6, 7, 5, 6, 8], [6, 5, 6, 9]]  # the stream starts with 5, 6: nothing precedes that 5
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(16))
    build_index(docs, tmp_path / "idx", name, vocab_hash, vocab_size)
    index = InfinigramIndex(tmp_path / "idx")
    for context in ([5, 5, 6], [9, 5, 6], [6, 5, 6], [7, 5, 6], [5, 6]):
        m, lo, hi = index.longest_suffix(context)
        assert m == _brute_longest_suffix(docs, context), context
        got = sorted(tuple(int(t) for t in row if t >= 0) for row in index.continuations(lo, hi, depth=3))
        assert got == _brute_continuations(docs, context, m, 3), context


def test_continuations_past_max_support_are_a_uniform_stride_of_all(small_index):
    _, index = small_index
    _, lo, hi = index.longest_suffix([3])
    everything = index.continuations(lo, hi, depth=3, max_support=10**6)
    for max_support in (hi - lo - 1, (hi - lo) // 2, 7):
        stride = -(-(hi - lo) // max_support)  # the smallest stride that keeps at most max_support occurrences
        sampled = index.continuations(lo, hi, depth=3, max_support=max_support)
        assert len(sampled) <= max_support
        np.testing.assert_array_equal(sampled, everything[::stride])


def test_the_vocabulary_hash_covers_ids_not_only_the_token_order():
    class Vocab:
        def __init__(self, vocab):
            self.vocab, self.name_or_path = vocab, "v"

        def get_vocab(self):
            return self.vocab

    dense, gapped = Vocab({"a": 0, "b": 1}), Vocab({"a": 0, "b": 2})  # same tokens, same order, "b" another id
    assert tokenizer_fingerprint(dense)[1] != tokenizer_fingerprint(gapped)[1]
    assert tokenizer_fingerprint(gapped)[2] == 3


def test_a_context_ending_in_an_id_outside_the_index_vocabulary_matches_nothing(small_index):
    _, index = small_index
    vocab_size = index.header.vocab_size
    for last in (vocab_size, vocab_size + 1, 2**40, -1):  # a model whose embedding is wider than its tokenizer
        assert index.longest_suffix([3, 7, last]) == (0, 0, 0)


def test_strip_after_eos_drops_the_eos_and_what_follows():
    from hf_accel.speculative.drafters.build import _strip_after_eos

    assert _strip_after_eos([5, 6, 2, 7, 2], {2}) == [5, 6]
    assert _strip_after_eos([5, 6, 7], {2, 9}) == [5, 6, 7]
    assert _strip_after_eos([9, 5], {2, 9}) == []


def test_a_new_answer_length_cap_is_not_answered_from_the_cache(tiny_llama, tmp_path):
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.speculative.drafters.build import self_distill

    tiny_llama.generation_config.eos_token_id = None  # every answer runs to its cap
    prompts = [BenchPrompt(question_id="0", category="t", text="hello")]
    short = self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path, max_new_tokens=3, use_speculation=False)
    longer = self_distill(tiny_llama, _CharTokenizer(), prompts, tmp_path, max_new_tokens=6, use_speculation=False)
    assert len(short[0]) == 3 and len(longer[0]) == 6 and longer[0][:3] == short[0]


def test_index_card_and_header_name_local_inputs_without_their_directories(tmp_path, capsys):
    """The card and `header.json` are published: a text file or a `save_to_disk` dataset is named by its own name,
    not by the absolute path it had on the machine that built the index."""
    from datasets import Dataset

    from hf_accel.cli import main

    text = tmp_path / "private" / "corpus.txt"
    text.parent.mkdir()
    text.write_text("def add(a, b):\n    return a + b\n" * 5)
    Dataset.from_dict({"text": ["x = 1\n", "y = 2\n"]}).save_to_disk(tmp_path / "private" / "my_ds")
    out = tmp_path / "idx"
    argv = ["index", "build", "--out", str(out), "--text", str(text), "--dataset", str(tmp_path / "private" / "my_ds")]
    assert main(argv) == 0
    card, header = (out / "README.md").read_text(), (out / "header.json").read_text()
    for published in (card, header):
        assert str(tmp_path) not in published
    assert "text:corpus.txt" in card and "dataset:my_ds:train:text" in card


@pytest.mark.parametrize("tree", [True, False])
def test_a_unanimous_continuation_passes_a_threshold_of_one(tmp_path, tree):
    """With no prior, a node every occurrence passes through is the ∞-gram's certainty, score exactly 1: splitting a
    vote into `n` shares and adding them back gave 0.9999999999999999 for some `n` (12, 14, 18, ... occurrences in the
    index; in the context, 38, 41, 45 repeats: the matches longer than `max_match` form one group), and nothing was
    drafted at `threshold=1`."""
    config = InfinigramConfig(threshold=1.0, prior=0.0, max_context_occurrences=100, tree=tree, calibrate=False)
    for n in (38, 41, 45):
        tokens, _, scores = InfinigramDrafter(None, config=config).draft_row(np.array([1, 2] * n + [1]), 1, 8)
        assert tokens == [2] and scores == [1.0], n
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(10))
    for n in (12, 14, 18):
        build_index([[3, 4, 5]] * n, tmp_path / str(n), name, vocab_hash, vocab_size)
        config = InfinigramConfig(threshold=1.0, prior=0.0, use_context=False, tree=tree, calibrate=False)
        drafter = InfinigramDrafter(tmp_path / str(n), config=config)
        assert drafter.draft_row(np.array([3]), 2, 8) == ([4, 5], [-1, 0], [1.0, 1.0]), n


def test_the_index_header_names_a_local_model_without_its_directories(tmp_path, capsys):
    """`header.json` is published with the index: a model (and so its tokenizer) given as a local directory is named by
    its own name, as the sources are, not by the path it has on the building machine."""
    from hf_accel.cli import main
    from hf_accel.loading import resolve_model
    from hf_accel.speculative.drafters.build import build_index_from_documents

    model = tmp_path / "private" / "my-model"
    shutil.copytree(resolve_model("smollm2-135m"), model, ignore=shutil.ignore_patterns("*.safetensors"))  # tokenizer
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    argv = ["index", "build", "--model", str(model), "--out", str(tmp_path / "idx"), "--text", str(text)]
    assert main(argv) == 0, capsys.readouterr().err
    assert InfinigramIndex(tmp_path / "idx").header.tokenizer_name == "my-model"
    header, _ = build_index_from_documents([[3, 7]], FakeTokenizer(10, name=str(model)), tmp_path / "idx2", [])
    assert header.tokenizer_name == "my-model"  # the tokenizer's own `name_or_path`, a directory too


def test_simulate_ngram_takes_the_answers_of_the_model_and_length_cap_asked_for(tmp_path, monkeypatch, capsys):
    """A self-distillation cache can also hold another run's answers to the same prompts (another model, another
    `--max-new-tokens`): the simulation must use only the run it is asked about, not every line."""
    import runpy
    import sys

    from hf_accel.eval.prompts import load_prompts
    from hf_accel.loading import load_tokenizer
    from hf_accel.speculative.drafters.build import _cache_key

    shipped = Path(__file__).resolve().parents[2] / "hf_accel/data/indexes/smollm2-135m-humaneval-first100"
    clean = (shipped / "self_distill.jsonl").read_text()  # smollm2-135m's answers, max_new_tokens 128
    prompts = load_prompts("humaneval", load_tokenizer("smollm2-135m"), limit=12)
    other = [
        {"key": _cache_key("smollm2-135m", p.text, 256), "question_id": p.question_id, "model": "0" * 16,
         "tokens": [42] * 50}
        for p in prompts
    ]  # fmt: skip
    (tmp_path / "clean.jsonl").write_text(clean)
    (tmp_path / "mixed.jsonl").write_text(clean + "".join(json.dumps(r) + "\n" for r in other))
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "simulate_ngram.py"), run_name="sim")
    monkeypatch.setenv("SIM_INDEX", "[true]")
    printed = []
    for cache in ("clean", "mixed"):
        argv = ["simulate_ngram.py", "--cache", str(tmp_path / f"{cache}.jsonl"), "--prompts", "humaneval"]
        monkeypatch.setattr(sys, "argv", [*argv, "--limit", "12", "--eval-last", "4", "--max-new-tokens", "128"])
        script["main"]()
        printed.append(capsys.readouterr().out)
    assert "from 8 outputs; eval on 4 outputs" in printed[0]
    assert printed[1] == printed[0]


def test_a_longest_match_that_only_ends_documents_falls_back_to_a_shorter_one(tmp_path):
    """The context's longest suffix in the index, `8 5 6`, occurs only at a document's end; `5 6` is continued by 7
    elsewhere. The drafter drafts from the shorter match rather than from nothing."""
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(16))
    build_index([[1, 8, 5, 6], [5, 6, 7, 9]], tmp_path / "idx", name, vocab_hash, vocab_size)
    config = InfinigramConfig(threshold=0.0, use_context=False, calibrate=False)
    drafter = InfinigramDrafter(tmp_path / "idx", config=config)
    assert drafter.index.longest_suffix(np.array([8, 5, 6]))[0] == 3
    assert drafter.draft_row(np.array([8, 5, 6]), 2, 8)[0] == [7, 9]
    # min_match still holds: no suffix of 3 or more tokens is continued
    drafter.config.min_match = 3
    assert drafter.draft_row(np.array([8, 5, 6]), 2, 8) == ([], [], [])


def test_a_token_added_after_the_index_was_built_is_accepted_a_changed_one_is_not(small_index):
    """`tokenizer.add_special_tokens({"pad_token": "<pad>"})` appends an id past every id the index holds: the index
    still means the same thing. A token renamed, moved or removed below the index's `vocab_size` is refused."""
    _, index = small_index
    tokenizer = FakeTokenizer(200000)
    tokenizer.vocab["<pad>"] = 200000
    index.check_tokenizer(tokenizer)
    for edit in ({"t5": 199999, "t199999": 5}, {"t5": None}, {"<new>": 17}):
        changed = FakeTokenizer(200000)
        for token, new_id in edit.items():
            if new_id is None:
                del changed.vocab[token]
            else:
                changed.vocab[token] = new_id
        with pytest.raises(ValueError, match="vocabulary hash"):
            index.check_tokenizer(changed)
    short = FakeTokenizer(199999)  # the last id the index may hold is gone
    with pytest.raises(ValueError, match="vocabulary hash"):
        index.check_tokenizer(short)


def test_shipped_indexes_accept_the_default_tokenizer_with_a_pad_token_added():
    from hf_accel.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    shipped = sorted((Path(__file__).resolve().parents[2] / "hf_accel/data/indexes").glob("*/header.json"))
    assert shipped
    for header in shipped:
        InfinigramIndex(header.parent).check_tokenizer(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    assert len(tokenizer) == 49153
    for header in shipped:
        InfinigramIndex(header.parent).check_tokenizer(tokenizer)


def _synthetic_documents(count, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield rng.integers(0, 200000, size=int(rng.integers(0, 300))).tolist()  # Python ints, as a tokenizer's


def test_an_index_built_from_a_generator_is_the_index_built_from_a_list(tmp_path):
    from hf_accel.speculative.drafters.build import build_index_from_documents

    docs = list(_synthetic_documents(60))
    consumed = []

    def once():
        consumed.append(None)
        yield from _synthetic_documents(60)

    tokenizer = FakeTokenizer(200000)
    header, _ = build_index_from_documents(docs, tokenizer, tmp_path / "list", ["unit"])
    streamed, _ = build_index_from_documents(once(), tokenizer, tmp_path / "gen", ["unit"])
    assert consumed == [None] and streamed == header
    for name in INDEX_FILES:
        assert (tmp_path / "gen" / name).read_bytes() == (tmp_path / "list" / name).read_bytes(), name
    index = InfinigramIndex(tmp_path / "gen")
    stream = [t for doc in docs if doc for t in [*doc, int(SEPARATOR)]]
    assert index.tokens.tolist() == stream and header.num_tokens == len(stream)


def test_building_an_index_does_not_hold_the_documents(tmp_path):
    """Documents stream to the staged token file: memory does not grow with the documents consumed (before, every
    document was kept as Python ints, then as numpy chunks until the stream was concatenated)."""
    import tracemalloc

    from hf_accel.speculative.drafters.build import build_index_from_documents

    traced = []

    def documents():
        for number, doc in enumerate(_synthetic_documents(400, seed=1)):
            traced.append(tracemalloc.get_traced_memory()[0])
            yield doc

    tracemalloc.start()
    try:
        header, _ = build_index_from_documents(documents(), FakeTokenizer(200000), tmp_path / "idx", [])
    finally:
        tracemalloc.stop()
    assert header.num_tokens > 50000
    growth = traced[-1] - traced[10]
    assert growth < header.num_tokens  # the stream alone is 4 bytes a token


def _run_now_or_when_the_cache_lock_is_free(cache_dir, job, waiting):
    """Another process's `job` on the self-distillation cache of `cache_dir`, started at this moment: at once if the
    cache lock is free, else in a thread that waits for it (appended to `waiting`, to be joined)."""
    import threading

    from filelock import FileLock, Timeout

    lock = FileLock(cache_dir / ".self_distill.jsonl.lock")
    try:
        lock.acquire(blocking=False)
    except Timeout:  # held by this process: the other one's reads and writes wait for it
        waiting.append(threading.Thread(target=job))
        waiting[-1].start()
        return
    lock.release()
    job()


def test_answers_appended_while_the_self_distillation_cache_is_rewritten_are_kept(tmp_path, monkeypatch):
    """The cache is re-read, written to a temporary file and renamed over: another process's answers appended in
    between were lost. A lock next to the cache (not published) makes appends and rewrites take turns."""
    from hf_accel.eval.prompts import BenchPrompt
    from hf_accel.hub import DEFAULT_IGNORE_PATTERNS, _artifact_files
    from hf_accel.speculative.drafters import build
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(seed=0)
    mine = [BenchPrompt(question_id="0", category="t", text="abc")]
    theirs = [BenchPrompt(question_id="1", category="t", text="hello")]
    cache = tmp_path / build.SELF_DISTILL_CACHE
    legacy = {"key": build._cache_key("", "abc", 4), "question_id": "0", "tokens": [7, 7]}  # makes this run rewrite
    cache.write_text(json.dumps(legacy) + "\n")

    def run(prompts):
        return build.self_distill(model, _CharTokenizer(), prompts, tmp_path, max_new_tokens=4, use_speculation=False)

    replace, waiting, other = os.replace, [], []

    def other_process_meanwhile(src, dst):
        if Path(dst) == cache and not other:  # between this run's re-read and its rename
            other.append(None)
            _run_now_or_when_the_cache_lock_is_free(tmp_path, lambda: other.append(run(theirs)), waiting)
        return replace(src, dst)

    monkeypatch.setattr(build.os, "replace", other_process_meanwhile)
    assert run(mine) == [[7, 7]]
    for thread in waiting:
        thread.join()
    assert len(other) == 2
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    assert sorted(r["question_id"] for r in records) == ["0", "1"]
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("regenerated a cached answer"))
    assert run(theirs) == other[1] and run(mine) == [[7, 7]]
    assert (tmp_path / ".self_distill.jsonl.lock").exists()
    published = [p.name for p in _artifact_files(tmp_path, DEFAULT_IGNORE_PATTERNS)]
    assert build.SELF_DISTILL_CACHE in published and ".self_distill.jsonl.lock" not in published


def test_a_drafter_serving_two_threads_learns_each_pass_from_its_own_proposal():
    """One drafter shared by `generate` calls in two threads (the Hub loader caches one per model): a pass's result
    is matched with the proposal made in its own thread, not the other thread's latest (whose tree may be smaller:
    IndexError in `update`)."""
    import threading

    from hf_accel.speculative.engine import DraftRequest, VerifyResult

    drafter = InfinigramDrafter(None, config=InfinigramConfig(threshold=0.0))
    drafter.cost_model.observe(1, 0.01)  # a plain pass was measured: the drafter drafts

    def request(context):
        ids = torch.tensor([context])
        return DraftRequest(ids, torch.tensor([len(context)]), len(context), torch.ones_like(ids), torch.tensor([0]),
                            torch.tensor([32]), False)  # fmt: skip

    long_tree = drafter.propose(request([5, 6, 7, 8, 9, 10, 11, 12, 5]))  # this thread: a chain of 8
    short_tree = []
    other = threading.Thread(target=lambda: short_tree.append(drafter.propose(request([3, 4, 3]))))
    other.start()
    other.join()
    assert long_tree.num_nodes == 8 and short_tree[0].num_nodes < 8
    before = [row[:] for row in drafter.calibrator.drafted]
    rows, best, path = torch.tensor([0]), torch.tensor([5]), torch.tensor([7])  # nodes 0-5 accepted
    result = VerifyResult(rows, [[6, 7, 8, 9, 10, 11, 12]], best, path, torch.tensor([False]), num_input_tokens=9)
    drafter.update(result)
    observed = sum(map(sum, drafter.calibrator.drafted)) - 0.995 * sum(map(sum, before))
    assert observed == pytest.approx(8)  # this thread's eight nodes
    assert threading.get_ident() not in drafter._proposed  # learned from, then dropped: ended threads leave nothing


def test_a_shipped_index_loads_by_name_from_any_directory(tmp_path, monkeypatch):
    """An installed wheel has no `hf_accel/data/indexes/...` path relative to the user's directory: the shipped
    indexes load by folder name (`ngram:smollm2-135m-chat-build`). A local directory of that name comes first."""
    from hf_accel.speculative.drafters import build_drafter
    from hf_accel.speculative.drafters.index import SHIPPED_INDEXES_DIR

    monkeypatch.chdir(tmp_path)
    names = sorted(header.parent.name for header in SHIPPED_INDEXES_DIR.glob("*/header.json"))
    assert "smollm2-135m-chat-build" in names
    for name in names:
        assert InfinigramIndex(name).path == SHIPPED_INDEXES_DIR / name
    assert build_drafter("ngram", "smollm2-135m-chat-build", None, None).index.header.num_tokens > 0
    tokenizer_name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(16))
    build_index([[1, 2, 3]], tmp_path / "smollm2-135m-chat-build", tokenizer_name, vocab_hash, vocab_size)
    assert InfinigramIndex("smollm2-135m-chat-build").path == Path("smollm2-135m-chat-build")
    with pytest.raises(FileNotFoundError, match="no header.json"):
        InfinigramIndex("no-such-index")


def test_pieces_within_vocabulary_cut_documents_at_unknown_ids():
    from hf_accel.speculative.drafters.build import pieces_within_vocabulary

    documents = [[5, 6, 200, 7], [200, 200], [1, 2, 3], [-1, 4, 201, 202, 5, 6]]
    assert list(pieces_within_vocabulary(documents, 100)) == [[5, 6], [7], [1, 2, 3], [4], [5, 6]]


def test_self_distilling_a_model_with_more_rows_than_its_tokenizer_has_ids(tmp_path, capsys):
    """A model whose embedding is padded past its tokenizer's ids (Qwen, Phi) may sample those ids; they have no
    text, so the self-distilled answers are cut there instead of the build failing after the whole generation."""
    import json

    from hf_accel.cli import main
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE
    from hf_accel.speculative.drafters.index import SEPARATOR, InfinigramIndex
    from tests.tiny_checkpoints import make_char_tokenizer, write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "m")  # 128 embedding rows, fewer tokenizer ids
    known = len(make_char_tokenizer())
    out = tmp_path / "index"
    argv = ["index", "build", "--model", str(model_dir), "--out", str(out), "--self-distill", "humaneval[:2]"]
    assert main([*argv, "--max-new-tokens", "16", "--json"]) == 0
    answers = [json.loads(line)["tokens"] for line in (out / SELF_DISTILL_CACHE).read_text().splitlines()]
    assert any(t >= known for answer in answers for t in answer)  # the case under test happened
    index = InfinigramIndex(out)
    indexed = np.asarray(index.tokens)[np.asarray(index.tokens) != SEPARATOR]
    assert index.header.vocab_size == known and int(indexed.max()) < known
    assert index.header.num_indexed_tokens == sum(t < known for answer in answers for t in answer)


def test_a_first_table_saved_as_an_npz_archive_is_one_clear_error(small_index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    with open(path / "first.npy", "wb") as file:  # np.load reads a zip as a lazy archive, whatever the name
        np.savez(file, np.load(small_index[1].path / "first.npy"))
    with pytest.raises(ValueError, match=r"first\.npy cannot be read \(an \.npz archive"):
        InfinigramIndex(path)


def test_a_first_table_claiming_a_huge_shape_is_refused_before_allocating(small_index, tmp_path):
    from numpy.lib import format as npy_format

    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    with open(path / "first.npy", "wb") as file:  # a crafted header: 512 TiB claimed, a few bytes given
        npy_format.write_array_header_1_0(file, {"descr": "<i8", "fortran_order": False, "shape": (2**46,)})
        file.write(bytes(64))
    with pytest.raises(ValueError, match=r"first\.npy cannot be read"):  # not a MemoryError from np.load
        InfinigramIndex(path)


def test_a_first_table_that_is_not_non_decreasing_is_refused_at_load(small_index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    first = np.load(path / "first.npy")
    first[3], first[4] = first[-1] + 100, -50  # ends still right: ranges past the suffix array, and negative ones
    np.save(path / "first.npy", first)
    with pytest.raises(ValueError, match="non-decreasing"):
        InfinigramIndex(path)


@pytest.mark.parametrize("dense_range", [2048, 1])  # 1: every range takes the binary-search path
def test_a_suffix_array_with_entries_outside_the_stream_drafts_without_failing(
    small_index, tmp_path, monkeypatch, dense_range
):
    from hf_accel.speculative.drafters import index as index_module

    monkeypatch.setattr(index_module, "_DENSE_RANGE", dense_range)
    docs, index = small_index
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    sa = np.fromfile(path / "sa.bin", dtype=index.header.sa_dtype)
    sa[::3], sa[1::3] = -7, 10**9  # the right size (all that is checked at load), entries past either end
    sa.tofile(path / "sa.bin")
    drafter = InfinigramDrafter(InfinigramIndex(path), config=InfinigramConfig(use_context=False))
    for doc in docs[:10]:
        for end in range(1, len(doc)):
            drafter.draft_row(np.array(doc[:end]), 8, 20)


def test_a_token_stream_with_ids_past_the_vocabulary_never_drafts_them(small_index, tmp_path):
    docs, index = small_index
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    tokens = np.fromfile(path / "tokens.u32", dtype="<u4")
    tokens[tokens == 70000] = 4_000_000  # the header says 200,000 ids
    tokens.tofile(path / "tokens.u32")
    drafter = InfinigramDrafter(InfinigramIndex(path), config=InfinigramConfig(use_context=False))
    drafted = set()
    for doc in docs[:10]:
        for end in range(1, len(doc)):
            drafted.update(drafter.draft_row(np.array(doc[:end]), 8, 20)[0])
    assert drafted and max(drafted) < 200000


def test_index_files_linking_outside_the_index_directory_are_refused(small_index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(small_index[1].path, path)
    (path / "data").mkdir()
    (path / "tokens.u32").rename(path / "data" / "tokens.u32")
    (path / "tokens.u32").symlink_to(Path("data") / "tokens.u32")  # inside: loads
    assert InfinigramIndex(path).header == small_index[1].header
    (path / "sa.bin").rename(tmp_path / "elsewhere.bin")
    (path / "sa.bin").symlink_to(tmp_path / "elsewhere.bin")  # the right size and contents, but not in the folder
    with pytest.raises(ValueError, match=r"sa\.bin links outside the index directory"):
        InfinigramIndex(path)
    (path / "sa.bin").unlink()
    (path / "sa.bin").symlink_to(Path("..") / "elsewhere.bin")  # relative
    with pytest.raises(ValueError, match=r"sa\.bin links outside the index directory"):
        InfinigramIndex(path)


def test_the_self_distillation_cache_reader_skips_blank_lines_and_a_vanished_file(tmp_path):
    from hf_accel.speculative.drafters.build import _read_locked_self_distill_cache, parse_self_distill_records

    data = b'{"key": "a", "tokens": [1]}\n\n  \n{"key": "b", "tokens": [2]}\n'  # a file edited by hand
    records, count = parse_self_distill_records(data, "cache.jsonl")
    assert count == 2 and {k: r["tokens"] for k, r in records.items()} == {"a": [1], "b": [2]}
    # removed by another process between a caller's check and its lock: nothing cached
    assert _read_locked_self_distill_cache(tmp_path / "self_distill.jsonl") == ({}, 0)


def test_a_rewrite_stamps_only_the_adopted_records_still_unclaimed(tmp_path):
    """Between a run's adoption of old records and its rewrite, another process may have stamped or replaced one
    (another model's answer now), or dropped it: the rewrite re-reads the cache and stamps only records still without
    a fingerprint or with this model's weights-only one."""
    from hf_accel.speculative.drafters.build import _rewrite_self_distill_cache

    cache = tmp_path / "self_distill.jsonl"
    records = [
        {"key": "claimed", "model": "another model", "tokens": [1]},
        {"key": "legacy", "tokens": [2]},
        {"key": "weights-only", "model": "weights", "tokens": [3]},
    ]
    cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    _rewrite_self_distill_cache(cache, {"claimed", "legacy", "weights-only", "dropped"}, "fingerprint", "weights")
    models = {r["key"]: r.get("model") for r in map(json.loads, cache.read_text().splitlines())}
    assert models == {"claimed": "another model", "legacy": "fingerprint", "weights-only": "fingerprint"}


def test_the_fingerprint_of_offloaded_parameters_counts_their_names_and_shapes():
    """Parameters offloaded to `meta` (accelerate's disk offload) have no values to sample: their names, shapes and
    dtypes alone make the fingerprint."""
    from hf_accel.speculative.drafters.build import model_fingerprint
    from tests.conftest import make_tiny_llama

    offloaded = [make_tiny_llama(seed=seed).to("meta") for seed in (0, 1)]
    assert model_fingerprint(offloaded[0]) == model_fingerprint(offloaded[1]) != model_fingerprint(make_tiny_llama())
    assert model_fingerprint(offloaded[0]) != model_fingerprint(make_tiny_llama(num_hidden_layers=1).to("meta"))


@pytest.mark.parametrize(
    "line",
    [b"\xff\xfe not utf-8", b'{"key": "k", "tokens": ["a", 2]}', b'{"key": "k", "tokens": [[1], 2]}',
     b'{"key": "k", "tokens": [1.5, 2]}', b'{"key": "k", "tokens": [true, 2]}'],
)  # fmt: skip
def test_a_self_distillation_record_that_is_not_utf_8_token_ids_is_refused_by_its_line(line):
    from hf_accel.speculative.drafters.build import parse_self_distill_records

    data = b'{"key": "ok", "tokens": [1, 2]}\n' + line + b"\n"
    with pytest.raises(ValueError, match="cache.jsonl line 2 is not a self-distillation record"):
        parse_self_distill_records(data, "cache.jsonl")


def _occurrence_ends(docs, pattern):
    """`(document, index after the occurrence)` of every occurrence of `pattern` in `docs`."""
    m = len(pattern)
    return [(d, i + m) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if doc[i : i + m] == pattern]


def _inf_nkt(docs, context, depth):
    """B.4's `inf_nkt` as written: continue every occurrence of the longest matched suffix, keep the majority token
    per position (ties: the smallest id), filter. Returns the tokens and `P_j = freq / |A_j|`."""
    m = _brute_longest_suffix(docs, context)
    active = [docs[d][end : end + depth] for d, end in _occurrence_ends(docs, list(context[-m:]))] if m else []
    tokens, probs = [], []
    for j in range(depth):
        active = [c for c in active if len(c) > j]
        if not active:
            break
        counts = {}
        for c in active:
            counts[c[j]] = counts.get(c[j], 0) + 1
        token = min(counts, key=lambda t: (-counts[t], t))
        tokens.append(token)
        probs.append(counts[token] / len(active))
        active = [c for c in active if c[j] == token]
    return tokens, probs


def _sequential_ntd(docs, context, depth):
    """`depth` sequential greedy ∞-gram calls: the majority next token of the longest matched suffix, appended."""
    context, tokens = list(context), []
    for _ in range(depth):
        m = _brute_longest_suffix(docs, context)
        nexts = [docs[d][end] for d, end in _occurrence_ends(docs, context[-m:]) if end < len(docs[d])] if m else []
        if not nexts:
            break
        tokens.append(min(set(nexts), key=lambda t: (-nexts.count(t), t)))
        context.append(tokens[-1])
    return tokens


def test_the_majority_chain_is_inf_nkt_and_its_scores_the_paths_probabilities(tmp_path):
    """Spec B.4 against brute force on random corpora: the `tree=False` chain (index only, no prior) drafts `inf_nkt`'s
    tokens, which are those of sequential greedy ∞-gram calls (B.4's equivalence, every occurrence read), and each
    node scores the fraction of the occurrences that continue with its path: B.4's `P_0 * ... * P_j` where no
    document ends inside the draft, smaller where one does (an ended continuation stays in the denominator)."""
    rng = np.random.default_rng(7)
    config = InfinigramConfig(threshold=0.0, prior=0.0, use_context=False, tree=False, calibrate=False)
    checked = 0
    for trial in range(8):
        vocab = int(rng.integers(2, 5))
        docs = [rng.integers(0, vocab, size=rng.integers(1, 20)).tolist() for _ in range(rng.integers(2, 10))]
        name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(vocab))
        build_index(docs, tmp_path / str(trial), name, vocab_hash, vocab_size, progress=False)
        drafter = InfinigramDrafter(tmp_path / str(trial), config=config)
        for _ in range(20):
            context, depth = rng.integers(0, vocab, size=rng.integers(1, 7)).tolist(), int(rng.integers(1, 7))
            m = _brute_longest_suffix(docs, context)
            conts = [docs[d][end : end + depth] for d, end in _occurrence_ends(docs, context[-m:])] if m else []
            if not any(conts):  # nothing continued: the drafter falls back to a shorter suffix (tested above)
                continue
            tokens, probs = _inf_nkt(docs, context, depth)
            got_tokens, parents, scores = drafter.draft_row(np.array(context), depth, 16)
            assert got_tokens == tokens == _sequential_ntd(docs, context, depth), (docs, context)
            assert parents == list(range(-1, len(tokens) - 1))
            continued = [c for c in conts if c]
            expected = [
                sum(c[: j + 1] == tokens[: j + 1] for c in continued) / len(continued) for j in range(len(tokens))
            ]
            np.testing.assert_allclose(scores, expected)
            if all(len(c) >= len(tokens) for c in continued):  # no document ends inside the draft
                np.testing.assert_allclose(scores, np.cumprod(probs))
            checked += 1
    assert checked > 60


def test_the_threshold_cuts_the_chain_at_the_paths_probability(tmp_path):
    """B.11 item 5: the confidence threshold applies to the probability of the whole path, not to B.5's per-position
    `P_j`; and a continuation that ends its document counts against the path."""
    name, vocab_hash, vocab_size = tokenizer_fingerprint(FakeTokenizer(10))
    config = InfinigramConfig(threshold=0.55, prior=0.0, use_context=False, tree=False, calibrate=False)
    # after 1: token 2 in 5 of 6 occurrences (P_0 = 0.83), then 3 in 3 of those 5 (P_1 = 0.6, path 0.5)
    docs = [[1, 2, 3]] * 3 + [[1, 2, 4]] * 2 + [[1, 5]]
    build_index(docs, tmp_path / "a", name, vocab_hash, vocab_size, progress=False)
    assert _inf_nkt(docs, [1], 2) == ([2, 3], [5 / 6, 0.6])  # B.5 would draft both at 0.55
    tokens, parents, scores = InfinigramDrafter(tmp_path / "a", config=config).draft_row(np.array([1]), 2, 8)
    assert (tokens, parents) == ([2], [-1]) and scores == pytest.approx([5 / 6])
    # after 7: always 8 (P_0 = 1), then 9 in both continuations that go on (P_1 = 1), but half the documents end
    docs = [[7, 8, 9]] * 2 + [[7, 8]] * 2
    build_index(docs, tmp_path / "b", name, vocab_hash, vocab_size, progress=False)
    assert _inf_nkt(docs, [7], 2) == ([8, 9], [1.0, 1.0])
    assert InfinigramDrafter(tmp_path / "b", config=config).draft_row(np.array([7]), 2, 8) == ([8], [-1], [1.0])


def test_the_index_files_are_the_documented_layout_and_queries_read_them_mapped(small_index):
    """Spec B.2 / issue 6: little-endian 32-bit ids with a separator after each document, the suffix array of the
    reversed stream (brute-force sorted), the first-token table, the header's fields; queries read the token stream
    and the suffix array memory-mapped, not loaded."""
    docs, index = small_index
    stream = [t for doc in docs for t in [*doc, int(SEPARATOR)]]
    raw = (index.path / "tokens.u32").read_bytes()
    assert raw == np.array(stream, dtype="<u4").tobytes() and max(stream[:-1]) > 65535
    backwards = stream[::-1]
    expected = sorted(range(len(backwards)), key=lambda r: backwards[r:])  # a shorter suffix sorts first
    np.testing.assert_array_equal(np.fromfile(index.path / "sa.bin", dtype=index.header.sa_dtype), expected)
    counts = np.bincount([t for doc in docs for t in doc], minlength=index.header.vocab_size)
    np.testing.assert_array_equal(np.load(index.path / "first.npy"), np.concatenate([[0], np.cumsum(counts)]))
    header = json.loads((index.path / "header.json").read_text())
    assert header["format_version"] == 1 and header["num_tokens"] == len(stream)
    assert {"tokenizer_name", "vocab_hash", "vocab_size", "num_documents", "sa_dtype"} <= set(header)
    assert isinstance(index.tokens, np.memmap) and isinstance(index.suffix_array, np.memmap)


@pytest.mark.parametrize("tree", [True, False])
def test_a_continuation_exactly_at_the_threshold_is_drafted(tree):
    """B.5 cuts the draft where `P_j < tau`: a token that continues exactly `tau` of the occurrences is drafted. The
    votes are split into shares and added back up, and `k` shares of `v / n` made a hair less than `k / n` of the total
    for some counts and match lengths (3 of 6 at `tau = 0.5`, 6 of 10 at 0.6, 7 of 10 at 0.7 ...): not drafted."""
    config = InfinigramConfig(prior=0.0, use_context=False, tree=tree, calibrate=False)
    drafter = InfinigramDrafter(None, config=config)
    for tau in (0.5, 0.6, 0.7, 0.75, 0.8):
        config.threshold = tau
        for n in range(1, 41):
            k = round(tau * n)
            if k / n != tau:
                continue
            conts = np.array([[1]] * k + [[2]] * (n - k))
            for length in (1, 2, 3, 5):
                drafter._match_groups = lambda context, depth, group=(length, False, conts): [group]
                tokens, _, scores = drafter.draft_row(np.array([0]), 1, 8)
                assert tokens[:1] == [1] and scores[0] == pytest.approx(tau), (tau, k, n, length)
                config.threshold = tau + 1e-6  # just above: not drafted
                assert 1 not in drafter.draft_row(np.array([0]), 1, 8)[0], (tau, k, n, length)
                config.threshold = tau


def test_index_build_checks_text_files_and_dataset_before_loading_the_model(tmp_path, capsys, monkeypatch):
    # self-distillation loads the model first of all the work: a bad text file or dataset must fail before it
    from hf_accel.cli import main
    from hf_accel.speculative import cli as speculative_cli
    from tests.tiny_checkpoints import write_tiny_llama

    def no_model(args):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(speculative_cli, "load_model", no_model)
    model = write_tiny_llama(tmp_path / "tiny")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9\n")
    common = ["index", "build", "--model", str(model), "--out", str(tmp_path / "o"), "--self-distill", "chat_build"]
    capsys.readouterr()  # the checkpoint's writing progress
    good = tmp_path / "good.txt"
    good.write_text("one document\n")
    (tmp_path / "link.txt").symlink_to(good)
    cases = [
        (["--text", str(latin1)], f"text file {latin1} is not UTF-8 text: byte 3"),
        (["--dataset", str(tmp_path / "no-such-dataset")], "no-such-dataset"),
        # one file twice (overlapping globs, a link and its target) would double every count it gives
        (["--text", str(good), str(latin1), str(good)], f"--text names one file more than once ({good}, {good})"),
        (["--text", str(tmp_path / "link.txt"), str(good)], "--text names one file more than once"),
    ]
    for extra, message in cases:
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_text_file_that_is_not_utf8_is_not_indexed(tmp_path):
    from hf_accel.speculative.drafters.build import iter_text_file_documents

    path = tmp_path / "latin1.txt"
    path.write_bytes("naïve".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text: byte 2"):
        next(iter_text_file_documents([path], tokenizer=None))
