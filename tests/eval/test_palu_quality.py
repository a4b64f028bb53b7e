"""The Palu quality benchmark on a tiny model: one calibration and one evaluation for Palu and CARE rows."""

import math

import pytest
import torch

from hf_accel.eval.palu_quality import PaluBenchConfig, format_palu_table, run_palu_quality_benchmark
from tests.compress.test_palu import CALIB_TEXT, TINY
from tests.conftest import make_tiny_llama
from tests.tiny_checkpoints import make_char_tokenizer


def test_full_rank_palu_and_care_rows_match_the_original_under_mixed_calibration():
    model, tokenizer = make_tiny_llama(**TINY), make_char_tokenizer()
    config = PaluBenchConfig(
        group_sizes=(2,), rank_methods=("uniform",), kv_keeps=(1.0,), bits=(4,), no_hadamard_bits=(),
        calib_samples=4, calib_generated_samples=2, calib_seq_len=32, fisher_samples=2, rank_multiple=1,
        eval_tokens=256, eval_seq_len=64, generated_samples=2, generated_seq_len=16, care_methods=("care",),
        residual_lengths=(4,), window_bytes_context=96,
    )  # fmt: skip
    report = run_palu_quality_benchmark(model, tokenizer, CALIB_TEXT[:20000], CALIB_TEXT[20000:], config, False)
    base, rows = report["base"], report["rows"]
    assert [(r["converter"], r["bits"], r.get("residual_length")) for r in rows] == [
        ("palu", 0, None), ("palu", 4, None), ("palu", 4, 4), ("care", 0, None)
    ]  # fmt: skip
    palu_float, palu_4bit, windowed, care = rows
    # The window row: decoding perplexity past the window, beside the float model's on the same positions, and
    # bytes at 96 tokens: 4-bit codes for all of them plus a 2-byte copy of the last 4 (what the next query reads,
    # or the last query again if its pass is cropped away).
    assert windowed["float_ppl_text"] != palu_float["ppl_text"] and windowed["bytes_context"] == 96
    assert windowed["float_base_ppl_text"] == pytest.approx(windowed["float_ppl_text"], rel=1e-4)  # full rank
    window_bytes = palu_float["cache_bytes_per_token"] * 4 / 96  # float latents are measured in bfloat16 too
    window_bytes += model.config.num_hidden_layers * 4 * 8 / 96  # and their int64 positions, one per layer
    assert windowed["cache_bytes_per_token"] == pytest.approx(palu_4bit["cache_bytes_per_token"] + window_bytes)
    assert abs(windowed["ppl_text"] / windowed["float_ppl_text"] - 1) < abs(
        palu_4bit["ppl_text"] / base["ppl_text"] - 1
    )
    for row in (palu_float, care):  # full rank: the same model, scored on the same texts
        assert row["ppl_text"] == pytest.approx(base["ppl_text"], rel=1e-4)
        assert row["ppl_generated"] == pytest.approx(base["ppl_generated"], rel=1e-4)
    assert palu_4bit["cache_bytes_per_token"] < palu_float["cache_bytes_per_token"]
    assert care["cache_bytes_per_token"] == pytest.approx(base["cache_bytes_per_token"])  # all K/V width kept
    table = format_palu_table(report)
    assert table.count("\n| CARE | care | 1.0 |") == 1 and table.count("\n| 2 | uniform | 1.0 |") == 3
    assert "| 4 + 4 fp (float there: " in table
    line = next(x for x in table.splitlines() if "| 4 + 4 fp (float there: " in x)
    ratio = windowed["ppl_text"] / windowed["float_base_ppl_text"]  # against the original on the same positions
    assert f" {windowed['ppl_text']:.2f} | {ratio:.3f} |" in line


