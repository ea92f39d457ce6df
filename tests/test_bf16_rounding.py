"""fp32 -> bf16 in a kernel rounds to nearest even on every path: the GPU's conversion, and under
Triton's interpreter the shim of ``llmkernels.ops._launch`` (the interpreter alone truncates)."""
import torch

from llmkernels.ops._launch import use_kernels
from llmkernels.ops._triton import tl, triton
from tests.conftest import DEVICE


@triton.jit
def _to_bf16_kernel(X, Y, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(Y + cols, tl.load(X + cols).to(tl.bfloat16))


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
