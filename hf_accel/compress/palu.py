"""Palu: grouped low-rank K/V projections with latent caching, Fisher ranks and Hadamard-rotated low-bit latents.

Pipeline (spec 002 §2, issue 4): calibrate the k/v-projection input second moments on the original model (shared with
CARE, [`collect_kv_calibration`]); allocate per-layer group ranks for K and V, uniform or Fisher-proportional under one
global budget ([`allocate_fisher_ranks`]), or CARE's loss-weighted allocation (`kfac`: water-filling on the singular
values of `√C·W_g·√G_g`, [`kfac_group_ranks`]); factorize every group of `s` KV heads with the whitened (truncation-aware)
SVD shared with CARE ([`factorize`] with `S = √C_λ`); optionally fold a Walsh–Hadamard rotation into each group's
factors; fold the value reconstruction into `o_proj`; build a `PaluLlamaForCausalLM` whose cache holds
`n_g·(r_k + r_v)` numbers (or packed low-bit codes) per token per layer.

Grouping of GQA models (spec §7 item 7): groups are formed over the **key/value heads**, in order: group `g` holds KV
heads `[g·s, (g+1)·s)`, and query head `h` reads KV head `h // (num_heads / num_key_value_heads)` as in the original.
J-LRD with uniform ranks (`s = num_key_value_heads`) is CARE-U's factorization of the whole K or V projection.

Whitening (spec §2.1): where the Palu code takes a Cholesky factor of the raw Gram matrix and splits `√Σ` to each side,
`S` here is CARE's symmetric root of the shrunk moment `C_λ = (1 − α) C + α λ I` (α = 0.05, λ = 10⁻²·λ_max), and Σ
goes whole into the down-projection `A = S⁻¹ U Σ`: every group's reconstruction `B = Vᵀ` has orthonormal rows (so
has `Hᵀ B` after the Hadamard fold), and a latent's quantization error reaches the keys and values unamplified.
"""

import numbers
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic import atomic_output_dir
from ..log import progress_bar
from ..models.configuration_palu import KERNEL_BACKENDS
from .calibration import (
    check_calibration_fits,
    check_calibration_ids,
    collect_kv_calibration,
    tokenize_calibration_text,
)
from .export import (
    as_converted,
    check_no_adapters,
    check_rope_type,
    load_converted_state,
    uninitialized_model,
)
from .factorize import check_shrinkage, factorize, shrink_moment, symmetric_sqrt
from .fisher import allocate_fisher_ranks, collect_fisher_scores
from .ranks import budget_from_kv_keep, water_fill


RANK_METHODS = ("uniform", "fisher", "kfac")
QUANT_BITS = (0, 2, 3, 4)
_PAPER = {"title": "Palu: KV-Cache Compression with Low-Rank Projection", "arxiv": "2407.21118"}


@dataclass
class PaluConversionConfig:
    """Options of a Palu conversion (the CLI's `convert palu` flags map to these fields)."""

    kv_keep: float = field(default=0.5, metadata={"help": "Fraction of the K+V cache width kept, in (0, 1]."})
    group_size: int | None = field(
        default=None,
        metadata={"help": "KV heads per group s (1: M-LRD, all: J-LRD); default: the largest divisor of them ≤ 4."},
    )
    ranks: str = field(
        default="fisher",
        metadata={"help": "Rank allocation: 'uniform', 'fisher', or 'kfac' (CARE's: water-filled σ of √C·W·√G)."},
    )
    quant_bits: int = field(default=0, metadata={"help": "0 (float latents), or 2/3/4-bit per-token latents."})
    hadamard: bool = field(default=True, metadata={"help": "Fold a Walsh–Hadamard rotation into the factors."})
    rank_multiple: int = field(default=8, metadata={"help": "Every group rank is a multiple of this."})
    calib_samples: int = field(default=64, metadata={"help": "Calibration sequences for the whitening moments."})
    calib_seq_len: int = field(default=256, metadata={"help": "Tokens per calibration sequence."})
    fisher_samples: int = field(default=16, metadata={"help": "Sequences (one backward each) for Fisher scores."})
    alpha: float = field(default=0.05, metadata={"help": "Shrinkage α of C_λ = (1−α)C + αλI (shared with CARE)."})
    lam_frac: float = field(default=1e-2, metadata={"help": "λ as a fraction of λ_max(C)."})
    quant_group_size: int = field(
        default=0,
        metadata={"help": "Channels per scale/zero-point; 0: a group's whole latent. Must divide rank_multiple."},
    )
    residual_length: int = field(
        default=0,
        metadata={
            "help": "Most recent tokens also served in full precision (quantized latents only; a fixed cost per sequence)."
        },
    )
    kernel_backend: str = field(
        default="eager", metadata={"help": "'eager', 'triton' or 'auto' (triton where available) kernels at run time."}
    )
    seed: int = field(default=3, metadata={"help": "Seed of the calibration window sampling."})

    def __post_init__(self):
        budget_from_kv_keep([1], self.kv_keep)  # validates kv_keep
        self.kv_keep = float(self.kv_keep)  # a numpy float would not go into the saved JSON
        # numpy integers are taken as ints (the saved JSON takes no numpy types); bools and floats are refused
        if self.group_size is not None:
            self.group_size = _integer("group_size", self.group_size, minimum=1)
        if self.ranks not in RANK_METHODS:
            raise ValueError(f"unknown rank allocation {self.ranks!r}; choose one of {', '.join(RANK_METHODS)}")
        if not _is_integer(self.quant_bits) or self.quant_bits not in QUANT_BITS:  # 3.0 == 3, np.False_ == 0
            raise ValueError(f"quant_bits must be one of {QUANT_BITS}, got {self.quant_bits!r}")
        self.quant_bits = int(self.quant_bits)
        self.rank_multiple = _integer("rank_multiple", self.rank_multiple, minimum=1)
        self.quant_group_size = _integer("quant_group_size", self.quant_group_size, minimum=0)
        if self.quant_group_size and self.rank_multiple % self.quant_group_size:
            raise ValueError(
                f"quant_group_size must be 0 (one scale per latent) or divide rank_multiple {self.rank_multiple}, so "
                f"that it divides every group rank; got {self.quant_group_size!r}"
            )
        self.residual_length = _integer("residual_length", self.residual_length, minimum=0)
        if self.residual_length and not self.quant_bits:
            raise ValueError("residual_length is a full-precision window of a quantized cache: it needs quant_bits")
        self.calib_samples = _integer("calib_samples", self.calib_samples, minimum=1)
        self.calib_seq_len = _integer("calib_seq_len", self.calib_seq_len, minimum=2)
        self.fisher_samples = _integer("fisher_samples", self.fisher_samples, minimum=int(self.ranks == "fisher"))
        self.seed = int(self.seed) if _is_integer(self.seed) else self.seed  # None: unseeded window sampling
        check_shrinkage(self.alpha, self.lam_frac)
        if self.kernel_backend not in KERNEL_BACKENDS:  # before calibration, not when the model is built
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")


