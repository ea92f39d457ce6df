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
from llmkernels.ops import _launch, _rowsplit
from llmkernels.ops.norm import configs as norm_cfg, launchers as norm_launch
from tests.conftest import INTERPRETED
from llmkernels.bench.runner import poisoned
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
    return t.detach().clone().requires_grad_(True)


def check_norm(is_rms, x, weight=None, bias=None, residual=None, *, prenorm=False, **opts):
    """Run the kernel and the float64 reference on the same leaves; compare y (and h), then
    every gradient for random upstream gradients."""
    fn, ref_fn = (lk.rms_norm, reference.rms_norm) if is_rms else (lk.layer_norm, reference.layer_norm)
    leaves = {k: _leaf(v) for k, v in dict(x=x, weight=weight, bias=bias, residual=residual).items() if v is not None}
    ref_leaves = {k: _leaf(v) for k, v in leaves.items()}
    out = fn(leaves["x"], leaves.get("weight"), leaves.get("bias"), residual=leaves.get("residual"),
             prenorm=prenorm, **opts)
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


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_no_weight_and_bias_only(is_rms, device):
    x = torch.randn(9, 130, device=device, dtype=torch.bfloat16)
    check_norm(is_rms, x)
    check_norm(is_rms, x, None, torch.randn(130, device=device))


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
    """h = x + residual rounded once to its dtype: exact on the GPU, within one bf16 ulp under
    the interpreter (which rounds bf16 toward zero)."""
    x = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    r = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    _, h = lk.rms_norm(x, torch.ones(512, device=device), residual=r, prenorm=True)
    expected = (x.float() + r.float()).to(torch.bfloat16)
    if INTERPRETED:
        ulp = expected.float().abs() * 2.0 ** -7
        assert ((h.float() - expected.float()).abs() <= ulp).all()
    else:
        assert torch.equal(h, expected)


