"""What differs between the transformers versions hf-accel runs on (5.23 and later 5.x).

transformers 5.24 renamed the cache of every model from `past_key_values` to `cache`: the models' and attention
layers' argument, the models' output field, and the key in `generate`'s model keyword arguments (a `custom_generate`
loop gets `model_kwargs["cache"]`). The models still take the old argument name as a deprecated alias; outputs and
`generate`'s keyword arguments have the new name only. Code that passes or reads a cache uses [`CACHE_NAME`].
"""

import inspect

import transformers
from transformers.generation.utils import ALL_CACHE_NAMES


# the cache's name in model inputs and outputs and in `generate`'s model_kwargs: "cache" from 5.24 on, else the old one
CACHE_NAME = ALL_CACHE_NAMES[0]


def check_cache_argument(model) -> None:
    """Refuses, in one line, a model whose attention layers would not get the cache from this transformers.

    From 5.24 on, transformers' layers pass the cache to their attention as `cache`. Attention code written before (a
    CARE or Palu checkpoint converted by an hf-accel older than its 5.24 support, another remote-code attention swapped
    into a library model) names it `past_key_values`, finds the cache among its ignored keyword arguments and attends
    to the new tokens alone: every step after the prefill would be silently wrong. Checked: every direct child of a
    module whose `forward` takes `cache` (the attention sits under `self_attn`, `attn`, `attention`, ...). A child's
    `forward` is read as written, not through its wrappers: a wrapper may pass `cache` on as `past_key_values`.
    """
    if CACHE_NAME == "past_key_values":
        return
    for parent in model.modules():
        if "cache" not in inspect.signature(parent.forward).parameters:
            continue
        for child in parent.children():
            takes = inspect.signature(child.forward, follow_wrapped=False).parameters
            if "past_key_values" in takes and "cache" not in takes:
                raise ValueError(
                    f"{type(child).__name__} (in {type(model).__name__}) takes the cache as `past_key_values`, but "
                    f"transformers {transformers.__version__} passes it as `cache`, which it would ignore and decode "
                    "without its cache: convert the checkpoint again with this hf-accel and load it in a new Python "
                    "process, or install transformers 5.23"
                )
