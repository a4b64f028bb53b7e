"""The `hf-accel` command line: one entry point, a subcommand per user job.

Each family adds its own subcommands through an `add_cli(subparsers)` function next to its code, registered in
`_build_parser`; a subcommand sets `func(args) -> int`. Expected user errors (bad model id, missing file, bad
prompts file, bad option) are raised as `ValueError`/`FileNotFoundError` and printed as one line, no traceback.
"""

import argparse
import json
import math
import os
import sys


def finite_or_null(obj):
    """`obj` with every NaN or infinite float replaced by `None`: JSON has no NaN or Infinity (`json.dumps` writes them
    anyway, and `jq` or `JSON.parse` then refuses the whole document), and a broken model's perplexity can be either."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_or_null(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(value) for value in obj]
    return obj


def user_path(value: str) -> str:
    """An option that may name a file or directory (`type=` of its argument), `~` expanded as the shell expands it in
    a word of its own: `--text=~/a.txt` and a quoted `~` reach the program as typed. A name that is no path
    (`humaneval`, a Hub id) passes as given; `hf:~/corpus` expands after its `hf:`."""
    prefix = "hf:" if value.startswith("hf:") else ""
    return prefix + os.path.expanduser(value[len(prefix) :])


def device_name(value: str) -> str:
    """`--device` (`type=` of its argument): a device this machine has, as torch names it (`cpu`, `cuda`, `cuda:1`,
    `mps`, `xpu`); anything else is refused while parsing, before a model loads."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {value!r} (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cpu":
        return value
    backend = getattr(torch, device.type, None)
    if not hasattr(backend, "is_available") or not hasattr(backend, "device_count"):
        raise argparse.ArgumentTypeError(f"{value!r}: models run on cpu, cuda, mps or xpu devices")
    if not backend.is_available():
        raise argparse.ArgumentTypeError(f"{value!r}: no {device.type} device is available on this machine")
    if device.index is not None and device.index >= backend.device_count():
        raise argparse.ArgumentTypeError(
            f"{value!r}: this machine has {backend.device_count()} {device.type} device(s)"
        )
    return value


DTYPES = ("float32", "bfloat16", "float16")


def add_model_options(parser) -> None:
    """`--model`, `--device` and `--dtype`: the model a command loads, where it runs and in which precision (read by
    [`load_model`])."""
    parser.add_argument("--model", default="smollm2-135m", help="Hub id, local directory, or `smollm2-135m`")
    parser.add_argument(
        "--device", type=device_name, default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, mps, ..."
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="the model's weights and compute (default: float32)"
    )


def load_model(args):
    """`(model, tokenizer)` of `--model`, loaded straight onto `--device` (no CPU copy first) in `--dtype`, with the
    command's `--trust-remote-code` where it has one; the CPU default exactly as without these options."""
    import torch

    from .loading import load_model_and_tokenizer

    kwargs = {"dtype": getattr(torch, args.dtype), "trust_remote_code": getattr(args, "trust_remote_code", False)}
    if args.device != "cpu":
        kwargs["device_map"] = args.device
    return load_model_and_tokenizer(args.model, **kwargs)


def placement_record(args) -> dict:
    """`--device` and `--dtype` as a command's JSON reports them, with the accelerator's name (a speed or a perplexity
    is a figure of one device and dtype)."""
    import torch

    record = {"device": args.device, "dtype": args.dtype}
    if torch.device(args.device).type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
    elif torch.device(args.device).type == "cpu":
        record.update(device_name=cpu_name(), threads=torch.get_num_threads())
    return record


def cpu_name() -> str:
    """The CPU's model name as the OS gives it (`/proc/cpuinfo`'s `model name` on Linux), else `platform`'s."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def strict_json(obj, indent: int | None = None) -> str:
    """`obj` as strict JSON text, non-finite numbers as `null` (for `--json` output and the JSON files we write)."""
    return json.dumps(finite_or_null(obj), indent=indent, allow_nan=False)


def print_json(obj) -> None:
    """Prints `obj` as one line of strict JSON on stdout (non-finite numbers as `null`)."""
    print(strict_json(obj))


class OneLineErrorParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line: argparse prints the whole usage (a dozen lines for
    `convert palu`) before the message. Subcommand parsers inherit the class through `add_subparsers`."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _build_parser() -> argparse.ArgumentParser:
    from .compress.cli import add_cli as add_convert
    from .demo import add_cli as add_demo
    from .eval.cli import add_cli as add_eval
    from .hub import add_cli as add_hub
    from .speculative.cli import add_cli as add_index
    from .training.cli import add_cli as add_train

    parser = OneLineErrorParser(prog="hf-accel", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo(commands)
    add_eval(commands)  # `eval ppl` and `bench generate`
    add_train(commands)  # `train heal`
    add_hub(commands)  # `push`
    add_convert(commands)  # `convert care` and `convert palu`
    add_index(commands)  # `index build`
    return parser


def main(argv=None) -> int:
    parser = _build_parser()
    # A subcommand that parses its own options (`train heal`, through HfArgumentParser) sets accepts_unknown_args.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown_args = unknown
    try:
        return args.func(args) or 0
    # Bad input, and file-system refusals (a path under a file, a read-only directory) that input can cause
    except (ValueError, ImportError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as err:
        print(f"hf-accel {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # The machine's errors, not the input's: a full disk, an I/O error (outputs are atomic); safetensors reports a
        # failed write as its own type
        if not isinstance(err, OSError) and type(err).__name__ != "SafetensorError":
            raise
        print(f"hf-accel {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
