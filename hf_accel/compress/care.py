"""CARE: convert a GQA causal LM into multi-head latent attention (MLA) that caches K/V latents.

Pipeline (spec 000, Part A): calibrate the k/v-projection input moments on the original model
([`collect_kv_calibration`]), factorize every K and V projection with a covariance-weighted SVD
([`whitened_factorize`]), allocate per-matrix ranks under a KV-cache budget ([`allocate_ranks`]), and build a
`Care*ForCausalLM` ([`build_care_model`]) whose cache holds `r_K + r_V` numbers per token per layer.

Methods (`method=`): `svd` (plain SVD, uniform ranks), `asvd` (diagonal activation scaling, uniform), `care-u`
(whitened SVD, uniform), `care-e-raw` (whitened SVD, the spec's water-filling on raw σ), `care-e-rel` (water-filling on
per-matrix relative energy σ²/Σσ²), and `care` (the default).

The default `care` weighs both sides of each projection: the input by `√C` (CARE's covariance) and the output by
`√G`, the root of the second moment of the loss gradient at the projection's output (one backward pass during
calibration). The SVD of `√C·W·√G` minimises the K-FAC estimate of the loss increase, and its σ² are in loss units,
so water-filling on them compares layers and K against V on one scale. The spec's raw σ (`care-e-raw`) are not
comparable across layers (issue 3's probe: it loses to uniform ranks on SmolLM2), and relative energy (`care-e-rel`)
only normalises each matrix without knowing how much the loss cares about it. Measured in the README's CARE table.
"""

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..atomic import atomic_output_dir
from ..log import progress_bar
from .calibration import KvCalibration, check_calibration_fits, collect_kv_calibration
from .export import (
    as_converted,
    check_no_adapters,
    check_rope_type,
    load_converted_state,
    plot_ranks,
    uninitialized_model,
    write_json,
)
from .factorize import asvd_scale, check_shrinkage, factorize, shrink_moment, symmetric_sqrt, whitened_factorize
from .ranks import budget_from_kv_keep, raw_sigma_gains, relative_energy_gains, uniform_ranks, water_fill


METHODS = ("care", "care-u", "care-e-raw", "care-e-rel", "svd", "asvd")
UNIFORM_RANK_METHODS = ("svd", "asvd", "care-u")  # the others water-fill
# model_type of the original → (config class, causal LM class, bare decoder class), in
# hf_accel/models/{configuration,modeling}_care.py
FAMILIES = {
    "llama": ("CareLlamaConfig", "CareLlamaForCausalLM", "CareLlamaModel"),
    "mistral": ("CareMistralConfig", "CareMistralForCausalLM", "CareMistralModel"),
    "qwen2": ("CareQwen2Config", "CareQwen2ForCausalLM", "CareQwen2Model"),
    "qwen3": ("CareQwen3Config", "CareQwen3ForCausalLM", "CareQwen3Model"),
}


@dataclass
class CareConversionConfig:
    """Options of a CARE conversion (the CLI's `convert care` flags map to these fields)."""

    kv_keep: float = field(default=0.5, metadata={"help": "Fraction of the K+V cache width kept, in (0, 1]."})
    method: str = field(default="care", metadata={"help": f"One of {', '.join(METHODS)}."})
    alpha: float = field(default=0.05, metadata={"help": "Shrinkage weight α of C_λ = (1−α)C + αλI (spec Eq. 3.8)."})
    lam_frac: float = field(default=1e-2, metadata={"help": "λ as a fraction of λ_max(C)."})
    asvd_alpha: float = field(default=0.5, metadata={"help": "ASVD exponent of the per-channel scaling."})
    absorb_value: bool = field(default=False, metadata={"help": "Fold the value up-projection into o_proj."})
    rank_floor_frac: float = field(
        default=0.0,
        metadata={
            "help": "Water-filling methods (care, care-e-raw, care-e-rel): every matrix keeps at least this fraction of "
            "its largest rank."
        },
    )

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown CARE method {self.method!r}; choose one of {', '.join(METHODS)}")
        budget_from_kv_keep([1], self.kv_keep)  # validates kv_keep
        self.kv_keep = float(self.kv_keep)  # a numpy float would not go into the saved JSON
        check_shrinkage(self.alpha, self.lam_frac)
        if not 0.0 <= self.rank_floor_frac <= self.kv_keep:  # floors above the budget: water-filling has no solution
            raise ValueError(f"rank_floor_frac must be in [0, kv_keep={self.kv_keep}], got {self.rank_floor_frac}")
        if self.rank_floor_frac and self.method in UNIFORM_RANK_METHODS:
            raise ValueError(f"rank_floor_frac applies to water-filled ranks; method {self.method!r} has uniform ones")


