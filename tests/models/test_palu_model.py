"""The Palu trust_remote_code model (issue 4): generate with batch > 1, cache rollback, cache bytes, fresh-process load."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_accel.compat import CACHE_NAME
from hf_accel.compress.palu import convert_palu, expected_cache_bytes_per_token, save_palu
from hf_accel.eval.memory import cache_bytes
from hf_accel.kernels import is_triton_available
from hf_accel.kernels.cache import PaluQuantizedCache
from hf_accel.kernels.quant import compute_bytes_per_token
from hf_accel.models.modeling_palu import make_palu_cache
from tests.compress.test_palu import CALIB_TEXT, FAST, TINY
from tests.conftest import make_tiny_llama
from tests.tiny_checkpoints import make_char_tokenizer


require_triton = pytest.mark.skipif(not is_triton_available(), reason="needs the optional `triton` package")


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="module", params=[0, 3], ids=["float", "3bit"])
def palu(request, tokenizer):
    model = make_tiny_llama(**TINY)
    converted, _ = convert_palu(
        model,
        tokenizer,
        kv_keep=0.5,
        group_size=2,
        ranks="fisher",
        quant_bits=request.param,
        calibration_text=CALIB_TEXT,
        **FAST,
    )
    return converted


def _ids(batch, length, seed=0):
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_generate_batch_rows_equal_single_runs(palu):
    prompts = [_ids(1, 9, seed=1)[0], _ids(1, 5, seed=2)[0]]
    # left padding, as transformers' generate expects for decoder-only models
    input_ids = torch.zeros(2, 9, dtype=torch.long)
    attention_mask = torch.zeros(2, 9, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, 9 - len(prompt) :] = prompt
        attention_mask[row, 9 - len(prompt) :] = 1
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    batched = palu.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[:, 9:]
    for row, prompt in enumerate(prompts):
        single = palu.generate(
            input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs
        )[:, len(prompt) :]
        assert torch.equal(batched[row], single[0])


def test_a_prompt_shorter_than_the_full_precision_window_decodes(palu):
    if not palu.config.palu_quant_bits:
        pytest.skip("the window is part of the quantized cache")
    prompt = _ids(1, 3, seed=4)
    reference = palu.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)  # no window
    palu.config.palu_residual_length = 16  # every token stays in full precision: the float latents' output
    try:
        windowed = palu.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        palu.config.palu_quant_bits = 0
        unquantized = palu.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    finally:
        palu.config.palu_residual_length, palu.config.palu_quant_bits = 0, 3
    assert windowed.shape == reference.shape and torch.equal(windowed, unquantized)


@pytest.mark.parametrize("residual_length", [0, 3])
def test_generate_with_a_hole_in_the_attention_mask_matches_the_uncached_model(palu, residual_length):
    # zeros after a row's first token (a padded continuation of a batch): cached keys' positions are not their slot
    # counts, generate passes them; its uncached run RoPEs every key at its position each step
    if residual_length and not palu.config.palu_quant_bits:
        pytest.skip("the window is part of the quantized cache")
    ids = _ids(2, 10, seed=5)
    mask = torch.ones_like(ids)
    ids[0, 3:6], mask[0, 3:6] = 0, 0
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    palu.config.palu_residual_length = residual_length
    try:
        cached = palu.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        uncached = palu.generate(
            input_ids=ids, attention_mask=mask, return_dict_in_generate=True, use_cache=False, **kwargs
        )
    finally:
        palu.config.palu_residual_length = 0
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), atol=1e-5, rtol=0)


def test_chunked_prefill_with_a_hole_in_the_attention_mask_matches_the_uncached_model(palu):
    # a chunked prefill gets its chunk's position ids only: the cached chunks' positions come from the mask
    ids = _ids(2, 10, seed=5)
    mask = torch.ones_like(ids)
    ids[0, 3:6], mask[0, 3:6] = 0, 0
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "output_logits": True}
    chunked = palu.generate(
        input_ids=ids, attention_mask=mask, return_dict_in_generate=True, prefill_chunk_size=4, **kwargs
    )
    uncached = palu.generate(
        input_ids=ids, attention_mask=mask, return_dict_in_generate=True, use_cache=False, **kwargs
    )
    assert torch.equal(chunked.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(uncached.logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("module", ["modeling_palu", "modeling_care"])  # each checkpoint ships its own copy
def test_a_chunk_without_a_2d_mask_of_the_whole_sequence_gets_no_key_positions(module):
    # a chunk's position ids alone do not say where the cached tokens are: the 2D mask up to the chunk's end does;
    # without one (none, a 4D mask, or another length) the model infers them, the cache being contiguous
    import importlib
    from types import SimpleNamespace

    positions = importlib.import_module(f"hf_accel.models.{module}")._generation_key_positions
    cache, chunk = SimpleNamespace(get_seq_length=lambda: 4), torch.tensor([[3, 4, 5, 6]])
    everything = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])  # generate's, for the whole prompt
    mask = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]])  # a hole: the chunk is at positions 3..6, not 4..7
    assert torch.equal(positions(everything, cache, chunk, mask), torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6]]))
    assert positions(everything, cache, torch.tensor([[4, 5, 6, 7]]), mask) is None  # they disagree
    for other in (None, mask[:, :7], mask[:, None, None].float(), torch.cat([mask, mask[:, :1]], dim=-1)):
        assert positions(everything, cache, chunk, other) is None


def _decode_logits(model, cache, tokens, start):
    logits = []
    for i, token in enumerate(tokens):
        out = model(input_ids=token.view(1, 1), **{CACHE_NAME: cache}, position_ids=torch.tensor([[start + i]]))
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


@torch.no_grad()
def test_crop_continues_decoding_identically(palu):
    prompt, tokens = _ids(1, 10), _ids(1, 4, seed=3)[0]
    cache = make_palu_cache(palu.config)
    palu(input_ids=prompt, **{CACHE_NAME: cache})
    expected = _decode_logits(palu, cache, tokens, 10)
    # a rejected draft: three junk tokens in one pass, then cropped away
    cache = make_palu_cache(palu.config)
    palu(input_ids=prompt, **{CACHE_NAME: cache})
    palu(input_ids=_ids(1, 3, seed=4), **{CACHE_NAME: cache})
    cache.crop(-3)  # transformers 5: a negative count removes that many tokens
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(_decode_logits(palu, cache, tokens, 10), expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_whole_pass_cropped_away_runs_again_identically_with_a_window(palu):
    # Scoring candidates from one prefix: each pass is cropped away whole, so its first position is queried again and
    # must read the same full-precision copies as the first time (it read codes for one token before the fix).
    if not palu.config.palu_quant_bits:
        pytest.skip("the window is part of the quantized cache")
    prompt, step, candidate = _ids(1, 10), _ids(1, 1, seed=6), _ids(1, 3, seed=7)
    palu.config.palu_residual_length = 4
    try:
        cache = make_palu_cache(palu.config)
        palu(input_ids=prompt, **{CACHE_NAME: cache})
        palu(input_ids=step, **{CACHE_NAME: cache})
        first = palu(input_ids=candidate, **{CACHE_NAME: cache}).logits
        cache.crop(-3)
        again = palu(input_ids=candidate, **{CACHE_NAME: cache}).logits
    finally:
        palu.config.palu_residual_length = 0
    torch.testing.assert_close(again, first, atol=1e-6, rtol=0)


@torch.no_grad()
def test_select_positions_after_tree_verification(palu):
    prompt, tokens = _ids(1, 8), _ids(1, 3, seed=5)[0]
    cache = make_palu_cache(palu.config)
    palu(input_ids=prompt, **{CACHE_NAME: cache})
    expected = _decode_logits(palu, cache, tokens, 8)
    # two sibling draft nodes [junk, tokens[0]] at the same position 8; the second must not see the first
    cache = make_palu_cache(palu.config)
    palu(input_ids=prompt, **{CACHE_NAME: cache})
    mask = torch.zeros(1, 1, 2, 10)
    mask[0, 0, 1, 8] = torch.finfo(torch.float32).min
    mask[0, 0, 0, 9] = torch.finfo(torch.float32).min
    out = palu(
        input_ids=torch.tensor([[5, tokens[0]]]),
        attention_mask=mask,
        position_ids=torch.tensor([[8, 8]]),
        **{CACHE_NAME: cache},
    )
    torch.testing.assert_close(out.logits[0, 1], expected[0], atol=1e-5, rtol=1e-5)
    keep = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 9]])
    if isinstance(cache, PaluQuantizedCache):
        cache.select_positions(keep)
    else:  # what the speculative engine does for plain layers: gather on the sequence axis
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, keep[0]], layer.values[:, :, keep[0]]
    torch.testing.assert_close(_decode_logits(palu, cache, tokens[1:], 9), expected[1:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_cache_bytes_per_token_match_ranks_and_bits(palu):
    config = palu.config
    out = palu.generate(input_ids=_ids(2, 7), max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = out[CACHE_NAME]
    tokens = 2 * cache.get_seq_length()
    num_groups = config.num_key_value_heads // config.palu_group_size
    if config.palu_quant_bits:
        assert isinstance(cache, PaluQuantizedCache)
        per_token = sum(
            num_groups * (compute_bytes_per_token(rk, 3) + compute_bytes_per_token(rv, 3))
            for rk, rv in zip(config.palu_k_ranks, config.palu_v_ranks)
        )
        assert cache_bytes(cache) == tokens * per_token == tokens * expected_cache_bytes_per_token(config)
    else:
        assert isinstance(cache, DynamicCache)
        per_token = 4 * num_groups * (sum(config.palu_k_ranks) + sum(config.palu_v_ranks))  # float32 latents
        assert cache_bytes(cache) == tokens * per_token == tokens * expected_cache_bytes_per_token(config, 4)


RELOAD = """
import sys, torch
if {block!r}:
    sys.modules["hf_accel"] = None  # the checkpoint must not need hf_accel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r}, trust_remote_code=True, palu_kernel_backend={backend!r})
