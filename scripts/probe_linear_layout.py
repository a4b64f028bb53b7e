"""Probe: runs an hf-accel command or script with the speculative engine's GEMM layout forced, to show what the layout
chosen on this machine (`hf_accel.kernels.cpu_linear`) contributes to a speedup.

`plain`: every pass in `x·Wᵀ`, as before the engine measured layouts (and as plain `generate` runs); `transposed`: every
multi-row pass of 2-64 rows in `(W·xᵀ)ᵀ`, whatever the measurement says. Vanilla `generate` is never affected.

Usage:
    python scripts/probe_linear_layout.py plain hf-accel bench generate --prompts humaneval --offset 100 --limit 64 \\
        --methods vanilla,ngram:hf_accel/data/indexes/smollm2-135m-code-build --json
    python scripts/probe_linear_layout.py plain scripts/pass_cost.py --json
"""

import runpy
import sys

from hf_accel.kernels import cpu_linear
from hf_accel.speculative import engine


LAYOUTS = {
    "plain": lambda model: None,
    "transposed": lambda model: cpu_linear.TransposedLinear(model, cpu_linear.ROW_GRID),
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in LAYOUTS:
        print(
            f"usage: probe_linear_layout.py {{{','.join(LAYOUTS)}}} (hf-accel ARGS... | SCRIPT.py ARGS...)",
            file=sys.stderr,
        )
        return 2
    engine.verification_layout = LAYOUTS[argv[0]]  # the engine looks it up when each call starts
    cpu_linear.verification_layout = LAYOUTS[argv[0]]  # scripts/pass_cost.py imports it from here
    if argv[1] == "hf-accel":
        from hf_accel.cli import main as cli_main

        return cli_main(argv[2:])
    sys.argv = argv[1:]
    runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
