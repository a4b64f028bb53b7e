import math

import pytest
import torch

from hf_accel.eval.perplexity import (
    compute_perplexity,
    decoding_perplexity,
    perplexity_on_ids,
    read_eval_text,
    split_windows,
)
from tests.conftest import make_tiny_llama


class ByteTokenizer:
    """Maps each character to one token id below the tiny model's vocabulary (no special tokens)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


def brute_force_ppl(model, ids: list[int], seq_len: int) -> tuple[float, int]:
    """exp(mean NLL) computed token by token with explicit softmaxes, window by window."""
    total, count = 0.0, 0
    for start in range(0, len(ids), seq_len):
        window = ids[start : start + seq_len]
        if len(window) < 2:
            continue
        logits = model(torch.tensor([window])).logits[0].double()
        for t in range(len(window) - 1):
            probs = torch.exp(logits[t]) / torch.exp(logits[t]).sum()
            total -= math.log(probs[window[t + 1]].item())
            count += 1
    return math.exp(total / count), count


def test_split_windows_keeps_tail_of_two_or_more():
    ids = torch.arange(10)
    assert [w.tolist() for w in split_windows(ids, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [w.numel() for w in split_windows(torch.arange(9), 4)] == [4, 4]  # a one-token tail predicts nothing
    with pytest.raises(ValueError, match="seq_len"):
        split_windows(ids, 1)


@pytest.mark.parametrize("seq_len,batch_size,max_tokens", [(16, 4, None), (7, 2, None), (16, 3, 40)])
def test_perplexity_matches_hand_computation(seq_len, batch_size, max_tokens):
    model = make_tiny_llama()
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer."
    result = compute_perplexity(model, ByteTokenizer(), text, seq_len, max_tokens, batch_size, False)
    ids = ByteTokenizer()(text)["input_ids"][:max_tokens]
    expected, count = brute_force_ppl(model, ids, seq_len)
    assert result["tokens"] == count
    assert result["seq_len"] == seq_len
    assert result["ppl"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("skip", [0, 5])
def test_decoding_perplexity_equals_the_prefill_one_on_a_plain_cache(skip):
    from hf_accel.eval.perplexity import decoding_perplexity

    model = make_tiny_llama()
    ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, skip:-1].double()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, skip + 1 :].reshape(-1))
    assert decoding_perplexity(model, ids, skip=skip, batch_size=2) == pytest.approx(expected.exp().item(), rel=1e-5)
    with pytest.raises(ValueError, match="skip"):
        decoding_perplexity(model, ids, skip=11)


def test_perplexity_rejects_too_short_text():
    with pytest.raises(ValueError, match="too short"):
        compute_perplexity(make_tiny_llama(), ByteTokenizer(), "a", 8, progress=False)


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_perplexity_rejects_a_max_tokens_that_is_not_positive(max_tokens):
    # -5 sliced the token ids: every token but the last 5 was scored, without a word
    with pytest.raises(ValueError, match=f"max_tokens must be positive, got {max_tokens}"):
        compute_perplexity(make_tiny_llama(), ByteTokenizer(), "To be, or not to be", 8, max_tokens, progress=False)
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):  # not range()'s own error
        compute_perplexity(make_tiny_llama(), ByteTokenizer(), "To be, or not to be", 8, batch_size=0, progress=False)


def test_read_eval_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_eval_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_eval_text(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="exactly one"):
        read_eval_text()


def test_read_eval_text_from_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["first line", "second line"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_eval_text(dataset=str(tmp_path / "ds")) == "first line\nsecond line"
    with pytest.raises(ValueError, match="no column"):
        read_eval_text(dataset=str(tmp_path / "ds"), column="content")


def test_read_eval_text_from_one_data_file(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"text": "first line"}\n{"text": "second line"}\n')
    assert read_eval_text(dataset=str(tmp_path / "test.jsonl")) == "first line\nsecond line"  # split "test"
    (tmp_path / "notes.xyz").write_text("x")
    with pytest.raises(ValueError, match="unknown data file type"):
        read_eval_text(dataset=str(tmp_path / "notes.xyz"))


@pytest.mark.parametrize("skip,batch_size", [(0, 2), (3, 2), (0, 5)])
def test_perplexity_on_ids_and_row_nlls_match_hand_computation(skip, batch_size):
    from hf_accel.eval.perplexity import perplexity_on_ids, row_nlls

    model = make_tiny_llama()
    rows = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    sums = []
    for row in rows.tolist():  # each row alone, its first `skip` predictions left out
        logits = model(torch.tensor([row])).logits[0].double()
        sums.append(-sum(torch.log_softmax(logits[t], -1)[row[t + 1]].item() for t in range(skip, len(row) - 1)))
    assert row_nlls(model, rows, batch_size=batch_size, skip=skip).tolist() == pytest.approx(sums, rel=1e-5)
    assert perplexity_on_ids(model, rows, batch_size=batch_size, skip=skip) == pytest.approx(
        math.exp(sum(sums) / (3 * (8 - skip))), rel=1e-5
    )


def test_paired_nll_difference_of_a_constant_shift_is_that_shift_with_no_spread():
    from hf_accel.eval.perplexity import paired_nll_difference

    baseline = torch.tensor([30.0, 12.5, 41.0, 7.0], dtype=torch.float64)
    result = paired_nll_difference(baseline, baseline + 0.5 * 10, tokens_per_row=10)
    assert result == {
        "nats_per_token": pytest.approx(0.5),
        "low": pytest.approx(0.5),
        "high": pytest.approx(0.5),
        "rows": 4,
    }
    same = paired_nll_difference(baseline, baseline.clone(), tokens_per_row=10)
    assert (same["nats_per_token"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_paired_nll_difference_interval_matches_the_normal_one_and_ignores_what_the_rows_share():
    # Row NLLs that vary a lot from row to row (what both models share) and a small noisy difference: the paired
    # interval follows the spread of the difference alone, mean ± 1.96·sd/√N for many rows
    from hf_accel.eval.perplexity import paired_nll_difference

    generator = torch.Generator().manual_seed(0)
    shared = 1000 * torch.rand(400, generator=generator, dtype=torch.float64)
    difference = 2.0 + 5.0 * torch.randn(400, generator=generator, dtype=torch.float64)
    result = paired_nll_difference(shared, shared + difference, tokens_per_row=100, samples=20_000)
    mean, half = difference.mean().item() / 100, 1.96 * difference.std().item() / 100 / math.sqrt(400)
    assert result["nats_per_token"] == pytest.approx(mean)
    assert result["low"] == pytest.approx(mean - half, abs=0.06 * half)
    assert result["high"] == pytest.approx(mean + half, abs=0.06 * half)
    with pytest.raises(ValueError, match="same rows"):
        paired_nll_difference(shared, shared[:3], tokens_per_row=100)


class _Fed(Exception):
    pass


class _DeviceSpy(torch.nn.Module):
    """A "model" whose weights sit on another device (meta): records the device of the ids it is fed, then stops."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))
        self.devices = []

    def forward(self, input_ids, **kwargs):
        self.devices.append(input_ids.device)
        raise _Fed