ids = torch.load({ids!r})
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, {out!r})
    torch.save(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False), {gen!r})
print(type(model).__name__)
"""


@pytest.mark.parametrize(
    "block_hf_accel, backend",
    [(True, "eager"), (False, "eager"), pytest.param(False, "triton", marks=require_triton)],
    ids=["without-hf_accel", "with-hf_accel", "triton"],
)
def test_fresh_process_load_gives_same_logits(palu, tokenizer, tmp_path, block_hf_accel, backend):
    if (
        not block_hf_accel and palu.config.palu_quant_bits == 0
    ):  # the float path through hf_accel is the in-process one
        pytest.skip("covered in process")
    info = {
        "settings": {
            "kv_keep": 0.5,
            "group_size": 2,
            "ranks": "fisher",
            "quant_bits": palu.config.palu_quant_bits,
            "quant_group_size": palu.config.palu_quant_group_size,
            "residual_length": 0,
            "hadamard": True,
        },
        "kv_keep_achieved": 0.5,
        "grouping": "G-LRD",
        "cache_bytes_per_token": 1,
        "base_cache_bytes_per_token": 2,
    }
    path = save_palu(palu, tokenizer, tmp_path / "palu", info, base_model="org/tiny")
    assert "\n# palu\n" in (path / "README.md").read_text()  # titled after --out, not the temporary directory
    ids = _ids(2, 11)
    torch.save(ids, tmp_path / "ids.pt")
    script = RELOAD.format(
        block=block_hf_accel,
        path=str(path),
        backend=backend,
        ids=str(tmp_path / "ids.pt"),
        out=str(tmp_path / "logits.pt"),
        gen=str(tmp_path / "gen.pt"),
    )
    env = dict(os.environ, TRITON_INTERPRET="1") if backend == "triton" and not torch.cuda.is_available() else None
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "PaluLlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(
            torch.load(tmp_path / "logits.pt"), palu(input_ids=ids).logits, atol=1e-4, rtol=1e-4
        )
        expected = palu.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(torch.load(tmp_path / "gen.pt"), expected)


def test_save_palu_without_a_hub_id_writes_a_loadable_checkpoint_and_no_card(palu, tokenizer, tmp_path):
    # `base_model=None` (a local model with no Hub id, as `save_care_model` takes it) failed deep in the card code
    # with a TypeError; it writes the checkpoint, its code and record, and no card
    from transformers import AutoModelForCausalLM

    info = {
        "settings": {
            "kv_keep": 0.5, "group_size": 2, "ranks": "fisher", "quant_bits": palu.config.palu_quant_bits,
            "quant_group_size": palu.config.palu_quant_group_size, "residual_length": 0, "hadamard": True,
        },
        "kv_keep_achieved": 0.5, "grouping": "G-LRD", "cache_bytes_per_token": 1, "base_cache_bytes_per_token": 2,
    }  # fmt: skip
    path = save_palu(palu, tokenizer, tmp_path / "palu", info, base_model=None)
    assert not (path / "README.md").exists()
    assert (path / "palu_ranks.json").is_file() and (path / "tokenizer.json").is_file()
    assert "# ---- from hf_accel/kernels/quant.py ----" in (path / "palu_kernels.py").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    ids = _ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, palu(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # and without a tokenizer, the checkpoint alone
    bare = save_palu(palu, None, tmp_path / "bare", info, base_model=None)
    assert {p.name for p in bare.iterdir()} == {p.name for p in path.iterdir()} - {
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_static_cache_is_refused_on_float_latents(palu):
    # a static cache's empty slots would shift every cached key's RoPE position; the float path says so
    if palu.config.palu_quant_bits:
        pytest.skip("quantized models replace an empty cache layer by their own quantized one")
    with pytest.raises(ValueError, match="dynamic cache"):
        palu.generate(_ids(1, 6), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static")


def test_an_offloaded_cache_is_refused_on_quantized_latents(palu):
    # the quantized latent cache replaces generate's DynamicCache, and has no offloading: asking for it says so
    if not palu.config.palu_quant_bits:
        pytest.skip("float latents sit in transformers' own DynamicCache, which offloads (to a GPU's host)")
    with pytest.raises(ValueError, match="does not offload"):
        palu.generate(_ids(1, 6), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="offloaded")


def test_a_static_cache_does_not_compile_a_quantized_model(palu):
    """A quantized model fills a static cache with its own growing latent layers; transformers judges whether to
    compile from the cache it built, before the model swaps them in. Compiled (on a GPU, by default; inductor), decoding
    met a data-dependent shape error with `fullgraph=True`, and without it spent 90 s compiling a tiny model."""
    from transformers import CompileConfig

    if not palu.config.palu_quant_bits:
        pytest.skip("float latents refuse a static cache (test above)")
    compiled = []

    def backend(graph_module, example_inputs, **options):
        compiled.append(graph_module)
        return graph_module.forward

    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on GPUs only; the CPU stands in for one here
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    reference = palu.generate(_ids(1, 6), **kwargs)
    out = palu.generate(_ids(1, 6), **kwargs, cache_implementation="static", compile_config=config)
    assert torch.equal(out, reference)
    assert not compiled


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_attention_implementations_other_than_eager_are_refused(palu, attention):
    # the Palu kernels compute the scores and read transformers' eager masks: other implementations would be ignored
    with pytest.raises(ValueError, match="does not support"):
        palu.set_attn_implementation(attention)
    assert palu.config._attn_implementation == "eager"


def test_conversion_keeps_the_model_dtype(tokenizer):
    model = make_tiny_llama(**TINY).to(torch.bfloat16)
    converted, _ = convert_palu(
        model, tokenizer, kv_keep=0.5, group_size=2, ranks="uniform", calibration_text=CALIB_TEXT, **FAST
    )
    assert {p.dtype for p in converted.parameters()} == {torch.bfloat16}
    assert converted.config.dtype == torch.bfloat16


def test_save_artifact_of_an_in_process_model_writes_self_contained_kernels(palu, tmp_path):
    # the package's palu_kernels.py is a shim importing hf_accel; a checkpoint must get the flattened sources
    from hf_accel.hub import save_artifact

    out = save_artifact(
        tmp_path / "artifact",
        "converted-model",
        "org/tiny",
        model=palu,
        kv_bytes_per_token=1,
        base_kv_bytes_per_token=2,
    )
    text = (out / "palu_kernels.py").read_text()
    assert "# ---- from hf_accel/kernels/quant.py ----" in text


def test_copy_remote_code_of_an_in_process_model_writes_self_contained_kernels(palu, tmp_path):
    # without save_pretrained first (which writes them itself), copy_remote_code meets the package's shim
    from hf_accel.hub import copy_remote_code

    copied = copy_remote_code(palu, tmp_path)
    assert sorted(copied) == ["configuration_palu.py", "modeling_palu.py", "palu_kernels.py"]
    text = (tmp_path / "palu_kernels.py").read_text()
    assert "# ---- from hf_accel/kernels/quant.py ----" in text  # not the shim that imports hf_accel


@torch.no_grad()
@pytest.mark.parametrize("quant_bits", [0, 3])
def test_output_attentions_returns_the_attention_weights(tokenizer, quant_bits):
    # Palu runs its own (eager) attention; output_attentions=True gave an empty tuple, and generate's attentions too
    model = make_tiny_llama(**TINY)
    model.config._attn_implementation = "eager"
    full, _ = convert_palu(
        model, tokenizer, kv_keep=1.0, group_size=2, ranks="uniform", quant_bits=quant_bits,
        calibration_text=CALIB_TEXT, **FAST,
    )  # fmt: skip
    input_ids = _ids(2, 7)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    got = full(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    expected = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    assert len(got) == model.config.num_hidden_layers
    for layer, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours.shape == (2, 8, 7, 7)
        if not quant_bits:  # full rank: the original's attention weights
            torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours[1, :, 2:], theirs[1, :, 2:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.sum(-1)[1, :, 2:], torch.ones(8, 5))  # rows of real queries sum to 1
    out = full.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_attentions=True,
    )  # fmt: skip
    assert [tuple(a.shape) for a in out.attentions[1]] == [(2, 8, 1, 8)] * model.config.num_hidden_layers


def test_save_pretrained_of_an_in_process_conversion_is_self_contained(palu, tmp_path):
    # convert_palu's model saved with save_pretrained: the code files its auto_map names were missing, and the
    # package's palu_kernels.py (a shim importing hf_accel) must not be what the checkpoint gets
    from tests.tiny_checkpoints import logits_in_fresh_process, sample_logits

    palu.save_pretrained(tmp_path / "palu")
    assert "# ---- from hf_accel/kernels/quant.py ----" in (tmp_path / "palu" / "palu_kernels.py").read_text()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="")
    logits, name = logits_in_fresh_process(tmp_path / "palu", tmp_path / "logits.pt", env)  # without hf_accel
    assert name == "PaluLlamaForCausalLM"
    torch.testing.assert_close(logits, sample_logits(palu), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("residual_length", [0, 4])
def test_training_reads_quantized_latents_with_straight_through_gradients(palu, residual_length):
    """With gradients on and no cache (training), a quantized model reads what its cache would (same logits) and
    its down-projections get the float model's gradient direction: codes carry no gradient, the rounding passes it
    straight through (without it, the value path's gradient only reached `v_down` through each token's min/max)."""
    if not palu.config.palu_quant_bits:
        pytest.skip("float latents have no quantizer")
    ids = _ids(2, 24, seed=7)
    attn = palu.model.layers[0].self_attn

    def down_grads(bits):
        palu.config.palu_quant_bits = bits
        palu.zero_grad()
        out = palu(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.logits.detach(), attn.k_down.weight.grad.clone(), attn.v_down.weight.grad.clone()

    palu.config.palu_residual_length = residual_length
    try:
        with torch.no_grad():
            cached_logits = palu(input_ids=ids, use_cache=False).logits  # the quantized cache's kernels
        logits, k_grad, v_grad = down_grads(3)
        _, float_k_grad, float_v_grad = down_grads(0)
    finally:
        palu.config.palu_quant_bits, palu.config.palu_residual_length = 3, 0
        palu.zero_grad(set_to_none=True)
    torch.testing.assert_close(logits, cached_logits, rtol=1e-5, atol=1e-5)
    for grad, reference in ((k_grad, float_k_grad), (v_grad, float_v_grad)):
        assert torch.nn.functional.cosine_similarity(grad.flatten(), reference.flatten(), dim=0) > 0.9


def test_a_config_without_ranks_is_refused_in_one_line():
    from hf_accel.models.configuration_palu import PaluLlamaConfig
    from hf_accel.models.modeling_palu import PaluLlamaForCausalLM

    config = PaluLlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="needs `palu_k_ranks` and `palu_v_ranks`"):
        PaluLlamaForCausalLM(config)


def test_training_with_the_models_own_cache_also_reads_straight_through(palu):
    # a plain training loop leaves use_cache at the config's True, so the model makes itself a cache: that forward
    # took the cache path, whose codes carry no gradient (v_down's gradient at cosine 0.3 to the float model's)
    if not palu.config.palu_quant_bits:
        pytest.skip("float latents have no quantizer")
    ids = _ids(2, 24, seed=7)
    attn = palu.model.layers[0].self_attn

    def forward(**kwargs):
        palu.zero_grad()
        out = palu(input_ids=ids, labels=ids, **kwargs)
        out.loss.backward()
        return out, attn.v_down.weight.grad.clone()

    palu.config.palu_residual_length = 4
    try:
        cached, v_grad = forward()
        _, reference = forward(use_cache=False)
        with torch.no_grad():
            prefill = palu(input_ids=ids)
            step = torch.tensor([[5], [6]])
            expected = palu(input_ids=step, **{CACHE_NAME: prefill[CACHE_NAME]}).logits
            got = palu(input_ids=step, **{CACHE_NAME: cached[CACHE_NAME]}).logits
    finally:
        palu.config.palu_residual_length = 0
        palu.zero_grad(set_to_none=True)
    assert isinstance(cached[CACHE_NAME].layers[0], type(prefill[CACHE_NAME].layers[0]))
    torch.testing.assert_close(v_grad, reference)
    torch.testing.assert_close(got, expected)  # the cache it filled decodes as a no-grad prefill's does


def test_save_pretrained_with_push_to_hub_uploads_the_self_contained_kernels(palu, tmp_path, monkeypatch):
    # transformers uploads inside save_pretrained, before the override replaced the package's palu_kernels.py (a
    # shim importing hf_accel): the repository got the shim
    from huggingface_hub import HfApi, RepoUrl
    from transformers.utils.hub import PushToHubMixin

    uploaded = {}

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        uploaded[repo_id] = (Path(working_dir) / "palu_kernels.py").read_text()

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: RepoUrl(f"https://huggingface.co/{repo_id}"))
    monkeypatch.setattr(PushToHubMixin, "_upload_modified_files", upload)
    palu.save_pretrained(tmp_path / "palu", push_to_hub=True, repo_id="me/palu")
    assert "# ---- from hf_accel/kernels/quant.py ----" in uploaded["me/palu"]


def test_training_with_the_triton_backend_differentiates_the_scores(palu, monkeypatch):
    # the Triton kernels write their result into a fresh tensor, with no backward: trained with
    # palu_kernel_backend='triton', queries, k_down and k_up silently got no gradient through the scores
    from hf_accel.kernels import registry
    from hf_accel.kernels.reference import rope_key_scores

    def without_autograd(*args, **kwargs):  # what a kernel launch returns
        return rope_key_scores(*args, **kwargs).detach()

    monkeypatch.setitem(registry._KERNEL_LOADERS["rope_key_scores"], "triton", lambda: without_autograd)
    ids = _ids(2, 12, seed=3)
    attn = palu.model.layers[0].self_attn
    grads = {}
    for backend in ("eager", "triton"):
        palu.config.palu_kernel_backend = backend
        palu.zero_grad()
        palu(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads[backend] = attn.k_up.grad.clone(), attn.q_proj.weight.grad.clone()
    palu.config.palu_kernel_backend = "eager"
    palu.zero_grad(set_to_none=True)
    for got, expected in zip(grads["triton"], grads["eager"]):
        torch.testing.assert_close(got, expected)


def test_a_pass_with_gradients_after_a_cached_prefix_differentiates_the_scores_with_triton(palu, monkeypatch):
    # a quantized model's pass over a non-empty cache (a prefix cached under no_grad, then trained tokens) launched
    # the Triton kernels with gradients on: queries, q_proj and k_up silently got none through the scores
    from hf_accel.kernels import registry
    from hf_accel.kernels.reference import dequantize_attend, rope_key_scores

    def without_autograd(kernel):  # what a kernel launch returns
        return lambda *args, **kwargs: kernel(*args, **kwargs).detach()

    monkeypatch.setitem(
        registry._KERNEL_LOADERS["rope_key_scores"], "triton", lambda: without_autograd(rope_key_scores)
    )
    monkeypatch.setitem(
        registry._KERNEL_LOADERS["dequantize_attend"], "triton", lambda: without_autograd(dequantize_attend)
    )
    ids = _ids(2, 12, seed=4)
    attn = palu.model.layers[0].self_attn
    grads = {}
    for backend in ("eager", "triton"):
        monkeypatch.setattr(palu.config, "palu_kernel_backend", backend)
        cache = make_palu_cache(palu.config)
        with torch.no_grad():
            palu(input_ids=ids[:, :7], **{CACHE_NAME: cache}, use_cache=True)
        palu.zero_grad()
        palu(input_ids=ids[:, 7:], **{CACHE_NAME: cache}, use_cache=True).logits.square().mean().backward()
        grads[backend] = attn.k_up.grad.clone(), attn.q_proj.weight.grad.clone()
    palu.zero_grad(set_to_none=True)
    for got, expected in zip(grads["triton"], grads["eager"]):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("same_sources", [True, False])
def test_checkpoint_kernels_use_the_installed_ones_only_from_the_same_sources(tmp_path, same_sources):
    # another hf_accel version's cache class may lack what this checkpoint's modeling code calls (e.g. a layer
    # without `straight_through`): its own copies are kept then
    import importlib.util

    from hf_accel.compress.palu import write_palu_kernels_file
    from hf_accel.kernels.cache import PaluQuantizedLayer as Installed

    path = write_palu_kernels_file(tmp_path / "palu_kernels.py")
    if not same_sources:
        text = path.read_text()
        assert "\n_SOURCES_HASH = '" in text
        path.write_text(text.replace("\n_SOURCES_HASH = '", "\n_SOURCES_HASH = 'other-", 1))
    spec = importlib.util.spec_from_file_location(f"checkpoint_kernels_{same_sources}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.PaluQuantizedLayer is Installed) == same_sources
    assert hasattr(module.PaluQuantizedLayer, "straight_through") and callable(module.reads_in_full_precision)


def test_auto_backend_runs_a_cpu_model_where_a_gpu_is_visible(palu, monkeypatch):
    # `palu_kernel_backend="auto"` on a CPU model must not launch the Triton kernels on CPU tensors
    ids = _ids(2, 7)
    with torch.no_grad():
        expected = palu(input_ids=ids).logits
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(palu.config, "palu_kernel_backend", "auto")
        torch.testing.assert_close(palu(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_checkpoint_kernels_auto_backend_runs_the_copies_without_hf_accel(tmp_path, monkeypatch):
    # the copies carry no Triton kernels: with triton installed and a GPU visible (any CUDA torch), a checkpoint whose
    # config says "auto" must run its eager copies, not fail on the missing Triton ones
    import importlib.util

    from hf_accel.compress.palu import write_palu_kernels_file

    path = write_palu_kernels_file(tmp_path / "palu_kernels.py")
    path.write_text(path.read_text().replace("\n_SOURCES_HASH = '", "\n_SOURCES_HASH = 'other-", 1))
    spec = importlib.util.spec_from_file_location("checkpoint_kernels_auto", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else find_spec(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend"):
        assert module.get_kernel(name, "auto") is getattr(module, name)


def test_checkpoint_kernels_triton_backend_from_other_sources_names_the_sources(tmp_path):
    # hf_accel[triton] installed, but from other kernel sources: the copies run, and they have no Triton kernels;
    # their error said only "need `pip install 'hf-accel[triton]'`", which was already done and changes nothing
    import importlib.util

    from hf_accel.compress.palu import write_palu_kernels_file

    path = write_palu_kernels_file(tmp_path / "palu_kernels.py")
    path.write_text(path.read_text().replace("\n_SOURCES_HASH = '", "\n_SOURCES_HASH = 'other-", 1))
    spec = importlib.util.spec_from_file_location("checkpoint_kernels_other_sources", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("rope_key_scores", "dequantize_matmul", "dequantize_attend"):
        with pytest.raises(ImportError, match=r"installed from the same kernel sources as the checkpoint"):
            module.get_kernel(name, "triton")()


def test_the_checkpoint_sources_hash_ignores_line_endings(tmp_path):
    # the same sources checked out with \r\n (git autocrlf on Windows) must keep using the installed kernels
    import importlib.util

    import hf_accel.kernels
    from hf_accel.kernels import checkpoint_sources_hash

    package = tmp_path / "crlf_kernels"
    package.mkdir()
    for source in Path(hf_accel.kernels.__file__).parent.glob("*.py"):
        (package / source.name).write_bytes(source.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    spec = importlib.util.spec_from_file_location(
        "crlf_kernels", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["crlf_kernels"] = module
    try:
        spec.loader.exec_module(module)
        assert module.checkpoint_sources_hash() == checkpoint_sources_hash()
    finally:
        for name in [n for n in sys.modules if n == "crlf_kernels" or n.startswith("crlf_kernels.")]:
            del sys.modules[name]


def test_a_quantized_sources_quantization_config_is_not_passed_on(tokenizer, tmp_path):
    # a source loaded from a GGUF file carries quantization_config; the converted weights are plain floats, but the
    # copied field made the saved checkpoint load as a GGUF-quantized model that refuses save_pretrained
    from transformers import AutoModelForCausalLM

    model = make_tiny_llama(**TINY)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf", "dequantize": False}
    converted, _ = convert_palu(
        model, tokenizer, kv_keep=0.5, group_size=2, ranks="uniform", calibration_text=CALIB_TEXT, **FAST
    )
    assert getattr(converted.config, "quantization_config", None) is None
    converted.save_pretrained(tmp_path / "palu")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "palu", trust_remote_code=True)
    assert getattr(loaded, "hf_quantizer", None) is None
    loaded.save_pretrained(tmp_path / "again")


require_cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or not is_triton_available(), reason="needs a CUDA GPU and triton"
)


def _logits_and_greedy(model, backend, ids):
    model.config.palu_kernel_backend = backend
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits, model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)


@require_cuda_triton
def test_triton_backend_on_a_gpu_matches_eager(palu):
    import copy

    model, ids = copy.deepcopy(palu).cuda(), _ids(2, 12).cuda()
    eager_logits, eager_tokens = _logits_and_greedy(model, "eager", ids)
    triton_logits, triton_tokens = _logits_and_greedy(model, "triton", ids)
    torch.testing.assert_close(triton_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(triton_tokens, eager_tokens)


@require_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_backend_in_half_precision_is_as_accurate_as_eager(palu, dtype):
    # half weights round everywhere (projections, latents, scales): the Triton kernels must add no error of their
    # own beyond that, measured against the float32 model
    import copy

    ids = _ids(2, 12).cuda()
    reference, _ = _logits_and_greedy(copy.deepcopy(palu).cuda(), "eager", ids)
    model = copy.deepcopy(palu).to("cuda", dtype)
    errors = {
        backend: (_logits_and_greedy(model, backend, ids)[0] - reference).abs().max()
        for backend in ("eager", "triton")
    }
    assert errors["triton"] <= 1.5 * errors["eager"] + 1e-3 * reference.abs().max(), errors


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"palu_quant_group_size": 5}, "palu_quant_group_size must be 0"),  # does not divide the ranks of 8
        ({"palu_quant_group_size": -1}, "palu_quant_group_size must be 0"),
        ({"palu_residual_length": -3}, "palu_residual_length must be a non-negative"),
        ({"palu_quant_bits": 5}, "^palu_quant_bits must be 0, 2, 3 or 4, got 5$"),
        (
            {"palu_kernel_backend": "cuda"},
            r"^palu_kernel_backend must be one of \('eager', 'triton', 'auto'\), got 'cuda'$",
        ),
        ({"palu_group_size": 3}, "^palu_group_size must divide num_key_value_heads=2, got 3$"),
        ({"palu_k_ranks": [8, 8]}, r"^palu_k_ranks must list 1 group ranks in \[1, 8\], got \[8, 8\]$"),
        ({"palu_v_ranks": [9]}, r"^palu_v_ranks must list 1 group ranks in \[1, 8\], got \[9\]$"),
    ],
)
def test_a_config_with_bad_quantization_fields_is_refused_at_load(fields, message):
    from hf_accel.models.configuration_palu import PaluLlamaConfig

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    ranks = {"palu_k_ranks": [8], "palu_v_ranks": [8], "palu_quant_bits": 4}
    assert PaluLlamaConfig(**shape, **ranks, palu_quant_group_size=4, palu_residual_length=2)  # these are fine
    with pytest.raises(ValueError, match=message):
        PaluLlamaConfig(**shape, **{**ranks, **fields})


def test_auto_model_loads_the_bare_decoder_with_latent_attention(palu, tmp_path):
    # config.json's auto_map named AutoConfig and AutoModelForCausalLM only: AutoModel (feature extraction) refused the
    # checkpoint with "Unrecognized configuration class"
    from transformers import AutoModel

    palu.save_pretrained(tmp_path / "palu")
    bare = AutoModel.from_pretrained(tmp_path / "palu", trust_remote_code=True)
    assert type(bare).__name__ == "PaluLlamaModel"
    assert type(bare.layers[0].self_attn).__name__ == "PaluLlamaAttention"
    ids = _ids(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(bare(input_ids=ids).last_hidden_state, palu.model(input_ids=ids).last_hidden_state)


def test_a_quantized_model_fills_a_plain_dynamic_cache_with_its_own_layers(palu):
    """A `DynamicCache()` without a config builds its layers as they are reached: a quantized model adds its own,
    which hold and measure what its `PaluQuantizedCache` does; one already holding float entries is refused."""
    from hf_accel.kernels.cache import PaluQuantizedLayer

    if not palu.config.palu_quant_bits:
        pytest.skip("float latents are stored in the DynamicCache's own layers")
    ids, own, plain = _ids(2, 9), make_palu_cache(palu.config), DynamicCache()
    with torch.no_grad():
        expected = palu(ids, **{CACHE_NAME: own}, use_cache=True).logits
        torch.testing.assert_close(palu(ids, **{CACHE_NAME: plain}, use_cache=True).logits, expected, atol=0, rtol=0)
    assert [type(layer) for layer in plain.layers] == [PaluQuantizedLayer] * palu.config.num_hidden_layers
    assert cache_bytes(plain) == cache_bytes(own) > 0
    used = DynamicCache()
    used.update(torch.zeros(2, 2, 9, 4), torch.zeros(2, 2, 9, 4), layer_idx=0)
    with pytest.raises(
        ValueError, match="^This Palu model quantizes its latents but got a cache that already holds fl"
    ):
        palu(ids, **{CACHE_NAME: used}, use_cache=True)


def test_masked_softmax_reads_no_mask_as_causal_and_a_boolean_mask_as_its_additive_form():
    from hf_accel.models.modeling_palu import _masked_softmax

    scores = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(0))  # 4 queries after 2 cached keys
    keep = torch.arange(6)[None] <= 2 + torch.arange(4)[:, None]  # [q, S]: query i sees keys 0..2 + i
    additive = torch.zeros(2, 1, 4, 7).masked_fill(~torch.nn.functional.pad(keep, (0, 1)), torch.finfo().min)
    expected = _masked_softmax(scores, additive, past_len=2)
    assert expected[:, :, ~keep].eq(0).all() and expected[:, :, keep].gt(0).all()  # future keys get no weight
    torch.testing.assert_close(_masked_softmax(scores, None, past_len=2), expected, atol=0, rtol=0)
    boolean = additive == 0  # True = attend, one column wider than the scores as a mask may be
    torch.testing.assert_close(_masked_softmax(scores, boolean, past_len=2), expected, atol=0, rtol=0)
    one = scores[..., -1:, :]  # a single query without a mask sees every key
    torch.testing.assert_close(_masked_softmax(one, None, past_len=5), one.softmax(-1), atol=0, rtol=0)
