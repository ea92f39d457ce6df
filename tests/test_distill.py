"""linear_distill_loss against the float64 reference: every kind and reduction, the loss and the
student's gradients for a random upstream gradient, temperature, ignored rows, a teacher of
another hidden size, several chunks (the last one ragged), outputs poisoned with NaN; the
weight gradient summed in the weight's dtype; Liger's beta convention; bad input; torch.compile."""
import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.testing import poisoned
from llmkernels.ops.losses import distill as distill_ops
from tests.conftest import DEVICE
from tests.helpers import assert_close, cuda_peak_bytes

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def make_pair(m, hs, ht, v, dtype, device, *, ignored=(3,)):
    student = torch.randn(m, hs, device=device).to(dtype), (torch.randn(v, hs, device=device) * 2 / hs ** 0.5).to(dtype)
    teacher = torch.randn(m, ht, device=device).to(dtype), (torch.randn(v, ht, device=device) * 2 / ht ** 0.5).to(dtype)
    target = torch.randint(0, v, (m,), device=device)
    for r in ignored:
        target[r] = -100
    return student, teacher, target


def check_distill(student, teacher, target, *, needs=(True, True), tol_scale=1.0, **opts):
    dtype = student[0].dtype
    leaves = [t.clone().requires_grad_(n) for t, n in zip(student, needs)]
    refs = [t.double().requires_grad_(n) for t, n in zip(student, needs)]
    loss = lk.linear_distill_loss(*leaves, *teacher, target, **opts)
    for option in ("chunk_size", "accum_dtype", "memory"):
        opts.pop(option, None)
    ref = reference.linear_distill_loss(*refs, *(t.double() for t in teacher), target, compute_dtype=torch.float64,
                                        **opts)
    tol = dtype if dtype == torch.float32 else torch.bfloat16
    assert loss.dtype == torch.float32
    assert_close(loss, ref, tol, "loss")
    g = torch.rand_like(loss) + 0.5
    wrt = [(name, l, r) for name, l, r in zip(("dhidden", "dweight"), leaves, refs) if l.requires_grad]
    grads = torch.autograd.grad(loss, [l for _, l, _ in wrt], g)
    ref_grads = torch.autograd.grad(ref, [r for _, _, r in wrt], g.double())
    for (name, leaf, _), got, want in zip(wrt, grads, ref_grads):
        assert got.dtype == leaf.dtype
        assert_close(got, want, tol, name, scale=tol_scale)
    return loss, dict(zip([name for name, _, _ in wrt], grads))


KINDS = ["jsd", "forward_kl", "reverse_kl"]
# every kind and reduction with memory="low"; the default memory="fast" once per kind
CASES = [(k, r, "low") for k in KINDS for r in ("mean", "sum", "none")] + list(zip(KINDS, ("none", "mean", "sum"),
                                                                                   ["fast"] * 3))


@pytest.mark.parametrize("kind,reduction,memory", CASES)
def test_matches_reference(kind, reduction, memory, device):
    """fp32, a teacher twice as wide as the student, 4-row chunks of 11 rows (low memory: and
    vocabulary chunks of 256 columns, the last one ragged)."""
    student, teacher, target = make_pair(11, 16, 32, 500, torch.float32, device)
    check_distill(student, teacher, target, kind=kind, beta=0.3, temperature=1.7, reduction=reduction, chunk_size=4,
                  memory=memory)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16(kind, device):
    student, teacher, target = make_pair(9, 32, 32, 700, torch.bfloat16, device)
    check_distill(student, teacher, target, kind=kind, temperature=2.0, chunk_size=5)


def test_low_memory_matches_fast_at_low_temperature(device):
    """bf16 at temperature 0.1, a student hidden that is a transposed view, one row a chunk:
    memory="low" pairs logits recomputed over vocabulary chunks (other GEMMs) with the row pass's
    statistics, and its gradients must agree with memory="fast", which forms them from the row
    pass's own logits, to a bf16 rounding (both are as far from float64 as bf16 logits are at
    this temperature, a few percent: the unfused computation's error)."""
    (hidden, weight), teacher, target = make_pair(39, 256, 64, 128, torch.bfloat16, device)
    hidden = hidden.T.contiguous().T
    grads = {}
    for memory in ("fast", "low"):
        leaves = [hidden.clone().requires_grad_(), (weight * 1.5).requires_grad_()]
        loss = lk.linear_distill_loss(*leaves, *teacher, target, kind="jsd", temperature=0.1, chunk_size=1,
                                      memory=memory)
        grads[memory] = torch.autograd.grad(loss, leaves)
    for name, fast, low in zip(("dhidden", "dweight"), *grads.values()):
        assert_close(low, fast, torch.bfloat16, name)


def test_accumulation_in_weight_dtype_partial_grads_and_no_target(device):
    student, teacher, target = make_pair(9, 16, 16, 300, torch.bfloat16, device)
    check_distill(student, teacher, target, memory="fast", accum_dtype=None, chunk_size=2, reduction="sum")
    student, teacher, _ = make_pair(9, 16, 16, 300, torch.float32, device)
    check_distill(student, teacher, None, kind="forward_kl", needs=(True, False))
    check_distill(student, teacher, None, kind="reverse_kl", needs=(False, True), reduction="none")


