"""Probe: what closing the cache's holes saves at batch > 1, with the engine's hole closing on and off in turns.

At batch > 1 every verification pass appends the batch's longest accepted path to every row, so rows that accept
less leave masked holes; the engine moves each row's valid slots to the cache's end once holes fill 1/8 of it
(`hf_accel.speculative.engine._close_holes`). The full `bench generate` runs vanilla and the drafter once each, and
its run-to-run noise on this machine (about 10 %) is larger than this effect, so this probe runs the same batches
with closing on and off alternately, `--reps` times each, with one drafter per setting, and checks every output
against plain greedy `generate`.

Usage:
    python scripts/probe_close_holes.py --prompts chat_heldout_26 --json
    python scripts/probe_close_holes.py --prompts humaneval --offset 100 --limit 64 \\
        --drafter ngram:hf_accel/data/indexes/smollm2-135m-code-build --json
"""

import json
import statistics
import sys
import time

import torch

from hf_accel.cli import OneLineErrorParser


def main(argv=None) -> int:
    from hf_accel.eval.prompts import encode_prompts, load_prompts
    from hf_accel.loading import load_model_and_tokenizer
    from hf_accel.speculative import custom_generate, engine
    from hf_accel.speculative.drafters import build_drafter

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default="chat_heldout_26")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--drafter", default="ngram:hf_accel/data/indexes/smollm2-135m-chat-build", help="KIND[:SOURCE]")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5, help="runs of all batches per setting, alternating")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.batch_size < 2 or min(args.max_new_tokens, args.reps) < 1:
        p.error("--batch-size must be at least 2 (a single row has no holes), --max-new-tokens and --reps at least 1")

    model, tokenizer = load_model_and_tokenizer(args.model)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit, offset=args.offset)
    # tokenized as `bench generate` does (a chat template's BOS once, a raw prompt's tokenizer's)
    batches = [
        encode_prompts(tokenizer, prompts[i : i + args.batch_size]) for i in range(0, len(prompts), args.batch_size)
    ]
    greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "temperature": None, "top_k": None}
    greedy.update(top_p=None, pad_token_id=batches[0][1])
    references = [model.generate(**inputs, **greedy) for inputs, _ in batches]
    kind, _, source = args.drafter.partition(":")
    close = engine._close_holes
    settings = {"closed": close, "kept": lambda state, cache, every_hole=False: None}
    drafters = {name: build_drafter(kind, source or None, model, tokenizer) for name in settings}
    seconds = {name: [] for name in settings}
    try:
        for _ in range(args.reps):
            for name, function in settings.items():
                engine._close_holes = function
                start = time.perf_counter()
                for (inputs, _), reference in zip(batches, references):
                    out = model.generate(**inputs, **greedy, custom_generate=custom_generate, drafter=drafters[name])
                    if not torch.equal(out, reference):
                        raise SystemExit(f"output differs from plain greedy generate with holes {name}")
                seconds[name].append(time.perf_counter() - start)
    finally:
        engine._close_holes = close
    closed, kept = seconds["closed"], seconds["kept"]
    report = {
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "batch_size": args.batch_size,
        "drafter": args.drafter,
        "seconds_closed": [round(s, 2) for s in closed],
        "seconds_kept": [round(s, 2) for s in kept],
        "closed_faster_in": sum(c < k for c, k in zip(closed, kept)),
        "median_time_ratio": round(statistics.median(closed) / statistics.median(kept), 3),
        "identical": True,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>18}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
