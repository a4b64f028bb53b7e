"""Probe: how often speculative greedy output differs from plain greedy `generate` in a dtype, and the logit gap there.

In float32 the engine's greedy output is token-identical to plain `generate`. In bfloat16 or float16 a multi-token
verification pass rounds the logits differently from a one-token decoding step, so a near-tie between the two best
tokens can flip (plain `generate` itself gives different text at batch 1 and batch 4 there). This probe counts the
outputs that differ and, for each, reports the first differing new token and the top-2 logit gap of plain decoding
there (its raw logits, in the model's dtype): a flip at a gap of one or two units in the last place is rounding, a
flip at a wide gap would be a bug.

Usage:
    python scripts/probe_half_precision_flips.py --dtype bfloat16 --limit 12 --json
    python scripts/probe_half_precision_flips.py --dtype float16 --drafter ngram:hf_accel/data/indexes/smollm2-135m-chat-build
"""

import json
import sys

import torch

from hf_accel.cli import OneLineErrorParser


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """Index of the first token where `output` differs from `reference` (a shorter one differs at its end), or
    `None` if they are equal."""
    for i, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def until_eos(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    """`tokens` up to and including the first EOS: the padding after it is as long as the batch's longest row, which
    differs between the two outputs of a batch whenever another row does."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in eos_token_ids), len(tokens))
    return tokens[:end]


def top2_gap(logits: torch.Tensor) -> float:
    """Largest minus second-largest entry of a `[V]` logit vector."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def main(argv=None) -> int:
    from hf_accel.eval.prompts import encode_prompts, load_prompts
    from hf_accel.loading import load_model_and_tokenizer
    from hf_accel.speculative import custom_generate
    from hf_accel.speculative.drafters import build_drafter

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--prompts", default="chat_heldout")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--drafter", default="ngram", help="KIND[:SOURCE] (default: the context-only n-gram drafter)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.batch_size, args.max_new_tokens) < 1:
        p.error("--batch-size and --max-new-tokens must be at least 1")

    model, tokenizer = load_model_and_tokenizer(args.model)
    model = model.to(getattr(torch, args.dtype))
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit, offset=args.offset)
    kind, _, source = args.drafter.partition(":")
    drafter = build_drafter(kind, source or None, model, tokenizer)
    greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "temperature": None, "top_k": None}
    eos = model.generation_config.eos_token_id
    eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    flips, tokens = [], 0
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        inputs, pad_token_id = encode_prompts(tokenizer, batch)  # as `bench generate` feeds them
        width = inputs["input_ids"].shape[1]
        kwargs = {**inputs, **greedy, "top_p": None, "pad_token_id": pad_token_id}
        reference = model.generate(**kwargs, return_dict_in_generate=True, output_logits=True)
        out = model.generate(**kwargs, custom_generate=custom_generate, drafter=drafter)
        for b, prompt in enumerate(batch):
            ref = until_eos(reference.sequences[b, width:].tolist(), eos_token_ids)
            new = until_eos(out[b, width:].tolist(), eos_token_ids)
            tokens += len(ref)
            position = first_divergence(ref, new)
            if position is not None:
                gap = top2_gap(reference.logits[position][b]) if position < len(reference.logits) else None
                flips.append({"question_id": prompt.question_id, "new_token": position, "top2_gap": gap})
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "batch_size": args.batch_size,
        "drafter": args.drafter,
        "max_new_tokens": args.max_new_tokens,
        "reference_tokens": tokens,
        "differing": len(flips),
        "flips": flips,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