def model_family(model) -> str:
    """The model_type of a supported original model; raises `ValueError` for others."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"CARE does not know model family {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    check_rope_type(model.config, "CARE")
    check_no_adapters(model, "CARE")
    return model_type


def kv_weights(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer `(W_K, W_V)` in row-vector form `[D, g·d]` (`linear.weight.T`), on the CPU, where the calibration
    statistics and the factorization live (the model may be on a GPU)."""
    return [
        (layer.self_attn.k_proj.weight.detach().T.cpu(), layer.self_attn.v_proj.weight.detach().T.cpu())
        for layer in model.model.layers
    ]


def _two_sided_factors(idx, w_k, w_v, calibration: KvCalibration, config: CareConversionConfig):
    """The default method's factors: SVD of `√C_λ · W · √G_λ` for K and V of layer `idx`.

    `G` is the second moment of the loss gradient at the projection's output, so under the Kronecker-factored
    (K-FAC) approximation of the Hessian, `½‖√C (W − Ŵ) √G‖²_F` estimates the loss increase of replacing `W` by `Ŵ`.
    The truncation then minimises that estimate, and the singular values are in loss units: comparable across
    layers and between K and V, which is what water-filling needs. Raw σ of `√C·W` are not (their scale differs per
    layer and says nothing of how much the loss cares; see issue 3's probe).
    """
    if calibration.k_grad_moments is None:
        raise ValueError("method 'care' needs output-gradient moments: calibrate with with_output_grads=True")
    scale, scale_inv = symmetric_sqrt(shrink_moment(calibration.moments[idx], config.alpha, config.lam_frac))
    pair = []
    for w, grad_moment in ((w_k, calibration.k_grad_moments[idx]), (w_v, calibration.v_grad_moments[idx])):
        out_scale, out_scale_inv = symmetric_sqrt(shrink_moment(grad_moment, config.alpha, config.lam_frac))
        pair.append(factorize(w, scale, scale_inv, out_scale, out_scale_inv))
    return tuple(pair)


def factorize_kv(
    model, calibration: KvCalibration | None, method: str, config: CareConversionConfig, progress: bool = False
):
    """Full-rank factors `[(K factors, V factors)]` per layer for `method` (no truncation yet)."""
    factors = []
    for idx, (w_k, w_v) in enumerate(progress_bar(kv_weights(model), progress, desc="factorize", unit="layer")):
        if method == "svd":
            pair = (factorize(w_k), factorize(w_v))
        elif method == "asvd":
            scale = asvd_scale(calibration.abs_means[idx], config.asvd_alpha)
            pair = (factorize(w_k, scale), factorize(w_v, scale))
        elif method == "care":
            pair = _two_sided_factors(idx, w_k, w_v, calibration, config)
        else:
            moment = calibration.moments[idx]
            pair = tuple(whitened_factorize(w, moment, config.alpha, config.lam_frac) for w in (w_k, w_v))
        factors.append(pair)
    return factors


def _widths_and_caps(factors) -> tuple[list[int], list[int]]:
    """Per matrix (K, V of every layer): its cache width `g·d` and its largest rank `min(hidden, g·d)`."""
    matrices = [f for pair in factors for f in pair]
    return [f.up.shape[1] for f in matrices], [f.max_rank for f in matrices]


def allocate_ranks(
    factors, kv_keep: float, method: str, rank_floor_frac: float = 0.0, gains=None
) -> tuple[list[int], list[int]]:
    """Per-layer `(K ranks, V ranks)` under the budget `kv_keep · Σ widths` (cache widths `g·d`; at most the sum of the
    matrices' largest ranks, which is smaller when `g·d` exceeds the hidden size).

    Args:
        factors (`list[tuple[LowRankFactors, LowRankFactors]]`): per layer, the K and V factors.
        kv_keep (`float`): fraction of the K+V cache width kept, in (0, 1].
        method (`str`): uniform for `svd`, `asvd`, `care-u`; water-filling on raw σ for `care-e-raw`, on relative
            energy σ²/Σσ² for `care-e-rel`, and on `gains` (default: σ², loss units when the factors are two-sided)
            for `care`.
        rank_floor_frac (`float`, *optional*, defaults to 0): minimum rank as a fraction of each matrix's largest rank.
        gains (`list[torch.Tensor]`, *optional*): marginal gains per matrix (index `2·layer + {0: K, 1: V}`).
    """
    widths, caps = _widths_and_caps(factors)
    sigmas = [f.sigma for pair in factors for f in pair]
    if method in UNIFORM_RANK_METHODS:
        ranks = uniform_ranks(widths, kv_keep, caps)
    else:
        if method == "care-e-raw":
            gains = raw_sigma_gains(sigmas)
        elif method == "care-e-rel":
            gains = relative_energy_gains(sigmas)
        elif gains is None:
            gains = [s.double() ** 2 for s in sigmas]
        floors = [max(1, int(rank_floor_frac * c)) for c in caps]
        ranks = water_fill(gains, min(sum(caps), budget_from_kv_keep(widths, kv_keep)), caps, floors)
    return ranks[0::2], ranks[1::2]


