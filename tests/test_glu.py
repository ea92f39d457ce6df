"""Gated-MLP activation (SwiGLU, GeGLU): output and gate/up gradients against the float64
reference for each activation and dtype, halves of a fused gate_up projection, leading shapes
and widths over one column tile, Hugging Face's rounding, what autograd saves, torch.compile,
bad input."""
import pytest
import torch
import torch.nn.functional as F

import llmkernels
from llmkernels import reference
from llmkernels.ops import glu as glu_ops
from llmkernels.ops.configs import glu as glu_configs

from tests.conftest import DEVICE, INTERPRETED
from llmkernels.testing import poisoned
from tests.helpers import assert_close, bad_input_test, exception_chain

F64 = torch.float64
ACTIVATIONS = tuple(reference.GLU_ACTIVATIONS)  # the one list: a new activation is tested here as it is added
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elementwise bound |out - ref| <= atol + rtol |ref|: two roundings (act(gate), then the
# product) fit in rtol.
ELEMENTWISE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-5), torch.float16: (4e-3, 1e-5)}


def assert_matches(out, ref, dtype, name):
    """Relative-norm check (tests/helpers.py) and the elementwise bound."""
    assert out.dtype == dtype, f"{name}: dtype {out.dtype} != {dtype}"
    assert_close(out, ref, dtype, name)
    rtol, atol = ELEMENTWISE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def check(activation, *leaves, split=lambda *t: t):
    """glu of ``split(*leaves)`` (gate, up) against the float64 reference of the same: the
    output, and every leaf's gradient for a random upstream gradient. Outputs poisoned."""
    gate, up = split(*leaves)
    with poisoned():
        y = llmkernels.glu(gate, up, activation)
    assert y.shape == gate.shape and y.is_contiguous()
    leaves64 = [t.detach().to(F64).requires_grad_() for t in leaves]
    ref = reference.glu(*split(*leaves64), activation, compute_dtype=F64)
    assert_matches(y, ref, gate.dtype, "y")
    dy = torch.randn_like(y)
    with poisoned():
        got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(ref, leaves64, dy.to(F64))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_matches(g, w, gate.dtype, f"gradient of leaf {i}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(activation, dtype):
    gate = (torch.randn(2, 5, 48, device=DEVICE) * 3).to(dtype).requires_grad_()
    up = torch.randn(2, 5, 48, device=DEVICE).to(dtype).requires_grad_()
    check(activation, gate, up)


def test_an_activation_without_its_kernel_branch_does_not_compile():
    """A name that the kernel has no branch for is a compile-time error, never another's branch."""
    gate = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(Exception) as caught:
        glu_ops.glu_fwd(gate, gate, glu_ops.GluOptions("not_an_activation"))
    assert "without its branch" in exception_chain(caught.value)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_halves_of_a_fused_gate_up_projection(activation, dtype):
    """gate, up = gate_up.chunk(2, -1) (Phi-3, MoE experts): views with row stride 2 I, read in
    place; the gradient reaches the fused tensor."""
    gate_up = torch.randn(3, 4, 2 * 40, device=DEVICE).to(dtype).requires_grad_()
    gate, _ = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous() and gate.stride(-2) == 80
    check(activation, gate_up, split=lambda t: t.chunk(2, dim=-1))


@pytest.mark.parametrize("shape", [(7,), (1, 1), (9, 1), (3, 2049), (2, 3, 4, 24)])
def test_leading_shapes_and_widths(shape):
    """No leading dims, one element, a single column, a row wider than a column tile (2049 >
    GluTiles.max_block_n: several column tiles and a masked tail), 4-D."""
    assert glu_configs.DEFAULT_TILES.max_block_n < 2049
    gate = torch.randn(shape, device=DEVICE, requires_grad=True)
    up = torch.randn(shape, device=DEVICE, requires_grad=True)
    check("silu", gate, up)


def test_launchers_take_a_config():
    """The forward and backward launchers run any tiling given as ``config=`` (here narrower
    than a row, several rows a tile), against the float64 reference."""
    gate, up, dy = (torch.randn(5, 100, device=DEVICE) for _ in range(3))
    config = glu_configs.GluConfig(block_m=2, block_n=32, num_warps=2)
    g64, u64 = gate.to(F64).requires_grad_(), up.to(F64).requires_grad_()
    y64 = reference.glu(g64, u64, "silu", compute_dtype=F64)
    d_gate64, d_up64 = torch.autograd.grad(y64, (g64, u64), dy.to(F64))
    assert_close(glu_ops.glu_fwd(gate, up, glu_ops.GluOptions("silu"), config=config), y64, torch.float32, "y")
    d_gate, d_up = glu_ops.glu_bwd(dy, gate, up, glu_ops.GluOptions("silu"), config=config)
    assert_close(d_gate, d_gate64, torch.float32, "d_gate")
    assert_close(d_up, d_up64, torch.float32, "d_up")


def test_transposed_and_broadcast_inputs():
    """A transposed gate (last stride not 1) is copied first; an expanded dy (``y.sum()``'s
    gradient, all strides 0) works too."""
    gate = torch.randn(24, 6, device=DEVICE).t().requires_grad_()
    up = torch.randn(6, 24, device=DEVICE, requires_grad=True)
    check("gelu_tanh", gate, up)
    y = llmkernels.glu(gate, up)
    d_gate, d_up = torch.autograd.grad(y.sum(), (gate, up))
    g64, u64 = gate.detach().to(F64).requires_grad_(), up.detach().to(F64).requires_grad_()
    want = torch.autograd.grad(reference.glu(g64, u64, compute_dtype=F64).sum(), (g64, u64))
    assert_matches(d_gate, want[0], torch.float32, "d_gate")
    assert_matches(d_up, want[1], torch.float32, "d_up")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounds_like_hugging_face(dtype):
    """act(gate) is rounded to the input dtype before the product, as HF's eager MLP computes
    ``act_fn(gate) * up``: on the GPU at least 99% of the elements are bit-equal (the rest
    differ in the fp32 transcendental)."""
    gate = torch.randn(64, 256, device=DEVICE).to(dtype)
    up = torch.randn(64, 256, device=DEVICE).to(dtype)
    for activation, hf in (("silu", F.silu(gate) * up), ("gelu_tanh", F.gelu(gate, approximate="tanh") * up)):
        y = llmkernels.glu(gate, up, activation)
        assert_close(y, hf, dtype, f"{activation} vs HF")
        assert (y == hf).float().mean() > 0.99


def test_saves_only_gate_and_up():
    """The backward recomputes act(gate): autograd holds gate and up, not a third tensor."""
    gate = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    up = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        llmkernels.glu(gate * 1.0, up * 1.0)  # non-leaf inputs, as gate_proj(x) and up_proj(x) are
    assert len(saved) == 2 and all(t.shape == gate.shape for t in saved)


def test_gradient_for_one_input_and_inference():
    """Only up needs a gradient (frozen gate projection), and no_grad: same output."""
    gate = torch.randn(5, 16, device=DEVICE)
    up = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    y = llmkernels.glu(gate, up)
    (d_up,) = torch.autograd.grad(y, up, torch.ones_like(y))
    assert_matches(d_up, reference.glu_activation(gate.to(F64), "silu"), torch.float32, "d_up")
    with torch.no_grad():
        assert torch.equal(llmkernels.glu(gate, up), y)


def test_float64_and_empty():
    """float64 runs the reference; empty tensors keep their shape."""
    gate, up = torch.randn(3, 8, device=DEVICE, dtype=F64), torch.randn(3, 8, device=DEVICE, dtype=F64)
    assert torch.equal(llmkernels.glu(gate, up, "gelu"), reference.glu(gate, up, "gelu", compute_dtype=F64))
    for shape in [(0, 8), (4, 0)]:
        empty = torch.randn(shape, device=DEVICE, requires_grad=True)
        y = llmkernels.glu(empty, empty)
        assert y.shape == shape
        y.sum().backward()


def test_torch_compile_fullgraph():
    """The custom ops trace with fullgraph=True: forward and both gradients equal eager."""
    backend = "aot_eager" if INTERPRETED else "inductor"

    def fn(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return llmkernels.glu(gate, up, "gelu_tanh")

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    gate_up = torch.randn(2, 5, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y, want = compiled(gate_up), fn(gate_up)
    assert torch.equal(y, want)
    dy = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, gate_up, dy)[0], torch.autograd.grad(want, gate_up, dy)[0])


def _glu_linear_leaves(dtype, bias: bool, i=48, o=24):
    g = torch.Generator().manual_seed(7)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype).requires_grad_()  # noqa: E731
    gate_up = make(2, 5, 2 * i, scale=2.0)  # the halves of a fused projection: strided rows
    weight = make(o, i, scale=i ** -0.5)
    return gate_up, weight, (make(o) if bias else None)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_glu_linear_against_float64(activation, dtype, bias, separate):
    """glu_linear = F.linear(glu(gate, up), weight, bias): output and the gradients of the fused
    gate_up, the weight and the bias against float64, for a random upstream gradient. ``separate``:
    gate and up as two contiguous [2, 5, I] tensors (separate projections), not strided halves."""
    gate_up, weight, b = _glu_linear_leaves(dtype, bias)
    leaves = [t for t in (gate_up, weight, b) if t is not None]
    halves = [h.contiguous() if separate else h for h in gate_up.chunk(2, dim=-1)]
    with poisoned():
        out = llmkernels.glu_linear(*halves, weight, b, activation)
    assert out.shape == (2, 5, weight.shape[0]) and out.dtype == dtype
    leaves64 = [t.detach().to(F64).requires_grad_() for t in leaves]
    gu64, w64, b64 = leaves64 + [None] * (3 - len(leaves64))
    ref = F.linear(reference.glu(*gu64.chunk(2, dim=-1), activation, compute_dtype=F64), w64, b64)
    # The product is rounded to dtype before the matmul (as in down_proj(glu(...))): compare with
    # the relative-norm bound of a bf16/fp16 matmul input.
    assert_close(out, ref, dtype, "out", scale=2.0)
    d_out = torch.randn_like(out)
    with poisoned():
        got = torch.autograd.grad(out, leaves, d_out)
    want = torch.autograd.grad(ref, leaves64, d_out.to(F64))
    for name, a, w in zip(("d_gate_up", "d_weight", "d_bias"), got, want):
        assert a.dtype == dtype
        assert_close(a, w, dtype, name, scale=2.0)


