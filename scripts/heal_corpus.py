"""Writes the texts of the healing experiment (README, "Healing"): a training corpus and two held-out texts.

- `train.txt`: tinyshakespeare's first half, the default model's own responses to the index-building prompts (decoded
  from the shipped self-distillation indexes: chat build set and HumanEval 1–100), and Python standard-library sources
  (every fourth top-level module in sorted order, `textwrap.py` excluded: the demo evaluates on it).
- `heldout_shakespeare.txt`: tinyshakespeare's second half (never trained or calibrated on).
- `teacher_samples.txt` (with `--teacher-samples N`): N × 256 tokens sampled from the original model, the same sampler
  as the held-out text below, on the index-building prompts (chat build set, then HumanEval-style `code_build`), which
  share none with CARE's held-out prompts: the teacher's own distribution without its evaluation text.
- `heldout_generated.txt`: text sampled from the original model on CARE's held-out prompts, with the seed and sizes
  `scripts/bench_care.py` uses (10 × 256 tokens, seed 1000), so both experiments score the same kind of text.

Example:
    python scripts/heal_corpus.py --out runs/heal --teacher-samples 640
"""

import json
import sys
import sysconfig
from pathlib import Path

from hf_accel.cli import OneLineErrorParser


DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"  # ../shared
INDEXES = ("smollm2-135m-chat-build", "smollm2-135m-humaneval-first100")


def stdlib_sample(every: int = 4, exclude: tuple[str, ...] = ("textwrap.py",)) -> list[Path]:
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.name not in exclude)
    return files[::every]


def self_distilled_responses() -> list[str]:
    """The default model's answers in the shipped indexes, decoded with the tokenizer each index names: their token
    ids are that tokenizer's, whatever `--model` is."""
    import hf_accel
    from hf_accel.loading import load_tokenizer

    texts = []
    for name in INDEXES:
        directory = Path(hf_accel.__file__).parent / "data" / "indexes" / name
        tokenizer = load_tokenizer(json.loads((directory / "header.json").read_text())["tokenizer_name"])
        with open(directory / "self_distill.jsonl") as f:
            texts += [tokenizer.decode(json.loads(line)["tokens"], skip_special_tokens=True) for line in f]
    return texts


def main(argv=None) -> int:
    from hf_accel.eval.care_quality import generated_text, split_text
    from hf_accel.eval.prompts import load_prompts
    from hf_accel.loading import load_model_and_tokenizer

    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--out", required=True)
    p.add_argument("--teacher-samples", type=int, default=0, help="also write teacher_samples.txt (N x 256 tokens)")
    args = p.parse_args(argv)
    if args.teacher_samples < 0:
        p.error(f"--teacher-samples must be >= 0, got {args.teacher_samples}")

    model, tokenizer = load_model_and_tokenizer(args.model)
    first, second = split_text(Path(args.text).read_text(encoding="utf-8"))
    sources = [first] + self_distilled_responses()
    sources += [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_sample()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n\n".join(sources), encoding="utf-8")
    (out / "heldout_shakespeare.txt").write_text(second, encoding="utf-8")
    generated = generated_text(model, tokenizer, num_samples=10, seq_len=256, seed=1000)
    (out / "heldout_generated.txt").write_text(generated, encoding="utf-8")
    names = ["train.txt", "heldout_shakespeare.txt", "heldout_generated.txt"]
    if args.teacher_samples:
        prompts = [p.text for name in ("chat_build", "code_build") for p in load_prompts(name)]
        samples = generated_text(model, tokenizer, args.teacher_samples, seq_len=256, seed=0, prompts=prompts)
        (out / "teacher_samples.txt").write_text(samples, encoding="utf-8")
        names.append("teacher_samples.txt")
    sizes = {name: len(tokenizer((out / name).read_text(encoding="utf-8")).input_ids) for name in sorted(names)}
    print(json.dumps({"out": str(out), "tokens": sizes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
