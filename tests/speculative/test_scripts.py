"""The speculative-decoding scripts of `scripts/` (pass cost, time split, offline simulation) on tiny inputs."""

import contextlib
import json
import runpy
from pathlib import Path

import pytest
import torch

import hf_accel.loading
from tests.conftest import make_tiny_llama
from tests.tiny_checkpoints import make_char_tokenizer


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(name: str) -> dict:
    return runpy.run_path(str(SCRIPTS / name), run_name="script")


@pytest.fixture
def tiny_loaded(monkeypatch):
    """`load_model_and_tokenizer` returns a tiny Llama and the character tokenizer (the scripts import it lazily)."""
    monkeypatch.setattr(
        hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: (make_tiny_llama(), make_char_tokenizer())
    )


@pytest.mark.parametrize(
    "bad", [["--tokens", "0"], ["--tokens", "2", "-1"], ["--context", "0"], ["--repeats", "0"], ["--batch-size", "0"]]
)
def test_pass_cost_refuses_sizes_below_one(tiny_loaded, capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        run_script("pass_cost.py")["main"](bad)
    assert exit_info.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_pass_cost_json_holds_the_printed_ratios(tiny_loaded, capsys):
    main = run_script("pass_cost.py")["main"]
    assert main(["--tokens", "4", "2", "--context", "8", "--repeats", "1", "--batch-size", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["ms"]) == list(report["relative"]) == list(report["head_ms"]) == ["1", "2", "4"]
    assert report["relative"]["1"] == 1.0 and report["context"] == 8 and report["batch_size"] == 3
    assert list(report["engine_ms"]) == list(report["engine_relative"]) == ["1", "2", "4"]
    assert all(set(rows) <= {1, 2, 4, 8, 16, 32} for rows in report["engine_layout_rows"].values())


def simulation_inputs(tmp_path, count: int = 4) -> list[str]:
    """A tiny checkpoint, `count` HumanEval-style prompts and a self-distillation cache of their outputs."""
    from hf_accel.eval.prompts import load_prompts
    from hf_accel.loading import load_tokenizer
    from hf_accel.speculative.drafters.build import _cache_key
    from tests.tiny_checkpoints import write_tiny_llama

    prompts, cache = tmp_path / "prompts.jsonl", tmp_path / "cache.jsonl"
    prompts.write_text(
        "".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}():\n"}) + "\n" for i in range(count))
    )
    model = str(write_tiny_llama(tmp_path / "tiny"))
    texts = [p.text for p in load_prompts(str(prompts), load_tokenizer(model))]  # as the script and the cache key them
    outputs = [[10 + (i + j) % 7 for j in range(24)] for i in range(count)]  # repetitive: the drafter matches
    records = [
        {"key": _cache_key(model, text, 256), "question_id": f"t{i}", "model": "tiny", "tokens": tokens}
        for i, (text, tokens) in enumerate(zip(texts, outputs))
    ]
    cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    return ["--cache", str(cache), "--prompts", str(prompts), "--model", model]


@pytest.mark.parametrize("eval_last", ["0", "-1", "5"])
def test_simulate_ngram_refuses_an_eval_split_outside_the_cache(tmp_path, monkeypatch, capsys, eval_last):
    # 0 evaluated every output (records[-0:]) and indexed none; more than the cache holds evaluated fewer than asked
    args = simulation_inputs(tmp_path)
    monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *args, "--eval-last", eval_last])
    with pytest.raises(SystemExit) as exit_info:
        run_script("simulate_ngram.py")["main"]()
    assert exit_info.value.code == 2 and "--eval-last must be in [1, 4]" in capsys.readouterr().err


def test_simulate_ngram_needs_something_to_index(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SIM_INDEX", raising=False)  # both rows: without and with the index
    monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *simulation_inputs(tmp_path), "--eval-last", "4"])
    with pytest.raises(SystemExit) as exit_info:
        run_script("simulate_ngram.py")["main"]()
    assert exit_info.value.code == 2 and "nothing to index" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *simulation_inputs(tmp_path), "--eval-last", "1", "--json"])
    run_script("simulate_ngram.py")["main"]()
    report = json.loads(capsys.readouterr().out)  # one document, nothing else on stdout
    assert (report["index_outputs"], report["eval_outputs"]) == (3, 1) and report["index_tokens"] >= 3 * 24
    assert [r["index"] for r in report["rows"]] == [False, True]
    assert all(r["mean_accepted"] > 1 for r in report["rows"])