def _is_integer(value) -> bool:
    """Whether `value` is an integer, a numpy one included: not a bool, nor a float (numpy's included) of whole value."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _integer(name: str, value, minimum: int) -> int:
    """`value` as a Python int (numpy integers included) of at least `minimum`; one line for anything else."""
    if not _is_integer(value) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer ≥ {minimum}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------------------------------
# Pure layout helpers (G-LRD, spec §2.2)


def group_kv_weight(weight: torch.Tensor, num_key_value_heads: int, head_dim: int, group_size: int) -> torch.Tensor:
    """
    Split a K or V projection into its G-LRD groups of `group_size` consecutive KV heads.

    Args:
        weight (`torch.Tensor` of shape `[in, num_key_value_heads · head_dim]`): `W = linear.weight.T`.
        num_key_value_heads (`int`): KV heads of the projection.
        head_dim (`int`): channels per head.
        group_size (`int`): KV heads per group `s`; it must divide `num_key_value_heads`.

    Returns:
        `torch.Tensor` of shape `[n_g, in, s · head_dim]`: `W_{g_j} = [W_{j,1} … W_{j,s}]` for every group `j`.
    """
    if group_size < 1 or num_key_value_heads % group_size:
        raise ValueError(
            f"group_size {group_size} must divide the model's {num_key_value_heads} key/value heads "
            f"(choose one of {[s for s in range(1, num_key_value_heads + 1) if num_key_value_heads % s == 0]})"
        )
    if weight.shape[1] != num_key_value_heads * head_dim:
        raise ValueError(f"weight {tuple(weight.shape)} is not [in, {num_key_value_heads}·{head_dim}]")
    num_groups = num_key_value_heads // group_size
    return weight.reshape(weight.shape[0], num_groups, group_size * head_dim).permute(1, 0, 2)


def fold_values_into_o_proj(
    o_weight: torch.Tensor, v_up: torch.Tensor, num_heads: int, num_key_value_heads: int, head_dim: int
) -> torch.Tensor:
    """
    Fold each query head's slice of the value reconstruction into `o_proj` (spec Eq. 5): `W̃^o_h = B^v_{g,i} W^o_h`.

    Args:
        o_weight (`torch.Tensor` of shape `[D, num_heads · head_dim]`): `o_proj.weight`.
        v_up (`torch.Tensor` of shape `[n_g, r_v, s · head_dim]`): value reconstruction `B^v` per group.
        num_heads (`int`), num_key_value_heads (`int`), head_dim (`int`): the original attention's shape.

    Returns:
        `torch.Tensor` of shape `[D, num_heads · r_v]`, the new `o_proj.weight`: query head `h` reads KV head
        `j = h // (num_heads / num_key_value_heads)`, which is head `i = j % s` of group `g = j // s`.
    """
    width = v_up.shape[-1]
    group_size = width // head_dim
    per_kv = num_heads // num_key_value_heads
    blocks = []
    for head in range(num_heads):
        group, inner = divmod(head // per_kv, group_size)
        b_head = v_up[group, :, inner * head_dim : (inner + 1) * head_dim]  # [r_v, d]
        blocks.append(o_weight[:, head * head_dim : (head + 1) * head_dim] @ b_head.T)  # [D, r_v]
    return torch.cat(blocks, dim=1)


def _rank_cap(width: int, multiple: int, max_rank: int | None) -> int:
    # a group's factors have min(width, hidden) ranks; caps are whole multiples
    cap = width if max_rank is None else min(width, max_rank)
    return cap - cap % multiple


def uniform_group_ranks(
    width: int, kv_keep: float, multiple: int, num_layers: int, *, max_rank: int | None = None
) -> tuple[list[int], list[int]]:
    """The same group rank for K and V of every layer: `kv_keep · width` rounded to `multiple`, within
    `[multiple, cap]`, the cap being the largest multiple of `multiple` ≤ `min(width, max_rank)`."""
    rank = min(_rank_cap(width, multiple, max_rank), max(multiple, multiple * round(kv_keep * width / multiple)))
    return [rank] * num_layers, [rank] * num_layers


def fisher_group_ranks(
    scores: list[tuple[float, float]],
    width: int,
    num_groups: int,
    kv_keep: float,
    multiple: int,
    *,
    max_rank: int | None = None,
) -> tuple[list[int], list[int]]:
    """
    Fisher-proportional group ranks: one budget over K and V of all layers (spec §2.4, `fisher_uniform`).

    Targets are the K and V projections of every layer (full width `n_g · width`); each gets a share of
    `kv_keep · Σ widths` proportional to its score, capped at full rank (`min(width, max_rank)` per group: the
    factors of a group have at most the hidden size's rank), and is split evenly over its groups (equal rank per
    group). The budget is rounded to whole units of `n_g · multiple`, so it is met exactly.

    Returns:
        `(k_ranks, v_ranks)`: per layer, the rank of each group.
    """
    unit = num_groups * multiple
    cap = num_groups * _rank_cap(width, multiple, max_rank)
    targets = [s for pair in scores for s in pair]
    budget = unit * max(len(targets), round(kv_keep * len(targets) * num_groups * width / unit))
    budget = min(budget, cap * len(targets))
    ranks = allocate_fisher_ranks(targets, [cap] * len(targets), budget, unit)
    group_ranks = [r // num_groups for r in ranks]
    return group_ranks[0::2], group_ranks[1::2]


def kfac_group_ranks(
    sigmas: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    width: int,
    kv_keep: float,
    multiple: int,
    *,
    max_rank: int | None = None,
) -> tuple[list[int], list[int]]:
    """
    CARE's allocation for Palu groups: water-filling on the K-FAC loss estimate, one rank per layer and projection.

    `sigmas[layer] = (K groups' σ, V groups' σ)`, singular values of `√C·W_g·√G_g` (loss units, comparable across
    layers, K and V). All groups of a projection share one rank (the cache layout), so a target's marginal gain at
    rank `i` is `Σ_g σ²_{g,i}`; ranks are handed out in blocks of `multiple` (a block's gain is the sum of its ranks'
    gains), between one block and the largest multiple of `multiple` ≤ `min(width, max_rank)`, with `kv_keep · targets · width`
    rounded to whole blocks as the budget, like [`fisher_group_ranks`].

    Returns:
        `(k_ranks, v_ranks)`: per layer, the rank of each group.
    """
    blocks = _rank_cap(width, multiple, max_rank) // multiple
    gains = []
    for pair in sigmas:
        for groups in pair:
            per_rank = sum(sigma.double()[: blocks * multiple] ** 2 for sigma in groups)
            gains.append(per_rank.reshape(blocks, multiple).sum(-1))
    budget = min(len(gains) * blocks, max(len(gains), round(kv_keep * len(gains) * width / multiple)))
    ranks = [multiple * r for r in water_fill(gains, budget, [blocks] * len(gains), floors=1)]
    return ranks[0::2], ranks[1::2]


# ---------------------------------------------------------------------------------------------------------------------
# Factorization and model building


def default_group_size(num_key_value_heads: int, preferred: int = 4) -> int:
    """The largest divisor of the KV heads that is at most `preferred` (the paper's G-LRD uses 4 heads a group;
    the default model's 3 KV heads give 3)."""
    return max(s for s in range(1, min(preferred, num_key_value_heads) + 1) if num_key_value_heads % s == 0)


def check_palu_model(model, conversion: PaluConversionConfig) -> int:
    """Refuses, in one line, a model or settings Palu cannot convert (before any calibration); returns the group size
    (`conversion.group_size`, or [`default_group_size`] when it is `None`)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        raise ValueError(f"Palu supports the llama model family, got {getattr(cfg, 'model_type', None)!r}")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("Palu does not support attention biases (attention_bias=True)")
    check_rope_type(cfg, "Palu")
    check_no_adapters(model, "Palu")
    n_kv = cfg.num_key_value_heads
    group_size = conversion.group_size or default_group_size(n_kv)
    if n_kv % group_size:
        raise ValueError(
            f"group_size {group_size} must divide the model's {n_kv} key/value heads "
            f"(choose one of {[s for s in range(1, n_kv + 1) if n_kv % s == 0]})"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_rank = min(group_size * head_dim, cfg.hidden_size)  # the rank of a group's [hidden, width] projection
    if conversion.rank_multiple > max_rank:
        raise ValueError(
            f"rank_multiple {conversion.rank_multiple} exceeds a group's largest rank {max_rank} (min of the group "
            f"width and the hidden size)"
        )
    return group_size


def factorize_groups(
    weight: torch.Tensor,
    scales,
    num_key_value_heads: int,
    head_dim: int,
    group_size: int,
    out_moment: torch.Tensor | None = None,
    alpha: float = 0.05,
    lam_frac: float = 1e-2,
) -> list:
    """
    Full-rank whitened SVD of every group of one projection (float64; [`truncate_groups`] cuts them to a rank).

    Args:
        weight (`torch.Tensor` of shape `[in, n_kv · d]`): `linear.weight.T`.
        scales (`tuple`): `(S, S⁻¹)` of the layer's input moment, `S = √C_λ` (shared by K and V).
        out_moment (`torch.Tensor` of shape `[n_kv · d, n_kv · d]`, *optional*): second moment of the loss gradient
            at the projection's output; each group is then weighted on both sides, SVD of `√C·W_g·√G_g` (CARE's
            K-FAC weighting, `G_g` the group's diagonal block, shrunk with `alpha` and `lam_frac`).

    Returns:
        `list[LowRankFactors]`, one per group, with `x @ down @ up = x @ W_g` at full rank.
    """
    width = group_size * head_dim
    groups = []
    for g, group_weight in enumerate(group_kv_weight(weight, num_key_value_heads, head_dim, group_size)):
        out_scales = ()
        if out_moment is not None:
            block = out_moment[g * width : (g + 1) * width, g * width : (g + 1) * width]
            out_scales = symmetric_sqrt(shrink_moment(block, alpha, lam_frac))
        groups.append(factorize(group_weight, *scales, *out_scales))
    return groups


def truncate_groups(groups, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked rank-`rank` factors `(down [n_g, in, rank], up [n_g, rank, s·d])` of full-rank group factors."""
    downs, ups = zip(*(factors.truncate(rank) for factors in groups))
    return torch.stack(downs), torch.stack(ups)


def palu_config_from(model, group_size, k_ranks, v_ranks, conversion: PaluConversionConfig):
    """The `PaluLlamaConfig` of a converted `model`: its config plus the Palu fields, `auto_map` and eager attention."""
    from ..models.configuration_palu import PaluLlamaConfig

    config_dict = model.config.to_dict()
    # the converted weights are plain floats: a source loaded from a quantized checkpoint (GGUF) must not pass its
    # quantization_config on, or the checkpoint loads as quantized (and refuses save_pretrained)
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config"):
        config_dict.pop(key, None)
    config_dict.update(
        palu_group_size=group_size,
        palu_k_ranks=list(k_ranks),
        palu_v_ranks=list(v_ranks),
        palu_quant_bits=conversion.quant_bits,
        palu_quant_group_size=conversion.quant_group_size,
        palu_residual_length=conversion.residual_length,
        palu_hadamard=conversion.hadamard,
        palu_kernel_backend=conversion.kernel_backend,
    )
    config = PaluLlamaConfig.from_dict(config_dict)
    config.architectures = ["PaluLlamaForCausalLM"]
    config.auto_map = {
        "AutoConfig": "configuration_palu.PaluLlamaConfig",
        "AutoModelForCausalLM": "modeling_palu.PaluLlamaForCausalLM",
        "AutoModel": "modeling_palu.PaluLlamaModel",  # the bare decoder: feature extraction
    }
    config._attn_implementation = "eager"  # the Palu kernels read additive masks
    return config


def build_palu_model(model, layer_factors, k_ranks, v_ranks, conversion: PaluConversionConfig):
    """
    Build the `PaluLlamaForCausalLM` from per-layer group factors; every other weight is `model`'s
    own ([`load_converted_state`]).

    Args:
        model (`PreTrainedModel`): the original Llama model.
        layer_factors (`list`): per layer `(k_down [n_g, in, r_k], k_up [n_g, r_k, s·d], v_down, v_up)`, float64.
        k_ranks, v_ranks (`list[int]`): per-layer group ranks.
        conversion ([`PaluConversionConfig`]): the options (Hadamard, quantization, kernels).
    """
    from ..kernels.hadamard import fold_hadamard_into_factors
    from ..models.modeling_palu import PaluLlamaForCausalLM

    config = palu_config_from(model, conversion.group_size, k_ranks, v_ranks, conversion)
    dtype = next(model.parameters()).dtype
    palu = uninitialized_model(PaluLlamaForCausalLM, config, dtype)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))}
    head_dim = palu.model.layers[0].self_attn.head_dim
    for idx, (k_down, k_up, v_down, v_up) in enumerate(layer_factors):
        if conversion.hadamard:  # A → A H, B → Hᵀ B per group (Eq. 7): unchanged outputs, flatter latents
            k_down, k_up = fold_hadamard_into_factors(k_down, k_up)
            v_down, v_up = fold_hadamard_into_factors(v_down, v_up)
        prefix = f"model.layers.{idx}.self_attn."
        state[prefix + "k_down.weight"] = as_converted(torch.cat(list(k_down), dim=1).T, dtype)  # [n_g·r_k, in]
        state[prefix + "v_down.weight"] = as_converted(torch.cat(list(v_down), dim=1).T, dtype)  # [n_g·r_v, in]
        state[prefix + "k_up"] = as_converted(k_up, dtype)
        o_weight = fold_values_into_o_proj(
            state[prefix + "o_proj.weight"].double().cpu(),
            v_up,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
        )
        state[prefix + "o_proj.weight"] = as_converted(o_weight, dtype)
        del o_weight  # not held on into the next layer (or the load, after the last)
    return load_converted_state(palu, state, model, "Palu")


