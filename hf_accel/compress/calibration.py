"""Calibration for K/V factorization: per-layer second moments of the k/v-projection input (CARE Stage 1–2).

Forward pre-hooks on every layer's `k_proj` capture its input, the post-`input_layernorm` activation that K and V
share, so one `C⁽ˡ⁾ = (1/N) Σ_t x_tᵀ x_t` per layer serves both (spec A.4, Stage 1 [INTERP]). Only the original
model runs (not a partially converted one), sums are float64, and padding tokens are excluded through the attention
mask. The same pass accumulates `mean_t |x_t|` per channel for the ASVD baseline.

Optionally (`with_output_grads=True`) a backward pass of the causal-LM loss also accumulates, per layer, the second
moment of the loss gradient with respect to the K and V projection outputs, `G = (1/N) Σ_t g_tᵀ g_t`: the
output-side weighting used by loss-aware rank gains.
"""

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..log import progress_bar


@dataclass
class KvCalibration:
    """Statistics of one calibration run, all float64 on CPU.

    Attributes:
        moments (`list[torch.Tensor]`, each `[D, D]`): per layer, the second moment `C` of the k/v-proj input.
        abs_means (`list[torch.Tensor]`, each `[D]`): per layer, `mean_t |x_t|` (ASVD).
        tokens (`int`): number of non-padding tokens seen.
        k_grad_moments, v_grad_moments (`list[torch.Tensor]`, each `[out, out]`, *optional*): per layer, the second
            moment of `∂loss/∂(k_proj output)` and `∂loss/∂(v_proj output)` (summed-loss gradients, per token).
    """

    moments: list
    abs_means: list
    tokens: int
    k_grad_moments: list | None = None
    v_grad_moments: list | None = None
    meta: dict = field(default_factory=dict)


def check_calibration_ids(input_ids, min_len: int = 2) -> None:
    """Refuses, in one line, calibration ids that are not a `[num_samples, seq_len]` integer tensor with `seq_len ≥
    min_len` (a loss, for gradients or Fisher scores, needs two tokens: with one, every gradient is zero)."""
    ok = isinstance(input_ids, torch.Tensor) and not input_ids.is_floating_point() and input_ids.dim() == 2
    if not ok or input_ids.shape[1] < min_len:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"calibration ids must be an integer tensor [num_samples, seq_len] with seq_len >= {min_len}, got {shape}"
        )


def check_calibration_fits(model, calibration: KvCalibration) -> None:
    """Refuses, in one line, statistics that were collected on another model (another number of layers, hidden size
    or K/V width): a reused [`KvCalibration`] with more layers than `model` would otherwise be used silently."""
    attn_modules = _attention_layers(model)
    k_proj, v_proj = attn_modules[0].k_proj, attn_modules[0].v_proj
    pairs = [(calibration.moments, len(attn_modules), k_proj.in_features)]
    if calibration.k_grad_moments is not None:
        pairs.append((calibration.k_grad_moments, len(attn_modules), k_proj.out_features))
        pairs.append((calibration.v_grad_moments, len(attn_modules), v_proj.out_features))
    for moments, layers, width in pairs:
        if len(moments) != layers or any(m.shape != (width, width) for m in moments):
            raise ValueError(
                f"the calibration does not fit this model ({len(moments)} layers of {tuple(moments[0].shape)} "
                f"moments, the model needs {layers} of {(width, width)}): calibrate this model"
            )


def chunk_token_ids(token_ids: Sequence[int], num_samples: int, seq_len: int, seed: int | None = None) -> torch.Tensor:
    """Cuts `num_samples` non-overlapping windows of `seq_len` tokens out of one token stream.

    Args:
        token_ids (sequence of `int`): the tokenized calibration text.
        num_samples (`int`): number of windows.
        seq_len (`int`): tokens per window.
        seed (`int`, *optional*): if given, windows are a random subset of all windows; otherwise the first ones.

    Returns:
        `torch.LongTensor` of shape `[num_samples, seq_len]`.
    """
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} x {seq_len}")
    available = len(token_ids) // seq_len
    if available < num_samples:
        raise ValueError(
            f"calibration text too short: {len(token_ids)} tokens give {available} windows of {seq_len}, "
            f"{num_samples} requested; pass more text or fewer samples / a shorter seq-len"
        )
    starts = list(range(available))
    if seed is not None:
        starts = sorted(random.Random(seed).sample(starts, num_samples))
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    return torch.stack([ids[s * seq_len : (s + 1) * seq_len] for s in starts[:num_samples]])


