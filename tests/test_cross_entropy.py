"""cross_entropy and linear_cross_entropy against the float64 reference (and F.cross_entropy):
reductions, ignored rows, label smoothing, z-loss, softcap, return_lse / return_z_loss, the
in-place gradient, strided logits, every dtype; the loss and every gradient, with outputs
poisoned with NaN before the kernels write them; bad input; torch.compile."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import llmkernels as lk
from llmkernels import reference
from llmkernels.ops.configs import cross_entropy as ce_configs
from llmkernels.ops.losses import cross_entropy as ce_ops
from llmkernels.ops.losses import linear_cross_entropy as lce_ops
from llmkernels.ops._register import flat_fields
from llmkernels.ops.losses.base import RowLoss, targets
from llmkernels.ops._rowsplit import split_grid
from tests.conftest import DEVICE
from llmkernels.testing import poisoned
from tests.helpers import assert_close, cuda_peak_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The interpreter evaluates masked-out lanes too (log(0) of padding rows): numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def make_case(m, v, dtype, device, *, ignored=(1,), scale=3.0):
    logits = (torch.randn(m, v, device=device) * scale + 0.5).to(dtype)
    target = torch.randint(0, v, (m,), device=device)
    for r in ignored:
        if r < m:
            target[r] = -100
    return logits, target


def upstream(loss):
    """A random upstream gradient for ``loss`` (never exactly 1, so the scaling is exercised)."""
    return torch.rand_like(loss, dtype=torch.float32).add_(0.5).to(loss.dtype)


def check_ce(logits, target, *, reduction="mean", inplace=False, grad=True, config=None, **opts):
    """Kernel vs float64 reference: loss, z part, lse, and d logits for a random upstream gradient
    (``config``: the kernels' launch configuration)."""
    dtype = logits.dtype
    ref_leaf = logits.detach().double().requires_grad_(grad)
    ref_loss, ref_z, ref_lse = reference.cross_entropy(ref_leaf, target, reduction=reduction,
                                                       compute_dtype=torch.float64, **opts)
    leaf = logits.detach().clone().requires_grad_(grad)
    out = lk.cross_entropy(leaf, target, reduction=reduction, return_z_loss=True, return_lse=True,
                           inplace_backward=inplace, config=config, **opts)
    assert isinstance(out, lk.CrossEntropyOutput)
    assert out.loss.dtype == dtype and out.z_loss.dtype == dtype and out.lse.dtype == torch.float32
    assert_close(out.loss, ref_loss, dtype, "loss")
    assert_close(out.z_loss, ref_z, dtype, "z_loss", scale=10.0 if opts.get("z_loss", 0) == 0 else 1.0)
    assert_close(out.lse, ref_lse, torch.float32, "lse")
    assert not out.lse.requires_grad and not out.z_loss.requires_grad
    if not grad:
        return
    g = upstream(out.loss)
    (dx,) = torch.autograd.grad(out.loss, leaf, g)
    (ref_dx,) = torch.autograd.grad(ref_loss, ref_leaf, g.double())
    assert dx.dtype == dtype
    assert_close(dx, ref_dx, dtype, "dlogits")
    if inplace and logits.stride(1) == 1:
        assert dx.data_ptr() == leaf.data_ptr(), "inplace_backward must return the logits buffer as the gradient"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,v", [(3, 1000), (9, 4099), (3, 20000)])  # 20000: the online loop
def test_matches_reference(m, v, dtype, reduction, device):
    logits, target = make_case(m, v, dtype, device)
    check_ce(logits, target, reduction=reduction)


OPTIONS = {
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-3),
    "softcap": dict(softcap=5.0),
    "all": dict(label_smoothing=0.2, z_loss=1e-2, softcap=8.0, ignore_index=7),
}


@pytest.mark.parametrize("inplace,dtype,reduction", [(False, torch.bfloat16, "mean"), (True, torch.bfloat16, "none"),
                                                     (True, torch.float16, "sum")], ids=["bf16", "bf16-inplace",
                                                                                         "fp16-inplace"])
