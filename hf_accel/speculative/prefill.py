"""The prefill of a ragged batch without most of its padding: rows of similar prompt length run as groups.

`generate` prefills left-padded prompts in one pass over `batch × longest prompt` tokens, so in a ragged batch the
padding is computed too (39 % of the tokens of HumanEval 101–164 in batches of 8, 44 % of `chat_heldout_26`'s). On a
CPU a pass costs about its tokens plus a fixed share, the weights streamed once: on 2 cores of this project's machine,
passes of the default model over 8, 32, 128 and 256 tokens took 62, 98, 242 and 450 ms (`python scripts/pass_cost.py
--context 1 --tokens 8 32 128 256 --repeats 3 --json`), of which the output projection over every token, which a
prefill runs for the last one only, took 12, 20, 50 and 99 ms: about 40 ms plus 1.2 ms per token, so the fixed share is
worth about 32 tokens ([`PASS_OVERHEAD_TOKENS`]). The engine therefore splits a ragged batch into the
groups that minimise `Σ (overhead + rows × longest prompt)` ([`prefill_groups`]), prefills each group over its own
longest prompt (its columns of the left-padded batch), and writes the groups' cache entries into one left-padded cache:
the same slots, mask and positions as one batched prefill, so nothing after the prefill changes. On a GPU a pass
over a few thousand tokens costs about as much as one token, so padding is nearly free there: one pass, as before.

Only a plain `DynamicCache` is assembled this way (its layers hold `keys` / `values` alone: standard models, and CARE
and float-latent Palu checkpoints, whose latents sit in such layers); any other cache class (a quantized Palu cache)
gets the one batched prefill. So do models whose RoPE frequencies follow a pass's largest position (dynamic NTK,
longrope: a group of short prompts would be rotated otherwise than in the batch's one pass; the engine decides that).
"""

import torch
from transformers import DynamicCache, DynamicLayer


# What a pass's fixed cost is worth in prompt tokens, per device type; a device not named runs one batched prefill.
PASS_OVERHEAD_TOKENS = {"cpu": 32}


def prefill_groups(lengths: list[int], overhead: float) -> list[list[int]]:
    """Splits rows of prompt lengths `lengths` into groups, each prefilled in one pass over its longest prompt,
    minimising `Σ_groups (overhead + len(group) × max length in group)`.

    Some optimal split takes rows in order of length (a row moved to the group of longer ones never lowers a maximum),
    so a dynamic program over the sorted rows finds it; ties keep fewer, larger groups. Groups come in order of
    length, each in order of length.
    """
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    best = [0.0] + [float("inf")] * len(order)  # best[i]: the cheapest split of the i shortest rows
    cut = [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):  # the last group: sorted rows j..i-1, all as long as row i-1 at most
            cost = best[j] + overhead + (i - j) * lengths[order[i - 1]]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(order)
    while i:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]


def plan_prefill(model, attention_mask, position_ids, cache) -> list[list[int]] | None:
    """The row groups of a grouped prefill ([`prefill_groups`]), or `None` for one batched pass: no padding to skip,
    a device without a [`PASS_OVERHEAD_TOKENS`] entry, padding that is not on the left, `position_ids` not given per
    row, or a cache other than an empty plain `DynamicCache`."""
    overhead = PASS_OVERHEAD_TOKENS.get(model.device.type)
    if overhead is None or attention_mask is None or attention_mask.shape[0] < 2:
        return None
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, :-1] & ~mask[:, 1:]).any()):  # a real token before padding
        return None
    if position_ids is not None and (position_ids.dim() < 2 or position_ids.shape[-2] != mask.shape[0]):
        return None
    if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    groups = prefill_groups(mask.sum(-1).tolist(), overhead)
    return groups if len(groups) > 1 else None


def grouped_prefill(forward, groups, input_ids, attention_mask, position_ids, cache, hidden_layers, keep_logits):
    """Prefills `groups` of rows of a left-padded batch, one `forward(cache, **inputs)` pass each over the group's
    longest prompt, and fills the empty `cache` with every row's entries in the batch's slots (padding slots: zeros,
    masked as before).

    Returns `(logits, hidden_states)`: the last prompt token's logits `[B, 1, V]`, and the layers `hidden_layers` over
    the batch's columns `[B, L, H]` (zeros at padding), as one batched pass would give them.
    """
    batch_size, width = input_ids.shape
    lengths = attention_mask.sum(-1)
    logits, hidden, entries = None, {}, []
    for group in groups:
        rows = torch.tensor(group, device=input_ids.device)
        start = width - int(lengths[rows].max())
        inputs = {"input_ids": input_ids[rows, start:], "attention_mask": attention_mask[rows, start:]}
        inputs["position_ids"] = position_ids[..., rows, start:]
        part = DynamicCache()
        outputs = forward(part, **inputs, **({"logits_to_keep": 1} if keep_logits else {}))
        last = outputs.logits[:, -1:]
        if logits is None:
            logits = last.new_zeros((batch_size, 1, last.shape[-1]))
        logits[rows] = last
        for i in hidden_layers:
            states = outputs.hidden_states[i]
            if i not in hidden:
                hidden[i] = states.new_zeros((batch_size, width, states.shape[-1]))
            hidden[i][rows, start:] = states
        entries.append((rows, start, part))
    for index in range(len(entries[0][2].layers)):
        full = []
        for name in ("keys", "values"):
            first = getattr(entries[0][2].layers[index], name)
            tensor = first.new_zeros((batch_size, first.shape[1], width, first.shape[-1]))
            for rows, start, part in entries:
                tensor[rows, :, start:] = getattr(part.layers[index], name)
            full.append(tensor)
        cache.update(*full, index)
    return logits, hidden
