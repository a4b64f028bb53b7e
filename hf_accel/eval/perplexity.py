"""Perplexity over non-overlapping windows.

Convention (written down because papers differ): the text is tokenized once, without special tokens, and cut into
consecutive windows of `seq_len` tokens (a shorter last window is kept when it has at least two tokens). Each window
is scored on its own, with no context carried over from the previous one, so a window of n tokens contributes n - 1
predictions. `tokens` in the result counts those predictions, and ppl = exp(total NLL / tokens).
"""

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..compat import CACHE_NAME
from ..log import progress_bar


def split_windows(input_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Cuts a 1D token sequence into consecutive windows of `seq_len` (the last may be shorter, but ≥ 2 tokens)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    windows = list(input_ids.split(seq_len))
    if windows and windows[-1].numel() < 2:
        windows.pop()
    return windows


def nll_to_ppl(mean_nll: float) -> float:
    """exp(mean NLL), or `inf` past the float range (a mean NLL above 709.78 nats: a broken model's perplexity is
    reported, not an `OverflowError`)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods of one window, and the number of predictions.

    Args:
        logits (`torch.Tensor` of shape `[S, V]`): the model's logits for the window.
        input_ids (`torch.Tensor` of shape `[S]`): the window's tokens.
    """
    nll = F.cross_entropy(logits[:-1].double(), input_ids[1:], reduction="sum")
    return nll.item(), input_ids.numel() - 1


@torch.no_grad()
def compute_perplexity(
    model,
    tokenizer,
    text: str,
    seq_len: int = 512,
    max_tokens: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> dict:
    """Perplexity of `model` on `text` over non-overlapping windows (see the module docstring).

    Args:
        model (`PreTrainedModel`): a causal LM.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        text (`str`): the evaluation text.
        seq_len (`int`, *optional*, defaults to 512): window length in tokens.
        max_tokens (`int`, *optional*): use only the first `max_tokens` tokens of the text.
        batch_size (`int`, *optional*, defaults to 4): windows per forward pass (full windows only).
        progress (`bool`, *optional*, defaults to `True`): show a progress bar.

    Returns:
        `dict` with `ppl`, `nll` (mean, nats), `tokens` (predictions scored) and `seq_len`.

    Example:
        ```python
        >>> from hf_accel.loading import load_model_and_tokenizer
        >>> model, tokenizer = load_model_and_tokenizer("smollm2-135m")
        >>> compute_perplexity(model, tokenizer, open("tinyshakespeare.txt").read(), max_tokens=4096)["ppl"]
        ```
    """
    if max_tokens is not None and max_tokens <= 0:  # a negative slice would silently drop the text's last tokens
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    input_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if max_tokens is not None:
        input_ids = input_ids[:max_tokens]
    windows = split_windows(input_ids, seq_len)
    if not windows:
        raise ValueError(f"the text has {input_ids.numel()} tokens: too short for a perplexity")
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    # Full windows are batched; a shorter last window runs alone, so no padding is ever scored.
    full = [w for w in windows if w.numel() == seq_len]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[w] for w in windows if w.numel() != seq_len]
    for group in progress_bar(groups, progress, desc="perplexity", unit="batch"):
        batch = torch.stack(group).to(device)  # [b, S]
        logits = model(input_ids=batch, use_cache=False).logits.float()  # [b, S, V]
        for row_logits, row_ids in zip(logits, batch):
            nll, count = window_nll(row_logits, row_ids)
            total_nll += nll
            total_tokens += count
    mean_nll = total_nll / total_tokens
    return {"ppl": nll_to_ppl(mean_nll), "nll": mean_nll, "tokens": total_tokens, "seq_len": seq_len}


@torch.no_grad()
def row_nlls(model, input_ids: torch.Tensor, batch_size: int = 4, skip: int = 0) -> torch.Tensor:
    """Summed next-token negative log-likelihood of each row of token ids (float64, `[N]`), each row scored alone
    with no padding, the first `skip` predictions of each row left out."""
    if not 0 <= skip < input_ids.shape[1] - 1:
        raise ValueError(f"skip must be in [0, {input_ids.shape[1] - 1}), got {skip}")
    device = next(model.parameters()).device
    sums = []
    for start in range(0, len(input_ids), batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()[:, skip:-1]
        targets = ids[:, skip + 1 :]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1), reduction="none")
        sums.append(nll.reshape(targets.shape).sum(-1).cpu())  # [b·S, V]: 2× faster on CPU than [b, V, S]
    return torch.cat(sums)