@pytest.mark.parametrize("opts", list(OPTIONS), ids=str)
@pytest.mark.parametrize("m,v", [(9, 4099), (3, 20000)])
def test_options(m, v, opts, inplace, dtype, reduction, device):
    logits, target = make_case(m, v, dtype, device)
    if "ignore_index" in OPTIONS[opts]:
        target[target == -100] = 7
    check_ce(logits, target, reduction=reduction, inplace=inplace, **OPTIONS[opts])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(reduction, device):
    logits, target = make_case(33, 3000, torch.float32, device)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = lk.cross_entropy(a, target, reduction=reduction, label_smoothing=0.15)
    ref = F.cross_entropy(b, target, reduction=reduction, label_smoothing=0.15)
    assert_close(out, ref, torch.float32, "loss")
    g = upstream(out)
    out.backward(g)
    ref.backward(g)
    assert_close(a.grad, b.grad, torch.float32, "dlogits")


def with_chunk(config, block_v):
    """``config`` with every loop over a row in chunks of ``block_v`` columns."""
    return dataclasses.replace(config, **{name: dataclasses.replace(getattr(config, name), block_v=block_v)
                                          for name in ("forward", "backward", "inplace")})


@pytest.mark.parametrize("opts", ["plain", "all"])
def test_forward_split_over_programs(opts, device):
    """Few rows of a wide vocabulary: the forward alone splits each row over programs (partial
    statistics, then a combine pass). Narrow spans give a row 20 parts, the last one partly
    masked; the separate backward then uses the combined lse."""
    config = with_chunk(ce_configs.DEFAULT_CONFIG, 1024)
    assert ce_configs.split_forward_parts(20000, 3, config) == (20, 1024)
    logits, target = make_case(3, 20000, torch.bfloat16, device, ignored=(0,))
    kwargs = dict(OPTIONS["all"], ignore_index=-100) if opts == "all" else {}
    for reduction in ("mean", "none"):
        check_ce(logits, target, reduction=reduction, config=config, **kwargs)
    bad = target.clone()
    bad[2] = 20000
    with pytest.raises(ValueError, match=r"target\[2\] = 20000 is outside"):
        lk.cross_entropy(logits, bad, config=config)


