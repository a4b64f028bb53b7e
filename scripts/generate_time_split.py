"""Where speculative decoding's wall time goes: the target's forward passes, the drafter, and the rest of the engine.

Runs `--num-batches` batches of prompts through `model.generate(custom_generate=..., drafter=...)` after one warm-up
run of the first batch, timing every target forward. If the forward is nearly all of the wall time, only fewer or
cheaper passes (better drafts) can make decoding faster; engine work would not.

Example:
    python scripts/generate_time_split.py --prompts chat_heldout_26 --batch-size 8 --json
    python scripts/generate_time_split.py --prompts humaneval --offset 100 --batch-size 1 \
        --num-batches 8 --drafter ngram:hf_accel/data/indexes/smollm2-135m-code-build --json
"""

import json
import sys
import time

import torch

from hf_accel.cli import OneLineErrorParser


def main(argv=None) -> int:
    from hf_accel.eval.prompts import encode_prompts, load_prompts
    from hf_accel.loading import load_model_and_tokenizer
    from hf_accel.speculative import custom_generate
    from hf_accel.speculative.drafters import build_drafter

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default="chat_heldout_26")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--num-batches", type=int, default=1)
    p.add_argument("--drafter", default="ngram:hf_accel/data/indexes/smollm2-135m-chat-build", help="KIND[:SOURCE]")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples (seeded)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.batch_size, args.num_batches, args.max_new_tokens) < 1 or args.temperature < 0:
        p.error("--batch-size, --num-batches and --max-new-tokens must be at least 1 and --temperature at least 0")

    model, tokenizer = load_model_and_tokenizer(args.model)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.batch_size * args.num_batches, offset=args.offset)
    kind, _, source = args.drafter.partition(":")
    drafter = build_drafter(kind, source or None, model, tokenizer)
    forward_seconds = []
    forward = model.forward

    def timed_forward(*a, **k):
        start = time.perf_counter()
        out = forward(*a, **k)
        forward_seconds.append(time.perf_counter() - start)
        return out

    model.forward = timed_forward
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    kwargs = {"custom_generate": custom_generate, "drafter": drafter, "max_new_tokens": args.max_new_tokens}
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    def run(batch):  # tokenized as `bench generate` does (a chat template's BOS once, a raw prompt's tokenizer's)
        inputs, pad_token_id = encode_prompts(tokenizer, batch)
        return model.generate(**inputs, **kwargs, pad_token_id=pad_token_id).speculative_stats

    run(batches[0])  # warm-up: the drafter's cost model learns pass times
    forward_seconds.clear()
    wall = drafter_s = new_tokens = 0.0
    torch.manual_seed(0)
    for batch in batches:
        start = time.perf_counter()
        stats = run(batch)
        wall += time.perf_counter() - start
        drafter_s += stats.drafter_time_s
        new_tokens += stats.new_tokens
    report = {
        "prompts": args.prompts,
        "batch_size": args.batch_size,
        "num_prompts": len(prompts),
        "drafter": args.drafter,
        "temperature": args.temperature,
        "wall_s": round(wall, 3),
        "forward_s": round(sum(forward_seconds), 3),
        "forward_share": round(sum(forward_seconds) / wall, 4),
        "drafter_s": round(drafter_s, 3),
        "target_passes": len(forward_seconds),
        "new_tokens": int(new_tokens),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>14}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
