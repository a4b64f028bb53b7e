"""Healing a converted model: fine-tuning with cross-entropy plus distillation from the original model.

Spec 000 (CARE) Stage 6: `L = CE + β τ² KL(teacher ‖ student)` with τ = 4, β = 0.5, the teacher being the original
(unconverted) model, frozen. Training is LoRA (spec 002, Palu App. E: r = 32, α = 32, lr 2e-4, cosine) or full
fine-tuning. After LoRA, the adapter is merged into the weights, so the healed checkpoint has the converted model's
architecture, cache and kernels, and loads exactly as the converted one did.

Single process:

    python scripts/heal.py --model_name_or_path CONVERTED_DIR --teacher_model_name_or_path smollm2-135m \
        --trust_remote_code --train_files corpus.txt --validation_file heldout.txt --output_dir healed

Several processes (one teacher copy per process, on that process's device):

    accelerate launch --num_processes 4 scripts/heal.py ...same options...
"""

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..atomic import replace_atomically
from ..cli import strict_json
from ..hub import copy_remote_code, is_hf_accel_card, published_name
from ..loading import to_checkpoint_dtype
from ..log import get_logger
from .data import PackedBlockCollator, load_text_dataset, tokenize_and_pack
from .losses import compute_healing_loss
from .monitor import (
    PerplexityCallback,
    TimeBudgetCallback,
    plot_perplexity_curve,
    read_history,
    validation_settings,
)


logger = get_logger(__name__)

HISTORY_FILE = "ppl_history.json"
PLOT_FILE = "ppl_curve.png"
SUMMARY_FILE = "healing_summary.json"
RUN_FILE = "healing_run.json"  # in each checkpoint: the run settings a resume must keep ([`run_settings`])
ADAPTER_DIR = "adapter"
# a converted student's record of its conversion (settings, ranks, KV bytes) and ranks plot, carried over
CONVERSION_RECORDS = ("care_ranks.json", "care_ranks.png", "palu_ranks.json", "palu_ranks.png")