def perplexity_on_ids(model, input_ids: torch.Tensor, batch_size: int = 4, skip: int = 0) -> float:
    """Perplexity over rows of token ids (each row scored alone, no padding), leaving the first `skip` predictions
    of each row unscored."""
    nlls = row_nlls(model, input_ids, batch_size, skip)
    return nll_to_ppl(nlls.sum().item() / (nlls.numel() * (input_ids.shape[1] - 1 - skip)))


def paired_nll_difference(
    baseline: torch.Tensor, other: torch.Tensor, tokens_per_row: int, samples: int = 10_000, seed: int = 0
) -> dict:
    """
    Mean per-token NLL difference `other − baseline` over the same rows, with a 95 % paired bootstrap interval.

    Two models scored on the same rows differ far less from row to row than either model's perplexity does, so the
    rows are resampled in pairs (with replacement, `samples` times, numpy's generator seeded with `seed`) and the
    interval is the 2.5th and 97.5th percentiles of the resampled means. A negative difference favours `other`;
    `exp(difference)` is the perplexity ratio `other / baseline`.

    Args:
        baseline, other (`torch.Tensor` of shape `[N]`): summed NLL of each row ([`row_nlls`]) under two models.
        tokens_per_row (`int`): predictions scored in each row.

    Returns:
        `dict` with `nats_per_token`, `low`, `high` (the interval) and `rows`.
    """
    if baseline.shape != other.shape or baseline.ndim != 1 or not len(baseline):
        raise ValueError(
            f"need two [N] tensors of the same rows, got {tuple(baseline.shape)} and {tuple(other.shape)}"
        )
    per_token = ((other.double() - baseline.double()) / tokens_per_row).numpy()
    picks = np.random.default_rng(seed).integers(0, len(per_token), size=(samples, len(per_token)))
    low, high = np.percentile(per_token[picks].mean(axis=1), [2.5, 97.5])
    return {"nats_per_token": float(per_token.mean()), "low": float(low), "high": float(high), "rows": len(per_token)}


@torch.no_grad()
def decoding_perplexity(model, input_ids: torch.Tensor, skip: int = 0, batch_size: int = 16) -> float:
    """Perplexity of rows of token ids scored by teacher-forced decoding: one token per forward pass, each read back
    from the model's own cache, as `generate` reads it. A prefill ([`perplexity_on_ids`]) must give the same, cache
    tricks included (Palu's full-precision window); the tests hold one against the other.

    Args:
        model (`PreTrainedModel`): a causal LM with a cache.
        input_ids (`torch.Tensor` of shape `[N, S]`): rows scored on their own (no padding).
        skip (`int`, *optional*, defaults to 0): leave the first `skip` predictions of each row unscored.
        batch_size (`int`, *optional*, defaults to 16): rows decoded together.
    """
    if not 0 <= skip < input_ids.shape[1] - 1:
        raise ValueError(f"skip must be in [0, {input_ids.shape[1] - 1}), got {skip}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(input_ids), batch_size):
        rows, cache = input_ids[start : start + batch_size].to(device), None
        for t in range(rows.shape[1] - 1):
            out = model(input_ids=rows[:, t : t + 1], **{CACHE_NAME: cache}, use_cache=True)
            cache = out[CACHE_NAME]
            if t >= skip:  # the prediction of token t + 1
                total += F.cross_entropy(out.logits[:, -1].double(), rows[:, t + 1], reduction="sum").item()
                count += len(rows)
    return nll_to_ppl(total / count)


def read_eval_text(path: str | None = None, dataset: str | None = None, split: str = "test", column: str = "text"):
    """Reads evaluation text from a plain text file (WikiText raw style) or a `datasets` dataset.

    Args:
        path (`str`, *optional*): a UTF-8 text file (a byte order mark at its start is left out).
        dataset (`str`, *optional*): a dataset saved with `save_to_disk`, a local data file/dir, or a Hub id (needs
            network or a populated cache).
        split (`str`, *optional*, defaults to `"test"`): the dataset split.
        column (`str`, *optional*, defaults to `"text"`): the text column; rows are joined with newlines.
    """
    if (path is None) == (dataset is None):
        raise ValueError("give exactly one of a text file (--text) or a dataset (--dataset)")
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"text file {'is a directory' if file.is_dir() else 'not found'}: {path}")
        from ..training.data import read_text_file

        text = read_text_file(path, what="evaluation text file")
    else:
        from ..loading import load_dataset_split

        values = [v for v in load_dataset_split(dataset, split, column=column)[column] if v is not None]
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"dataset {dataset!r} column {column!r} holds values that are not text")
        text = "\n".join(values)
    if not text.strip():
        raise ValueError(f"the evaluation text from {path or dataset!r} is empty")
    return text
