"""The contract every path keeps (kernel on the GPU, the interpreter, the plain-PyTorch fallback):
the cases the differential fuzzer found wrong, each fixed and kept here.

1. Gradients of the linear losses for transposed hidden states / weights under an upstream
   gradient that is not 1; 2. the ops under a default device that is not the inputs';
3. NaN in distillation stays in its row; 4. empty batches; 5. one target contract on every path;
6. bad options name the argument; 7. the in-place cross-entropy on a view of the logits."""
import math

import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.ops import _launch
from tests.conftest import DEVICE
from tests.helpers import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch):
    """Each test twice: through the kernels (the interpreter on CPU) and through the plain-PyTorch
    fallback that a CPU tensor takes without the interpreter (``use_kernels`` False)."""
    if request.param == "fallback":
        monkeypatch.setattr(_launch, "INTERPRET", False)
        if DEVICE == "cuda":
            pytest.skip("CUDA tensors always take the kernels")
    return request.param


def transposed(rows, cols, scale=1.0):
    """A ``[rows, cols]`` leaf stored column-major (strides (1, rows)), as ``t.t()`` of a weight."""
    return (torch.randn(cols, rows, device=DEVICE) * scale).t().requires_grad_()


def head(m, h, v, which):
    hidden = transposed(m, h) if which == "hidden" else torch.randn(m, h, device=DEVICE).requires_grad_()
    weight = transposed(v, h, h ** -0.5) if which == "weight" else (torch.randn(v, h, device=DEVICE) * h ** -0.5).requires_grad_()
    return hidden, weight


def grads_vs_reference(loss_fn, ref_fn, leaves, scale):
    """Gradients of ``scale * loss`` (loss scaling, accumulation) against float64."""
    refs = [t.detach().double().requires_grad_() for t in leaves]
    got = torch.autograd.grad(scale * loss_fn(*leaves), leaves)
    want = torch.autograd.grad(scale * ref_fn(*refs), refs)
    for name, g, w in zip(("dhidden", "dweight"), got, want):
        assert_close(g, w, torch.float32, name, scale=10)


