"""Convert the default model to MLA with CARE at half the KV cache, save it, and load it back with transformers.

Run: python examples/convert_care.py  (a few minutes on 2 CPU cores)
"""

import torch
from transformers import AutoModelForCausalLM

from hf_accel import load_model_and_tokenizer
from hf_accel.compress.care import CareConversionConfig, run_care_conversion, save_care_model
from hf_accel.eval.memory import measure_cache_bytes_per_token


model, tokenizer = load_model_and_tokenizer("smollm2-135m")
# Calibrate on 32 x 64 tokens the model generates itself, keep half the K+V cache width (water-filled ranks).
result = run_care_conversion(model, tokenizer, CareConversionConfig(kv_keep=0.5), num_samples=32, seq_len=64)
save_care_model(result, tokenizer, "smollm2-135m-care-0.5", "smollm2-135m", overwrite=True)

care = AutoModelForCausalLM.from_pretrained("smollm2-135m-care-0.5", trust_remote_code=True)
probe = torch.arange(16)[None]
print("KV bytes per token, original:", measure_cache_bytes_per_token(model, probe))
print("KV bytes per token, CARE:    ", measure_cache_bytes_per_token(care, probe))
