"""`hf-accel eval ppl` and `hf-accel bench generate`."""

import argparse
import math
import sys

from ..cli import add_model_options, load_model, placement_record, print_json, user_path


def add_cli(commands) -> None:
    evaluate = commands.add_parser("eval", help="measure model quality").add_subparsers(dest="what", required=True)
    ppl = evaluate.add_parser("ppl", help="perplexity over non-overlapping windows")
    add_model_options(ppl)
    source = ppl.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", type=user_path, help="a plain UTF-8 text file")
    source.add_argument(
        "--dataset", type=user_path, help="a `datasets` dataset (save_to_disk directory, data files, or Hub id)"
    )
    ppl.add_argument("--split", default="test", help="the dataset split (with --dataset)")
    ppl.add_argument("--text-column", default="text", help="the dataset column holding the text")
    ppl.add_argument("--seq-len", type=int, default=512, help="window length in tokens (windows scored alone)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    ppl.add_argument("--trust-remote-code", action="store_true", help="needed for converted checkpoints")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.set_defaults(func=_run_ppl)

    bench = commands.add_parser("bench", help="benchmark speed").add_subparsers(dest="what", required=True)
    gen = bench.add_parser("generate", help="tokens/s of generation methods side by side")
    add_model_options(gen)
    gen.add_argument(
        "--prompts", required=True, type=user_path, help="Spec-Bench JSONL file, `humaneval`, or a built-in set name"
    )
    gen.add_argument("--limit", type=int, default=None, help="use at most N prompts (after --offset)")
    gen.add_argument("--offset", type=int, default=0, help="skip the first N prompts (HumanEval held-out: 100)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="generation length cap")
    gen.add_argument("--methods", default="vanilla,pld", help="comma-separated: vanilla, pld, ngram[:INDEX], ...")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples")
    gen.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens of `pld`")
    gen.add_argument("--seed", type=int, default=0, help="reseeded before each method (sampling)")
    gen.add_argument("--trust-remote-code", action="store_true", help="needed for converted checkpoints")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_run_bench)


def _positive(name: str, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"--{name} must be positive, got {value}")


def _run_ppl(args: argparse.Namespace) -> int:
    from .perplexity import compute_perplexity, read_eval_text

    for name in ("seq_len", "max_tokens", "batch_size"):
        _positive(name.replace("_", "-"), getattr(args, name))
    text = read_eval_text(args.text, args.dataset, args.split, args.text_column)
    model, tokenizer = load_model(args)
    context = getattr(model.config, "max_position_embeddings", None)
    if context and args.seq_len > context:
        print(f"warning: --seq-len {args.seq_len} is past the model's {context} positions", file=sys.stderr)
    result = {"model": args.model, "text": args.text or args.dataset, **placement_record(args)}
    result.update(compute_perplexity(model, tokenizer, text, args.seq_len, args.max_tokens, args.batch_size))
    if args.json:
        print_json(result)
    else:
        print(f"model      {result['model']}\ntext       {result['text']}\ndevice     {_placement(result)}")
        print(f"seq_len    {result['seq_len']}\ntokens     {result['tokens']}\nperplexity {result['ppl']:.3f}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import bench_generate, check_method_names
    from .prompts import load_prompts

    for name in ("limit", "max_new_tokens", "batch_size", "pld_tokens"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.offset < 0:
        raise ValueError(f"--offset must be ≥ 0, got {args.offset}")
    if not math.isfinite(args.temperature) or args.temperature < 0:  # NaN would run greedy, inf print no JSON
        raise ValueError(f"--temperature must be a finite number ≥ 0, got {args.temperature}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    check_method_names(methods)
    load_prompts(args.prompts, None, args.limit, args.offset)  # a bad prompts file fails before the model loads
    model, tokenizer = load_model(args)
    prompts = load_prompts(args.prompts, tokenizer, args.limit, args.offset)
    result = {"model": args.model, "prompt_source": args.prompts, "offset": args.offset, "limit": args.limit}
    result.update(placement_record(args))
    result.update(
        bench_generate(
            model,
            tokenizer,
            prompts,
            methods,
            args.batch_size,
            args.max_new_tokens,
            do_sample=args.temperature > 0,
            temperature=args.temperature or 1.0,
            pld_tokens=args.pld_tokens,
            seed=args.seed,
        )
    )
    print_json(result) if args.json else print(format_bench_table(result))
    return 0


def _decoding(result: dict) -> str:
    if not result["do_sample"]:
        return "greedy"
    return f"sampling, T = {result['temperature']:g}" if result.get("temperature") else "sampling"


def _placement(result: dict) -> str:
    """`cuda:0 (NVIDIA H100 80GB HBM3), bfloat16` from a result's `device`, `device_name` and `dtype`."""
    name = f" ({result['device_name']})" if result.get("device_name") else ""
    return f"{result.get('device', 'cpu')}{name}, {result.get('dtype', 'float32')}"


def format_bench_table(result: dict) -> str:
    """A human table of a `bench generate` result: one row per method, then one per method × category."""
    width = max([28, *(len(m) + 2 for m in result["methods"])])  # index paths can be long
    cat_width = max([16, *(len(c) + 2 for f in result["methods"].values() for c in f["per_category"])])
    head = f"{'method':<{width}}{'category':<{cat_width}}{'tok/s':>8}{'speedup':>9}{'accepted':>10}{'identical':>11}"
    lines = [
        (
            f"model {result['model']} · {result['prompts']} prompts · batch {result['batch_size']} · "
            f"{_decoding(result)} · max_new_tokens {result['max_new_tokens']} · {_placement(result)}"
        ),
        head,
        "-" * len(head),
    ]

    def row(method, category, f):
        acc = "-" if f["mean_accepted"] is None else f"{f['mean_accepted']:.2f}"
        same = "-" if f["identical"] is None else ("yes" if f["identical"] else "NO")
        figures = f"{f['tokens_per_s']:>8.1f}{f.get('speedup', 1.0):>8.2f}x{acc:>10}{same:>11}"
        return f"{method:<{width}}{category:<{cat_width}}{figures}"

    for method, figures in result["methods"].items():
        lines.append(row(method, "all", figures))
    for method, figures in result["methods"].items():
        for category, f in figures["per_category"].items():
            lines.append(row(method, category, f))
    notes = [f"note: {m}: {f['note']}" for m, f in result["methods"].items() if f.get("note")]
    return "\n".join(lines + notes + ["accepted = tokens per target forward pass after the prefill, bonus included"])
