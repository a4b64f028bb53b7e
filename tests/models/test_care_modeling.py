"""CARE model classes on tiny random models of every supported family (Llama, Mistral, Qwen2 with biases, Qwen3)."""

import copy
import functools
import os
import subprocess
import sys

import pytest
import torch

from hf_accel.compat import CACHE_NAME
from hf_accel.compress.care import CareConversionConfig, convert_care, run_care_conversion, save_care_model
from hf_accel.eval.memory import cache_bytes_per_token
from tests.compress.care_helpers import FAMILIES, make_tiny, tiny_calibration


# Full-rank conversion: float32 logits agree with the original's to this absolute tolerance (seen: ~2e-7).
FULL_RANK_ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def family_setup(request):
    model = make_tiny(request.param)
    return request.param, model, tiny_calibration(model)


def _ids(seed=1, shape=(2, 12)):
    return torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["care", "care-u", "care-e-raw", "svd", "asvd"])
@pytest.mark.parametrize("absorb_value", [False, True])
def test_full_rank_reproduces_original_logits(family_setup, method, absorb_value):
    _, model, calibration = family_setup
    care = convert_care(
        model, kv_keep=1.0, method=method, calibration=calibration, absorb_value=absorb_value, progress=False
    )
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(care(ids).logits, model(ids).logits, atol=FULL_RANK_ATOL, rtol=0)


def test_cache_holds_latents_and_bytes_match_ranks(family_setup):
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    ranks_k, ranks_v = care.config.care_k_ranks, care.config.care_v_ranks
    assert sum(ranks_k) + sum(ranks_v) == round(0.5 * 2 * 2 * 16)
    with torch.no_grad():
        cache = care(_ids(), use_cache=True)[CACHE_NAME]
    for layer, rk, rv in zip(cache.layers, ranks_k, ranks_v):
        assert layer.keys.shape == (2, 1, 12, rk) and layer.values.shape == (2, 1, 12, rv)
    assert cache_bytes_per_token(cache, batch_size=2) == (sum(ranks_k) + sum(ranks_v)) * 4  # float32


def test_absorbed_value_matches_unabsorbed(family_setup):
    _, model, calibration = family_setup
    plain = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    absorbed = convert_care(model, kv_keep=0.5, calibration=calibration, absorb_value=True, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(absorbed(_ids()).logits, plain(_ids()).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absorb_value", [False, True])
def test_truncated_conversion_is_the_original_with_each_projection_replaced_by_its_reconstruction(
    family_setup, absorb_value
):
    """Below full rank the converted model is the original with every `W` replaced by `W_a W_b` (spec Stage 5):
    each layer's K and V get their own ranks, and a K/V bias (Qwen2) is kept exactly on the up-projection rather than
    factorized with the weight (TransMLA's constant-1 input column, spec Stage 5)."""
    from hf_accel.compress.care import allocate_ranks, build_care_model, factorize_kv

    _, model, calibration = family_setup
    config = CareConversionConfig(kv_keep=0.4)  # the default method: two-sided factors, water-filled ranks
    factors = factorize_kv(model, calibration, config.method, config)
    k_ranks, v_ranks = allocate_ranks(factors, config.kv_keep, config.method)
    assert k_ranks != v_ranks  # a K/V or layer mix-up of the ranks would show
    reference = copy.deepcopy(model)
    for layer, (fk, fv), rk, rv in zip(reference.model.layers, factors, k_ranks, v_ranks):
        for proj, f, rank in ((layer.self_attn.k_proj, fk, rk), (layer.self_attn.v_proj, fv, rv)):
            down, up = f.truncate(rank)
            proj.weight.data = (down @ up).T.to(proj.weight.dtype)
    care = build_care_model(model, factors, k_ranks, v_ranks, absorb_value)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(care(ids).logits, reference(ids).logits, atol=FULL_RANK_ATOL, rtol=0)


def test_incremental_decoding_crop_and_gather(family_setup):
    """Latent caches survive the speculative engine's sequence-axis crop and index-select."""
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    ids = _ids(shape=(2, 10))
    with torch.no_grad():
        full = care(ids).logits
        # prefill 6, then decode the rest one token at a time
        out = care(ids[:, :6], use_cache=True)
        cache, steps = out[CACHE_NAME], [out.logits]
        for t in range(6, 10):
            out = care(ids[:, t : t + 1], **{CACHE_NAME: cache}, use_cache=True)
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        # crop back to 7 tokens and redo the last three
        cache.crop(-3)  # transformers 5: a negative count of tokens to remove
        redo = care(ids[:, 7:], **{CACHE_NAME: cache}, use_cache=True).logits
        torch.testing.assert_close(redo, full[:, 7:], atol=1e-5, rtol=1e-5)
        # a "tree" of two rejected tokens then the accepted ones, verified with explicit positions, then gathered
        cache = care(ids[:, :6], use_cache=True)[CACHE_NAME]
        junk = _ids(seed=9, shape=(2, 2))
        block = torch.cat([junk, ids[:, 6:8]], 1)
        positions = torch.tensor([[6, 7, 6, 7]]).expand(2, -1)
        mask = torch.full((4, 10), float("-inf"))
        mask[:, :6] = 0
        mask[[0, 1, 1, 2, 3, 3], [6, 6, 7, 8, 8, 9]] = 0  # node i sees its own path only
        mask = mask[None, None].expand(2, 1, 4, 10)
        tree = care(block, **{CACHE_NAME: cache}, position_ids=positions, attention_mask=mask, use_cache=True).logits
        torch.testing.assert_close(tree[:, 2:], full[:, 6:8], atol=1e-5, rtol=1e-5)
        keep = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9])
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            if hasattr(layer, "cumulative_length"):  # sliding-window layers (Mistral) count tokens seen
                layer.cumulative_length = len(keep)
        after = care(ids[:, 8:], **{CACHE_NAME: cache}, use_cache=True).logits
        torch.testing.assert_close(after, full[:, 8:], atol=1e-5, rtol=1e-5)


