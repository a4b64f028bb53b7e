"""Features used together: a seeded sample of targets (plain Llama, CARE, a reloaded 3-bit Palu checkpoint with a
full-precision window) x loops (the engine with an Infinigram index or random trees, transformers' assisted loop) x
batches (1, a ragged left-padded 3) x greedy / seeded sampling x context-dependent processors x stops (EOS inside a
draft, `max_new_tokens`, `max_length`, a stop string, a streamer). Each feature has its own tests; this one looks for
what only shows when several meet."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteriaList, StopStringCriteria

from hf_accel.speculative import DraftTree, assisted_generate, custom_generate
from hf_accel.speculative.drafters import InfinigramConfig, InfinigramDrafter, build_index, tokenizer_fingerprint
from hf_accel.speculative.drafters.build import pieces_within_vocabulary
from hf_accel.speculative.drafters.infinigram import node_depths
from tests.speculative.test_engine import CollectingStreamer


VOCAB = 104  # the character tokenizer's

AXES = {
    "target": ["llama", "care", "palu-3bit-window-reloaded"],
    "loop": ["ngram-index", "random-tree", "assisted"],
    "batch_size": [1, 3],
    "sample": [False, True],
    "processor": [{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 3}],
    "stop": ["max_new_tokens", "max_length", "eos", "stop_string", "streamer"],
}


def _cases(n: int = 12, seed: int = 23595) -> list[dict]:
    """`n` combinations in which every value of every axis occurs (each axis cycled, then shuffled); the assisted
    loop and streamers run at batch size 1. The seed makes every target meet both batch sizes, greedy and sampling,
    and every loop; both converted targets decode a ragged batch greedily, every loop stops greedily at an EOS or a
    stop string inside a draft, and the engine streams."""
    rng = random.Random(seed)
    columns = {}
    for name, values in AXES.items():
        column = [values[i % len(values)] for i in range(n)]
        rng.shuffle(column)
        columns[name] = column
    cases = [dict(zip(columns, row)) for row in zip(*columns.values())]
    for case in cases:
        if case["loop"] == "assisted" or case["stop"] == "streamer":
            case["batch_size"] = 1
    return cases


def _tokenizer():
    from tokenizers import decoders

    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # "ab", not "a b": stop strings need the real text
    return tokenizer


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from hf_accel.compress.care import convert_care
    from hf_accel.compress.palu import convert_palu, save_palu
    from tests.compress.care_helpers import tiny_calibration
    from tests.compress.test_palu import CALIB_TEXT, FAST, TINY
    from tests.conftest import make_tiny_llama

    llama = make_tiny_llama(**{**TINY, "vocab_size": VOCAB})  # every id has text: the index drafts all of them
    care = convert_care(llama, kv_keep=0.5, calibration=tiny_calibration(llama), progress=False)
    palu, info = convert_palu(
        llama, _tokenizer(), kv_keep=0.5, group_size=2, quant_bits=3, residual_length=4, calibration_text=CALIB_TEXT,
        **FAST,
    )  # fmt: skip
    path = save_palu(palu, _tokenizer(), tmp_path_factory.mktemp("palu") / "palu", info, base_model=None)
    reloaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    targets = {"llama": llama, "care": care, "palu-3bit-window-reloaded": reloaded}
    for model in targets.values():  # full-length texts: each case sets its own stops
        model.generation_config.eos_token_id = None
    return targets


class _RandomTrees:
    """Seeded random trees of up to 8 nodes per row, each node the reference's token at its depth (90 %) or any."""

    def __init__(self, reference, seed):
        self.reference, self.rng = reference, random.Random(seed)

    def propose(self, request):
        trees = []
        for b in range(len(request.rows)):
            row, length = int(request.rows[b]), int(request.lengths[b])
            parents = [self.rng.randint(-1, i - 1) for i in range(self.rng.randint(0, 8))]
            tokens = []
            for depth in node_depths(parents):
                position = length + depth - 1
                good = position < self.reference.shape[1] and self.rng.random() < 0.9
                tokens.append(int(self.reference[row, position]) if good else self.rng.randrange(VOCAB))
            trees.append((tokens, parents))
        return DraftTree.from_parent_lists(trees)