@pytest.mark.parametrize("opts", ["plain", "all"])
def test_inplace_rows_split_over_programs(opts, device):
    """The in-place pass over rows wider than one program: programs sharing a row hold their
    slices in registers (the logits are read once) and exchange the row's statistics. On a GPU
    1024-column slices give 20 parts a row, the last partly masked, and the -inf columns fill
    whole parts; the interpreter runs programs one after another, so there one holds the row."""
    block = 1024 if device == "cuda" else 32768
    config = dataclasses.replace(ce_configs.DEFAULT_CONFIG,
                                 split_inplace=dataclasses.replace(ce_configs.DEFAULT_CONFIG.split_inplace, block_v=block))
    m, v = (37, 20000) if device == "cuda" else (5, 20000)
    assert split_grid(v, m, block, torch.device(device))[0] == -(-v // block)
    logits, target = make_case(m, v, torch.bfloat16, device, ignored=(0,))
    kwargs = dict(OPTIONS["all"], ignore_index=-100) if opts == "all" else {}
    for reduction in ("mean", "none"):
        check_ce(logits, target, reduction=reduction, inplace=True, config=config, **kwargs)
    if opts == "plain":  # a masked vocabulary range (label smoothing would make the loss infinite)
        logits[:, 2048:5000] = float("-inf")
        target[(target >= 2048) & (target < 5000)] = 7
        check_ce(logits, target, inplace=True, config=config)
    bad = target.clone()
    bad[2] = v
    with pytest.raises(ValueError, match=r"target\[2\] = 20000 is outside"):
        lk.cross_entropy(logits.clone().requires_grad_(), bad, inplace_backward=True, config=config)


@pytest.mark.parametrize("m,v", [(64, 9000), (600, 9000), (8, 3000)])
def test_inplace_reads_the_target_logit_before_any_store(m, v, device):
    """In place, a program's threads read z[target] for the loss while others write the row's
    gradient over it: fp32 rows one program holds whole (the in-place split of one part a row,
    and the one-block kernel) must read it first. On an H100 the loss was 1e-3 to 4e-2 off in a
    third of the calls before; the same call repeated, against the default (out-of-place) path."""
    if device != "cuda" and v > 3000:
        pytest.skip("a race of a GPU's threads: the interpreter runs one program's lanes at once")
    logits, target = make_case(m, v, torch.float32, device)
    want = lk.cross_entropy(logits, target)
    for _ in range(6 if device == "cuda" else 1):
        leaf = logits.clone().requires_grad_()
        loss = lk.cross_entropy(leaf * 1, target, inplace_backward=True)
        loss.backward()
        assert_close(loss, want, torch.float32, "loss")


def test_forward_only_and_default_output(device):
    logits, target = make_case(17, 4099, torch.bfloat16, device)
    loss = lk.cross_entropy(logits, target)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    assert_close(loss, reference.cross_entropy(logits.double(), target, compute_dtype=torch.float64)[0],
                 torch.bfloat16, "loss")
    check_ce(logits, target, grad=False, z_loss=1e-3)
    out = lk.cross_entropy(logits, target, return_lse=True)
    assert out.z_loss is None and out.lse.shape == (17,)
    out = lk.cross_entropy(logits, target, return_z_loss=True)
    assert out.lse is None and out.z_loss.item() == 0.0


def test_inplace_overwrites_logits_with_gradient(device):
    logits, target = make_case(17, 4099, torch.float32, device)
    leaf = logits.clone().requires_grad_()
    loss = lk.cross_entropy(leaf, target, inplace_backward=True)
    ref = logits.double().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert_close(leaf.detach(), ref.grad, torch.float32, "logits after forward")
    loss.backward()  # upstream gradient exactly 1: the backward pass over the logits is skipped
    assert_close(leaf.grad, ref.grad, torch.float32, "dlogits")
    # Autograd refuses a backward that would read logits another op saved.
    x = logits.clone().requires_grad_()
    y = x.exp()  # saves its output
    loss = lk.cross_entropy(y, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_backward_twice(device):
    logits, target = make_case(5, 300, torch.float32, device)
    leaf = logits.clone().requires_grad_()
    loss = lk.cross_entropy(leaf, target)
    (a,) = torch.autograd.grad(loss, leaf, torch.tensor(2.0, device=device), retain_graph=True)
    (b,) = torch.autograd.grad(loss, leaf, torch.tensor(3.0, device=device))
    assert_close(b, a * 1.5, torch.float32, "second backward")
    loss = lk.cross_entropy(logits.clone().requires_grad_(), target, inplace_backward=True)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


@pytest.mark.parametrize("inplace", [False, True])
def test_strided_logits(inplace, device):
    big = torch.randn(9, 5000, device=device, dtype=torch.bfloat16) * 3
    target = torch.randint(0, 4099, (9,), device=device)
    view = big[:, 300:300 + 4099]  # row stride 5000, unit stride in V
    check_ce(view, target, inplace=inplace, label_smoothing=0.1)
    if inplace:
        leaf = big.clone().requires_grad_()
        loss = lk.cross_entropy(leaf[:, 300:300 + 4099], target, inplace_backward=True)
        loss.backward()
        assert torch.equal(leaf.detach()[:, :300], big[:, :300]), "columns outside the view were written"
    # Column-strided logits (a transposed tensor) are copied first.
    check_ce(torch.randn(1000, 6, device=device).t(), torch.randint(0, 1000, (6,), device=device), inplace=inplace)


def test_int32_target_and_extreme_logits(device):
    logits, target = make_case(6, 2000, torch.float32, device, ignored=())
    logits[0, :1500] = float("-inf")  # masked vocabulary entries
    logits[1] = logits[1] * 1000  # one class dominates: p -> onehot
    target[0] = 1700
    check_ce(logits, target.to(torch.int32), label_smoothing=0.0)


def test_all_ignored_and_empty(device):
    logits, _ = make_case(5, 700, torch.float32, device)
    target = torch.full((5,), -100, device=device)
    leaf = logits.clone().requires_grad_()
    loss = lk.cross_entropy(leaf, target)
    assert math.isnan(loss.item()) and math.isnan(F.cross_entropy(logits, target).item())
    (dx,) = torch.autograd.grad(lk.cross_entropy(leaf, target, reduction="sum"), leaf)
    assert torch.equal(dx, torch.zeros_like(dx))
    empty = torch.empty(0, 700, device=device)
    assert math.isnan(lk.cross_entropy(empty, target[:0]).item())
    assert lk.cross_entropy(empty, target[:0], reduction="sum").item() == 0.0
    assert lk.cross_entropy(empty, target[:0], reduction="none").shape == (0,)


def test_bad_target(device):
    logits, target = make_case(9, 1000, torch.bfloat16, device)
    for bad in (1000, -5):
        t = target.clone()
        t[4] = bad
        t[7] = 5000  # the first out-of-range row is the one named
        with pytest.raises(ValueError, match=rf"target\[4\] = {bad} is outside \[0, 1000\)"):
            lk.cross_entropy(logits, t)
        rows = lk.cross_entropy(logits, t, reduction="none", check_targets=False)
        good = (torch.arange(9, device=device) != 4) & (torch.arange(9, device=device) != 7)
        assert torch.isnan(rows[4]) and torch.isnan(rows[7]) and torch.isfinite(rows[good]).all()
    with pytest.raises(ValueError, match="outside"):
        lk.linear_cross_entropy(torch.randn(3, 8, device=device), torch.randn(10, 8, device=device),
                                torch.tensor([0, 10, 2], device=device))


def test_bad_arguments(device):
    logits, target = make_case(4, 50, torch.float32, device)
    cases = [
        (TypeError, "logits must be a floating-point", dict(logits=logits.long())),
        (ValueError, r"logits must have shape \[M, V\]", dict(logits=logits[0])),
        (ValueError, r"logits must have shape \[M, V\]", dict(logits=logits[:, :0])),
        (TypeError, "target must be int64 or int32", dict(target=target.float())),
        (ValueError, r"target must have shape \[4\]", dict(target=target[:3])),
        (TypeError, "target must be a torch.Tensor", dict(target=[0, 1, 2, 3])),
        (ValueError, "reduction must be one of", dict(reduction="avg")),
        (ValueError, "label_smoothing", dict(label_smoothing=1.5)),
        (ValueError, "z_loss", dict(z_loss=-1.0)),
        (ValueError, "softcap", dict(softcap=0.0)),
        (TypeError, "ignore_index", dict(ignore_index=1.0)),
    ]
    for exc, msg, kw in cases:
        args = dict(logits=logits, target=target) | kw
        with pytest.raises(exc, match=msg):
            lk.cross_entropy(args.pop("logits"), args.pop("target"), **args)


def test_config_covers_every_width():
    config = ce_configs.DEFAULT_CONFIG
    for v in [1, 7, 64, 1000, 4096, 8192, 8193, 32000, 128256, 262144]:
        block_m, block_v, num_warps, one_block = ce_configs.row_tiles(v, 4096, config.forward)
        assert block_v & (block_v - 1) == 0 and block_m & (block_m - 1) == 0
        assert (block_v >= v) if one_block else (v > config.one_block_max)  # one block holds the whole row
        assert block_m * block_v <= 16384 and 4 <= num_warps <= 32


# --------------------------------------------------------------------------------------------
# linear_cross_entropy
# --------------------------------------------------------------------------------------------
def check_lce(m, h, v, dtype, device, *, bias=True, reduction="mean", chunk_size=5, needs=(True, True, True),
              **opts):
    hidden = torch.randn(m, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) / h ** 0.5).to(dtype)
    b = (torch.randn(v, device=device) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, v, (m,), device=device)
    target[3] = opts.get("ignore_index", -100)
    tensors = [hidden, weight, b]
    leaves = [None if t is None else t.clone().requires_grad_(n) for t, n in zip(tensors, needs)]
    refs = [None if t is None else t.double().requires_grad_(n) for t, n in zip(tensors, needs)]
    out = lk.linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction, chunk_size=chunk_size,
                                  return_lse=True, **opts)
    opts.pop("accum_dtype", None)
    opts.pop("memory", None)
    ref_loss, _, ref_lse = reference.linear_cross_entropy(*refs[:2], target, refs[2], reduction=reduction,
                                                          compute_dtype=torch.float64, **opts)
    # The kernels round the logits to the input dtype before the loss (as the unfused path does).
    tol = dtype if dtype == torch.float32 else torch.bfloat16
    assert out.loss.dtype == torch.float32  # the LM loss is returned in fp32, as HF computes it
    assert_close(out.loss, ref_loss, tol, "loss")
    assert_close(out.lse, ref_lse, tol, "lse")
    g = upstream(out.loss)
    wrt = [(name, l, r) for name, l, r in zip(("dhidden", "dweight", "dbias"), leaves, refs)
           if l is not None and l.requires_grad]
    grads = torch.autograd.grad(out.loss, [l for _, l, _ in wrt], g)
    ref_grads = torch.autograd.grad(ref_loss, [r for _, _, r in wrt], g.double())
    for (name, leaf, _), got, want in zip(wrt, grads, ref_grads):
        assert got.dtype == leaf.dtype
        assert_close(got, want, tol, name)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_reference(bias, dtype, reduction, device):
    check_lce(17, 48, 1100, dtype, device, bias=bias, reduction=reduction)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator statistics need CUDA")