def check_fisher_samples(fisher_samples: int, calib_samples: int, needed: bool) -> None:
    """Refuses, in one line, more Fisher sequences than calibration sequences (they are the first `fisher_samples`
    of them): fewer would be used than the checkpoint's record says."""
    if needed and fisher_samples > calib_samples:
        raise ValueError(
            f"fisher_samples {fisher_samples} exceeds the {calib_samples} calibration sequences it is taken from; "
            "pass fewer Fisher samples or more calibration sequences"
        )


def _read_calibration(tokenizer, calibration_text, calibration_ids, conversion):
    if calibration_ids is not None and calibration_text:
        raise ValueError("pass calibration_text or calibration_ids, not both")
    if calibration_ids is not None:
        check_calibration_ids(calibration_ids)  # like calib_seq_len ≥ 2, before any work
        return calibration_ids
    if not calibration_text:
        raise ValueError(
            "Palu needs calibration text (a non-empty string) or token ids; pass --calib FILE or generated"
        )
    return tokenize_calibration_text(
        tokenizer, calibration_text, conversion.calib_samples, conversion.calib_seq_len, seed=conversion.seed
    )


def convert_palu(
    model,
    tokenizer,
    kv_keep: float = 0.5,
    group_size: int | None = None,
    ranks: str = "fisher",
    quant_bits: int = 0,
    hadamard: bool = True,
    calibration_text: str | None = None,
    calibration_ids: torch.Tensor | None = None,
    calibration=None,
    fisher_scores: list | None = None,
    progress: bool = True,
    **options,
):
    """
    Convert a Llama-family causal LM to Palu (spec 002): grouped low-rank K/V that cache latents.

    Args:
        model (`PreTrainedModel`): the original model, left unchanged; the result shares the weights it keeps
            with it (train a `copy.deepcopy` to keep both).
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (for the calibration text).
        kv_keep (`float`, *optional*, defaults to 0.5): fraction of the K+V cache width kept, in (0, 1].
        group_size (`int`, *optional*): KV heads per group (must divide `num_key_value_heads`); defaults to the
            largest divisor of them that is at most 4 ([`default_group_size`]).
        ranks (`str`, *optional*, defaults to `"fisher"`): `"uniform"`, `"fisher"` or `"kfac"` (CARE's water-filling
            on the singular values of `√C·W_g·√G_g`; needs gradient moments, collected during calibration).
        quant_bits (`int`, *optional*, defaults to 0): 0, or 2/3/4-bit per-token quantized latents.
        hadamard (`bool`, *optional*, defaults to `True`): fold a Walsh–Hadamard rotation into the factors.
        calibration_text (`str`): text for the whitening moments (and the Fisher scores).
        calibration_ids (`torch.LongTensor` of shape `[N, S]`, *optional*): calibration token ids instead of text (for
            example sequences the model sampled, [`generate_calibration_ids`]); the first `fisher_samples` rows also
            give the Fisher scores.
        calibration ([`KvCalibration`], *optional*): moments from an earlier run (reused, not recollected).
        fisher_scores (`list[tuple[float, float]]`, *optional*): per-layer Fisher scores from an earlier run.
        progress (`bool`, *optional*, defaults to `True`): progress bars.
        options: other fields of [`PaluConversionConfig`] (`rank_multiple`, `calib_samples`, `calib_seq_len`,
            `fisher_samples`, `alpha`, `quant_group_size`, `residual_length`, `kernel_backend`, ...).

    Returns:
        `(palu_model, info)`: the converted model (eval mode) and a dict with the ranks, settings and timings.

    Example:

    ```python
    >>> from hf_accel.loading import load_model_and_tokenizer
    >>> model, tokenizer = load_model_and_tokenizer("smollm2-135m")
    >>> palu, info = convert_palu(model, tokenizer, kv_keep=0.5, group_size=3, quant_bits=3,
    ...                           calibration_text=open("tinyshakespeare.txt").read())
    ```
    """
    conversion = PaluConversionConfig(
        kv_keep=kv_keep, group_size=group_size, ranks=ranks, quant_bits=quant_bits, hadamard=hadamard, **options
    )
    group_size = conversion.group_size = check_palu_model(model, conversion)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv, num_layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    num_groups, width = n_kv // group_size, group_size * head_dim
    max_rank = min(width, cfg.hidden_size)  # the rank of a group's [hidden, width] projection
    reused = calibration is not None  # a caller's statistics, kept by the caller (and so the scales cached on them)
    if reused:
        check_calibration_fits(model, calibration)
    if fisher_scores is not None and len(fisher_scores) != num_layers:
        raise ValueError(f"fisher_scores has {len(fisher_scores)} (K, V) pairs, the model {num_layers} layers")
    start = time.perf_counter()
    input_ids = None
    if calibration is None or (conversion.ranks == "fisher" and fisher_scores is None):
        input_ids = _read_calibration(tokenizer, calibration_text, calibration_ids, conversion)
        check_fisher_samples(
            conversion.fisher_samples, len(input_ids), conversion.ranks == "fisher" and fisher_scores is None
        )
    kfac = conversion.ranks == "kfac"
    if calibration is None:
        calibration = collect_kv_calibration(model, input_ids, with_output_grads=kfac, progress=progress)
    if kfac and calibration.k_grad_moments is None:
        raise ValueError("ranks='kfac' needs output-gradient moments: calibrate with with_output_grads=True")
    timings = {"calibration_s": time.perf_counter() - start}
    scores = None
    if conversion.ranks == "fisher":
        start = time.perf_counter()
        scores = fisher_scores
        if scores is None:
            scores = collect_fisher_scores(model, input_ids[: conversion.fisher_samples], progress=progress)
        k_ranks, v_ranks = fisher_group_ranks(
            scores, width, num_groups, kv_keep, conversion.rank_multiple, max_rank=max_rank
        )
        timings["fisher_s"] = time.perf_counter() - start
    elif conversion.ranks == "uniform":
        k_ranks, v_ranks = uniform_group_ranks(width, kv_keep, conversion.rank_multiple, num_layers, max_rank=max_rank)
    start = time.perf_counter()
    layout = {"num_key_value_heads": n_kv, "head_dim": head_dim, "group_size": group_size}
    full, sigmas = _factorize_layers(model, calibration, conversion, layout, reused, kfac, progress)
    if kfac:
        k_ranks, v_ranks = kfac_group_ranks(sigmas, width, kv_keep, conversion.rank_multiple, max_rank=max_rank)
    layer_factors = [
        (*truncate_groups(k_groups, k_rank), *truncate_groups(v_groups, v_rank))
        for (k_groups, v_groups), k_rank, v_rank in zip(full, k_ranks, v_ranks)
    ]
    calibration_tokens = calibration.tokens
    # The original and the converted model coexist while the latter is built (the conversion's peak): the full-rank
    # factors and the statistics of a calibration made here (2·hidden² float64 numbers a layer) are freed first.
    del calibration, full, sigmas
    palu = build_palu_model(model, layer_factors, k_ranks, v_ranks, conversion)
    timings["factorization_s"] = time.perf_counter() - start
    total_width = 2 * num_layers * n_kv * head_dim
    info = {
        "method": "palu",
        "settings": asdict(conversion),
        "grouping": describe_grouping(cfg.num_attention_heads, n_kv, group_size),
        "k_ranks": k_ranks,
        "v_ranks": v_ranks,
        "kv_keep_achieved": num_groups * (sum(k_ranks) + sum(v_ranks)) / total_width,
        "fisher_scores": scores,
        "calibration_tokens": calibration_tokens,
        "cache_bytes_per_token": expected_cache_bytes_per_token(palu.config),
        "window_bytes_per_sequence": window_bytes_per_sequence(palu),
        "base_cache_bytes_per_token": total_width * 2,  # float16 keys and values
        "timings": timings,
    }
    return palu, info