def test_glu_linear_equals_down_proj_of_glu_and_saves_gate_up_and_weight():
    """Bitwise the output and gradients of ``down_proj(glu(gate, up))``, while autograd keeps
    gate, up and the weight (no [..., I] product): the backward recomputes it."""
    gate_up, weight, b = _glu_linear_leaves(torch.float32, bias=True, i=40, o=12)
    down = torch.nn.Linear(40, 12, device=DEVICE)
    with torch.no_grad():
        down.weight.copy_(weight)
        down.bias.copy_(b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = llmkernels.glu_linear(*(gate_up * 1.0).chunk(2, dim=-1), down.weight, down.bias)
    assert sorted(tuple(t.shape) for t in saved) == [(10, 40), (10, 40), (12, 40)]  # gate, up rows; weight
    want = down(llmkernels.glu(*gate_up.chunk(2, dim=-1)))
    assert torch.equal(out, want)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (gate_up, down.weight, down.bias), d_out)
    ref = torch.autograd.grad(want, (gate_up, down.weight, down.bias), d_out)
    for name, a, w in zip(("d_gate_up", "d_weight", "d_bias"), got, ref):
        assert torch.equal(a, w), f"{name}: max diff {(a - w).abs().max().item():.3e}"


def test_glu_linear_frozen_weight_and_inference():
    """A frozen down projection (no weight gradient), and no_grad: same output."""
    gate_up, weight, _ = _glu_linear_leaves(torch.float32, bias=False)
    weight = weight.detach()
    gate, up = gate_up.chunk(2, dim=-1)
    out = llmkernels.glu_linear(gate, up, weight)
    (d_gate_up,) = torch.autograd.grad(out, gate_up, torch.ones_like(out))
    (want,) = torch.autograd.grad(F.linear(llmkernels.glu(gate, up), weight), gate_up, torch.ones_like(out))
    assert torch.equal(d_gate_up, want)
    with torch.no_grad():
        assert torch.equal(llmkernels.glu_linear(gate, up, weight), out)