def test_residual_grads_do_not_alias(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    y, h = lk.rms_norm(x, torch.ones(64, device=device), residual=r, prenorm=True)
    (y.float().sum() + h.float().sum()).backward()
    assert torch.equal(x.grad, r.grad)
    x.grad.add_(1.0)
    assert not torch.equal(x.grad, r.grad), "x.grad and residual.grad share storage"


@pytest.mark.parametrize("n", [40001, 65536, 70001])
@pytest.mark.parametrize("split", [True, False], ids=["split", "blocked"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_wide_rows(is_rms, dtype, split, n, device, monkeypatch):
    """Rows wider than the one-pass limits, with and without a residual: forward and backward split
    across programs (on a GPU; the interpreter cannot run programs that wait for each other; the
    forward where FWD_SPLIT has the case) or blocked (in half chunks up to
    FWD_BLOCKED_HALF_CHUNK_MAX). 65536 fills whole slices of every split, 40001 and 70001 leave
    the last one partly masked."""
    if split and INTERPRETED:
        pytest.skip("a row split over several programs needs them to run concurrently (GPU)")
    monkeypatch.setattr(_rowsplit, "ROW_SPLIT", split)
    assert n > norm_cfg.FWD_ONE_PASS_MAX and n > norm_cfg.BWD_ONE_PASS_MAX
    x = torch.randn(3, n, device=device, dtype=dtype) + 3.0  # |mean| > std: exercises the shifted variance
    res = torch.randn(3, n, device=device, dtype=dtype)
    w = torch.randn(n, device=device)
    b = None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b, res, prenorm=True)
    check_norm(is_rms, x, w, b)


@pytest.mark.parametrize("n", [20480, 28672, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_split_below_one_pass_max(is_rms, dtype, n, device):
    """Rows of 16385-32768 that take the split forward (on a GPU; the one-pass kernel under the
    interpreter): 2-byte rows that do not fill their power of two, every fp32 LayerNorm row.
    20480 and 28672 do not fill whole 8192-column slices: 2-byte rows take 4096-column ones,
    fp32 rows a partly masked last."""
    cfg = norm_cfg._fwd_split_config(is_rms, torch.empty(0, dtype=dtype).element_size(), False, n)
    assert (cfg is None) == (n == 32768 and dtype == torch.bfloat16 or is_rms and dtype == torch.float32)
    x = torch.randn(3, n, device=device, dtype=dtype) + 3.0
    check_norm(is_rms, x, torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device))


@pytest.mark.parametrize("n", [4353, 5120, 9216, 10240, 12288])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_forward_tail(is_rms, dtype, n, device):
    """Rows of 4353-6144 and 8705-12288 columns: the one-pass forward takes half their power of
    two whole and the rest as a masked power-of-two tail (300 rows: the bandwidth path, not the
    decode rule). The interpreter runs the forced case below."""
    cfg = norm_cfg._fwd_config(n, 300, is_rms, 132, torch.empty(0, dtype=dtype).element_size())
    assert cfg[1] < n <= cfg[1] + cfg[5]
    if INTERPRETED:
        pytest.skip("300 rows of these widths take minutes under the interpreter")
    x = torch.randn(300, n, device=device, dtype=dtype) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)


@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("n", [80, 96])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_forward_tail_forced(is_rms, n, block_m, device, monkeypatch):
    """The forward's tail at a small width: 64 columns whole and a tail of 32 (the last 16 masked
    at 80), one or two rows a tile (5 rows: the last tile half empty), with and without the
    residual add."""
    monkeypatch.setattr(norm_launch, "_fwd_config", lambda *_: (block_m, 64, 4, True, False, 32))
    x = torch.randn(5, n, device=device) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True)


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


# (forward programs per SM, backward stages, backward weight kept packed)
SPLIT_MODES = {"lockstep": (1, 0, False), "pipelined": (2, 3, True)}


@pytest.mark.parametrize("mode", SPLIT_MODES)
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_split_path_forced(is_rms, dtype, parts, mode, device, monkeypatch):
    """The split forward and backward at a small width (limits lowered): one part per row (also
    under the interpreter) or four, the last one partly masked; more rows than groups in flight;
    the forward one or two programs an SM; the backward's exchange in step with the row or a row
    ahead with the loads pipelined."""
    if parts > 1 and INTERPRETED:
        pytest.skip("a row split over several programs needs them to run concurrently (GPU)")
    n = 100
    fwd_per_sm, bwd_stages, bwd_w_packed = SPLIT_MODES[mode]
    monkeypatch.setattr(norm_cfg, "FWD_ONE_PASS_MAX", 64)
    monkeypatch.setattr(norm_launch, "_fwd_split_config", lambda *_: (128 // parts, 4, fwd_per_sm))
    monkeypatch.setattr(norm_cfg, "BWD_ONE_PASS_MAX", 64)
    monkeypatch.setattr(norm_launch, "_split_config", lambda *_: (128 // parts, 4, bwd_stages, bwd_w_packed))
    assert _rowsplit.split_grid(n, 300, 128 // parts, torch.device(device))[0] == parts
    x = torch.randn(3, 100, n, device=device, dtype=dtype) + 2.0
    res = torch.randn(3, 100, n, device=device, dtype=dtype)
    check_norm(is_rms, x, torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device),
               res, prenorm=True)
    check_norm(is_rms, x[:1, :3], torch.randn(n, device=device, dtype=dtype), casting="gemma")


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_blocked_path_forced(is_rms, device, monkeypatch):
    """The blocked kernels at a small width (limits lowered), with several rows per head."""
    monkeypatch.setattr(_rowsplit, "ROW_SPLIT", False)
    monkeypatch.setattr(norm_cfg, "FWD_ONE_PASS_MAX", 64)
    monkeypatch.setattr(norm_cfg, "BWD_ONE_PASS_MAX", 64)
    monkeypatch.setattr(norm_cfg, "FWD_BLOCKED", (2, 32, 4, False))
    monkeypatch.setattr(norm_cfg, "BWD_BLOCKED", (2, 32, 4, False, 2))
    x = torch.randn(2, 5, 3, 100, device=device, dtype=torch.float32)
    check_norm(is_rms, x, torch.randn(100, device=device), torch.randn(100, device=device))
    check_norm(is_rms, x, torch.randn(3, 100, device=device), torch.randn(3, 100, device=device))


@pytest.mark.parametrize("entry", [(key, width) for key, widths in norm_cfg._BWD_TABLE_RAGGED.items() for width in widths],
                         ids=lambda e: f"{'rms' if e[0][0] else 'layer'}-{e[0][1]}B-{e[1]}")
def test_backward_ragged_entries(entry, device):
    """Each entry for rows between two powers of two: taken for the widest row it covers, not
    for the power of two itself; on a GPU, that row's backward (300 rows: the bandwidth path),
    with the residual add for RMSNorm."""
    (is_rms, elem_size), width = entry
    cfg, widest = norm_cfg._BWD_TABLE_RAGGED[is_rms, elem_size][width]
    n = width * min(widest, 7) // 8
    bm, bn, warps, _, per_sm, _, prefetch, _ = norm_cfg._bwd_config(n, 300, is_rms, 132, elem_size)
    assert (bm * bn, warps, per_sm, prefetch) == cfg and bn == width
    bm, bn, warps, _, per_sm, _, prefetch, _ = norm_cfg._bwd_config(width, 300, is_rms, 132, elem_size)
    power_cfg = (norm_cfg._BWD_TABLE_FP32[is_rms].get(width) if elem_size == 4 else None) or (
        norm_cfg._BWD_TABLE[is_rms][width])
    assert (bm * bn, warps, per_sm, prefetch) == power_cfg
    if INTERPRETED:
        pytest.skip("300 rows of thousands of columns take minutes under the interpreter")
    dtype = torch.float32 if elem_size == 4 else torch.bfloat16
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
    bm, bn, _, one_pass, _, max_programs, _, tail_n = norm_cfg._bwd_config(n, 300, is_rms, 132, 2)
    assert one_pass and bn == 8192 and bn < n <= bn + tail_n and not max_programs
    if INTERPRETED:
        pytest.skip("300 rows of these widths take minutes under the interpreter")
    x = torch.randn(300, n, device=device, dtype=torch.bfloat16) + 3.0
    w, b = torch.randn(n, device=device), None if is_rms else torch.randn(n, device=device)
    check_norm(is_rms, x, w, b)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True)


@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=["load", "prefetch", "pipelined"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_tiles_with_and_without_prefetch(is_rms, prefetch, device, monkeypatch):
    """The one-pass backward with 2-row tiles, several a program and a last one half full (the
    prefetch then reads nothing past the last row), per-head weights and a residual too; loads
    in the loop, the next tile into registers, or the loop pipelined by Triton in 3 stages."""
    cfg = (2, 128, 4, True, 1, 3, prefetch, 0)  # 3 programs, 2 x 128 tiles
    monkeypatch.setattr(norm_launch, "_bwd_config", lambda *_: cfg)
    x = torch.randn(5, 3, 100, device=device, dtype=torch.bfloat16)
    check_norm(is_rms, x, torch.randn(100, device=device), torch.randn(100, device=device))
    check_norm(is_rms, x, torch.randn(3, 100, device=device), None, torch.randn_like(x), prenorm=True)


@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=["load", "prefetch", "pipelined"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_tail_forced(is_rms, prefetch, device, monkeypatch):
    """The one-pass backward with a tail: 64 columns whole and 32 more (the last 16 masked), 2-row
    tiles, 3 programs, the last tile half full; loads in the loop, the next tile into registers,
    or pipelined; with the residual's gradient too."""
    monkeypatch.setattr(norm_launch, "_bwd_config", lambda *_: (2, 64, 4, True, 1, 3, prefetch, 32))
    x = torch.randn(5, 80, device=device) + 3.0
    w, b = torch.randn(80, device=device), None if is_rms else torch.randn(80, device=device)
    check_norm(is_rms, x, w, b)
    check_norm(is_rms, x, w, b, torch.randn_like(x), prenorm=True)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_decode_writes_dw_by_columns(is_rms, device, monkeypatch):
    """Decode sizes: each backward program also writes dW / dB of its share of the columns over
    every row (DW_COLS), no partials. On a GPU as the decode rule launches it (rows of 4096 and
    3000 columns, 1 ... 256 rows; a residual too); under the interpreter three programs of three
    rows, 128 columns each of a 300-column row (the last share partly masked)."""
    dw_cols = []

    def recording_launch(kernel, grid, *args, **kwargs):
        dw_cols.append(kwargs.get("DW_COLS", 0))
        return _launch.launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(norm_launch, "launch", recording_launch)
    if INTERPRETED:
        monkeypatch.setattr(norm_launch, "_bwd_config", lambda *_: (1, 512, 4, True, 1, 3, 0, 0))
        shapes = [(9, 300)]
    else:
        shapes = [(m, n) for n in (4096, 3000) for m in (1, 8, 37, 256)]
    for m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        check_norm(is_rms, x, torch.randn(n, device=device, dtype=torch.bfloat16),
                   None if is_rms else torch.randn(n, device=device, dtype=torch.bfloat16))
        check_norm(is_rms, x, torch.randn(n, device=device, dtype=torch.bfloat16), None, torch.randn_like(x),
                   prenorm=True)
    assert max(dw_cols) > 0


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
def test_per_head_weight_with_residual(is_rms, blocked, device, monkeypatch):
    """Per-head weights with a fused residual (fp32 residual stream), on both kernel paths."""
    if blocked:  # per-head weights never take the row split
        monkeypatch.setattr(norm_cfg, "FWD_ONE_PASS_MAX", 16)
        monkeypatch.setattr(norm_cfg, "BWD_ONE_PASS_MAX", 16)
        monkeypatch.setattr(norm_cfg, "FWD_BLOCKED", (2, 16, 4, False))
        monkeypatch.setattr(norm_cfg, "BWD_BLOCKED", (2, 16, 4, False, 2))
    x = torch.randn(2, 5, 4, 32, device=device, dtype=torch.bfloat16)
    res = torch.randn(2, 5, 4, 32, device=device, dtype=torch.float32)
    check_norm(is_rms, x, torch.randn(4, 32, device=device), torch.randn(4, 32, device=device), res, prenorm=True,
               residual_in_fp32=True)


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
    elements may differ, by one ulp of the output dtype. Under the interpreter (bf16 rounded
    toward zero) the relative bf16 tolerance applies."""
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
        if INTERPRETED:
            assert_close(got, expected, torch.bfloat16, name)
            continue
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
    monkeypatch.setattr(_launch, "_shared_memory", lambda index: 232448)  # H100
    gpu = torch.device("cuda", 0)
    assert _launch.fit_stages(4, 65536, gpu) == 4  # 3 x 64 KiB
    assert _launch.fit_stages(4, 98304, gpu) == 3  # fp32 x, dy and dh of 8192 columns
    assert _launch.fit_stages(3, 250000, gpu) == 0
    assert _launch.fit_stages(1, 10**9, gpu) == 1 and _launch.fit_stages(0, 10**9, gpu) == 0
    assert _launch.fit_stages(4, 10**9, torch.device("cpu")) == 4


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
        cols, warps, stages, w_packed = norm_cfg._split_config(is_rms, dtype)
        assert cols & (cols - 1) == 0 and warps in (4, 8, 16, 32) and stages in (0, 2, 3, 4)
        assert w_packed in (False, True)


@pytest.mark.parametrize("n", [1, 2, 3, 100, 1024, 5000, 16384, 16385, 32768, 32769, 40960, 49152, 65536, 131072,
                               262144])
def test_heuristics_cover_every_width(n):
    for m, is_rms in itertools.product((1, 7, 4096), (True, False)):
        for sms in (0, 132):
            bm, bn, warps, one_pass, early_w, tail_n = norm_cfg._fwd_config(n, m, is_rms, sms)
            assert not early_w or (one_pass and bm == 1 and sms > 0)
            assert warps in (1, 2, 4, 8, 16, 32) and bm >= 1 and bn & (bn - 1) == 0
            assert one_pass == (bn + tail_n >= n) and (one_pass or n > norm_cfg.FWD_ONE_PASS_MAX)
            assert tail_n == 0 or (tail_n & (tail_n - 1) == 0 and bn < n <= bn + tail_n and tail_n <= bn // 2)
            assert bm * bn <= 65536
            for elem_size in (2, 4):
                bm, bn, warps, one_pass, per_sm, max_programs, prefetch, tail_n = norm_cfg._bwd_config(
                    n, m, is_rms, sms, elem_size)
                assert per_sm >= 1 and max_programs in (0, norm_cfg.BWD_DECODE_PROGRAMS)
                assert not prefetch or (one_pass and not max_programs)
                assert warps in (1, 2, 4, 8, 16, 32) and bm >= 1 and bn & (bn - 1) == 0
                assert one_pass == (bn + tail_n >= n) and (one_pass or n > norm_cfg.BWD_ONE_PASS_MAX // 2)
                assert tail_n == 0 or (tail_n & (tail_n - 1) == 0 and bn < n <= bn + tail_n and not max_programs)
                assert bm * bn <= 65536
    if n > norm_cfg.FWD_ONE_PASS_MAX:  # the split forward, the blocked loop's chunk
        narrow = n <= norm_cfg.FWD_BLOCKED_HALF_CHUNK_MAX
        assert norm_cfg._fwd_split_config(True, 2, False, n) is not None
        for is_rms, elem_size, residual in norm_cfg.FWD_SPLIT:
            cfg = norm_cfg._fwd_split_config(is_rms, elem_size, residual, n)
            assert cfg is None or (cfg[0] & (cfg[0] - 1) == 0 and cfg[2] in (1, 2, 4)
                                   and _rowsplit.resident_registers(cfg[1], cfg[2]) >= 128)
        # 2-byte rows that do not fill whole 8192-column slices take 4096-column ones
        assert norm_cfg._fwd_split_config(False, 2, False, n)[0] == (8192 if n % 8192 == 0 else 4096)
        assert norm_cfg._fwd_split_config(True, 2, False, n)[0] == (8192 if n % 8192 == 0 else 4096)
        assert norm_cfg._fwd_config(n, 4096, False, 132, 2)[1] == norm_cfg.FWD_BLOCKED[1] // (2 if narrow else 1)
        assert norm_cfg._fwd_config(n, 4096, False, 132, 4)[1] == norm_cfg.FWD_BLOCKED[1]


def test_decode_rules_are_the_measured_configs():
    """Decode sizes on 132 SMs (N = 4096, benchmarks/results/decode-h100-2026-11-23/ and -24/):
    the forward takes a row a program at 8 warps (LayerNorm 4) with the weight loaded early; the backward a
    row a program up to 64 programs, then tiles of 2 or 4 rows (LayerNorm: two tiles of 2 rows at
    M = 256, tiles of 2 at M = 5-16), 4 warps (8 for 4 rows); training sizes and an unknown SM
    count keep the bandwidth tables."""
    assert norm_cfg._fwd_config(4096, 8, True, 132) == (1, 4096, 8, True, True, 0)
    assert norm_cfg._fwd_config(4096, 256, False, 132) == (1, 4096, 4, True, True, 0)  # 256 tiles, yet decode
    assert norm_cfg._fwd_config(4096, 1, False, 132) == (1, 4096, 4, True, True, 0)
    assert norm_cfg._fwd_config(4096, 512, False, 132)[4] is False
    assert norm_cfg._fwd_config(4096, 8, True, 0)[4] is False
    assert norm_cfg._fwd_config(4096, 2**15, True, 132)[4] is False
    assert norm_cfg._fwd_config(256, 8, True, 132)[4] is False  # narrow rows: not measured
    assert norm_cfg._bwd_config(4096, 256, True, 132) == (4, 4096, 8, True, 2, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 256, False, 132) == (2, 4096, 4, True, 1, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 128, False, 132) == (2, 4096, 4, True, 1, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 8, True, 132) == (1, 4096, 4, True, 2, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 8, False, 132) == (2, 4096, 4, True, 1, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 32, False, 132) == (1, 4096, 4, True, 1, 64, 0, 0)
    assert norm_cfg._bwd_config(4096, 2**15, True, 132)[5] == 0


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