def test_simulate_ngram_reads_extra_docs_as_json_not_pickle(tmp_path, monkeypatch, capsys):
    # --extra-docs was a pickle, read with pickle.load: a file that runs code on load. It is a JSON list of documents
    import pickle

    monkeypatch.delenv("SIM_INDEX", raising=False)
    args = [*simulation_inputs(tmp_path), "--eval-last", "1", "--json"]
    (tmp_path / "extra.json").write_text(json.dumps([[10 + j % 7 for j in range(30)], [5, 6]]))
    monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *args, "--extra-docs", str(tmp_path / "extra.json")])
    run_script("simulate_ngram.py")["main"]()
    assert json.loads(capsys.readouterr().out)["index_tokens"] >= 3 * 24 + 32
    (tmp_path / "extra.pkl").write_bytes(pickle.dumps([[1, 2]]))
    for name, text in (("extra.pkl", None), ("bad.json", '[[1, "2"]]'), ("missing.json", None)):
        if text is not None:
            (tmp_path / name).write_text(text)
        monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *args, "--extra-docs", str(tmp_path / name)])
        with pytest.raises(SystemExit) as exit_info:
            run_script("simulate_ngram.py")["main"]()
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and f"--extra-docs {tmp_path / name}" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "bad", [["--batch-size", "0"], ["--num-batches", "0"], ["--max-new-tokens", "0"], ["--temperature", "-1"]]
)
def test_generate_time_split_refuses_bad_sizes_and_temperatures(tiny_loaded, capsys, bad):
    # batch size / batches 0 said "no prompts left after --offset 0"; a negative temperature silently ran greedy
    with pytest.raises(SystemExit) as exit_info:
        run_script("generate_time_split.py")["main"](bad)
    assert exit_info.value.code == 2 and "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, extra", [("generate_time_split.py", ["--json"]), ("probe_close_holes.py", ["--reps", "1", "--json"])]
)
def test_timing_scripts_feed_the_prompts_as_bench_generate_does(script, extra, monkeypatch, tmp_path, capsys):
    """A chat template that writes the BOS got a second one from the tokenizer: the scripts timed other inputs than
    `bench generate` runs."""
    from tokenizers import processors

    from hf_accel.eval.prompts import encode_prompts, load_prompts

    tokenizer = make_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    model, seen = make_tiny_llama(vocab_size=128), []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: seen.append(kwargs["input_ids"]) or generate(**kwargs))
    monkeypatch.setattr(hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: (model, tokenizer))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": ["hello there"]}\n')
    argv = ["--prompts", str(prompts), "--batch-size", "2", "--drafter", "ngram", "--max-new-tokens", "4", *extra]
    assert run_script(script)["main"](argv) == 0
    expected = encode_prompts(tokenizer, load_prompts(str(prompts), tokenizer))[0]["input_ids"]
    assert seen and all(ids.tolist() == expected.tolist() for ids in seen)
    assert expected[1].tolist()[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("[")]  # one BOS
    assert json.loads(capsys.readouterr().out).get("identical", True)


