"""Progress bars and log messages that follow the switches a transformers user already sets."""

from transformers.utils import logging


def progress_bar(iterable=None, progress: bool = True, **kwargs):
    """A tqdm progress bar (on stderr), hidden when `progress` is `False` or when the user turned bars off: in
    transformers (`transformers.utils.logging.disable_progress_bar()`, `HF_HUB_DISABLE_PROGRESS_BARS=1`) or in tqdm
    (`TQDM_DISABLE=1`). No `disable=False` is passed: tqdm lets an explicit one override `TQDM_DISABLE`."""
    if not progress:
        kwargs["disable"] = True
    return logging.tqdm(iterable, **kwargs)


def get_logger(name: str):
    """The logger of hf-accel's module `name`, under transformers' library logger, so that its verbosity
    (`transformers.logging.set_verbosity_*`, `TRANSFORMERS_VERBOSITY`, a Trainer's `log_level`) and handler apply to
    hf-accel's messages as to transformers' own. `transformers.utils.logging.get_logger(__name__)` names a logger
    outside that tree: its warnings ignored the verbosity and its info messages never showed."""
    return logging.get_logger(f"transformers.{name}")
