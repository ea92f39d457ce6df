"""The ops' infrastructure on CPU: the cached launch's key (what Triton specialises a compiled
kernel on) with a fake kernel standing for Triton's, and ``import llmkernels`` without Triton."""
import os
import subprocess
import sys
import types
from typing import NamedTuple

import pytest
import torch

from llmkernels.ops import _launch, _register


class FakeCompiled:
    """What ``kernel[grid](...)`` returns: a compiled kernel with its own launcher."""

    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "function", "packed"

    def run(self, *args):
        self.calls.append(("direct", args))

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


class FakeKernel:
    """A JIT function's surface that the Launcher uses: ``kernel[grid](*args, **options)``,
    ``arg_names`` and ``fn`` (for the defaults of constexprs not passed)."""

    def __init__(self):
        self.calls = []

        def fn(X, n, scale, BLOCK, EVEN=True):
            pass

        self.fn, self.arg_names = fn, ["X", "n", "scale", "BLOCK", "EVEN"]

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("triton", grid, args, options))
            return FakeCompiled(self.calls)
        return launch


@pytest.fixture
def gpu_launch(monkeypatch):
    """The launch as on a GPU (no interpreter), device 0, direct launches on."""
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "direct", True)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 7)
    monkeypatch.setattr(_launch, "knobs", types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)))
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    kernel = FakeKernel()
    return kernel, _launch.Launcher(kernel, {"num_warps": 4, "BLOCK": 64})


def kinds(kernel):
    """How each call went: through Triton ("triton", which compiles or finds and launches) or
    straight to the cached compiled kernel ("direct")."""
    return [call[0] for call in kernel.calls]


def test_cached_launch_reuses_the_compiled_kernel_with_its_constexprs(gpu_launch):
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    launcher((3,), x, 100, 0.5)
    launcher((5, 2), x, 100, 0.5)
    assert kinds(kernel) == ["triton", "direct"]
    assert kernel.calls[0][1:] == ((3,), (x, 100, 0.5), {"num_warps": 4, "BLOCK": 64})
    # grid padded to 3-D, the stream, the handles, no hooks; then the runtime arguments and
    # every constexpr (BLOCK given, EVEN its default) in the kernel's order
    assert kernel.calls[1][1] == (5, 2, 1, 7, "function", "packed", None, None, None, x, 100, 0.5, 64, True)


def test_cached_launch_follows_tensor_alignment_and_dtype(gpu_launch):
    kernel, launcher = gpu_launch
    base = torch.zeros(80, dtype=torch.bfloat16)
    aligned, odd = base[:64], base[1:65]  # 2 bytes past a 16-byte boundary
    assert aligned.data_ptr() % 16 == 0 and odd.data_ptr() % 16 != 0
    for x in (aligned, odd, aligned, odd, base[8:72], aligned.float()):
        launcher((1,), x, 64, 1.0)
    # the 16-byte offset base[8:] is aligned like base; a float32 tensor is another kernel
    assert kinds(kernel) == ["triton", "triton", "direct", "direct", "direct", "triton"]


@pytest.mark.parametrize("values,expected", [
    ((3, 5, 7), ["triton", "direct", "direct"]),  # one class: not 1, not a multiple of 16, 32-bit
    ((1, 2, 1), ["triton", "triton", "direct"]),  # 1 is a constant of its own
    ((16, 48, 17), ["triton", "direct", "triton"]),  # multiples of 16
    ((2**31 - 1, 2**31 + 1, -2**31 + 1, -2**31 - 1), ["triton", "triton", "direct", "direct"]),  # 32 / 64 bits
    ((2**63 - 1, 2**63 + 1), ["triton", "triton"]),  # signed / unsigned 64 bits
    ((2, 2.0, 2, True), ["triton", "triton", "direct", "triton"]),  # int, float, bool never share a kernel
])
def test_cached_launch_follows_int_specialisation(gpu_launch, values, expected):
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    for n in values:
        launcher((1,), x, n, 1.0)
    assert kinds(kernel) == expected


def test_cached_launch_keys_a_float_argument_by_its_class(gpu_launch):
    """Floats are not specialised (any value shares a kernel); an int or a bool where a float was
    seen is specialised as such."""
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    for scale in (1.0, 2.5, 1, 16, 3, True, 0.0):
        launcher((1,), x, 64, scale)
    assert kinds(kernel) == ["triton", "direct", "triton", "triton", "triton", "triton", "direct"]


