"""`hf-accel convert care` and `hf-accel convert palu`: the converters' command line."""

import argparse
import dataclasses
import sys

from ..cli import add_model_options, load_model, user_path


def add_cli(commands) -> argparse.ArgumentParser:
    """Adds the `convert` command group, one subcommand per converter, to the top-level subparsers; returns its
    parser."""
    convert = commands.add_parser("convert", help="convert a model into a smaller-KV-cache checkpoint")
    converters = convert.add_subparsers(dest="converter", required=True, metavar="CONVERTER")
    _add_care(converters)
    _add_palu(converters)
    return convert


def _add_source_options(parser) -> None:
    """What both converters read: the model, where it runs, and the calibration text."""
    add_model_options(parser)
    parser.add_argument(
        "--calib",
        default="generated",
        type=user_path,
        help="`generated` (sampled from the model), a text file, or hf:<dataset>[:cfg]",
    )
    parser.add_argument("--calib-split", help="the dataset split (with --calib hf:...; default: train)")
    parser.add_argument("--calib-text-column", help="the dataset column holding the text (default: text)")


def _add_output_options(parser) -> None:
    """What both converters write: the checkpoint directory, its card's base model, and the JSON summary."""
    parser.add_argument("--base-model", help="Hub id for the model card (default: --model when it is a Hub id)")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier checkpoint in --out")
    parser.add_argument("--json", action="store_true", help="print one JSON summary object")


def _add_care(converters) -> None:
    from .care import METHODS

    care = converters.add_parser(
        "care", help="CARE: GQA → MLA with covariance-weighted SVD and water-filling ranks (caches latents)"
    )
    _add_source_options(care)
    care.add_argument("--kv-keep", type=float, required=True, help="fraction of the K+V cache kept, in (0, 1]")
    care.add_argument("--method", default="care", choices=METHODS, help="factorization + rank allocation")
    care.add_argument("--calib-samples", type=int, default=256, help="calibration sequences (spec default 256)")
    care.add_argument("--calib-seq-len", type=int, default=32, help="tokens per sequence (spec default 32)")
    care.add_argument("--alpha", type=float, default=0.05, help="covariance shrinkage weight α")
    care.add_argument("--absorb-value", action="store_true", help="fold the value up-projection into o_proj")
    care.add_argument(
        "--seed", type=int, default=0, help="calibration seed: the model's samples, or which windows of a text"
    )
    _add_output_options(care)
    care.set_defaults(func=run_convert_care)


def _check_sources_and_output(args):
    """What both converters check before the (slow) model load, so a bad option fails in a second: the calibration
    source, the model (a missing local one is named first; a converted one is refused), the card's base model and
    `--out`. Returns `(resolved model path, base model, output directory)`."""
    from ..atomic import check_output_dir
    from ..loading import resolve_model
    from .calibration import check_calibration_source
    from .export import card_base_model, check_source_model

    check_calibration_source(args.calib, args.calib_split, args.calib_text_column)
    source = resolve_model(args.model)
    check_source_model(args.model, source)
    base_model = card_base_model(args.base_model or args.model)
    return source, base_model, check_output_dir(args.out, args.overwrite)


def _saved_like_original(model, source, converter: str):
    """`model`, converted in `--dtype`, cast to the dtype the original `source` declares, as it is saved; weights that
    dtype cannot hold are refused (a float16 original's factors, computed in float32, may pass 65504: saved as inf)."""
    from ..loading import to_checkpoint_dtype
    from .export import first_non_finite

    computed = model.dtype
    model = to_checkpoint_dtype(model, source)
    name = None if model.dtype == computed else first_non_finite(model.named_parameters())
    if name is not None:
        dtype = str(model.dtype).removeprefix("torch.")
        raise ValueError(
            f"{converter} conversion produced {name} beyond the range of {dtype}, the original checkpoint's dtype it "
            f"is saved in; save the original in bfloat16 or float32 first"
        )
    return model


def run_convert_care(args) -> int:
    from ..cli import print_json
    from .care import CareConversionConfig, run_care_conversion, save_care_model

    config = CareConversionConfig(
        kv_keep=args.kv_keep, method=args.method, alpha=args.alpha, absorb_value=args.absorb_value
    )  # validates before the (slow) model load
    if args.calib_samples < 1 or args.calib_seq_len < 2:
        raise ValueError(
            f"--calib-samples must be ≥ 1 and --calib-seq-len ≥ 2 (a prediction needs two tokens), got "
            f"{args.calib_samples} and {args.calib_seq_len}"
        )
    source, base_model, _ = _check_sources_and_output(args)
    model, tokenizer = load_model(args)
    result = run_care_conversion(
        model,
        tokenizer,
        config,
        progress=True,  # bars go to stderr, --json to stdout
        calib=args.calib,
        num_samples=args.calib_samples,
        seq_len=args.calib_seq_len,
        seed=args.seed,
        split=args.calib_split,
        text_column=args.calib_text_column,
    )
    result.model = _saved_like_original(result.model, source, "CARE")
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


