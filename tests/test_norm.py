"""RMSNorm / LayerNorm kernels against the float64 reference: every shape class, dtype, option
and gradient; outputs poisoned with NaN before the kernels write them."""
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import llmkernels as lk
from llmkernels import reference
from llmkernels.ops import _device, _rowsplit
from llmkernels.ops.norm import launchers
from llmkernels.ops.norm import (BACKWARD, BWD_PLANS, FORWARD, FWD_PLANS, BwdConfig, FwdConfig, NormConfig, NormKey,
                                 NormOptions, SplitBwdConfig, SplitFwdConfig, backward_config, check_config,
                                 forward_config, norm_fwd)
from llmkernels.ops.norm.tables import (BWD_ONE_PASS_MAX, DECODE_PROGRAMS, FWD_ONE_PASS_MAX, WARP, below_power_of_two,
                                        five_eighths, fp16)
from tests.conftest import INTERPRETED
from llmkernels.testing import poisoned
from tests.helpers import REL_TOL, assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def _tol_dtype(*dtypes):
    """The least precise of the dtypes involved sets the tolerance."""
    return max((d for d in dtypes if d is not None), key=lambda d: REL_TOL[d])


def _leaf(t):
    """A leaf copy of ``t`` with its strides, so that a sliced or transposed input stays one."""
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return leaf.copy_(t.detach()).requires_grad_(True)


def check_norm(is_rms, x, weight=None, bias=None, residual=None, *, prenorm=False, config=None, **opts):
    """Run the kernel (with the launch ``config``) and the float64 reference on the same leaves;
    compare y (and h), then every gradient for random upstream gradients."""
    fn, ref_fn = (lk.rms_norm, reference.rms_norm) if is_rms else (lk.layer_norm, reference.layer_norm)
    leaves = {k: _leaf(v) for k, v in dict(x=x, weight=weight, bias=bias, residual=residual).items() if v is not None}
    ref_leaves = {k: _leaf(v) for k, v in leaves.items()}
    out = fn(leaves["x"], leaves.get("weight"), leaves.get("bias"), residual=leaves.get("residual"),
             prenorm=prenorm, config=config, **opts)
    ref_opts = dict(opts)
    ref_opts.setdefault("out_dtype", out[0].dtype if prenorm else out.dtype)
    ref = ref_fn(ref_leaves["x"], ref_leaves.get("weight"), ref_leaves.get("bias"),
                 residual=ref_leaves.get("residual"), prenorm=prenorm, compute_dtype=torch.float64, **ref_opts)
    outs = out if prenorm else (out,)
    refs = ref if prenorm else (ref,)
    tol = _tol_dtype(x.dtype, None if residual is None else residual.dtype, outs[0].dtype)
    for name, o, r in zip(("y", "h"), outs, refs):
        assert o.dtype == r.dtype, f"{name}: dtype {o.dtype} != reference {r.dtype}"
        assert_close(o, r, tol, name)
    if x.shape[:-1].numel() == 0:
        return
    grads_out = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads_out)
    torch.autograd.backward(refs, grads_out)
    # Gradients that are zero up to rounding (dx when N == 1) are judged against the scale of
    # the upstream gradient instead of their own norm.
    floor = 1e-3 * sum(g.double().norm().item() for g in grads_out)
    for k in leaves:
        assert leaves[k].grad is not None, f"no gradient for {k}"
        assert leaves[k].grad.dtype == leaves[k].dtype
        assert_close(leaves[k].grad, ref_leaves[k].grad, _tol_dtype(tol, leaves[k].dtype), f"d{k}", floor=floor)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 4096, 5120])
@pytest.mark.parametrize("m", [0, 1, 3, 257])
def test_shapes(is_rms, m, n, device):
    dtype = DTYPES[(m + n) % 3]
    x = torch.randn(m, n, device=device, dtype=dtype) * 2 + 0.5
    w = torch.randn(n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype) if not is_rms else None
    check_norm(is_rms, x, w, b)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_dtypes_weight_bias(is_rms, dtype, w_dtype, device):
    x = torch.randn(5, 3, 96, device=device, dtype=dtype)
    w = torch.randn(96, device=device, dtype=w_dtype)
    b = torch.randn(96, device=device, dtype=w_dtype)
    check_norm(is_rms, x, w, b)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_casting(is_rms, casting, dtype, device):
    x = torch.randn(4, 2, 200, device=device, dtype=dtype)
    w = torch.randn(200, device=device, dtype=torch.float32) * 0.1
    check_norm(is_rms, x, w, casting=casting)
    check_norm(is_rms, x, w, casting=casting, weight_offset=0.5, out_dtype=torch.float32)


