"""Probe: runs an hf-accel command or script with parts of the speculative engine's CPU savings forced on or off, to
show what each contributes to a speedup. Vanilla `generate` is never affected.

Parts (several, comma-separated):
- `plain-layout`: every pass in `x·Wᵀ`, as before the engine measured GEMM layouts (and as plain `generate` runs);
  `transposed-layout`: every pass of 1-32 rows in `(W·xᵀ)ᵀ`, whatever the measurement says
  (`hf_accel.kernels.cpu_linear`); `no-one-row`: the measured layout, but one-row products (a pass without a draft at
  batch 1) in `x·Wᵀ`, a matrix-vector product as in plain decoding (as before session 28).
- `no-gqa-packing`: verification passes copy the cached keys and values once per query head, as transformers' `sdpa`
  attention does for several masked queries (`hf_accel.kernels.gqa_attention`).
- `no-grouped-prefill`: a ragged batch is prefilled in one batched pass over its padding, as `generate` does
  (`hf_accel.speculative.prefill`).
- `no-drafts`: the `ngram` drafter proposes nothing, so every pass is a plain decoding step in the engine's own
  layout, attention and prefill: what the engine saves without speculating.

Usage:
    python scripts/probe_engine_parts.py plain-layout hf-accel bench generate --prompts humaneval --offset 100 \\
        --limit 64 --methods vanilla,ngram:hf_accel/data/indexes/smollm2-135m-code-build --json
    python scripts/probe_engine_parts.py transposed-layout,no-gqa-packing scripts/pass_cost.py --batch-size 8 --json
"""

import contextlib
import runpy
import sys

from hf_accel.kernels import cpu_linear
from hf_accel.speculative import engine, prefill
from hf_accel.speculative.drafters.infinigram import InfinigramDrafter


# The engine (and scripts/pass_cost.py through it) looks these names up in its own module when a call or pass starts.
def _layout(choose):
    def force():
        engine.verification_layout = choose

    return force


def _no_one_row():
    measured = engine.verification_layout

    def choose(model):
        layout = measured(model)
        rows = {shape: counts - {1} for shape, counts in layout.row_counts.items()} if layout is not None else {}
        return cpu_linear.TransposedLinear(model, rows) if any(rows.values()) else None

    engine.verification_layout = choose


def _no_drafts():
    InfinigramDrafter.propose = lambda self, request: None


def _no_gqa_packing():
    engine.packed_gqa_attention = contextlib.nullcontext  # `verification_pass` enters it around every pass


def _no_grouped_prefill():
    prefill.PASS_OVERHEAD_TOKENS = {}  # no device has a measured pass overhead: one batched prefill


PARTS = {
    "plain-layout": _layout(lambda model: None),
    "transposed-layout": _layout(lambda model: cpu_linear.TransposedLinear(model, cpu_linear.ROW_GRID)),
    "no-one-row": _no_one_row,
    "no-gqa-packing": _no_gqa_packing,
    "no-grouped-prefill": _no_grouped_prefill,
    "no-drafts": _no_drafts,
}


def main(argv: list[str]) -> int:
    parts = argv[0].split(",") if argv else []
    layouts = {"plain-layout", "transposed-layout", "no-one-row"}
    if len(argv) < 2 or not set(parts) <= set(PARTS) or len(layouts & set(parts)) > 1:
        print(
            f"usage: probe_engine_parts.py PART[,PART...] (hf-accel ARGS... | SCRIPT.py ARGS...); parts: "
            f"{', '.join(PARTS)} (one layout at most)",
            file=sys.stderr,
        )
        return 2
    for part in parts:
        PARTS[part]()
    if argv[1] == "hf-accel":
        from hf_accel.cli import main as cli_main

        return cli_main(argv[2:])
    sys.argv = argv[1:]
    runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