class _NoDraft:
    def propose(self, request):
        return None


def _prompts(batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch_size, 10), generator=generator)
    input_ids[:, 6:] = input_ids[:, 2:6]  # a repeat, for the context's n-grams
    attention_mask = torch.ones_like(input_ids)
    for b, pad in enumerate([0, 3, 5][:batch_size]):
        input_ids[b, :pad], attention_mask[b, :pad] = 0, 0
    return input_ids, attention_mask


def _drafter(loop, text, tokenizer, index_dir, seed):
    """A drafter that knows `text` (the call's expected output): long accepted drafts, EOS and stops inside them."""
    if loop == "random-tree":
        return _RandomTrees(text, seed)
    if not index_dir.exists():
        name, vocab_hash, vocab_size = tokenizer_fingerprint(tokenizer)
        documents = pieces_within_vocabulary([row[row != 0].tolist() for row in text], vocab_size)
        build_index(documents, index_dir, name, vocab_hash, vocab_size, progress=False)
    return InfinigramDrafter(index_dir, tokenizer, InfinigramConfig(tree=loop != "assisted", adaptive_cost=False))


def _check_case(i: int, case: dict, model, tokenizer, index_dir):
    """Greedy: the text of plain `generate`. Sampling: the seeded text of no drafts, whatever the drafts, and the
    same in both loops. Streamed tokens: the returned ones."""
    input_ids, attention_mask = _prompts(case["batch_size"], seed=i)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "pad_token_id": 0, **case["processor"]}
    free = model.generate(**kwargs, max_new_tokens=24, do_sample=False)
    start = input_ids.shape[1]
    kwargs["max_new_tokens"] = 20
    if case["stop"] == "max_length":
        del kwargs["max_new_tokens"]
        kwargs["max_length"] = start + 13
    elif case["stop"] == "eos":
        kwargs["eos_token_id"] = int(free[0, start + 6])
    elif case["stop"] == "stop_string":
        stop = tokenizer.decode(free[0, start + 5 : start + 7])
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
        # an EOS no text holds: without one, `generate` goes on decoding the rows a stop string ended (the engine's
        # docstring, "Ambiguities"); with one, it pads them, as the engine does
        kwargs["eos_token_id"] = min(set(range(3, VOCAB)) - set(free.flatten().tolist()))
    loop = assisted_generate if case["loop"] == "assisted" else custom_generate

    def run(drafter, **extra):
        streamer = CollectingStreamer() if case["stop"] == "streamer" else None
        out = model.generate(**kwargs, **extra, custom_generate=loop, drafter=drafter, streamer=streamer)
        if streamer is not None:
            assert streamer.tokens == out[0].tolist() and streamer.ends == 1, case
        return out

    if not case["sample"]:
        reference = model.generate(**kwargs, do_sample=False)
        assert torch.equal(run(_drafter(case["loop"], free, tokenizer, index_dir, seed=i), do_sample=False), reference)
        return
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 20}
    torch.manual_seed(i)
    expected = run(_NoDraft(), **sampling)
    for seed in (i, i + 1):  # drafters that know the sampled text: their drafts are accepted
        torch.manual_seed(i)
        assert torch.equal(run(_drafter(case["loop"], expected, tokenizer, index_dir, seed), **sampling), expected)
    if loop is assisted_generate:
        torch.manual_seed(i)
        out = model.generate(**kwargs, **sampling, custom_generate=custom_generate, drafter=_NoDraft())
        assert torch.equal(out, expected)


def test_a_seeded_sample_of_feature_combinations(targets, tmp_path):
    tokenizer = _tokenizer()
    for i, case in enumerate(_cases()):
        try:
            _check_case(i, case, targets[case["target"]], tokenizer, tmp_path / f"index-{i}")
        except AssertionError as err:
            raise AssertionError(f"case {i}: {case}") from err
