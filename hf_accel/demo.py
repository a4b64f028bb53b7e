"""`hf-accel demo`: the embedded default model answering a few built-in prompts, with the figures that matter."""

import argparse
import time

import torch

from .cli import print_json


DEMO_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today and we are going to the park.",
]


def kv_cache_bytes_per_token(past_key_values) -> float:
    """Bytes the cache really holds per cached token (all layers), measured from its tensors.

    Args:
        past_key_values (`Cache`): a transformers cache after a forward pass, batch size 1.
    """
    total, seq_len = 0, past_key_values.get_seq_length()
    for layer in past_key_values.layers:
        nbytes = getattr(layer, "nbytes", None)  # compressed layers report their own true size
        if nbytes is not None:
            total += nbytes() if callable(nbytes) else nbytes
            continue
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total / seq_len


def add_cli(commands) -> None:
    demo = commands.add_parser("demo", help="run the embedded default model on a few prompts")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=run_demo)


@torch.no_grad()
def run_demo(args: argparse.Namespace) -> int:
    from .loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model)
    rows = []
    for prompt in DEMO_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        start = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True
        )
        seconds = time.perf_counter() - start
        new = out.sequences[0, inputs["input_ids"].shape[1] :]
        rows.append(
            {
                "prompt": prompt,
                "answer": tokenizer.decode(new, skip_special_tokens=True).strip(),
                "tokens": new.numel(),
                "tokens_per_s": new.numel() / seconds,
                "kv_bytes_per_token": kv_cache_bytes_per_token(out.past_key_values),
            }
        )
    result = {"model": args.model, "dtype": str(model.dtype), "rows": rows}
    if args.json:
        print_json(result)
        return 0
    print(f"hf-accel demo · {args.model} · {model.dtype} · greedy, max_new_tokens {args.max_new_tokens}\n")
    print(f"{'prompt':<44}{'tokens':>7}{'tok/s':>8}{'KV B/token':>12}  answer")
    for r in rows:
        answer = r["answer"].replace("\n", " ")
        print(
            f"{r['prompt'][:42]:<44}{r['tokens']:>7}{r['tokens_per_s']:>8.1f}{r['kv_bytes_per_token']:>12,.0f}  "
            f"{answer[:70]}{'…' if len(answer) > 70 else ''}"
        )
    return 0
