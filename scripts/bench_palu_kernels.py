"""Benchmark Palu decode attention (fused latent×B→RoPE→q·k Triton kernel) against plain SDPA, 4K–64K tokens.

    python scripts/bench_palu_kernels.py                 # human table
    python scripts/bench_palu_kernels.py --json          # one JSON object
    python scripts/bench_palu_kernels.py --seq-lens 4096 16384 --group-size 1

Needs a CUDA GPU and triton; without a GPU it says so and exits 0. Timings are medians of CUDA-event timings of one
decode step of one layer (batch and shapes from the options); record them with the printed GPU name.
"""

import argparse
import dataclasses
import json
import sys

from hf_accel.cli import OneLineErrorParser
from hf_accel.kernels.benchmark import PaluAttentionBenchConfig, format_report, run_palu_attention_benchmark


def parse_args(argv=None) -> tuple[argparse.Namespace, PaluAttentionBenchConfig]:
    defaults = PaluAttentionBenchConfig()
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(defaults.seq_lens))
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-key-value-heads", type=int, default=defaults.num_key_value_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--key-keep", type=float, default=defaults.key_keep)
    parser.add_argument("--value-keep", type=float, default=defaults.value_keep)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--iters", type=int, default=defaults.iters)
    args = parser.parse_args(argv)
    try:
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(PaluAttentionBenchConfig)}
        config = PaluAttentionBenchConfig(**{**options, "seq_lens": tuple(args.seq_lens)})  # every field is an option
    except ValueError as err:
        parser.error(str(err))
    return args, config


def main(argv=None) -> int:
    args, config = parse_args(argv)
    report = run_palu_attention_benchmark(config)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