def tokenize_calibration_text(
    tokenizer, text: str, num_samples: int, seq_len: int, seed: int | None = None
) -> torch.Tensor:
    """Tokenizes `text` (no special tokens) and cuts it with [`chunk_token_ids`]; `[num_samples, seq_len]`."""
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return chunk_token_ids(token_ids, num_samples, seq_len, seed)


def _attention_layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"{type(model).__name__} has no `model.layers[i].self_attn`: not a supported decoder LM")
    return [layer.self_attn for layer in layers]


def _accumulate_inputs(attn_modules, stats, mask_box):
    """Registers the k_proj input hooks; returns their handles."""

    def make_hook(idx):
        def hook(_module, args):
            x = args[0].detach()  # [B, S, D]
            mask = mask_box[0]
            x = x.reshape(-1, x.shape[-1]) if mask is None else x[mask.bool()]
            x = x.double().cpu()  # the statistics live on the CPU in float64
            stats["moments"][idx] += x.T @ x
            stats["abs_sums"][idx] += x.abs().sum(0)

        return hook

    return [attn.k_proj.register_forward_pre_hook(make_hook(i)) for i, attn in enumerate(attn_modules)]


def _accumulate_output_grads(attn_modules, stats, mask_box):
    """Registers forward hooks that attach gradient hooks to the k/v_proj outputs; returns the handles."""

    def make_hook(idx, key):
        def fwd_hook(_module, _args, output):
            def grad_hook(grad):  # [B, S, out]
                mask = mask_box[0]
                g = grad.reshape(-1, grad.shape[-1]) if mask is None else grad[mask.bool()]
                g = g.double().cpu()
                stats[key][idx] += g.T @ g

            output.register_hook(grad_hook)

        return fwd_hook

    handles = []
    for i, attn in enumerate(attn_modules):
        handles.append(attn.k_proj.register_forward_hook(make_hook(i, "k_grads")))
        handles.append(attn.v_proj.register_forward_hook(make_hook(i, "v_grads")))
    return handles


def collect_kv_calibration(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    with_output_grads: bool = False,
    progress: bool = True,
) -> KvCalibration:
    """Runs the original model over calibration batches and accumulates the K/V input statistics.

    Args:
        model (`PreTrainedModel`): a Llama/Mistral/Qwen2/Qwen3-style causal LM (`model.model.layers[i].self_attn`).
        input_ids (`torch.LongTensor` of shape `[N, S]`): calibration sequences.
        attention_mask (`torch.Tensor` of shape `[N, S]`, *optional*): 0 marks padding, which is excluded.
        batch_size (`int`, *optional*, defaults to 8): sequences per forward pass.
        with_output_grads (`bool`, *optional*, defaults to `False`): also run the backward pass of the causal-LM loss
            and accumulate the K/V output-gradient moments (loss-aware gains).
        progress (`bool`, *optional*, defaults to `True`): show a progress bar.

    Returns:
        [`KvCalibration`] with per-token averages.
    """
    check_calibration_ids(input_ids, 2 if with_output_grads else 1)
    attn_modules = _attention_layers(model)
    d_in = attn_modules[0].k_proj.in_features
    d_k, d_v = attn_modules[0].k_proj.out_features, attn_modules[0].v_proj.out_features
    n = len(attn_modules)
    zeros = lambda *shape: [torch.zeros(*shape, dtype=torch.float64) for _ in range(n)]
    stats = {"moments": zeros(d_in, d_in), "abs_sums": zeros(d_in)}
    if with_output_grads:  # 2·layers·(g·d)² float64 numbers: 8.6 GB at Llama-2-7B's shapes, for nothing without them
        stats.update(k_grads=zeros(d_k, d_k), v_grads=zeros(d_v, d_v))
    mask_box = [None]
    handles = _accumulate_inputs(attn_modules, stats, mask_box)
    if with_output_grads:
        handles += _accumulate_output_grads(attn_modules, stats, mask_box)
    tokens = 0
    device = next(model.parameters()).device
    try:
        for start in progress_bar(range(0, len(input_ids), batch_size), progress, desc="calibration"):
            ids = input_ids[start : start + batch_size].to(device)
            mask = None if attention_mask is None else attention_mask[start : start + batch_size].to(device)
            mask_box[0] = mask
            tokens += ids.numel() if mask is None else int(mask.sum())
            _calibration_step(model, ids, mask, with_output_grads)
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise ValueError("calibration saw no tokens (all padding?)")
    check_finite_statistics(stats, with_output_grads, next(model.parameters()).dtype)
    # averaged in place: a divided copy held every layer's moments twice (2·layers·hidden² float64 numbers)
    averages = {key: [total.div_(tokens) for total in totals] for key, totals in stats.items()}
    return KvCalibration(
        moments=averages["moments"],
        abs_means=averages["abs_sums"],
        tokens=tokens,
        k_grad_moments=averages.get("k_grads"),
        v_grad_moments=averages.get("v_grads"),
    )