@pytest.mark.parametrize("measure", ["compute_perplexity", "perplexity_on_ids", "decoding_perplexity", "cache_bytes"])
def test_every_measurement_feeds_the_ids_on_the_models_device(measure):
    # perplexity_on_ids and measure_cache_bytes_per_token fed CPU ids to a GPU model (the Palu quality benchmark
    # failed there at its first row); the other two moved them already
    from hf_accel.eval.memory import measure_cache_bytes_per_token
    from hf_accel.eval.perplexity import decoding_perplexity, perplexity_on_ids

    spy, ids = _DeviceSpy(), torch.randint(3, 97, (2, 8))
    run = {
        "compute_perplexity": lambda: compute_perplexity(
            spy, ByteTokenizer(), "To be, or not to be", 8, progress=False
        ),
        "perplexity_on_ids": lambda: perplexity_on_ids(spy, ids),
        "decoding_perplexity": lambda: decoding_perplexity(spy, ids),
        "cache_bytes": lambda: measure_cache_bytes_per_token(spy, ids),
    }[measure]
    with pytest.raises(_Fed):
        run()
    assert spy.devices == [torch.device("meta")]


def _strict_json(text: str):
    """`json.loads` that refuses NaN and Infinity, as `jq` and `JSON.parse` do."""
    import json

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_eval_ppl_json_of_a_model_with_nan_logits_is_strict_json(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_accel.cli import main
    from tests.tiny_checkpoints import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "nan")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")  # as an fp16 overflow or a broken conversion leaves it
    model.save_pretrained(model_dir)
    (tmp_path / "t.txt").write_text("To be, or not to be: that is the question. " * 4)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(model_dir), "--text", str(tmp_path / "t.txt"), "--json"]) == 0
    result = _strict_json(capsys.readouterr().out)
    assert result["ppl"] is None and result["nll"] is None and result["tokens"] > 0


def test_a_perplexity_past_the_float_range_is_inf_not_an_overflow_error(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_accel.cli import main
    from tests.tiny_checkpoints import write_tiny_llama

    model = AutoModelForCausalLM.from_pretrained(write_tiny_llama(tmp_path / "m"))
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)  # confidently wrong: a mean NLL of thousands of nats
    ids = torch.tensor([[3 + (7 * i) % 90 for i in range(24)]])
    assert compute_perplexity(model, ByteTokenizer(), "wrong " * 8, seq_len=16, progress=False)["ppl"] == math.inf
    assert perplexity_on_ids(model, ids) == decoding_perplexity(model, ids) == math.inf
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text("To be, or not to be: that is the question. " * 4)
    argv = ["eval", "ppl", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt")]
    capsys.readouterr()
    assert main(argv) == 0 and "perplexity inf" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0 and _strict_json(capsys.readouterr().out)["ppl"] is None