def _factorize_layers(model, calibration, conversion, layout: dict, reused: bool, kfac: bool, progress: bool):
    """Per layer, `(K groups, V groups)` full-rank whitened factors, and with `kfac` the σ of each group's two-sided
    SVD (`√C·W_g·√G_g`, for the ranks only). `layout`: [`factorize_groups`]'s `num_key_value_heads`, `head_dim` and
    `group_size`. One layer's whitening scales at a time unless `reused` (a caller's calibration, which caches them
    for the conversions that share it)."""
    common = dict(layout, alpha=conversion.alpha, lam_frac=conversion.lam_frac)
    full, sigmas = [], []
    for idx, layer in enumerate(progress_bar(model.model.layers, progress, desc="factorize", unit="layer")):
        attn = layer.self_attn
        common["scales"] = _layer_scales(calibration, idx, conversion.alpha, conversion.lam_frac, cache=reused)
        weights = (attn.k_proj.weight.detach().T.cpu(), attn.v_proj.weight.detach().T.cpu())  # with the statistics
        full.append(tuple(factorize_groups(w, **common) for w in weights))
        if kfac:
            grads = (calibration.k_grad_moments[idx], calibration.v_grad_moments[idx])
            pair = [factorize_groups(w, out_moment=g, **common) for w, g in zip(weights, grads)]
            sigmas.append(tuple([f.sigma for f in groups] for groups in pair))
    return full, sigmas


