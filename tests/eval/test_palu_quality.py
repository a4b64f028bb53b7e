"""The Palu quality benchmark on a tiny model: one calibration and one evaluation for Palu and CARE rows."""

import pytest

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
    )  # fmt: skip
    report = run_palu_quality_benchmark(model, tokenizer, CALIB_TEXT[:20000], CALIB_TEXT[20000:], config, False)
    base, rows = report["base"], report["rows"]
    assert [(r["converter"], r["bits"]) for r in rows] == [("palu", 0), ("palu", 4), ("care", 0)]
    palu_float, palu_4bit, care = rows
    for row in (palu_float, care):  # full rank: the same model, scored on the same texts
        assert row["ppl_text"] == pytest.approx(base["ppl_text"], rel=1e-4)
        assert row["ppl_generated"] == pytest.approx(base["ppl_generated"], rel=1e-4)
    assert palu_4bit["cache_bytes_per_token"] < palu_float["cache_bytes_per_token"]
    assert care["cache_bytes_per_token"] == pytest.approx(base["cache_bytes_per_token"])  # all K/V width kept
    table = format_palu_table(report)
    assert table.count("\n| CARE | care | 1.0 |") == 1 and table.count("\n| 2 | uniform | 1.0 |") == 2
