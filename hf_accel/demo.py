"""`hf-accel demo`: the embedded default model, with both halves of hf-accel on it.

1. Speculative decoding: a few built-in prompts answered by plain greedy `generate` and by the `ngram` drafter
   through `generate(custom_generate=...)`, side by side (tokens/s, tokens per target pass, identity).
2. KV-cache compression: the model converted by CARE (cached under `$HF_ACCEL_HOME/models/`), its measured cache
   bytes per token and its perplexity beside the original's, on a Python standard-library source file.
"""

import argparse
import hashlib
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from .cli import print_json
from .eval.memory import measure_cache_bytes_per_token


# Three kinds of request: a short answer with nothing to draft from (n-gram drafting cannot help), code (some
# repetition), and extraction from a given passage (the answer copies the prompt: n-gram drafting's best case).
DEMO_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    (
        "Copy every sentence of this text that mentions a city, word for word:\n\nAnna Schmidt moved from Berlin "
        "to Lisbon in 2019. She works as a nurse. Two years later, her brother Jonas followed her to Lisbon, while "
        "their cousin Mia moved to Vienna. Mia studies music. In 2022, Paul Richter left Hamburg for Copenhagen."
    ),
]
_SHIPPED_INDEX = Path(__file__).resolve().parent / "data" / "indexes" / "smollm2-135m-chat-build"
_PPL_TOKENS = 2048
_PPL_SEQ_LEN = 512
# in a cached CARE conversion: the fingerprint of the weights it was converted from, and of the code it was given
_SOURCE_STAMP = ".demo_source_fingerprint"


def add_cli(commands) -> None:
    demo = commands.add_parser("demo", help="run the embedded default model: speculative decoding and CARE")
    demo.add_argument("--model", default="smollm2-135m", help="Hub id, local directory, or `smollm2-135m`")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap of each demo prompt")
    demo.add_argument("--kv-keep", type=float, default=0.5, help="CARE budget (fraction of the K+V cache kept)")
    demo.add_argument("--no-convert", action="store_true", help="skip the CARE part")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=run_demo)


def _timed_generate(model, inputs, max_new_tokens, **kwargs):
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :], time.perf_counter() - start


@torch.no_grad()
def _speculative_rows(model, tokenizer, drafter, max_new_tokens: int) -> list[dict]:
    from .speculative import custom_generate

    rows = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:  # a base model without a chat template continues the prompt as text, as `bench generate` runs it
            inputs = tokenizer(prompt, return_tensors="pt")
        if i == 0:  # warm-up of both paths, excluded from the timings
            _timed_generate(model, inputs, 4)
            _timed_generate(model, inputs, 4, custom_generate=custom_generate, drafter=drafter)
        plain, plain_s = _timed_generate(model, inputs, max_new_tokens)
        fast, fast_s = _timed_generate(model, inputs, max_new_tokens, custom_generate=custom_generate, drafter=drafter)
        stats = drafter.last_stats
        rows.append({
            "prompt": prompt,
            "answer": tokenizer.decode(plain, skip_special_tokens=True).strip(),
            "tokens": plain.numel(),
            "vanilla_tokens_per_s": plain.numel() / plain_s,
            "ngram_tokens_per_s": fast.numel() / fast_s,
            "speedup": (fast.numel() / fast_s) / (plain.numel() / plain_s),
            # tokens per verification pass; none ran when the prefill's token was the answer (`bench generate`: null)
            "mean_accepted": stats.mean_accepted if sum(stats.accepted_histogram.values()) else None,
            "identical": plain.tolist() == fast.tolist(),
        })  # fmt: skip
    return rows


def care_cache_dir(name: str, kv_keep: float) -> Path:
    """Where the demo keeps its CARE conversion of model `name`: beside the default model's checkpoint, named by the
    model's last path part plus, for any model but the default, a hash of where it comes from (a directory or a Hub
    id), so another model of the same last name (an org's, a fine-tune's folder) gets its own."""
    from .loading import DEFAULT_MODEL, hf_accel_home, looks_like_local_path

    key = Path(name).name
    if name != DEFAULT_MODEL:
        source = str(Path(name).expanduser().resolve()) if looks_like_local_path(name) else name  # or a Hub id
        key += "-" + hashlib.sha256(source.encode()).hexdigest()[:8]
    return hf_accel_home() / "models" / f"{key}-care-kv{kv_keep:g}"


