"""SDPA for grouped-query attention over a few masked queries, without copying the cache once per query head.

transformers' `sdpa` attention serves grouped-query attention (fewer KV heads than query heads) in one of three ways:
`enable_gqa` where the device's kernels take it with the mask given, the query heads packed onto their KV head for a
single query token (`pack_gqa`), and otherwise `repeat_kv`, which copies the layer's whole cached keys and values once
per query head of their group. A verification pass has several queries and a 4D tree mask, so it took the copy: on the
default model (3 KV heads, 3 query heads each) at batch 8 with about 350 cached tokens, 2 × 6.5 MB per layer and pass.

[`packed_gqa_sdpa`] packs several queries too: the `q` queries of the `n_rep` heads that share a KV head become
`n_rep · q` queries of that head, with the mask's rows repeated alike (one mask serves every head), and the output is
unpacked. Each query meets the same keys, mask row and scale, so the scores and softmax are the same per query; only
the kernel's blocking may round differently. [`packed_gqa_attention`] installs it as `sdpa` while the engine's passes
run, for the thread running them: plain `generate`, in that thread or another, is untouched. On 2 cores of this project's CPU, batch-8 passes over 300 cached tokens and 2, 3
and 4 tokens per row took 81.8, 109.5 and 116.8 ms with it against 94.9, 118.2 and 125.5 ms without (`python
scripts/probe_engine_parts.py transposed-layout[,no-gqa-packing] scripts/pass_cost.py --batch-size 8 --tokens 1 2 3 4
--repeats 5 --json`).
"""

import contextlib
import functools
import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


MAX_PACKED_QUERIES = 128  # more queries (a prefill) keep the copy: the repeated mask would outgrow it
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")  # the fallback's to refuse or add

_LOCK = threading.Lock()
_INSTALLED = {"count": 0, "wrapper": None, "had_local": False}  # open entries; what the first one installed over
_THREAD = threading.local()  # `depth`: the entries open in this thread


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, *, fallback,
                    **kwargs):  # fmt: skip
    """transformers' attention-function signature: `query` `[B, H, q, d]`, `key` / `value` `[B, H_kv, S, d]`,
    `attention_mask` `[B, 1, q, S]`; returns `([B, q, H, d], None)`. Calls `fallback` (the `sdpa` function it
    replaces) for anything else: one query, no KV groups, a per-head or missing mask, dropout, more than
    [`MAX_PACKED_QUERIES`] queries, or options the packing does not handle."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, queries, _ = query.shape
    if (
        groups == 1
        or not 1 < queries <= MAX_PACKED_QUERIES
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout
        or any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _UNSUPPORTED)
    ):
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)  # fmt: skip
    # head h = kv_head · groups + r reads KV head h // groups (`repeat_kv`'s order); packed row r · q + i is head r's
    # query i, whose mask row is i
    packed = query.reshape(batch, heads // groups, groups * queries, query.shape[-1])
    mask = attention_mask.expand(batch, 1, queries, attention_mask.shape[-1]).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, queries, value.shape[-1]).transpose(1, 2).contiguous(), None


def _packing(*args, fallback, **kwargs):
    """The `sdpa` function while installed: packed in threads inside an engine pass, `fallback` in any other."""
    if getattr(_THREAD, "depth", 0):
        return packed_gqa_sdpa(*args, fallback=fallback, **kwargs)
    return fallback(*args, **kwargs)


@contextlib.contextmanager
def packed_gqa_attention():
    """While entered, transformers' own `sdpa` attention runs as [`packed_gqa_sdpa`] in the entering thread; other
    threads' calls go to it unchanged. Entries may nest and come from several threads: the registration is made by the
    first and restored by the last. A user's own registered `sdpa` function is left alone (it is never bypassed), and
    one registered while an entry is open is kept."""
    with _LOCK:
        if _INSTALLED["count"] == 0:
            _INSTALLED["wrapper"] = None
            if ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward:  # a local entry, if any, is that function
                _INSTALLED["had_local"] = "sdpa" in getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
                _INSTALLED["wrapper"] = functools.partial(_packing, fallback=sdpa_attention_forward)
                ALL_ATTENTION_FUNCTIONS["sdpa"] = _INSTALLED["wrapper"]
        _INSTALLED["count"] += 1
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1
        with _LOCK:
            _INSTALLED["count"] -= 1
            wrapper = _INSTALLED["wrapper"]
            local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
            if _INSTALLED["count"] == 0 and wrapper is not None and local.get("sdpa") is wrapper:  # not replaced since
                if _INSTALLED["had_local"]:
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
                else:
                    del ALL_ATTENTION_FUNCTIONS["sdpa"]
