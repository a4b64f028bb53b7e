"""The generation benchmark: every method on the same prompts, in one process, side by side.

Methods: `vanilla` (plain `generate`), `pld` (transformers' prompt lookup, `prompt_lookup_num_tokens`), and
`<drafter>[:<artifact>]` for hf-accel drafters, run through `model.generate(custom_generate=...)`.

Measurement rules (DESIGN.md, "Measuring"): one warm-up generation per method, excluded; prompts batched in order,
across categories, so every batch but the last is full; at batch 1 per-category times are exact, at batch > 1 each
batch's wall time, accepted tokens and passes are split among its categories by their share of the batch's generated
tokens (per-category figures are then estimates; the totals are exact); `tokens_per_s` = generated tokens (up to and
including EOS) / wall time; `speedup` = tokens_per_s / vanilla's in the same run; `mean_accepted` = tokens produced
per target forward pass after the prefill, per row, bonus token included (vanilla is 1 by construction; drafters
report the engine's per-row histogram); `target_passes` = forward calls of the target, prefills included (at batch > 1
a pass serves every active row, so the batch's slowest row sets this count); `prefill_seconds` = wall time of the
prefills (the first forward call of each `generate` call, which for `pld`, transformers' assisted loop, also verifies
its first draft; hf-accel's engine reports its own, which may be several passes: `speculative/prefill.py`);
`decode_speedup` = tokens per second of the wall time after the prefills, against vanilla's (it leaves out the engine's
grouped prefill, which computes less padding than `generate`'s);
`identical` = every greedy output equals vanilla's token for token (None when sampling).
"""

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..log import progress_bar
from .prompts import BenchPrompt, encode_prompts


@dataclass
class MethodRun:
    """What one method produced on the whole prompt set."""

    outputs: dict = field(default_factory=dict)  # question_id -> list[int] of generated tokens
    seconds: dict = field(default_factory=lambda: defaultdict(float))  # category -> wall time
    prefill_seconds: dict = field(default_factory=lambda: defaultdict(float))  # category -> the prefills' part
    # category -> tokens committed by target passes after the prefill, and the (row, pass) pairs that made them
    accepted: dict = field(default_factory=lambda: defaultdict(float))
    row_passes: dict = field(default_factory=lambda: defaultdict(float))
    target_passes: dict = field(default_factory=lambda: defaultdict(float))  # category -> target forward calls
    note: str | None = None


class _ForwardCounter:
    """Counts forward calls of the target model and times the first one since `calls` was reset, the prefill of a
    decoding loop that prefills in one pass (forward hooks; works for any decoding loop)."""

    def __init__(self, model):
        self.calls, self.first_seconds, self._start = 0, 0.0, 0.0
        self._handles = [model.register_forward_pre_hook(self._pre_hook), model.register_forward_hook(self._hook)]

    def _pre_hook(self, *_):
        self._start = time.perf_counter()

    def _hook(self, *_):
        if self.calls == 0:
            self.first_seconds = time.perf_counter() - self._start
        self.calls += 1

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _trim(row: torch.Tensor, eos_ids: set[int], pad_id: int | None) -> list[int]:
    """Generated tokens of one row up to and including the first EOS (padding after it dropped)."""
    tokens = row.tolist()
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    if pad_id is not None and pad_id not in eos_ids:
        while tokens and tokens[-1] == pad_id:
            tokens.pop()
    return tokens


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _batches(prompts: list[BenchPrompt], batch_size: int) -> list[list[BenchPrompt]]:
    """Consecutive full batches in prompt order, across categories (a set with 2 prompts per category still runs at
    the batch size asked for)."""
    return [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]


def _shares(batch: list[BenchPrompt], rows: list[list[int]]) -> dict[str, float]:
    """Each category's share of a batch: its rows' generated tokens over the batch's (1.0 for a batch of one)."""
    weights = [max(len(row), 1) for row in rows]
    shares = defaultdict(float)
    for p, w in zip(batch, weights):
        shares[p.category] += w / sum(weights)
    return shares


def check_method_names(methods: list[str]) -> None:
    """Raises `ValueError` for a method that is neither a baseline (`vanilla`, `pld`) nor a registered drafter, before
    anything is loaded."""
    from ..speculative.drafters import available_drafters

    for method in methods:
        name = method.partition(":")[0]
        if name in ("vanilla", "pld") and method != name:
            raise ValueError(f"method {name!r} takes no ':' argument, got {method!r} (pld's window is --pld-tokens)")
        if name not in ("vanilla", "pld", *available_drafters()):
            raise ValueError(
                f"unknown method {method!r}; use vanilla, pld or a drafter: {', '.join(available_drafters())}"
            )


