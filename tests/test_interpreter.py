"""What the kernels can rely on under Triton's interpreter as on the GPU (``llmkernels.ops._interpreter_shims``,
installed by ``_launch``): fp32 -> bf16 rounds to nearest even (the interpreter alone truncates),
and a load or store outside the launch's tensors fails (the interpreter alone reads any address)."""
import pytest
import torch

from llmkernels.ops._launch import use_kernels
from llmkernels.ops._triton import tl, triton
from tests.conftest import DEVICE, INTERPRETED


@triton.jit
def _to_bf16_kernel(X, Y, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(Y + cols, tl.load(X + cols).to(tl.bfloat16))


@triton.jit
def _copy_kernel(X, Y, N, READ_PAST: tl.constexpr, WRITE_PAST: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(Y + cols, tl.load(X + cols, mask=cols < N + READ_PAST, other=0.0), mask=cols < N + WRITE_PAST)


def test_kernel_bf16_conversion_is_torchs():
    """Ties (1 + 2^-8 to 1, 1 + 3 * 2^-8 up to the even 1 + 2^-6), the largest finite fp32 (to
    inf), infinities, NaN and values from 1e-30 to 1e30 of both signs: bit for bit torch's."""
    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    x[:6] = torch.tensor([1.00390625, 1.01171875, torch.finfo(torch.float32).max, float("inf"), -float("inf"),
                          float("nan")])
    x = x.to(DEVICE)
    assert use_kernels(x)
    y = torch.full(x.shape, 7.0, dtype=torch.bfloat16, device=DEVICE)  # poisoned
    _to_bf16_kernel[(1,)](x, y, N=x.numel())
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert same.all(), (x[~same][:4], y[~same][:4], want[~same][:4])
    assert y[0] == 1.0 and y[1] == 1.015625 and y[2] == float("inf")


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU an access past the tensors may fault the process")
def test_access_outside_the_launch_tensors_fails():
    """Masked-off lanes may point anywhere and a view may read its storage beyond its own
    elements; one element past the storage, read or written, fails and says what it was."""
    x, y = torch.randn(10), torch.full((10,), 7.0)
    _copy_kernel[(1,)](x, y, 10, READ_PAST=0, WRITE_PAST=0, BLOCK=16)
    assert torch.equal(x, y)
    base = torch.randn(20)
    _copy_kernel[(1,)](base[5:15], y, 10, READ_PAST=5, WRITE_PAST=0, BLOCK=16)
    assert torch.equal(y, base[5:15])
    for read, write, what in ((1, 0, "a load of 1 element"), (0, 2, "a store of 2 element")):
        with pytest.raises(Exception, match=what):
            _copy_kernel[(1,)](x, torch.empty(10), 10, READ_PAST=read, WRITE_PAST=write, BLOCK=16)
