"""Heal a converted model: CE + β·τ²·KL(teacher‖student) fine-tuning (LoRA merged at the end, or full).

Every option is a field of `hf_accel.training.heal.HealingArguments` or of `transformers.TrainingArguments`
(`python scripts/heal.py --help` lists them). Single process:

    python scripts/heal.py --model_name_or_path CONVERTED_DIR --trust_remote_code \
        --teacher_model_name_or_path smollm2-135m --train_files corpus.txt --validation_file heldout.txt \
        --output_dir healed --max_steps 1000 --learning_rate 2e-4 --lr_scheduler_type cosine --warmup_steps 0.03

Several processes or GPUs (same options; each process holds its own teacher copy):

    accelerate launch --num_processes 4 scripts/heal.py ...same options...
    torchrun --nproc_per_node 2 scripts/heal.py --use_cpu true ...same options...   # CPU processes (gloo)

Resume an interrupted run with `--resume_from_checkpoint last` (or a `checkpoint-N` directory).
"""

import sys

from hf_accel.cli import main as hf_accel_main


def main(argv=None) -> int:
    """`hf-accel train heal` with the same options and errors (one line on stderr, exit code 2)."""
    return hf_accel_main(["train", "heal", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
