"""Validation perplexity while training, and the perplexity-vs-training-tokens plot.

The history is a JSON file `{"validation": {...}, "reference_ppl": float | null, "points": [{"step", "tokens",
"ppl"}, ...]}`, rewritten after every evaluation, so an interrupted run keeps its curve and a resumed run continues
it, as long as it measures the same way: `validation` ([`validation_settings`]) names the text, window, token cap and
reference model; a resumed run with another text, window or cap starts a new curve (another reference model only
measures its own reference line).
"""

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy

from ..atomic import replace_atomically
from ..cli import strict_json
from ..eval.perplexity import compute_perplexity
from ..log import get_logger


logger = get_logger(__name__)


def read_history(path: str | Path) -> dict:
    """Reads a perplexity history file; an absent file is an empty history."""
    path = Path(path)
    if not path.is_file():
        return {"reference_ppl": None, "points": []}
    return json.loads(path.read_text(encoding="utf-8"))


def validation_settings(text: str, seq_len: int, max_tokens: int | None, reference_model: str | None = None) -> dict:
    """What a history's perplexities were measured with: the validation text (a hash), the window, the token cap, and
    the model whose perplexity is the reference line (a local one, an absolute path, by a hash: the history is
    published with the model). Points or a reference measured otherwise are not reused."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    if reference_model is not None and os.path.isabs(reference_model):
        reference_model = "local:" + hashlib.sha256(reference_model.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return {"text_sha256": digest, "seq_len": seq_len, "max_tokens": max_tokens, "reference_model": reference_model}


def same_measurement(before: dict | None, now: dict) -> bool:
    """Whether perplexities measured with [`validation_settings`] `before` and `now` lie on one curve: the same text,
    window and token cap. The reference model is not part of it (only the reference line depends on it)."""
    if before is None:
        return False
    return {**before, "reference_model": None} == {**now, "reference_model": None}


def plot_perplexity_curve(history: dict, path: str | Path, title: str | None = None) -> Path:
    """Writes a PNG of validation perplexity against training tokens.

    Args:
        history (`dict`): `{"reference_ppl", "points": [{"tokens", "ppl"}, ...]}` (see the module docstring); the
            reference (the original model's perplexity), when given, is drawn as a horizontal line.
        path (`str` or `Path`): the PNG file to write.
        title (`str`, *optional*): the plot title.

    Returns:
        `Path`: the written file.
    """
    # Figure without pyplot: no global state, no display backend needed.
    from matplotlib.figure import Figure

    points = sorted(history["points"], key=lambda p: p["tokens"])
    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.subplots()
    ax.plot([p["tokens"] for p in points], [p["ppl"] for p in points], marker="o", label="healed model")
    if history.get("reference_ppl") is not None:
        ax.axhline(history["reference_ppl"], color="gray", linestyle="--", label="original model (teacher)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or "Healing: validation perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


class PerplexityCallback(TrainerCallback):
    """Measures perplexity on held-out text every `eval_steps` optimizer steps (and at steps 0 and last).

    Training tokens are the Trainer's own count (`state.num_input_tokens_seen`, over all processes: the run needs
    `include_num_input_tokens_seen`), so a last partial batch counts what it holds.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer.
        text (`str`): held-out validation text (not the training text).
        eval_steps (`int`): evaluate every this many steps.
        history_file (`str` or `Path`): where the history is kept (see the module docstring).
        seq_len (`int`, *optional*, defaults to 512): perplexity window.
        max_tokens (`int`, *optional*): score only the first `max_tokens` tokens of `text`.
        reference_ppl (`float`, *optional*): the original model's perplexity on the same text, for the plot.
        resume (`bool`, *optional*, defaults to `False`): continue the history file's curve (a resumed run) when it
            was measured the same way ([`same_measurement`]); a new run starts its own.
        reference_model (`str`, *optional*): the model `reference_ppl` was measured on (part of the settings).
    """

    def __init__(
        self,
        tokenizer,
        text: str,
        eval_steps: int,
        history_file,
        seq_len: int = 512,
        max_tokens: int | None = None,
        reference_ppl: float | None = None,
        resume: bool = False,
        reference_model: str | None = None,
    ):
        if eval_steps <= 0:
            raise ValueError(f"eval_steps must be positive, got {eval_steps}")
        self.tokenizer, self.text, self.seq_len, self.max_tokens = tokenizer, text, seq_len, max_tokens
        self.eval_steps, self.resume = eval_steps, resume
        self.history_file = Path(history_file)
        settings = validation_settings(text, seq_len, max_tokens, reference_model)
        self.history = {"validation": settings, "reference_ppl": reference_ppl, "points": []}

    def _evaluate(self, model, state) -> None:
        was_training = model.training
        model.eval()
        result = compute_perplexity(model, self.tokenizer, self.text, self.seq_len, self.max_tokens, progress=False)
        model.train(was_training)
        step = state.global_step
        point = {"step": step, "tokens": int(state.num_input_tokens_seen), "ppl": result["ppl"]}
        self.history["points"].append(point)
        self.history_file.parent.mkdir(parents=True, exist_ok=True)
        # atomically: an interruption (what resuming is for) leaves the previous curve, not a truncated file;
        # strict JSON: a diverged run's NaN perplexity is written as null (`jq` refuses NaN and the whole file)
        text = strict_json(self.history, indent=1)
        replace_atomically(self.history_file, Path.write_text, text, "utf-8")
        tqdm.write(f"step {step}: {point['tokens']} training tokens, validation perplexity {point['ppl']:.3f}")

    def _evaluated(self, step: int) -> bool:
        return any(p["step"] == step for p in self.history["points"])

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        # a resume without a history (a run started without validation) has no curve to continue, nor to warn about
        previous = read_history(self.history_file) if self.resume and self.history_file.is_file() else None
        if previous is not None and not same_measurement(previous.get("validation"), self.history["validation"]):
            logger.warning(f"{self.history_file}: measured on other validation settings; the curve starts over")
        elif previous is not None:  # a resumed run keeps the points measured before its checkpoint
            self.history["points"] = [p for p in previous["points"] if p["step"] <= state.global_step]
        if not self._evaluated(state.global_step):
            self._evaluate(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and state.global_step % self.eval_steps == 0:
            self._evaluate(model, state)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and not self._evaluated(state.global_step):
            self._evaluate(model, state)


class TimeBudgetCallback(TrainerCallback):
    """Stops training after `max_minutes` of wall time since training began (validation included), at the end of
    the first optimizer step past the budget; the Trainer then saves and finishes as after its last step (a checkpoint
    with `save_strategy="steps"`, at the epoch's end with `"epoch"`, none with `"no"`).

    Under distributed training the processes decide together (any one past the budget stops all of them at the same
    step): clocks differ by the main process's validation, and a process that stopped alone would leave the others
    waiting in a collective.

    Args:
        max_minutes (`float`): the budget, in minutes of wall time for this `train()` call.
    """

    def __init__(self, max_minutes: float):
        if max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive, got {max_minutes}")
        self.max_seconds = 60.0 * max_minutes
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        over = time.monotonic() - self.start >= self.max_seconds
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor(float(over), device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over:
            control.should_training_stop = True
            if args.save_strategy == SaveStrategy.STEPS:  # as DefaultFlowCallback at the last step
                control.should_save = True