def _validate_ranks(factors, k_ranks, v_ranks) -> None:
    for idx, ((fk, fv), rk, rv) in enumerate(zip(factors, k_ranks, v_ranks)):
        for name, f, r in (("K", fk, rk), ("V", fv, rv)):
            if not 1 <= r <= f.max_rank:
                raise ValueError(
                    f"layer {idx} {name} rank {r} is outside [1, {f.max_rank}] (the projection's width and rank)"
                )


def care_config_from(model, k_ranks, v_ranks, absorb_value: bool = False):
    """The `Care*Config` of a converted `model` (a copy of its config plus the ranks, unique `model_type`)."""
    from ..models import configuration_care

    family = model_family(model)
    config_cls = getattr(configuration_care, FAMILIES[family][0])
    config_dict = model.config.to_dict()
    # the converted weights are plain floats: a source loaded from a quantized checkpoint (GGUF) must not pass its
    # quantization_config on, or the checkpoint loads as quantized (and refuses save_pretrained)
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config"):
        config_dict.pop(key, None)
    config_dict.update(care_k_ranks=list(k_ranks), care_v_ranks=list(v_ranks), care_absorb_value=absorb_value)
    config = config_cls.from_dict(config_dict)
    config.architectures = [FAMILIES[family][1]]
    config.auto_map = {
        "AutoConfig": f"configuration_care.{FAMILIES[family][0]}",
        "AutoModelForCausalLM": f"modeling_care.{FAMILIES[family][1]}",
        "AutoModel": f"modeling_care.{FAMILIES[family][2]}",  # the bare decoder: feature extraction
    }
    config._attn_implementation = model.config._attn_implementation
    return config


def _absorbed_o_proj(o_weight, o_bias, v_up, v_bias, num_heads, num_kv_heads, head_dim):
    """Folds the value up-projection into o_proj per query head (spec Stage 5: `W_b^V W_O^(h)`).

    Shapes: `o_weight [D, n_h·d]`, `v_up [g·d, r_V]`, `v_bias [g·d]` → weight `[D, n_h·r_V]`, bias `[D]`.
    """
    groups = num_heads // num_kv_heads
    bias = o_bias.clone() if o_bias is not None else o_weight.new_zeros(o_weight.shape[0])
    blocks = []
    for head in range(num_heads):
        kv = head // groups
        o_h = o_weight[:, head * head_dim : (head + 1) * head_dim]  # [D, d]
        blocks.append(o_h @ v_up[kv * head_dim : (kv + 1) * head_dim])  # [D, r_V]
        if v_bias is not None:  # softmax rows sum to 1, so the value bias passes straight to o_proj
            bias = bias + o_h @ v_bias[kv * head_dim : (kv + 1) * head_dim]
    return torch.cat(blocks, dim=1), bias


