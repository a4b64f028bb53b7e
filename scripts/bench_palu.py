"""Palu on the default model: perplexity and measured KV-cache bytes per token over a grid of conversions.

    python scripts/bench_palu.py                      # human table (Markdown)
    python scripts/bench_palu.py --json               # one JSON object
    python scripts/bench_palu.py --group-sizes 3 --kv-keeps 0.5 --eval-tokens 4096
    python scripts/bench_palu.py --compare-ranks --generated-samples 64 --ranks uniform fisher kfac --json

Calibration: the first 90 % of tinyshakespeare (random windows), plus with `--calib-generated-samples N` N sequences
the model samples on its calibration prompts (CARE's mixed calibration); evaluation: its last 10 % (held out), and
with `--generated-samples N` also N held-out sequences sampled from the original model on CARE's held-out prompts.
`--care-methods care` adds CARE conversions at the same budgets, from the same calibration and evaluation. Grid: group sizes × uniform/Fisher
ranks × kv-keep, each unquantized and at 2/3/4 bits, with and without the Walsh–Hadamard rotation. With
`--compare-ranks`: float latents only, each rank method against uniform on the same rows, with paired intervals.
"""

import argparse
import json
import sys
from pathlib import Path

from hf_accel.cli import OneLineErrorParser, print_json
from hf_accel.compress.care import METHODS as CARE_METHODS
from hf_accel.eval.palu_quality import (
    PaluBenchConfig,
    compare_rank_methods,
    format_palu_table,
    format_rank_comparison,
    run_palu_quality_benchmark,
)
from hf_accel.loading import load_model_and_tokenizer


SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def parse_args(argv=None) -> argparse.Namespace:
    d = PaluBenchConfig()
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default=str(SHAKESPEARE), help="text file: calibration 90 %%, evaluation 10 %%")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--compare-ranks", action="store_true",
        help="instead of the grid: float latents only, each rank method against uniform with paired 95%% intervals "
        "on the held-out text, the held-out generated text and the calibration rows",
    )  # fmt: skip
    parser.add_argument("--group-sizes", type=int, nargs="+", default=list(d.group_sizes))
    parser.add_argument("--ranks", nargs="+", default=list(d.rank_methods), choices=["uniform", "fisher", "kfac"])
    parser.add_argument("--kv-keeps", type=float, nargs="+", default=list(d.kv_keeps))
    parser.add_argument("--bits", type=int, nargs="*", default=list(d.bits))
    parser.add_argument("--no-hadamard-bits", type=int, nargs="*", default=list(d.no_hadamard_bits))
    parser.add_argument(
        "--residual-lengths", type=int, nargs="*", default=list(d.residual_lengths),
        help="full-precision windows of recent tokens: extra quantized rows, scored past the window",
    )  # fmt: skip
    parser.add_argument(
        "--care-methods", nargs="*", default=list(d.care_methods), choices=CARE_METHODS,
        help="CARE rows at the same budgets (e.g. care)",
    )  # fmt: skip
    for name in (
        "calib_samples",
        "calib_generated_samples",
        "calib_seq_len",
        "fisher_samples",
        "rank_multiple",
        "quant_group_size",
        "eval_tokens",
        "eval_seq_len",
        "generated_samples",
        "generated_seq_len",
        "window_bytes_context",
        "seed",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    args = parser.parse_args(argv)
    if args.compare_ranks and (not args.generated_samples or "uniform" not in args.ranks):
        parser.error("--compare-ranks needs --generated-samples N and uniform among --ranks")
    if args.compare_ranks and (args.care_methods or args.residual_lengths):
        parser.error("--compare-ranks compares float latents only: drop --care-methods and --residual-lengths")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    text = Path(args.text).read_text(encoding="utf-8")
    split = int(0.9 * len(text))
    config = PaluBenchConfig(
        group_sizes=tuple(args.group_sizes),
        rank_methods=tuple(args.ranks),
        kv_keeps=tuple(args.kv_keeps),
        bits=tuple(args.bits),
        no_hadamard_bits=tuple(args.no_hadamard_bits),
        calib_samples=args.calib_samples,
        calib_generated_samples=args.calib_generated_samples,
        care_methods=tuple(args.care_methods),
        calib_seq_len=args.calib_seq_len,
        fisher_samples=args.fisher_samples,
        rank_multiple=args.rank_multiple,
        quant_group_size=args.quant_group_size,
        eval_tokens=args.eval_tokens,
        eval_seq_len=args.eval_seq_len,
        generated_samples=args.generated_samples,
        generated_seq_len=args.generated_seq_len,
        residual_lengths=tuple(args.residual_lengths),
        window_bytes_context=args.window_bytes_context,
        seed=args.seed,
    )
    model, tokenizer = load_model_and_tokenizer(args.model)
    run, table = (
        (compare_rank_methods, format_rank_comparison)
        if args.compare_ranks
        else (run_palu_quality_benchmark, format_palu_table)
    )
    report = run(model, tokenizer, text[:split], text[split:], config, progress=not args.json)
    report["model"] = args.model
    if args.json:
        print_json(report)
    else:
        print(table(report))
        print(json.dumps({"timings": report["timings"], "settings": report["settings"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
