"""Perplexity and a side-by-side generation benchmark from Python (the CLI's `eval ppl` and `bench generate`).

Run: python examples/perplexity_and_bench.py
"""

import textwrap
from pathlib import Path

from hf_accel import load_model_and_tokenizer
from hf_accel.eval.bench import bench_generate
from hf_accel.eval.perplexity import compute_perplexity
from hf_accel.eval.prompts import load_prompts


model, tokenizer = load_model_and_tokenizer("smollm2-135m")
text = Path(textwrap.__file__).read_text()  # any text: here a Python standard-library source file
print(compute_perplexity(model, tokenizer, text, seq_len=512, max_tokens=2048))

prompts = load_prompts("humaneval", tokenizer, limit=2, offset=100)
result = bench_generate(
    model, tokenizer, prompts, ["vanilla", "pld", "ngram:smollm2-135m-code-build"], max_new_tokens=64
)
for method, figures in result["methods"].items():
    print(
        f"{method:30s} {figures['tokens_per_s']:6.1f} tok/s  speedup {figures['speedup']:.2f}x  "
        f"identical {figures['identical']}"
    )