def test_glu_linear_torch_compile_fullgraph():
    """Under torch.compile glu_linear is F.linear of the glu custom op: no graph break, and the
    output and gradients equal eager."""
    backend = "aot_eager" if INTERPRETED else "inductor"
    gate_up, weight, b = _glu_linear_leaves(torch.float32, bias=True)

    def fn(gate_up, weight, b):
        return llmkernels.glu_linear(*gate_up.chunk(2, dim=-1), weight, b, "gelu_tanh")

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    out, want = compiled(gate_up, weight, b), fn(gate_up, weight, b)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (gate_up, weight, b), d_out)
    ref = torch.autograd.grad(want, (gate_up, weight, b), d_out)
    for a, w in zip(got, ref):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)


def _bad_cases():
    gate = torch.randn(4, 8, device=DEVICE)
    return [
        ("up shape", ValueError, lambda: llmkernels.glu(gate, gate[:, :4])),
        ("up shape", ValueError, lambda: llmkernels.glu(gate, gate[None])),
        ("up dtype", TypeError, lambda: llmkernels.glu(gate, gate.bfloat16())),
        ("gate must be a floating", TypeError, lambda: llmkernels.glu(gate.long(), gate)),
        ("up must be a floating", TypeError, lambda: llmkernels.glu(gate, gate.int())),
        ("up must be a torch.Tensor", TypeError, lambda: llmkernels.glu(gate, 1.0)),
        ("activation must be one of", ValueError, lambda: llmkernels.glu(gate, gate, "relu")),
        ("at least one dimension", ValueError, lambda: llmkernels.glu(gate[0, 0], gate[0, 0])),
        ("weight must have shape", ValueError, lambda: llmkernels.glu_linear(gate, gate, gate[:, :4])),
        ("weight must have shape", ValueError, lambda: llmkernels.glu_linear(gate, gate, gate[0])),
        ("weight dtype", TypeError, lambda: llmkernels.glu_linear(gate, gate, gate.bfloat16())),
        ("weight must be a floating", TypeError, lambda: llmkernels.glu_linear(gate, gate, gate.long())),
        ("bias must have shape", ValueError, lambda: llmkernels.glu_linear(gate, gate, gate, gate[0])),
        ("bias dtype", TypeError, lambda: llmkernels.glu_linear(gate, gate, gate, gate[:, 0].half())),
        ("up shape", ValueError, lambda: llmkernels.glu_linear(gate, gate[:, :4], gate)),
    ]


test_bad_input = bad_input_test(_bad_cases)


def test_wrong_device():
    if DEVICE == "cpu":
        pytest.skip("needs a second device")
    gate = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="up is on cpu"):
        llmkernels.glu(gate, gate.cpu())