def window_bytes_per_sequence(palu_model) -> int:
    """The full-precision window's bytes: a fixed cost per sequence, the latents of its `palu_residual_length` most
    recent tokens in the model's dtype and their int64 positions, one per token and layer (the cache's bytes per
    token leave it out)."""
    cfg = palu_model.config
    groups = cfg.num_key_value_heads // cfg.palu_group_size
    latents = groups * (sum(cfg.palu_k_ranks) + sum(cfg.palu_v_ranks))
    positions = cfg.num_hidden_layers * torch.long.itemsize
    return cfg.palu_residual_length * (latents * palu_model.dtype.itemsize + positions)


def _layer_scales(calibration, idx: int, alpha: float, lam_frac: float, cache: bool) -> tuple:
    """`(S, S⁻¹)` of layer `idx`, `S = √C_λ`. With `cache`, kept on the calibration: conversions that share it skip
    the eigh. Without, computed for the one layer being factorized: every layer's at once cost `2·layers·hidden²`
    float64 numbers (8.6 GB for Llama-3-8B's shapes), needlessly for a calibration that serves one conversion."""
    if not cache:
        return symmetric_sqrt(shrink_moment(calibration.moments[idx], alpha, lam_frac))
    scales = calibration.meta.setdefault(("palu_scales", alpha, lam_frac), [None] * len(calibration.moments))
    if scales[idx] is None:
        scales[idx] = symmetric_sqrt(shrink_moment(calibration.moments[idx], alpha, lam_frac))
    return scales[idx]