def build_care_model(model, factors, k_ranks, v_ranks, absorb_value: bool = False):
    """Builds the `Care*ForCausalLM` with the truncated factors; every other weight is `model`'s own
    ([`load_converted_state`]).

    Args:
        model (`PreTrainedModel`): the original GQA model.
        factors (`list[tuple[LowRankFactors, LowRankFactors]]`): full-rank factors per layer.
        k_ranks, v_ranks (`list[int]`): per-layer ranks.
        absorb_value (`bool`, *optional*, defaults to `False`): fold the value up-projection into o_proj.

    Returns:
        The converted model, in eval mode, with `model`'s dtype and device.
    """
    from ..models import modeling_care

    _validate_ranks(factors, k_ranks, v_ranks)
    config = care_config_from(model, k_ranks, v_ranks, absorb_value)
    dtype = next(model.parameters()).dtype
    care_model = uninitialized_model(getattr(modeling_care, FAMILIES[model_family(model)][1]), config, dtype)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))}
    state = {k: v for k, v in state.items() if not k.endswith(("k_proj.bias", "v_proj.bias"))}
    for idx, ((fk, fv), rk, rv) in enumerate(zip(factors, k_ranks, v_ranks)):
        prefix, attn = f"model.layers.{idx}.self_attn.", model.model.layers[idx].self_attn
        k_down, k_up = fk.truncate(rk)
        v_down, v_up = fv.truncate(rv)
        state[prefix + "k_down.weight"] = as_converted(k_down.T, dtype)
        state[prefix + "k_up.weight"] = as_converted(k_up.T, dtype)
        state[prefix + "v_down.weight"] = as_converted(v_down.T, dtype)
        if attn.k_proj.bias is not None:
            state[prefix + "k_up.bias"] = attn.k_proj.bias.detach()
        v_bias = None if attn.v_proj.bias is None else attn.v_proj.bias.detach().double().cpu()
        if absorb_value:  # on the CPU, with the factors
            o_bias = None if attn.o_proj.bias is None else attn.o_proj.bias.detach().double().cpu()
            weight, bias = _absorbed_o_proj(
                attn.o_proj.weight.detach().double().cpu(),
                o_bias,
                v_up.T,
                v_bias,
                config.num_attention_heads,
                config.num_key_value_heads,
                attn.head_dim,
            )
            state[prefix + "o_proj.weight"] = as_converted(weight, dtype)
            if care_model.model.layers[idx].self_attn.o_proj.bias is not None:
                state[prefix + "o_proj.bias"] = as_converted(bias, dtype)
            del weight, bias  # float64: not held on into the next layer (or the load, after the last)
        else:
            state[prefix + "v_up.weight"] = as_converted(v_up.T, dtype)
            if v_bias is not None:
                state[prefix + "v_up.bias"] = as_converted(v_bias, dtype)
    return load_converted_state(care_model, state, model, "CARE")


@dataclass
class CareResult:
    """What [`run_care_conversion`] returns: the converted model and how it was made."""

    model: object
    k_ranks: list
    v_ranks: list
    method: str
    kv_keep: float
    calibration_seconds: float
    factorization_seconds: float
    calibration: dict | None = None  # [`describe_calibration`]: its source and sizes, not its matrices

    def summary(self) -> dict:
        widths = sum(2 * a.k_up.out_features for a in _attn_modules(self.model))
        return {
            "method": self.method,
            "kv_keep": self.kv_keep,
            "kv_keep_achieved": (sum(self.k_ranks) + sum(self.v_ranks)) / widths,
            "k_ranks": self.k_ranks,
            "v_ranks": self.v_ranks,
            "cache_values_per_token": sum(self.k_ranks) + sum(self.v_ranks),
            "calibration_seconds": round(self.calibration_seconds, 2),
            "factorization_seconds": round(self.factorization_seconds, 2),
        }


def _attn_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def prepare_calibration(
    model,
    tokenizer=None,
    calib: str = "generated",
    num_samples: int = 256,
    seq_len: int = 32,
    with_output_grads: bool = True,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
    split: str | None = None,
    text_column: str | None = None,
) -> KvCalibration:
    """Builds the calibration set from `calib` and collects its statistics on the original model.

    Args:
        calib (`str`, *optional*, defaults to `"generated"`): `"generated"` (sampled from the model itself), a text
            file path, or `hf:<dataset>[:<config>]`.
        num_samples, seq_len (`int`): calibration windows × tokens (spec defaults 256 × 32).
        seed (`int`, *optional*, defaults to 0): which windows of a text are drawn, or the seed of the model's
            samples (`"generated"`); recorded in the checkpoint's card and `care_ranks.json`.
        with_output_grads (`bool`, *optional*, defaults to `True`): also collect loss-gradient moments (needed by the
            default method `care`).
        split, text_column (`str`, *optional*): the split and column of an `hf:` source (defaults `train`, `text`).
    """
    from .calibration import calibration_dataset_fields, load_calibration_ids, published_calibration_source

    if tokenizer is None and calib is not None:
        raise ValueError("a tokenizer is needed to build calibration data")
    ids = load_calibration_ids(model, tokenizer, calib, num_samples, seq_len, seed, progress, split, text_column)
    calibration = collect_kv_calibration(model, ids, None, batch_size, with_output_grads, progress)
    # the card and care_ranks.json are published, the machine's paths are not
    # with the seed, which picked the windows of a text or the model's samples: what it takes to calibrate again
    calibration.meta.update(
        source=published_calibration_source(calib), num_samples=num_samples, seq_len=seq_len, seed=seed
    )
    calibration.meta.update(calibration_dataset_fields(calib, split, text_column))
    return calibration