def test_cached_launch_keys_the_device_and_other_argument_kinds(gpu_launch, monkeypatch):
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    launcher((1,), x, 64, 1.0)
    monkeypatch.setattr(_launch, "_current_device", lambda: 1)
    launcher((1,), x, 64, 1.0)  # another device: compiled again
    launcher((1,), None, 64, 1.0)  # an argument of another kind than first seen: Triton decides
    launcher((1,), None, 64, 1.0)
    launcher((1,), x, 64, 1.0)
    assert kinds(kernel) == ["triton", "triton", "triton", "direct", "direct"]


def test_cached_launch_takes_none_for_a_tensor_first(gpu_launch):
    """None where a kernel takes a pointer (Triton specialises it as a constant) on the first call
    too: its key must not treat it as a number (``None % 16``)."""
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    for args in ((None, 64, 1.0), (None, 64, 2.0), (x, 64, 1.0), (None, 64, 1.0), (x, 64, 1.0)):
        launcher((1,), *args)
    assert kinds(kernel) == ["triton", "direct", "triton", "direct", "direct"]


def test_cached_launch_sends_tensor_descriptors_through_triton(gpu_launch):
    """A call with a host-side tensor descriptor goes through Triton each time (Triton keys and
    encodes descriptors itself), first seen or after a tensor in its place; the descriptor as
    given."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel, launcher = gpu_launch
    x = torch.zeros(4, 64)
    desc = TensorDescriptor(x, [4, 64], [64, 1], [1, 64])
    for arg in (desc, desc, x, x, desc):
        launcher((1,), arg, 64, 1.0)
    assert kinds(kernel) == ["triton", "triton", "triton", "direct", "triton"]
    assert kernel.calls[1][2][0] is desc and kernel.calls[4][2][0] is desc


def test_cached_launch_falls_back_to_triton(gpu_launch, monkeypatch):
    kernel, launcher = gpu_launch

    def other_signature(self, *args):
        raise TypeError("function takes exactly 12 arguments")

    monkeypatch.setattr(FakeCompiled, "run", other_signature)
    x = torch.zeros(64)
    launcher((1,), x, 64, 1.0)
    launcher((1,), x, 64, 1.0)  # the launcher refuses its arguments: launched through Triton instead
    assert not _launch.direct
    launcher((1,), x, 64, 1.0)
    assert kinds(kernel) == ["triton", "triton", "triton"]


def test_hooked_launches_go_through_triton(gpu_launch, monkeypatch):
    """A profiler's launch hook is set: Triton launches, calling it with the launch's metadata."""
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    launcher((1,), x, 64, 1.0)
    monkeypatch.setattr(_launch.knobs.runtime, "launch_enter_hook", types.SimpleNamespace(calls=[]))  # empty chain
    launcher((1,), x, 64, 1.0)
    monkeypatch.setattr(_launch.knobs.runtime, "launch_exit_hook", types.SimpleNamespace(calls=[print]))
    launcher((1,), x, 64, 1.0)
    assert kinds(kernel) == ["triton", "direct", "triton"]


def test_interpreted_launch_is_the_plain_triton_call(gpu_launch, monkeypatch):
    kernel, launcher = gpu_launch
    monkeypatch.setattr(_launch, "INTERPRET", True)
    x = torch.zeros(64)
    launcher((1,), x, 64, 1.0)
    launcher((1,), x, 64, 1.0)
    assert kinds(kernel) == ["triton", "triton"]


def test_launcher_is_made_once_per_options():
    kernel = FakeKernel()
    assert _launch.launcher_of(kernel, num_warps=4, BLOCK=64) is _launch.launcher_of(kernel, num_warps=4, BLOCK=64)
    assert _launch.launcher_of(kernel, num_warps=8, BLOCK=64) is not _launch.launcher_of(kernel, num_warps=4, BLOCK=64)


def test_launches_are_looked_up_by_value_first(gpu_launch, monkeypatch):
    """Arguments seen before skip the fingerprint; the look-ups by value are bounded, and
    arguments of other kinds (None for a tensor) are never kept by value."""
    kernel, launcher = gpu_launch
    x = torch.zeros(64)
    launcher((1,), x, 100, 0.5)
    fingerprint = launcher._fingerprint
    monkeypatch.setattr(launcher, "_fingerprint", lambda *args: pytest.fail("fingerprint of values seen before"))
    launcher((2,), x, 100, 0.5)
    monkeypatch.setattr(launcher, "_fingerprint", fingerprint)
    monkeypatch.setattr(_launch, "VALUES_KEPT", 3)
    for n in (3, 5, 7, 9):  # one class: direct, each kept by value until the bound drops them all (at 7)
        launcher((1,), x, n, 0.5)
    assert sorted(key[4] for key in launcher._by_values) == [7, 9]
    launcher((1,), None, 100, 0.5)
    launcher((1,), None, 100, 0.5)
    assert all(key[1] is not None.__class__ for key in launcher._by_values)
    assert kinds(kernel) == ["triton", "direct", "direct", "direct", "direct", "direct", "triton", "direct"]


def test_plans_are_made_once_per_key_and_bounded():
    made = []
    plans = _launch.PlanCache(lambda *key: made.append(key) or len(made), limit=2)
    assert plans[1, "a"] == 1 and plans[1, "a"] == 1 and plans[7] == 2  # (a key that is not a tuple: make(key))
    assert made == [(1, "a"), (7,)]
    assert plans[2, "b"] == 3 and len(plans) == 1  # full: the earlier plans were dropped


class _Scale:
    """An eager-only Op (no custom op): y = factor x, its backward factor dy (factor 2)."""

    class Options(NamedTuple):
        factor: float

    @staticmethod
    def op(once_differentiable=False):
        return _register.Op(
            "test_scale", forward=lambda x, bias, options: options.factor * x + (0 if bias is None else bias),
            setup=lambda ctx, tensors, options, output: None, backward=lambda ctx, bwd, dy: (2 * dy,),
            grad_inputs=(0,), base=lambda x, bias, options: options.factor * x,
            once_differentiable=once_differentiable)


def test_autograd_goes_straight_to_the_cpp_apply(monkeypatch):
    """Outside functorch transforms the Op calls autograd's C++ apply (a builtin), skipping the
    Python ``Function.apply``; inside one, or where torch has no such entry points, it takes
    ``Function.apply``. The gradients are the same either way."""
    op = _Scale.op()
    assert isinstance(op._c_apply, types.BuiltinMethodType)
    public = []
    monkeypatch.setattr(op.function, "apply", lambda *args: public.append(1) or op._c_apply(*args))
    x = torch.randn(5, requires_grad=True)
    for active in (False, True):
        monkeypatch.setattr(_register, "_functorch_active", lambda: active)
        y = op(x, None, _Scale.Options(2.0))
        assert y.grad_fn.name() == "TestScaleBackward"
        (dx,) = torch.autograd.grad(y, x, torch.ones(5))
        assert torch.equal(dx, torch.full((5,), 2.0))
    assert public == [1]
    monkeypatch.setattr(_register, "_functorch_active", None)
    assert _register._c_apply(op.function) is None


def test_once_differentiable_backward_refuses_a_second_differentiation():
    """The backward of a once-differentiable Op skips torch's no_grad wrapper unless a graph of
    the backward is recorded; then its outputs refuse a second differentiation, as before."""
    op = _Scale.op(once_differentiable=True)
    x = torch.randn(4, requires_grad=True)
    (dx,) = torch.autograd.grad(op(x, None, _Scale.Options(2.0)).sum(), x)
    assert torch.equal(dx, torch.full((4,), 2.0)) and dx.grad_fn is None
    g = torch.ones(4, requires_grad=True)
    (dx,) = torch.autograd.grad(op(x, None, _Scale.Options(2.0)), x, g, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


WITHOUT_TRITON = """
import importlib.abc, sys, warnings

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r}")