def describe_grouping(num_heads: int, num_key_value_heads: int, group_size: int) -> str:
    """One sentence for the model card: how KV heads are grouped and which query heads read each group."""
    num_groups = num_key_value_heads // group_size
    per_kv = num_heads // num_key_value_heads
    kind = "M-LRD" if group_size == 1 else ("J-LRD" if group_size == num_key_value_heads else "G-LRD")
    return (
        f"{kind}: the {num_key_value_heads} key/value heads form {num_groups} group(s) of {group_size} consecutive "
        f"KV heads (group g = KV heads [g·{group_size}, (g+1)·{group_size})); each group caches one key latent and one "
        f"value latent, read by its {group_size * per_kv} query heads (GQA: {per_kv} query heads per KV head)."
    )


def expected_cache_bytes_per_token(config, float_bytes: int = 2) -> float:
    """Cache bytes per token from the ranks: float latents (`float_bytes` each) or packed codes + scales + zeros."""
    from ..kernels.quant import compute_bytes_per_token

    num_groups = config.num_key_value_heads // config.palu_group_size
    total = 0
    for r_k, r_v in zip(config.palu_k_ranks, config.palu_v_ranks):
        for rank in (r_k, r_v):
            if config.palu_quant_bits:
                total += num_groups * compute_bytes_per_token(
                    rank, config.palu_quant_bits, config.palu_quant_group_size
                )
            else:
                total += num_groups * rank * float_bytes
    return total


