"""The transformers versions hf-accel runs on: the cache's name (5.24 renamed `past_key_values` to `cache`)."""

import inspect

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from hf_accel.compat import CACHE_NAME, check_cache_argument
from hf_accel.compress.care import convert_care
from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters.infinigram import InfinigramDrafter
from tests.compress.care_helpers import make_tiny, tiny_calibration


def test_the_cache_name_is_the_one_this_transformers_passes_its_layers():
    assert CACHE_NAME in inspect.signature(LlamaDecoderLayer.forward).parameters
    model = make_tiny("llama")
    out = model(torch.tensor([[5, 6, 7]]), **{CACHE_NAME: None}, use_cache=True)
    assert out[CACHE_NAME].get_seq_length() == 3


def _with_attention_of_an_older_checkpoint(care):
    """`care` with its attention's forward as CARE checkpoints wrote it before hf-accel supported transformers 5.24."""
    current = type(care.model.layers[0].self_attn)

    class OldCareAttention(current):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                    position_ids=None, **kwargs):  # fmt: skip
            kwargs.pop("cache", None)  # what transformers >= 5.24 passes: the old code left it unread in `kwargs`
            return current.forward(
                self, hidden_states, position_embeddings, attention_mask, cache=past_key_values,
                position_ids=position_ids, **kwargs,
            )  # fmt: skip

    for layer in care.model.layers:
        layer.self_attn.__class__ = OldCareAttention
    return care


def test_attention_that_takes_the_cache_under_its_old_name_is_refused_where_it_would_be_ignored():
    model = make_tiny("llama")
    care = convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), progress=False)
    check_cache_argument(model)
    check_cache_argument(care)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    reference = care.generate(ids, **kwargs)
    old = _with_attention_of_an_older_checkpoint(care)
    if CACHE_NAME == "past_key_values":  # before 5.24 the layers pass `past_key_values`: the old code is right
        check_cache_argument(old)
        assert torch.equal(old.generate(ids, **kwargs), reference)
        return
    # 5.24 and later: the old attention ignores the cache, and plain `generate` silently decodes something else
    assert not torch.equal(old.generate(ids, **kwargs), reference)
    message = (
        rf"^OldCareAttention \(in CareLlamaForCausalLM\) takes the cache as `past_key_values`, but "
        rf"transformers {transformers.__version__} passes it as `cache`, which it would ignore"
    )
    with pytest.raises(ValueError, match=message):
        check_cache_argument(old)
    with pytest.raises(ValueError, match=message):
        old.generate(ids, custom_generate=custom_generate, drafter=InfinigramDrafter(), **kwargs)


def test_attention_under_other_names_that_takes_the_old_cache_name_is_refused_too():
    # GPT-2 keeps its attention under `attn` (GPT-NeoX `attention`, Falcon `self_attention`); only `self_attn` was read
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97)).eval()
    check_cache_argument(model)
    current = type(model.transformer.h[0].attn)

    class OldAttention(current):
        def forward(self, hidden_states, past_key_values=None, **kwargs):
            kwargs.pop("cache", None)  # what transformers >= 5.24 passes: code written before left it unread
            return current.forward(self, hidden_states, **{CACHE_NAME: past_key_values}, **kwargs)

    for block in model.transformer.h:
        block.attn.__class__ = OldAttention
    if CACHE_NAME == "past_key_values":
        check_cache_argument(model)
    else:
        with pytest.raises(ValueError, match=r"^OldAttention \(in GPT2LMHeadModel\) takes the cache as `past_key"):
            check_cache_argument(model)


def test_attention_wrapped_to_take_the_cache_under_its_new_name_is_not_refused():
    # a wrapper that passes `cache` on as `past_key_values` (transformers' own `deprecate_kwarg`, put on an older
    # checkpoint's attention by its user) decodes right: its inner signature must not get it refused
    from transformers.utils.deprecation import deprecate_kwarg

    model = make_tiny("llama")
    care = convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), progress=False)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    reference = care.generate(ids, **kwargs)
    old = _with_attention_of_an_older_checkpoint(care)
    old_class = type(old.model.layers[0].self_attn)
    old_class.forward = deprecate_kwarg("cache", "99.0.0", new_name="past_key_values")(old_class.forward)
    check_cache_argument(old)
    assert torch.equal(old.generate(ids, **kwargs), reference)
