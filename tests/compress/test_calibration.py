"""K/V calibration statistics against a direct autograd oracle: padding is excluded, gradients are per token."""

import pytest
import torch

from hf_accel.compress.calibration import collect_kv_calibration
from tests.conftest import make_tiny_llama


def _direct_statistics(model, ids):
    """Layer 0's `Σ xᵀx`, `Σ |x|` and `Σ gᵀg` of one unpadded sequence, g the gradient of the summed loss at k_proj."""
    attn = model.model.layers[0].self_attn
    seen = {}
    handles = [
        attn.k_proj.register_forward_pre_hook(lambda _m, args: seen.update(x=args[0].detach())),
        attn.k_proj.register_forward_hook(lambda _m, _a, out: seen.update(k=out)),
    ]
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
            loss = model(inputs_embeds=embeds, labels=ids[None]).loss * (len(ids) - 1)
            (grad,) = torch.autograd.grad(loss, seen["k"])
    finally:
        for handle in handles:
            handle.remove()
    x, g = seen["x"][0].double(), grad[0].double()
    return x.T @ x, x.abs().sum(0), g.T @ g


def test_padding_is_excluded_and_gradient_moments_are_per_token():
    model = make_tiny_llama()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding: the real tokens of row 1 never see it
    cal = collect_kv_calibration(model, ids, mask, with_output_grads=True, progress=False)
    rows = [_direct_statistics(model, ids[0]), _direct_statistics(model, ids[1, :5])]
    assert cal.tokens == 13
    moment, abs_sum, grad_moment = (sum(parts) / 13 for parts in zip(*rows))
    torch.testing.assert_close(cal.moments[0], moment, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(cal.abs_means[0], abs_sum, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(cal.k_grad_moments[0], grad_moment, rtol=1e-3, atol=1e-9)


def test_left_padding_leaves_the_statistics_of_real_tokens_unchanged():
    """A left-padded row gives the unpadded row's statistics: its first real token is a label predicted from a pad
    position, but that position attends to pads only (causal mask), so no gradient reaches a real token's K/V."""
    model = make_tiny_llama()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cal = collect_kv_calibration(model, ids, mask, with_output_grads=True, progress=False)
    rows = [_direct_statistics(model, ids[0]), _direct_statistics(model, ids[1, 3:])]
    assert cal.tokens == 13
    for got, parts in ((cal.k_grad_moments[0], [r[2] for r in rows]), (cal.moments[0], [r[0] for r in rows])):
        torch.testing.assert_close(got, sum(parts) / 13, rtol=1e-3, atol=1e-9)


def test_activations_that_overflow_are_refused_in_one_line():
    """Inf/NaN activations (a model overflowing its dtype) give a ValueError naming the layer, not a failed eigh."""
    model = make_tiny_llama()
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[0] = float("inf")
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    for with_output_grads in (False, True):
        with pytest.raises(ValueError, match="layer 1 are not finite"):
            collect_kv_calibration(model, ids, with_output_grads=with_output_grads, progress=False)


def test_calibration_ids_must_be_rows():
    model = make_tiny_llama()
    with pytest.raises(ValueError, match=r"\[num_samples, seq_len\] with seq_len >= 1, got \(16,\)"):
        collect_kv_calibration(model, torch.arange(3, 19), progress=False)
    with pytest.raises(ValueError, match="seq_len >= 2"):  # a loss needs two tokens
        collect_kv_calibration(model, torch.arange(3, 7)[:, None], with_output_grads=True, progress=False)


@pytest.fixture
def allocated(monkeypatch) -> list:
    """Every tensor `torch.zeros` makes while the test runs (the calibration's accumulators)."""
    made, zeros = [], torch.zeros

    def recording_zeros(*args, **kwargs):
        made.append(zeros(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch, "zeros", recording_zeros)
    return made


def test_no_gradient_accumulators_without_gradients(allocated):
    """Without `with_output_grads` only the input statistics are allocated: the two `[g·d, g·d]` float64 gradient
    accumulators per layer (8.6 GB at Llama-2-7B's shapes) were made and never used."""
    model = make_tiny_llama()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    collect_kv_calibration(model, ids, progress=False)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert sum(t.numel() for t in allocated if t.dtype == torch.float64) == layers * (hidden * hidden + hidden)


def test_statistics_are_averaged_in_place(allocated):
    """The returned averages are the accumulators themselves: a divided copy held every layer's `[hidden, hidden]`
    float64 moments twice at the end of the calibration (80 GB at a 70B model's shapes)."""
    model = make_tiny_llama()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    cal = collect_kv_calibration(model, ids, with_output_grads=True, progress=False)
    returned = cal.moments + cal.abs_means + cal.k_grad_moments + cal.v_grad_moments
    assert {t.data_ptr() for t in returned} <= {t.data_ptr() for t in allocated}


@pytest.mark.parametrize("num_samples, seq_len", [(0, 4), (2, 1)])
def test_windows_need_a_sample_and_two_tokens(num_samples, seq_len):
    from hf_accel.compress.calibration import chunk_token_ids

    with pytest.raises(ValueError, match=rf"^need num_samples >= 1 and seq_len >= 2, got {num_samples} x {seq_len}$"):
        chunk_token_ids(list(range(100)), num_samples, seq_len)


@pytest.mark.parametrize("with_output_grads", [False, True])
def test_a_calibration_of_padding_only_is_refused(with_output_grads):
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^calibration saw no tokens \(all padding\?\)$"):
        collect_kv_calibration(
            make_tiny_llama(), ids, torch.zeros_like(ids), with_output_grads=with_output_grads, progress=False
        )


def test_a_model_without_decoder_layers_is_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=97, bos_token_id=1, eos_token_id=2))
    with pytest.raises(ValueError, match=r"^GPT2LMHeadModel has no `model.layers\[i\].self_attn`: not a supported"):
        collect_kv_calibration(model, torch.randint(3, 97, (1, 6)), progress=False)


@pytest.mark.parametrize("text, text_samples", [(None, 4), ("some text", 0)])
def test_mixed_calibration_without_text_or_samples_is_refused(text, text_samples):
    from hf_accel.compress.calibration import mixed_calibration_ids

    with pytest.raises(ValueError, match="^no calibration data: give text samples or generated samples$"):
        mixed_calibration_ids(make_tiny_llama(), None, text, text_samples, generated_samples=0, seq_len=8)
