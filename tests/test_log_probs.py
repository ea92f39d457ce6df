"""linear_log_probs against the float64 reference: log-probabilities, entropy and every gradient
for random upstream gradients of both outputs, with bias, temperature, ignored rows, several
row and vocabulary chunks (the last ones ragged), outputs poisoned with NaN; partial gradients,
masked classes, bad input, torch.compile."""
import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.testing import poisoned
from llmkernels.ops.losses import log_probs as lp_ops
from tests.conftest import DEVICE
from tests.helpers import assert_close

# The interpreter evaluates masked-out lanes too (exp of -inf padding): numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def make_head(m, h, v, dtype, device, *, bias=True, ignored=(3,)):
    hidden = torch.randn(m, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) * 2 / h ** 0.5).to(dtype)
    b = (torch.randn(v, device=device) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, v, (m,), device=device)
    for r in ignored:
        target[r] = -100
    return hidden, weight, b, target


def check_log_probs(hidden, weight, bias, target, *, needs=(True, True, True), entropy=True, upstream=("logp", "ent"),
                    **opts):
    """Kernel vs float64 reference: logp, entropy and the gradients of ``sum(g1 logp + g2 entropy)``."""
    dtype = hidden.dtype
    tensors = (hidden, weight, bias)
    leaves = [None if t is None else t.clone().requires_grad_(n) for t, n in zip(tensors, needs)]
    refs = [None if t is None else t.double().requires_grad_(n) for t, n in zip(tensors, needs)]
    out = lk.linear_log_probs(*leaves[:2], target, leaves[2], return_entropy=entropy, **opts)
    logp, ent = out if entropy else (out, None)
    opts = {k: v for k, v in opts.items() if k in ("temperature", "ignore_index")}
    ref_logp, ref_ent = reference.linear_log_probs(*refs[:2], target, refs[2], compute_dtype=torch.float64, **opts)
    tol = dtype if dtype == torch.float32 else torch.bfloat16  # logits rounded to the input dtype, as unfused
    assert logp.dtype == torch.float32 and logp.shape == target.shape
    assert_close(logp, ref_logp, tol, "logp")
    loss, ref_loss = 0.0, 0.0
    if "logp" in upstream:
        g1 = torch.rand_like(logp) + 0.5
        loss, ref_loss = (logp * g1).sum(), (ref_logp * g1.double()).sum()
    if entropy:
        assert_close(ent, ref_ent, tol, "entropy")
        if "ent" in upstream:
            g2 = torch.randn_like(ent)
            loss, ref_loss = loss + (ent * g2).sum(), ref_loss + (ref_ent * g2.double()).sum()
    wrt = [(name, l, r) for name, l, r in zip(("dhidden", "dweight", "dbias"), leaves, refs)
           if l is not None and l.requires_grad]
    grads = torch.autograd.grad(loss, [l for _, l, _ in wrt])
    ref_grads = torch.autograd.grad(ref_loss, [r for _, _, r in wrt])
    for (name, leaf, _), got, want in zip(wrt, grads, ref_grads):
        assert got.dtype == leaf.dtype
        assert_close(got, want, tol, name)
    return logp, ent, dict(zip([name for name, _, _ in wrt], grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(bias, dtype, device):
    """4-row forward chunks and 128-column backward chunks over V = 700 (both last ones ragged)."""
    hidden, weight, b, target = make_head(13, 32, 700, dtype, device, bias=bias)
    check_log_probs(hidden, weight, b, target, temperature=0.7, chunk_size=4, vocab_chunk_size=128)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("chunk_size", [1, None], ids=["rows-1", "rows-default"])
def test_low_temperature_bf16_transposed(layout, chunk_size, temperature, device):
    """bf16, a hidden that is a transposed view, one row a forward chunk, an upstream gradient on
    both outputs: the backward's logits, formed over vocabulary chunks by other GEMMs than the
    forward's, must agree with the forward's lse and E_p[z] to better than a bf16 rounding, which
    1 / 0.05 would magnify (on a GPU the gradients were 1.4-3.3 times their own size off when both
    passes rounded the logits to bf16 at 0.05, 3.3e-2 relative at temperature 1 with a row a chunk)."""
    hidden = torch.randn(256, 39, device=device).to(torch.bfloat16)
    hidden = hidden.T if layout == "transposed" else hidden.T.contiguous()
    weight = (torch.randn(128, 256, device=device) * 3 / 16).to(torch.bfloat16)
    bias = torch.randn(128, device=device).to(torch.bfloat16)
    target = torch.randint(0, 128, (39,), device=device)
    check_log_probs(hidden, weight, bias, target, temperature=temperature, chunk_size=chunk_size)


@pytest.mark.parametrize("upstream", [("logp",), ("ent",)], ids=["logp-only", "entropy-only"])
def test_one_output_used(upstream, device):
    hidden, weight, b, target = make_head(9, 16, 300, torch.float32, device)
    check_log_probs(hidden, weight, b, target, upstream=upstream, vocab_chunk_size=64)


def test_without_entropy_partial_grads_and_default_chunks(device):
    hidden, weight, b, target = make_head(9, 16, 300, torch.float32, device)
    check_log_probs(hidden, weight, b, target, entropy=False, temperature=2.0)
    check_log_probs(hidden, weight, b, target, needs=(True, False, False), vocab_chunk_size=100)
    check_log_probs(hidden, weight, b, target, needs=(False, True, False), chunk_size=2)


def test_ignored_rows_contribute_nothing(device):
    """Ignored rows: logp = entropy = 0, zero hidden gradient, and their hidden states do not
    change the weight gradient."""
    hidden, weight, b, target = make_head(8, 16, 200, torch.float32, device, ignored=(0, 5))
    logp, ent, grads = check_log_probs(hidden, weight, b, target, vocab_chunk_size=64)
    assert torch.equal(logp[[0, 5]], torch.zeros(2, device=device)) and torch.equal(ent[[0, 5]], logp[[0, 5]])
    assert torch.equal(grads["dhidden"][[0, 5]], torch.zeros(2, 16, device=device))
    other = hidden.clone()
    other[[0, 5]] = torch.randn(2, 16, device=device) * 10
    w = weight.clone().requires_grad_()
    torch.manual_seed(7)
    (lk.linear_log_probs(other, w, target, b).sum()).backward()
    w2 = weight.clone().requires_grad_()
    (lk.linear_log_probs(hidden, w2, target, b).sum()).backward()
    assert_close(w.grad, w2.grad, torch.float32, "dweight without the ignored rows")


def test_masked_classes_and_int32_target(device):
    """Classes masked with a -inf bias have p = 0: finite entropy and gradients."""
    hidden, weight, b, target = make_head(6, 16, 300, torch.float32, device, ignored=())
    b[:100] = float("-inf")
    target = target.clamp(min=100).to(torch.int32)
    logp, ent = lk.linear_log_probs(hidden, weight.clone().requires_grad_(), target, b, return_entropy=True)
    ref_logp, ref_ent = reference.linear_log_probs(hidden.double(), weight.double(), target, b.double(),
                                                   compute_dtype=torch.float64)
    assert_close(logp, ref_logp, torch.float32, "logp")
    assert_close(ent, ref_ent, torch.float32, "entropy")
    h = hidden.clone().requires_grad_()
    (lk.linear_log_probs(h, weight, target, b, return_entropy=True, vocab_chunk_size=64)[1].sum()).backward()
    assert torch.isfinite(h.grad).all()


def test_bad_input(device):
    hidden, weight, b, target = make_head(4, 8, 20, torch.float32, device, ignored=())
    cases = [
        (TypeError, "hidden must be a floating-point", (hidden.long(), weight, target), {}),
        (ValueError, r"hidden must have shape \[M, H\]", (hidden[0], weight, target), {}),
        (ValueError, r"weight must have shape \[V, H\] = \[V, 8\]", (hidden, weight[:, :4], target), {}),
        (TypeError, "weight dtype", (hidden, weight.double(), target), {}),
        (ValueError, "weight is on meta", (hidden, weight.to("meta"), target), {}),
        (ValueError, r"bias must have shape \[20\]", (hidden, weight, target), dict(bias=b[:5])),
        (ValueError, r"target must have shape \[4\]", (hidden, weight, target[:2]), {}),
        (TypeError, "target must be int64 or int32", (hidden, weight, target.float()), {}),
        (ValueError, r"target\[1\] = 20 is outside \[0, 20\)", (hidden, weight, torch.tensor([0, 20, 1, 2], device=device)), {}),
        (ValueError, "temperature", (hidden, weight, target), dict(temperature=0.0)),
        (ValueError, "vocab_chunk_size", (hidden, weight, target), dict(vocab_chunk_size=0)),
        (TypeError, "ignore_index", (hidden, weight, target), dict(ignore_index=None)),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            lk.linear_log_probs(*args, **kw)


BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def test_compile_fullgraph(device):
    torch._dynamo.reset()
    hidden, weight, b, target = make_head(7, 16, 300, torch.float32, device)

    def step(h, w, bias):
        logp, ent = lk.linear_log_probs(h, w, target, bias, temperature=0.8, return_entropy=True,
                                        vocab_chunk_size=100)
        return (logp.exp() * 2.0 - 0.1 * ent).sum()

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    results = []
    for fn in (step, compiled):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
        loss = fn(*leaves)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    torch._dynamo.reset()
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert_close(loss_c, loss_e, torch.float32, "compiled loss")
    for name, got, want in zip(("dhidden", "dweight", "dbias"), grads_c, grads_e):
        assert_close(got, want, torch.float32, name)


def test_opcheck(device):
    hidden, weight, b, target = make_head(5, 8, 40, torch.float32, device)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    options = lp_ops.LogProbsOptions(temperature=0.9, want_entropy=True, ignore_index=-100, check=True, chunk_size=2,
                                     vocab_chunk_size=16, need=[True, True, b is not None])
    torch.library.opcheck(lp_ops.LOG_PROBS.op, (h, w, target, b, *options))