def test_linear_forward_peak_memory():
    """One [chunk, V] block of logits at a time: the forward's peak above its inputs is the fp32
    weight-gradient accumulator plus one block (larger than the bf16 weight gradient formed
    after the loop) and small buffers; a fresh product per chunk once kept two blocks alive."""
    m, h, v, chunk = 256, 64, 50000, 128
    hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (m,), device="cuda")
    lk.linear_cross_entropy(hidden, weight, target, chunk_size=chunk)  # warm-up: kernels, cuBLAS workspace
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lk.linear_cross_entropy(hidden, weight, target, chunk_size=chunk)
    peak = torch.cuda.max_memory_allocated() - base
    block, accumulator = chunk * v * 2, v * h * 4
    assert block > v * h * 2  # so that two blocks alive would exceed the bound
    assert peak <= accumulator + block + m * h * 2 + 2**20, f"peak {peak} B"
    loss.backward()


@pytest.mark.parametrize("opts", list(OPTIONS), ids=str)
def test_linear_options(opts, device):
    check_lce(9, 32, 1100, torch.float32, device, chunk_size=4, **OPTIONS[opts])


def test_linear_partial_grads_and_accumulation(device):
    # Frozen weight (only dhidden), frozen hidden (only dweight, dbias), one chunk, and
    # accumulation in the weight's own dtype.
    check_lce(17, 32, 700, torch.float32, device, needs=(True, False, False))
    check_lce(17, 32, 700, torch.float32, device, needs=(False, True, True), chunk_size=None)
    check_lce(17, 32, 700, torch.bfloat16, device, accum_dtype=None, reduction="sum")


