"""Errors name the caller's arguments (issue 25, item 6). The device checks of the losses still
say ``x``, a name neither function has; the ops engineer fixes the messages after the ops
restructure lands (``cross_entropy.check_target`` and ``linear_cross_entropy``'s weight / bias
checks must pass ``like_name``)."""
import pytest
import torch

import llmkernels as lk

PENDING = pytest.mark.xfail(strict=True, reason="ops restructure pending")



@PENDING
def test_cross_entropy_target_on_another_device():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="target is on meta but logits is on cpu"):
        lk.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"))


@PENDING
@pytest.mark.parametrize("argument", ["weight", "bias", "target"])
def test_linear_cross_entropy_arguments_on_another_device(argument):
    inputs = {"hidden": torch.randn(4, 8), "weight": torch.randn(10, 8), "target": torch.zeros(4, dtype=torch.long),
              "bias": torch.randn(10)}
    inputs[argument] = inputs[argument].to("meta")
    with pytest.raises(ValueError, match=f"{argument} is on meta but hidden is on cpu"):
        lk.linear_cross_entropy(**inputs)
