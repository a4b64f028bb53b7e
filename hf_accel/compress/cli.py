"""`hf-accel convert ...`: the converters' command line (`convert care` here; Palu adds `convert palu`)."""

import argparse

from ..cli import add_model_placement_options, model_placement, user_path


def add_cli(commands) -> argparse.ArgumentParser:
    """Adds the `convert` command group to the top-level subparsers; returns its parser.

    Other converters register beside CARE with `parser._convert_subcommands.add_parser(...)` or by extending
    `_add_converters`.
    """
    convert = commands.add_parser("convert", help="convert a model into a smaller-KV-cache checkpoint")
    converters = convert.add_subparsers(dest="converter", required=True, metavar="CONVERTER")
    convert._convert_subcommands = converters
    _add_care(converters)
    return convert


def _add_care(converters) -> None:
    from .care import METHODS

    care = converters.add_parser(
        "care", help="CARE: GQA → MLA with covariance-weighted SVD and water-filling ranks (caches latents)"
    )
    care.add_argument("--model", default="smollm2-135m", help="Hub id, local directory, or `smollm2-135m`")
    add_model_placement_options(care)
    care.add_argument("--kv-keep", type=float, required=True, help="fraction of the K+V cache kept, in (0, 1]")
    care.add_argument("--method", default="care", choices=METHODS, help="factorization + rank allocation")
    care.add_argument(
        "--calib",
        default="generated",
        type=user_path,
        help="`generated` (sampled from the model), a text file, or hf:<dataset>[:cfg]",
    )
    care.add_argument("--calib-samples", type=int, default=256, help="calibration sequences (spec default 256)")
    care.add_argument("--calib-seq-len", type=int, default=32, help="tokens per sequence (spec default 32)")
    care.add_argument("--alpha", type=float, default=0.05, help="covariance shrinkage weight α")
    care.add_argument("--absorb-value", action="store_true", help="fold the value up-projection into o_proj")
    care.add_argument(
        "--seed", type=int, default=0, help="calibration seed: the model's samples, or which windows of a text"
    )
    care.add_argument("--base-model", help="Hub id for the model card (default: --model when it is a Hub id)")
    care.add_argument("--out", required=True, help="output directory (written atomically)")
    care.add_argument("--overwrite", action="store_true", help="replace an earlier checkpoint in --out")
    care.add_argument("--json", action="store_true", help="print one JSON summary object")
    care.set_defaults(func=run_convert_care)


def run_convert_care(args) -> int:
    from ..cli import print_json
    from ..loading import load_model_and_tokenizer, resolve_model, to_checkpoint_dtype
    from .calibration import check_calibration_source
    from .care import CareConversionConfig, run_care_conversion, save_care_model
    from .export import card_base_model, check_output_dir, check_source_model

    config = CareConversionConfig(
        kv_keep=args.kv_keep, method=args.method, alpha=args.alpha, absorb_value=args.absorb_value
    )  # validates before the (slow) model load
    if args.calib_samples < 1 or args.calib_seq_len < 2:
        raise ValueError(
            f"--calib-samples must be ≥ 1 and --calib-seq-len ≥ 2 (a prediction needs two tokens), got "
            f"{args.calib_samples} and {args.calib_seq_len}"
        )
    check_calibration_source(args.calib)
    source = resolve_model(args.model)  # a missing local model is named first
    check_source_model(args.model, source)
    base_model = card_base_model(args.base_model or args.model)
    check_output_dir(args.out, args.overwrite)
    model, tokenizer = load_model_and_tokenizer(args.model, **model_placement(args))
    result = run_care_conversion(
        model,
        tokenizer,
        config,
        progress=True,  # bars go to stderr, --json to stdout
        calib=args.calib,
        num_samples=args.calib_samples,
        seq_len=args.calib_seq_len,
        seed=args.seed,
    )
    result.model = to_checkpoint_dtype(result.model, source)  # converted in --dtype, saved like the original
    out = save_care_model(result, tokenizer, args.out, base_model, overwrite=args.overwrite)
    summary = dict(result.summary(), model=args.model, out=str(out))
    if args.json:
        print_json(summary)
    else:
        print(
            f"CARE ({args.method}) kv-keep {args.kv_keep}: {summary['cache_values_per_token']} cached values per "
            f"token (achieved {summary['kv_keep_achieved']:.3f}); calibration {summary['calibration_seconds']} s, "
            f"factorization {summary['factorization_seconds']} s → {out}"
        )
    return 0