@pytest.mark.parametrize("shape", [(9, 130), (40, 8, 129)])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_no_weight_and_bias_only(is_rms, shape, device):
    """Without a weight (and bias) the backward has no dW / dB partials to sum: at 320 rows its
    programs are several, the plan must not launch the sums with absent pointers."""
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    check_norm(is_rms, x)
    assert all(plan.sums is None for key, plan in BWD_PLANS.items()
               if key.w_dtype is None and key.options.bias_dtype is None)
    check_norm(is_rms, x, None, torch.randn(shape[-1], device=device))


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("residual_in_fp32", [True, False])
@pytest.mark.parametrize("res_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_residual(is_rms, prenorm, residual_in_fp32, res_dtype, device):
    x = torch.randn(2, 17, 384, device=device, dtype=torch.bfloat16)
    res = torch.randn(2, 17, 384, device=device, dtype=res_dtype)
    w = torch.randn(384, device=device)
    b = None if is_rms else torch.randn(384, device=device)
    check_norm(is_rms, x, w, b, res, prenorm=prenorm, residual_in_fp32=residual_in_fp32)


def test_prenorm_without_residual_returns_input(device):
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    y, h = lk.rms_norm(x, torch.randn(64, device=device), prenorm=True)
    assert h is x
    _, h32 = lk.rms_norm(x, torch.randn(64, device=device), prenorm=True, residual_in_fp32=True)
    assert h32.dtype == torch.float32 and torch.equal(h32, x.float())


def test_residual_h_is_exact_sum(device):
    """h = x + residual rounded once to its dtype, to nearest even."""
    x = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    r = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    _, h = lk.rms_norm(x, torch.ones(512, device=device), residual=r, prenorm=True)
    assert torch.equal(h, (x.float() + r.float()).to(torch.bfloat16))


def test_residual_grads_do_not_alias(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    y, h = lk.rms_norm(x, torch.ones(64, device=device), residual=r, prenorm=True)
    (y.float().sum() + h.float().sum()).backward()
    assert torch.equal(x.grad, r.grad)
    x.grad.add_(1.0)
    assert not torch.equal(x.grad, r.grad), "x.grad and residual.grad share storage"


# Each width with one dtype (every dtype once over the widths); the other six pairs in the slow run.
WIDE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WIDE = [pytest.param(dtype, n, id=f"{dtype}-{n}", marks=[] if i == j else [pytest.mark.slow])
        for i, n in enumerate([40001, 65536, 70001]) for j, dtype in enumerate(WIDE_DTYPES)]


@pytest.mark.parametrize("dtype,n", WIDE)
@pytest.mark.parametrize("split", [True, False], ids=["split", "blocked"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_wide_rows(is_rms, dtype, split, n, device):
    """Rows wider than the one-pass limits, with and without a residual: forward and backward split
    across programs (on a GPU; the interpreter cannot run programs that wait for each other; the
    forward where the table has a split entry) or blocked (the tables' choice where the row may
    not split: in half chunks up to 49152 for 2-byte rows). 65536 fills whole slices of every
    split, 40001 and 70001 leave the last one partly masked."""
    if split and INTERPRETED:
        pytest.skip("a row split over several programs needs them to run concurrently (GPU)")

    def blocked(residual):
        key = NormKey(is_rms, dtype, residual, n, 3, split=False)
        return None if split else NormConfig(forward_config(key), backward_config(key))

    assert n > FWD_ONE_PASS_MAX and n > BWD_ONE_PASS_MAX
    x = torch.randn(3, n, device=device, dtype=dtype) + 3.0  # |mean| > std: exercises the shifted variance
    res = torch.randn(3, n, device=device, dtype=dtype)
    w = torch.randn(n, device=device)
    b = None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b, res, prenorm=True, config=blocked(True))
    check_norm(is_rms, x, w, b, config=blocked(False))


@pytest.mark.parametrize("n", [20480, 28672, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_split_below_one_pass_max(is_rms, dtype, n, device):
    """Rows of 16385-32768 that take the split forward (on a GPU; the one-pass kernel under the
    interpreter): 2-byte rows that do not fill their power of two, every fp32 LayerNorm row.
    20480 and 28672 do not fill whole 8192-column slices: 2-byte rows take 4096-column ones,
    fp32 rows a partly masked last."""
    split = isinstance(forward_config(NormKey(is_rms, dtype, False, n, 3, sms=132)), SplitFwdConfig)
    assert (not split) == (n == 32768 and dtype == torch.bfloat16 or is_rms and dtype == torch.float32)
    x = torch.randn(3, n, device=device, dtype=dtype) + 3.0
    check_norm(is_rms, x, torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device))


@pytest.mark.parametrize("n", [4353, 5120, 9216, 10240, 12288])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_forward_tail(is_rms, dtype, n, device):
    """Rows of 4353-6144 and 8705-12288 columns: the one-pass forward takes half their power of
    two whole and the rest as a masked power-of-two tail (300 rows: the bandwidth path, not the
    decode rule). The interpreter runs the forced case below."""
    cfg = forward_config(NormKey(is_rms, dtype, False, n, 300, sms=132))
    assert cfg.block_n < n <= cfg.block_n + cfg.tail_n
    if INTERPRETED:
        pytest.skip("300 rows of these widths take minutes under the interpreter")
    x = torch.randn(300, n, device=device, dtype=dtype) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)


@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("n", [80, 96])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_forward_tail_forced(is_rms, n, block_m, device):
    """The forward's tail at a small width: 64 columns whole and a tail of 32 (the last 16 masked
    at 80), one or two rows a tile (5 rows: the last tile half empty), with and without the
    residual add."""
    config = NormConfig(forward=FwdConfig(block_m, 64, 4, tail_n=32))
    x = torch.randn(5, n, device=device) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b, config=config)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_norm_offset_rows(dtype, device):
    """One-pass LayerNorm (rows that fit in registers) on rows whose mean is far from their
    spread: the variance comes from sums shifted by the row's first element. (With a bf16
    residual stream at |h| ~ 20 one bf16 ulp is 0.125, and Triton's interpreter rounds float32 to
    bfloat16 differently from torch, so the residual case runs in float32.)"""
    x = torch.randn(6, 3000, device=device, dtype=dtype) * 0.5 + 20.0
    w, b = torch.randn(3000, device=device), torch.randn(3000, device=device)
    check_norm(False, x, w, b)
    if dtype == torch.float32:
        check_norm(False, x, w, b, torch.randn_like(x), prenorm=True)


FAR_MEAN_PATHS = {  # every forward path at a width of 100, one at a time
    "one_pass": None, "tail": FwdConfig(2, 64, 4, tail_n=64), "blocked": FwdConfig(2, 32, 4, one_pass=False),
    "split": SplitFwdConfig(128, 4, 1, 0), "split_pipelined": SplitFwdConfig(128, 4, 2, 3)}


@pytest.mark.parametrize("path", FAR_MEAN_PATHS)
@pytest.mark.parametrize("offset", [1e3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["x", "residual"])
def test_layer_norm_mean_far_above_spread(where, dtype, offset, path, device):
    """LayerNorm on rows whose mean is far larger than their spread, the offset in x or in the
    fused residual, on every forward path: the variance comes from sums shifted by the first
    element of h = x + residual and y from the shifted values, so y keeps the dtype's precision
    against the norm of the h the kernel formed. The backward reads the saved fp32 mean, whose
    rounding (half an ulp of the offset) bounds x_hat's accuracy as in PyTorch's own kernels: the
    gradients' tolerance adds that term. bf16 rows keep a spread of a few ulps of the offset; their
    residual stream is fp32 (Triton's interpreter rounds a float32 sum to bf16 otherwise than
    torch)."""
    spread = 1e-2 if dtype == torch.float32 else offset / 64
    big = offset + spread * torch.randn(6, 100, device=device)
    small = spread * torch.randn(6, 100, device=device)
    x, res = ((big, small) if where == "x" else (small, big))
    leaves = [t.to(dtype).requires_grad_() for t in (x, res)] + [torch.randn(100, device=device).requires_grad_()
                                                                  for _ in range(2)]
    config = None if FAR_MEAN_PATHS[path] is None else NormConfig(forward=FAR_MEAN_PATHS[path])
    y, h = lk.layer_norm(leaves[0], *leaves[2:], residual=leaves[1], prenorm=True, config=config,
                         residual_in_fp32=dtype != torch.float32)
    assert_close(h, leaves[0].double() + leaves[1].double(), h.dtype, "h")
    ref_leaves = [t.detach().double().requires_grad_() for t in (h, *leaves[2:])]
    ref = F.layer_norm(*ref_leaves[:1], (100,), *ref_leaves[1:], eps=1e-5)
    assert_close(y, ref, dtype, "y")
    dy = torch.randn_like(ref)
    y.backward(dy.to(y.dtype))
    ref.backward(dy)
    mean_rounding = 2.0**-24 * offset / spread
    scale = 1 + 4 * mean_rounding / REL_TOL[dtype]
    for name, leaf, ref_grad in zip(("dx", "dresidual", "dw", "db"), leaves, [ref_leaves[0].grad, *(
            r.grad for r in ref_leaves)]):
        assert_close(leaf.grad, ref_grad, dtype, name, scale=scale)


# (forward programs per SM, forward stages, backward stages, backward weight kept packed)
SPLIT_MODES = {"lockstep": (1, 0, 0, False), "pipelined": (2, 3, 3, True)}


@pytest.mark.parametrize("mode", SPLIT_MODES)
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_split_path_forced(is_rms, dtype, parts, mode, device):
    """The split forward and backward at a small width: one part per row (also under the
    interpreter) or four, the last one partly masked; more rows than groups in flight; the
    forward one or two programs an SM, its slices read again or its loads pipelined; the
    backward's exchange in step with the row or a row ahead with the loads pipelined."""
    if parts > 1 and INTERPRETED:
        pytest.skip("a row split over several programs needs them to run concurrently (GPU)")
    n = 100
    fwd_per_sm, fwd_stages, bwd_stages, bwd_w_packed = SPLIT_MODES[mode]
    config = NormConfig(SplitFwdConfig(128 // parts, 4, fwd_per_sm, fwd_stages),
                        SplitBwdConfig(128 // parts, 4, bwd_stages, bwd_w_packed))
    split_parts, groups = _rowsplit.split_grid(n, 2**20, 128 // parts, torch.device(device))
    assert split_parts == parts
    x = torch.randn(3, groups + 1, n, device=device, dtype=dtype) + 2.0  # 3 (groups + 1) rows: the last
    res = torch.randn_like(x)                                            # round of groups partly filled
    check_norm(is_rms, x, torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device),
               res, prenorm=True, config=config)
    check_norm(is_rms, x[:1, :3], torch.randn(n, device=device, dtype=dtype), casting="gemma", config=config)


@pytest.mark.parametrize("tma, lag", [(True, 1), (False, 2), (True, 2)], ids=["tma", "lag2", "tma-lag2"])
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_split_forward_wide_row_candidates(is_rms, dtype, parts, tma, lag, device, monkeypatch):
    """The pipelined split forward reading x through a tensor descriptor made on the host (TMA on
    a GPU) and / or writing y two rows behind the row it loads: one part per row (also under the
    interpreter) or four, the last partly masked; more rows than groups in flight, fewer, and one;
    with and without a residual. With TMA, rows that do not start on 16 bytes are read without it."""
    if parts > 1 and INTERPRETED:
        pytest.skip("a row split over several programs needs them to run concurrently (GPU)")
    n = 232  # 16-byte rows in bf16 and fp32; slices of 64 columns or more (128 bytes in bf16)
    config = NormConfig(forward=SplitFwdConfig(256 // parts, 4, 2, 3, tma=tma, lag=lag))
    split_parts, groups = _rowsplit.split_grid(n, 2**20, 256 // parts, torch.device(device), 2)
    assert split_parts == parts
    x = torch.randn(2, groups + 1, n, device=device, dtype=dtype) + 2.0
    check_norm(is_rms, x, torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device),
               torch.randn_like(x), prenorm=True, config=config)
    check_norm(is_rms, x[:, :3], torch.randn(n, device=device, dtype=dtype), config=config)
    check_norm(is_rms, x[:1, :1], torch.randn(n, device=device, dtype=dtype), config=config)
    if tma:
        real, made = launchers.TensorDescriptor, []
        monkeypatch.setattr(launchers, "TensorDescriptor", lambda *args: made.append(args[0].stride(0)) or real(*args))
        check_norm(is_rms, torch.randn(4, n + 1, device=device, dtype=dtype)[:, :n],
                   torch.randn(n, device=device, dtype=dtype), config=config)
        assert made == []  # a row stride of n + 1 elements is not a multiple of 16 bytes
        check_norm(is_rms, x[0], torch.randn(n, device=device, dtype=dtype), config=config)
        assert made and set(made) == {n}


def test_split_forward_tuned_tma_read_where_it_cannot_run(monkeypatch, device):
    """A tuned cache's or the table's TMA read where it cannot run here, a slice short of 128
    bytes, a Triton without tensor descriptors or a GPU older than Hopper, is read without TMA,
    not refused: only a caller's own config is refused."""
    w = torch.randn(32, device=device)
    monkeypatch.setattr(launchers, "forward_config", lambda key, tuned=None: SplitFwdConfig(32, 4, 2, 3, tma=True))
    FWD_PLANS.clear()
    try:
        check_norm(True, torch.randn(4, 32, device=device, dtype=torch.bfloat16) + 2.0, w)  # 64-byte slices
        monkeypatch.setattr(launchers, "TensorDescriptor", None)
        check_norm(True, torch.randn(8, 32, device=device) + 2.0, w)
        assert FWD_PLANS and all(plan.tma_block == 0 for plan in FWD_PLANS.values())
        FWD_PLANS.clear()
        monkeypatch.undo()
        monkeypatch.setattr(launchers, "forward_config", lambda key, tuned=None: SplitFwdConfig(32, 4, 2, 3, tma=True))
        monkeypatch.setattr(launchers, "has_tma", lambda index: False)  # a GPU older than Hopper
        check_norm(True, torch.randn(8, 32, device=device) + 2.0, w)
        assert FWD_PLANS and all(plan.tma_block == 0 for plan in FWD_PLANS.values())
    finally:
        FWD_PLANS.clear()


def test_split_forward_tma_refuses_slices_short_of_128_bytes(device):
    """TMA copies each pipelined slice into a shared-memory buffer that must start on 128 bytes: a
    slice of 32 bf16 columns (64 bytes) is refused naming config before anything launches; 32
    fp32 columns (128 bytes) run."""
    config = NormConfig(forward=SplitFwdConfig(32, 4, 2, 3, tma=True))
    w = torch.randn(32, device=device)
    with pytest.raises(ValueError, match="config .*TMA slice of 32 torch.bfloat16 .*128 bytes"):
        lk.rms_norm(torch.randn(4, 32, device=device, dtype=torch.bfloat16), w, config=config)
    check_norm(True, torch.randn(4, 32, device=device) + 2.0, w, config=config)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_blocked_path_forced(is_rms, device):
    """The blocked kernels at a small width (32-column chunks, 2 rows a tile), with several rows
    per head."""
    config = NormConfig(FwdConfig(2, 32, 4, one_pass=False), BwdConfig(2, 32, 4, one_pass=False, per_sm=2))
    x = torch.randn(2, 5, 3, 100, device=device, dtype=torch.float32)
    check_norm(is_rms, x, torch.randn(100, device=device), torch.randn(100, device=device), config=config)
    check_norm(is_rms, x, torch.randn(3, 100, device=device), torch.randn(3, 100, device=device), config=config)


def _ragged_entries():
    """(entry, RMSNorm?, bytes per element, power of two) of each backward entry for rows between
    two powers of two."""
    for entry in BACKWARD.entries:
        if {five_eighths, below_power_of_two} & set(entry.when):
            for is_rms, elem_size, width in itertools.product(entry.kinds, entry.elem_sizes, (4096, 8192)):
                if entry.widths[0] <= width <= entry.widths[1]:
                    yield entry, is_rms, elem_size, width


def _tiles(cfg):
    """(tile elements, warps, programs an SM, prefetch) of a backward configuration or rule."""
    if isinstance(cfg, BwdConfig):
        return cfg.block_m * cfg.block_n, cfg.num_warps, cfg.per_sm, cfg.prefetch
    return cfg.tile, cfg.num_warps, cfg.per_sm, cfg.prefetch


@pytest.mark.parametrize("case", list(_ragged_entries()),
                         ids=lambda c: f"{'rms' if c[1] else 'layer'}-{c[2]}B-{c[3]}")
def test_backward_ragged_entries(case, device):
    """Each entry for rows between two powers of two: taken for the widest row it covers (in
    eighths of the power, at most 7/8), not for the power of two itself; on a GPU, that row's
    backward (300 rows: the bandwidth path), with the residual add for RMSNorm."""
    entry, is_rms, elem_size, width = case
    dtype = torch.float32 if elem_size == 4 else torch.bfloat16

    def key(n):
        return NormKey(is_rms, dtype, False, n, 300, sms=132)

    n = max(width * k // 8 for k in range(5, 8) if BACKWARD.entry(key(width * k // 8)) is entry)
    cfg = backward_config(key(n))
    assert _tiles(cfg) == _tiles(entry.config) and cfg.block_n == width
    power = BACKWARD.entry(key(width))
    assert power is not entry and _tiles(backward_config(key(width))) == _tiles(power.config)
    if INTERPRETED:
        pytest.skip("300 rows of thousands of columns take minutes under the interpreter")
    x = torch.randn(300, n, device=device, dtype=dtype) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)
    if is_rms:
        check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True)


@pytest.mark.parametrize("n", [8200, 10240, 12288])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_tail(is_rms, n, device):
    """2-byte rows of 8193-12288: the one-pass backward takes 8192 columns whole and a tail (of 8
    columns at 8200), LayerNorm's as well (not its split backward); 300 rows (not the decode
    rule). The interpreter runs the forced case (test_backward_tail_forced)."""
    cfg = backward_config(NormKey(is_rms, torch.bfloat16, False, n, 300, sms=132))
    assert cfg.one_pass and cfg.block_n == 8192 and cfg.block_n < n <= cfg.block_n + cfg.tail_n
    assert not cfg.max_programs
    if INTERPRETED:
        pytest.skip("300 rows of these widths take minutes under the interpreter")
    x = torch.randn(300, n, device=device, dtype=torch.bfloat16) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True)


@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=["load", "prefetch", "pipelined"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_tiles_with_and_without_prefetch(is_rms, prefetch, device):
    """The one-pass backward with 2-row tiles, several a program and a last one half full (the
    prefetch then reads nothing past the last row), per-head weights and a residual too; loads
    in the loop, the next tile into registers, or the loop pipelined by Triton in 3 stages."""
    config = NormConfig(backward=BwdConfig(2, 128, 4, max_programs=3, prefetch=prefetch))  # 3 programs, 2 x 128
    x = torch.randn(5, 3, 100, device=device, dtype=torch.bfloat16)
    check_norm(is_rms, x, torch.randn(100, device=device), torch.randn(100, device=device), config=config)
    check_norm(is_rms, x, torch.randn(3, 100, device=device), None, torch.randn_like(x), prenorm=True, config=config)


@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=["load", "prefetch", "pipelined"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_tail_forced(is_rms, prefetch, device):
    """The one-pass backward with a tail: 64 columns whole and 32 more (the last 16 masked), 2-row
    tiles, 3 programs, the last tile half full; loads in the loop, the next tile into registers,
    or pipelined; with the residual's gradient too."""
    config = NormConfig(backward=BwdConfig(2, 64, 4, max_programs=3, prefetch=prefetch, tail_n=32))
    x = torch.randn(5, 80, device=device) + 3.0
    w, b = torch.randn(80, device=device), None if is_rms else torch.randn(80, device=device)
    check_norm(is_rms, x, w, b, config=config)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True, config=config)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_decode_writes_dw_by_columns(is_rms, device):
    """Decode sizes: each backward program also writes dW / dB of its share of the columns over
    every row (DW_COLS), no partials. On a GPU as the decode rule launches it (rows of 4096 and
    3000 columns, 1 ... 256 rows; a residual too); under the interpreter three programs of three
    rows, 128 columns each of a 300-column row (the last share partly masked)."""
    config = NormConfig()
    if INTERPRETED:
        config = NormConfig(backward=BwdConfig(1, 512, 4, max_programs=3))
        shapes = [(9, 300)]
    else:
        shapes = [(m, n) for n in (4096, 3000) for m in (1, 8, 37, 256)]
    BWD_PLANS.clear()  # so that it holds the plans of these backwards alone
    for m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        check_norm(is_rms, x, torch.randn(n, device=device, dtype=torch.bfloat16),
                   None if is_rms else torch.randn(n, device=device, dtype=torch.bfloat16), config=config)
        check_norm(is_rms, x, torch.randn(n, device=device, dtype=torch.bfloat16), None, torch.randn_like(x),
                   prenorm=True, config=config)
    assert max(plan.launch.options.get("DW_COLS", 0) for plan in BWD_PLANS.values()) > 0


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_per_head_weight(is_rms, device):
    """QK norm: weight [H, D] over x [..., H, D], each head its own scale."""
    x = torch.randn(2, 5, 4, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, 32, device=device)
    b = torch.randn(4, 32, device=device)
    check_norm(is_rms, x, w, b)
    check_norm(is_rms, x, w, b, casting="gemma")


@pytest.mark.parametrize("blocked", [False, True], ids=["one_pass", "blocked"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_per_head_weight_with_residual(is_rms, blocked, device):
    """Per-head weights with a fused residual (fp32 residual stream), on both kernel paths (per-head
    weights never take the row split; blocked: 8-column chunks forward, 16 backward, 2-row tiles)."""
    config = NormConfig(FwdConfig(2, 8, 4, one_pass=False), BwdConfig(2, 16, 4, one_pass=False, per_sm=2))
    x = torch.randn(2, 5, 4, 32, device=device, dtype=torch.bfloat16)
    res = torch.randn(2, 5, 4, 32, device=device, dtype=torch.float32)
    check_norm(is_rms, x, torch.randn(4, 32, device=device), torch.randn(4, 32, device=device), res, prenorm=True,
               residual_in_fp32=True, config=config if blocked else None)


def test_shared_head_weight(device):
    """Qwen3-style QK norm: weight [D] shared by every head of x [B, S, H, D]."""
    x = torch.randn(2, 7, 8, 64, device=device, dtype=torch.bfloat16)
    check_norm(True, x, torch.randn(64, device=device))


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_strided_rows(is_rms, device):
    """A slice of a bigger tensor (e.g. of a fused projection): rows with a stride, no copy."""
    big = torch.randn(6, 4, 3 * 160, device=device, dtype=torch.bfloat16)
    x = big[..., 160:320]
    assert not x.is_contiguous()
    res_big = torch.randn(6, 4, 2 * 160, device=device, dtype=torch.bfloat16)
    check_norm(is_rms, x, torch.randn(160, device=device), torch.randn(160, device=device), res_big[..., :160],
               prenorm=True)
    check_norm(is_rms, x.transpose(0, 1), torch.randn(160, device=device))  # leading dims that don't merge


def test_4d_input(device):
    x = torch.randn(2, 3, 4, 48, device=device, dtype=torch.float16)
    check_norm(True, x, torch.randn(48, device=device, dtype=torch.float16))
    check_norm(False, x, torch.randn(48, device=device), torch.randn(48, device=device))


def test_no_grad_inference(device):
    x = torch.randn(3, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = lk.rms_norm(x, w)
    assert_close(y, reference.rms_norm(x, w, compute_dtype=torch.float64, out_dtype=torch.bfloat16),
                 torch.bfloat16, "y")


def test_matches_hf_llama_and_gemma(device):
    """HF-exact casting. The row sum runs in another order than torch's, so rstd may differ by
    an fp32 ulp and flip the rounding of a rare output element: on the GPU at most 1 in 1000
    elements may differ, by one ulp of the output dtype."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    x = torch.randn(4, 33, 256, device=device, dtype=torch.bfloat16)
    for hf_cls, casting, w_dtype in ((llama.LlamaRMSNorm, "llama", torch.bfloat16),
                                     (llama.LlamaRMSNorm, "llama", torch.float32),
                                     (gemma.GemmaRMSNorm, "gemma", torch.float32)):
        hf = hf_cls(256, eps=1e-6).to(device=device, dtype=w_dtype)
        with torch.no_grad():
            hf.weight.normal_()
            expected = hf(x)
        got = lk.rms_norm(x, hf.weight.detach(), eps=1e-6, casting=casting)
        name = f"{hf_cls.__name__} ({w_dtype})"
        assert got.dtype == expected.dtype, name
        differ = got != expected
        ulp = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(torch.finfo(expected.dtype).tiny)
        assert differ.float().mean().item() <= 1e-3, f"{name}: {differ.sum().item()} elements differ"
        assert ((got.float() - expected.float()).abs() <= ulp)[differ].all(), f"{name}: a difference > 1 ulp"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch_layer_norm(dtype, device):
    x = torch.randn(7, 300, device=device, dtype=dtype)
    w, b = torch.randn(300, device=device, dtype=dtype), torch.randn(300, device=device, dtype=dtype)
    assert_close(lk.layer_norm(x, w, b), F.layer_norm(x.float(), (300,), w.float(), b.float()), dtype, "y")


def test_modules(device):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(128, eps=1e-5).to(device)
    mine = lk.RMSNorm.from_llama_rmsnorm(hf)
    assert mine.weight is hf.weight and mine.variance_epsilon == 1e-5
    fresh = lk.RMSNorm(128, eps=1e-5).to(device)
    assert fresh.state_dict().keys() == hf.state_dict().keys()
    fresh.load_state_dict(hf.state_dict())

    torch_ln = torch.nn.LayerNorm(96).to(device)
    ln = lk.LayerNorm(96).to(device)
    assert ln.state_dict().keys() == torch_ln.state_dict().keys()
    with torch.no_grad():
        torch_ln.weight.normal_()
        torch_ln.bias.normal_()
    ln.load_state_dict(torch_ln.state_dict())
    x = torch.randn(3, 96, device=device)
    assert_close(ln(x), torch_ln(x), torch.float32, "LayerNorm")

    fused = lk.FusedAddRMSNorm(128).to(device)
    x, r = torch.randn(2, 128, device=device), torch.randn(2, 128, device=device)
    y, h = fused(x, r)
    assert_close(h, x + r, torch.float32, "h")
    assert_close(y, reference.rms_norm(x + r, fused.weight, compute_dtype=torch.float64), torch.float32, "y")


def test_errors(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(TypeError, match="x"):
        lk.rms_norm(torch.ones(4, 8, dtype=torch.int64, device=device), w)
    with pytest.raises(TypeError, match="x"):
        lk.rms_norm([1.0, 2.0], w)
    with pytest.raises(ValueError, match="weight"):
        lk.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="weight"):
        lk.rms_norm(torch.randn(2, 3, 8, device=device), torch.ones(4, 8, device=device))  # per-head H mismatch
    with pytest.raises(TypeError, match="weight"):
        lk.rms_norm(x, torch.ones(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="eps"):
        lk.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        lk.layer_norm(x, w, eps=float("nan"))
    with pytest.raises(ValueError, match="bias"):
        lk.layer_norm(x, w, torch.ones(9, device=device))
    with pytest.raises(ValueError, match="residual"):
        lk.rms_norm(x, w, residual=torch.randn(4, 9, device=device))
    with pytest.raises(ValueError, match="casting"):
        lk.rms_norm(x, w, casting="llama2")
    with pytest.raises(ValueError, match="last dimension"):
        lk.rms_norm(torch.randn(4, 0, device=device))
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="weight"):
        lk.rms_norm(x, torch.ones(8, device=other))
    with pytest.raises(ValueError, match="residual"):
        lk.rms_norm(x, w, residual=torch.ones(4, 8, device=other))


def test_pipeline_stages_fit_shared_memory(monkeypatch):
    """Stages are lowered until their buffers (stages - 1 of them) fit a program's shared memory,
    and dropped (0) when not one does; nothing changes off a GPU or without pipelining."""
    monkeypatch.setattr(_device, "device_model", lambda index: _device.REFERENCE)  # an H100: 232448 B a program
    gpu = torch.device("cuda", 0)
    assert _device.fit_stages(4, 65536, gpu) == 4  # 3 x 64 KiB
    assert _device.fit_stages(4, 98304, gpu) == 3  # fp32 x, dy and dh of 8192 columns
    assert _device.fit_stages(3, 250000, gpu) == 0
    assert _device.fit_stages(1, 10**9, gpu) == 1 and _device.fit_stages(0, 10**9, gpu) == 0
    assert _device.fit_stages(4, 10**9, torch.device("cpu")) == 4


@triton.jit
def _slot_pair_roundtrip_kernel(SLOTS, NONNEG, VALUE, OUT_NONNEG, OUT_VALUE, K, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    _rowsplit.publish_pair(SLOTS + idx, tl.load(NONNEG + idx), tl.load(VALUE + idx))
    nonneg, value = _rowsplit.collect_pair(SLOTS + idx, idx < K)
    tl.store(OUT_NONNEG + idx, nonneg)
    tl.store(OUT_VALUE + idx, value)


def test_slot_pair_holds_two_values_exactly(device):
    """A slot written by ``publish_pair`` gives back both fp32 values bit for bit (a zero sum of
    squares too: the tag is the high word's sign bit), and 0 where the mask is off."""
    nonneg = torch.tensor([0.0, 1.5e-38, 3.25, 7.0e37, 1e-45, 2.0, 11.0, 0.5], device=device)
    value = torch.tensor([-0.0, -2.5, 0.0, -3.0e38, 1e-45, -1e-30, 6.0, 9.0], device=device)
    slots = torch.zeros(8, dtype=torch.int64, device=device)
    out_nonneg, out_value = torch.full_like(nonneg, float("nan")), torch.full_like(value, float("nan"))
    _slot_pair_roundtrip_kernel[(1,)](slots, nonneg, value, out_nonneg, out_value, 6, BLOCK=8)
    assert torch.equal(out_nonneg[:6].view(torch.int32), nonneg[:6].view(torch.int32))
    assert torch.equal(out_value[:6].view(torch.int32), value[:6].view(torch.int32))
    assert out_nonneg[6:].eq(0).all() and (slots != 0).all()


def test_split_backward_config_for_every_dtype():
    """The split backward has a launch configuration for every dtype the kernels take."""
    for is_rms, dtype in itertools.product((True, False), (torch.bfloat16, torch.float16, torch.float32)):
        cfg = backward_config(NormKey(is_rms, dtype, False, 65536, 4096, sms=132))
        assert isinstance(cfg, SplitBwdConfig)
        assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.num_warps in (4, 8, 16, 32) and cfg.stages in (0, 2, 3, 4)
        assert cfg.w_packed in (False, True)


@pytest.mark.parametrize("n", [1, 2, 3, 100, 1024, 5000, 16384, 16385, 32768, 32769, 40960, 49152, 65536, 131072,
                               262144])
def test_heuristics_cover_every_width(n):
    for m, is_rms in itertools.product((1, 7, 4096), (True, False)):
        for sms in (0, 132):
            f = forward_config(NormKey(is_rms, torch.bfloat16, False, n, m, sms, split=False))
            assert not f.early_w or (f.one_pass and f.block_m == 1 and sms > 0)
            assert f.num_warps in (1, 2, 4, 8, 16, 32) and f.block_m >= 1 and f.block_n & (f.block_n - 1) == 0
            assert f.one_pass == (f.block_n + f.tail_n >= n) and (f.one_pass or n > FWD_ONE_PASS_MAX)
            assert f.tail_n == 0 or (f.tail_n & (f.tail_n - 1) == 0 and f.block_n < n <= f.block_n + f.tail_n
                                     and f.tail_n <= f.block_n // 2)
            assert f.block_m * f.block_n <= 65536
            for dtype in (torch.bfloat16, torch.float32):
                b = backward_config(NormKey(is_rms, dtype, False, n, m, sms, split=False))
                assert b.per_sm >= 1 and b.max_programs in (0, DECODE_PROGRAMS)
                assert not b.prefetch or (b.one_pass and not b.max_programs)
                assert b.num_warps in (1, 2, 4, 8, 16, 32) and b.block_m >= 1 and b.block_n & (b.block_n - 1) == 0
                assert b.one_pass == (b.block_n + b.tail_n >= n) and (b.one_pass or n > BWD_ONE_PASS_MAX // 2)
                assert b.tail_n == 0 or (b.tail_n & (b.tail_n - 1) == 0 and b.block_n < n <= b.block_n + b.tail_n
                                         and not b.max_programs)
                assert b.block_m * b.block_n <= 65536
    if n > FWD_ONE_PASS_MAX:  # the split forward, the blocked loop's chunk
        narrow = n <= 49152

        def forward(is_rms, dtype, residual=False, split=True):
            return forward_config(NormKey(is_rms, dtype, residual, n, 4096, 132, split))

        assert isinstance(forward(True, torch.bfloat16), SplitFwdConfig)
        for is_rms, dtype, residual in itertools.product((True, False), (torch.bfloat16, torch.float32),
                                                         (False, True)):
            cfg = forward(is_rms, dtype, residual)
            assert not isinstance(cfg, SplitFwdConfig) or (
                cfg.block_n & (cfg.block_n - 1) == 0 and cfg.per_sm in (1, 2, 4)
                and _rowsplit.resident_registers(cfg.num_warps, cfg.per_sm) >= 128)
        # 2-byte rows that do not fill whole 8192-column slices take 4096-column ones
        assert forward(False, torch.bfloat16).block_n == (8192 if n % 8192 == 0 else 4096)
        assert forward(True, torch.bfloat16).block_n == (8192 if n % 8192 == 0 else 4096)
        assert forward(False, torch.bfloat16, split=False).block_n == 16384 // (2 if narrow else 1)
        assert forward(False, torch.float32, split=False).block_n == 16384


def test_decode_rules_are_the_measured_configs():
    """Decode sizes on 132 SMs (N = 4096, benchmarks/results/decode-h100-2026-11-23/ and -24/):
    the forward takes a row a program at 8 warps (LayerNorm 4) with the weight loaded early; the backward a
    row a program up to 64 programs, then tiles of 2 or 4 rows (LayerNorm: two tiles of 2 rows at
    M = 256, tiles of 2 at M = 5-16), 4 warps (8 for 4 rows); training sizes and an unknown SM
    count keep the bandwidth tables."""
    def fwd(n, m, is_rms, sms):
        return forward_config(NormKey(is_rms, torch.bfloat16, False, n, m, sms))

    def bwd(n, m, is_rms, sms):
        return backward_config(NormKey(is_rms, torch.bfloat16, False, n, m, sms))

    assert fwd(4096, 8, True, 132) == FwdConfig(1, 4096, 8, early_w=True)
    assert fwd(4096, 256, False, 132) == FwdConfig(1, 4096, 4, early_w=True)  # 256 tiles, yet decode
    assert fwd(4096, 1, False, 132) == FwdConfig(1, 4096, 4, early_w=True)
    assert fwd(4096, 512, False, 132).early_w is False
    assert fwd(4096, 8, True, 0).early_w is False
    assert fwd(4096, 2**15, True, 132).early_w is False
    assert fwd(256, 8, True, 132).early_w is False  # narrow rows: not measured
    assert bwd(4096, 256, True, 132) == BwdConfig(4, 4096, 8, per_sm=2, max_programs=64)
    assert bwd(4096, 256, False, 132) == BwdConfig(2, 4096, 4, per_sm=1, max_programs=64)
    assert bwd(4096, 128, False, 132) == BwdConfig(2, 4096, 4, per_sm=1, max_programs=64)
    assert bwd(4096, 8, True, 132) == BwdConfig(1, 4096, 4, per_sm=2, max_programs=64)
    assert bwd(4096, 8, False, 132) == BwdConfig(2, 4096, 4, per_sm=1, max_programs=64)
    assert bwd(4096, 32, False, 132) == BwdConfig(1, 4096, 4, per_sm=1, max_programs=64)
    assert bwd(4096, 2**15, True, 132).max_programs == 0


WIDEST_TESTED = 262144
KINDS_DTYPES_RESIDUAL = list(itertools.product((True, False), DTYPES, (False, True)))


def _launchable(cfg, n: int) -> bool:
    """``check_config`` takes it for rows of ``n``, and it is within the kernels' limits: at most
    128 elements of a tile a thread in the forward and 64 of each of x and dy in the backward (255
    registers), split programs resident (``resident_registers``), a chunked loop only for rows
    wider than its chunk, the decode programs' cap without prefetch or tail."""
    check_config(cfg, n, isinstance(cfg, (BwdConfig, SplitBwdConfig)))
    threads = WARP * cfg.num_warps
    if isinstance(cfg, SplitFwdConfig):
        return cfg.per_sm in (1, 2, 4) and _rowsplit.resident_registers(cfg.num_warps, cfg.per_sm) >= 128 and (
            cfg.block_n <= 128 * threads)
    if isinstance(cfg, SplitBwdConfig):
        return cfg.stages in (0, 2, 3, 4) and cfg.block_n <= 64 * threads
    held = cfg.block_m * (cfg.block_n + cfg.tail_n)
    if cfg.block_m * cfg.block_n > 65536 or cfg.one_pass != (cfg.block_n + cfg.tail_n >= n):
        return False
    if isinstance(cfg, FwdConfig):
        return held <= 128 * threads and (not cfg.early_w or cfg.block_m == 1)
    return (held <= 64 * threads and cfg.max_programs in (0, DECODE_PROGRAMS)
            and not (cfg.max_programs and (cfg.prefetch or cfg.tail_n)))


@pytest.mark.parametrize("table", [FORWARD, BACKWARD], ids=["forward", "backward"])
def test_tables_cover_every_width(table):
    """Every row width from 1 to 262144, for each norm kind, dtype and residual add, row split or
    not and decode sizes or not, gets exactly one configuration (the first entry that matches),
    and it is launchable: the entries without conditions cover every width, so a first match
    always exists; each entry's configuration, made for every width it covers (at 8 and 4096
    rows), is within the kernels' limits; resolving every 257th width and every entry's and power
    of two's edges (decode sizes or not, split or not) gives a launchable configuration of a
    matching entry."""
    for is_rms, dtype, residual in KINDS_DTYPES_RESIDUAL:
        key = NormKey(is_rms, dtype, residual, 1, 1)
        unconditional = sorted(e.widths for e in table.entries
                               if not e.when and e.decode is None and e.matches(key._replace(n=e.widths[0]), False))
        covered = 0
        for lo, hi in unconditional:
            assert lo <= covered + 1, f"{key}: no entry for width {covered + 1}"
            covered = max(covered, hi)
        assert covered >= WIDEST_TESTED
    base = BwdConfig(1, 16, 4, per_sm=2)  # what a decode row replaces: only its programs an SM pass through
    for entry in table.entries:
        residual = bool(entry.residual and entry.residual[0])
        for m in (8, 4096):
            key = NormKey(entry.kinds[0], _entry_dtype(entry), residual, 1, m, sms=132)
            for n in range(entry.widths[0], min(entry.widths[1], WIDEST_TESTED) + 1):
                if not entry.matches(key._replace(n=n), True):
                    continue
                cfg = entry.make(key._replace(n=n), base)
                assert _launchable(cfg, n), (entry, n, m, cfg)
                if cfg is entry.config:  # a configuration, not a rule: the same for every width
                    break
    edges = {v for e in table.entries for w in e.widths for v in (w - 1, w, w + 1)} | {
        v for p in range(4, 19) for v in (2**p - 1, 2**p, 2**p + 1)}
    every_key = list(itertools.product((1, 200, 4096), (0, 132), (True, False)))
    some_keys = [(1, 132, True), (200, 132, True), (4096, 132, True), (4096, 0, False)]
    widths = sorted(n for n in edges | set(range(1, WIDEST_TESTED + 1, 257)) if 1 <= n <= WIDEST_TESTED)
    for (is_rms, dtype, residual), n in itertools.product(KINDS_DTYPES_RESIDUAL, widths):
        for m, sms, split in (every_key if n in edges else some_keys):
            key = NormKey(is_rms, dtype, residual, n, m, sms, split)
            cfg = table.resolve(key)
            assert _launchable(cfg, n), (key, cfg)
            assert table.entry(key, decode=True).matches(key, True)


@pytest.mark.parametrize("table", [FORWARD, BACKWARD], ids=["forward", "backward"])
def test_every_table_entry_is_taken_and_names_kept_results(table):
    """No entry is shadowed by the ones before it: each is the first match for some key (its
    widths, 1 / 8 / 200 / 4096 rows, 132 multiprocessors, the split allowed or not, the H100's
    depth or the H200's, decode rows where it has them); and each names results files kept under
    benchmarks/results/."""
    results = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "results")
    for entry in table.entries:
        keys = (NormKey(is_rms, _entry_dtype(entry, size), residual, n, m, 132, split, depth)
                for n in range(entry.widths[0], min(entry.widths[1], entry.widths[0] + 8192) + 1)
                for is_rms, size, residual, m, split, depth in itertools.product(
                    entry.kinds, entry.elem_sizes or (2, 4), entry.residual or (False, True), (1, 8, 200, 4096),
                    (True, False), (1, 2)))
        assert any(table.entry(key, decode=entry.decode is not None) is entry for key in keys), entry
        assert entry.source and all(isinstance(path, str) for path in entry.source), entry
        for path in entry.source:
            assert os.path.exists(os.path.join(results, path)), f"{entry}: {path} is not in benchmarks/results/"


def _entry_dtype(entry, size=None):
    """A dtype of the entry's bytes per element (``size``: of those), fp16 where it asks for it."""
    size = size or (entry.elem_sizes or (2,))[0]
    if size == 4:
        return torch.float32
    return torch.float16 if fp16 in entry.when else torch.bfloat16


def test_config_argument_is_checked(device):
    """A configuration that is no record of its direction, or that cannot launch the rows (one
    pass over part of the row, a tail where there is no room, sizes that are no power of two, a
    bool for an int), is refused with an error naming the argument, before anything runs."""
    x, w = torch.randn(2, 64, device=device), torch.randn(64, device=device)
    with pytest.raises(TypeError, match="config"):
        lk.rms_norm(x, w, config=FwdConfig(1, 64, 4))
    with pytest.raises(TypeError, match="config.forward"):
        lk.rms_norm(x, w, config=NormConfig(forward=BwdConfig(1, 64, 4)))
    with pytest.raises(TypeError, match="config.backward"):
        lk.layer_norm(x, w, config=NormConfig(backward=SplitFwdConfig(64, 4, 1)))
    bad = [(ValueError, NormConfig(forward=FwdConfig(1, 32, 4)), "config.forward .*one pass"),
           (ValueError, NormConfig(backward=BwdConfig(2, 64, 4, tail_n=32)), "config.backward .*tail"),
           (ValueError, NormConfig(forward=FwdConfig(1, 48, 4, one_pass=False)), "config.forward .*power of two"),
           (ValueError, NormConfig(backward=SplitBwdConfig(64, 3, 0)), "config.backward .*num_warps"),
           (ValueError, NormConfig(forward=SplitFwdConfig(64, 4, 1, stages=1)), "config.forward .*stages"),
           (ValueError, NormConfig(forward=SplitFwdConfig(64, 4, 1, tma=True)), "config.forward .*tma"),
           (ValueError, NormConfig(forward=SplitFwdConfig(64, 4, 1, lag=2)), "config.forward .*lag"),
           (ValueError, NormConfig(forward=SplitFwdConfig(64, 4, 1, 3, lag=3)), "config.forward .*lag"),
           (TypeError, NormConfig(forward=FwdConfig(True, 64, 4)), "config.forward .*block_m")]
    for error, config, message in bad:
        with pytest.raises(error, match=message):
            lk.rms_norm(_leaf(x), w, config=config)
    with pytest.raises(TypeError, match="config must be a FwdConfig or SplitFwdConfig"):
        options = NormOptions(is_rms=True, round_x_hat=True, heads=1, eps=1e-6, weight_offset=0.0, out_dtype=x.dtype,
                              h_dtype=None, x_dtype=x.dtype, res_dtype=None, bias_dtype=None)
        norm_fwd(x, w, None, None, options, store_stats=False, config=NormConfig())


def test_cpu_without_interpreter_uses_reference():
    """A user on a CPU gets the reference's answer, not a crash."""
    code = (
        "import torch, llmkernels as lk\n"
        "from llmkernels import reference\n"
        "x = torch.randn(3, 50, dtype=torch.bfloat16); w = torch.randn(50)\n"
        "y = lk.rms_norm(x, w)\n"
        "assert torch.equal(y, reference.rms_norm(x, w)), 'mismatch'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_cached_launch_follows_alignment(device):
    """The cached launch (ops._launch.launch) keys compiled kernels on pointer alignment and
    stride divisibility: an aligned call, then one on rows at an odd element offset and stride,
    then the aligned one again, each against the reference."""
    n = 256
    base = torch.randn(9, n + 1, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, device=device, dtype=torch.bfloat16)
    for x in (base[:, :n].contiguous(), base[:, 1:], base[:, :n].contiguous()):
        ref = reference.rms_norm(x, w, compute_dtype=torch.float64)
        assert_close(lk.rms_norm(x, w), ref, _tol_dtype(torch.bfloat16, None, torch.bfloat16), "y")


def test_launch_plans_are_made_once_per_key(device):
    """A call's configuration, grids and kernel handles are resolved once per key (rows, width,
    dtypes, device, switches, config) into a plan (FWD_PLANS / BWD_PLANS) and reused: the same
    sizes on fresh data take the same plan objects, and the right answer; another dtype, width,
    residual add or configuration makes a plan of its own."""
    FWD_PLANS.clear()
    BWD_PLANS.clear()
    x, w = torch.randn(3, 100, device=device), torch.randn(100, device=device)
    check_norm(True, x, w)
    made = dict(FWD_PLANS), dict(BWD_PLANS)
    assert [len(plans) for plans in made] == [1, 1]
    check_norm(True, torch.randn_like(x), torch.randn_like(w))
    for plans, before in zip((FWD_PLANS, BWD_PLANS), made):
        assert plans.keys() == before.keys() and all(plans[key] is plan for key, plan in before.items())
    check_norm(True, x.to(torch.bfloat16), w)
    check_norm(True, x[:, :64], w[:64])
    check_norm(True, x, w, None, torch.randn_like(x), prenorm=True)
    check_norm(True, x, w, config=NormConfig(FwdConfig(2, 128, 4), BwdConfig(1, 128, 4)))
    for plans in (FWD_PLANS, BWD_PLANS):
        assert len(plans) == 5
        assert {(key.m, key.n, key.options.x_dtype) for key in plans} == {
            (3, 100, torch.float32), (3, 100, torch.bfloat16), (3, 64, torch.float32)}