def test_window_settings_are_checked_before_anything_runs_and_short_texts_still_score():
    from hf_accel.eval.perplexity import perplexity_on_ids

    model, tokenizer = make_tiny_llama(**TINY), make_char_tokenizer()
    small = {
        "group_sizes": (2,),
        "rank_methods": ("uniform",),
        "kv_keeps": (1.0,),
        "bits": (4,),
        "no_hadamard_bits": (),
    }
    small.update(calib_samples=2, calib_seq_len=32, fisher_samples=2, rank_multiple=1, eval_seq_len=64)
    with pytest.raises(ValueError, match=r"residual_lengths \[63\] must be in \[1, 62\]"):
        run_palu_quality_benchmark(
            model, tokenizer, CALIB_TEXT, CALIB_TEXT, PaluBenchConfig(**small, residual_lengths=(63,)), False
        )
    with pytest.raises(ValueError, match="no full window of 64 tokens"):
        run_palu_quality_benchmark(
            model, tokenizer, CALIB_TEXT, CALIB_TEXT[:40], PaluBenchConfig(**small, residual_lengths=(4,)), False
        )
    report = run_palu_quality_benchmark(model, tokenizer, CALIB_TEXT, CALIB_TEXT[:40], PaluBenchConfig(**small), False)
    assert len(report["rows"]) == 2  # a held-out text shorter than one window is scored as before
    with pytest.raises(ValueError, match="skip must be in"):
        perplexity_on_ids(model, torch.zeros(1, 8, dtype=torch.long), skip=7)


def test_windowed_rows_without_generated_text_and_progress_lines_on_stderr(capsys):
    # without held-out generated text, a windowed row and its float references have text perplexities only; with
    # progress, every row is also written as one JSON line on stderr as it is measured, stdout left alone
    import json

    model, tokenizer = make_tiny_llama(**TINY), make_char_tokenizer()
    config = PaluBenchConfig(
        group_sizes=(2,), rank_methods=("uniform",), kv_keeps=(1.0,), bits=(4,), no_hadamard_bits=(),
        calib_samples=4, calib_seq_len=32, fisher_samples=2, rank_multiple=1, eval_tokens=256, eval_seq_len=64,
        care_methods=("care",), residual_lengths=(4,), window_bytes_context=96,
    )  # fmt: skip
    report = run_palu_quality_benchmark(model, tokenizer, CALIB_TEXT[:20000], CALIB_TEXT[20000:], config, True)
    windowed = report["rows"][2]
    assert windowed["residual_length"] == 4 and not [k for k in windowed if "generated" in k]
    assert windowed["float_base_ppl_text"] == pytest.approx(windowed["float_ppl_text"], rel=1e-4)  # full rank
    assert "| 4 + 4 fp (float there: " in format_palu_table(report)
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert lines == [{"base": report["base"], **report["timings"]}, *report["rows"]] and out == ""


def test_bench_palu_script_refuses_an_unknown_care_method_before_running(capsys):
    # CARE rows run after the whole Palu grid: a misspelt method must fail at parse time, not hours later
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "bench_palu.py"), run_name="x")
    assert script["parse_args"](["--care-methods", "care", "svd"]).care_methods == ["care", "svd"]
    with pytest.raises(SystemExit) as exit_info:
        script["parse_args"](["--care-methods", "carre"])
    assert exit_info.value.code == 2 and "invalid choice: 'carre'" in capsys.readouterr().err
    for argv, message in [
        (["--compare-ranks"], "needs --generated-samples N and uniform among --ranks"),
        (["--compare-ranks", "--generated-samples", "4", "--ranks", "fisher"], "uniform among --ranks"),
        (["--compare-ranks", "--generated-samples", "4", "--care-methods", "care"], "drop --care-methods"),
    ]:
        with pytest.raises(SystemExit):
            script["parse_args"](argv)
        assert message in capsys.readouterr().err
    assert script["parse_args"](["--compare-ranks", "--generated-samples", "4"]).compare_ranks


def test_bench_palu_json_is_strict_with_a_perplexity_past_the_float_range(capsys, tmp_path):
    # a diverged row's perplexity is inf, which json.dumps printed as Infinity: not JSON, refused by jq
    import json
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "bench_palu.py"), run_name="x")
    report = {"base": {"ppl": 12.5}, "rows": [{"bits": 2, "ppl": math.inf}, {"bits": 3, "ppl": math.nan}]}
    script["main"].__globals__.update(
        load_model_and_tokenizer=lambda *a, **k: (None, None), run_palu_quality_benchmark=lambda *a, **k: dict(report)
    )
    (tmp_path / "t.txt").write_text("some text")
    assert script["main"](["--text", str(tmp_path / "t.txt"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert [row["ppl"] for row in printed["rows"]] == [None, None] and printed["base"]["ppl"] == 12.5


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"kv_keeps": (0.5, 1.5)}, "kv_keep must be in"),
        ({"bits": (3, 5)}, "quant_bits must be one of"),
        ({"no_hadamard_bits": (8,)}, "quant_bits must be one of"),
        ({"group_sizes": (0,)}, "group_size must be a positive integer"),
        ({"quant_group_size": 3}, "quant_group_size must be 0"),
        ({"care_methods": ("carre",)}, "unknown CARE method"),
    ],
)
def test_grid_values_are_checked_before_anything_runs(bad, message):
    # the model is None: a check made after the calibration would fail on it instead
    with pytest.raises(ValueError, match=message):
        run_palu_quality_benchmark(None, None, "", "", PaluBenchConfig(**bad), False)


