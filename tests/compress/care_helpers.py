"""Tiny random-initialised models of every family CARE supports, and a calibration on random tokens."""

import torch

from tests.conftest import TINY_CONFIG


TINY = TINY_CONFIG
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def make_tiny(family: str, seed: int = 0, **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    kwargs = dict(TINY, **overrides)
    if family == "qwen2":
        kwargs.pop("head_dim")  # Qwen2 derives it: 32 / 4 = 8
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # random biases and norms, so that the bias / norm paths are really exercised
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def tiny_calibration(model, n: int = 8, seq_len: int = 16, with_output_grads: bool = True, seed: int = 0):
    from hf_accel.compress.calibration import collect_kv_calibration

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, seq_len), generator=generator)
    return collect_kv_calibration(model, ids, with_output_grads=with_output_grads, progress=False)
