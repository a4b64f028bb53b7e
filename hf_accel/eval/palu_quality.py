"""Quality and cache-size benchmark of Palu conversions (issue 4's README table), as a library function.

For every group size × rank allocation × kv-keep, the model is converted once with and once without the Hadamard
rotation (calibration moments and Fisher scores are collected once and shared), and each conversion is evaluated
unquantized and at every requested bit width (the bit width is a runtime setting of the converted model). Every row
reports perplexity on held-out text (and on held-out model-generated text when asked) and the **measured** cache
bytes per token: the bytes held by the cache after a short prefill, divided by the tokens cached. Float caches are
measured with the model in bfloat16 (2-byte latents, like the fp16 baseline); quantized caches hold packed codes plus
float16 scales and zero-points whatever the model dtype.

With `calib_generated_samples`, the calibration is CARE's mixed one (text windows + sequences the model sampled on
its calibration prompts), and with `care_methods` CARE conversions at the same budgets join the table, from the same
calibration statistics and scored by the same evaluation: one protocol for both converters. The held-out generated
text is sampled on the held-out prompts `EVAL_PROMPTS` (compress/calibration.py), none of which calibrates.
"""

import copy
import itertools
import json
import sys
import time
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ..log import progress_bar
from .memory import measure_cache_bytes_per_token
from .perplexity import (
    compute_perplexity,
    nll_to_ppl,
    paired_nll_difference,
    perplexity_on_ids,
    row_nlls,
    split_windows,
)


@dataclass
class PaluBenchConfig:
    group_sizes: tuple = (1, 3)
    rank_methods: tuple = ("uniform", "fisher")
    kv_keeps: tuple = (0.75, 0.5)
    bits: tuple = (2, 3, 4)
    no_hadamard_bits: tuple = (2, 3, 4)  # bit widths also measured without the Hadamard rotation
    quant_group_size: int = (
        0  # latent channels per scale/zero-point (0: a group's whole latent); divides rank_multiple
    )
    calib_samples: int = 32  # text windows
    calib_generated_samples: int = 0  # + model-generated calibration sequences (CARE's mixed calibration)
    care_methods: tuple = ()  # CARE conversions at each kv-keep, same calibration and evaluation (e.g. ("care",))
    calib_seq_len: int = 256
    fisher_samples: int = 8
    rank_multiple: int = 8
    eval_tokens: int = 8192
    eval_seq_len: int = 256
    generated_samples: int = 0  # held-out model-generated sequences (0: skip)
    generated_seq_len: int = 256
    # Full-precision windows of recent tokens: each adds a row per quantized bit width, scored on the positions past
    # the window (the first ones have their whole context in full precision); bytes per token are measured with
    # `window_bytes_context` tokens cached, since the window is a fixed cost per sequence.
    residual_lengths: tuple = ()
    window_bytes_context: int = 2048
    seed: int = 3


def measure_palu_cache_bytes_per_token(model, input_ids: torch.Tensor) -> float:
    """Bytes the model's cache holds once filled with `input_ids` as `generate` fills it
    ([`measure_cache_bytes_per_token`]), per cached token (batch × length), with the model in bfloat16: float latents
    and a quantized cache's full-precision window take 2 bytes (the fp16 reference of the issue's targets); packed
    codes, float16 scales and zero-points do not depend on it."""
    from ..models.modeling_palu import make_palu_cache

    measured = copy.deepcopy(model).to(torch.bfloat16)
    cache = make_palu_cache(measured.config) if hasattr(model.config, "palu_k_ranks") else None
    return measure_cache_bytes_per_token(measured, input_ids, cache)


def _evaluate(model, tokenizer, held_out: str, generated, config: PaluBenchConfig, probe_ids) -> dict:
    start = time.perf_counter()
    row = {
        "ppl_text": compute_perplexity(
            model, tokenizer, held_out, seq_len=config.eval_seq_len, max_tokens=config.eval_tokens, progress=False
        )["ppl"]
    }
    if generated is not None:
        row["ppl_generated"] = perplexity_on_ids(model, generated)
    row["cache_bytes_per_token"] = measure_palu_cache_bytes_per_token(model, probe_ids)
    row["eval_s"] = round(time.perf_counter() - start, 1)
    return row