# ---------------------------------------------------------------------------------------------------------------------
# Saving: a self-contained trust_remote_code checkpoint


_KERNEL_REGISTRATION = """

# ---- registration (as hf_accel/kernels/__init__.py) ----
def _eager_loader(name):
    return lambda: globals()[name]


def _missing_triton(*args, **kwargs):
    raise ImportError(
        "This checkpoint's own copies of the Palu kernels have no 'triton' backend: it needs hf_accel installed from "
        "the same kernel sources as the checkpoint (_SOURCES_HASH in its palu_kernels.py; convert the model again with "
        "the installed hf_accel otherwise) and `triton` (`pip install 'hf-accel[triton]'`); or use the 'eager' backend."
    )


def resolve_auto_backend(device=None):  # noqa: F811
    # these copies carry no Triton kernels: "auto" runs the eager ones (hf_accel from the same sources brings its own)
    return "eager"


for _name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend"):
    register_kernel(_name, "eager", _eager_loader(_name))
    register_kernel(_name, "triton", lambda: _missing_triton)

try:  # with hf_accel installed from the same sources, its kernels (Triton included) and cache classes replace the copies
    from hf_accel.kernels import checkpoint_sources_hash

    if checkpoint_sources_hash() == _SOURCES_HASH:
        from hf_accel.kernels import get_kernel  # noqa: F811
        from hf_accel.kernels.cache import PaluQuantizedCache, PaluQuantizedLayer  # noqa: F811
except (ImportError, OSError):  # no hf_accel, one older than the sources hash, or one without its .py sources
    pass
"""