def test_linear_chunk_rows():
    cpu = torch.device("cpu")
    assert lce_ops.rows_per_chunk(16384, 128256, 2, cpu, None) == 2048
    assert lce_ops.rows_per_chunk(5000, 128256, 2, cpu, None) == 1667  # 3 even chunks, not 2048 + 2048 + 904
    assert lce_ops.rows_per_chunk(100, 1000, 2, cpu, None) == 100
    assert lce_ops.rows_per_chunk(100, 1000, 2, cpu, 7) == 7


def test_linear_bad_arguments(device):
    h, w = torch.randn(4, 8, device=device), torch.randn(10, 8, device=device)
    t = torch.zeros(4, dtype=torch.long, device=device)
    cases = [
        (ValueError, r"hidden must have shape \[M, H\]", (h[0], w, t), {}),
        (ValueError, r"weight must have shape \[V, H\]", (h, w[:, :4], t), {}),
        (TypeError, "weight dtype", (h, w.double(), t), {}),
        (ValueError, r"bias must have shape \[10\]", (h, w, t), dict(bias=torch.randn(9, device=device))),
        (ValueError, r"target must have shape \[4\]", (h, w, t[:2]), {}),
        (ValueError, "chunk_size", (h, w, t), dict(chunk_size=0)),
        (ValueError, "accum_dtype", (h, w, t), dict(accum_dtype=torch.bfloat16)),
        (ValueError, "reduction", (h, w, t), dict(reduction="max")),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            lk.linear_cross_entropy(*args, **kw)


def test_linear_backward_twice_raises(device):
    h = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    loss = lk.linear_cross_entropy(h, w, torch.randint(0, 20, (6,), device=device), chunk_size=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


# --------------------------------------------------------------------------------------------
# linear_cross_entropy(memory="low"): hidden gradient over row chunks, weight gradient over
# vocabulary chunks (chunk_size 5 of 17 rows: 4 row chunks and 4 column chunks of V = 1100)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_low_memory_matches_reference(dtype, reduction, device):
    check_lce(17, 48, 1100, dtype, device, reduction=reduction, memory="low")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_low_memory_options_and_partial_grads(reduction, device):
    check_lce(9, 32, 1100, torch.float32, device, chunk_size=4, reduction=reduction, memory="low", **OPTIONS["all"])
    check_lce(17, 32, 700, torch.float32, device, reduction=reduction, memory="low", needs=(True, False, False))
    check_lce(17, 32, 700, torch.bfloat16, device, reduction=reduction, memory="low", needs=(False, True, True),
              chunk_size=None)
    with pytest.raises(ValueError, match="memory must be one of"):
        lk.linear_cross_entropy(torch.randn(3, 8, device=device), torch.randn(10, 8, device=device),
                                torch.zeros(3, dtype=torch.long, device=device), memory="small")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator statistics need CUDA")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_low_memory_peak(reduction):
    """memory="low": forward + backward hold the gradients and one chunk of logits (no [V, H]
    fp32 accumulator, no second chunk)."""
    m, h, v, chunk = 256, 64, 50000, 16
    hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (m,), device="cuda")
    peak = cuda_peak_bytes(lambda: lk.linear_cross_entropy(hidden, weight, target, chunk_size=chunk, memory="low",
                                                           reduction=reduction).sum().backward(), (hidden, weight))
    grads, block = (m + v) * h * 2, chunk * v * 2
    assert block < v * h * 4  # an fp32 accumulator would exceed the bound
    assert peak <= grads + block + 2**20, f"peak {peak} B"


# --------------------------------------------------------------------------------------------
# torch.compile (custom ops, classic backward)
# --------------------------------------------------------------------------------------------
BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph(reduction, device, fresh_dynamo):
    logits, target = make_case(9, 3000, torch.bfloat16, device)
    hidden = torch.randn(9, 16, device=device)
    weight = torch.randn(300, 16, device=device) / 4
    t2 = target.clamp(0, 299)

    def step(x, h, w):
        a = lk.cross_entropy(x, target, reduction=reduction, softcap=20.0, z_loss=1e-3, return_lse=True)
        b = lk.linear_cross_entropy(h, w, t2, reduction=reduction, chunk_size=4, label_smoothing=0.1)
        return a.loss.float().sum() + b.sum(), a.lse

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    results = []
    for fn in (step, compiled):
        leaves = [t.clone().requires_grad_() for t in (logits, hidden, weight)]
        loss, lse = fn(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        results.append((loss, lse, grads))
    (loss_e, lse_e, grads_e), (loss_c, lse_c, grads_c) = results
    assert_close(loss_c, loss_e, torch.bfloat16, "compiled loss")
    assert_close(lse_c, lse_e, torch.float32, "compiled lse")
    for name, got, want in zip(("dlogits", "dhidden", "dweight"), grads_c, grads_e):
        assert_close(got, want, torch.bfloat16 if name == "dlogits" else torch.float32, name)


def test_opcheck(device):
    logits, target = make_case(5, 300, torch.float32, device)
    options = ce_ops.CrossEntropyOptions(RowLoss(ignore_index=-100, smoothing=0.1, z_coef=1e-3, softcap=None),
                                         reduction="mean", want_z=True, check=True)
    torch.library.opcheck(ce_ops.CE.op, (logits.requires_grad_(), target, *flat_fields(options)))
    h = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    options = lce_ops.LinearCrossEntropyOptions(RowLoss(ignore_index=-100, smoothing=0.0, z_coef=0.0, softcap=3.0),
                                                reduction="sum", want_z=False, check=True, chunk_size=4,
                                                accum_dtype=torch.float32, need=[True, True, False], memory="fast")
    torch.library.opcheck(lce_ops.LCE.op, (h, w, torch.randint(0, 20, (6,), device=device), None,
                                           *flat_fields(options)))



def test_target_check_falls_back_to_a_device_word(monkeypatch):
    """On a GPU the check kernel writes a pinned host word directly; where Triton refuses host
    memory (ValueError), it writes a device word copied back instead, from then on. (On CPU the
    words are plain tensors and the kernel a fake writing row 3 as the first bad one.)"""
    host = torch.zeros(1, dtype=torch.int64)
    monkeypatch.setattr(targets._FLAG, "word", lambda pinned: host)
    monkeypatch.setattr(targets, "MAPPED_FLAG", True)
    seen = []

    def check(grid, target, word, m, v, ignore_index):
        seen.append(word is host)
        if word is host and len(seen) == 1:
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        word.fill_(4)

    target = torch.tensor([1, 2, 3, 99])
    for _ in range(2):
        assert targets._check_to_host(check, target, 10, -100).item() == 4
    assert seen == [True, False, False] and not targets.MAPPED_FLAG
    monkeypatch.setattr(targets, "MAPPED_FLAG", True)
    assert targets._check_to_host(check, target, 10, -100) is host
