"""Palu conversion (spec 002, issue 4): G-LRD layout, full-rank equivalence, Hadamard folding, ranks, CLI errors."""

import copy
import json

import pytest
import torch

from hf_accel.compat import CACHE_NAME
from hf_accel.compress.palu import (
    PaluConversionConfig,
    convert_palu,
    default_group_size,
    factorize_groups,
    fisher_group_ranks,
    fold_values_into_o_proj,
    group_kv_weight,
    kfac_group_ranks,
    uniform_group_ranks,
)
from tests.conftest import make_tiny_llama, requires_transformers_adapters
from tests.tiny_checkpoints import make_char_tokenizer


CALIB_TEXT = " ".join(f"the {w} of line {i} is {w[::-1]}." for i in range(600) for w in ("cat", "house", "river"))
TINY = {"vocab_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}  # 2 query heads per KV head
FAST = {"calib_samples": 8, "calib_seq_len": 64, "fisher_samples": 3, "rank_multiple": 1, "progress": False}


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(**TINY)


def _ids(batch=2, length=12, seed=0):
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_group_kv_weight_layout():
    # 4 KV heads of dim 2: column c belongs to head c // 2
    weight = torch.arange(3 * 8).reshape(3, 8)
    groups = group_kv_weight(weight, num_key_value_heads=4, head_dim=2, group_size=2)
    assert groups.shape == (2, 3, 4)
    assert torch.equal(groups[1], weight[:, 4:8])  # group 1 = KV heads 2 and 3
    assert torch.equal(group_kv_weight(weight, 4, 2, 4)[0], weight)  # J-LRD: one group
    assert torch.equal(group_kv_weight(weight, 4, 2, 1)[3], weight[:, 6:8])  # M-LRD: one head per group
    with pytest.raises(ValueError, match="must divide"):
        group_kv_weight(weight, 4, 2, 3)
    with pytest.raises(ValueError, match=r"^weight \(3, 8\) is not \[in, 4·3\]$"):  # head_dim 3: 12 columns
        group_kv_weight(weight, 4, 3, 2)


def test_fold_values_into_o_proj_matches_per_head_attention():
    num_heads, n_kv, d, r, hidden = 8, 4, 3, 2, 5
    o_weight, v_up = (
        torch.randn(hidden, num_heads * d, dtype=torch.float64),
        torch.randn(2, r, 2 * d, dtype=torch.float64),
    )
    latents = torch.randn(2, r, dtype=torch.float64)  # attention output per group, p · H^v
    folded = fold_values_into_o_proj(o_weight, v_up, num_heads, n_kv, d)
    # reference: rebuild each head's value output, then the original o_proj
    heads = []
    for h in range(num_heads):
        kv = h // 2
        heads.append(latents[kv // 2] @ v_up[kv // 2][:, (kv % 2) * d : (kv % 2 + 1) * d])
    expected = torch.cat(heads) @ o_weight.T
    got = torch.cat([latents[(h // 2) // 2] for h in range(num_heads)]) @ folded.T
    torch.testing.assert_close(got, expected)


def test_rank_helpers_meet_the_budget():
    assert uniform_group_ranks(192, 0.5, 8, 3) == ([96] * 3, [96] * 3)
    scores = [(0.1, 1.0), (0.5, 0.2), (2.0, 0.01)]
    k_ranks, v_ranks = fisher_group_ranks(scores, width=64, num_groups=3, kv_keep=0.5, multiple=8)
    assert 3 * (sum(k_ranks) + sum(v_ranks)) == round(0.5 * 6 * 3 * 64)
    assert all(8 <= r <= 64 and r % 8 == 0 for r in k_ranks + v_ranks)
    assert v_ranks[0] > k_ranks[0] and k_ranks[2] == 64  # more Fisher, more rank; capped at full width


def test_rank_caps_are_multiples_within_the_hidden_size():
    assert uniform_group_ranks(16, 0.95, 6, 2) == ([12] * 2, [12] * 2)  # 18 rounds past the width: largest multiple
    assert uniform_group_ranks(64, 1.0, 8, 2, max_rank=32) == ([32] * 2, [32] * 2)  # a [32, 64] group has rank 32
    k_ranks, v_ranks = fisher_group_ranks([(1.0, 1.0)] * 2, 64, 1, kv_keep=0.9, multiple=8, max_rank=32)
    assert max(k_ranks + v_ranks) <= 32
    sigmas = [([torch.ones(32)], [torch.ones(32)])] * 2
    assert kfac_group_ranks(sigmas, 64, kv_keep=0.9, multiple=8, max_rank=32) == ([32] * 2, [32] * 2)


@pytest.mark.parametrize("ranks", ["uniform", "fisher", "kfac"])
def test_group_wider_than_the_hidden_size_converts_losslessly(tokenizer, ranks):
    # hidden 32, 4 KV heads of 16: a J-LRD group is 64 wide but its projection has rank 32
    wide = make_tiny_llama(vocab_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    palu, info = convert_palu(
        wide, tokenizer, kv_keep=1.0, group_size=4, ranks=ranks, calibration_text=CALIB_TEXT, **FAST
    )
    assert info["k_ranks"] == info["v_ranks"] == [32, 32]
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(palu(ids).logits, wide(ids).logits, atol=2e-5, rtol=1e-4)


def test_kfac_group_ranks_water_fill_blocks_of_summed_energy():
    width, multiple = 16, 4
    flat, steep = torch.ones(width), torch.tensor([10.0] * 4 + [0.01] * 12)
    # layer 0: K has flat spectra in both groups, V is steep; layer 1: K steep, V flat
    sigmas = [([flat, flat], [steep, steep]), ([steep, steep], [flat, 2 * flat])]
    k_ranks, v_ranks = kfac_group_ranks(sigmas, width, kv_keep=0.5, multiple=multiple)
    assert sum(k_ranks) + sum(v_ranks) == 0.5 * 4 * width  # the budget, in group-rank units
    assert all(r % multiple == 0 and multiple <= r <= width for r in k_ranks + v_ranks)
    # every target gets its first block; of the 4 blocks left, the 2x-flat V of layer 1 (block gain 4 * (1 + 4) =
    # 20) takes all 3 it can, layer 0's flat K (block gain 8) the last; steep spectra gain nothing past block 0
    assert (k_ranks, v_ranks) == ([8, 4], [4, 16])


@pytest.mark.parametrize("group_size,ranks", [(1, "uniform"), (2, "uniform"), (4, "uniform"), (2, "kfac")])
def test_full_rank_reproduces_original_logits(model, tokenizer, group_size, ranks):
    palu, info = convert_palu(
        model, tokenizer, kv_keep=1.0, group_size=group_size, ranks=ranks, calibration_text=CALIB_TEXT, **FAST
    )
    assert info["k_ranks"] == [2 * group_size * 8 // 2] * 2
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(palu(ids).logits, model(ids).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_keep", [0.25, 0.5])
def test_j_lrd_with_uniform_ranks_is_care_u(model, kv_keep):
    """Issue 4 and the README ("gs 3 is J-LRD ..., so its uniform rows are CARE-U's factorization at the same
    budget"): one group of all KV heads with uniform ranks, unrotated, is CARE-U's model, from the same statistics."""
    from hf_accel.compress.care import convert_care
    from tests.compress.care_helpers import tiny_calibration

    calibration = tiny_calibration(model)
    palu, info = convert_palu(
        model, None, kv_keep=kv_keep, group_size=4, ranks="uniform", hadamard=False, calibration=calibration,
        rank_multiple=1, progress=False,
    )  # fmt: skip
    care = convert_care(model, kv_keep=kv_keep, method="care-u", calibration=calibration, progress=False)
    assert (info["k_ranks"], info["v_ranks"]) == (care.config.care_k_ranks, care.config.care_v_ranks)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(palu(ids).logits, care(ids).logits, atol=1e-6, rtol=0)
        assert not torch.allclose(palu(ids).logits, model(ids).logits, atol=1e-3)  # truncated for real


def test_hadamard_folding_leaves_unquantized_outputs_unchanged(model, tokenizer):
    common = {"kv_keep": 0.5, "group_size": 2, "ranks": "uniform", "calibration_text": CALIB_TEXT, **FAST}
    plain, _ = convert_palu(model, tokenizer, hadamard=False, **common)
    rotated, _ = convert_palu(model, tokenizer, hadamard=True, **common)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(rotated(ids).logits, plain(ids).logits, atol=2e-5, rtol=1e-4)
        # ... while the cached latents themselves are rotated
        x = torch.randn(3, 32)
        assert not torch.allclose(
            rotated.model.layers[0].self_attn.k_down(x), plain.model.layers[0].self_attn.k_down(x)
        )


def test_hadamard_reduces_low_bit_error(model, tokenizer):
    common = {"kv_keep": 0.5, "group_size": 4, "ranks": "uniform", "calibration_text": CALIB_TEXT, **FAST}
    ids = _ids(4, 32)
    with torch.no_grad():
        ref = convert_palu(model, tokenizer, quant_bits=0, **common)[0](ids).logits
        errors = {
            h: (convert_palu(model, tokenizer, quant_bits=2, hadamard=h, **common)[0](ids).logits - ref).norm()
            for h in (False, True)
        }
    assert errors[True] < errors[False]


def test_fisher_conversion_meets_budget(model, tokenizer):
    palu, info = convert_palu(
        model, tokenizer, kv_keep=0.5, group_size=2, ranks="fisher", calibration_text=CALIB_TEXT, **FAST
    )
    assert info["kv_keep_achieved"] == 0.5
    assert palu.config.palu_k_ranks == info["k_ranks"] and len(info["fisher_scores"]) == 2


def test_bad_inputs_raise_clear_errors(model, tokenizer):
    with pytest.raises(ValueError, match="kv_keep"):
        convert_palu(model, tokenizer, kv_keep=1.5, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="must divide"):
        convert_palu(model, tokenizer, group_size=3, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="quant_bits"):
        convert_palu(model, tokenizer, quant_bits=5, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="needs calibration text"):
        convert_palu(model, tokenizer, **FAST)
    with pytest.raises(ValueError, match="pass calibration_text or calibration_ids, not both"):
        convert_palu(model, tokenizer, calibration_text=CALIB_TEXT, calibration_ids=torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="calibration text too short"):
        convert_palu(model, tokenizer, calibration_text="too short", **FAST)
    with pytest.raises(ValueError, match="quant_group_size must be 0 .* or divide rank_multiple 8"):
        convert_palu(model, tokenizer, rank_multiple=8, quant_group_size=3, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="residual_length is a full-precision window of a quantized cache"):
        convert_palu(model, tokenizer, residual_length=16, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="residual_length must be a non-negative integer"):
        convert_palu(model, tokenizer, quant_bits=3, residual_length=-1, calibration_text=CALIB_TEXT)
    with pytest.raises(ValueError, match="kernel_backend must be one of"):  # before anything else: no calibration
        convert_palu(model, tokenizer, kernel_backend="trtion")


def test_numpy_integers_are_taken_as_ints_and_bools_or_floats_refused():
    import dataclasses

    import numpy as np

    config = PaluConversionConfig(
        group_size=np.int64(2), rank_multiple=np.int32(8), quant_bits=np.int64(3), quant_group_size=np.int64(4),
        residual_length=np.int64(16), calib_samples=np.int64(8), calib_seq_len=np.int64(32),
        fisher_samples=np.int64(4), seed=np.int64(1),
    )  # fmt: skip
    settings = dataclasses.asdict(config)
    assert json.loads(json.dumps(settings)) == settings  # what the saved checkpoint's JSON takes
    integers = ("group_size", "rank_multiple", "quant_bits", "quant_group_size", "calib_samples", "calib_seq_len")
    assert all(type(settings[k]) is int for k in (*integers, "fisher_samples", "seed"))
    for bad, message in [
        ({"rank_multiple": 8.0}, "rank_multiple must be a positive integer"),
        ({"group_size": True}, "group_size must be a positive integer"),
        ({"quant_bits": 3.0}, "quant_bits must be one of"),
        ({"quant_bits": np.float32(3.0)}, "quant_bits must be one of"),  # not a Python float, yet == 3
        ({"quant_bits": np.False_}, "quant_bits must be one of"),  # not a Python bool, yet == 0
        ({"quant_group_size": -1}, "quant_group_size must be a non-negative integer"),
        ({"calib_seq_len": 1}, "calib_seq_len must be an integer ≥ 2, got 1"),
        ({"ranks": "fisher", "fisher_samples": 0}, "fisher_samples must be a positive integer"),
        ({"ranks": "fishr"}, "^unknown rank allocation 'fishr'; choose one of uniform, fisher, kfac$"),
    ]:
        with pytest.raises(ValueError, match=message):
            PaluConversionConfig(**bad)


@requires_transformers_adapters
def test_a_model_with_peft_adapters_is_refused_before_calibration(tokenizer, monkeypatch):
    # the adapters' deltas are not in the base weights that are factorized and copied: merge first
    from peft import LoraConfig

    import hf_accel.compress.palu as palu_module

    adapted = make_tiny_llama(**TINY)
    adapted.add_adapter(LoraConfig(target_modules=["k_proj"], r=2, init_lora_weights=False))
    monkeypatch.setattr(palu_module, "collect_kv_calibration", lambda *a, **k: pytest.fail("calibrated"))
    with pytest.raises(ValueError, match="Palu converts plain weights, and this model has PEFT adapters loaded"):
        convert_palu(adapted, tokenizer, kv_keep=0.5, calibration_text=CALIB_TEXT, **FAST)


def test_default_group_size_divides_the_kv_heads(model, tokenizer):
    assert [default_group_size(n) for n in (1, 2, 3, 4, 5, 6, 8, 32)] == [1, 2, 3, 4, 1, 3, 4, 4]
    palu, info = convert_palu(model, tokenizer, kv_keep=0.5, ranks="uniform", calibration_text=CALIB_TEXT, **FAST)
    assert palu.config.palu_group_size == 4 == info["settings"]["group_size"]  # TINY has 4 KV heads


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("qwen2", {}, "^Palu supports the llama model family, got 'qwen2'$"),
        ("llama", {"attention_bias": True}, r"^Palu does not support attention biases \(attention_bias=True\)$"),
    ],
)
def test_a_model_outside_the_llama_family_or_with_attention_biases_is_refused(
    tokenizer, family, overrides, message, monkeypatch
):
    import hf_accel.compress.palu as palu_module
    from tests.compress.care_helpers import make_tiny

    monkeypatch.setattr(palu_module, "collect_kv_calibration", lambda *a, **k: pytest.fail("calibrated"))
    with pytest.raises(ValueError, match=message):
        convert_palu(
            make_tiny(family, **TINY, **overrides), tokenizer, kv_keep=0.5, calibration_text=CALIB_TEXT, **FAST
        )


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_that_changes_at_run_time_is_refused(tokenizer, rope_type):
    # keys are RoPE'd at attention time with fixed frequencies: these would drift past the trained length
    parameters = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        parameters.update(short_factor=[1.0] * 4, long_factor=[4.0] * 4, original_max_position_embeddings=16)
    wide = make_tiny_llama(**TINY, rope_parameters=parameters, max_position_embeddings=64)
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
        convert_palu(wide, tokenizer, kv_keep=0.5, calibration_text=CALIB_TEXT, **FAST)


def test_the_convert_command_group_holds_both_converters():
    """Both converters' command lines live in `hf_accel.compress.cli`, as the module's name says: `convert palu` was
    registered from the converter module by reaching into the group's subparsers after CARE's module made it."""
    import argparse

    from hf_accel.compress.cli import add_cli, run_convert_care, run_convert_palu

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    for converter, run in (("care", run_convert_care), ("palu", run_convert_palu)):
        assert parser.parse_args(["convert", converter, "--kv-keep", "0.5", "--out", "x"]).func is run


def test_command_line_defaults_are_the_python_api_defaults():
    """`convert care|palu` with only the required options convert as `convert_care` / `convert_palu` do with only
    theirs, with the defaults the README compares with the specs (256 × 32 CARE calibration, α = 0.05; Palu: gs
    from the KV heads, Fisher ranks, 64 × 256 calibration, 16 Fisher sequences, multiples of 8, seed 3)."""
    import argparse
    import inspect

    from hf_accel.compress.care import CareConversionConfig, prepare_calibration
    from hf_accel.compress.cli import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    care = parser.parse_args(["convert", "care", "--kv-keep", "0.5", "--out", "x"])
    calib = {k: p.default for k, p in inspect.signature(prepare_calibration).parameters.items()}
    config = CareConversionConfig()
    assert (care.method, care.alpha, care.absorb_value) == (config.method, config.alpha, config.absorb_value)
    assert (care.calib, care.calib_samples, care.calib_seq_len, care.seed) == (
        calib["calib"],
        calib["num_samples"],
        calib["seq_len"],
        calib["seed"],
    )
    assert (care.calib_samples, care.calib_seq_len, care.alpha) == (256, 32, 0.05)
    palu = parser.parse_args(["convert", "palu", "--kv-keep", "0.5", "--out", "x"])
    config = PaluConversionConfig()
    for name in ("group_size", "ranks", "quant_bits", "quant_group_size", "residual_length", "calib_samples"):
        assert getattr(palu, name) == getattr(config, name), name
    for name in ("calib_seq_len", "fisher_samples", "rank_multiple"):
        assert getattr(palu, name) == getattr(config, name), name
    assert palu.no_hadamard is not config.hadamard and palu.calib == "generated"
    assert (config.ranks, config.calib_samples, config.calib_seq_len, config.fisher_samples) == ("fisher", 64, 256, 16)
    assert (config.rank_multiple, config.seed, config.alpha) == (8, 3, 0.05)


def test_cli_checks_the_model_before_calibrating(tmp_path, model, tokenizer, capsys, monkeypatch):
    import hf_accel.compress.calibration as calibration_module
    from hf_accel.cli import main

    src = tmp_path / "tiny"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before checking the model")

    monkeypatch.setattr(calibration_module, "load_calibration_ids", no_calibration)
    argv = ["convert", "palu", "--model", str(src), "--out", str(tmp_path / "o"), "--base-model", "org/tiny"]
    assert main(argv + ["--kv-keep", "0.5", "--group-size", "3"]) == 2
    assert main(argv + ["--kv-keep", "0.5", "--rank-multiple", "512"]) == 2
    err = capsys.readouterr().err
    assert "group_size 3 must divide" in err and "rank_multiple 512 exceeds" in err


def test_more_fisher_samples_than_calibration_sequences_is_an_error(tmp_path, model, capsys):
    """Fisher scores come from the first `fisher_samples` calibration sequences: with fewer sequences than that, 4 were
    used while the checkpoint's record said 16. Refused in one line, by the command line before the model loads."""
    from hf_accel.cli import main

    options = {"kv_keep": 0.5, "calibration_ids": _ids(batch=4, length=16), "rank_multiple": 1, "progress": False}
    with pytest.raises(ValueError, match="fisher_samples 16 exceeds the 4 calibration sequences"):
        convert_palu(model, None, fisher_samples=16, **options)
    _, info = convert_palu(model, None, fisher_samples=4, **options)  # all of them
    assert info["settings"]["fisher_samples"] == 4
    convert_palu(model, None, ranks="uniform", fisher_samples=16, **options)  # no Fisher scores: nothing to refuse
    argv = [
        "convert",
        "palu",
        "--model",
        str(tmp_path / "not-loaded"),
        "--out",
        str(tmp_path / "o"),
        "--kv-keep",
        "0.5",
    ]
    assert main(argv + ["--calib-samples", "8", "--fisher-samples", "16"]) == 2
    assert "fisher_samples 16 exceeds the 8 calibration sequences" in capsys.readouterr().err


def test_quant_group_size_sets_scales_per_channel_group(model, tokenizer):
    # 4 channels per scale/zero-point: the measured cache bytes are those of 4-channel groups, and the finer grid
    # quantizes closer to the float model than one scale per latent does
    common = {"kv_keep": 0.5, "group_size": 2, "ranks": "uniform", "calibration_text": CALIB_TEXT, "quant_bits": 2}
    common.update(FAST, rank_multiple=4)
    ids = _ids(4, 32)
    with torch.no_grad():
        ref = convert_palu(model, tokenizer, **{**common, "quant_bits": 0})[0](ids).logits
        whole, info_whole = convert_palu(model, tokenizer, **common)
        fine, info_fine = convert_palu(model, tokenizer, quant_group_size=4, **common)
        assert fine.config.palu_quant_group_size == 4
        assert (fine(ids).logits - ref).norm() < (whole(ids).logits - ref).norm()
    rank_sum = 2 * (sum(info_fine["k_ranks"]) + sum(info_fine["v_ranks"]))  # 2 groups per layer
    extra_groups = rank_sum // 4 - 2 * 2 * len(info_fine["k_ranks"])  # scale/zero pairs beyond one per latent
    assert info_fine["cache_bytes_per_token"] - info_whole["cache_bytes_per_token"] == extra_groups * 4


def test_cli_convert_palu(tmp_path, model, tokenizer, capsys):
    from hf_accel.cli import main

    src = tmp_path / "tiny"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB_TEXT)
    out = tmp_path / "palu"
    base = [
        "convert",
        "palu",
        "--model",
        str(src),
        "--calib",
        str(calib),
        "--out",
        str(out),
        "--base-model",
        "org/tiny",
    ]
    fast = ["--calib-samples", "4", "--calib-seq-len", "32", "--fisher-samples", "2", "--rank-multiple", "2"]
    assert main(base + ["--kv-keep", "1.5"]) == 2
    assert main(base + ["--kv-keep", "0.5", "--group-size", "3"] + fast) == 2
    err = capsys.readouterr().err
    assert "kv_keep must be in (0, 1]" in err and "group_size 3 must divide" in err
    assert not out.exists() and not list(tmp_path.glob(".palu-*"))  # nothing half-written
    quant = ["--quant-bits", "3", "--quant-group-size", "2", "--residual-length", "4", "--json"]
    assert main(base + ["--kv-keep", "0.5", "--group-size", "2"] + quant + fast) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kv_keep_achieved"] == 0.5 and summary["quant_bits"] == 3 and summary["quant_group_size"] == 2
    rank_sum = 2 * (sum(summary["k_ranks"]) + sum(summary["v_ranks"]))  # 2 groups per layer
    # the window's latents are in the checkpoint's dtype (float32 here), their positions int64, one per layer
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert summary["residual_length"] == 4 and summary["window_bytes_per_sequence"] == 4 * (rank_sum * 4 + layers * 8)
    config = json.loads((out / "config.json").read_text())
    assert config["palu_quant_group_size"] == 2 and config["palu_residual_length"] == 4
    card = (out / "README.md").read_text()
    assert f"`window_bytes_per_sequence` | `{summary['window_bytes_per_sequence']} (float32)`" in card
    assert "| `calibration` | `source calib.txt, num_samples 4, seq_len 32, tokens 128` |" in card  # not its path
    assert str(tmp_path) not in card + (out / "palu_ranks.json").read_text()
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_palu.py",
        "configuration_palu.py",
        "palu_kernels.py",
        "README.md",
        "palu_ranks.json",
    } <= names
    assert "2 group(s) of 2 consecutive KV heads" in (out / "README.md").read_text()


def test_cli_convert_palu_reads_and_names_a_dataset_split_and_column(tmp_path, model, tokenizer, capsys):
    import datasets

    from hf_accel.cli import main

    src = tmp_path / "tiny"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    held = datasets.Dataset.from_dict({"body": [CALIB_TEXT]})
    datasets.DatasetDict({"validation": held}).save_to_disk(str(tmp_path / "corpus"))
    argv = ["convert", "palu", "--model", str(src), "--calib", f"hf:{tmp_path / 'corpus'}", "--kv-keep", "0.5"]
    argv += ["--calib-samples", "4", "--calib-seq-len", "32", "--ranks", "uniform", "--rank-multiple", "2"]
    argv += ["--out", str(tmp_path / "palu"), "--base-model", "org/tiny"]
    assert main(argv) == 2  # split `train`, column `text` by default: neither is there
    assert "no split 'train'" in capsys.readouterr().err
    assert main(argv + ["--calib-split", "validation", "--calib-text-column", "body"]) == 0
    card = (tmp_path / "palu" / "README.md").read_text()
    assert "`source hf:corpus, split validation, text_column body, num_samples 4," in card


def test_cli_convert_palu_generated_calibration(tmp_path, model, tokenizer, capsys):
    # `--calib generated` (the default): the model's own samples calibrate, as for CARE; no text file needed
    from hf_accel.cli import main

    src = tmp_path / "tiny"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "palu"
    argv = ["convert", "palu", "--model", str(src), "--out", str(out), "--base-model", "org/tiny", "--kv-keep", "0.5"]
    argv += ["--group-size", "2", "--calib-samples", "3", "--calib-seq-len", "8", "--fisher-samples", "2", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kv_keep_achieved"] == 0.5 and (out / "model.safetensors").is_file()
    # a budget below one rank multiple per group is kept at that floor, and said so; the text summary is rounded
    small = [a if a != "0.5" else "0.05" for a in argv[:-1]] + ["--rank-multiple", "8", "--overwrite"]
    assert main(small) == 0
    captured = capsys.readouterr()
    assert "warning: ranks in multiples of 8 keep 0.5 of the cache, not 0.05" in captured.err
    lines = {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in captured.out.splitlines()}
    assert lines["kv_keep_achieved"] == "0.5" and lines["timings"].startswith("calibration_s ")
    # and a full budget in multiples that do not divide the group width (16) stays below it, also said so
    full = [a if a != "0.5" else "1.0" for a in argv[:-1]] + ["--rank-multiple", "3", "--overwrite"]
    assert main(full) == 0
    assert "warning: ranks in multiples of 3 keep 0.938 of the cache, not 1" in capsys.readouterr().err


def test_calibration_ids_replace_text(model, tokenizer):
    from hf_accel.compress.calibration import tokenize_calibration_text

    common = {"kv_keep": 0.5, "group_size": 2, "ranks": "fisher", **FAST}
    ids = tokenize_calibration_text(tokenizer, CALIB_TEXT, FAST["calib_samples"], FAST["calib_seq_len"], seed=3)
    from_text, info_text = convert_palu(model, tokenizer, calibration_text=CALIB_TEXT, **common)
    from_ids, info_ids = convert_palu(model, tokenizer, calibration_ids=ids, **common)
    assert info_ids["k_ranks"] == info_text["k_ranks"] and info_ids["fisher_scores"] == info_text["fisher_scores"]
    with torch.no_grad():
        torch.testing.assert_close(from_ids(_ids()).logits, from_text(_ids()).logits)


def test_default_model_full_rank_and_3bit(default_model, shakespeare_text):
    """SmolLM2-135M (30 layers, 3 KV heads): gs 3 at full rank is exact; gs 1 at 0.5 with 3 bits decodes."""
    model, tokenizer = default_model
    from hf_accel.compress.calibration import collect_kv_calibration, tokenize_calibration_text

    calib_ids = tokenize_calibration_text(tokenizer, shakespeare_text[:100_000], 4, 64)
    calib = {"calibration": collect_kv_calibration(model, calib_ids, progress=False), "progress": False}
    ids = tokenizer("To be, or not to be, that is the question:", return_tensors="pt")["input_ids"]
    full, _ = convert_palu(model, tokenizer, kv_keep=1.0, group_size=3, ranks="uniform", **calib)
    with torch.no_grad():
        torch.testing.assert_close(full(ids).logits, model(ids).logits, atol=2e-3, rtol=1e-3)
    low, info = convert_palu(model, tokenizer, kv_keep=0.5, group_size=1, ranks="uniform", quant_bits=3, **calib)
    assert "3 group(s) of 1 consecutive KV heads" in info["grouping"]
    out = low.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = out[CACHE_NAME]
    assert cache.get_cache_bytes() == cache.get_seq_length() * info["cache_bytes_per_token"]
    assert info["cache_bytes_per_token"] <= info["base_cache_bytes_per_token"] / 8


def test_kfac_conversion_meets_budget_and_needs_gradient_moments(model, tokenizer):
    from hf_accel.compress.calibration import collect_kv_calibration

    common = {"kv_keep": 0.5, "group_size": 2, "ranks": "kfac", **FAST}
    palu, info = convert_palu(model, tokenizer, calibration_text=CALIB_TEXT, **common)
    assert info["kv_keep_achieved"] == 0.5 and palu.config.palu_v_ranks == info["v_ranks"]
    no_grads = collect_kv_calibration(model, _ids(4, 32), progress=False)
    with pytest.raises(ValueError, match="output-gradient moments"):
        convert_palu(model, tokenizer, calibration=no_grads, **common)


def test_cli_saves_the_source_dtype(tmp_path, model, tokenizer, capsys):
    from safetensors.torch import load_file

    from hf_accel.cli import main

    src = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(src)  # the module's fixture stays float32
    tokenizer.save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB_TEXT)
    out = tmp_path / "palu"
    argv = ["convert", "palu", "--model", str(src), "--calib", str(calib), "--out", str(out), "--base-model", "o/t"]
    argv += ["--kv-keep", "0.5", "--ranks", "uniform", "--quant-bits", "3", "--residual-length", "4", "--json"]
    argv += ["--calib-samples", "4", "--calib-seq-len", "32", "--rank-multiple", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    floats = {t.dtype for t in load_file(out / "model.safetensors").values() if t.is_floating_point()}
    assert floats == {torch.bfloat16}
    rank_sum = sum(summary["k_ranks"]) + sum(summary["v_ranks"])  # one group of 4 KV heads
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert summary["window_bytes_per_sequence"] == 4 * (rank_sum * 2 + layers * 8)  # bfloat16 latents


def test_uniform_group_rank_rounds_to_the_nearest_multiple():
    assert uniform_group_ranks(64, 0.45, 8, 1) == ([32], [32])  # 28.8 is 3.6 multiples of 8: 4, not 3


def test_kfac_gains_are_squared_singular_values():
    # K: σ = 2, 2 | 2, 2 (second block: Σσ = 4, Σσ² = 8); V: σ = 3, 3 | 3, 0.5 (Σσ = 3.5, Σσ² = 9.25): the third
    # block of the budget goes to V, whose block removes more of the loss estimate
    sigmas = [([torch.full((4,), 2.0)], [torch.tensor([3.0, 3.0, 3.0, 0.5])])]
    assert kfac_group_ranks(sigmas, 4, kv_keep=0.75, multiple=2) == ([2], [4])


def test_factorize_groups_weights_each_group_by_its_own_gradient_block():
    # S = I, no shrinkage: the σ² of group g are the eigenvalues of W_gᵀ W_g G_gg (similar to √G W_gᵀ W_g √G)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 8, generator=gen, dtype=torch.float64)  # 4 KV heads of dim 2, groups of 2 heads
    grads = torch.randn(30, 8, generator=gen, dtype=torch.float64) * torch.arange(1.0, 9.0, dtype=torch.float64)
    out_moment = grads.T @ grads / 30
    eye = torch.eye(6, dtype=torch.float64)
    groups = factorize_groups(weight, (eye, eye), 4, 2, 2, out_moment=out_moment, alpha=0.0, lam_frac=0.0)
    for g, factors in enumerate(groups):
        cols = slice(4 * g, 4 * (g + 1))
        w_g = weight[:, cols]
        expected = torch.linalg.eigvals(w_g.T @ w_g @ out_moment[cols, cols]).real.sort(descending=True).values
        torch.testing.assert_close(factors.sigma**2, expected, rtol=1e-8, atol=1e-10)


def test_fisher_budget_rounds_to_the_nearest_unit():
    # 0.47 · 2 targets · 64 = 60.2 ranks = 7.52 units of 8: 8 units, 32 ranks each for equal scores
    assert fisher_group_ranks([(1.0, 1.0)], 64, 1, kv_keep=0.47, multiple=8) == ([32], [32])


def test_hadamard_rotates_both_key_and_value_latents(model, tokenizer):
    from hf_accel.compress.calibration import collect_kv_calibration
    from hf_accel.kernels.hadamard import apply_hadamard

    calibration = collect_kv_calibration(model, _ids(4, 32), progress=False)
    common = dict(kv_keep=0.5, group_size=2, ranks="uniform", calibration=calibration, **FAST)
    plain, _ = convert_palu(model, tokenizer, hadamard=False, **common)
    rotated, _ = convert_palu(model, tokenizer, hadamard=True, **common)
    x = torch.randn(5, model.config.hidden_size)
    for name in ("k_down", "v_down"):
        latent = x @ getattr(plain.model.layers[0].self_attn, name).weight.T  # [5, n_g · r]
        expected = apply_hadamard(latent.view(5, 2, -1)).view(5, -1)  # one rotation per group
        got = x @ getattr(rotated.model.layers[0].self_attn, name).weight.T
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", ["linear", "yarn", "llama3"])
def test_full_rank_reproduces_original_logits_for_each_rope_type(tokenizer, rope):
    """Past `original_max_position_embeddings` (40 positions against 16). Unquantized only: here the RoPE type moves
    the logits by 2e-3 to 4e-3, 4-bit latents by 2e-2."""
    from tests.models.test_care_modeling import ROPE_VARIANTS

    wide = make_tiny_llama(**TINY, rope_parameters=dict(ROPE_VARIANTS[rope]), max_position_embeddings=64)
    palu, _ = convert_palu(wide, tokenizer, kv_keep=1.0, group_size=2, calibration_text=CALIB_TEXT, **FAST)
    ids = _ids(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(palu(ids).logits, wide(ids).logits, atol=2e-5, rtol=1e-4)
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[0, :3] = 0
    kwargs = {"input_ids": ids[:, :8], "attention_mask": attention_mask, "max_new_tokens": 30, "do_sample": False}
    assert torch.equal(palu.generate(**kwargs), wide.generate(**kwargs))


def test_a_calibration_or_fisher_scores_of_another_model_are_refused(model, tokenizer):
    from tests.compress.care_helpers import tiny_calibration

    other = make_tiny_llama(**dict(TINY, num_hidden_layers=3))
    common = dict(kv_keep=0.5, group_size=2, calibration_text=CALIB_TEXT, **FAST)
    with pytest.raises(ValueError, match="calibration does not fit this model"):
        convert_palu(model, tokenizer, ranks="uniform", calibration=tiny_calibration(other), **common)
    with pytest.raises(ValueError, match="fisher_scores has 3"):
        convert_palu(model, tokenizer, ranks="fisher", fisher_scores=[(1.0, 1.0)] * 3, **common)


def test_calibration_ids_that_are_not_rows_of_two_tokens_are_refused(model):
    """1-D ids died inside the model's attention; one-token rows gave all-zero Fisher scores and a silent even split."""
    from hf_accel.compress.fisher import collect_fisher_scores

    for ids in (_ids(length=12)[0], _ids(length=1), _ids().tolist()):
        with pytest.raises(ValueError, match=r"calibration ids must be an integer tensor \[num_samples, seq_len\]"):
            convert_palu(model, None, kv_keep=0.5, ranks="fisher", calibration_ids=ids, progress=False)
    with pytest.raises(ValueError, match="seq_len >= 2"):
        collect_fisher_scores(model, _ids(length=1), progress=False)


def _tensors_of(value):
    """The tensors a calibration, a `(S, S⁻¹)` pair or low-rank factors hold."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_of(item)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for name in value.__dataclass_fields__ for t in _tensors_of(getattr(value, name))]
    return []


@pytest.mark.parametrize("ranks", ["fisher", "kfac"])
def test_statistics_and_full_factors_are_freed_before_the_converted_model_is_built(
    model, tokenizer, monkeypatch, ranks
):
    """The original and the converted model coexist while the latter is built, the conversion's peak. By then the
    statistics of a calibration made for this conversion, their whitening scales (every layer's: 2·hidden² float64
    numbers a layer, 8.6 GB at Llama-3-8B's shapes) and the full-rank factors must be gone."""
    import gc
    import weakref

    import hf_accel.compress.palu as palu_module

    made = []

    def tracked(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            made.extend(weakref.ref(t) for t in _tensors_of(out))
            return out

        return wrapper

    for name in ("collect_kv_calibration", "symmetric_sqrt", "factorize"):
        monkeypatch.setattr(palu_module, name, tracked(getattr(palu_module, name)))
    build, alive = palu_module.build_palu_model, []

    def counting_build(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
        return build(*args, **kwargs)

    monkeypatch.setattr(palu_module, "build_palu_model", counting_build)
    convert_palu(model, tokenizer, kv_keep=0.5, group_size=2, ranks=ranks, calibration_text=CALIB_TEXT, **FAST)
    assert made and alive == [0]


def test_a_checkpoint_does_not_depend_on_how_long_its_conversion_took(tmp_path, model, tokenizer):
    """`palu_ranks.json` is published with the checkpoint: it held the conversion's timings, so two conversions of one
    model with one calibration gave checkpoints that differ (and another Hub commit)."""
    from hf_accel.compress.palu import save_palu

    palu, info = convert_palu(model, tokenizer, calibration_text=CALIB_TEXT, **FAST)
    slower = dict(info, timings={name: seconds + 1.5 for name, seconds in info["timings"].items()})
    for name, record in (("a", info), ("b", slower)):
        save_palu(palu, tokenizer, tmp_path / name / "palu", record, base_model="org/tiny")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for file in files:
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def _whitened_group_reconstruction(weight, moment, group_cols, rank, alpha=0.05, lam_frac=1e-2):
    """The spec's truncation-aware SVD of one group written out: `S = √C_λ` by eigh, `Ŵ_g = S⁻¹ U_r Σ_r V_rᵀ`."""
    eye = torch.eye(moment.shape[0], dtype=torch.float64)
    shrunk = (1 - alpha) * moment + alpha * lam_frac * torch.linalg.eigvalsh(moment).max() * eye
    evals, evecs = torch.linalg.eigh(shrunk)
    root = evecs @ torch.diag(evals.sqrt()) @ evecs.T
    u, sigma, vt = torch.linalg.svd(root @ weight.double()[:, group_cols], full_matrices=False)
    return torch.linalg.solve(root, u[:, :rank] * sigma[:rank]) @ vt[:rank], sigma


def test_group_factors_whiten_by_the_shrunk_moment_and_keep_sigma_in_the_down_projection():
    """Choices on spec 002 §2.1 (the Palu code: Cholesky of the raw Gram matrix, √Σ on each side): the whitening is
    CARE's symmetric root of the shrunk moment `C_λ`, and Σ goes whole into the down-projection `A = S⁻¹ U Σ`, so
    each group's reconstruction `B = Vᵀ` has orthonormal rows (a latent's quantization error reaches the keys and
    values unamplified)."""
    from hf_accel.compress.factorize import shrink_moment, symmetric_sqrt

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=gen, dtype=torch.float64) @ torch.randn(
        12, 12, generator=gen, dtype=torch.float64
    )
    moment = x.T @ x / 200
    weight = torch.randn(12, 16, generator=gen, dtype=torch.float64)  # 4 KV heads of dim 4, groups of 2 heads
    groups = factorize_groups(weight, symmetric_sqrt(shrink_moment(moment)), 4, 4, 2)
    for g, factors in enumerate(groups):
        cols = slice(8 * g, 8 * (g + 1))
        expected, sigma = _whitened_group_reconstruction(weight, moment, cols, 3)
        torch.testing.assert_close(factors.sigma, sigma, rtol=1e-9, atol=1e-12)  # C_λ, not the raw moment
        down, up = factors.truncate(3)
        torch.testing.assert_close(down @ up, expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(factors.up @ factors.up.T, torch.eye(8, dtype=torch.float64))


@pytest.mark.parametrize("group_size", [1, 2])
def test_truncated_conversion_is_the_original_with_each_group_replaced_by_its_reconstruction(model, group_size):
    """Below full rank, with K and V ranks that differ per layer (Fisher) and the Hadamard rotation folded in, the
    float-latent model is the original with every group `W_g` of consecutive KV heads replaced by `Ŵ_g`."""
    from hf_accel.compress.calibration import collect_kv_calibration

    calibration = collect_kv_calibration(model, _ids(batch=8, length=16, seed=1), progress=False)
    palu, info = convert_palu(
        model,
        None,
        kv_keep=0.5,
        group_size=group_size,
        calibration=calibration,
        fisher_scores=[(1.0, 3.0), (2.0, 0.5)],
        **FAST,
    )
    assert info["k_ranks"] != info["v_ranks"] and info["k_ranks"][0] != info["k_ranks"][1]
    reference, width = copy.deepcopy(model), group_size * model.config.head_dim
    for idx, layer in enumerate(reference.model.layers):
        for proj, rank in (
            (layer.self_attn.k_proj, info["k_ranks"][idx]),
            (layer.self_attn.v_proj, info["v_ranks"][idx]),
        ):
            weight = proj.weight.detach().T
            groups = range(weight.shape[1] // width)
            rebuilt = [
                _whitened_group_reconstruction(
                    weight, calibration.moments[idx], slice(g * width, (g + 1) * width), rank
                )[0]
                for g in groups
            ]
            proj.weight.data = torch.cat(rebuilt, dim=1).T.to(proj.weight.dtype)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(palu(ids).logits, reference(ids).logits, atol=2e-5, rtol=1e-4)