def _care_code_hash() -> str:
    """Of the CARE model code a conversion copies into its checkpoint (`hf_accel/models/*_care.py`)."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "models").glob("*_care.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _care_model(name: str, model, tokenizer, kv_keep: float):
    """The CARE conversion of `model`, converted once and cached ([`care_cache_dir`]), and converted again when the
    weights at `name` are not those it was converted from (a directory re-saved after fine-tuning), or when its code is
    not this hf-accel's (an earlier version's may not run on the installed transformers)."""
    from .compress.care import CareConversionConfig, run_care_conversion, save_care_model
    from .loading import load_model_and_tokenizer, looks_like_local_path
    from .speculative.drafters.build import model_fingerprint

    cached, source = care_cache_dir(name, kv_keep), f"{model_fingerprint(model)} code {_care_code_hash()}"
    if not _converted_from(cached, source):
        config = CareConversionConfig(kv_keep=kv_keep)
        # Calibrated on the model's own generated text (the CLI default), 32 windows of 64 tokens.
        result = run_care_conversion(model, tokenizer, config, None, True, num_samples=32, seq_len=64)
        base_model = None if looks_like_local_path(name) else name  # a local model's cache gets no model card
        # Saved and stamped in a staging folder, then renamed into place: another demo running at the same time
        # never sees a checkpoint without its stamp (and so never removes one being written). The folder is named by
        # this process and host, so that the ones killed demos left (a whole checkpoint each) are removed here.
        from .atomic import _host_name, _remove_dead_scratch

        cached.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_scratch(cached.parent, f".{cached.name}-", _host_name())
        prefix = f".{cached.name}-{os.getpid()}@{_host_name()}-"
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=cached.parent))
        try:
            staged = save_care_model(result, tokenizer, staging / cached.name, base_model)
            (staged / _SOURCE_STAMP).write_text(source + "\n")
            if not _converted_from(cached, source):  # else another demo finished first: keep its copy
                if cached.exists():
                    cached.rename(staging / "stale")  # removed with the staging folder
                try:
                    os.replace(staged, cached)
                except OSError:  # another demo's copy landed in between
                    if not _converted_from(cached, source):
                        raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return load_model_and_tokenizer(str(cached), trust_remote_code=True)[0], cached


def _converted_from(cached: Path, source: str) -> bool:
    """Whether `cached` holds a finished conversion of the weights fingerprinted `source` (its stamp says so)."""
    stamp = cached / _SOURCE_STAMP
    return (cached / "config.json").is_file() and stamp.is_file() and stamp.read_text().strip() == source


def _compression_rows(name, model, tokenizer, kv_keep: float) -> tuple[list[dict], str]:
    from .eval.perplexity import compute_perplexity

    care, cached = _care_model(name, model, tokenizer, kv_keep)
    text = Path(textwrap.__file__).read_text(encoding="utf-8")
    probe = torch.arange(32)[None] % model.config.vocab_size
    rows = []
    for label, m in (("original", model), (f"CARE kv-keep {kv_keep:g}", care)):
        ppl = compute_perplexity(m, tokenizer, text, _PPL_SEQ_LEN, _PPL_TOKENS, progress=False)["ppl"]
        rows.append({"model": label, "kv_bytes_per_token": measure_cache_bytes_per_token(m, probe), "ppl": ppl})
    return rows, str(cached)


def run_demo(args: argparse.Namespace) -> int:
    from .loading import DEFAULT_MODEL, load_model_and_tokenizer, remote_code_model_type, resolve_model
    from .speculative.drafters import build_drafter

    if not 0 < args.kv_keep <= 1:
        raise ValueError(f"--kv-keep must be in (0, 1], got {args.kv_keep}")
    model_type = remote_code_model_type(resolve_model(args.model))
    if model_type:
        raise ValueError(
            f"the demo runs plain transformers models; {args.model!r} is a converted checkpoint ({model_type}): try "
            "`hf-accel bench generate --trust-remote-code` or `hf-accel eval ppl --trust-remote-code`"
        )
    model, tokenizer = load_model_and_tokenizer(args.model)
    index = str(_SHIPPED_INDEX) if args.model == DEFAULT_MODEL else None  # the shipped index is the default's
    drafter = build_drafter("ngram", index, model, tokenizer)
    result = {"model": args.model, "dtype": str(model.dtype), "max_new_tokens": args.max_new_tokens}
    result["ngram_index"] = index
    result["speculative"] = _speculative_rows(model, tokenizer, drafter, args.max_new_tokens)
    if not args.no_convert:
        result["compression"], result["care_checkpoint"] = _compression_rows(
            args.model, model, tokenizer, args.kv_keep
        )
        result["kv_keep"] = args.kv_keep
        result["perplexity_text"] = {"text": "textwrap.py", "max_tokens": _PPL_TOKENS, "seq_len": _PPL_SEQ_LEN}
    print_json(result) if args.json else _print_tables(result)
    return 0


def _print_tables(result: dict) -> None:
    print(
        f"hf-accel demo · {result['model']} · {result['dtype']} · greedy, max_new_tokens {result['max_new_tokens']}\n"
    )
    print("Speculative decoding: plain generate vs the ngram drafter (generate(custom_generate=...))")
    print(f"{'prompt':<40}{'tokens':>7}{'vanilla':>9}{'ngram':>8}{'speedup':>9}{'acc/pass':>9}{'same':>6}  answer")
    for r in result["speculative"]:
        answer = r["answer"].replace("\n", " ")
        accepted = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        print(
            f"{r['prompt'][:38]:<40}{r['tokens']:>7}{r['vanilla_tokens_per_s']:>9.1f}{r['ngram_tokens_per_s']:>8.1f}"
            f"{r['speedup']:>8.2f}x{accepted:>9}{'yes' if r['identical'] else 'NO':>6}  "
            f"{answer[:60]}{'…' if len(answer) > 60 else ''}"
        )
    print("tok/s columns; acc/pass = tokens per target forward pass, bonus token included")
    if "compression" in result:
        print(f"\nKV-cache compression: CARE (checkpoint {result['care_checkpoint']})")
        print(f"{'model':<22}{'KV bytes/token':>16}{'perplexity':>12}")
        for r in result["compression"]:
            print(f"{r['model']:<22}{r['kv_bytes_per_token']:>16,.0f}{r['ppl']:>12.2f}")
        ppl = result["perplexity_text"]
        print(f"perplexity: Python's {ppl['text']}, first {ppl['max_tokens']} tokens, {ppl['seq_len']}-token windows")
