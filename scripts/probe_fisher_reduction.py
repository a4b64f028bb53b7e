"""Probe: the Palu benchmark with Fisher scores read as the paper's text reads, not as its code computes them.

Spec 002 §2.4 (gaps list, item 3): the paper calls a projection's importance the "sum of Fisher information" over
its weights; the Palu code, and `hf_accel.compress.fisher.projection_importance`, take the mean over elements of
`sqrt(mean g²)`. K and V projections have the same size on the default model, so sum and mean allocate alike, and
the two readings differ by the square root only: without it, ranks follow the Fisher diagonal `mean g²` itself, a
more uneven allocation. This probe runs `scripts/bench_palu.py` with that reading; `--ranks fisher` rows are then
the paper-text rule, every other row is unchanged.

Usage:
    python scripts/probe_fisher_reduction.py scripts/bench_palu.py --ranks fisher --bits --no-hadamard-bits --json
"""

import runpy
import sys

import hf_accel.compress.fisher


def fisher_diagonal_importance(mean_squared_grad) -> float:
    """The mean Fisher-diagonal entry `mean g²` over a projection's weights (no square root)."""
    return mean_squared_grad.mean().item()


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: probe_fisher_reduction.py SCRIPT.py ARGS...", file=sys.stderr)
        return 0 if argv else 2
    hf_accel.compress.fisher.projection_importance = fisher_diagonal_importance  # read at call time
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
