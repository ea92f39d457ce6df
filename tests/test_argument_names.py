"""Errors name the caller's arguments: the device checks of the losses name
the argument the other tensors must share a device with (``logits``, ``hidden``), never ``x``."""
import pytest
import torch

import llmkernels as lk


def test_cross_entropy_target_on_another_device():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="target is on meta but logits is on cpu"):
        lk.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("loss", ["linear_cross_entropy", "linear_log_probs"])
@pytest.mark.parametrize("argument", ["weight", "bias", "target"])
def test_lm_head_arguments_on_another_device(argument, loss):
    inputs = {"hidden": torch.randn(4, 8), "weight": torch.randn(10, 8), "target": torch.zeros(4, dtype=torch.long),
              "bias": torch.randn(10)}
    inputs[argument] = inputs[argument].to("meta")
    with pytest.raises(ValueError, match=f"{argument} is on meta but hidden is on cpu"):
        getattr(lk, loss)(**inputs)


@pytest.mark.parametrize("argument,other", [("student_weight", "student_hidden"), ("teacher_hidden", "student_hidden"),
                                            ("teacher_weight", "teacher_hidden"), ("target", "student_hidden")])
def test_linear_distill_loss_arguments_on_another_device(argument, other):
    inputs = {"student_hidden": torch.randn(4, 8), "student_weight": torch.randn(10, 8),
              "teacher_hidden": torch.randn(4, 6), "teacher_weight": torch.randn(10, 6),
              "target": torch.zeros(4, dtype=torch.long)}
    inputs[argument] = inputs[argument].to("meta")
    with pytest.raises(ValueError, match=f"{argument} is on meta but {other} is on cpu"):
        lk.linear_distill_loss(**inputs)