def _method_kwargs(method: str, model, tokenizer, pld_tokens: int) -> tuple[dict, bool]:
    """`generate` keyword arguments for a method, and whether it supports batch > 1."""
    if method == "vanilla":
        return {}, True
    if method == "pld":
        # transformers' assisted generation (prompt lookup included) refuses batch > 1.
        return {"prompt_lookup_num_tokens": pld_tokens}, False
    from ..speculative import custom_generate
    from ..speculative.drafters import build_drafter

    name, _, artifact = method.partition(":")
    drafter = build_drafter(name, artifact or None, model, tokenizer)
    return {"custom_generate": custom_generate, "drafter": drafter}, True


def run_method(
    method: str,
    model,
    tokenizer,
    prompts: list[BenchPrompt],
    batch_size: int,
    generate_kwargs: dict,
    *,
    extra: dict,
    batched: bool,
    seed: int = 0,
) -> MethodRun:
    """Runs one method (`generate` keyword arguments `extra`; `batched`: whether it takes batch > 1) over all prompts,
    after a warm-up, and records outputs, times and target passes."""
    run = MethodRun()
    if batch_size > 1 and not batched:
        run.note = f"{method} supports batch 1 only; it ran row by row"
    step = batch_size if batched else 1
    eos, pad = _eos_ids(model), tokenizer.pad_token_id
    _generate(model, tokenizer, prompts[:1], {**generate_kwargs, "max_new_tokens": 8}, extra)  # warm-up
    torch.manual_seed(seed)
    counter = _ForwardCounter(model)
    try:
        batches = _batches(prompts, step)
        for batch in progress_bar(batches, desc=method, unit="batch", leave=False):
            counter.calls = 0
            start = time.perf_counter()
            new_tokens = _generate(model, tokenizer, batch, generate_kwargs, extra)
            seconds = time.perf_counter() - start
            rows = [_trim(row, eos, pad) for row in new_tokens]
            for p, row in zip(batch, rows):
                run.outputs[p.question_id] = row
            stats = getattr(extra.get("drafter"), "last_stats", None)  # the engine's, for hf-accel drafters
            accepted, row_passes = _acceptance(method, stats, rows, counter.calls)
            prefill = stats.prefill_time_s if stats is not None else counter.first_seconds  # perhaps several passes
            for category, share in _shares(batch, rows).items():
                run.seconds[category] += share * seconds
                run.prefill_seconds[category] += share * prefill
                run.accepted[category] += share * accepted
                run.row_passes[category] += share * row_passes
                run.target_passes[category] += share * counter.calls
    finally:
        counter.remove()
    return run


def _acceptance(method: str, stats, rows: list[list[int]], target_calls: int) -> tuple[int, int]:
    """(tokens committed after the prefill, (row, pass) pairs) of one `generate` call, from the engine's `stats` if
    the method ran in it (else `None`); the first token of each row comes from the prefill and is not counted."""
    if stats is not None:  # the engine's own per-row histogram, bonus included
        return sum(k * v for k, v in stats.accepted_histogram.items()), sum(stats.accepted_histogram.values())
    after_prefill = sum(max(len(r) - 1, 0) for r in rows)
    if method == "vanilla":  # one token per active row per pass, by construction
        return after_prefill, after_prefill
    if len(rows) != 1:
        raise AssertionError(f"{method} ran with {len(rows)} rows but has no per-row statistics")
    return after_prefill, max(target_calls - 1, 0)


def _generate(model, tokenizer, prompts: list[BenchPrompt], generate_kwargs: dict, extra: dict) -> torch.Tensor:
    inputs, pad_token_id = encode_prompts(tokenizer, prompts)
    out = model.generate(**inputs.to(model.device), **generate_kwargs, **extra, pad_token_id=pad_token_id)
    return out[:, inputs["input_ids"].shape[1] :]