def fisher_rows(ids: torch.Tensor, config: PaluBenchConfig) -> torch.Tensor:
    """The `fisher_samples` calibration rows that give the Fisher scores: half text windows, half generated sequences
    (the first rows of each kind), the other kind filling in where one has fewer rows. `ids` holds the text windows
    first, then the generated sequences (`mixed_calibration_ids`)."""
    num_text = len(ids) - config.calib_generated_samples
    generated = min(config.fisher_samples // 2, config.calib_generated_samples)
    text = min(config.fisher_samples - generated, num_text)
    generated = min(config.fisher_samples - text, config.calib_generated_samples)
    return torch.cat([ids[:text], ids[num_text:][:generated]])


def _check_residual_lengths(config: PaluBenchConfig) -> None:
    """Windows must leave predictions to score in every evaluation row (checked before anything runs)."""
    shortest = min([config.eval_seq_len] + ([config.generated_seq_len] if config.generated_samples else []))
    bad = [r for r in config.residual_lengths if not 0 < r < shortest - 1]
    if bad:
        raise ValueError(
            f"residual_lengths {bad} must be in [1, {shortest - 2}]: rows of {shortest} tokens are scored past the window"
        )


def _check_conversions(config: PaluBenchConfig) -> None:
    """Every conversion and bit width of the grid is a valid one (checked before anything runs: a bad value would
    otherwise fail after the calibration, or after hours of earlier rows, with nothing reported)."""
    from ..compress.care import CareConversionConfig
    from ..compress.palu import PaluConversionConfig

    for group_size, ranks, kv_keep in itertools.product(config.group_sizes, config.rank_methods, config.kv_keeps):
        for bits in sorted({0, *config.bits, *config.no_hadamard_bits}):
            PaluConversionConfig(
                kv_keep=kv_keep, group_size=group_size, ranks=ranks, quant_bits=bits,
                rank_multiple=config.rank_multiple, quant_group_size=config.quant_group_size,
            )  # fmt: skip
    for method, kv_keep in itertools.product(config.care_methods, config.kv_keeps):
        CareConversionConfig(kv_keep=kv_keep, method=method)


def _full_windows(tokenizer, text: str, config: PaluBenchConfig) -> torch.Tensor:
    """`[N, eval_seq_len]` token windows of the held-out text (full windows only: they are scored as a batch), for the
    windowed rows and the rank comparison."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])[: config.eval_tokens]
    windows = [w for w in split_windows(ids, config.eval_seq_len) if len(w) == config.eval_seq_len]
    if not windows:
        raise ValueError(f"the held-out text has no full window of {config.eval_seq_len} tokens to score row by row")
    return torch.stack(windows)


def _evaluate_windowed(model, text_rows, generated, residual: int, long_probe, reference: dict) -> dict:
    """A quantized row with a full-precision window: perplexity past the window (a prefill reads each position as
    decoding does, see `kernels/cache.py`), next to the unquantized model's on the same positions (`reference`), and
    bytes per token at `long_probe`'s length."""
    start = time.perf_counter()
    row = {"residual_length": residual, "ppl_text": perplexity_on_ids(model, text_rows, skip=residual)}
    if generated is not None:
        row["ppl_generated"] = perplexity_on_ids(model, generated, skip=residual)
    row.update({f"float_{k}": v for k, v in reference.items()})
    row["cache_bytes_per_token"] = measure_palu_cache_bytes_per_token(model, long_probe)
    row["bytes_context"] = long_probe.shape[1]
    row["eval_s"] = round(time.perf_counter() - start, 1)
    return row


def _windowed_rows(model, palu, bits_list, config, text_rows, generated, long_probe, common) -> list[dict]:
    """Rows of [`_evaluate_windowed`] for every window of `config.residual_lengths` and quantized bit width, each
    starting with `common` (the conversion). Beside each: the unquantized Palu model's perplexity (`float_*`) and
    the original `model`'s (`float_base_*`) on the same positions."""
    rows = []
    for residual in config.residual_lengths:
        palu.config.palu_quant_bits, palu.config.palu_residual_length = 0, 0
        reference = {}
        for prefix, scored in (("", palu), ("base_", model)):
            reference[f"{prefix}ppl_text"] = perplexity_on_ids(scored, text_rows, skip=residual)
            if generated is not None:
                reference[f"{prefix}ppl_generated"] = perplexity_on_ids(scored, generated, skip=residual)
        for bits in [b for b in bits_list if b]:
            palu.config.palu_quant_bits, palu.config.palu_residual_length = bits, residual
            row = {**common, "bits": bits, "quant_group_size": config.quant_group_size}
            rows.append({**row, **_evaluate_windowed(palu, text_rows, generated, residual, long_probe, reference)})
    palu.config.palu_residual_length = 0
    return rows


def _calibrate(model, tokenizer, calibration_text: str, config: PaluBenchConfig, with_output_grads: bool, progress):
    """What every row shares: the calibration ids (text windows, then generated sequences), their moments, the Fisher
    scores, the held-out generated rows (or `None`) and the timings of each step."""
    from ..compress.calibration import (
        EVAL_PROMPTS,
        collect_kv_calibration,
        generate_calibration_ids,
        mixed_calibration_ids,
    )
    from ..compress.fisher import collect_fisher_scores

    timings = {}
    start = time.perf_counter()
    ids = mixed_calibration_ids(
        model, tokenizer, calibration_text, config.calib_samples, config.calib_generated_samples,
        config.calib_seq_len, seed=config.seed,
    )  # fmt: skip
    calibration = collect_kv_calibration(model, ids, with_output_grads=with_output_grads, progress=progress)
    timings["calibration_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    fisher = collect_fisher_scores(model, fisher_rows(ids, config), progress=progress)
    timings["fisher_s"] = round(time.perf_counter() - start, 1)
    generated = None
    if config.generated_samples:
        start = time.perf_counter()
        # held-out prompts and a seed unlike the calibration's: held-out samples of the model's own text
        generated = generate_calibration_ids(
            model,
            tokenizer,
            config.generated_samples,
            config.generated_seq_len,
            seed=config.seed + 1000,
            prompts=EVAL_PROMPTS,
            progress=progress,
        )
        timings["generation_s"] = round(time.perf_counter() - start, 1)
    return ids, calibration, fisher, generated, timings


def run_palu_quality_benchmark(
    model,
    tokenizer,
    calibration_text: str,
    held_out_text: str,
    config: PaluBenchConfig | None = None,
    progress: bool = True,
) -> dict:
    """
    Convert and evaluate every configuration of `config`; returns `{"base": row, "rows": [row, ...], "settings"}`.

    Args:
        model, tokenizer: the original model (float32) and its tokenizer.
        calibration_text (`str`): text for the whitening moments and Fisher scores.
        held_out_text (`str`): evaluation text, disjoint from the calibration text.
        config ([`PaluBenchConfig`], *optional*): the grid and sizes.
    """
    from ..compress.care import convert_care
    from ..compress.palu import convert_palu

    config = config or PaluBenchConfig()
    _check_residual_lengths(config)
    _check_conversions(config)
    with_output_grads = bool(config.care_methods) or "kfac" in config.rank_methods
    ids, calibration, fisher, generated, timings = _calibrate(
        model, tokenizer, calibration_text, config, with_output_grads, progress
    )
    probe_ids = ids[:2, :64]
    long_probe = ids.reshape(1, -1)[:, : config.window_bytes_context]
    text_rows = _full_windows(tokenizer, held_out_text, config) if config.residual_lengths else None
    base = _evaluate(model, tokenizer, held_out_text, generated, config, probe_ids)
    if progress:
        tqdm.write(json.dumps({"base": base, **timings}), file=sys.stderr)
    rows = []
    grid = [(g, r, k) for g in config.group_sizes for r in config.rank_methods for k in config.kv_keeps]
    for group_size, ranks, kv_keep in progress_bar(grid, progress, desc="palu configs"):
        for hadamard in (True, False):
            bits_list = ([0] if hadamard else []) + list(config.bits if hadamard else config.no_hadamard_bits)
            if not bits_list:
                continue
            palu, info = convert_palu(
                model,
                tokenizer,
                kv_keep=kv_keep,
                group_size=group_size,
                ranks=ranks,
                hadamard=hadamard,
                calibration=calibration,
                fisher_scores=fisher,
                rank_multiple=config.rank_multiple,
                quant_group_size=config.quant_group_size,
                progress=False,
            )

            common = {
                "converter": "palu",
                "group_size": group_size,
                "ranks": ranks,
                "kv_keep": kv_keep,
                "kv_keep_achieved": round(info["kv_keep_achieved"], 4),
                "hadamard": hadamard,
            }
            for bits in bits_list:
                palu.config.palu_quant_bits = bits  # a runtime setting: same factors, other cache
                row = {**common, "bits": bits, "quant_group_size": config.quant_group_size if bits else None}
                row.update(_evaluate(palu, tokenizer, held_out_text, generated, config, probe_ids))
                rows.append(row)
                if progress:
                    tqdm.write(json.dumps(row), file=sys.stderr)
            for row in _windowed_rows(model, palu, bits_list, config, text_rows, generated, long_probe, common):
                rows.append(row)
                if progress:
                    tqdm.write(json.dumps(row), file=sys.stderr)
    for method in progress_bar(config.care_methods, progress, desc="care configs"):
        for kv_keep in config.kv_keeps:
            care = convert_care(
                model, tokenizer, kv_keep=kv_keep, method=method, calibration=calibration, progress=False
            )
            row = {"converter": "care", "group_size": None, "ranks": method, "kv_keep": kv_keep}
            row.update(hadamard=False, bits=0)
            row.update(_evaluate(care, tokenizer, held_out_text, generated, config, probe_ids))
            rows.append(row)
            if progress:
                tqdm.write(json.dumps(row), file=sys.stderr)
    return {"base": base, "rows": rows, "timings": timings, "settings": dict(vars(config))}


def compare_rank_methods(
    model,
    tokenizer,
    calibration_text: str,
    held_out_text: str,
    config: PaluBenchConfig | None = None,
    progress: bool = True,
) -> dict:
    """
    Rank allocations against `uniform`, row by row: is one better than the other beyond the evaluation's noise?

    For every group size × kv-keep of `config`, each rank method converts the model with float latents (the same
    calibration and Fisher scores for all) and is scored on four sets of rows: the held-out text's full windows
    (up to `eval_tokens`; a shorter last window is left out, unlike the grid's `ppl_text`), the held-out generated
    sequences, and in sample the calibration rows themselves (what the allocation saw), text windows and generated
    sequences apart. Each non-uniform method is compared with the uniform conversion of the same cell on the
    same rows: mean per-token NLL difference and its 95 % paired bootstrap interval ([`paired_nll_difference`]).
    `config.bits` and the windows are not used.

    Returns:
        `dict` with `base` (the original's perplexities), `rows` (one per conversion: `group_size`, `kv_keep`,
        `ranks`, `k_ranks`, `v_ranks`, `ppl_<set>` for each set (`text`, `generated`, `calibration_text`,
        `calibration_generated`) and, except for uniform rows, `vs_uniform[set]`), `timings` and `settings`.
    """
    from ..compress.palu import convert_palu

    config = config or PaluBenchConfig()
    if "uniform" not in config.rank_methods or not config.generated_samples:
        raise ValueError("a rank comparison needs 'uniform' among the rank methods and held-out generated samples")
    _check_conversions(replace(config, bits=(), no_hadamard_bits=()))  # float latents only
    ids, calibration, fisher, generated, timings = _calibrate(
        model, tokenizer, calibration_text, config, "kfac" in config.rank_methods, progress
    )
    num_text = len(ids) - config.calib_generated_samples
    sets = {"text": _full_windows(tokenizer, held_out_text, config), "generated": generated}
    sets.update(calibration_text=ids[:num_text], calibration_generated=ids[num_text:])
    sets = {name: rows for name, rows in sets.items() if len(rows)}  # text-only calibration: no generated rows

    def score(scored) -> tuple[dict, dict]:
        nlls = {name: row_nlls(scored, rows) for name, rows in sets.items()}
        ppl = {f"ppl_{name}": nll_to_ppl(v.sum().item() / sets[name][:, 1:].numel()) for name, v in nlls.items()}
        return ppl, nlls

    base, _ = score(model)
    rows = []
    grid = [(g, k, r) for g in config.group_sizes for k in config.kv_keeps for r in config.rank_methods]
    uniform = {}
    for group_size, kv_keep, ranks in progress_bar(grid, progress, desc="rank methods"):
        palu, info = convert_palu(
            model, tokenizer, kv_keep=kv_keep, group_size=group_size, ranks=ranks, calibration=calibration,
            fisher_scores=fisher, rank_multiple=config.rank_multiple, progress=False,
        )  # fmt: skip
        ppl, nlls = score(palu)
        row = {"group_size": group_size, "kv_keep": kv_keep, "ranks": ranks, **ppl}
        row.update(k_ranks=info["k_ranks"], v_ranks=info["v_ranks"])
        if ranks == "uniform":
            uniform[group_size, kv_keep] = nlls
        rows.append((row, nlls))
    for row, nlls in rows:
        if row["ranks"] != "uniform":
            reference = uniform[row["group_size"], row["kv_keep"]]
            row["vs_uniform"] = {
                name: paired_nll_difference(reference[name], nlls[name], sets[name].shape[1] - 1, seed=config.seed)
                for name in sets
            }
    return {"base": base, "rows": [row for row, _ in rows], "timings": timings, "settings": dict(vars(config))}


def format_rank_comparison(report: dict) -> str:
    """A Markdown table of [`compare_rank_methods`]'s report: perplexities, and each method's NLL difference from
    uniform in nats per token with its 95 % interval (negative: better than uniform; bold: beyond the noise)."""
    names = [k[4:] for k in report["base"] if k.startswith("ppl_")]
    head = "| gs | kv-keep | ranks | " + " | ".join(f"{n.replace('_', ' ')} ppl | vs uniform" for n in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def signed(x: float) -> str:
        return f"{x:+.3f}".replace("-", "−")

    for r in report["rows"]:
        cells = []
        for n in names:
            d = r.get("vs_uniform", {}).get(n)
            mean = d and (f"**{signed(d['nats_per_token'])}**" if d["high"] < 0 else signed(d["nats_per_token"]))
            diff = f"{mean} [{signed(d['low'])}, {signed(d['high'])}]" if d else ""
            cells.append(f"{r[f'ppl_{n}']:.2f} | {diff}")
        lines.append(f"| {r['group_size']} | {r['kv_keep']} | {r['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_palu_table(report: dict) -> str:
    """A Markdown table of [`run_palu_quality_benchmark`]'s report."""
    base = report["base"]
    has_gen = "ppl_generated" in base
    head = "| gs | ranks | kv-keep | WHT | bits | ppl text | ×orig |" + (" ppl generated | ×orig |" if has_gen else "")
    head += " cache B/token | ×fp16 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def fmt(r):  # a windowed row is scored past its window: ×orig against the original on those positions
        ratio = lambda key: r[key] / r.get(f"float_base_{key}", base[key])
        return (
            f" {r['ppl_text']:.2f} | {ratio('ppl_text'):.3f} |"
            + (f" {r['ppl_generated']:.2f} | {ratio('ppl_generated'):.3f} |" if has_gen else "")
            + f" {r['cache_bytes_per_token']:.0f} | {r['cache_bytes_per_token'] / base['cache_bytes_per_token']:.4f} |"
        )

    lines.append("| original | | 1.0 | | 16 |" + fmt(base))
    for r in report["rows"]:
        wht = "yes" if r["hadamard"] else "no"
        bits = (
            f"{r['bits']} (g{r['quant_group_size']})" if r["bits"] and r.get("quant_group_size") else r["bits"] or 16
        )
        if r.get("residual_length"):  # scored past the window: the float model's ppl on those positions beside it
            floats = " / ".join(f"{r[k]:.2f}" for k in ("float_ppl_text", "float_ppl_generated") if k in r)
            bits = f"{bits} + {r['residual_length']} fp (float there: {floats}; bytes at {r['bytes_context']} tokens)"
        gs = "CARE" if r.get("converter") == "care" else r["group_size"]
        lines.append(f"| {gs} | {r['ranks']} | {r['kv_keep']} | {wht} | {bits} |" + fmt(r))
    return "\n".join(lines)
