"""The benchmark harness and the CLI on the embedded default model (shared session instance)."""

import json
import os
import re
import shutil

import pytest
import torch

from hf_accel.cli import main
from hf_accel.eval.bench import MethodRun, _batches, _shares, bench_generate, summarize
from hf_accel.eval.prompts import BenchPrompt, load_prompts


@pytest.mark.slow
def test_bench_generate_reports_design_keys(default_model):
    model, tokenizer = default_model
    prompts = load_prompts("humaneval", tokenizer, limit=2)
    result = bench_generate(model, tokenizer, prompts, ["pld"], batch_size=2, max_new_tokens=12)
    assert set(result["methods"]) == {"vanilla", "pld"}
    for figures in result["methods"].values():
        assert {"tokens_per_s", "speedup", "mean_accepted", "identical", "per_category"} <= set(figures)
        assert figures["identical"] is True  # greedy prompt lookup is lossless
        assert set(figures["per_category"]) == {"humaneval"}
    assert result["methods"]["vanilla"]["speedup"] == 1.0
    assert result["methods"]["vanilla"]["mean_accepted"] == pytest.approx(1.0)
    # one batch of 2 rows that both run to max_new_tokens (no EOS this early): a prefill + 11 decoding passes
    assert result["methods"]["vanilla"]["target_passes"] == 12
    assert "row by row" in result["methods"]["pld"]["note"]
    # what a run needs to be reproduced from its JSON alone
    assert {k: result[k] for k in ("do_sample", "temperature", "seed", "pld_tokens")} == {
        "do_sample": False, "temperature": None, "seed": 0, "pld_tokens": 10
    }  # fmt: skip
    layout = result["engine_linear_layout_rows"]  # what the engine's passes ran in, per weight shape
    assert all(re.fullmatch(r"\d+x\d+", shape) and set(rows) <= {1, 2, 4, 8, 16, 32} for shape, rows in layout.items())


def test_batches_span_categories_and_split_by_generated_tokens():
    prompts = [BenchPrompt(str(i), "aabbb"[i], "") for i in range(5)]
    batches = _batches(prompts, 4)
    assert [[p.question_id for p in b] for b in batches] == [["0", "1", "2", "3"], ["4"]]  # full batches
    shares = _shares(batches[0], [[1] * 3, [1], [1] * 4, []])  # 3 + 1 tokens of a, 4 + (empty: 1) of b
    assert shares == pytest.approx({"a": 4 / 9, "b": 5 / 9})
    assert _shares(batches[1], [[7, 8]]) == {"b": 1.0}