def test_batched_left_padded_generate_matches_single_rows(family_setup):
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    long_row, short_row = _ids(seed=3, shape=(1, 9)), _ids(seed=4, shape=(1, 5))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 4, dtype=torch.long), short_row], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        batched = care.generate(batch, attention_mask=mask, **kwargs)
        single_long = care.generate(long_row, **kwargs)
        single_short = care.generate(short_row, **kwargs)
    assert torch.equal(batched[0], single_long[0])
    assert torch.equal(batched[1, 4:], single_short[0])


@pytest.mark.parametrize("chunk", [{}, {"prefill_chunk_size": 4}], ids=["prefill", "chunked-prefill"])
def test_generate_with_a_hole_in_the_attention_mask_matches_the_uncached_model(family_setup, chunk):
    # zeros after a row's first token (a padded continuation of a batch): cached keys' positions are not their slot
    # counts, generate passes them (a chunked prefill: from the mask); its uncached run RoPEs every key at its position
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    ids = _ids(seed=5, shape=(2, 10))
    mask = torch.ones_like(ids)
    ids[0, 3:6], mask[0, 3:6] = 0, 0
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    with torch.no_grad():
        cached = care.generate(ids, attention_mask=mask, return_dict_in_generate=True, **chunk, **kwargs)
        uncached = care.generate(ids, attention_mask=mask, return_dict_in_generate=True, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), atol=1e-5, rtol=0)