def summarize(runs: dict[str, MethodRun], prompts: list[BenchPrompt], do_sample: bool) -> dict:
    """Per-method and per-category figures, in the JSON layout of DESIGN.md ("JSON outputs")."""
    categories = sorted({p.category for p in prompts})
    ids_by_cat = {c: [p.question_id for p in prompts if p.category == c] for c in categories}
    vanilla = runs.get("vanilla")

    def figures(run: MethodRun, cats: list[str]) -> dict:
        ids = [i for c in cats for i in ids_by_cat[c]]
        tokens = sum(len(run.outputs[i]) for i in ids)
        seconds = sum(run.seconds[c] for c in cats)
        row_passes = sum(run.row_passes[c] for c in cats)
        prefill = sum(run.prefill_seconds[c] for c in cats)
        out = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "prefill_seconds": prefill,
            "mean_accepted": sum(run.accepted[c] for c in cats) / row_passes if row_passes else None,
            "target_passes": round(sum(run.target_passes[c] for c in cats)),
        }
        if vanilla is not None:
            base_tokens = sum(len(vanilla.outputs[i]) for i in ids)
            out["speedup"] = out["tokens_per_s"] / (base_tokens / sum(vanilla.seconds[c] for c in cats))
            base_decode = sum(vanilla.seconds[c] - vanilla.prefill_seconds[c] for c in cats)
            decode = seconds - prefill
            out["decode_speedup"] = (tokens / decode) / (base_tokens / base_decode) if decode and base_decode else None
        out["identical"] = (
            None if do_sample or vanilla is None else all(run.outputs[i] == vanilla.outputs[i] for i in ids)
        )
        return out

    methods = {}
    for name, run in runs.items():
        entry = figures(run, categories)
        entry["per_category"] = {c: figures(run, [c]) for c in categories}
        if run.note:
            entry["note"] = run.note
        methods[name] = entry
    return methods


def bench_generate(
    model,
    tokenizer,
    prompts: list[BenchPrompt],
    methods: list[str],
    batch_size: int = 1,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 0.7,
    pld_tokens: int = 10,
    seed: int = 0,
) -> dict:
    """Benchmarks generation methods side by side; returns the `bench generate --json` object (without `model`).

    Args:
        model (`PreTrainedModel`): the target model.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (prompts are padded on the left, with EOS if it has no
            pad token).
        prompts (`list[BenchPrompt]`): from `hf_accel.eval.prompts.load_prompts`.
        methods (`list[str]`): method names; `vanilla` is added first if missing (speedups are relative to it).
        batch_size (`int`, *optional*, defaults to 1): prompts per `generate` call.
        max_new_tokens (`int`, *optional*, defaults to 128): generation length cap.
        do_sample (`bool`, *optional*, defaults to `False`): sample (with `temperature`) instead of greedy.
        temperature (`float`, *optional*, defaults to 0.7): sampling temperature.
        pld_tokens (`int`, *optional*, defaults to 10): `prompt_lookup_num_tokens` of the `pld` method.
        seed (`int`, *optional*, defaults to 0): reseeded before each method.
    """
    if "vanilla" not in methods:
        methods = ["vanilla", *methods]
    methods = ["vanilla", *[m for m in methods if m != "vanilla"]]
    generate_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    if do_sample:
        generate_kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    else:
        generate_kwargs.update(temperature=None, top_k=None, top_p=None)
    check_method_names(methods)
    # Every drafter (and its index) is built before the first run, so that a bad one fails in a second, not after
    # the vanilla run.
    prepared = {m: _method_kwargs(m, model, tokenizer, pld_tokens) for m in methods}
    runs = {
        m: run_method(
            m,
            model,
            tokenizer,
            prompts,
            batch_size,
            generate_kwargs,
            extra=prepared[m][0],
            batched=prepared[m][1],
            seed=seed,
        )
        for m in methods
    }
    return {
        "prompts": len(prompts),
        "batch_size": batch_size,
        "do_sample": do_sample,
        "temperature": temperature if do_sample else None,
        "seed": seed,
        "pld_tokens": pld_tokens,
        "max_new_tokens": max_new_tokens,
        "engine_linear_layout_rows": _layout_rows(model),
        "methods": summarize(runs, prompts, do_sample),
    }


def _layout_rows(model) -> dict[str, list[int]]:
    """The row counts the engine's passes ran in the `(W·xᵀ)ᵀ` layout in this process, per weight shape
    (`kernels.cpu_linear`; its measurement is cached, so this reads what the runs used); `{}` where none did."""
    from ..speculative import engine

    layout = engine.verification_layout(model)
    return layout.describe() if layout is not None else {}