sys.meta_path.insert(0, NoTriton())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import llmkernels as lk
    from llmkernels import reference
    from llmkernels.ops import _launch, _register
ours = [w for w in caught if "llmkernels" in str(w.message)]
assert len(ours) == 1 and ours[0].category is UserWarning, [str(w.message) for w in caught]
assert "Triton is not installed" in str(ours[0].message) and "plain PyTorch" in str(ours[0].message)
torch.manual_seed(0)
x, w = torch.randn(3, 50, dtype=torch.bfloat16), torch.randn(50)
assert not _launch.use_kernels(x)
assert torch.equal(lk.rms_norm(x, w), reference.rms_norm(x, w))
assert torch.equal(lk.layer_norm(x, w), reference.layer_norm(x, w))
logits, target = torch.randn(4, 30), torch.tensor([1, -100, 29, 0])
assert torch.equal(lk.cross_entropy(logits, target), reference.cross_entropy(logits, target)[0])
q, k, cos, sin = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
for got, want in zip(lk.apply_rope(q, k, cos, sin), reference.apply_rope(q, k, cos, sin)):
    assert torch.equal(got, want)
gate, up = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16)
y = lk.glu(gate, up)
assert torch.equal(y, reference.glu(gate, up))
y.sum().backward()
assert gate.grad is not None
print("ok")
"""


def test_import_without_triton_falls_back_to_pytorch():
    """Without Triton (blocked from import; the interpreter asked for, to show that it is the
    missing Triton that decides) llmkernels imports with one UserWarning and every op gives
    the reference's result."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
