"""The CARE benchmark: perplexity and measured KV-cache bytes of every method at several budgets, one calibration.

Used by `scripts/bench_care.py`. The calibration statistics (input moments and loss-gradient moments) are collected
once on the original model and shared by all methods, so the per-method cost is the factorization alone.
"""

import math
import sys
import time

import torch

from ..compress.calibration import EVAL_PROMPTS, KvCalibration, generate_calibration_ids
from ..compress.care import CareConversionConfig, run_care_conversion
from .memory import measure_cache_bytes_per_token


def split_text(text: str, calib_fraction: float = 0.5) -> tuple[str, str]:
    """`(calibration part, held-out part)`: the first `calib_fraction` of the characters, and the rest."""
    cut = int(len(text) * calib_fraction)
    return text[:cut], text[cut:]


def generated_text(model, tokenizer, num_samples: int, seq_len: int, seed: int, prompts=EVAL_PROMPTS) -> str:
    """Model-generated responses (sampled), decoded and joined: held-out text from the model's own distribution."""
    ids = generate_calibration_ids(model, tokenizer, num_samples, seq_len, seed=seed, prompts=prompts)
    return "\n\n".join(tokenizer.batch_decode(ids, skip_special_tokens=True))


def measured_cache_bytes_per_token(model, vocab_size: int, tokens: int = 16) -> float:
    """Runs `tokens` tokens through `model` with a cache and returns the cache tensors' bytes per token."""
    ids = torch.arange(tokens)[None] % vocab_size
    return measure_cache_bytes_per_token(model, ids.to(next(model.parameters()).device))


def benchmark_care(
    model,
    tokenizer,
    calibration: KvCalibration,
    eval_texts: dict,
    kv_keeps,
    methods,
    eval_tokens: dict,
    seq_len: int = 512,
    progress: bool = False,
) -> dict:
    """Converts `model` with each method at each budget and evaluates it.

    Returns:
        `dict` with `original` (ppl per text, cache bytes) and `results`: a list of rows `{method, kv_keep, ppl:
        {name: ppl}, cache_bytes_per_token, kv_keep_achieved, factorization_seconds, k_ranks, v_ranks}`.
    """
    from ..eval.perplexity import compute_perplexity

    def evaluate(m):
        return {
            name: round(compute_perplexity(m, tokenizer, text, seq_len, eval_tokens[name], progress=False)["ppl"], 3)
            for name, text in eval_texts.items()
        }

    vocab = model.config.vocab_size
    report = {
        "original": {"ppl": evaluate(model), "cache_bytes_per_token": measured_cache_bytes_per_token(model, vocab)}
    }
    rows = []
    for kv_keep in kv_keeps:
        for method in methods:
            start = time.perf_counter()
            result = run_care_conversion(
                model, tokenizer, CareConversionConfig(kv_keep=kv_keep, method=method), calibration, progress
            )
            seconds = time.perf_counter() - start
            row = dict(result.summary(), factorization_seconds=round(seconds, 2))
            row["ppl"] = evaluate(result.model)
            row["cache_bytes_per_token"] = measured_cache_bytes_per_token(result.model, vocab)
            rows.append(row)
            print(  # progress, on stderr: a --json report owns stdout
                f"  kv_keep={kv_keep} {method:11s} ppl={row['ppl']} bytes/token={row['cache_bytes_per_token']:.0f}",
                file=sys.stderr,
                flush=True,
            )
            del result
    report["results"] = rows
    return report


def format_care_table(report: dict, eval_names) -> str:
    """A Markdown table of a [`benchmark_care`] report."""
    head = "| kv-keep | method | " + " | ".join(f"ppl {n}" for n in eval_names) + " | KV bytes/token | factorize s |"
    lines = [head, "|" + "---|" * (4 + len(eval_names))]
    orig = report["original"]
    lines.append(
        "| 1.0 | original | "
        + " | ".join(f"{orig['ppl'][n]:.2f}" for n in eval_names)
        + f" | {orig['cache_bytes_per_token']:.0f} | – |"
    )
    for row in report["results"]:
        ppl = " | ".join(_fmt(row["ppl"][n]) for n in eval_names)
        lines.append(
            f"| {row['kv_keep']} | {row['method']} | {ppl} | {row['cache_bytes_per_token']:.0f} "
            f"| {row['factorization_seconds']:.1f} |"
        )
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:,.2f}" if x < 1e4 else f"{x:,.0f}" if math.isfinite(x) else str(x)
