"""Progress bars that follow the switches a transformers user already sets."""

from transformers.utils import logging


def progress_bar(iterable=None, progress: bool = True, **kwargs):
    """A tqdm progress bar (on stderr), hidden when `progress` is `False` or when the user turned bars off: in
    transformers (`transformers.utils.logging.disable_progress_bar()`, `HF_HUB_DISABLE_PROGRESS_BARS=1`) or in tqdm
    (`TQDM_DISABLE=1`). No `disable=False` is passed: tqdm lets an explicit one override `TQDM_DISABLE`."""
    if not progress:
        kwargs["disable"] = True
    return logging.tqdm(iterable, **kwargs)