@pytest.mark.parametrize("which", ["hidden", "weight"])
@pytest.mark.parametrize("memory", ["fast", "low"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_transposed_inputs_scaled_gradient(reduction, memory, which):
    m, h, v = 47, 64, 31
    hidden, weight = head(m, h, v, which)
    target = torch.randint(0, v, (m,), device=DEVICE)
    grads_vs_reference(
        lambda a, b: lk.linear_cross_entropy(a, b, target, reduction=reduction, memory=memory),
        lambda a, b: reference.linear_cross_entropy(a, b, target, reduction=reduction, compute_dtype=torch.float64)[0],
        [hidden, weight], 0.37)


@pytest.mark.parametrize("which", ["hidden", "weight"])
@pytest.mark.parametrize("memory", ["fast", "low"])
@pytest.mark.parametrize("kind", ["jsd", "forward_kl", "reverse_kl"])
def test_distill_transposed_inputs_scaled_gradient(kind, memory, which):
    m, h, v = 12, 100, 31
    hidden, weight = head(m, h, v, which)
    teacher = torch.randn(m, 24, device=DEVICE), torch.randn(v, 24, device=DEVICE) * 24 ** -0.5
    grads_vs_reference(
        lambda a, b: lk.linear_distill_loss(a, b, *teacher, kind=kind, memory=memory, reduction="sum"),
        lambda a, b: reference.linear_distill_loss(a, b, *(t.double() for t in teacher), kind=kind, reduction="sum",
                                                   compute_dtype=torch.float64),
        [hidden, weight], 2.5)


OPS = {
    "cross_entropy": lambda h, w, t, x: lk.cross_entropy(h @ w.t(), t),
    "cross_entropy_inplace": lambda h, w, t, x: lk.cross_entropy(h @ w.t(), t, inplace_backward=True),
    "linear_cross_entropy": lambda h, w, t, x: lk.linear_cross_entropy(h, w, t),
    "linear_cross_entropy_low": lambda h, w, t, x: lk.linear_cross_entropy(h, w, t, memory="low", reduction="none").sum(),
    "linear_log_probs": lambda h, w, t, x: lk.linear_log_probs(h, w, t, return_entropy=True)[1].sum(),
    "linear_distill_loss": lambda h, w, t, x: lk.linear_distill_loss(h, w, h.detach(), w.detach() * 2, t),
    "rms_norm": lambda h, w, t, x: lk.rms_norm(x, w[0], residual=x * 2).sum(),
    "layer_norm": lambda h, w, t, x: lk.layer_norm(x, w[0], w[1]).sum(),
    "glu": lambda h, w, t, x: lk.glu(x, x.flip(0), activation="gelu_tanh").sum(),
    "apply_rope": lambda h, w, t, x: lk.apply_rope(x.view(1, 1, 5, 16), None, h[None].cos(), h[None].sin())[0].sum(),
    "qk_norm_rope": lambda h, w, t, x: lk.qk_norm_rope(x.view(1, 5, 1, 16), x.flip(0).view(1, 5, 1, 16), w[0], w[1],
                                                       h.cos(), h.sin(), layout="bshd")[0].sum(),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("context", ["set_default_device", "device_block"])
def test_default_device_elsewhere(op, context):
    """Tensors the ops make without naming a device (the target check's host word was one) land
    on the default device; 'meta' stands in for a default CUDA device on CPU."""
    other = "meta" if DEVICE == "cpu" else "cuda"
    h = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(13, 16, device=DEVICE, requires_grad=True)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 13, (5,), device=DEVICE)
    if context == "set_default_device":
        torch.set_default_device(other)
        try:
            loss = OPS[op](h, w, t, x)
            loss.backward()
        finally:
            torch.set_default_device(None)
    else:
        with torch.device(other):
            loss = OPS[op](h, w, t, x)
            loss.backward()
    assert loss.device.type == torch.device(DEVICE).type and torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in (h, w, x))


@pytest.mark.parametrize("kind", ["jsd", "forward_kl", "reverse_kl"])
@pytest.mark.parametrize("where", ["teacher_row", "teacher_weight", "student_row"])
def test_distill_nan_stays_in_its_row(where, kind, path):
    m, h, v = 6, 16, 37
    sh, sw = torch.randn(m, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    th, tw = torch.randn(m, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    {"teacher_row": th, "teacher_weight": tw, "student_row": sh}[where][2 if where != "teacher_weight" else 5, 3] = math.nan
    sh.requires_grad_()
    sw.requires_grad_()
    rows = lk.linear_distill_loss(sh, sw, th, tw, kind=kind, reduction="none")
    rows.backward(torch.rand_like(rows) + 0.5)
    nan_rows = list(range(m)) if where == "teacher_weight" else [2]
    assert torch.isnan(rows).nonzero().flatten().tolist() == nan_rows
    assert torch.isnan(sh.grad).any(1).nonzero().flatten().tolist() == nan_rows
    assert torch.isnan(sw.grad).any()


@pytest.mark.parametrize("memory", ["low", "fast"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_distill_empty_batch(reduction, memory, path):
    sh = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    sw = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    loss = lk.linear_distill_loss(sh, sw, torch.randn(0, 8, device=DEVICE), torch.randn(11, 8, device=DEVICE),
                                  reduction=reduction, memory=memory)
    loss.sum().backward()
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert sw.grad.shape == sw.shape and not sw.grad.abs().any() and sh.grad.shape == (0, 8)


def test_unchecked_out_of_range_target_is_nan_on_every_path(path):
    """``check_targets=False``: a target outside [0, V) gives its row NaN (outputs and gradient)
    whichever path runs; ignored rows stay 0."""
    m, h, v = 5, 8, 11
    hidden = torch.randn(m, h, device=DEVICE, requires_grad=True)
    weight = torch.randn(v, h, device=DEVICE, requires_grad=True)
    target = torch.tensor([1, v, -100, -5, 0], device=DEVICE)
    logp, entropy = lk.linear_log_probs(hidden, weight, target, return_entropy=True, check_targets=False)
    (logp.sum() + entropy.sum()).backward()
    for name, rows in (("logp", logp), ("entropy", entropy), ("dhidden", hidden.grad)):
        nan = torch.isnan(rows.reshape(m, -1)).any(1).tolist()
        assert nan == [False, True, False, True, False], name
    assert logp[2] == 0 and entropy[2] == 0
    for fn in (lambda: lk.cross_entropy(hidden @ weight.t(), target, reduction="none", check_targets=False),
               lambda: lk.linear_cross_entropy(hidden, weight, target, reduction="none", check_targets=False)):
        rows = fn()
        assert torch.isnan(rows).tolist() == [False, True, False, True, False]


@pytest.mark.parametrize("bad", [11, -5])
def test_distill_target_contract_on_every_path(bad, path):
    m, h, v = 4, 8, 11
    student = torch.randn(m, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    teacher = torch.randn(m, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    target = torch.tensor([0, bad, -100, 3], device=DEVICE)
    with pytest.raises(ValueError, match=r"target\[1\]"):
        lk.linear_distill_loss(*student, *teacher, target)
    loss = lk.linear_distill_loss(*student, *teacher, target, check_targets=False, reduction="none")
    valid = lk.linear_distill_loss(*student, *teacher, torch.tensor([0, 1, -100, 3], device=DEVICE), reduction="none")
    torch.testing.assert_close(loss, valid)  # the target is a mask only


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.bool, "float16", 16])
@pytest.mark.parametrize("norm", [lk.rms_norm, lk.layer_norm])
def test_norm_out_dtype_named(norm, out_dtype, path):
    x, w = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match="out_dtype"):
        norm(x, w, out_dtype=out_dtype)


@pytest.mark.parametrize("cos_shape,unsqueeze_dim", [((1, 6, 8), 1), ((3, 5, 8), 1), ((1, 5, 4), 1), ((5, 8), 1),
                                                     ((1, 5, 8), 3)])
def test_hf_rope_mis_sized_cos_named(cos_shape, unsqueeze_dim, path):
    q, k = torch.randn(2, 4, 5, 8, device=DEVICE), torch.randn(2, 2, 5, 8, device=DEVICE)
    cos = torch.randn(cos_shape, device=DEVICE)
    with pytest.raises(ValueError, match="cos|unsqueeze_dim"):
        lk.apply_rotary_pos_emb(q, k, cos, cos.clone(), unsqueeze_dim=unsqueeze_dim)


@pytest.mark.parametrize("view", ["reshape", "slice"])
@pytest.mark.parametrize("reach", ["autograd_grad", "retain_grad"])
def test_inplace_cross_entropy_on_a_view(reach, view):
    """The gradient written over a view of the logits reaches ``autograd.grad(loss, logits)`` and
    ``retain_grad``, and flows on to the matmul's inputs."""
    h = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(11, 16, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 11, (6,), device=DEVICE)

    def logits_of(h, w):
        z = h @ w.t()
        return z.view(-1, 11) if view == "reshape" else torch.cat([z, z], -1).view(-1, 22)[:, :11]

    ref = logits_of(h, w).detach().double().requires_grad_()
    want = torch.autograd.grad(0.5 * torch.nn.functional.cross_entropy(ref, t), ref)[0]
    h_ref, w_ref = (p.detach().double().requires_grad_() for p in (h, w))
    (0.5 * torch.nn.functional.cross_entropy(logits_of(h_ref, w_ref), t)).backward()
    logits = logits_of(h, w)
    if reach == "retain_grad":
        logits.retain_grad()
    loss = lk.cross_entropy(logits, t, inplace_backward=True)
    if reach == "autograd_grad":
        got = torch.autograd.grad(0.5 * loss, logits)[0]
    else:
        (0.5 * loss).backward()
        got = logits.grad
        assert_close(h.grad, h_ref.grad, torch.float32, "dh")
        assert_close(w.grad, w_ref.grad, torch.float32, "dw")
    assert_close(got, want, torch.float32, "dlogits")
