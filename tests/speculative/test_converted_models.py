"""The engine on converted models: CARE latents (one-head cache entries) and Palu's quantized latent cache keep
speculative greedy output identical to plain greedy `generate` of the same converted model.

CARE and Palu RoPE cached keys at attention time; in a batch the engine's cache has masked holes where rows accepted
fewer tokens, so the engine passes every slot's position (`key_positions`): batches stay identical too."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_accel.compress.care import convert_care
from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters import build_drafter
from tests.compress.care_helpers import make_tiny, tiny_calibration
from tests.speculative.test_engine import RandomTreeDrafter
from tests.speculative.test_engine import _ragged_batch as engine_ragged_batch


def _ragged_batch(vocab_size: int, rows: int = 2):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_size, (2, 10), generator=generator)
    ids[1, 5:] = ids[1, :5]  # a repeat, so the context-only n-gram drafter has something to propose
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # left padding on row 0
    return {"input_ids": ids[2 - rows :], "attention_mask": mask[2 - rows :]}


def _assert_speculative_identical(model, rows: int = 2):
    inputs = {name: t.to(model.device) for name, t in _ragged_batch(model.config.vocab_size, rows).items()}
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(**inputs, **kwargs)
    drafter = build_drafter("ngram", None, model, tokenizer=None)
    out = model.generate(**inputs, **kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    assert drafter.last_stats.mean_accepted > 1  # drafts were accepted


@pytest.mark.parametrize(
    "family, window",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 6}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ],
)
def test_care_model_under_the_engine(family, window, prefill):
    """Sliding windows (6) shorter than prompt + generation (10 + 24): masked by position, CARE's keys RoPE'd by
    position too."""
    model = make_tiny(family, **window)
    care = convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), progress=False)
    _assert_speculative_identical(care, rows=1)
    _assert_speculative_identical(care, rows=2)


def _tiny_palu(residual_length: int, bits: int = 3):
    from hf_accel.compress.palu import convert_palu
    from tests.compress.test_palu import CALIB_TEXT, FAST, TINY
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import make_char_tokenizer

    model = make_tiny_llama(**TINY)
    palu, _ = convert_palu(
        model, make_char_tokenizer(), kv_keep=0.5, group_size=2, quant_bits=bits, calibration_text=CALIB_TEXT,
        residual_length=residual_length, **FAST,
    )  # fmt: skip
    return palu


@pytest.mark.parametrize("residual_length", [0, 4])
def test_palu_quantized_cache_under_the_engine(residual_length, prefill):
    # With a full-precision window, a verification pass reads each cached token in full precision or from codes
    # per query, by position, exactly as one-token decoding would (the window rule of kernels/cache.py)
    palu = _tiny_palu(residual_length)
    _assert_speculative_identical(palu, rows=1)
    _assert_speculative_identical(palu, rows=2)


@pytest.fixture(scope="module")
def windowed_palu():
    return _tiny_palu(residual_length=4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_trees_never_change_a_windowed_palu_models_greedy_output(windowed_palu, data):
    input_ids, attention_mask = engine_ragged_batch(data.draw(st.integers(1, 3)), seed=data.draw(st.integers(0, 5)))
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = windowed_palu.generate(**kwargs, pad_token_id=0)

    drafter = RandomTreeDrafter(data, reference, max_nodes=8)  # deep trees: queries far past the window's length
    out = windowed_palu.generate(**kwargs, pad_token_id=0, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)


def test_a_windowed_palu_prefill_scores_like_decoding():
    """The window rule is per query: a prefill reads what one-token-at-a-time decoding reads."""
    from hf_accel.eval.perplexity import decoding_perplexity, perplexity_on_ids

    palu = _tiny_palu(residual_length=4)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert perplexity_on_ids(palu, ids) == pytest.approx(decoding_perplexity(palu, ids), rel=1e-5)


def _vocab_ragged_batch(batch_size: int, width: int, seed: int):
    """Left-padded rows of ids over the tiny Palu model's 128-token vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (batch_size, width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for b in range(batch_size):
        pad = (b * 3) % (width - 2)
        input_ids[b, :pad], attention_mask[b, :pad] = 0, 0
    return input_ids, attention_mask