def test_summarize_speedup_and_identity_by_hand():
    prompts = [BenchPrompt("a", "x", ""), BenchPrompt("b", "y", "")]
    vanilla = MethodRun(outputs={"a": [1, 2, 3, 4], "b": [5, 6]})
    vanilla.seconds.update(x=2.0, y=1.0)
    vanilla.prefill_seconds.update(x=0.5, y=0.25)
    vanilla.accepted.update(x=3, y=1)
    vanilla.row_passes.update(x=3, y=1)
    fast = MethodRun(outputs={"a": [1, 2, 3, 4], "b": [5, 7]})
    fast.seconds.update(x=1.0, y=1.0)
    fast.prefill_seconds.update(x=0.25, y=0.5)
    fast.accepted.update(x=3, y=1)
    fast.row_passes.update(x=1, y=1)
    fast.target_passes.update(x=2, y=2)
    out = summarize({"vanilla": vanilla, "fast": fast}, prompts, do_sample=False)
    assert out["vanilla"]["tokens_per_s"] == pytest.approx(6 / 3.0)
    assert out["fast"]["speedup"] == pytest.approx((6 / 2.0) / (6 / 3.0))
    assert out["fast"]["per_category"]["x"] == {
        "tokens": 4,
        "seconds": 1.0,
        "tokens_per_s": 4.0,
        "prefill_seconds": 0.25,
        "mean_accepted": 3.0,
        "target_passes": 2,
        "speedup": 2.0,
        "decode_speedup": (4 / 0.75) / (4 / 1.5),
        "identical": True,
    }
    assert out["fast"]["decode_speedup"] == pytest.approx((6 / 1.25) / (6 / 2.25))
    assert out["fast"]["per_category"]["y"]["identical"] is False
    assert out["fast"]["identical"] is False
    assert out["vanilla"]["mean_accepted"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["eval", "ppl", "--model", "/no/such/dir", "--text", "pyproject.toml"], "not a directory"),
        (["eval", "ppl", "--text", "/no/such/file.txt"], "not found"),
        (["eval", "ppl", "--text", "pyproject.toml", "--seq-len", "0"], "must be positive"),
        (["bench", "generate", "--prompts", "/no/such.jsonl"], "not found"),
        (["bench", "generate", "--prompts", "humaneval", "--methods", ","], "empty"),
        (["bench", "generate", "--prompts", "humaneval", "--offset", "-3"], "must be ≥ 0"),
        # NaN would silently run greedy decoding, inf would print `Infinity` in the --json output
        (
            ["bench", "generate", "--model", "/no/such/dir", "--prompts", "humaneval", "--temperature", "nan"],
            "must be a finite number ≥ 0",
        ),
        (
            ["bench", "generate", "--model", "/no/such/dir", "--prompts", "humaneval", "--temperature", "inf"],
            "must be a finite number ≥ 0",
        ),
        (
            ["bench", "generate", "--model", "/no/such/dir", "--prompts", "humaneval", "--temperature", "-1"],
            "must be a finite number ≥ 0",
        ),
        # the model does not exist: the method name must be refused first
        (
            ["bench", "generate", "--model", "/no/such/dir", "--prompts", "humaneval", "--methods", "vanilla,nope"],
            "unknown method 'nope'",
        ),
        # both converters check the calibration source before loading the model
        (["convert", "care", "--kv-keep", "0.5", "--calib", "/no/such.txt", "--out", "/tmp/x"], "not found"),
        (["convert", "palu", "--kv-keep", "0.5", "--calib", "/no/such.txt", "--out", "/tmp/x"], "not found"),
        (["convert", "care", "--kv-keep", "0.5", "--out", "pyproject.toml"], "is an existing file"),
        (["convert", "palu", "--kv-keep", "0.5", "--out", "pyproject.toml"], "is an existing file"),
        (["convert", "palu", "--kv-keep", "0.5", "--model", "/no/such/model", "--out", "/tmp/x"], "not a directory"),
        (["convert", "care", "--kv-keep", "0.5", "--model", "/no/such/model", "--out", "/tmp/x"], "not a directory"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "ppl", "--text", "t.txt", "--seq-len", "abc"], "argument --seq-len: invalid int value: 'abc'"),
        (["convert", "palu", "--kv-keep", "0.5"], "the following arguments are required: --out"),
        (["convert", "care", "--kv-keep", "0.5", "--method", "x", "--out", "o"], "argument --method: invalid choice"),
        (["bench", "generate", "--prompts", "humaneval", "--bogus"], "unrecognized arguments: --bogus"),
        (["frob"], "invalid choice: 'frob'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_cli_option_errors_are_one_line(argv, message, capsys):
    # argparse printed the whole usage (five lines for `eval ppl`) before its message; the README promises one line
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_cli_bad_hub_id_offline_is_one_line(capsys, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n')
    assert (
        main(["bench", "generate", "--model", "nobody/no-such-model-xyz", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "model 'nobody/no-such-model-xyz' is not in the Hugging Face cache" in err and len(err.splitlines()) == 1


def test_a_bad_index_fails_before_the_vanilla_run(default_model, capsys, monkeypatch):
    from hf_accel.eval import bench

    def no_run(*args, **kwargs):
        raise AssertionError("a method ran before every drafter was built")

    monkeypatch.setattr(bench, "run_method", no_run)
    argv = ["bench", "generate", "--prompts", "humaneval", "--limit", "1", "--methods", "vanilla,ngram:/no/such/index"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the weight-loading progress bar
    assert last == "hf-accel bench: error: not an Infinigram index (no header.json): /no/such/index"


@pytest.mark.slow
def test_cli_ppl_and_demo_json(default_model, shakespeare_text, capsys, tmp_path):
    (tmp_path / "t.txt").write_text(shakespeare_text[:3000])
    assert (
        main(["eval", "ppl", "--text", str(tmp_path / "t.txt"), "--seq-len", "128", "--max-tokens", "300", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert {"model", "ppl", "tokens", "seq_len"} <= set(result)
    assert result["tokens"] == 127 + 127 + 43 and 1 < result["ppl"] < 1000
    assert main(["demo", "--max-new-tokens", "8", "--no-convert", "--json"]) == 0
    demo = json.loads(capsys.readouterr().out)
    assert len(demo["speculative"]) == 3 and all(r["identical"] for r in demo["speculative"])
    assert demo["max_new_tokens"] == 8  # what the figures were measured with, as the printed table says
    assert "compression" not in demo


def test_measured_cache_bytes_of_the_default_model(default_model):
    from hf_accel.eval.memory import measure_cache_bytes_per_token

    model, _ = default_model
    # fp32 GQA cache of SmolLM2: 30 layers x (K + V) x 3 KV heads x 64 dims x 4 bytes
    assert measure_cache_bytes_per_token(model, torch.arange(10).view(2, 5)) == 30 * 2 * 3 * 64 * 4


@pytest.mark.parametrize("length", [1, 4])
def test_measured_cache_bytes_of_a_one_token_input_come_from_the_decoding_step_alone(length):
    from transformers import DynamicCache

    from hf_accel.eval.memory import cache_bytes, measure_cache_bytes_per_token
    from tests.conftest import make_tiny_llama

    # fp32 GQA cache of the tiny Llama: 2 layers x (K + V) x 2 KV heads x 8 dims x 4 bytes
    assert measure_cache_bytes_per_token(make_tiny_llama(), torch.arange(3, 3 + 2 * length).view(2, length)) == 256
    empty_layers = DynamicCache(config=make_tiny_llama().config)  # layers with no tensors yet count nothing
    assert cache_bytes(empty_layers) == 0


def test_a_remote_code_checkpoint_without_trust_remote_code_is_one_line(tmp_path, capsys):
    from tests.tiny_checkpoints import write_tiny_remote_model

    model_dir = write_tiny_remote_model(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be. " * 20)
    capsys.readouterr()  # the checkpoint's writing progress
    assert main(["eval", "ppl", "--model", str(model_dir), "--text", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --trust-remote-code" in err[0], err
    argv = ["eval", "ppl", "--model", str(model_dir), "--text", str(text), "--trust-remote-code", "--json"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--seq-len", "300"]) == 0  # a window past the model's 256 positions is flagged
    assert "warning: --seq-len 300 is past the model's 256 positions" in capsys.readouterr().err
    assert main(["demo", "--model", str(model_dir)]) == 2  # no --trust-remote-code there: no advice to pass it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the demo runs plain transformers models" in err[0], err


def test_the_demo_runs_a_model_without_a_chat_template(tmp_path, capsys):
    # `--model` takes any plain model; one whose tokenizer has no chat template (a base model) stopped the demo with
    # transformers' "tokenizer.chat_template is not set": its prompts are continued as text, as in `bench generate`
    from tests.tiny_checkpoints import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "tiny")
    capsys.readouterr()
    assert main(["demo", "--model", str(model_dir), "--max-new-tokens", "4", "--no-convert", "--json"]) == 0
    demo = json.loads(capsys.readouterr().out)
    assert len(demo["speculative"]) == 3 and all(r["identical"] for r in demo["speculative"])


def test_the_demo_reports_no_tokens_per_pass_when_no_verification_pass_ran(tmp_path, capsys):
    # with one new token the prefill answers alone: the demo said 0.00 tokens per pass (`bench generate`: null, "-")
    from tests.tiny_checkpoints import write_tiny_llama

    argv = ["demo", "--model", str(write_tiny_llama(tmp_path / "tiny")), "--max-new-tokens", "1", "--no-convert"]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    assert [r["mean_accepted"] for r in json.loads(capsys.readouterr().out)["speculative"]] == [None] * 3
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("prompt"))) + 1 :][:3]
    assert [row[40 + 7 + 9 + 8 + 9 :][:9].strip() for row in rows] == ["-"] * 3  # the acc/pass column


def test_the_demo_converts_with_care_and_reports_kv_bytes_and_perplexity(tmp_path, monkeypatch, capsys):
    # the demo's second half (`make demo` runs it): CARE's cache beside the original's, and both perplexities
    import math

    from hf_accel.demo import care_cache_dir
    from tests.tiny_checkpoints import write_tiny_llama

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    model_dir = str(write_tiny_llama(tmp_path / "tiny"))
    argv = ["demo", "--model", model_dir, "--max-new-tokens", "2", "--kv-keep", "0.5"]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    demo = json.loads(capsys.readouterr().out)
    original, care = demo["compression"]
    assert [original["model"], care["model"]] == ["original", "CARE kv-keep 0.5"]
    assert care["kv_bytes_per_token"] == original["kv_bytes_per_token"] / 2  # K and V at half their width
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in (original, care))
    assert demo["care_checkpoint"] == str(care_cache_dir(model_dir, 0.5)) and demo["kv_keep"] == 0.5
    assert demo["perplexity_text"] == {"text": "textwrap.py", "max_tokens": 2048, "seq_len": 512}
    assert main(argv) == 0  # the table, from the cached conversion
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"KV-cache compression: CARE (checkpoint {demo['care_checkpoint']})")
    assert [line.split() for line in lines[start + 2 : start + 4]] == [
        ["original", f"{original['kv_bytes_per_token']:,.0f}", f"{original['ppl']:.2f}"],
        ["CARE", "kv-keep", "0.5", f"{care['kv_bytes_per_token']:,.0f}", f"{care['ppl']:.2f}"],
    ]
    assert lines[start + 4] == "perplexity: Python's textwrap.py, first 2048 tokens, 512-token windows"


@pytest.mark.parametrize("kv_keep", ["0", "-0.5", "1.5", "nan"])
def test_the_demo_refuses_a_kv_keep_outside_0_1_in_one_line(kv_keep, capsys):
    assert main(["demo", "--kv-keep", kv_keep]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hf-accel demo: error: --kv-keep must be in (0, 1], got {float(kv_keep)}"
    ]


def test_a_full_disk_is_one_line(monkeypatch, capsys):
    import errno

    import hf_accel.eval.cli

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_accel.eval.cli, "_run_ppl", full_disk)
    assert main(["eval", "ppl", "--text", "x.txt"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hf-accel eval: error: [Errno 28] No space left on device"]


def test_an_interrupted_command_exits_130_in_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import hf_accel.eval.cli

    def interrupted(args):
        raise KeyboardInterrupt

    def bug(args):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(hf_accel.eval.cli, "_run_ppl", interrupted)
    assert main(["eval", "ppl", "--text", "x.txt"]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]
    monkeypatch.setattr(hf_accel.eval.cli, "_run_ppl", bug)
    with pytest.raises(RuntimeError, match="a bug of ours"):  # not an exit code that hides where it came from
        main(["eval", "ppl", "--text", "x.txt"])


def test_bench_table_columns_fit_long_method_names():
    from hf_accel.eval.cli import format_bench_table

    figures = {"tokens_per_s": 10.0, "speedup": 1.5, "mean_accepted": 2.0, "identical": True}
    long_name = "ngram:hf_accel/data/indexes/smollm2-135m-chat-build"
    result = {"model": "m", "prompts": 2, "batch_size": 1, "do_sample": False, "max_new_tokens": 8,
              "methods": {long_name: {**figures, "per_category": {"a-long-category-name": figures}}}}  # fmt: skip
    table = format_bench_table(result).splitlines()
    assert "· greedy ·" in table[0]
    assert "· sampling, T = 0.7 ·" in format_bench_table({**result, "do_sample": True, "temperature": 0.7})
    row = next(line for line in table if line.startswith(long_name) and "a-long-category-name" in line)
    assert row.split() == [long_name, "a-long-category-name", "10.0", "1.50x", "2.00", "yes"]


def test_the_demo_converts_a_re_saved_model_again(tmp_path, monkeypatch):
    # the cache was keyed by the model's path only: a directory re-saved with other weights (after fine-tuning) got
    # the CARE conversion of the old weights, shown as this model's
    from hf_accel.compress import care
    from hf_accel.demo import _care_model
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    conversions = []
    convert = care.run_care_conversion
    monkeypatch.setattr(care, "run_care_conversion", lambda *a, **kw: conversions.append(1) or convert(*a, **kw))
    name, tokenizer = str(tmp_path / "mine"), make_char_tokenizer()
    for seed in (0, 0, 1):
        model = make_tiny_llama(seed=seed, vocab_size=VOCAB_SIZE)
        _care_model(name, model, tokenizer, 0.5)
    assert len(conversions) == 2  # once for the first weights, again for the re-saved ones


def test_the_demo_converts_again_a_conversion_cached_with_other_model_code(tmp_path, monkeypatch):
    # a conversion cached by an earlier hf-accel carries that version's modeling_care.py, which may not run on the
    # installed transformers (5.24 passes the cache under a new name): same weights, other code, converted again
    from hf_accel import demo
    from hf_accel.compress import care
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    conversions = []
    convert = care.run_care_conversion
    monkeypatch.setattr(care, "run_care_conversion", lambda *a, **kw: conversions.append(1) or convert(*a, **kw))
    name, tokenizer, model = str(tmp_path / "mine"), make_char_tokenizer(), make_tiny_llama(vocab_size=VOCAB_SIZE)
    for code in ("current", "current", "earlier", "earlier"):
        monkeypatch.setattr(demo, "_care_code_hash", lambda code=code: code)
        demo._care_model(name, model, tokenizer, 0.5)
    assert len(conversions) == 2


def test_the_demo_keeps_one_care_conversion_per_source_model(tmp_path, monkeypatch):
    from hf_accel.demo import care_cache_dir

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    for where in ("a", "b"):
        (tmp_path / where / "smollm2-135m").mkdir(parents=True)  # two models of the default's last name
    default = care_cache_dir("smollm2-135m", 0.5)
    first, second = (care_cache_dir(str(tmp_path / w / "smollm2-135m"), 0.5) for w in ("a", "b"))
    assert default.name == "smollm2-135m-care-kv0.5" and len({default, first, second}) == 3
    monkeypatch.chdir(tmp_path / "a")  # a Hub id's directory does not depend on where the demo runs
    hub = care_cache_dir("org/model", 0.25)
    monkeypatch.chdir(tmp_path / "b")
    assert care_cache_dir("org/model", 0.25) == hub and hub.name.startswith("model-")


def test_bad_evaluation_inputs_are_one_line(tmp_path, capsys):
    (tmp_path / "ds.jsonl").write_text('{"text": "hello world"}\n{"text": 5}\n')
    assert main(["eval", "ppl", "--dataset", str(tmp_path / "ds.jsonl"), "--split", "train"]) == 2
    assert "holds values that are not text" in capsys.readouterr().err
    (tmp_path / "p.jsonl.gz").write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n')  # not gzip
    assert main(["bench", "generate", "--prompts", str(tmp_path / "p.jsonl.gz")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a valid gzip file" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("has_eos", [True, False])
def test_a_tokenizer_without_a_pad_token_batches_prompts(tmp_path, has_eos):
    """Llama and Mistral tokenizers have no pad token, and a tokenizer may pad on the right: batched bench runs and
    self-distillation pad on the left with EOS, and leave the tokenizer as it was. One with no EOS to borrow either
    failed every batch, a single prompt included (transformers' "Asking to pad but the tokenizer does not have a
    padding token"): it pads with id 0 under the mask. Either way each answer is the one generated alone."""
    from hf_accel.speculative.drafters.build import self_distill
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import make_char_tokenizer

    model, tokenizer = make_tiny_llama(seed=0, vocab_size=128), make_char_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = None, "right"
    if not has_eos:
        tokenizer.eos_token = None
    eos = tokenizer.eos_token_id
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    prompts = [BenchPrompt(str(i), "c", text) for i, text in enumerate(["abc", "hello there", "x"])]
    result = bench_generate(model, tokenizer, prompts, ["ngram"], batch_size=3, max_new_tokens=6)
    assert result["methods"]["ngram"]["identical"] is True
    for figures in result["methods"].values():  # the first pass's time (vanilla), the engine's own (ngram)
        assert 0 < figures["prefill_seconds"] < figures["seconds"]
    answers = self_distill(model, tokenizer, prompts, tmp_path, max_new_tokens=6, use_speculation=False)
    alone = [
        self_distill(model, tokenizer, [p], tmp_path / p.question_id, 6, use_speculation=False)[0] for p in prompts
    ]
    assert answers == alone  # each answer as if generated alone: left padding, masked
    assert has_eos or all(len(a) == 6 for a in answers)
    assert tokenizer.pad_token is None and tokenizer.padding_side == "right" and tokenizer.eos_token_id == eos


def _bos_char_tokenizer():
    """The character tokenizer adding `<s>` to every text, as Llama's and Mistral's tokenizers do."""
    from tokenizers import processors

    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    return tokenizer


def test_raw_prompts_get_the_tokenizers_bos_and_chat_prompts_the_templates_alone(tmp_path):
    """A raw prompt (HumanEval, or a question for a tokenizer without a chat template) is tokenized as `generate`'s
    users and transformers' pipeline tokenize text, with a Llama tokenizer's BOS (bench and self-distillation ran
    it without, unlike the demo); a chat-templated one holds the template's BOS only, once."""
    from hf_accel.eval.bench import run_method
    from hf_accel.eval.prompts import encode_prompts
    from hf_accel.speculative.drafters.build import SELF_DISTILL_CACHE, _cache_key, self_distill
    from tests.conftest import make_tiny_llama

    model, tokenizer = make_tiny_llama(seed=0, vocab_size=128), _bos_char_tokenizer()
    (tmp_path / "p.jsonl").write_text(
        '{"task_id": "raw/0", "prompt": "def f(x):"}\n{"question_id": 1, "category": "qa", "turns": ["hi there"]}\n'
    )
    raw, chat = load_prompts(str(tmp_path / "p.jsonl"), tokenizer)
    bos = tokenizer.bos_token_id
    for prompts in ([raw], [chat], [raw, chat]):  # a file may mix both kinds in one batch
        inputs, _ = encode_prompts(tokenizer, prompts)
        for row, mask, prompt in zip(inputs["input_ids"], inputs["attention_mask"], prompts):
            ids = row[mask.bool()].tolist()
            assert ids == [bos] + tokenizer(prompt.text[len("<s>") :] if prompt.chat else prompt.text)["input_ids"][1:]
    reference = []
    for prompt in (raw, chat):
        inputs = tokenizer(prompt.text, return_tensors="pt", add_special_tokens=not prompt.chat)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        reference.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    settings = {"max_new_tokens": 6, "do_sample": False}
    run = run_method("vanilla", model, tokenizer, [raw, chat], 2, settings, extra={}, batched=True)
    assert [run.outputs[p.question_id] for p in (raw, chat)] == reference
    # an answer cached by a build that fed the raw prompt without its BOS is not this input's answer
    stale = {"key": _cache_key("", raw.text, 6), "question_id": raw.question_id, "tokens": [7, 7]}
    (tmp_path / SELF_DISTILL_CACHE).write_text(json.dumps(stale) + "\n")
    answers = self_distill(model, tokenizer, [raw, chat], tmp_path, max_new_tokens=6, use_speculation=False)
    assert answers == reference  # EOS never comes this early in these tiny answers


def test_trim_keeps_the_first_eos_and_drops_padding_only():
    from hf_accel.eval.bench import _trim

    eos = {2}
    assert _trim(torch.tensor([5, 6, 2, 0, 0]), eos, pad_id=0) == [5, 6, 2]  # EOS counts as a generated token
    assert _trim(torch.tensor([5, 2, 2, 2]), eos, pad_id=2) == [5, 2]  # padding with EOS
    assert _trim(torch.tensor([5, 6, 0, 0]), eos, pad_id=0) == [5, 6]  # a row cut short of a longer one
    assert _trim(torch.tensor([5, 6, 7]), eos, pad_id=None) == [5, 6, 7]


def test_acceptance_without_engine_statistics_leaves_the_prefill_token_out():
    from hf_accel.eval.bench import _acceptance

    # 5 generated tokens in 3 forward calls: the prefill makes the first, 2 later passes make the other 4
    assert _acceptance("pld", None, [[1, 2, 3, 4, 5]], target_calls=3) == (4, 2)
    # vanilla: one token per row and pass after the prefill, whatever the calls (rows of 3 and 1 tokens)
    assert _acceptance("vanilla", None, [[1, 2, 3], [4]], target_calls=3) == (2, 2)


@pytest.mark.parametrize("other_demo", ["killed while converting", "finished first"])
def test_two_demos_converting_the_same_model_at_once_leave_one_whole_checkpoint(tmp_path, monkeypatch, other_demo):
    # A second demo starting while the first was between saving its checkpoint and stamping it saw no stamp and removed
    # the checkpoint: the first then failed writing its stamp (FileNotFoundError) or loading
    from hf_accel import demo
    from hf_accel.compress import care
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    name, tokenizer, model = str(tmp_path / "mine"), make_char_tokenizer(), make_tiny_llama(vocab_size=VOCAB_SIZE)
    save, convert, conversions = care.save_care_model, care.run_care_conversion, []

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    def save_then_the_other_demo_runs(*args, **kwargs):
        out = save(*args, **kwargs)
        monkeypatch.setattr(care, "save_care_model", save)
        if other_demo == "killed while converting":
            monkeypatch.setattr(care, "run_care_conversion", killed)
            with pytest.raises(KeyboardInterrupt):
                demo._care_model(name, model, tokenizer, 0.5)
        else:
            demo._care_model(name, model, tokenizer, 0.5)
        monkeypatch.setattr(care, "run_care_conversion", counted)
        return out

    def counted(*args, **kwargs):
        conversions.append(1)
        return convert(*args, **kwargs)

    monkeypatch.setattr(care, "run_care_conversion", counted)
    monkeypatch.setattr(care, "save_care_model", save_then_the_other_demo_runs)
    care_model, cached = demo._care_model(name, model, tokenizer, 0.5)
    assert care_model(torch.tensor([[5, 6, 7]])).logits.isfinite().all()
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no staging folder, no second copy
    demo._care_model(name, model, tokenizer, 0.5)  # stamped: not converted again
    assert len(conversions) == 1 + (other_demo == "finished first")


def test_a_demo_removes_the_staging_folder_a_killed_demo_left(tmp_path, monkeypatch):
    """A demo killed while converting (SIGKILL, the OOM killer: no `finally` runs) left its staging folder, a whole
    CARE checkpoint, in $HF_ACCEL_HOME/models for good; another running demo's folder stays."""
    import socket

    from hf_accel import demo
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    name = str(tmp_path / "mine")
    target = demo.care_cache_dir(name, 0.5)
    host = socket.gethostname().replace("-", "_")
    dead = target.parent / f".{target.name}-999999999@{host}-k1ll3d"
    live = target.parent / f".{target.name}-{os.getppid()}@{host}-running"  # pytest's parent: a running demo's
    for folder in (dead, live):
        (folder / target.name).mkdir(parents=True)
        (folder / target.name / "model.safetensors").write_bytes(b"half")
    demo._care_model(name, make_tiny_llama(vocab_size=VOCAB_SIZE), make_char_tokenizer(), 0.5)
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, live.name])


@pytest.mark.parametrize("other_demo", ["its copy landed first", "none"])
def test_a_demo_whose_rename_fails_keeps_another_demos_copy_or_reports_it(tmp_path, monkeypatch, other_demo):
    """Two demos finishing at once: the second rename meets the first's finished copy (directory not empty) and
    keeps it. With no other copy there, the rename's error is raised. Neither leaves a staging folder."""
    from hf_accel import demo
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    name, replace = str(tmp_path / "mine"), os.replace
    target = demo.care_cache_dir(name, 0.5)

    def rename(source, destination):
        if os.fspath(destination) != os.fspath(target):
            return replace(source, destination)
        if other_demo == "none":
            raise PermissionError(13, "Permission denied", str(destination))
        shutil.copytree(source, destination)  # its copy, stamped for the same weights
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(os, "replace", rename)
    model = make_tiny_llama(vocab_size=VOCAB_SIZE)
    if other_demo == "none":
        with pytest.raises(PermissionError, match="Permission denied"):
            demo._care_model(name, model, make_char_tokenizer(), 0.5)
        assert list(target.parent.iterdir()) == []
        return
    care_model, cached = demo._care_model(name, model, make_char_tokenizer(), 0.5)
    assert cached == target and care_model(torch.tensor([[5, 6, 7]])).logits.isfinite().all()
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]


@pytest.mark.parametrize("method", ["vanilla:x", "pld:5"])
def test_a_baseline_with_an_argument_is_refused_in_one_line(method):
    from hf_accel.eval.bench import check_method_names

    name = method.partition(":")[0]
    with pytest.raises(ValueError, match=rf"^method '{name}' takes no ':' argument, got '{method}' \(pld's window is"):
        check_method_names(["vanilla", method])


def test_a_sampled_benchmark_passes_its_temperature_and_claims_no_identity(monkeypatch):
    from hf_accel.eval import bench
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import make_char_tokenizer

    seen = []
    generate = bench._generate
    monkeypatch.setattr(
        bench, "_generate", lambda m, t, p, kwargs, extra: seen.append(kwargs) or generate(m, t, p, kwargs, extra)
    )
    model, tokenizer = make_tiny_llama(seed=0, vocab_size=128), make_char_tokenizer()
    prompts = [BenchPrompt(str(i), "c", text) for i, text in enumerate(["abc", "hello"])]
    result = bench_generate(model, tokenizer, prompts, ["ngram"], max_new_tokens=4, do_sample=True, temperature=0.5)
    assert result["do_sample"] is True and result["temperature"] == 0.5
    assert all(k["do_sample"] and (k["temperature"], k["top_k"], k["top_p"]) == (0.5, 0, 1.0) for k in seen)
    assert {name: figures["identical"] for name, figures in result["methods"].items()} == {
        "vanilla": None,
        "ngram": None,
    }
