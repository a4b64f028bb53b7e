import math

import pytest
import torch

from hf_accel.training.losses import compute_ce_loss, compute_healing_loss, compute_kd_loss


# One row, 3 positions, vocabulary of 2. Position t predicts labels[t + 1]; labels[2] = -100 masks position 1,
# and position 2 predicts nothing (last), so only position 0 is scored.
STUDENT = torch.tensor([[[0.0, 2.0], [1.0, 1.0], [3.0, 0.0]]])
TEACHER = torch.tensor([[[2.0, 0.0], [0.0, 5.0], [0.0, 0.0]]])
LABELS = torch.tensor([[0, 1, -100]])


def _softmax2(a, b):
    return math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))


def test_kd_loss_matches_hand_computation():
    tau = 2.0
    # Position 0: teacher logits (2, 0) / τ = (1, 0); student (0, 2) / τ = (0, 1).
    p = _softmax2(1.0, 0.0)
    q = _softmax2(0.0, 1.0)
    expected = p[0] * math.log(p[0] / q[0]) + p[1] * math.log(p[1] / q[1])
    got = compute_kd_loss(STUDENT, TEACHER, LABELS, temperature=tau)
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_kd_loss_averages_over_valid_positions_and_is_zero_for_identical_models():
    labels = torch.tensor([[0, 1, 1]])  # positions 0 and 1 both scored
    tau = 1.0
    p0, q0 = _softmax2(2.0, 0.0), _softmax2(0.0, 2.0)
    p1, q1 = _softmax2(0.0, 5.0), _softmax2(1.0, 1.0)
    kl0 = sum(a * math.log(a / b) for a, b in zip(p0, q0))
    kl1 = sum(a * math.log(a / b) for a, b in zip(p1, q1))
    got = compute_kd_loss(STUDENT, TEACHER, labels, temperature=tau)
    assert got.item() == pytest.approx((kl0 + kl1) / 2, rel=1e-6)
    assert compute_kd_loss(STUDENT, STUDENT, labels).item() == pytest.approx(0.0, abs=1e-7)
    # num_items_in_batch (gradient accumulation) replaces the local count of 2.
    got = compute_kd_loss(STUDENT, TEACHER, labels, temperature=tau, num_items_in_batch=8)
    assert got.item() == pytest.approx((kl0 + kl1) / 8, rel=1e-6)


def test_ce_loss_matches_hand_computation():
    # Position 0 predicts label 1 from student logits (0, 2).
    expected = -math.log(_softmax2(0.0, 2.0)[1])
    assert compute_ce_loss(STUDENT, LABELS).item() == pytest.approx(expected, rel=1e-6)


def test_healing_loss_is_ce_plus_beta_tau_squared_kd():
    tau, beta = 4.0, 0.5
    out = compute_healing_loss(STUDENT, TEACHER, LABELS, temperature=tau, beta=beta)
    ce = -math.log(_softmax2(0.0, 2.0)[1])
    p, q = _softmax2(0.5, 0.0), _softmax2(0.0, 0.5)
    kd = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert out.ce.item() == pytest.approx(ce, rel=1e-6)
    assert out.kd.item() == pytest.approx(kd, rel=1e-6)
    assert out.loss.item() == pytest.approx(ce + beta * tau**2 * kd, rel=1e-6)
    assert compute_healing_loss(STUDENT, None, LABELS).loss.item() == pytest.approx(ce, rel=1e-6)


def test_fully_masked_batch_gives_zero_not_nan():
    labels = torch.full((1, 3), -100)
    out = compute_healing_loss(STUDENT, TEACHER, labels)
    assert out.loss.item() == 0.0


def test_vocabulary_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="share the tokenizer"):
        compute_kd_loss(STUDENT, torch.zeros(1, 3, 3), LABELS)


def test_gradient_flows_to_student_only():
    student = STUDENT.clone().requires_grad_()
    teacher = TEACHER.clone().requires_grad_()
    compute_healing_loss(student, teacher.detach(), LABELS).loss.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()
    assert student.grad[0, 1:].abs().sum() == 0  # masked and last positions get no gradient
    assert teacher.grad is None


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_a_temperature_that_is_not_positive_is_refused(temperature):
    # τ = 0 divides the logits by zero: a NaN loss, not an error, without the check
    with pytest.raises(ValueError, match="temperature must be positive"):
        compute_kd_loss(STUDENT, TEACHER, LABELS, temperature=temperature)


def test_beta_zero_is_plain_cross_entropy_with_a_zero_kd_part():
    # the documented contract: with beta == 0 the teacher is not consulted and `kd` is 0 (not the unscaled KL)
    out = compute_healing_loss(STUDENT, TEACHER, LABELS, beta=0.0)
    ce = -math.log(_softmax2(0.0, 2.0)[1])
    assert out.loss.item() == pytest.approx(ce, rel=1e-6)
    assert out.kd.item() == 0.0
