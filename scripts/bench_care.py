"""Benchmark CARE against SVD / ASVD / CARE-U / CARE-E on a model: perplexity, measured KV bytes, conversion time.

Calibrates once on the original model (tinyshakespeare's first half + model-generated text by default), converts
with every method at every budget, and evaluates perplexity on tinyshakespeare's held-out second half and on held-out
model-generated text (other prompts, other seed).

Example:
    python scripts/bench_care.py --kv-keep 0.75 0.5 0.25 0.125 --json
"""

import pickle
import sys
import time
from pathlib import Path

import torch

from hf_accel.cli import OneLineErrorParser, print_json


DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"  # ../shared


def parse_args(argv=None):
    from hf_accel.compress.care import METHODS, CareConversionConfig

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default=DEFAULT_TEXT, help="text file: first half calibrates, second half evaluates")
    p.add_argument("--kv-keep", type=float, nargs="+", default=[0.75, 0.5, 0.25, 0.125])
    p.add_argument(
        "--methods", nargs="+", default=["svd", "asvd", "care-u", "care-e-raw", "care-e-rel", "care"], choices=METHODS
    )
    p.add_argument("--calib-text-samples", type=int, default=16, help="calibration windows from the text")
    p.add_argument("--calib-generated-samples", type=int, default=16, help="model-generated calibration sequences")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--calib-cache", default=None, help="file to save / reuse the calibration statistics")
    p.add_argument("--generated-cache", default=None, help="file to save / reuse the held-out generated text")
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of held-out text evaluated")
    p.add_argument("--eval-generated-tokens", type=int, default=2048, help="tokens of held-out generated text")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    for kv_keep in args.kv_keep:  # now, not after the calibration and the rows of the budgets before it
        try:
            CareConversionConfig(kv_keep=kv_keep)
        except ValueError as err:
            p.error(str(err))
    return args


def cached(path: str | None, settings: dict, make):
    """`make()`, saved to `path` with the `settings` it was made with (atomically) and read back by a later run with
    the same settings; a file made with other settings is refused in one line rather than reused."""
    from hf_accel.atomic import replace_atomically

    if path is None:
        return make()
    if Path(path).is_file():
        try:  # tensors, lists, dicts and plain values only: a pickle of anything else could run code on load
            saved = torch.load(path, weights_only=True)
        except pickle.UnpicklingError:  # an older bench_care's file, which pickled the calibration's class
            saved = None
        if not isinstance(saved, dict) or saved.get("settings") != settings:
            made_with = saved.get("settings") if isinstance(saved, dict) else "an older bench_care"
            raise SystemExit(f"{path} was made with {made_with}, not {settings}: remove it or name another file")
        return saved["value"]
    value = make()
    replace_atomically(Path(path), lambda partial: torch.save({"settings": settings, "value": value}, partial))
    return value


def main(argv=None) -> int:
    from hf_accel.compress.calibration import KvCalibration, calibrate_mixed
    from hf_accel.eval.care_quality import benchmark_care, format_care_table, generated_text, split_text
    from hf_accel.loading import load_model_and_tokenizer

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model)
    calib_text, heldout_text = split_text(Path(args.text).read_text(encoding="utf-8"))
    start = time.perf_counter()
    settings = {"model": args.model, "text": str(Path(args.text).resolve()), "seed": args.seed}
    fields = cached(  # the calibration's fields, not the object: the file loads with weights_only=True
        args.calib_cache,
        dict(settings, samples=[args.calib_text_samples, args.calib_generated_samples], seq_len=args.calib_seq_len),
        lambda: vars(
            calibrate_mixed(
                model,
                tokenizer,
                calib_text,
                args.calib_text_samples,
                args.calib_generated_samples,
                args.calib_seq_len,
                seed=args.seed,
            )
        ),
    )
    calibration = KvCalibration(**fields)
    calibration_seconds = time.perf_counter() - start
    gen_samples = max(1, args.eval_generated_tokens // 256 + 2)
    heldout_generated = cached(
        args.generated_cache,
        dict(settings, samples=gen_samples),
        lambda: generated_text(model, tokenizer, gen_samples, 256, seed=args.seed + 1000),
    )
    eval_texts = {"shakespeare": heldout_text, "generated": heldout_generated}
    eval_tokens = {"shakespeare": args.eval_tokens, "generated": args.eval_generated_tokens}
    report = benchmark_care(
        model, tokenizer, calibration, eval_texts, args.kv_keep, args.methods, eval_tokens, args.eval_seq_len
    )
    report.update(
        model=args.model,
        calibration=dict(calibration.meta, tokens=calibration.tokens),
        calibration_seconds=round(calibration_seconds, 1),
        eval_tokens=eval_tokens,
        eval_seq_len=args.eval_seq_len,
        command="python scripts/bench_care.py " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    if args.json:
        print_json(report)
    else:
        print(format_care_table(report, list(eval_texts)))
        print(f"calibration: {report['calibration']} in {report['calibration_seconds']} s (shared by all methods)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
