"""`hf-accel train heal ...`: the healing script as a subcommand (drafter training adds `train <drafter>`)."""

import argparse
import contextlib
import sys


def add_cli(commands) -> None:
    train = commands.add_parser("train", help="train: heal converted models (drafters later)")
    methods = train.add_subparsers(dest="what", required=True, metavar="WHAT")
    # The options are HealingArguments/TrainingArguments fields, parsed by HfArgumentParser in `_run_heal`
    # (`hf-accel train heal --help` lists them); argparse here only passes them through.
    heal = methods.add_parser(
        "heal",
        add_help=False,
        help="CE + distillation fine-tuning of a converted model (LoRA or full)",
        description="options: see `hf-accel train heal --help` (HealingArguments and TrainingArguments)",
    )
    heal.set_defaults(func=_run_heal, accepts_unknown_args=True)


def _run_heal(args: argparse.Namespace) -> int:
    from transformers import HfArgumentParser

    from ..cli import print_json
    from .heal import HealingArguments, run_healing

    class OneLineErrors(HfArgumentParser):
        def error(self, message):  # argparse prints the whole usage (130 lines here) before the message
            raise ValueError(f"{message} (see `hf-accel train heal --help`)")

    parser = OneLineErrors(HealingArguments, prog="hf-accel train heal")
    (healing_args,) = parser.parse_args_into_dataclasses(args=args.unknown_args)
    # stdout carries the summary's JSON alone: the Trainer prints its logs there (`{'loss': ...}`), and so do the
    # perplexity evaluations
    with contextlib.redirect_stdout(sys.stderr):
        result = run_healing(healing_args)
    if healing_args.process_index == 0:
        print_json(result.summary)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # torch asks for this before exit; left to interpreter teardown, a torchrun worker of the two-process test
        # once aborted there ("terminate called without an active exception") under a loaded machine
        dist.destroy_process_group()
    return 0
