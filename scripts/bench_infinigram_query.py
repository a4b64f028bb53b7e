"""Query latency of the Infinigram index on a synthetic corpus (issue 6: ~1 ms per draft at 10^8 tokens).

The corpus is built from a Zipf-distributed bank of random "phrases" (5-40 tokens, vocabulary 49,152) so that long
suffix matches and frequent short ones both occur, as in real text. Prints the build speed and per-query latency of
`longest_suffix`, `continuations` (depth 16, max_support 1000) and a full `draft_row` (tree) on 512-token contexts.

    python scripts/bench_infinigram_query.py --tokens 100000000 --out /tmp/synthetic_index [--json]
"""

import json
import time
from pathlib import Path

import numpy as np

from hf_accel.cli import OneLineErrorParser
from hf_accel.speculative.drafters.index import InfinigramIndex, build_index
from hf_accel.speculative.drafters.infinigram import InfinigramConfig, InfinigramDrafter


def synthetic_documents(num_tokens: int, vocab: int = 49152, seed: int = 0, doc_tokens: int = 2000):
    rng = np.random.default_rng(seed)
    bank = [rng.integers(0, vocab, size=rng.integers(5, 40)) for _ in range(50_000)]
    weights = 1.0 / np.arange(1, len(bank) + 1) ** 1.1
    weights /= weights.sum()
    produced = 0
    while produced < num_tokens:
        picks = rng.choice(len(bank), size=doc_tokens // 20, p=weights)
        doc = np.concatenate([bank[i] for i in picks])[:doc_tokens]
        noise = rng.random(len(doc)) < 0.05  # a few substitutions so that matches end
        doc[noise] = rng.integers(0, vocab, size=int(noise.sum()))
        produced += len(doc)
        yield doc
    return bank


def main():
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.queries < 1 or not args.tokens >= 1000:
        parser.error(f"--queries must be >= 1 and --tokens >= 1000, got {args.queries} and {args.tokens:g}")
    out = Path(args.out)
    build_s = None
    if not (out / "header.json").exists():
        start = time.perf_counter()
        build_index(synthetic_documents(int(args.tokens)), out, "synthetic", "0" * 16, 49152, ["synthetic"])
        build_s = time.perf_counter() - start
    index = InfinigramIndex(out)
    if index.num_tokens < 1000:  # contexts are 512 tokens taken from the corpus, and then some
        parser.error(f"{out} holds {index.num_tokens} tokens; the benchmark needs at least 1000")
    # Contexts: 512 tokens of corpus text (so the suffix matches), or with a fresh random tail.
    rng = np.random.default_rng(1)
    contexts = []
    for i in range(args.queries):
        start = int(rng.integers(0, index.num_tokens - 600))
        context = np.asarray(index.tokens[start : start + 512]).astype(np.int64)
        context[context == 0xFFFFFFFF] = 7
        if i % 2:
            context[-int(rng.integers(1, 8)) :] = rng.integers(0, 49152, size=1)
        contexts.append(context)
    drafter = InfinigramDrafter(index, config=InfinigramConfig(use_context=False))
    timings = {"longest_suffix": [], "continuations": [], "draft_row": []}
    lengths = []
    for context in contexts:
        tic = time.perf_counter()
        m, lo, hi = index.longest_suffix(context, 64)
        timings["longest_suffix"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        index.continuations(lo, hi, 16, 1000)
        timings["continuations"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        drafter.draft_row(context, 16, 16)
        timings["draft_row"].append(time.perf_counter() - tic)
        lengths.append(m)
    result = {
        "tokens": index.num_tokens,
        "build_s": build_s,
        "build_tokens_per_s": index.num_tokens / build_s if build_s else None,
        "mean_match_length": float(np.mean(lengths)),
        **{f"{k}_ms_median": 1000 * float(np.median(v)) for k, v in timings.items()},
        **{f"{k}_ms_p90": 1000 * float(np.percentile(v, 90)) for k, v in timings.items()},
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
