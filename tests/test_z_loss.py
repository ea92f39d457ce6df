"""linear_z_loss against the float64 reference (random upstream gradient, transposed hidden, several chunks)."""
import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.testing import poisoned
from tests.conftest import DEVICE
from tests.helpers import assert_close, bad_input_test


@pytest.mark.parametrize("reduction,bias,dtype", [("mean", 1, torch.float32), ("sum", 0, torch.float32),
                                                  ("none", 1, torch.bfloat16)])
def test_matches_reference(reduction, bias, dtype):
    head = [torch.randn(40, 7).t(), torch.randn(300, 40) / 3, torch.randn(300)]  # hidden [7, 40] transposed
    head = [t.to(DEVICE, dtype).requires_grad_() for t in head[:2 + bias]]
    with poisoned():
        loss = lk.linear_z_loss(*head, reduction=reduction, chunk_size=3, vocab_chunk_size=128)
        g = torch.rand_like(loss) + 0.5
        grads = torch.autograd.grad(loss, head, g)
    exact = [t.detach().double().requires_grad_() for t in head]
    ref = reference.linear_z_loss(*exact, reduction=reduction, compute_dtype=torch.float64)
    for name, got, want in zip(("loss", "hidden", "weight", "bias"), (loss, *grads),
                               (ref, *torch.autograd.grad(ref, exact, g.double()))):
        assert_close(got, want, dtype, name)


H, W = torch.randn(4, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
test_bad_input = bad_input_test(lambda: [("weight", ValueError, lambda: lk.linear_z_loss(H, W[:, :5])),
                                         ("reduction", ValueError, lambda: lk.linear_z_loss(H, W, reduction="x"))])
