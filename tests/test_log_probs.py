"""linear_log_probs against the float64 reference: log-probabilities, entropy and every gradient
for random upstream gradients of both outputs, with bias, temperature, ignored rows, several
vocabulary chunks (the last one ragged), outputs poisoned with NaN; partial gradients, masked
classes, bad input, torch.compile; both passes' logits made by the same GEMM calls, in hidden's
dtype or (``logits_dtype=torch.float32``) in fp32, on the kernels and on the plain-PyTorch path."""
import importlib

import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.testing import poisoned
from llmkernels.ops import _launch
from llmkernels.ops.losses import log_probs as lp_ops
from llmkernels.ops.losses.base import chunks as chunks_ops
from tests.conftest import DEVICE
from tests.helpers import assert_close, cuda_peak_bytes

# the module (the package's attribute of that name is its function)
vocab_grads_ops = importlib.import_module("llmkernels.ops.losses.base.vocab_grads")

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
                    tols=None, **opts):
    """Kernel vs float64 reference: logp, entropy and the gradients of ``sum(g1 logp + g2 entropy)``.
    The reference's logits are rounded to a 16-bit input's dtype, as the kernel's GEMMs (and the
    unfused computation's) round them, unless ``logits_dtype=torch.float32``: at temperature 0.05
    that rounding alone moves a bf16 entropy by up to tens of percent and the gradients by a few,
    which no kernel can undo. ``tols``: ``(dtype, scale)`` of ``assert_close`` for "logp",
    "entropy" and "grads" (default: the input's dtype, bf16's for a 16-bit input)."""
    dtype = hidden.dtype
    tensors = (hidden, weight, bias)
    leaves = [None if t is None else t.clone().requires_grad_(n) for t, n in zip(tensors, needs)]
    refs = [None if t is None else t.double().requires_grad_(n) for t, n in zip(tensors, needs)]
    out = lk.linear_log_probs(*leaves[:2], target, leaves[2], return_entropy=entropy, **opts)
    logp, ent = out if entropy else (out, None)
    rounded = dtype != torch.float32 and opts.get("logits_dtype") is None
    opts = {k: v for k, v in opts.items() if k in ("temperature", "ignore_index")}
    ref_logp, ref_ent = reference.linear_log_probs(*refs[:2], target, refs[2], compute_dtype=torch.float64,
                                                   logits_dtype=dtype if rounded else None, **opts)
    default = (dtype if dtype == torch.float32 else torch.bfloat16, 1.0)
    tols = {"logp": default, "entropy": default, "grads": default, **(tols or {})}
    assert logp.dtype == torch.float32 and logp.shape == target.shape
    assert_close(logp, ref_logp, tols["logp"][0], "logp", scale=tols["logp"][1])
    loss, ref_loss = 0.0, 0.0
    if "logp" in upstream:
        g1 = torch.rand_like(logp) + 0.5
        loss, ref_loss = (logp * g1).sum(), (ref_logp * g1.double()).sum()
    if entropy:
        assert_close(ent, ref_ent, tols["entropy"][0], "entropy", scale=tols["entropy"][1])
        if "ent" in upstream:
            g2 = torch.randn_like(ent)
            loss, ref_loss = loss + (ent * g2).sum(), ref_loss + (ref_ent * g2.double()).sum()
    wrt = [(name, l, r) for name, l, r in zip(("dhidden", "dweight", "dbias"), leaves, refs)
           if l is not None and l.requires_grad]
    grads = torch.autograd.grad(loss, [l for _, l, _ in wrt])
    ref_grads = torch.autograd.grad(ref_loss, [r for _, _, r in wrt])
    for (name, leaf, _), got, want in zip(wrt, grads, ref_grads):
        assert got.dtype == leaf.dtype
        assert_close(got, want, tols["grads"][0], name, scale=tols["grads"][1])
    return logp, ent, dict(zip([name for name, _, _ in wrt], grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(bias, dtype, device):
    """128-column chunks over V = 700 (the last one ragged)."""
    hidden, weight, b, target = make_head(13, 32, 700, dtype, device, bias=bias)
    check_log_probs(hidden, weight, b, target, temperature=0.7, vocab_chunk_size=128)


def bug_case(device, layout="transposed"):
    """bf16, hidden a transposed view (or its contiguous copy), weight [128, 256] * 3/16, a bias:
    where logits of the two passes formed by different GEMMs put the gradients far off."""
    hidden = torch.randn(256, 39, device=device).to(torch.bfloat16)
    hidden = hidden.T if layout == "transposed" else hidden.T.contiguous()
    weight = (torch.randn(128, 256, device=device) * 3 / 16).to(torch.bfloat16)
    bias = torch.randn(128, device=device).to(torch.bfloat16)
    return hidden, weight, bias, torch.randint(0, 128, (39,), device=device)


def exact_tols(temperature):
    """fp32 logits against the exact float64 reference: logp to fp32's tolerance; the entropy
    ``lse - E_p[z]`` cancels fp32 rounding of z, 1 / temperature times the logits; the bf16
    gradients within about two bf16 roundings (the gradient block, then the output)."""
    return {"logp": (torch.float32, 1.0), "entropy": (torch.float32, 2.0 / temperature),
            "grads": (torch.bfloat16, 0.6)}


@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["bf16-logits", "fp32-logits"])
@pytest.mark.parametrize("temperature", [0.05, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("cols", [48, None], ids=["cols-48", "cols-default"])
def test_low_temperature_bf16_transposed(layout, cols, temperature, logits_dtype, device):
    """An upstream gradient on both outputs: the backward's logits must be the forward's, to which
    its lse and E_p[z] belong, or a bf16 rounding apart is magnified by 1 / 0.05 (on a GPU the
    gradients were 1.4-3.3 times their own size off at 0.05, 3.3e-2 relative at temperature 1,
    when the forward went over row chunks). Bf16 logits match the float64 reference of rounded
    logits; fp32 logits the exact one, tightly."""
    hidden, weight, bias, target = bug_case(device, layout)
    check_log_probs(hidden, weight, bias, target, temperature=temperature, vocab_chunk_size=cols,
                    logits_dtype=logits_dtype, tols=exact_tols(temperature) if logits_dtype else None)


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA tensors always take the kernels")
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["bf16-logits", "fp32-logits"])
def test_plain_pytorch_path_keeps_the_logits_contract(logits_dtype, monkeypatch):
    """The fallback a CPU tensor takes without the interpreter: logits rounded to hidden's dtype
    unless logits_dtype is float32, as on the kernels."""
    monkeypatch.setattr(_launch, "INTERPRET", False)
    hidden, weight, bias, target = bug_case("cpu")
    check_log_probs(hidden, weight, bias, target, temperature=0.05, logits_dtype=logits_dtype,
                    tols=exact_tols(0.05) if logits_dtype else None)


@pytest.mark.parametrize("upstream", [("logp",), ("ent",)], ids=["logp-only", "entropy-only"])
def test_one_output_used(upstream, device):
    hidden, weight, b, target = make_head(9, 16, 300, torch.float32, device)
    check_log_probs(hidden, weight, b, target, upstream=upstream, vocab_chunk_size=64)


def test_without_entropy_partial_grads_and_default_chunks(device):
    hidden, weight, b, target = make_head(9, 16, 300, torch.float32, device)
    check_log_probs(hidden, weight, b, target, entropy=False, temperature=2.0)
    check_log_probs(hidden, weight, b, target, needs=(True, False, False), vocab_chunk_size=100)
    check_log_probs(hidden, weight, b, target, needs=(False, True, False), vocab_chunk_size=7)


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
        *[(ValueError, "logits_dtype must be torch.float32 or None", (hidden, weight, target), dict(logits_dtype=bad))
          for bad in (torch.bfloat16, torch.float16, torch.float64, "float32", torch.int32)],
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            lk.linear_log_probs(*args, **kw)


def _layout(t):
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["bf16-logits", "fp32-logits"])
def test_both_passes_make_the_same_logits(logits_dtype, monkeypatch, device):
    """The backward's GEMMs are the forward's, call for call (the same hidden, weight and bias
    slices, an output of the same shape, strides and dtype: hidden's, or fp32 as asked), so their
    logits are the same bits (on CUDA: cuBLAS's; a bf16 rounding apart is what once put the
    gradients far off). The width is chosen once: a default that changed between the passes (the
    free memory it reads) must not reach the backward."""
    calls = {"forward": [], "backward": []}
    phase = ["forward"]
    make = chunks_ops.head_logits

    def recorded(hidden, weight, bias, out):
        logits = make(hidden, weight, bias, out)
        calls[phase[0]].append(((_layout(hidden), _layout(weight), _layout(bias), tuple(out.shape), out.stride(),
                                 out.dtype), logits.clone()))
        return logits

    widths = iter([48, 40, 40])  # the first call's width, then what a second choice would give
    monkeypatch.setattr(chunks_ops, "head_logits", recorded)
    monkeypatch.setattr(vocab_grads_ops, "chunk_cols", lambda *args: next(widths))  # both passes size through it
    hidden = torch.randn(64, 21, device=device).to(torch.bfloat16).T  # a transposed view
    weight = (torch.randn(130, 64, device=device) / 8).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(130, device=device).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 130, (21,), device=device)
    h = hidden.requires_grad_()
    logp, ent = lk.linear_log_probs(h, weight, target, bias, temperature=0.05, return_entropy=True,
                                    logits_dtype=logits_dtype)
    phase[0] = "backward"
    (logp * torch.rand_like(logp) + ent).sum().backward()
    forward, backward = calls["forward"], calls["backward"]
    assert [call for call, _ in forward] == [call for call, _ in backward]
    assert [call[1][1][0] for call, _ in forward] == [48, 48, 34]  # weight rows of each chunk
    assert all(call[-1] == (logits_dtype or torch.bfloat16) for call, _ in forward)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(forward, backward))