def check_finite_statistics(stats: dict, with_output_grads: bool, dtype: torch.dtype) -> None:
    """Refuses, in one line, calibration sums with an inf or NaN (activations or gradients that overflowed the
    model's dtype): every factorization of them would fail inside `torch.linalg` or give non-finite weights."""
    keys = ("moments", "abs_sums") + (("k_grads", "v_grads") if with_output_grads else ())
    hint = "" if dtype == torch.float32 else "; calibrate the model in float32"
    for key in keys:
        for idx, total in enumerate(stats[key]):
            if not torch.isfinite(total).all():
                what = "loss gradients at k/v_proj" if key.endswith("grads") else "k/v_proj inputs"
                raise ValueError(
                    f"calibration statistics of layer {idx} are not finite: its {what} overflow (inf/NaN) in "
                    f"{str(dtype).removeprefix('torch.')}{hint}"
                )


def _calibration_step(model, ids, mask, with_output_grads):
    if not with_output_grads:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        return
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    was_grad = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model(inputs_embeds=embeds, attention_mask=mask, labels=labels, use_cache=False)
            # Sum over tokens (not mean) so each token's gradient is its own loss's gradient.
            n_pred = int((labels[:, 1:] != -100).sum())
            (out.loss * n_pred).backward()
    finally:
        for p, g in zip(model.parameters(), was_grad):
            p.requires_grad_(g)


# Short, varied instructions for model-generated calibration text (the default source for instruct models).
CALIBRATION_PROMPTS = (
    "Tell me a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "Write a Python function that checks whether a number is prime.",
    "What are the main causes of inflation?",
    "Describe the water cycle to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "Summarize the history of the Roman Empire in a paragraph.",
    "How does a hash table work?",
    "Write a polite email asking for a meeting next week.",
    "What is the difference between weather and climate?",
    "Explain recursion with an example.",
    "List some healthy breakfast ideas.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "How do vaccines train the immune system?",
    "Compare renting and buying a home.",
)


# Held-out prompts for the generated evaluation text of the CARE and Palu quality benchmarks (disjoint from
# CALIBRATION_PROMPTS, so no evaluation text was calibrated on).
EVAL_PROMPTS = (
    "Explain the rules of chess to a beginner.",
    "Write a short poem about the sea at night.",
    "What are the benefits of regular exercise?",
    "Describe how a bill becomes a law.",
    "Write a JavaScript function that reverses a string.",
    "Tell me about the life of Marie Curie.",
    "How do airplanes stay in the air?",
    "Give advice to someone starting their first job.",
)
assert not set(EVAL_PROMPTS) & set(CALIBRATION_PROMPTS)


def generate_calibration_ids(
    model,
    tokenizer,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    prompts=CALIBRATION_PROMPTS,
    batch_size: int = 32,
    progress: bool = True,
) -> torch.Tensor:
    """Samples `num_samples` responses of `seq_len` tokens from the model itself (self-distillation text).

    Returns:
        `torch.LongTensor` `[num_samples, seq_len]`: the generated tokens only (the prompt is not part of the
        calibration). `min_new_tokens = seq_len` holds back the end of sequence, so every token is real text.
    """
    device = next(model.parameters()).device
    # seeded on a copy of torch's random state (`manual_seed` seeds every GPU's too): the caller's own sampling after
    # a conversion is not reseeded
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)
        rows = []
        for start in progress_bar(range(0, num_samples, batch_size), progress, desc="generating calibration text"):
            batch = [prompts[(start + i) % len(prompts)] for i in range(min(batch_size, num_samples - start))]
            enc, pad_id = _encode_prompts(tokenizer, batch)
            enc = enc.to(device)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=True,
                    temperature=1.0,
                    top_p=0.95,
                    max_new_tokens=seq_len,
                    min_new_tokens=seq_len,
                    pad_token_id=pad_id,
                )
            new = out[:, enc["input_ids"].shape[1] :].cpu()  # [b, seq_len]
            rows.append(new)
    return torch.cat(rows)