def test_generate_computes_the_keys_cos_sin_once_per_step(family_setup, monkeypatch):
    # every layer RoPEs its whole rebuilt key history at every step, at positions that are the same in every layer:
    # `generate` computes their cos/sin once per step, the layers' own rotary modules run in the prefill only
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    ids = _ids(seed=6, shape=(2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    calls = []
    hooks = [
        layer.self_attn.rotary_emb.register_forward_hook(lambda *args: calls.append(1)) for layer in care.model.layers
    ]
    with torch.no_grad():
        shared = care.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    for hook in hooks:
        hook.remove()
    assert len(calls) == len(care.model.layers) + 4  # the prefill's layers, then one per decoding step
    prepare = care.prepare_inputs_for_generation

    @functools.wraps(prepare)  # `generate` reads its signature
    def per_layer_cos_sin(*args, **kw):
        return {k: v for k, v in prepare(*args, **kw).items() if k != "key_position_embeddings"}

    monkeypatch.setattr(care, "prepare_inputs_for_generation", per_layer_cos_sin)
    with torch.no_grad():
        per_layer = care.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    assert torch.equal(shared.sequences, per_layer.sequences)
    assert torch.equal(torch.stack(shared.logits), torch.stack(per_layer.logits))


def _run_offline(code: str, cwd) -> str:
    """Runs `code` in a fresh Python process, offline and without this checkout on the path; returns its stdout."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_saved_checkpoint_loads_in_fresh_process(tmp_path):
    """save → AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) in a new interpreter → same logits."""
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    for family in FAMILIES:
        model = make_tiny(family)
        result = run_care_conversion(model, None, CareConversionConfig(kv_keep=0.5), tiny_calibration(model), False)
        save_care_model(result, None, tmp_path / family, f"org/tiny-{family}")
        with torch.no_grad():
            torch.save(result.model(ids).logits, tmp_path / f"{family}.pt")
    code = (
        "import sys, torch\n"
        "sys.modules['hf_accel'] = None  # the checkpoint must load without hf_accel (installed or not)\n"
        "from transformers import AutoModelForCausalLM\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        f"for family in {list(FAMILIES)!r}:\n"
        f"    m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + '/' + family, trust_remote_code=True)\n"
        "    assert type(m).__name__.startswith('Care'), type(m)\n"
        f"    ref = torch.load({str(tmp_path)!r} + '/' + family + '.pt')\n"
        "    with torch.no_grad():\n"
        "        torch.testing.assert_close(m(ids).logits, ref, atol=1e-6, rtol=0)\n"
        "print('ok')\n"
    )
    assert _run_offline(code, tmp_path).endswith("ok")
    assert {"care_ranks.json", "care_ranks.png", "README.md", "modeling_care.py"} <= set(
        os.listdir(tmp_path / "llama")
    )


def test_a_second_turn_continues_from_the_returned_cache(family_setup):
    """Multi-turn: the second call gets the first one's latent cache and a padded follow-up (zeros in the mask after
    each row's first token): the same tokens as a fresh call on the whole conversation, and only latents cached."""
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    ids, mask = _ids(shape=(2, 8)), torch.ones(2, 8, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    first = care.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    follow_up, follow_mask = _ids(seed=2, shape=(2, 4)), torch.ones(2, 4, dtype=torch.long)
    follow_up[1, :2], follow_mask[1, :2] = 0, 0
    ids = torch.cat([first.sequences, follow_up], dim=1)
    mask = torch.cat([mask, torch.ones_like(first.sequences[:, 8:]), follow_mask], dim=1)
    reference = care.generate(input_ids=ids, attention_mask=mask, **kwargs)
    cache = first[CACHE_NAME]
    out = care.generate(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache}, **kwargs)
    assert torch.equal(out, reference)
    latent = care.config.care_k_ranks[0], care.config.care_v_ranks[0]
    assert (cache.layers[0].keys.shape[1:], cache.layers[0].values.shape[-1]) == (
        (1, out.shape[1] - 1, latent[0]),
        latent[1],
    )


@pytest.mark.parametrize("implementation", ["static", "sliding_window"])
def test_static_cache_is_refused(family_setup, implementation):
    # a static cache's empty slots would shift every cached key's RoPE position: silently wrong, so refused
    _, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    with pytest.raises(ValueError, match=r"dynamic cache, not a \w*StaticCache.*drop cache_implementation"):
        care.generate(_ids(shape=(1, 6)), max_new_tokens=2, do_sample=False, cache_implementation=implementation)


def test_conversion_keeps_the_model_dtype(family_setup):
    _, model, calibration = family_setup
    half = copy.deepcopy(model).to(torch.bfloat16)
    care = convert_care(half, kv_keep=0.5, calibration=calibration, progress=False)
    assert {p.dtype for p in care.parameters()} == {torch.bfloat16}
    assert care.config.dtype == torch.bfloat16


def test_save_pretrained_of_an_in_process_conversion_is_self_contained(tmp_path):
    # convert_care's model saved with save_pretrained: config.json's auto_map names configuration_care.py and
    # modeling_care.py, which were missing from the folder (it did not load)
    model = make_tiny("qwen3")
    care = convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), progress=False)
    care.save_pretrained(tmp_path / "care")
    assert {"configuration_care.py", "modeling_care.py"} <= set(os.listdir(tmp_path / "care"))
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(care(ids).logits, tmp_path / "ref.pt")
    code = (
        "import sys, torch\n"
        "sys.modules['hf_accel'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'care')!r}, trust_remote_code=True)\n"
        "with torch.no_grad():\n"
        f"    logits = m(torch.load({str(tmp_path / 'ids.pt')!r})).logits\n"
        f"torch.testing.assert_close(logits, torch.load({str(tmp_path / 'ref.pt')!r}), atol=1e-6, rtol=0)\n"
        "print(type(m).__name__)\n"
    )
    assert _run_offline(code, tmp_path).endswith("CareQwen3ForCausalLM")


