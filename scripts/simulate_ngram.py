"""Tune the Infinigram drafter offline on recorded greedy outputs (a self-distillation cache).

    python scripts/simulate_ngram.py --cache IDX/self_distill.jsonl --prompts humaneval --limit 100 --eval-last 20
    SIM_INDEX='[true]' python scripts/simulate_ngram.py --cache hf_accel/data/indexes/smollm2-135m-code-build/self_distill.jsonl \
        --prompts humaneval --limit 100 --eval-last 25 --max-new-tokens 128 --index-other-records \
        --grid '{"prior": [5, 10, 20, 40]}'

Outputs of the first prompts build the index; the last `--eval-last` are decoded in simulation (their own outputs are
not indexed). Prints mean accepted length and estimated speedup for a grid of settings (with `--json`, one JSON document:
the index's size and one row per setting).

A cache can hold answers of several runs (another model, another length cap): the prompts' answers are those of
`--model` and `--max-new-tokens` as `hf-accel index build` keyed them, and the other records indexed with
`--index-other-records` are those of the same weights.
"""

import dataclasses
import itertools
import json
import os
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from hf_accel.cli import OneLineErrorParser, print_json
from hf_accel.eval.prompts import adds_special_tokens, load_prompts
from hf_accel.loading import resolve_model
from hf_accel.speculative.drafters.build import (
    _cache_key,
    build_index_from_documents,
    parse_self_distill_records,
    whole_records,
)
from hf_accel.speculative.drafters.index import InfinigramIndex
from hf_accel.speculative.drafters.infinigram import InfinigramConfig, InfinigramDrafter
from hf_accel.speculative.drafters.simulate import simulate_greedy


def select_records(
    by_key: dict[str, dict], prompts: dict, model: str, max_new_tokens: int, tokenizer
) -> tuple[list, list]:
    """`(answers, others)`: of the cache's records by key, those answering `prompts` (question id -> prompt, in their
    order) under `model` and `max_new_tokens`, and the records of other prompts written by the same weights."""
    keys = [_cache_key(model, p.text, max_new_tokens, adds_special_tokens(tokenizer, p)) for p in prompts.values()]
    answers = [by_key[k] for k in keys if k in by_key]
    if not answers:
        raise SystemExit(
            f"no answers of {model!r} with max_new_tokens {max_new_tokens} to these prompts in the cache: pass the "
            "--model and --max-new-tokens it was built with"
        )
    weights, asked = {r.get("model") for r in answers}, set(keys)
    others = [r for r in by_key.values() if r["key"] not in asked and r.get("model") in weights]
    return answers, [r for r in others if r["question_id"] not in prompts]


def _prompt_ids(tokenizer, prompt) -> list[int]:
    return tokenizer(prompt.text, add_special_tokens=not prompt.chat)["input_ids"]


def read_records(cache: Path) -> dict[str, dict]:
    """The cache's records by key, read as `self_distill` reads them, without mending the file: a last line cut short
    by an interrupted `index build` is left out."""
    try:
        return parse_self_distill_records(whole_records(cache.read_bytes()), cache)[0]
    except ValueError as err:
        raise SystemExit(str(err)) from None


def parse_grid(text: str) -> dict:
    """`--grid`'s `{InfinigramConfig field: [values]}`; `ValueError` in one line if it is not one."""
    try:
        grid = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--grid is not JSON: {err}") from None
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ValueError(f"--grid must map InfinigramConfig fields to non-empty lists of values, got {text}")
    unknown = sorted(set(grid) - {f.name for f in dataclasses.fields(InfinigramConfig)})
    if unknown:
        raise ValueError(f"--grid: unknown InfinigramConfig field(s) {', '.join(unknown)}")
    for values in itertools.product(*grid.values()):  # a value out of range, before the index is built
        try:
            InfinigramConfig(**dict(zip(grid, values)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"--grid: {err}") from None
    return grid


def read_extra_docs(path: str, parser) -> list[list[int]]:
    """The documents of `--extra-docs`: a JSON list of lists of token ids (JSON, not a pickle, which runs code on
    load)."""
    try:
        docs = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        parser.error(f"--extra-docs {path}: {err}")
    if not isinstance(docs, list) or not all(
        isinstance(doc, list) and all(type(t) is int for t in doc) for doc in docs
    ):
        parser.error(f"--extra-docs {path}: not a JSON list of token-id lists ([[id, ...], ...])")
    return docs


def main():
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--eval-last", type=int, default=20)
    parser.add_argument("--model", default="smollm2-135m", help="the --model the cache was built with")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the --max-new-tokens it was built with")
    parser.add_argument(
        "--extra-docs",
        default=None,
        help="JSON file: a list of token-id documents ([[id, ...], ...]) added to the index",
    )
    parser.add_argument(
        "--index-other-records",
        action="store_true",
        help="also index the cache's records of other prompt sets (e.g. code_build's in the code-build index)",
    )
    parser.add_argument("--grid", default="{}", help="JSON dict of InfinigramConfig field -> list of values")
    parser.add_argument("--json", action="store_true", help="print one JSON document at the end")
    args = parser.parse_args()
    try:
        grid = parse_grid(args.grid)
    except ValueError as err:
        parser.error(str(err))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    prompts = {p.question_id: p for p in load_prompts(args.prompts, tokenizer, args.limit, args.offset)}
    records = read_records(Path(args.cache))
    records, others = select_records(records, prompts, args.model, args.max_new_tokens, tokenizer)
    others = [r["tokens"] for r in others]
    if not 1 <= args.eval_last <= len(records):
        parser.error(
            f"--eval-last must be in [1, {len(records)}]: the cache has {len(records)} outputs of these prompts"
        )
    build, held = records[: -args.eval_last], records[-args.eval_last :]
    # each prompt as `self_distill` fed it (its BOS, if any): the drafter's context at the answer's first token
    cases = [(_prompt_ids(tokenizer, prompts[r["question_id"]]), r["tokens"]) for r in held]
    with tempfile.TemporaryDirectory() as tmp:
        documents = [r["tokens"] for r in build] + (others if args.index_other_records else [])
        if args.extra_docs:
            documents += read_extra_docs(args.extra_docs, parser)
        if not any(documents):
            parser.error(
                "nothing to index: every output is evaluated (lower --eval-last or add --index-other-records)"
            )
        header, _ = build_index_from_documents(documents, tokenizer, tmp, ["simulation"], progress=False)
        index = InfinigramIndex(tmp)
        keys, rows = list(grid), []
        summary = {"index_tokens": header.num_indexed_tokens, "index_outputs": len(build), "eval_outputs": len(held)}
        if not args.json:
            print(f"index: {header.num_indexed_tokens} tokens from {len(build)} outputs; eval on {len(held)} outputs")
        for values in itertools.product(*[grid[k] for k in keys]):
            overrides = dict(zip(keys, values))
            for use_index in json.loads(os.environ.get("SIM_INDEX", "[false, true]")):
                drafter = InfinigramDrafter(index if use_index else None, config=InfinigramConfig(**overrides))
                r = simulate_greedy(drafter, cases, max_depth=drafter.config.max_depth)
                row = {
                    "index": use_index,
                    **overrides,
                    "mean_accepted": round(r.mean_accepted, 3),
                    "est_speedup": round(r.estimated_speedup, 3),
                    "nodes_per_pass": round(r.draft_nodes / r.passes, 2),
                }
                rows.append(row)
                if not args.json:
                    print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        if args.json:
            print_json({**summary, "rows": rows})


if __name__ == "__main__":
    main()
