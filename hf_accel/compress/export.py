"""Finishing converted checkpoints: checks of the source model, loading the converted weights, rank reports and
model cards (`save_pretrained` copies the remote code: the converted classes set `_auto_class`).

Shared by the CARE and Palu converters. Both write their checkpoint with [`~hf_accel.atomic.atomic_output_dir`], so a
failure never leaves a half-written output directory.
"""

import json
from pathlib import Path

import torch


def card_base_model(name: str) -> str:
    """The Hub id a converted checkpoint's model card names as its base model (`--base-model`, else `--model`)."""
    from ..hub import hub_base_model

    try:
        return hub_base_model(name)
    except ValueError:
        raise ValueError(
            f"the model card needs the Hub id of the original model, not {name!r}; pass --base-model ORG/NAME"
        ) from None


# RoPE whose frequencies change with the sequence length at run time: CARE and Palu models RoPE cached keys at
# attention time with the current frequencies, the original keeps each key as rotated when it was cached, so the two
# would drift apart past the trained length.
RUNTIME_ROPE_TYPES = ("dynamic", "longrope")


def check_rope_type(config, converter: str) -> None:
    """Refuses, in one line, a model whose RoPE frequencies change at run time ([`RUNTIME_ROPE_TYPES`])."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in RUNTIME_ROPE_TYPES:
        raise ValueError(f"{converter} does not support rope_type {rope_type!r} (frequencies that change at run time)")


def check_no_adapters(model, converter: str) -> None:
    """Refuses, in one line, a model with PEFT adapters loaded (a `PeftModel`, or adapters added to a transformers
    model, as `from_pretrained` of an adapter directory does): the converters factorize the base `k_proj`/`v_proj`
    weights and copy every other weight by name, so the adapters' deltas would be lost, and their modules' weights do
    not fit the converted model."""
    if getattr(model, "peft_config", None):
        raise ValueError(
            f"{converter} converts plain weights, and this model has PEFT adapters loaded: merge them first "
            "(merge_and_unload() of a PeftModel, then save) and convert the merged model"
        )


def check_source_model(name: str, path: str) -> None:
    """Refuses, in one line, a directory that holds no model, and a checkpoint that is already converted (it ships its
    own modeling code)."""
    from ..loading import check_model_dir, remote_code_model_type

    check_model_dir(name, path)
    model_type = remote_code_model_type(path)
    if model_type:
        raise ValueError(
            f"model {name!r} is already a converted checkpoint ({model_type}): convert the original model"
        )


def uninitialized_model(model_class, config, dtype):
    """`model_class` built from `config` in `dtype` with its parameters on the meta device: [`load_converted_state`]
    then assigns every one of them (strictly). Allocating and initialising weights that are overwritten cost a second
    copy of the model at peak (`scripts/probe_conversion_memory.py`) and 23 s at 1B shapes. Buffers computed at
    construction (RoPE frequencies) are made as usual."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_class._from_config(config, dtype=dtype)


def as_converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as [`load_converted_state`] loads it: in `dtype`, contiguous (the same tensor when it already is). The
    builders convert each layer's float64 results as they make them: kept in float64 until the load, every layer's
    were held together with their converted copies, three times the converted weights of a float32 model (five of a
    16-bit one)."""
    return tensor.to(dtype, memory_format=torch.contiguous_format)


def first_non_finite(named_tensors) -> str | None:
    """The name of the first floating tensor of `(name, tensor)` pairs that holds a non-finite value, else `None`."""
    return next((n for n, t in named_tensors if t.is_floating_point() and not torch.isfinite(t).all()), None)


def load_converted_state(converted, state: dict, source, converter: str):
    """Assigns `state` to the parameters of `converted` (built by [`uninitialized_model`]) in the dtype of `source`,
    refusing non-finite values, and gives it `source`'s generation config (its EOS ids and sampling defaults live
    there, not in `config.json`).

    Weights the conversion leaves as they are (embeddings, MLPs, norms, query projections) are `source`'s own
    tensors, not copies, when `source` is on one device in one dtype: a conversion holds the source model plus the
    new attention weights. Training the converted model in the same process therefore changes `source` too; convert
    a `copy.deepcopy` of it to keep both.

    Returns:
        `converted`, on `source`'s device, in eval mode.
    """
    import copy

    dtype = next(source.parameters()).dtype
    state = {k: as_converted(v, dtype) for k, v in state.items()}
    name = first_non_finite(state.items())
    if name is not None:
        # a 16-bit checkpoint may just not hold a factor; in float32 a factor blew up (a near-singular moment)
        hint = "convert the model in float32, or " if torch.finfo(dtype).bits < 32 else "convert "
        raise ValueError(
            f"{converter} conversion produced non-finite values in {name} ({str(dtype).removeprefix('torch.')}); "
            f"{hint}with a larger shrinkage alpha"
        )
    converted.load_state_dict(state, strict=True, assign=True)
    converted.tie_weights()  # assigned, the tied output and input embeddings are two parameters again
    converted.generation_config = copy.deepcopy(source.generation_config)
    return converted.to(next(source.parameters()).device).eval()


def write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def plot_ranks(path: Path, k_ranks: list[int], v_ranks: list[int], width: int, title: str) -> None:
    """Saves a PNG of the per-layer K and V ranks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    layers = range(len(k_ranks))
    ax.plot(layers, k_ranks, marker="o", label="K rank")
    ax.plot(layers, v_ranks, marker="s", label="V rank")
    ax.axhline(width, color="grey", linestyle=":", label=f"full width ({width})")
    ax.set_xlabel("layer")
    ax.set_ylabel("latent rank")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