def test_a_windowed_palu_model_in_long_ragged_speculation_and_transformers_prompt_lookup():
    """2-bit codes move the logits enough to show a token read from codes where decoding reads full precision. Rows
    that accept different lengths leave masked holes that repeat an earlier position, and transformers' assisted
    generation crops even its first pass: every copy a later query reads must survive both (under the previous
    rules, seeds 1, 5, 7, 11 and 12 of the first loop and seed 5 of the second differed from plain greedy)."""
    from tests.speculative.test_engine import ReferenceDrafter

    palu = _tiny_palu(residual_length=4, bits=2)
    for seed in range(13):
        input_ids, attention_mask = _vocab_ragged_batch(4, 10, seed)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 40,
                  "do_sample": False, "pad_token_id": 0}  # fmt: skip
        reference = palu.generate(**kwargs)
        for tree in (False, True):
            drafter = ReferenceDrafter(reference, depth=6, tree=tree, seed=seed, corrupt_every=2)
            assert torch.equal(palu.generate(**kwargs, custom_generate=custom_generate, drafter=drafter), reference)
    for seed in range(6):
        prompt = torch.cat([_vocab_ragged_batch(1, 10, seed)[0]] * 2, dim=1)
        kwargs = {"input_ids": prompt, "max_new_tokens": 25, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(palu.generate(**kwargs, prompt_lookup_num_tokens=5), palu.generate(**kwargs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_palu_quantized_cache_under_the_engine_on_a_gpu(backend):
    # the Triton kernels read the packed latents of a verification pass (tree rows, masked holes) on the GPU
    if backend == "triton":
        pytest.importorskip("triton")
    palu = _tiny_palu(residual_length=4).cuda()
    palu.config.palu_kernel_backend = backend
    _assert_speculative_identical(palu, rows=1)
    _assert_speculative_identical(palu, rows=2)


@pytest.mark.parametrize("model_kind", ["care-sliding", "palu-window"])
def test_closing_cache_holes_keeps_converted_models_identical(model_kind, windowed_palu, monkeypatch):
    """Rows accepting very different numbers of tokens leave holes the engine closes (moving slots): CARE's keys are
    RoPE'd by each slot's position, Palu's full-precision window follows its positions."""
    from tests.speculative.test_engine import SkewedDrafter, count_hole_closings

    closed = count_hole_closings(monkeypatch)
    if model_kind == "palu-window":
        model = windowed_palu
    else:
        tiny = make_tiny("mistral", sliding_window=6)
        model = convert_care(tiny, kv_keep=0.5, calibration=tiny_calibration(tiny), progress=False)
    input_ids, attention_mask = engine_ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 30, "do_sample": False}
    reference = model.generate(**kwargs, pad_token_id=0)
    out = model.generate(
        **kwargs, pad_token_id=0, custom_generate=custom_generate, drafter=SkewedDrafter(reference, depth=5)
    )
    assert torch.equal(out, reference)
    assert closed


@pytest.mark.parametrize("kind", ["care", "care-sliding", "palu-window"])
def test_prefill_auxiliary_inputs_on_converted_models(kind):
    """PPD's prompt tokens in the prefill (`propose_prefill`) on latent caches: their entries are dropped from CARE's
    one-head latents and from Palu's quantized cache with its full-precision window, their logits are those of the
    real prompt continued by them, and greedy output stays plain `generate`'s."""
    from tests.speculative.test_engine import PrefillGuessDrafter, prefill_aux_logits_alone

    if kind == "palu-window":
        model = _tiny_palu(residual_length=4)
    else:
        tiny = make_tiny("mistral", sliding_window=6) if kind == "care-sliding" else make_tiny("llama")
        model = convert_care(tiny, kv_keep=0.5, calibration=tiny_calibration(tiny), progress=False)
    model.eval()
    input_ids, attention_mask = engine_ragged_batch(3, width=9)
    input_ids = input_ids % model.config.vocab_size
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False}
    reference = model.generate(**kwargs, pad_token_id=0)
    embed = model.get_input_embeddings().weight.detach().clone()
    aux_tokens = torch.stack([reference[:, 9], reference[:, 10], torch.full((3,), 11)], dim=1)  # a chain, then a leaf

    drafter = PrefillGuessDrafter(reference, embed, aux_tokens)
    out = model.generate(**kwargs, pad_token_id=0, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    assert [len(tokens) for tokens in drafter.results[1].new_tokens] == [3, 3, 3]  # both guesses, then the bonus
    expected = prefill_aux_logits_alone(model, input_ids, attention_mask, aux_tokens)
    torch.testing.assert_close(drafter.results[0].aux_logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("declares", ["nothing", "no_cache_holes"])
def test_checkpoints_converted_before_key_positions_stay_identical_in_ragged_batches(declares, monkeypatch, prefill):
    """A CARE or Palu checkpoint converted before `key_positions` runs its own modeling code, which takes cached slot
    `j` of `S` to be at `position_ids[:, 0] - S + j` (older ones declare nothing, one version
    `_supports_cache_holes = False`): the engine keeps every row's slots contiguous for it, since a hole would shift
    the RoPE of every key before it (greedy output changed)."""
    from tests.speculative.test_engine import SkewedDrafter

    tiny = make_tiny("qwen3")
    model = convert_care(tiny, kv_keep=0.5, calibration=tiny_calibration(tiny), progress=False)
    monkeypatch.setattr(type(model), "_accepts_key_positions", False)  # the old code: positions from slots
    if declares == "no_cache_holes":
        monkeypatch.setattr(type(model.config), "model_type", "renamed")
        monkeypatch.setattr(type(model), "_supports_cache_holes", False, raising=False)
    input_ids, attention_mask = engine_ragged_batch(3)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 30, "do_sample": False}
    reference = model.generate(**kwargs, pad_token_id=0)
    out = model.generate(
        **kwargs, pad_token_id=0, custom_generate=custom_generate, drafter=SkewedDrafter(reference, depth=5)
    )
    assert torch.equal(out, reference)
