"""The README's benchmark tables hold every cell their issue asks for, with the figures of the JSON records they cite."""

import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _table(header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the README's Markdown table whose header line is `header`."""
    assert README.count(header + "\n") == 1, f"README has no single table headed {header!r}"
    lines = README.split(header + "\n", 1)[1].splitlines()[1:]  # past the |---| line
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _numbers(cell: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", cell)]


CARE_METHODS = ["svd", "asvd", "care-u", "care-e-raw", "care-e-rel", "care"]
CARE_HEADER = "| kv-keep | {} | **care** (default) |"


@pytest.fixture(scope="module")
def care_results():
    report = json.loads((ROOT / "scripts" / "bench_care_results.json").read_text())
    return {(r["kv_keep"], r["method"]): r for r in report["results"]}


def test_the_care_table_gives_perplexities_and_bytes_of_every_method_and_budget(care_results):
    """Issue 3: SVD, ASVD, CARE-U, CARE-E and the default at kv-keep 0.75 / 0.5 / 0.25 / 0.125, perplexity on
    tinyshakespeare and on generated text, and cache bytes per token, as `scripts/bench_care_results.json` has them."""
    rows = _table(CARE_HEADER.format("KV bytes/token | " + " | ".join(CARE_METHODS[:-1])))
    by_budget = {float(row[0].split()[0]): row for row in rows}
    assert set(by_budget) == {1.0, 0.75, 0.5, 0.25, 0.125}
    for kv_keep in (0.75, 0.5, 0.25, 0.125):
        row = by_budget[kv_keep]
        assert _numbers(row[1]) == [care_results[kv_keep, "care"]["cache_bytes_per_token"]]
        for method, cell in zip(CARE_METHODS, row[2:]):
            ppl = care_results[kv_keep, method]["ppl"]
            assert _numbers(cell) == pytest.approx([ppl["shakespeare"], ppl["generated"]], rel=0.01), (kv_keep, method)


def test_the_care_table_gives_the_conversion_time_of_every_method_and_budget(care_results):
    """Issue 3 asks the README's table for conversion time too; it gave a range and sent the reader to
    `scripts/bench_care.md`."""
    rows = _table(CARE_HEADER.format(" | ".join(CARE_METHODS[:-1])))
    assert [float(row[0]) for row in rows] == [0.75, 0.5, 0.25, 0.125]
    for row in rows:
        seconds = [care_results[float(row[0]), method]["factorization_seconds"] for method in CARE_METHODS]
        assert [_numbers(cell) for cell in row[1:]] == [[round(s, 1)] for s in seconds], row


def _palu_rows(name):
    report = json.loads((ROOT / "docs" / "palu" / name).read_text())
    rows = {(r["group_size"], r["ranks"], r["kv_keep"], r["hadamard"], r["bits"]): r for r in report["rows"]}
    return report["base"], rows


def _palu_cell(row) -> list[float]:
    return [round(row["ppl_text"], 1), round(row["ppl_generated"], 2), row["cache_bytes_per_token"]]


def test_the_palu_table_gives_every_bit_width_with_and_without_the_rotation():
    """Issue 4: perplexity and bytes for gs 1/3, uniform vs Fisher, with and without WHT at 2/3/4 bits, at kv-keep
    0.75 and 0.5, next to CARE at the same budgets: every cell as the two JSON records of its commands have it."""
    base, records = _palu_rows("bench_palu_mixed_calibration.json")
    kfac_base, kfac = _palu_rows("bench_palu_mixed_calibration_kfac.json")
    assert kfac_base == {**base, "eval_s": kfac_base["eval_s"]}  # one calibration and evaluation for both runs
    records.update(kfac)
    rows = _table(
        "| gs | ranks | kv-keep | float latents | 4-bit + WHT | 3-bit + WHT | 2-bit + WHT | 4-bit, no WHT "
        "| 3-bit, no WHT | 2-bit, no WHT |"
    )
    assert rows[0][:3] == ["original", "", "1.0"] and _numbers(rows[0][3]) == _palu_cell(base)
    columns = [(True, 0), (True, 4), (True, 3), (True, 2), (False, 4), (False, 3), (False, 2)]
    cells = {(int(row[0]), row[1], float(row[2])): row[3:] for row in rows[1:] if row[0] != "CARE"}
    expected = {(gs, ranks, kv) for gs in (1, 3) for ranks in ("uniform", "fisher", "kfac") for kv in (0.75, 0.5)}
    assert set(cells) == expected
    for gs, ranks, kv in expected:
        want = [_palu_cell(records[gs, ranks, kv, hadamard, bits]) for hadamard, bits in columns]
        assert [_numbers(cell) for cell in cells[gs, ranks, kv]] == want, (gs, ranks, kv)
    care = {float(row[2]): _numbers(row[3]) for row in rows if row[0] == "CARE"}
    assert care == {kv: _palu_cell(records[None, "care", kv, False, 0]) for kv in (0.75, 0.5)}


def test_the_rank_comparison_table_and_its_verdict_are_the_json_record():
    """Issue 4, Fisher vs uniform: the README's table is `format_rank_comparison` of
    `docs/palu/rank_comparison.json`, and the counts it draws from it (better beyond the noise, tie, worse) over the 8
    held-out comparisons are the record's."""
    from hf_accel.eval.palu_quality import format_rank_comparison

    report = json.loads((ROOT / "docs" / "palu" / "rank_comparison.json").read_text())
    table = format_rank_comparison(report).replace("\n", "\n  ")
    assert "\n  " + table + "\n" in README
    verdicts = {"fisher": [], "kfac": []}
    for row in report["rows"]:
        for name in ("text", "generated") if row["ranks"] != "uniform" else ():
            d = row["vs_uniform"][name]
            verdicts[row["ranks"]].append("better" if d["high"] < 0 else "worse" if d["low"] > 0 else "tie")
    counts = {m: {v: verdicts[m].count(v) for v in ("better", "tie", "worse")} for m in verdicts}
    assert counts == {"fisher": {"better": 4, "tie": 3, "worse": 1}, "kfac": {"better": 7, "tie": 0, "worse": 1}}
    text = " ".join(README.replace("\n  ", " ").split())  # the list item's lines as one
    assert "**Fisher is better than uniform beyond the noise in 4**" in text and "**ties in 3**" in text
    assert "**and is worse in 1: text at gs 1 / 0.5, by 0.097 nats" in text
    assert "**`kfac` ranks beat uniform beyond the noise in 7 of 8**" in text


SESSION_27_RUNS = [
    "he_b8_greedy", "chat_b8_greedy", "he_b1_greedy", "chat_b1_greedy", "he_b8_greedy_run2", "he_b8_t07",
    "chat_b8_t07", "chat_b1_t07", "he_b1_t07",
]  # fmt: skip
SESSION_28_RUNS = [
    "he_b1_t07", "he_b1_greedy", "he_b8_greedy", "chat_b8_greedy", "chat_b1_greedy", "he_b8_t07", "chat_b8_t07",
    "chat_b1_t07", "he_b1_t07_no_one_row", "he_b8_greedy_no_drafts", "chat_b8_t07_no_drafts",
]  # fmt: skip

GENERATION_TABLES = {
    # method column of the header: (JSON prefix under docs/speculative/, runs in table order)
    # session 25: `pld` beside `ngram` at batch 1 and 8, greedy and at T = 0.7, the cells no other table had
    "method": ("v8", ["he_b8_greedy", "he_b8_t07", "chat_b8_greedy", "chat_b8_t07", "he_b1_t07", "chat_b1_t07"]),
    # session 26: the engine's GEMM layout, first run (commit bb84469) and with the final timing
    "method (session 26)": ("v9", ["he_b1_greedy", "chat_b1_greedy", "he_b8_greedy", "chat_b8_greedy", "he_b1_t07"]),
    "method (final layout)": (
        "v10",
        ["he_b1_greedy", "he_b1_greedy_run2", "chat_b1_greedy", "he_b8_greedy", "chat_b8_greedy"],
    ),
    # session 27: the grouped prefill and packed grouped-query attention
    "method (session 27)": ("v11", SESSION_27_RUNS),
    # session 28: sampling along the accepted path, per-shape GEMM layout, the sampled code-build index; controls last
    "method (session 28)": ("v12", SESSION_28_RUNS),
}


def _records_figures(prefix: str, runs: list[str], pick) -> list[tuple]:
    """`pick(record, figures)` for every method of every run's JSON record under docs/speculative/, in order."""
    picked = []
    for run in runs:
        record = json.loads((ROOT / "docs" / "speculative" / f"{prefix}_{run}.json").read_text())
        assert all(method.split(":")[0] in ("vanilla", "pld", "ngram") for method in record["methods"])
        picked += [pick(record, figures) for figures in record["methods"].values()]
    return picked


@pytest.mark.parametrize("method_column", list(GENERATION_TABLES))
def test_each_generation_table_gives_its_json_records_figures(method_column):
    """Each issue-6 table of batch, tokens/s, speedup, tokens per pass, target passes and identity holds the
    figures of the JSON records it cites, every method of every run, in order."""
    header = (
        f"| prompts | batch | decoding | {method_column} | tokens/s | speedup | tokens per pass | target passes "
        "| identical |"
    )
    expected = _records_figures(
        *GENERATION_TABLES[method_column],
        lambda record, figures: (
            record["batch_size"],
            round(figures["tokens_per_s"], 1),
            round(figures["speedup"], 2),
            round(figures["mean_accepted"], 2),
            figures["target_passes"],
            {None: "–", True: "yes", False: "no"}[figures["identical"]],
        ),
    )
    got = [(int(r[1]), *(_numbers(c)[0] for c in r[4:8]), r[8]) for r in _table(header)]
    assert got == expected


# session: (JSON prefix, runs in table order); session 27's control after the second HumanEval batch-8 run
TIME_SPLITS = {27: ("v11", [*SESSION_27_RUNS[:5], "he_b8_greedy_no_gqa_packing", *SESSION_27_RUNS[5:]]),
               28: ("v12", SESSION_28_RUNS)}  # fmt: skip


@pytest.mark.parametrize("session", list(TIME_SPLITS))
def test_each_time_split_gives_its_json_records_figures(session):
    """Issue 6, sessions 27 and 28: each run's wall time, prefill time and speedup after the prefill (session 27 with
    the GEMM layout's row counts of its process; session 28's are per weight shape, in the records), in run order."""
    prefix, runs = TIME_SPLITS[session]
    layout = session == 27
    expected = _records_figures(
        prefix,
        runs,
        lambda record, figures: (
            record["batch_size"],
            round(figures["seconds"], 1),
            round(figures["prefill_seconds"], 1),
            round(figures["decode_speedup"], 2),
            *([record["engine_linear_layout_rows"]] if layout else []),
        ),
    )
    header = f"| prompts | batch | decoding | method (session {session}) | seconds | prefill s | decode speedup |"
    rows = _table(header + (" layout rows |" if layout else ""))
    got = [
        (int(r[1]), *(_numbers(c)[0] for c in r[4:7]), *([[int(n) for n in _numbers(r[7])]] if layout else []))
        for r in rows
    ]
    assert got == expected