def test_chunk_size_no_longer_applies(device):
    """``chunk_size`` (the forward's rows per chunk before it went over vocabulary chunks) is
    accepted and checked, warns, and changes nothing."""
    hidden, weight, b, target = make_head(9, 16, 300, torch.bfloat16, device)
    with pytest.warns(FutureWarning, match="chunk_size no longer applies"):
        given = lk.linear_log_probs(hidden, weight, target, b, return_entropy=True, chunk_size=2, vocab_chunk_size=64)
    plain = lk.linear_log_probs(hidden, weight, target, b, return_entropy=True, vocab_chunk_size=64)
    assert all(torch.equal(a, b) for a, b in zip(given, plain))
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1"):
        lk.linear_log_probs(hidden, weight, target, chunk_size=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator statistics need CUDA")
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["bf16-logits", "fp32-logits"])
def test_forward_peak_memory(logits_dtype):
    """The forward holds one [M, Cv] block of logits in their dtype, as the backward does, and
    rows of fp32 statistics: no [C, V] block, no second chunk."""
    m, h, v, cols = 2048, 64, 8192, 1024
    hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (m,), device="cuda")
    peak = cuda_peak_bytes(lambda: lk.linear_log_probs(hidden, weight, target, return_entropy=True,
                                                       vocab_chunk_size=cols, logits_dtype=logits_dtype))
    block = m * cols * (logits_dtype or hidden.dtype).itemsize
    assert block > 2**20 + 12 * m * 4  # so that a second block would exceed the bound
    assert peak <= block + 12 * m * 4 + 2**20, f"peak {peak} B"


BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


HEAD_DTYPES = [(torch.float32, None), (torch.bfloat16, torch.float32)]  # (hidden's, logits_dtype)


@pytest.mark.parametrize("dtype,logits_dtype", HEAD_DTYPES, ids=["fp32", "bf16-fp32-logits"])
def test_compile_fullgraph(dtype, logits_dtype, device):
    torch._dynamo.reset()
    hidden, weight, b, target = make_head(7, 16, 300, dtype, device)

    def step(h, w, bias):
        logp, ent = lk.linear_log_probs(h, w, target, bias, temperature=0.8, return_entropy=True,
                                        vocab_chunk_size=100, logits_dtype=logits_dtype)
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
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype,logits_dtype", HEAD_DTYPES, ids=["fp32", "bf16-fp32-logits"])
def test_opcheck(dtype, logits_dtype, device):
    hidden, weight, b, target = make_head(5, 8, 40, dtype, device)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    options = lp_ops.LogProbsOptions(temperature=0.9, want_entropy=True, ignore_index=-100, check=True, cols=16,
                                     logits_dtype=logits_dtype, need=[True, True, b is not None])
    torch.library.opcheck(lp_ops.LOG_PROBS.op, (h, w, target, b, *options))