def run_care_conversion(
    model,
    tokenizer=None,
    config: CareConversionConfig | None = None,
    calibration: KvCalibration | None = None,
    progress: bool = True,
    **calib_kwargs,
) -> CareResult:
    """Converts `model` with CARE; see [`convert_care`] for the arguments. Returns a [`CareResult`]."""
    config = config or CareConversionConfig()
    model_family(model)
    if calibration is not None:
        check_calibration_fits(model, calibration)
    start = time.perf_counter()
    if calibration is None and config.method != "svd":
        calibration = prepare_calibration(
            model, tokenizer, with_output_grads=config.method == "care", progress=progress, **calib_kwargs
        )
    calibration_seconds = time.perf_counter() - start
    start = time.perf_counter()
    factors = factorize_kv(model, calibration, config.method, config, progress)
    k_ranks, v_ranks = allocate_ranks(factors, config.kv_keep, config.method, config.rank_floor_frac)
    # only its description is kept: a calibration made here is freed before the build (its float64 moments are
    # 4.3 GB at Llama-3-8B's shapes)
    described, calibration = describe_calibration(calibration), None
    # The original and the converted model coexist while the latter is built (the conversion's peak): the full-rank
    # float64 factors (2·(hidden + g·d)·min(hidden, g·d) numbers a layer) are cut to their ranks first, one at a time.
    for idx, ranks in enumerate(zip(k_ranks, v_ranks)):
        factors[idx] = tuple(f.keep_ranks(r) for f, r in zip(factors[idx], ranks))
    care_model = build_care_model(model, factors, k_ranks, v_ranks, config.absorb_value)
    return CareResult(
        model=care_model,
        k_ranks=k_ranks,
        v_ranks=v_ranks,
        method=config.method,
        kv_keep=config.kv_keep,
        calibration_seconds=calibration_seconds,
        factorization_seconds=time.perf_counter() - start,
        calibration=described,
    )


def describe_calibration(calibration: KvCalibration | None) -> dict | None:
    """The scalar descriptions of `calibration` that a checkpoint publishes (source, sizes, seed, tokens), or `None`
    without one (plain SVD)."""
    if calibration is None:
        return None
    meta = dict(calibration.meta, tokens=calibration.tokens)
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, (str, int, float))}


def convert_care(
    model,
    tokenizer=None,
    kv_keep: float = 0.5,
    method: str = "care",
    calibration: KvCalibration | None = None,
    progress: bool = True,
    **kwargs,
):
    """Converts a GQA causal LM (Llama, Mistral, Qwen2, Qwen3) into a CARE MLA model that caches K/V latents.

    Args:
        model (`PreTrainedModel`): the original model, left unchanged; the result shares the weights it keeps
            with it (train a `copy.deepcopy` to keep both).
        tokenizer (`PreTrainedTokenizer`, *optional*): needed unless `calibration` is given or `method="svd"`.
        kv_keep (`float`, *optional*, defaults to 0.5): fraction of the K+V cache width kept, in (0, 1].
        method (`str`, *optional*, defaults to `"care"`): one of `care`, `care-u`, `care-e-raw`, `care-e-rel`,
            `svd`, `asvd`.
        calibration ([`KvCalibration`], *optional*): reuse statistics from an earlier run (any method but `care`
            can use one collected without gradients).
        progress (`bool`, *optional*, defaults to `True`): show progress bars.
        kwargs: [`CareConversionConfig`] fields (`alpha`, `lam_frac`, `absorb_value`, ...) and
            [`prepare_calibration`] arguments (`calib`, `num_samples`, `seq_len`, `seed`, `batch_size`, `split`,
            `text_column`).

    Returns:
        The converted `Care*ForCausalLM` (eval mode). Its config carries `care_k_ranks` / `care_v_ranks`.

    Example:
        ```python
        >>> from hf_accel import load_model_and_tokenizer
        >>> from hf_accel.compress.care import convert_care
        >>> model, tokenizer = load_model_and_tokenizer("smollm2-135m")
        >>> care_model = convert_care(model, tokenizer, kv_keep=0.5)
        ```
    """
    config_fields = set(CareConversionConfig.__dataclass_fields__)
    calib_fields = set(inspect.signature(prepare_calibration).parameters) - {
        "model",
        "tokenizer",
        "progress",
        "with_output_grads",
    }
    unknown = sorted(set(kwargs) - config_fields - calib_fields)
    if unknown:  # a typo must not be dropped silently (calibration arguments are unused when it is given)
        raise TypeError(f"convert_care() got unexpected keyword argument(s): {', '.join(unknown)}")
    config = CareConversionConfig(
        kv_keep=kv_keep, method=method, **{k: v for k, v in kwargs.items() if k in config_fields}
    )
    calib_kwargs = {k: v for k, v in kwargs.items() if k not in config_fields}
    return run_care_conversion(model, tokenizer, config, calibration, progress, **calib_kwargs).model


