"""Measures what one target forward pass over `n` new tokens costs, relative to one token: the curve that bounds
speculative decoding (speedup ≤ tokens per pass ÷ relative cost of the pass).

Each point: a fresh cache filled with a `--context`-token prefill of `--batch-size` rows, then one timed pass over `n`
tokens per row (all logits, as in a verification pass); median of `--repeats` after two warm-up runs. `ms` is the
pass as plain `generate` runs it; `engine_ms`, as the speculative engine runs it (`engine.verification_pass`): in the
GEMM layout measured faster here (`hf_accel.kernels.cpu_linear`) and with grouped-query attention packed instead of
copied per head for `n > 1` (`hf_accel.kernels.gqa_attention`); the same as `ms` at `n = 1` where that layout is the default one. The two
alternate, so load on the machine falls on both alike.

Example:
    python scripts/pass_cost.py --json
    python scripts/pass_cost.py --batch-size 8 --tokens 1 2 3 4 --json
"""

import contextlib
import json
import statistics
import sys
import time

import torch

from hf_accel.cli import OneLineErrorParser
from hf_accel.compat import CACHE_NAME


def main(argv=None) -> int:
    from transformers import DynamicCache

    from hf_accel.loading import load_model_and_tokenizer
    from hf_accel.speculative import engine

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.context < 1 or args.repeats < 1 or args.batch_size < 1:
        p.error(
            "--tokens, --context, --repeats and --batch-size must be at least 1, got "
            f"{args.tokens}, {args.context}, {args.repeats}, {args.batch_size}"
        )
    args.tokens = sorted({1, *args.tokens})  # ratios are relative to one token

    model, _ = load_model_and_tokenizer(args.model)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (args.batch_size, args.context), generator=generator)
    ms, engine_ms, head_ms = {}, {}, {}
    head = model.get_output_embeddings()
    engine_layout = engine.verification_layout(model)
    layouts = {"plain": contextlib.nullcontext, "engine": lambda: engine.verification_pass(engine_layout)}
    with torch.no_grad():
        for n in args.tokens:
            times = {name: [] for name in layouts}
            for _ in range(args.repeats + 2):
                for name, layout in layouts.items():
                    cache = DynamicCache(config=model.config)
                    model(input_ids=prefix, **{CACHE_NAME: cache}, use_cache=True)
                    new = torch.randint(0, vocab, (args.batch_size, n), generator=generator)
                    with layout():
                        start = time.perf_counter()
                        model(input_ids=new, **{CACHE_NAME: cache}, use_cache=True)
                        times[name].append(time.perf_counter() - start)
            ms[n] = 1000 * statistics.median(times["plain"][2:])
            engine_ms[n] = 1000 * statistics.median(times["engine"][2:])
            hidden = torch.randn(args.batch_size, n, model.config.hidden_size, generator=generator)
            times = []
            for _ in range(args.repeats + 2):
                start = time.perf_counter()
                head(hidden)
                times.append(time.perf_counter() - start)
            head_ms[n] = 1000 * statistics.median(times[2:])
    result = {
        "model": args.model,
        "context": args.context,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "ms": {str(n): round(v, 1) for n, v in ms.items()},
        "relative": {str(n): round(v / ms[1], 2) for n, v in ms.items()},
        "engine_layout_rows": engine_layout.describe() if engine_layout is not None else {},
        "engine_ms": {str(n): round(v, 1) for n, v in engine_ms.items()},
        "engine_relative": {str(n): round(v / ms[1], 2) for n, v in engine_ms.items()},  # to plain decoding's step
        "head_ms": {str(n): round(v, 1) for n, v in head_ms.items()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for n in args.tokens:
            print(
                f"n = {n:3d}: {ms[n]:7.1f} ms  ({ms[n] / ms[1]:.2f}x), in the engine's layout {engine_ms[n]:7.1f} ms "
                f"({engine_ms[n] / ms[1]:.2f}x), output projection {head_ms[n]:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