@dataclass
class HealingArguments(TrainingArguments):
    r"""
    Arguments of [`HealingTrainer`] and `scripts/heal.py`, on top of [`~transformers.TrainingArguments`].

    Spec values not set here (they are `TrainingArguments` fields): CARE full fine-tuning uses `--learning_rate 2e-5
    --lr_scheduler_type cosine --adam_beta2 0.95 --weight_decay 0.1 --max_grad_norm 1.0`; LoRA uses
    `--learning_rate 2e-4 --lr_scheduler_type cosine`.

    > Models

    model_name_or_path (`str`, defaults to `"smollm2-135m"`): the student, usually a converted checkpoint.
    teacher_model_name_or_path (`str`, *optional*): the original model; required when `kd_beta > 0`.
    trust_remote_code (`bool`, defaults to `False`): needed for converted (CARE, Palu) checkpoints.

    > Loss

    kd_temperature (`float`, defaults to 4.0): τ. kd_beta (`float`, defaults to 0.5): β; 0 is plain cross-entropy.

    > Parameters trained

    use_lora (`bool`, defaults to `True`): LoRA adapters (merged at the end), or full fine-tuning when `False`.
    lora_r, lora_alpha, lora_dropout: LoRA rank (32), scale numerator (32) and dropout (0.0).
    lora_target_modules (`str`, defaults to `"attention"`): see [`resolve_lora_target_modules`].

    > Data

    dataset_name, dataset_config, dataset_split, text_column, train_files: the training text, a `datasets` dataset or
    local text files. train_seq_len: packed block length. max_train_blocks: cap on the number of blocks.
    validation_file, validation_seq_len, validation_max_tokens, ppl_eval_steps: held-out perplexity during training.
    max_train_minutes: a wall-time budget for training.
    """

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={"help": "The model to heal: a converted checkpoint directory, Hub id, alias."},
    )
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The original model (teacher). Required when kd_beta > 0."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow the checkpoints' own modeling code (converted models need it)."}
    )
    kd_temperature: float = field(default=4.0, metadata={"help": "Distillation temperature τ (spec: 4)."})
    kd_beta: float = field(default=0.5, metadata={"help": "Weight β of the τ²-scaled KL term (spec: 0.5)."})
    use_lora: bool = field(
        default=True, metadata={"help": "Train LoRA adapters and merge them at the end; False: full fine-tuning."}
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="attention",
        metadata={
            "help": "`attention`: every linear layer inside an attention block, whatever its name (q/k/v/o and "
            "the down/up projections of converted models); `all-linear`: every linear layer but the LM head; or "
            "comma-separated regular expressions searched in the full module names."
        },
    )
    train_seq_len: int = field(
        default=512,
        metadata={
            "help": "Length of the packed training blocks, in tokens (documents joined by EOS; each batch of 1,000 "
            "documents drops its tail shorter than a block)."
        },
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Training dataset: Hub id, local data directory, or save_to_disk directory."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "The dataset split to train on."})
    text_column: str = field(default="text", metadata={"help": "The dataset column holding the text."})
    train_files: list[str] | None = field(
        default=None, metadata={"help": "Local UTF-8 text files to train on (instead of a dataset)."}
    )
    max_train_blocks: int | None = field(default=None, metadata={"help": "Use at most this many training blocks."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Held-out UTF-8 text for perplexity during training (not the training text)."}
    )
    validation_seq_len: int | None = field(
        default=None, metadata={"help": "Perplexity window; defaults to train_seq_len."}
    )
    validation_max_tokens: int | None = field(
        default=16384, metadata={"help": "Score only the first N tokens of the validation text."}
    )
    ppl_eval_steps: int = field(default=50, metadata={"help": "Measure validation perplexity every N steps."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Write into a non-empty --output_dir (not needed to resume from its checkpoints)."},
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Stop after this many minutes of training wall time (validation included), whatever max_steps "
            "says; the learning-rate schedule still follows max_steps / num_train_epochs."
        },
    )

    def __post_init__(self):
        # `--activation_checkpointing` (transformers' default, non-reentrant, also works with frozen embeddings
        # under LoRA) trades compute for activation memory.
        self._validate_healing()
        if self.include_num_input_tokens_seen in ("no", False):
            self.include_num_input_tokens_seen = "all"  # the summary, card and curve report tokens actually seen
        super().__post_init__()

    def _validate_healing(self) -> None:
        # written `not (x > 0)`: NaN fails every comparison, and passed `x <= 0` to make every loss NaN (or, as
        # max_train_minutes, to never stop)
        if not (0 < self.kd_temperature < math.inf):
            raise ValueError(f"kd_temperature must be a finite positive number, got {self.kd_temperature}")
        if not (0 <= self.kd_beta < math.inf):
            raise ValueError(f"kd_beta must be a finite number ≥ 0, got {self.kd_beta}")
        if self.kd_beta > 0 and self.teacher_model_name_or_path is None:
            raise ValueError(
                f"kd_beta={self.kd_beta} needs a teacher: pass --teacher_model_name_or_path (the original model), "
                "or --kd_beta 0 for cross-entropy only"
            )
        if (self.dataset_name is None) == (not self.train_files):
            raise ValueError("give exactly one training source: --dataset_name or --train_files")
        missing = [f for f in self.train_files or [] if not Path(f).is_file()]
        if missing:  # before minutes of model loading
            raise ValueError(f"training text file(s) not found: {', '.join(missing)}")
        if self.validation_file is not None and not Path(self.validation_file).is_file():
            raise ValueError(f"validation text file not found: {self.validation_file}")
        if self.label_smoothing_factor != 0:  # HealingTrainer.compute_loss replaces the Trainer's label smoother
            raise ValueError(
                f"--label_smoothing_factor {self.label_smoothing_factor}: the healing loss (CE + distillation) has no "
                "label smoothing; leave it at 0"
            )
        if self.lora_target_modules not in ("attention", "all-linear"):
            _lora_target_patterns(self.lora_target_modules)  # a bad regular expression fails before any loading
        for name in (
            "lora_r",
            "lora_alpha",
            "train_seq_len",
            "ppl_eval_steps",
            "max_train_minutes",
            "max_train_blocks",
            "validation_seq_len",
            "validation_max_tokens",
        ):
            if getattr(self, name) is not None and not (getattr(self, name) > 0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("train_seq_len", "validation_seq_len"):  # one token predicts nothing
            if getattr(self, name) == 1:
                raise ValueError(f"{name} must be at least 2 tokens, got 1")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:  # zero steps would save the student as if healed
            raise ValueError(
                f"nothing to train: --max_steps {self.max_steps} and --num_train_epochs {self.num_train_epochs}; "
                "give a positive --max_steps or --num_train_epochs"
            )


def _check_teacher_apart(student, teacher) -> None:
    """Refuses a teacher that holds weights the student trains: a converted model shares the weights it keeps with its
    source ([`~hf_accel.compress.export.load_converted_state`]), so healing it against that source in one process
    would move the teacher with every step."""
    trained = {p.data_ptr() for p in student.parameters() if p.requires_grad}
    if any(p.data_ptr() in trained for p in teacher.parameters()):
        raise ValueError(
            "the teacher shares weights with the student (a converted model shares what it keeps with its source): "
            "pass `teacher_model=copy.deepcopy(source)`"
        )


class HealingTrainer(Trainer):
    """A [`~transformers.Trainer`] whose loss is `CE + β τ² KL(teacher ‖ student)` (see [`compute_healing_loss`]).

    Args:
        teacher_model (`PreTrainedModel`, *optional*): the frozen original model; moved to the training device and
            put in eval mode. `None` trains with cross-entropy only. It must not hold weights the student trains:
            a model converted in this process shares what it keeps with its source, so pass a copy of the source.
        kd_temperature (`float`, *optional*, defaults to 4.0): τ.
        kd_beta (`float`, *optional*, defaults to 0.5): β.
        args, kwargs: as for [`~transformers.Trainer`]; `train_dataset` rows need `input_ids` and the collator must
            add `labels` (see [`PackedBlockCollator`]).
    """

    def __init__(self, *args, teacher_model=None, kd_temperature: float = 4.0, kd_beta: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.kd_temperature, self.kd_beta = kd_temperature, kd_beta
        self.teacher_model = teacher_model
        if teacher_model is not None:
            self.teacher_model = teacher_model.to(self.args.device).eval().requires_grad_(False)
            _check_teacher_apart(self.model, self.teacher_model)
        # Our loss always divides by `num_items_in_batch` when given, so let the Trainer count it and not also
        # divide by the accumulation steps (see Trainer.training_step).
        self.model_accepts_loss_kwargs = True
        self._loss_parts = {"ce": [], "kd": []}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # The Trainer's loop checks for `max_steps` after a step only (DefaultFlowCallback.on_step_end), so a resume
        # from the last step's checkpoint (a kill during the final save) trained one step more. Its loop
        # (`Trainer._run_epoch`, transformers 5) asks here for each step's batches: none, and a stop, end it before
        # that step. The checkpoint's weights and state are loaded by then, and the Trainer finishes as after the last
        # step of an uninterrupted run (on_train_end: the last perplexity, if the killed run had not measured it).
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs, use_cache=False)
        teacher_logits = None
        if self.teacher_model is not None and self.kd_beta > 0:
            with torch.no_grad():
                teacher_logits = self.teacher_model(**inputs, use_cache=False).logits
        out = compute_healing_loss(
            outputs.logits,
            teacher_logits,
            labels,
            self.kd_temperature,
            self.kd_beta,
            num_items_in_batch=num_items_in_batch,
        )
        if model.training:
            self._record_parts(out, labels, num_items_in_batch)
        loss = out.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch counts every data-parallel process's tokens once (tensor-parallel ranks share a batch)
            # and DDP averages gradients over those processes: undo that mean, with Trainer.compute_loss's divisor.
            # Not Trainer's `n_gpu` factor for DataParallel: this loss is taken over the batch gathered from every
            # replica, not averaged over per-replica losses.
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, outputs) if return_outputs else loss

    def _record_parts(self, out, labels, num_items_in_batch) -> None:
        # Log each part as a per-token mean of this micro-batch, whatever the normalisation used for the gradient.
        # Tensors, not floats: no host sync per step; they are read when the Trainer logs.
        scale = 1.0
        if num_items_in_batch is not None:
            scale = num_items_in_batch / (labels[..., 1:] != -100).sum().clamp(min=1)
        self._loss_parts["ce"].append((out.ce * scale).detach())
        self._loss_parts["kd"].append((out.kd * scale).detach())

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self._loss_parts["ce"]:
            for name, values in self._loss_parts.items():
                # this process's micro-batches, then the mean over processes, as the Trainer logs `loss` (every
                # process logs here together; packed blocks give every micro-batch the same number of tokens)
                mean = torch.stack(values).float().mean()
                logs[f"{name}_loss"] = self.accelerator.reduce(mean, reduction="mean").item()
                values.clear()
        super().log(logs, *args, **kwargs)


def resolve_lora_target_modules(model: nn.Module, spec: str = "attention") -> list[str]:
    """The full names of the linear layers that get LoRA adapters.

    Args:
        model (`nn.Module`): the model (before `get_peft_model`).
        spec (`str`, *optional*, defaults to `"attention"`):
            - `"attention"`: every `nn.Linear` with an ancestor module whose name contains `attn` or `attention`
              (case-insensitive). This covers q/k/v/o and whatever down/up projections a converted attention has,
              under any name.
            - `"all-linear"`: every `nn.Linear` except the output embeddings (LM head).
            - otherwise comma-separated regular expressions; a linear layer is chosen if one of them is found
              (`re.search`) in its full name, e.g. `"k_proj,v_proj,kv_(down|up)"`.

    Returns:
        `list[str]`: sorted full module names, ready for `peft.LoraConfig(target_modules=...)`.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head]
    if spec == "all-linear":
        chosen = linears
    elif spec == "attention":
        ancestor = re.compile(r"attn|attention", re.IGNORECASE)
        chosen = [name for name in linears if any(ancestor.search(part) for part in name.split(".")[:-1])]
    else:
        patterns = _lora_target_patterns(spec)
        chosen = [name for name in linears if any(p.search(name) for p in patterns)]
    if not chosen:
        examples = ", ".join(linears[:6])
        raise ValueError(f"lora_target_modules={spec!r} matches no linear layer; the model has e.g. {examples}")
    return sorted(chosen)


def _lora_target_patterns(spec: str) -> list[re.Pattern]:
    try:
        return [re.compile(p.strip()) for p in spec.split(",") if p.strip()]
    except re.error as err:
        raise ValueError(f"lora_target_modules={spec!r} is not a comma-separated list of regular expressions: {err}")


def prepare_student(model, args: HealingArguments):
    """Wraps `model` with LoRA adapters (`args.use_lora`), or makes every parameter trainable (full fine-tuning)."""
    if not args.use_lora:
        return model.requires_grad_(True)
    from peft import LoraConfig, get_peft_model

    targets = resolve_lora_target_modules(model, args.lora_target_modules)
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    logger.info(f"LoRA on {len(targets)} linear layers, e.g. {targets[:4]}")
    frozen = _raw_parameters_beside(model, targets)
    if frozen:
        logger.warning(
            f"LoRA adapts linear layers only: {len(frozen)} parameters held directly by those layers' modules (e.g. "
            f"{frozen[0]}; Palu's key up-projection is one) stay as converted; --use_lora False trains them too"
        )
    return get_peft_model(model, config)


def _raw_parameters_beside(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of parameters held directly (not through a submodule) by a module holding LoRA targets."""
    parents = {name.rpartition(".")[0] for name in targets}
    return [
        f"{name}.{param_name}"
        for name, module in model.named_modules()
        if name in parents
        for param_name, _ in module.named_parameters(recurse=False)
    ]


def _check_finite(model) -> None:
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise ValueError(
                f"the healed weights are not finite in {name}: lower --learning_rate, or train without --fp16"
            )


def save_healed_model(model, tokenizer, output_dir: str | Path, source: str | Path | None = None):
    """Merges LoRA adapters (if any) and saves a checkpoint that loads like the student did, in the dtype of the
    student's checkpoint (training runs in float32; a bfloat16 conversion stays bfloat16).

    Args:
        model (`PreTrainedModel` or `PeftModel`): the trained student.
        tokenizer (`PreTrainedTokenizerBase`): saved beside it.
        output_dir (`str` or `Path`): the checkpoint directory.
        source (`str` or `Path`, *optional*): the student's original directory (searched for remote code, read for
            its dtype) or Hub id (read for its dtype).

    Returns:
        the merged `PreTrainedModel`.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    _check_finite(model)
    if source is not None:
        model = to_checkpoint_dtype(model, source)
    # the Trainer set it to TrainingArguments.use_cache (False); the checkpoint should cache like the converted one
    model.config.use_cache = True
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    copy_remote_code(model, output_dir, source)
    return model


def _load_models(args: HealingArguments):
    from ..loading import load_model_and_tokenizer

    student, tokenizer = load_model_and_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if getattr(student, "peft_config", None):
        # an adapter directory loads as its base with the adapters attached: `save_pretrained` of the healed model
        # would then write the adapters alone (full fine-tuning's weights lost) or fail (LoRA, after training)
        raise ValueError(
            f"the student {args.model_name_or_path!r} has PEFT adapters loaded (an adapter directory): merge them "
            "first (merge_and_unload() of a PeftModel, then save) and heal the merged model"
        )
    teacher = None
    if args.kd_beta > 0:
        teacher, _ = load_model_and_tokenizer(
            args.teacher_model_name_or_path, trust_remote_code=args.trust_remote_code
        )
        sizes = [m.get_output_embeddings().weight.shape[0] for m in (teacher, student)]
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"the teacher {args.teacher_model_name_or_path!r} predicts {sizes[0]} tokens and the student "
                f"{args.model_name_or_path!r} {sizes[1]}: distillation needs one vocabulary"
            )
    return student.train(), teacher, tokenizer


def _perplexity_callback(args: HealingArguments, tokenizer, teacher, resume: bool):
    """The validation-perplexity callback, with the teacher's perplexity as the plot's reference line."""
    if args.validation_file is None:
        return None
    from ..eval.perplexity import compute_perplexity, read_eval_text

    text = read_eval_text(path=args.validation_file)
    seq_len = args.validation_seq_len or args.train_seq_len
    history_file = Path(args.output_dir) / HISTORY_FILE
    reference_model = _where(args.teacher_model_name_or_path) if teacher is not None else None  # named either way
    settings = validation_settings(text, seq_len, args.validation_max_tokens, reference_model)
    previous = read_history(history_file) if resume else {}  # an old run's is not this run's
    # nor one measured on another text, window or teacher before the resumed checkpoint
    reference = previous.get("reference_ppl") if previous.get("validation") == settings else None
    if reference is None and teacher is not None:
        teacher = teacher.to(args.device)  # it loaded on the CPU; HealingTrainer would move it there next anyway
        reference = compute_perplexity(teacher, tokenizer, text, seq_len, args.validation_max_tokens, progress=False)
        reference = reference["ppl"]
    return PerplexityCallback(
        tokenizer, text, args.ppl_eval_steps, history_file, seq_len, args.validation_max_tokens, reference, resume,
        reference_model,
    )  # fmt: skip


def _resume_target(args: HealingArguments):
    value = args.resume_from_checkpoint
    if value is None or value.lower() in ("false", "no", ""):
        return None
    if value.lower() in ("true", "last", "latest"):
        last = _last_complete_checkpoint(args.output_dir)
        if last is None:
            raise ValueError(
                f"--resume_from_checkpoint {value}: no complete {PREFIX_CHECKPOINT_DIR}-N directory (with "
                f"trainer_state.json) in {args.output_dir}"
            )
        return last
    if not (Path(value) / "trainer_state.json").is_file():  # before the models load, not after packing the text
        raise ValueError(f"--resume_from_checkpoint {value}: not a Trainer checkpoint (no trainer_state.json)")
    if not _whole_trainer_state(value):
        raise ValueError(
            f"--resume_from_checkpoint {value}: its trainer_state.json is cut short (a save killed while writing it); "
            "resume from an earlier checkpoint"
        )
    return value


# Options that decide what a checkpoint's weights and optimizer state are (the student, LoRA's shapes) or what the
# run trains on: a resume with other values would fail deep in the Trainer's loading, or continue on other data.
# Learning rate, steps, loss weights and validation may change on a resume.
_RUN_SETTINGS = (
    "model_name_or_path",
    "use_lora",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "train_files",
    "dataset_name",
    "dataset_config",
    "dataset_split",
    "text_column",
    "train_seq_len",
    "max_train_blocks",
)


def _where(name: str) -> str:
    """A local path made absolute (a resume may name it otherwise); a Hub id as given."""
    return str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else name


def run_settings(args: HealingArguments) -> dict:
    """The [`_RUN_SETTINGS`] of `args`, local paths made absolute ([`_where`])."""
    settings = {name: getattr(args, name) for name in _RUN_SETTINGS}
    settings["model_name_or_path"] = _where(args.model_name_or_path)
    settings["dataset_name"] = _where(args.dataset_name) if args.dataset_name else args.dataset_name
    settings["train_files"] = [_where(f) for f in args.train_files] if args.train_files else args.train_files
    if not args.use_lora:  # full fine-tuning: LoRA's options shape nothing
        for name in ("lora_r", "lora_alpha", "lora_target_modules"):
            settings.pop(name)
    return json.loads(json.dumps(settings))  # as read back from the file


def _check_resume_settings(args: HealingArguments, checkpoint: str) -> None:
    """Refuses, in one line and before anything loads, a resume whose run settings differ from those `checkpoint` was
    trained with (its `healing_run.json`; checkpoints from before the file existed are not checked)."""
    written = Path(checkpoint) / RUN_FILE
    if not written.is_file():
        return
    try:
        before = json.loads(written.read_text(encoding="utf-8"))
    except ValueError:  # cut short by a kill in an earlier version, which wrote it in place
        raise ValueError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint}: {written} is not valid JSON; delete it to "
            "resume without checking the run settings"
        ) from None
    now = run_settings(args)
    changed = [f"{k}={before.get(k)!r}, now {now[k]!r}" for k in now if before.get(k) != now[k]]
    if changed:
        raise ValueError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint}: {Path(checkpoint).name} was trained with "
            f"{'; '.join(changed)}: resume with the run's model, LoRA and data options, or start a new run "
            "(--overwrite_output_dir)"
        )


class _RunSettingsCallback(TrainerCallback):
    """Writes the run settings into every checkpoint the Trainer saves, for [`_check_resume_settings`]."""

    def __init__(self, settings: dict):
        self.settings = settings

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and folder.is_dir():
            # atomically: it is written after the Trainer's trainer_state.json, so a kill while it was written in place
            # left a complete checkpoint whose resume failed on a bare JSON error
            text = json.dumps(self.settings, indent=1)
            replace_atomically(folder / RUN_FILE, Path.write_text, text, "utf-8")


def _last_complete_checkpoint(output_dir) -> str | None:
    """The newest `checkpoint-N` that holds a whole `trainer_state.json` (written last by the Trainer, so a save that
    was interrupted, even while writing that file, is skipped for the one before it)."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = [
        (int(m.group(1)), d)
        for d in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        if (m := pattern.match(d.name))
    ]
    for _, folder in sorted(found, reverse=True):
        if _whole_trainer_state(folder):
            return str(folder)
    return None


def _whole_trainer_state(checkpoint) -> bool:
    """Whether `checkpoint` holds a `trainer_state.json` that is a whole JSON object: the Trainer writes it in place,
    so a kill while it does leaves it empty or cut short, and the Trainer's resume failed on it with a bare JSON error."""
    try:
        return isinstance(json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


_CARD_SETTINGS = (
    "kd_temperature",
    "kd_beta",
    "use_lora",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "train_seq_len",
    "dataset_name",
    "dataset_config",
    "dataset_split",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "adam_beta2",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)


def healing_settings(args: HealingArguments, summary: dict | None = None) -> dict:
    """The healing options worth showing on a model card (prefixed `healing_`), with the run's steps and tokens."""
    settings = {f"healing_{name}": getattr(args, name) for name in _CARD_SETTINGS if getattr(args, name) is not None}
    settings = {k: getattr(v, "value", v) for k, v in settings.items()}  # enums (the scheduler) by their value
    if args.train_files:
        settings["healing_train_files"] = ", ".join(Path(f).name for f in args.train_files)
        settings.pop("healing_dataset_split", None)  # no dataset, so no split
    elif args.dataset_name:  # a local dataset directory: its path is not published either
        settings["healing_dataset_name"] = published_name(args.dataset_name)
    if not args.use_lora:
        for name in ("healing_lora_r", "healing_lora_alpha", "healing_lora_target_modules"):
            settings.pop(name)
    if summary:
        settings.update(healing_steps=summary["steps"], healing_train_tokens=summary["train_tokens"])
    return settings


def _carry_conversion_record(source, output_dir) -> dict:
    """Copies a converted student's conversion record (`care_ranks.json` or `palu_ranks.json`, and its plot) from its
    directory `source` into the healed checkpoint, and returns the card fields the record keeps (`settings`,
    `kv_bytes_per_token`, `base_kv_bytes_per_token`, and the copied plot as `ranks_plot`; `None`s if there is none):
    healing changes the weights, not what the cache holds."""
    card, plot = {}, None
    for name in CONVERSION_RECORDS:
        if (Path(source) / name).is_file():
            copied = shutil.copy(Path(source) / name, Path(output_dir) / name)
            if name.endswith(".json"):
                card = json.loads(Path(copied).read_text(encoding="utf-8")).get("card") or {}
            else:
                plot = copied
    return {**card, "ranks_plot": plot}


def _write_card(args: HealingArguments, summary: dict, conversion: dict) -> None:
    """A `converted-model` card for the healed checkpoint: the conversion's settings and KV bytes per token (from
    [`_carry_conversion_record`]), then the healing's."""
    from ..hub import hub_id_or_none, write_model_card

    base = args.teacher_model_name_or_path or args.model_name_or_path
    if hub_id_or_none(base) is None:
        logger.warning(f"no model card written: the base model {base!r} is not a Hub id (use hf_accel.hub)")
        return
    results = None
    if summary["ppl"] is not None:
        name = Path(args.validation_file).name
        results = [{"metric_type": "perplexity", "metric_value": round(summary["ppl"], 4), "dataset_name": name}]
    write_model_card(
        args.output_dir,
        "converted-model",
        base,
        settings={**conversion.get("settings", {}), **healing_settings(args, summary)},
        eval_results=results,
        kv_bytes_per_token=conversion.get("kv_bytes_per_token"),
        base_kv_bytes_per_token=conversion.get("base_kv_bytes_per_token"),
        ranks_plot=conversion.get("ranks_plot"),
        description=(
            "Healed with cross-entropy plus distillation from the original model (`hf-accel train heal`)."
            if args.kd_beta > 0
            else "Healed with cross-entropy on the training text (`hf-accel train heal`)."
        ),
    )


@dataclass
class HealingResult:
    """What [`run_healing`] returns: the healed (merged) model in memory and the run's summary (also written to
    `healing_summary.json`)."""

    model: object
    summary: dict


def _check_output_dir(args: HealingArguments, resume_target: str | None) -> None:
    """Refuses, before anything loads, an `--output_dir` that is a model being read, a file, or a used directory
    (unless resuming from it or `--overwrite_output_dir`): the healed checkpoint replaces files of the same names."""
    from ..atomic import check_output_path
    from ..loading import resolve_model

    out = check_output_path(args.output_dir, option="--output_dir")  # a file, or a path under one
    for name in filter(None, (args.model_name_or_path, args.teacher_model_name_or_path)):
        source = resolve_model(name)
        if Path(source).is_dir() and Path(source).resolve() == out:
            raise ValueError(f"--output_dir {args.output_dir} is the model {name!r} itself: choose another directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite_output_dir and resume_target is None:
        # a run stopped before its first checkpoint leaves e.g. ppl_history.json only: `last` has nothing to resume
        resume = ", --resume_from_checkpoint last," if _last_complete_checkpoint(out) is not None else ""
        raise ValueError(
            f"--output_dir {args.output_dir} exists and is not empty: pass --overwrite_output_dir{resume} "
            "or another directory"
        )


def _build_trainer(args: HealingArguments, resume: bool) -> tuple[HealingTrainer, object, PerplexityCallback | None]:
    with args.main_process_first(desc="load the training text"):  # before the models: bad text fails in seconds
        texts = load_text_dataset(args.dataset_name, args.dataset_config, args.dataset_split, args.train_files)
    student, teacher, tokenizer = _load_models(args)
    set_seed(args.seed)  # the Trainer seeds only after this, too late for the LoRA weights' initialisation
    model = prepare_student(student, args)
    with args.main_process_first(desc="tokenize and pack"):
        train_dataset = tokenize_and_pack(
            texts, tokenizer, args.train_seq_len, args.text_column, args.max_train_blocks
        )
    callback = _perplexity_callback(args, tokenizer, teacher, resume)
    callbacks = [_RunSettingsCallback(run_settings(args))] + ([callback] if callback is not None else [])
    if args.max_train_minutes is not None:
        callbacks.append(TimeBudgetCallback(args.max_train_minutes))
    trainer = HealingTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=PackedBlockCollator(),
        processing_class=tokenizer,
        teacher_model=teacher,
        kd_temperature=args.kd_temperature,
        kd_beta=args.kd_beta,
        callbacks=callbacks,
    )
    return trainer, tokenizer, callback


def _remove_earlier_run(output_dir) -> None:
    """Deletes what an earlier healing run wrote in `output_dir` (reached with `--overwrite_output_dir` only): its
    Trainer checkpoints (`checkpoint-N`) would be taken for this run's by `--resume_from_checkpoint last`, and its
    adapter, curve, summary or card would be published beside this run's model, and its healed checkpoint (config and
    weights: its summary says it finished), which `from_pretrained` would load as this run's if this one is
    interrupted. Other files stay."""
    from ..hub import WEIGHT_PATTERNS

    out = Path(output_dir)
    if (out / SUMMARY_FILE).is_file():
        for path in [p for pattern in ("config.json", *WEIGHT_PATTERNS) for p in out.glob(pattern)]:
            path.unlink(missing_ok=True)
    checkpoints = [p for p in out.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if re.fullmatch(r"checkpoint-\d+", p.name)]
    adapter = [out / ADAPTER_DIR] if (out / ADAPTER_DIR / "adapter_config.json").is_file() else []
    for path in checkpoints + adapter:
        shutil.rmtree(path, ignore_errors=True)
    for name in (HISTORY_FILE, PLOT_FILE, SUMMARY_FILE, *CONVERSION_RECORDS):
        (out / name).unlink(missing_ok=True)
    if is_hf_accel_card(out / "README.md"):
        (out / "README.md").unlink(missing_ok=True)


def _save_adapter(model, adapter_dir: Path, student: str) -> None:
    """The LoRA adapter, naming the student's Hub id as its base (none when the student is a local directory: PEFT
    would write the local path), without PEFT's own card (its front matter names that path too)."""
    from ..hub import hub_id_or_none, name_base_model_in_adapters

    model.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").unlink(missing_ok=True)
    name_base_model_in_adapters(model, adapter_dir, hub_id_or_none(student))


def run_healing(args: HealingArguments) -> HealingResult:
    """Heals `args.model_name_or_path` and saves the (merged) result to `args.output_dir`.

    Writes, in `args.output_dir`: the healed checkpoint (with its remote code), `adapter/` (LoRA only),
    `checkpoint-*/` (Trainer checkpoints, resumable), `ppl_history.json` and `ppl_curve.png` (with a validation
    file), `healing_summary.json` (the summary without local paths), and a converted student's conversion record. A run that is not a resume first deletes
    an earlier run's checkpoints, adapter, curve, summary and card there (`--overwrite_output_dir`).

    Args:
        args ([`HealingArguments`]): every option.

    Returns:
        [`HealingResult`]; its `summary` has `output_dir`, `steps`, `train_tokens`, `trainable_parameters`, `ppl`
        (last validation perplexity or `None`), `reference_ppl` (the teacher's) and `plot` (path or `None`). On
        processes other than the main one, `model` is `None`.

    Example:
        ```python
        >>> args = HealingArguments(output_dir="healed", model_name_or_path="converted", trust_remote_code=True,
        ...     teacher_model_name_or_path="smollm2-135m", train_files=["corpus.txt"], validation_file="heldout.txt")
        >>> run_healing(args).summary["ppl"]
        ```
    """
    from ..loading import resolve_model

    resume_target = _resume_target(args)  # a checkpoint directory, or None
    _check_output_dir(args, resume_target)
    if resume_target is not None:
        _check_resume_settings(args, resume_target)
    trainer, tokenizer, callback = _build_trainer(args, resume_target is not None)
    if resume_target is None and args.should_save:  # the process that saves checkpoints (one per node if each saves)
        _remove_earlier_run(args.output_dir)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = trainer.train(resume_from_checkpoint=resume_target)
    summary = {"output_dir": args.output_dir, "steps": result.global_step, "trainable_parameters": trainable}
    summary.update(train_tokens=int(trainer.state.num_input_tokens_seen), ppl=None, reference_ppl=None, plot=None)
    merged = None
    if trainer.is_world_process_zero():
        trained = trainer.accelerator.unwrap_model(trainer.model)
        _check_finite(trained)  # before the adapter is written: a diverged run leaves no weights to publish
        if args.use_lora:
            _save_adapter(trained, Path(args.output_dir) / ADAPTER_DIR, args.model_name_or_path)
        student = resolve_model(args.model_name_or_path)
        merged = save_healed_model(trained, tokenizer, args.output_dir, student)
        conversion = _carry_conversion_record(student, args.output_dir)
        if callback is not None:
            history = callback.history
            summary.update(ppl=history["points"][-1]["ppl"], reference_ppl=history["reference_ppl"])
            summary["plot"] = str(plot_perplexity_curve(history, Path(args.output_dir) / PLOT_FILE))
        _write_card(args, summary, conversion)
        # published with the model: no local paths (the plot lies beside it)
        written = {**summary, "plot": summary["plot"] and PLOT_FILE}
        del written["output_dir"]
        (Path(args.output_dir) / SUMMARY_FILE).write_text(strict_json(written, indent=1), encoding="utf-8")
    trainer.accelerator.wait_for_everyone()
    return HealingResult(model=merged, summary=summary)
