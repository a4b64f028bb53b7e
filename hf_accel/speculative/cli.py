"""`hf-accel index build`: an Infinigram index from text files, a dataset, or the model's own answers."""

import itertools
import math
import re
import shutil
import time
from pathlib import Path

from ..cli import add_model_options, load_model, user_path


def add_cli(commands) -> None:
    """Adds the `index` command (subcommand `build`) to the top-level `hf-accel` subparsers."""
    index = commands.add_parser("index", help="Infinigram (suffix-array) indexes for the `ngram` drafter")
    sub = index.add_subparsers(dest="index_command", required=True, metavar="SUBCOMMAND")
    build = sub.add_parser(
        "build",
        help="build an index (tokens of the model's tokenizer)",
        description="Builds an index; --text, --dataset and --self-distill combine: every source given is indexed.",
    )
    add_model_options(build)  # the model runs only with --self-distill; its tokenizer always
    build.add_argument("--out", required=True, help="index directory to write")
    build.add_argument("--text", nargs="+", default=[], type=user_path, help="plain text files (one document each)")
    build.add_argument(
        "--dataset", type=user_path, help="a `datasets` dataset (save_to_disk directory, data files, or Hub id)"
    )
    build.add_argument("--split", default="train", help="the dataset split (with --dataset)")
    build.add_argument("--text-column", default="text", help="the dataset column holding the text")
    build.add_argument(
        "--self-distill", nargs="+", default=[], type=user_path, metavar="PROMPTS",
        help="prompt sets (Spec-Bench JSONL, `humaneval`, or a built-in set) the model answers, its answers indexed; "
        "a slice picks prompts, e.g. `humaneval[:100]`",
    )  # fmt: skip
    build.add_argument("--max-new-tokens", type=int, default=256, help="self-distill: answer length cap")
    build.add_argument("--batch-size", type=int, default=8, help="self-distill: prompts per generate call")
    build.add_argument(
        "--samples", type=int, default=0,
        help="self-distill: also index this many answers per prompt sampled at --temperature (for sampled decoding)",
    )  # fmt: skip
    build.add_argument("--temperature", type=float, default=0.7, help="self-distill: the sampled answers' temperature")
    build.add_argument("--seed", type=int, default=0, help="self-distill: the sampled answers' seed")
    build.add_argument("--trust-remote-code", action="store_true", help="needed for converted checkpoints")
    build.add_argument("--json", action="store_true", help="print one JSON object")
    build.set_defaults(func=_run_build)