@pytest.mark.parametrize(
    "text,generated,fisher,expected",
    [
        (16, 16, 8, [0, 1, 2, 3, 16, 17, 18, 19]),  # the README's tables: 4 of each kind
        (4, 2, 2, [0, 4]),
        (2, 16, 8, [0, 1, 2, 3, 4, 5, 6, 7]),  # gave rows 0-3 and 2-5: generated 2, 3 twice
        (16, 2, 8, [0, 1, 2, 3, 4, 5, 16, 17]),  # gave 6 rows, 4 text and 2 generated
        (8, 0, 4, [0, 1, 2, 3]),
    ],
)
def test_fisher_rows_are_distinct_half_text_half_generated(text, generated, fisher, expected):
    from hf_accel.eval.palu_quality import fisher_rows

    ids = torch.arange(text + generated)[:, None].expand(-1, 4)  # row i holds i: text windows, then generated rows
    config = PaluBenchConfig(calib_samples=text, calib_generated_samples=generated, fisher_samples=fisher)
    assert fisher_rows(ids, config)[:, 0].tolist() == expected


def test_rank_comparison_pairs_each_method_with_the_uniform_conversion_of_its_cell():
    from hf_accel.eval.palu_quality import compare_rank_methods, format_rank_comparison

    model, tokenizer = make_tiny_llama(**TINY), make_char_tokenizer()
    config = PaluBenchConfig(
        group_sizes=(2,), rank_methods=("uniform", "fisher", "kfac"), kv_keeps=(1.0, 0.5), calib_samples=4,
        calib_generated_samples=2, calib_seq_len=32, fisher_samples=2, rank_multiple=1, eval_tokens=256,
        eval_seq_len=64, generated_samples=2, generated_seq_len=16,
    )  # fmt: skip
    report = compare_rank_methods(model, tokenizer, CALIB_TEXT[:20000], CALIB_TEXT[20000:], config, False)
    rows = {(r["kv_keep"], r["ranks"]): r for r in report["rows"]}
    assert list(rows) == [(k, r) for k in (1.0, 0.5) for r in ("uniform", "fisher", "kfac")]
    for (kv_keep, ranks), row in rows.items():
        uniform = rows[kv_keep, "uniform"]
        assert ("vs_uniform" in row) == (ranks != "uniform")
        for name in ("text", "generated", "calibration_text", "calibration_generated") if ranks != "uniform" else ():
            diff = row["vs_uniform"][name]
            # the mean per-token difference is the log of the perplexity ratio on the same rows
            assert diff["nats_per_token"] == pytest.approx(math.log(row[f"ppl_{name}"] / uniform[f"ppl_{name}"]))
            assert diff["low"] <= diff["nats_per_token"] <= diff["high"]
            if kv_keep == 1.0:  # full rank: every allocation is the original model
                assert row[f"ppl_{name}"] == pytest.approx(report["base"][f"ppl_{name}"], rel=1e-4)
                assert abs(diff["low"]) < 1e-4 and abs(diff["high"]) < 1e-4
    assert rows[0.5, "fisher"]["k_ranks"] != rows[0.5, "uniform"]["k_ranks"]  # the allocations differ
    assert set(report["base"]) == {"ppl_text", "ppl_generated", "ppl_calibration_text", "ppl_calibration_generated"}
    table = format_rank_comparison(report).splitlines()
    assert table[0].startswith("| gs | kv-keep | ranks | text ppl | vs uniform | generated ppl | vs uniform |")
    line = next(x for x in table if x.startswith("| 2 | 0.5 | fisher | "))
    d = rows[0.5, "fisher"]["vs_uniform"]["text"]
    mean = f"{d['nats_per_token']:+.3f}".replace("-", "−")
    assert (f"| **{mean}** [" if d["high"] < 0 else f"| {mean} [") in line  # bold only beyond the noise
    with pytest.raises(ValueError, match="'uniform' among the rank methods"):
        compare_rank_methods(model, tokenizer, CALIB_TEXT, CALIB_TEXT, PaluBenchConfig(rank_methods=("fisher",)))