def write_palu_kernels_file(path: str | Path) -> Path:
    """
    Write a self-contained `palu_kernels.py` for a checkpoint: the sources of `hf_accel/kernels/{quant, reference,
    registry, cache}.py` in one flat module (their relative imports dropped) plus the eager registration. Where
    hf_accel is installed from the same sources ([`~hf_accel.kernels.checkpoint_sources_hash`]), the file uses its
    kernels and cache instead (and so its Triton backend); another version's could differ from this modeling code.
    """
    from ..kernels import CHECKPOINT_SOURCES, checkpoint_sources_hash

    kernels_dir = Path(__file__).resolve().parents[1] / "kernels"
    parts = ['"""Palu kernels and quantized cache, copied from hf_accel.kernels by the Palu converter."""\n']
    parts.append(f"\n_SOURCES_HASH = {checkpoint_sources_hash()!r}  # of the sources below (hf_accel.kernels)\n")
    for name in CHECKPOINT_SOURCES:
        source = (kernels_dir / name).read_text(encoding="utf-8")
        if re.search(r"^\s*from \.\w* import \($", source, flags=re.MULTILINE):
            raise RuntimeError(f"hf_accel/kernels/{name} has a multi-line relative import; flatten it")
        # the names come from the modules above, now in the same file
        source = re.sub(
            r"^(\s*)from \.(\w*) import .*$", r"\1pass  # (flattened: from .\2 import ...)", source, flags=re.MULTILINE
        )
        parts.append(f"\n# ---- from hf_accel/kernels/{name} ----\n{source}")
    path = Path(path)
    path.write_text("".join(parts) + _KERNEL_REGISTRATION, encoding="utf-8")
    return path


def save_palu(
    palu_model, tokenizer, out_dir: str | Path, info: dict, base_model: str | None, overwrite: bool = False
) -> Path:
    """
    Save a converted model as a Hub-ready directory, atomically (temporary directory, then rename).

    Writes safetensors, config (with `auto_map`), the remote code (`configuration_palu.py`, `modeling_palu.py`,
    a self-contained `palu_kernels.py`), the tokenizer, `palu_ranks.json` and a model card that says how KV heads are
    grouped.

    Args:
        palu_model: the converted model. tokenizer: its tokenizer. out_dir: the directory to create.
        info (`dict`): what [`convert_palu`] returned. base_model (`str`): Hub id or alias of the original, named by
            the card; `None` writes no card (a model without a Hub id), as [`save_care_model`] does.
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing `out_dir`.
    """
    import json

    from ..hub import save_artifact

    out = Path(out_dir)
    with atomic_output_dir(out, overwrite) as tmp:  # checks `out` (file, non-empty directory) first
        keys = ("kv_keep", "group_size", "ranks", "quant_bits", "quant_group_size", "residual_length", "hadamard")
        settings = {k: info["settings"][k] for k in keys}
        settings.update(kv_keep_achieved=round(info["kv_keep_achieved"], 4), grouping=info["grouping"])
        if info.get("calibration_source"):  # what the CLI read (`--calib`), named as CARE's card names it
            calibration = {"source": info["calibration_source"]}
            calibration.update(
                {k: info[f"calibration_{k}"] for k in ("split", "text_column") if f"calibration_{k}" in info}
            )
            calibration["num_samples"] = info["settings"]["calib_samples"]
            calibration.update(seq_len=info["settings"]["calib_seq_len"], tokens=info["calibration_tokens"])
            settings["calibration"] = ", ".join(f"{k} {v}" for k, v in calibration.items())
        if info["settings"]["residual_length"]:  # the card's bytes per token leave out this fixed cost
            # in the checkpoint's dtype, named (the card's bytes table counts 16-bit floats)
            dtype = str(palu_model.dtype).removeprefix("torch.")
            settings["window_bytes_per_sequence"] = f"{info['window_bytes_per_sequence']} ({dtype})"
        card = {"settings": settings, "kv_bytes_per_token": info["cache_bytes_per_token"]}  # also for the card
        card["base_kv_bytes_per_token"] = info["base_cache_bytes_per_token"]  # of a healed model ([`heal`])
        # the timings are printed, not published: two conversions of one model give the same files
        record = json.dumps(dict({k: v for k, v in info.items() if k != "timings"}, card=card), indent=1, default=str)
        (tmp / "palu_ranks.json").write_text(record, encoding="utf-8")
        if base_model is None:
            palu_model.save_pretrained(tmp)  # with its remote code and a self-contained `palu_kernels.py`
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            return out
        save_artifact(
            tmp,
            "converted-model",
            base_model,
            model_name=out.resolve().name,  # not the temporary directory's
            model=palu_model,
            tokenizer=tokenizer,
            description="Palu: grouped low-rank K/V projections; the cache stores per-group latents. "
            + info["grouping"],
            **card,
            papers=[_PAPER],
        )
    return out
