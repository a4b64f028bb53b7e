"""Healing losses: next-token cross-entropy plus temperature-scaled distillation from a frozen teacher.

Spec 000 (CARE) Stage 6, Eqs. (3.13)-(3.15):

    L_CE = -(1/T) Σ_t log p^S(x_{t+1} | x_{≤t})
    L_KD =  (1/T) Σ_t KL( softmax(z_t^T / τ) || softmax(z_t^S / τ) )
    L    =  L_CE + β τ² L_KD,          τ = 4, β = 0.5

Both sums run over the same predictions: position t predicts label t + 1 (causal shift), and a position whose next
label is `ignore_index` (padding, masked prompt) counts in neither the sum nor T. The τ² factor keeps the gradient
of the KD term on the scale of the CE term when τ changes (Hinton et al. 2015, arXiv:1503.02531, Sec. 2).

With gradient accumulation, `transformers.Trainer` passes `num_items_in_batch`, the number of valid predictions in
the whole accumulated batch; the sums are then divided by it instead of the micro-batch's own count, which is what
makes accumulated steps equal to one big step.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


IGNORE_INDEX = -100


@dataclass
class HealingLossOutput:
    """The combined loss and its parts (both parts already reduced; `kd` without the β τ² factor)."""

    loss: torch.Tensor
    ce: torch.Tensor
    kd: torch.Tensor


def _shift(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """Aligns each position's logits with the next label and returns them flattened with the validity mask."""
    vocab = logits.shape[-1]
    logits = logits[..., :-1, :].reshape(-1, vocab)  # [N, V], N = B * (S - 1)
    targets = labels[..., 1:].reshape(-1)  # [N]
    return logits, targets, targets != ignore_index


def _denominator(valid: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=valid.device)
    # clamp: a micro-batch with no valid prediction gives a zero loss, not NaN.
    return valid.sum().clamp(min=1).float()


def compute_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 4.0,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over valid predictions of KL(softmax(teacher / τ) ‖ softmax(student / τ)), Eq. (3.14), without τ².

    Args:
        student_logits (`torch.Tensor` of shape `[B, S, V]`): the student's logits.
        teacher_logits (`torch.Tensor` of shape `[B, S, V]`): the teacher's logits on the same `input_ids`.
        labels (`torch.Tensor` of shape `[B, S]`): the `input_ids`, with `ignore_index` where nothing is predicted;
            position t is scored iff `labels[:, t + 1] != ignore_index`.
        temperature (`float`, *optional*, defaults to 4.0): τ; both distributions are softened by it.
        ignore_index (`int`, *optional*, defaults to -100): the label value that masks a position.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): divide the sum by this instead of the number of
            valid predictions (gradient accumulation, see the module docstring).

    Returns:
        `torch.Tensor`: a scalar in nats, computed in float32.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs "
            f"{tuple(teacher_logits.shape)}; the two models must share the tokenizer and vocabulary"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    student, _, valid = _shift(student_logits.float(), labels, ignore_index)
    teacher, _, _ = _shift(teacher_logits.float(), labels, ignore_index)
    if not valid.all():  # packed blocks have no masked position: skip the [n, V] copies then
        student, teacher = student[valid], teacher[valid]
    student_logp = F.log_softmax(student / temperature, dim=-1)  # [n, V]
    teacher_logp = F.log_softmax(teacher / temperature, dim=-1)  # [n, V]
    # KL(p_T || p_S) = Σ_v p_T (log p_T - log p_S), per position.
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)  # [n]
    return kl.sum() / _denominator(valid, num_items_in_batch)


def compute_ce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy, Eq. (3.13), with the same masking and reduction as [`compute_kd_loss`]."""
    logits, targets, valid = _shift(logits.float(), labels, ignore_index)
    nll = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return nll / _denominator(valid, num_items_in_batch)


def compute_healing_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 4.0,
    beta: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> HealingLossOutput:
    """`L = L_CE + β τ² L_KD`, Eq. (3.15).

    Args:
        student_logits (`torch.Tensor` of shape `[B, S, V]`): the model being healed.
        teacher_logits (`torch.Tensor` of shape `[B, S, V]`, *optional*): the frozen original model's logits; with
            `None` (or `beta == 0`) the loss is plain cross-entropy and `kd` is 0.
        labels (`torch.Tensor` of shape `[B, S]`): see [`compute_kd_loss`].
        temperature (`float`, *optional*, defaults to 4.0): τ.
        beta (`float`, *optional*, defaults to 0.5): β, the weight of the distillation term.
        ignore_index (`int`, *optional*, defaults to -100): masked label value.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): see [`compute_kd_loss`].

    Returns:
        [`HealingLossOutput`] with `loss`, `ce` and `kd` (the unscaled KL).

    Example:
        ```python
        >>> out = compute_healing_loss(student(input_ids).logits, teacher(input_ids).logits, labels=input_ids)
        >>> out.loss.backward()
        ```
    """
    if beta < 0:
        raise ValueError(f"beta must be ≥ 0, got {beta}")
    ce = compute_ce_loss(student_logits, labels, ignore_index, num_items_in_batch)
    if teacher_logits is None or beta == 0:
        kd = torch.zeros((), device=ce.device)
        return HealingLossOutput(loss=ce, ce=ce, kd=kd)
    kd = compute_kd_loss(student_logits, teacher_logits, labels, temperature, ignore_index, num_items_in_batch)
    return HealingLossOutput(loss=ce + beta * temperature**2 * kd, ce=ce, kd=kd)
