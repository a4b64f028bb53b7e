"""Peak memory a conversion takes above its source model (CPU, Linux): the README's figure for converted models sharing
the weights they keep.

    python scripts/probe_conversion_memory.py --converter care --json
    python scripts/probe_conversion_memory.py --converter palu --json

Builds a random Llama (hidden 2048, 8 layers, 16 query and 16 KV heads, MLP 5504, vocabulary 32,000, untied: 536M
parameters, 2.1 GB in float32), converts it at kv-keep 0.5 (CARE `svd`; Palu uniform ranks, 4 random calibration
rows of 128 tokens) and reports the process's peak resident memory (`VmHWM`) above what it held once the model was
built. One conversion per process: the peak is the process's. Compare commits by running it in each.
"""

import gc
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.cli import OneLineErrorParser


def _status_mb(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", choices=("care", "palu"), required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5504, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    gc.collect()
    before = _status_mb("VmRSS")
    if args.converter == "care":
        from hf_accel.compress.care import convert_care

        convert_care(model, method="svd", kv_keep=0.5, progress=False)
    else:
        from hf_accel.compress.palu import convert_palu

        ids = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
        convert_palu(model, None, kv_keep=0.5, ranks="uniform", calibration_ids=ids, progress=False,
                     calib_samples=4, calib_seq_len=128)  # fmt: skip
    result = {
        "converter": args.converter,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rss_with_model_mb": before,
        "peak_above_model_mb": _status_mb("VmHWM") - before,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.converter}: peak {result['peak_above_model_mb']} MB above the model ({before} MB resident)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
