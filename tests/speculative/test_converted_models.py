"""The engine on converted models: CARE latents (one-head cache entries) and Palu's quantized latent cache keep
speculative greedy output identical to plain greedy `generate` of the same converted model.

CARE and Palu RoPE cached keys at attention time; in a batch the engine's cache has masked holes where rows accepted
fewer tokens, so the engine passes every slot's position (`key_positions`): batches stay identical too."""

import pytest
import torch

from hf_accel.compress.care import convert_care
from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters import build_drafter
from tests.compress.care_helpers import make_tiny, tiny_calibration


def _ragged_batch(vocab_size: int, rows: int = 2):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_size, (2, 10), generator=generator)
    ids[1, 5:] = ids[1, :5]  # a repeat, so the context-only n-gram drafter has something to propose
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # left padding on row 0
    return {"input_ids": ids[2 - rows :], "attention_mask": mask[2 - rows :]}


def _assert_speculative_identical(model, rows: int = 2):
    inputs = _ragged_batch(model.config.vocab_size, rows)
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(**inputs, **kwargs)
    drafter = build_drafter("ngram", None, model, tokenizer=None)
    out = model.generate(**inputs, **kwargs, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(out, reference)
    assert drafter.last_stats.target_forward_passes <= 24


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_care_model_under_the_engine(family):
    model = make_tiny(family)
    care = convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), progress=False)
    _assert_speculative_identical(care, rows=1)
    _assert_speculative_identical(care, rows=2)


def test_palu_quantized_cache_under_the_engine():
    from hf_accel.compress.palu import convert_palu
    from tests.compress.test_palu import CALIB_TEXT, FAST, TINY
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import make_char_tokenizer

    model = make_tiny_llama(**TINY)
    palu, _ = convert_palu(
        model, make_char_tokenizer(), kv_keep=0.5, group_size=2, quant_bits=3, calibration_text=CALIB_TEXT, **FAST
    )
    _assert_speculative_identical(palu, rows=1)
    _assert_speculative_identical(palu, rows=2)