@pytest.mark.parametrize(
    "grid, message",
    [
        ('{"priorr": [5]}', "unknown InfinigramConfig field(s) priorr"),
        ('{"prior": 5}', "non-empty lists"),
        ("{prior", "not JSON"),
        ('{"prior": [5], "min_match": [1, 0]}', "--grid: InfinigramConfig.min_match must be an integer >= 1, got 0"),
    ],
)
def test_simulate_ngram_refuses_a_bad_grid_in_one_line(tmp_path, monkeypatch, capsys, grid, message):
    # a misspelt field was a TypeError traceback from InfinigramConfig, a bare value one from itertools.product
    monkeypatch.setattr(
        "sys.argv", ["simulate_ngram.py", *simulation_inputs(tmp_path), "--eval-last", "1", "--grid", grid]
    )
    with pytest.raises(SystemExit) as exit_info:
        run_script("simulate_ngram.py")["main"]()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_infinigram_query_refuses_no_queries_and_too_small_an_index(tmp_path, monkeypatch, capsys):
    # --queries 0 ended in an IndexError, and an existing index of under ~600 tokens in rng.integers
    from hf_accel.speculative.drafters.index import build_index

    main = run_script("bench_infinigram_query.py")["main"]
    monkeypatch.setattr("sys.argv", ["bench_infinigram_query.py", "--out", str(tmp_path / "a"), "--queries", "0"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "--queries must be >= 1" in capsys.readouterr().err
    build_index([list(range(50))], tmp_path / "small", "synthetic", "0" * 16, 49152)
    monkeypatch.setattr("sys.argv", ["bench_infinigram_query.py", "--out", str(tmp_path / "small"), "--queries", "2"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "the benchmark needs at least 1000" in capsys.readouterr().err


def test_simulate_ngram_leaves_out_a_last_line_cut_short(tmp_path, monkeypatch, capsys):
    # an interrupted `index build` can leave half a record at the end of the cache: self_distill drops it on its next
    # run, and the simulation crashed on it with a JSONDecodeError
    monkeypatch.setenv("SIM_INDEX", "[true]")
    args = [*simulation_inputs(tmp_path), "--eval-last", "1"]
    printed = []
    for cut in (False, True):
        if cut:
            with open(args[1], "a") as f:
                f.write('{"key": "abc", "question_id": "t9", "tok')
        monkeypatch.setattr("sys.argv", ["simulate_ngram.py", *args])
        run_script("simulate_ngram.py")["main"]()
        printed.append(capsys.readouterr().out)
    assert printed[1] == printed[0] and "eval on 1 outputs" in printed[0]
    with open(args[1], "a") as f:
        f.write('\n{"key": "def"}\n')  # a broken line that is not the last one is an error
    with pytest.raises(SystemExit, match="line 5 is not a self-distillation record"):
        run_script("simulate_ngram.py")["main"]()


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py") if "add_argument" in p.read_text()))
def test_every_script_answers_help_and_a_bad_option_in_one_line(name, monkeypatch, capsys):
    # argparse printed the whole usage before the message; `hf-accel`'s own commands say it in one line
    script = run_script(name)
    for argv, code in ((["--help"], 0), (["--no-such-option"], 2)):
        monkeypatch.setattr("sys.argv", [name, *argv])
        with pytest.raises(SystemExit) as exit_info:
            script["main"]()
        assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{name}: error: ") and "--help" in err


def test_probe_half_precision_flips_counts_differing_outputs_and_gives_the_gap_there(monkeypatch, tmp_path, capsys):
    """The probe reports how often speculative greedy output differs from plain `generate` and plain decoding's
    top-2 logit gap at the first differing token (issue 6: a near-tie flip is reported, never hidden)."""
    model = make_tiny_llama(vocab_size=128)
    monkeypatch.setattr(hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: (model, make_char_tokenizer()))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    argv = ["--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "6", "--json"]
    main = run_script("probe_half_precision_flips.py")["main"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_prompts"], report["differing"], report["flips"]) == (3, 0, [])  # float32: identical
    assert report["reference_tokens"] == 18

    generate, logits = model.generate, []

    def flip_third_token(**kwargs):  # the speculative output of the second prompt differs at its third new token
        if "custom_generate" not in kwargs:
            out = generate(**kwargs)
            logits.append(out.logits[2][0])
            return out
        kwargs.pop("custom_generate"), kwargs.pop("drafter")
        out = generate(**kwargs).clone()
        if len(logits) == 2:
            out[0, kwargs["input_ids"].shape[1] + 2] += 1
        return out

    monkeypatch.setattr(model, "generate", flip_third_token)
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    top = logits[1].topk(2).values
    assert report["differing"] == 1
    assert report["flips"] == [
        {"question_id": "t1", "new_token": 2, "top2_gap": pytest.approx(float(top[0] - top[1]))}
    ]
    run = run_script("probe_half_precision_flips.py")
    assert run["first_divergence"]([1, 2, 3], [1, 2]) == 2 and run["first_divergence"]([1, 2], [1, 2]) is None


def test_probe_half_precision_flips_ignores_the_padding_after_a_rows_eos(monkeypatch, tmp_path, capsys):
    """At --batch-size > 1 a finished row is padded to the batch's longest row, which differs between the two outputs
    whenever another row does: an identical row was counted as a flip at its padding (and its padding as tokens)."""
    from types import SimpleNamespace

    model = make_tiny_llama(vocab_size=128)
    model.generation_config.eos_token_id = 2
    monkeypatch.setattr(hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: (model, make_char_tokenizer()))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}(x):\n"}) + "\n" for i in range(2)))

    def fake_generate(**kwargs):  # row 0 ends alike in both; row 1 differs at its third new token and ends there
        width, pad = kwargs["input_ids"].shape[1], kwargs["pad_token_id"]
        if "custom_generate" in kwargs:
            new = [[5, 2, pad, pad], [6, 7, 2, pad]]
        else:
            new = [[5, 2, pad, pad, pad, pad], [6, 7, 8, 9, 10, 11]]
        sequences = torch.cat([kwargs["input_ids"], torch.tensor(new)], dim=1)
        if "custom_generate" in kwargs:
            return sequences
        logits = [torch.arange(128.0).repeat(2, 1) for _ in range(sequences.shape[1] - width)]  # gap 1 everywhere
        return SimpleNamespace(sequences=sequences, logits=logits)

    monkeypatch.setattr(model, "generate", fake_generate)
    argv = ["--prompts", str(prompts), "--dtype", "float32", "--batch-size", "2", "--max-new-tokens", "6", "--json"]
    assert run_script("probe_half_precision_flips.py")["main"](argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["flips"] == [{"question_id": "t1", "new_token": 2, "top2_gap": 1.0}]
    assert report["reference_tokens"] == 2 + 6


@pytest.mark.parametrize(
    "parts",
    [
        "plain-layout",
        "transposed-layout",
        "no-one-row",
        "no-gqa-packing",
        "no-grouped-prefill",
        "no-drafts",
        "transposed-layout,no-gqa-packing",
    ],
)
def test_the_engine_parts_probe_forces_each_part(tiny_loaded, capsys, monkeypatch, parts):
    from hf_accel.kernels import gqa_attention
    from hf_accel.kernels.cpu_linear import ROW_GRID
    from hf_accel.speculative import engine, prefill
    from hf_accel.speculative.drafters.infinigram import InfinigramDrafter

    for module, name in [(engine, "verification_layout"), (engine, "packed_gqa_attention"),
                         (prefill, "PASS_OVERHEAD_TOKENS"), (InfinigramDrafter, "propose")]:  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    proposes = InfinigramDrafter.propose
    measured = engine.verification_layout
    if parts == "no-one-row":  # a measurement that took every count, one row too
        from hf_accel.kernels import cpu_linear

        monkeypatch.setattr(
            cpu_linear, "transposed_row_counts", lambda ws: {cpu_linear.shape_key(w): frozenset(ROW_GRID) for w in ws}
        )
    main = run_script("probe_engine_parts.py")["main"]
    for bad in ("sideways", "plain-layout,transposed-layout", "no-one-row,transposed-layout"):
        assert main([bad, "scripts/pass_cost.py"]) == 2 and "usage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # the script's own `sys.exit(main())`
        main([parts, str(SCRIPTS / "pass_cost.py"), "--tokens", "2", "--context", "8", "--repeats", "1"])
    assert exit_info.value.code == 0 and "in the engine's layout" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([parts, str(SCRIPTS / "pass_cost.py"), "--tokens", "2", "--context", "8", "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    parts = parts.split(",")
    if "plain-layout" in parts or "transposed-layout" in parts:  # the script measured in the forced layout
        rows = [] if "plain-layout" in parts else list(ROW_GRID)
        assert set(map(tuple, report["engine_layout_rows"].values())) == ({tuple(rows)} if rows else set())
    chosen = engine.verification_layout(make_tiny_llama())
    if "plain-layout" in parts:
        assert chosen is None
    elif "transposed-layout" in parts:
        assert set(chosen.row_counts.values()) == {frozenset(ROW_GRID)}
    elif "no-one-row" in parts:  # the measured counts, one row left out
        assert set(chosen.row_counts.values()) == {frozenset(ROW_GRID) - {1}}
        assert set(map(tuple, report["engine_layout_rows"].values())) == {tuple(ROW_GRID[1:])}
    else:
        assert engine.verification_layout is measured
    assert (engine.packed_gqa_attention is contextlib.nullcontext) == ("no-gqa-packing" in parts)
    assert gqa_attention.packed_gqa_attention is not contextlib.nullcontext  # the engine's name alone is patched
    assert prefill.PASS_OVERHEAD_TOKENS == ({} if "no-grouped-prefill" in parts else {"cpu": 32})
    drafter = InfinigramDrafter(None)
    request = None  # a drafter with no drafts answers without reading it
    if "no-drafts" in parts:
        assert drafter.propose(request) is None
    else:
        assert InfinigramDrafter.propose is proposes