def mixed_calibration_ids(
    model, tokenizer, text: str | None, text_samples: int, generated_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """`[text_samples + generated_samples, seq_len]` token ids: random windows of `text`, then sequences sampled
    from the model on [`CALIBRATION_PROMPTS`] (the calibration the CARE and Palu quality benchmarks share)."""
    parts = []
    if text and text_samples:
        parts.append(tokenize_calibration_text(tokenizer, text, text_samples, seq_len, seed))
    if generated_samples:
        parts.append(generate_calibration_ids(model, tokenizer, generated_samples, seq_len, seed=seed))
    if not parts:
        raise ValueError("no calibration data: give text samples or generated samples")
    return torch.cat(parts)


def calibrate_mixed(
    model,
    tokenizer,
    text: str | None,
    text_samples: int,
    generated_samples: int,
    seq_len: int,
    seed: int = 0,
    with_output_grads: bool = True,
) -> KvCalibration:
    """One calibration over `text_samples` windows of `text` plus `generated_samples` model-generated sequences."""
    ids = mixed_calibration_ids(model, tokenizer, text, text_samples, generated_samples, seq_len, seed)
    calibration = collect_kv_calibration(model, ids, None, 8, with_output_grads)
    calibration.meta.update(text_samples=text_samples, generated_samples=generated_samples, seq_len=seq_len)
    return calibration


def check_calibration_source(source: str, split: str | None = None, text_column: str | None = None) -> None:
    """Fails fast (before a model loads) on a calibration source that is neither `generated`, `hf:...` nor a file, or
    on a split or text column given for a source that is not a dataset."""
    if source != "generated" and not source.startswith("hf:") and not os.path.isfile(source):
        raise FileNotFoundError(f"calibration text not found: {source} (give `generated`, a text file or hf:NAME)")
    if not source.startswith("hf:") and (split is not None or text_column is not None):
        raise ValueError(f"a split and a text column choose from a dataset (--calib hf:NAME), not from {source!r}")


def calibration_dataset_fields(source: str | None, split: str | None, text_column: str | None) -> dict:
    """`{"split": ..., "text_column": ...}` as read from an `hf:` source (the defaults filled in), else `{}`: what a
    card and a rank record add to the source's name so that the calibration can be read again."""
    if source is None or not source.startswith("hf:"):
        return {}
    return {"split": split or "train", "text_column": text_column or "text"}


def published_calibration_source(source: str | None) -> str | None:
    """How a calibration source is named in a published card: a local text file, data file or saved dataset by its
    file name (`hf:/home/me/corpus` -> `hf:corpus`), not the machine's path ([`~hf_accel.hub.published_name`]);
    `generated` and Hub ids as given."""
    from ..hub import published_name

    if source in (None, "generated"):
        return source
    if not source.startswith("hf:"):
        return published_name(source)
    name, sep, config = source[3:].partition(":")
    return "hf:" + published_name(name) + sep + config


def load_calibration_ids(
    model,
    tokenizer,
    source: str,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    progress: bool = True,
    split: str | None = None,
    text_column: str | None = None,
) -> torch.Tensor:
    """
    `[num_samples, seq_len]` calibration token ids from one source, the same for CARE and Palu.

    Args:
        source (`str`): `"generated"` (the model's own samples on [`CALIBRATION_PROMPTS`]), a text-file path, or
            `hf:<dataset>[:<config>]`.
        seed (`int`, *optional*, defaults to 0): the sampling seed, or which windows of the text are drawn.
        split, text_column (`str`, *optional*): the split and column an `hf:` source is read from (defaults `train`
            and `text`); refused for other sources.
    """
    check_calibration_source(source, split, text_column)
    if source == "generated":
        return generate_calibration_ids(model, tokenizer, num_samples, seq_len, seed=seed, progress=progress)
    text = load_calibration_text(source, split or "train", text_column or "text")
    return tokenize_calibration_text(tokenizer, text, num_samples, seq_len, seed=seed)


def _encode_prompts(tokenizer, prompts):
    """`(inputs, pad_token_id)` of the prompts padded on the left, in the chat template if any."""
    from ..eval.prompts import encode_prompts, user_prompt

    return encode_prompts(tokenizer, [user_prompt(tokenizer, p) for p in prompts])


def load_calibration_text(source: str, split: str = "train", column: str = "text") -> str:
    """Text of a calibration source: a text-file path, or `hf:<dataset>[:<config>]` (a `datasets` dataset).

    Raises:
        `FileNotFoundError` for a missing file; `ValueError` for a file that is not UTF-8 or a dataset without
        `column`.
    """
    if source.startswith("hf:"):
        from ..loading import load_dataset_split

        name, _, config = source[3:].partition(":")
        dataset = load_dataset_split(name, split, config or None, column)
        return "\n\n".join(t for t in dataset[column] if t)
    from ..training.data import read_text_file

    return read_text_file(source, what="calibration text file")