def test_ignored_rows_contribute_nothing_and_liger_beta(device):
    """Ignored rows: loss 0 (``none``), not counted by ``mean``, zero gradient. beta weighs the
    teacher: with M = beta P + (1 - beta) Q, beta -> 0 makes M -> Q (the loss vanishes)."""
    student, teacher, target = make_pair(8, 16, 16, 200, torch.float32, device, ignored=(0, 5))
    rows, grads = check_distill(student, teacher, target, reduction="none", chunk_size=3)
    assert torch.equal(rows[[0, 5]], torch.zeros(2, device=device))
    assert torch.equal(grads["dhidden"][[0, 5]], torch.zeros(2, 16, device=device))
    mean = lk.linear_distill_loss(*student, *teacher, target)
    assert_close(mean, rows.sum() / 6, torch.float32, "mean over the 6 rows not ignored")
    small = lk.linear_distill_loss(*student, *teacher, target, beta=1e-4)
    large = lk.linear_distill_loss(*student, *teacher, target, beta=0.5)
    assert 0 < small < 1e-3 * large


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator statistics need CUDA")
def test_low_memory_peak():
    """memory="low": forward + backward hold the gradients and one chunk of each model's logits
    (no [V, H] fp32 accumulator)."""
    m, h, v, chunk = 256, 64, 50000, 16
    (hs, ws), teacher, target = make_pair(m, h, h, v, torch.bfloat16, "cuda")
    hs, ws = hs.requires_grad_(), ws.requires_grad_()
    peak = cuda_peak_bytes(lambda: lk.linear_distill_loss(hs, ws, *teacher, target, chunk_size=chunk,
                                                          memory="low").backward(), (hs, ws))
    grads, blocks = (m + v) * h * 2, 2 * m * 3200 * 2  # vocabulary chunks: 16 * 50000 / 256 columns, aligned
    assert blocks + 2**20 < v * h * 4  # an fp32 accumulator would exceed the bound
    assert peak <= grads + blocks + 2**20, f"peak {peak} B"


def test_backward_twice_raises(device):
    student, teacher, target = make_pair(6, 8, 8, 50, torch.float32, device)
    h = student[0].clone().requires_grad_()
    loss = lk.linear_distill_loss(h, student[1], *teacher, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_bad_input(device):
    (hs, ws), (ht, wt), target = make_pair(4, 8, 12, 20, torch.float32, device, ignored=())
    cases = [
        (TypeError, "student_hidden must be a floating-point", (hs.long(), ws, ht, wt), {}),
        (TypeError, "teacher_hidden must be a floating-point", (hs, ws, ht.int(), wt), {}),
        (ValueError, r"student_weight must have shape \[V, H\] = \[V, 8\]", (hs, wt, ht, wt), {}),
        (ValueError, r"teacher_weight must have shape \[V, H\] = \[V, 12\]", (hs, ws, ht, ws), {}),
        (ValueError, "teacher_weight has a vocabulary of 19 but student_weight of 20", (hs, ws, ht, wt[:19]), {}),
        (ValueError, "teacher_hidden has 3 rows but student_hidden has 4", (hs, ws, ht[:3], wt), {}),
        (ValueError, "teacher_hidden is on meta", (hs, ws, ht.to("meta"), wt), {}),
        (TypeError, "teacher_weight dtype", (hs, ws, ht, wt.double()), {}),
        (ValueError, r"target must have shape \[4\]", (hs, ws, ht, wt), dict(target=target[:3])),
        (ValueError, "kind must be one of", (hs, ws, ht, wt), dict(kind="kl")),
        (ValueError, r"beta must be a number in \(0, 1\)", (hs, ws, ht, wt), dict(beta=1.0)),
        (ValueError, "temperature", (hs, ws, ht, wt), dict(temperature=-1.0)),
        (ValueError, "reduction must be one of", (hs, ws, ht, wt), dict(reduction="max")),
        (ValueError, "accum_dtype", (hs, ws, ht, wt), dict(accum_dtype=torch.bfloat16)),
        (ValueError, "chunk_size", (hs, ws, ht, wt), dict(chunk_size=0)),
        (ValueError, "memory must be one of", (hs, ws, ht, wt), dict(memory="small")),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            lk.linear_distill_loss(*args, **kw)


BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph(reduction, device):
    torch._dynamo.reset()
    student, teacher, target = make_pair(7, 16, 16, 300, torch.float32, device)

    def step(h, w):
        return lk.linear_distill_loss(h, w, *teacher, target, kind="jsd", temperature=1.5, reduction=reduction,
                                      chunk_size=3).sum() * 3.0

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    results = []
    for fn in (step, compiled):
        leaves = [t.clone().requires_grad_() for t in student]
        loss = fn(*leaves)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    torch._dynamo.reset()
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert_close(loss_c, loss_e, torch.float32, "compiled loss")
    for name, got, want in zip(("dhidden", "dweight"), grads_c, grads_e):
        assert_close(got, want, torch.float32, name)


def test_opcheck(device):
    student, teacher, target = make_pair(5, 8, 8, 40, torch.float32, device)
    h, w = (t.requires_grad_() for t in student)
    options = distill_ops.DistillOptions(kind="jsd", beta=0.5, temperature=1.0, ignore_index=-100, reduction="none",
                                         check=True, chunk_size=2, accum_dtype=torch.float32, need=[True, True],
                                         memory="low")
    torch.library.opcheck(distill_ops.DISTILL.op, (h, w, *teacher, target, *options))