def _add_palu(converters) -> None:
    from .palu import QUANT_BITS, RANK_METHODS

    parser = converters.add_parser("palu", help="Palu: grouped low-rank K/V latents, Fisher ranks, low-bit")
    _add_source_options(parser)
    parser.add_argument("--kv-keep", type=float, required=True, help="fraction of the K+V cache width kept, (0, 1]")
    parser.add_argument(
        "--group-size", type=int, default=None,
        help="KV heads per group (must divide the KV heads; default: the largest divisor of them ≤ 4)",
    )  # fmt: skip
    parser.add_argument(
        "--ranks", choices=RANK_METHODS, default="fisher", help="rank allocation over groups and layers"
    )
    parser.add_argument(
        "--quant-bits", type=int, choices=QUANT_BITS, default=0, help="0: float latents; else per-token codes"
    )
    parser.add_argument(
        "--quant-group-size",
        type=int,
        default=0,
        help="channels per scale/zero-point (0: whole latent; divides --rank-multiple)",
    )
    parser.add_argument(
        "--residual-length", type=int, default=0,
        help="most recent tokens also served in full precision (with --quant-bits; a fixed cost per sequence)",
    )  # fmt: skip
    parser.add_argument("--no-hadamard", action="store_true", help="do not fold the Walsh–Hadamard rotation")
    parser.add_argument("--calib-samples", type=int, default=64, help="calibration sequences")
    parser.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    parser.add_argument(
        "--fisher-samples", type=int, default=16, help="calibration sequences for the Fisher scores (--ranks fisher)"
    )
    parser.add_argument("--rank-multiple", type=int, default=8, help="every group rank is a multiple of this")
    _add_output_options(parser)
    parser.set_defaults(func=run_convert_palu)


def run_convert_palu(args) -> int:
    from ..cli import print_json
    from .calibration import calibration_dataset_fields, load_calibration_ids, published_calibration_source
    from .palu import (
        PaluConversionConfig,
        check_fisher_samples,
        check_palu_model,
        convert_palu,
        save_palu,
        window_bytes_per_sequence,
    )

    # Validate everything cheap before loading the model
    conversion = PaluConversionConfig(
        kv_keep=args.kv_keep,
        group_size=args.group_size,
        ranks=args.ranks,
        quant_bits=args.quant_bits,
        hadamard=not args.no_hadamard,
        quant_group_size=args.quant_group_size,
        residual_length=args.residual_length,
        calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        fisher_samples=args.fisher_samples,
        rank_multiple=args.rank_multiple,
    )
    check_fisher_samples(args.fisher_samples, args.calib_samples, args.ranks == "fisher")
    source, base_model, out = _check_sources_and_output(args)
    model, tokenizer = load_model(args)
    group_size = check_palu_model(model, conversion)  # before the (slow) calibration
    ids = load_calibration_ids(
        model, tokenizer, args.calib, args.calib_samples, args.calib_seq_len, seed=conversion.seed,
        progress=True,  # bars go to stderr, --json to stdout
        split=args.calib_split, text_column=args.calib_text_column,
    )  # fmt: skip
    options = dict(dataclasses.asdict(conversion), group_size=group_size)  # the options checked above, as they are
    palu, info = convert_palu(model, tokenizer, calibration_ids=ids, progress=True, **options)  # bars go to stderr
    palu = _saved_like_original(palu, source, "Palu")
    info["window_bytes_per_sequence"] = window_bytes_per_sequence(palu)  # in the saved dtype
    info["calibration_source"] = published_calibration_source(args.calib)  # a local file by its name
    fields = calibration_dataset_fields(args.calib, args.calib_split, args.calib_text_column)
    info.update({f"calibration_{k}": v for k, v in fields.items()})  # a dataset's split and column
    save_palu(palu, tokenizer, out, info, base_model=base_model, overwrite=args.overwrite)
    summary = {
        "model": args.model,
        "out": str(out),
        "kv_keep": args.kv_keep,
        "kv_keep_achieved": info["kv_keep_achieved"],
        "group_size": group_size,
        "ranks": args.ranks,
        "quant_bits": args.quant_bits,
        "quant_group_size": args.quant_group_size,
        "residual_length": args.residual_length,
        "hadamard": not args.no_hadamard,
        "k_ranks": info["k_ranks"],
        "v_ranks": info["v_ranks"],
        "cache_bytes_per_token": info["cache_bytes_per_token"],
        "window_bytes_per_sequence": info["window_bytes_per_sequence"],
        "base_cache_bytes_per_token": info["base_cache_bytes_per_token"],
        "timings": info["timings"],
    }
    # every group keeps at least one rank multiple, and at most the largest multiple within its width
    if abs(info["kv_keep_achieved"] - args.kv_keep) > 0.05 * args.kv_keep:
        print(
            f"warning: ranks in multiples of {args.rank_multiple} keep {info['kv_keep_achieved']:.3g} of the cache, "
            f"not {args.kv_keep:g}; a smaller --rank-multiple, or one that divides the group width, gets closer",
            file=sys.stderr,
        )
    if args.json:
        print_json(summary)
    else:
        for key, value in summary.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v:.1f}" for k, v in value.items())
            print(f"{key:>28}: {f'{value:.4g}' if isinstance(value, float) else value}")
    return 0
