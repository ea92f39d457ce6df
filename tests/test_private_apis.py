"""The private PyTorch and Triton APIs that ARCHITECTURE.md lists: each test fails on a torch or
Triton where the API broke or where its guard sent the call to the public path (the others are
named in that table: test_launch, test_bench)."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from llmkernels.hf import mlp
from llmkernels.ops import _launch

gpu = pytest.mark.skipif(not torch.cuda.is_available() or _launch.INTERPRET, reason="needs a GPU")


def _add_one_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)
    return add_one


@gpu
def test_direct_launch_on_this_triton():
    """After Triton's first launch of a key, the Launcher calls the compiled kernel's own
    launcher with Triton's internal arguments; a Triton whose launcher refuses them turns the
    direct launch off for good (``_launch.direct``)."""
    x = torch.zeros(20, device="cuda")
    handle = _launch.launcher_of(_add_one_kernel(), BLOCK=32, num_warps=1)
    for _ in range(3):
        handle((1,), x, 20)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))
    assert _launch.direct and _launch._PUBLIC not in handle._compiled.values()


@gpu
def test_raw_stream_is_the_current_stream():
    assert _launch._current_stream is getattr(torch._C, "_cuda_getCurrentRawStream", None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _launch._current_stream(torch.cuda.current_device()) == side.cuda_stream


LOOP_BOUND = """
import torch, triton, triton.language as tl

@triton.jit
def fill(X, n, STEP: tl.constexpr):
    for i in range(tl.program_id(0), n, STEP):  # a loop bound that is a tensor
        tl.store(X + i, i)

import llmkernels.ops._launch  # (its compatibility patch, where this Triton needs it)
x = torch.zeros(7, dtype=torch.int32)
fill[(2,)](x, 7, STEP=2)
assert x.tolist() == list(range(7)), x
print("ok")
"""


def test_interpreter_runs_a_tensor_loop_bound():
    """Triton < 3.7's interpreter with NumPy >= 2.5 needs ``ops._interpreter_shims.loop_bounds_compat``."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", LOOP_BOUND], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_global_module_hooks_keep_the_down_projection():
    """A hook on every module must run: a down projection with one set is not a plain linear,
    so ``glu_linear`` does not replace it."""
    from torch.nn.modules import module as module_globals

    assert all(hasattr(module_globals, name) for name in mlp._GLOBAL_HOOKS)
    down, x = nn.Linear(4, 3), torch.randn(2, 4)
    assert mlp._plain_linear(down, x)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not mlp._plain_linear(down, x)
    finally:
        handle.remove()
    assert mlp._plain_linear(down, x)