@pytest.mark.parametrize(
    "ranks, message",
    [
        ({"care_k_ranks": [4, 4]}, r"^care_k_ranks must list 1 ranks in \[1, 16\], got \[4, 4\]$"),
        ({"care_v_ranks": [17]}, r"^care_v_ranks must list 1 ranks in \[1, 16\], got \[17\]$"),
        ({"care_k_ranks": [0]}, r"^care_k_ranks must list 1 ranks in \[1, 16\], got \[0\]$"),
    ],
)
def test_a_config_with_ranks_that_do_not_fit_is_refused_in_one_line(ranks, message):
    from hf_accel.models.configuration_care import CareLlamaConfig

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert CareLlamaConfig(**shape, care_k_ranks=[16], care_v_ranks=[1])  # two KV heads of 8: ranks up to 16
    with pytest.raises(ValueError, match=message):
        CareLlamaConfig(**shape, **ranks)


def test_a_config_without_ranks_is_refused_in_one_line():
    from hf_accel.models.configuration_care import CareLlamaConfig
    from hf_accel.models.modeling_care import CareLlamaForCausalLM

    config = CareLlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="needs `care_k_ranks` and `care_v_ranks`"):
        CareLlamaForCausalLM(config)


def test_a_quantized_sources_quantization_config_is_not_passed_on(tmp_path):
    # a source loaded from a GGUF file carries quantization_config; the converted weights are plain floats, but the
    # copied field made the saved checkpoint load as a GGUF-quantized model that refuses save_pretrained
    from transformers import AutoModelForCausalLM

    model = make_tiny("llama")
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf", "dequantize": False}
    care = convert_care(model, kv_keep=0.5, method="svd", progress=False)
    assert getattr(care.config, "quantization_config", None) is None
    care.save_pretrained(tmp_path / "care")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "care", trust_remote_code=True)
    assert getattr(loaded, "hf_quantizer", None) is None
    loaded.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(loaded(_ids()).logits, care(_ids()).logits, atol=1e-6, rtol=0)


# RoPE types with fixed frequencies (dynamic and longrope change theirs at run time and are refused): a converted
# model RoPEs cached keys at attention time, with the original's frequencies and attention scaling (yarn's)
ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "attention_factor": 1.7,
    },
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rope", list(ROPE_VARIANTS))
def test_full_rank_reproduces_original_logits_for_each_rope_type(family, rope):
    """Past `original_max_position_embeddings` (40 positions against 16), where the scaled frequencies matter."""
    model = make_tiny(family, rope_parameters=dict(ROPE_VARIANTS[rope]), max_position_embeddings=64)
    care = convert_care(model, kv_keep=1.0, method="svd", progress=False)
    ids = _ids(shape=(2, 40))
    with torch.no_grad():
        torch.testing.assert_close(care(ids).logits, model(ids).logits, atol=FULL_RANK_ATOL, rtol=0)
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[0, :3] = 0
    kwargs = {"input_ids": ids[:, :8], "attention_mask": attention_mask, "max_new_tokens": 30, "do_sample": False}
    assert torch.equal(care.generate(**kwargs), model.generate(**kwargs))


def test_auto_model_loads_the_bare_decoder_with_latent_attention(family_setup, tmp_path):
    # config.json's auto_map named AutoConfig and AutoModelForCausalLM only: AutoModel (feature extraction) refused the
    # checkpoint with "Unrecognized configuration class"
    from transformers import AutoModel

    family, model, calibration = family_setup
    care = convert_care(model, kv_keep=0.5, calibration=calibration, progress=False)
    care.save_pretrained(tmp_path / family)
    bare = AutoModel.from_pretrained(tmp_path / family, trust_remote_code=True)
    assert type(bare).__name__ == type(care).__name__.replace("ForCausalLM", "Model")
    assert type(bare.layers[0].self_attn).__name__.startswith("Care")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(bare(ids).last_hidden_state, care.model(ids).last_hidden_state, atol=1e-6, rtol=0)