def kv_cache_bytes_per_token(model, dtype_bytes: int | None = None) -> int:
    """Analytic K/V cache bytes per token of a model (all layers): latent ranks for CARE, `2·g·d` otherwise."""
    config = model.config
    dtype_bytes = dtype_bytes or next(model.parameters()).element_size()
    if getattr(config, "care_k_ranks", None) is not None:
        return (sum(config.care_k_ranks) + sum(config.care_v_ranks)) * dtype_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


_PAPER = {"title": "CARE: Covariance-Aware and Rank-Enhanced Decomposition for Enabling Multi-Head Latent Attention"}


def save_care_model(result: CareResult, tokenizer, out_dir, base_model: str | None, overwrite: bool = False) -> Path:
    """Writes a converted model as a Hub-ready trust_remote_code checkpoint (atomically).

    The directory holds `model.safetensors`, `config.json` (with `auto_map`), `configuration_care.py` and
    `modeling_care.py`, the tokenizer, `care_ranks.json`, `care_ranks.png` and a model card (`converted-model`).

    Args:
        result ([`CareResult`]): from [`run_care_conversion`].
        tokenizer: saved beside the model (skipped if `None`).
        out_dir (`str` or `os.PathLike`): the output directory; must not exist or be empty unless `overwrite`.
        base_model (`str`): the original model's Hub id (or the `smollm2-135m` alias), named by the card; `None`
            writes no card (a local cache of a model without a Hub id).
        overwrite (`bool`, *optional*, defaults to `False`): replace an earlier checkpoint in `out_dir` (a
            `config.json` naming a `model_type`, and weights); any other non-empty directory is refused.

    Returns:
        `Path`: `out_dir`.
    """
    from ..hub import save_artifact

    model, out = result.model, Path(out_dir)
    width = model.model.layers[0].self_attn.k_up.out_features
    summary = result.summary()
    with atomic_output_dir(out, overwrite) as tmp:
        calibration = result.calibration
        plot_ranks(tmp / "care_ranks.png", result.k_ranks, result.v_ranks, width, f"CARE ranks ({result.method})")
        settings = {"method": result.method, "kv_keep": result.kv_keep}
        settings["kv_keep_achieved"] = round(summary["kv_keep_achieved"], 4)
        settings["absorb_value"] = model.config.care_absorb_value
        settings["calibration"] = ", ".join(f"{k} {v}" for k, v in (calibration or {"none": "(plain SVD)"}).items())
        card = {"settings": settings, "kv_bytes_per_token": kv_cache_bytes_per_token(model, 2)}  # also for the card
        card["base_kv_bytes_per_token"] = 2 * width * len(result.k_ranks) * 2  # of a healed model ([`heal`])
        # how long the conversion took is printed, not published: two conversions of one model give the same files
        record = {k: v for k, v in summary.items() if not k.endswith("_seconds")}
        write_json(tmp / "care_ranks.json", dict(record, base_model=base_model, calibration=calibration, card=card))
        if base_model is None:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            return out
        save_artifact(
            tmp,
            "converted-model",
            base_model,
            model_name=out.resolve().name,  # not the temporary directory's (`--out .` has no name)
            model=model,
            tokenizer=tokenizer,
            description="CARE: every layer's `k_proj`/`v_proj` is factorized into a down-projection to a latent and "
            "an up-projection (covariance-weighted SVD); the KV cache stores only the latents, and keys are rebuilt "
            "and RoPE'd at attention time. A zero-shot conversion (no healing): quality is below the original.",
            **card,
            ranks_plot=tmp / "care_ranks.png",
            papers=[_PAPER],
        )
    return out