def _run_build(args) -> int:
    from ..atomic import check_output_path
    from ..cli import print_json
    from ..loading import load_tokenizer
    from ..training.data import check_utf8_file
    from .drafters.build import (
        SELF_DISTILL_CACHE,
        SELF_DISTILL_LOCK,
        build_index_from_documents,
        iter_dataset_documents,
        iter_text_file_documents,
        pieces_within_vocabulary,
        self_distill,
    )
    from .drafters.index import INDEX_FILES, tokenizer_fingerprint

    if not (args.text or args.dataset or args.self_distill):
        raise ValueError("nothing to index: pass --text FILE..., --dataset NAME, or --self-distill PROMPTS...")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError("--max-new-tokens and --batch-size must be at least 1")
    if args.samples < 0:
        raise ValueError(f"--samples must be at least 0, got {args.samples}")
    if args.samples and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be positive and finite, got {args.temperature}")
    out = check_output_path(args.out)  # a file is refused; a used index directory is rebuilt in place
    # an index's files (header.json goes first in a rebuild's swap) or a killed build's `.staging-*` leftovers
    entries = [p.name for p in out.iterdir() if not p.name.startswith(".staging-")] if out.is_dir() else []
    if entries and not set(entries) & {*INDEX_FILES, SELF_DISTILL_CACHE, SELF_DISTILL_LOCK}:
        raise ValueError(f"--out {args.out} holds files that are not an index: choose an empty or an index directory")
    missing = [path for path in args.text if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"text file(s) not found: {', '.join(missing)}")
    # one file named twice (overlapping shell globs, a link and its target) would be indexed twice, doubling every
    # count its continuations get
    resolved = [Path(path).resolve() for path in args.text]
    twice = [path for path, real in zip(args.text, resolved) if resolved.count(real) > 1]
    if twice:
        raise ValueError(f"--text names one file more than once ({', '.join(twice)}); each file is indexed once")
    from ..eval.prompts import load_prompts
    from ..hub import published_name

    prompt_sets = [parse_prompt_slice(source) for source in args.self_distill]
    for name, offset, limit in prompt_sets:  # a bad slice, set name or file fails before the model loads
        load_prompts(name, None, limit=limit, offset=offset)
    for path in args.text:  # read again as they are indexed: a bad one fails now, not after minutes of work
        check_utf8_file(path, what="text file")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    documents, sources = [], []  # iterables, consumed once as the index is written
    start = time.perf_counter()
    if args.text:
        documents.append(iter_text_file_documents(args.text, tokenizer))
        sources += [f"text:{published_name(p)}" for p in args.text]
    if args.dataset:  # loaded here: a bad name or column fails before the model loads
        documents.append(iter_dataset_documents(args.dataset, tokenizer, args.split, args.text_column))
        sources.append(f"dataset:{published_name(args.dataset)}:{args.split}:{args.text_column}")
    model_load_s = 0.0
    if args.self_distill:
        tic = time.perf_counter()
        model, tokenizer = load_model(args)
        model_load_s = time.perf_counter() - tic
    generation_s = 0.0
    vocab_size = tokenizer_fingerprint(tokenizer)[2] if prompt_sets else None  # ids a self-distilled answer may keep
    for name, offset, limit in prompt_sets:
        prompts = load_prompts(name, tokenizer, limit=limit, offset=offset)
        tic = time.perf_counter()
        answers = self_distill(
            model, tokenizer, prompts, out, args.max_new_tokens, args.batch_size, args.model,
            samples=args.samples, temperature=args.temperature, seed=args.seed,
        )  # fmt: skip
        documents.append(pieces_within_vocabulary(answers, vocab_size))
        generation_s += time.perf_counter() - tic
        sampled = f":samples={args.samples}@T{float(args.temperature)!r}:seed={args.seed}" if args.samples else ""
        sources.append(
            f"self-distill:{published_name(name)}:offset={offset}:limit={limit}:max_new={args.max_new_tokens}{sampled}"
        )
    tic = time.perf_counter()
    header, build_s = build_index_from_documents(itertools.chain(*documents), tokenizer, out, sources, args.model)
    # text and dataset are tokenized as they stream; the model's load is no input's preparation
    prepare_s = tic - start - model_load_s + (time.perf_counter() - tic - build_s)
    card = _write_card(str(out), args.model, header)
    tokens = header.num_indexed_tokens  # not the stream's separators
    result = {
        "out": str(args.out), "model": args.model, "tokens": tokens, "documents": header.num_documents,
        "sources": sources, "prepare_s": round(prepare_s, 3), "self_distill_s": round(generation_s, 3),
        "build_s": round(build_s, 3), "build_tokens_per_s": round(tokens / max(build_s, 1e-9)),
        "model_card": card,
    }  # fmt: skip
    if args.json:
        print_json(result)
    else:
        print(f"index {args.out}: {tokens:,} tokens in {header.num_documents:,} documents")
        print(f"  suffix array built in {build_s:.2f} s ({result['build_tokens_per_s']:,} tokens/s)")
        print(f"  inputs prepared in {prepare_s:.1f} s (self-distillation {generation_s:.1f} s)")
        if card is None:
            print("  no model card: --model is not a Hub id (hf_accel.hub.save_artifact names the base model)")
    return 0


def _write_card(out: str, model: str, header) -> str | None:
    """Makes the index a Hub artifact (model card, `custom_generate/` for `generate(custom_generate=<repo>)`) when
    `model` names a Hub repository; returns the card's path, or `None` for a local model directory, whose rebuild
    removes an earlier build's card and `custom_generate/` (they describe the index it replaced)."""
    from ..hub import hub_id_or_none, is_hf_accel_card, save_artifact
    from ..loading import remote_code_model_type, resolve_model

    base_model = hub_id_or_none(model)
    if base_model is None:
        if is_hf_accel_card(Path(out) / "README.md"):
            (Path(out) / "README.md").unlink()
            shutil.rmtree(Path(out) / "custom_generate", ignore_errors=True)
        return None
    settings = {
        "tokens": header.num_indexed_tokens,
        "documents": header.num_documents,
        "tokenizer": header.tokenizer_name,
    }
    settings.update({f"source {i + 1}": source for i, source in enumerate(header.sources or [])})
    remote_code = remote_code_model_type(resolve_model(model)) is not None  # its snippets must trust that code
    save_artifact(out, "drafter-index", base_model, drafter="ngram", settings=settings, base_remote_code=remote_code)
    return str(Path(out) / "README.md")


def parse_prompt_slice(source: str) -> tuple[str, int, int | None]:
    """`"humaneval[:100]"` -> `("humaneval", 0, 100)`: a prompt set and the `[start:stop]` slice of it to use."""
    match = re.fullmatch(r"(.+)\[(\d*):(\d*)\]", source)
    if match is None:
        return source, 0, None
    name, start, stop = match.group(1), int(match.group(2) or 0), match.group(3)
    if stop and int(stop) <= start:
        raise ValueError(f"empty prompt slice in {source!r}")
    return name, start, int(stop) - start if stop else None
