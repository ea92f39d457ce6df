"""QK-norm and RoPE in one pass: outputs and the gradients of q, k and both weights against the
float64 reference, in both layouts, with GQA, ragged head widths, slices of a fused qkv
projection, every cos/sin shape, more token blocks than the backward's programs; the unfused
ops, NaN rows, torch.compile, the fallback's contract, bad input."""
import pytest
import torch

import llmkernels
from llmkernels import reference
from llmkernels.ops import qk_norm_rope as ops
from llmkernels.testing import poisoned

from tests.conftest import DEVICE, INTERPRETED
from tests.helpers import assert_close, bad_input_test

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _leaves(b, s, hq, hk, d, dtype, layout, fused_qkv=False):
    """q, k (leaves, or slices of a fused ``[B, S, H, 3, D]`` qkv leaf), weights, cos, sin."""
    g = torch.Generator().manual_seed(11)

    def make(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    if fused_qkv:
        qkv = make(b, s, hq, 3, d, scale=2.0).requires_grad_()
        q, k, _ = qkv.unbind(3)
        leaves = [qkv]
    else:
        shape = (lambda h: (b, s, h, d)) if layout == "bshd" else (lambda h: (b, h, s, d))
        q, k = make(*shape(hq), scale=2.0).requires_grad_(), make(*shape(hk), scale=0.5).requires_grad_()
        leaves = [q, k]
    wq = make(d, scale=0.3, shift=1.0).float().requires_grad_()
    wk = make(d, scale=0.3, shift=1.0).float().requires_grad_()
    angles = torch.rand(s, d // 2, generator=g) * 20
    angles = torch.cat((angles, angles), -1).to(DEVICE)
    return leaves, (q, k), (wq, wk), angles.cos(), angles.sin()


def check(b, s, hq, hk, d, dtype, layout="bshd", fused_qkv=False, table=lambda t: t):
    """The op against the float64 reference: both outputs, and every leaf's gradient for random
    upstream gradients. Outputs poisoned."""
    leaves, (q, k), (wq, wk), cos, sin = _leaves(b, s, hq, hk, d, dtype, layout, fused_qkv)
    cos, sin = table(cos), table(sin)
    with poisoned():
        out = llmkernels.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-5, layout=layout)
    assert out[0].grad_fn is not None and type(out[0].grad_fn).__name__ == "QkNormRopeBackward"
    assert [o.shape for o in out] == [q.shape, k.shape] and all(o.is_contiguous() and o.dtype == dtype for o in out)
    leaves64 = [t.detach().to(F64).requires_grad_() for t in (*leaves, wq, wk)]
    q64, k64 = leaves64[0].unbind(3)[:2] if fused_qkv else leaves64[:2]
    ref = reference.qk_norm_rope(q64, k64, *leaves64[-2:], cos.to(F64), sin.to(F64), eps=1e-5, layout=layout,
                                 compute_dtype=F64)
    for name, o, r in zip(("q_out", "k_out"), out, ref):
        assert_close(o, r, dtype, name)
    ups = [torch.randn_like(o) for o in out]
    with poisoned():
        got = torch.autograd.grad(out, (*leaves, wq, wk), ups)
    want = torch.autograd.grad(ref, leaves64, [u.to(F64) for u in ups])
    names = ["qkv"] if fused_qkv else ["q", "k"]
    for name, g_, w in zip(names + ["q_weight", "k_weight"], got, want):
        # the weights' gradients sum every row: their rounding is the inputs', at a larger scale
        assert_close(g_, w, g_.dtype if name.endswith("weight") and dtype == torch.float32 else dtype,
                     f"gradient of {name}", scale=1.0 if name in ("q", "k", "qkv") else 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_against_float64(dtype, layout):
    check(2, 7, 4, 2, 32, dtype, layout)


@pytest.mark.parametrize("d", [2, 24, 64, 128])
def test_head_widths(d):
    """Widths whose halves are not a power of two (masked features) and the usual ones."""
    check(1, 5, 3, 1, d, torch.float32)


def test_slices_of_a_fused_qkv_projection():
    """q and k read in place from ``qkv [B, S, H, 3, D]``, rows 3·D apart (the scaling decoder's)."""
    check(2, 6, 3, 3, 16, torch.bfloat16, fused_qkv=True)


@pytest.mark.parametrize("table", ["batch", "one", "transposed"])
def test_cos_sin_shapes(table):
    """``[B, S, D]`` rows, ``[1, S, D]`` broadcast over the batch, and a table with a non-unit
    last stride (copied)."""
    shape = {"batch": lambda t: torch.stack((t, t.roll(1, 0))),  # each sequence its own rows
             "one": lambda t: t[None],
             "transposed": lambda t: t.t().contiguous().t()}[table]
    check(2, 5, 2, 2, 16, torch.float32, table=shape)


def test_more_token_blocks_than_backward_programs():
    """The backward's persistent loop: token blocks of 2 over more blocks than programs, so each
    program sums the weight gradients of several blocks."""
    check(3, 11, 2, 1, 16, torch.float32)
    leaves, (q, k), (wq, wk), cos, sin = _leaves(3, 11, 2, 1, 16, torch.float32, "bshd")
    options = ops.QkNormRopeOptions(1e-6, "bshd")
    small = ops.QkNormRopeConfig(block_t=2, block_h=1, num_warps=1)
    with torch.no_grad():
        fwd = ops.qk_norm_rope_fwd(q, k, wq, wk, cos, sin, options, config=small)
        ref = reference.qk_norm_rope(q.double(), k.double(), wq.double(), wk.double(), cos.double(), sin.double(),
                                     eps=1e-6, layout="bshd", compute_dtype=F64)
        for o, r in zip(fwd[:2], ref):
            assert_close(o, r, torch.float32, "forward with small tiles")
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        got = ops.qk_norm_rope_bwd(dq, dk, q, k, wq, wk, cos, sin, fwd[2], fwd[3], options, config=small)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    ref = reference.qk_norm_rope(*leaves64, cos.double(), sin.double(), eps=1e-6, layout="bshd", compute_dtype=F64)
    want = torch.autograd.grad(ref, leaves64, (dq.double(), dk.double()))
    for name, g_, w in zip(("dq", "dk", "dwq", "dwk"), got, want):
        assert_close(g_, w, torch.float32, f"{name} with small tiles")


def test_eager_configurations_reach_both_launchers():
    """The tune's path: an eager call's ``config`` launches the forward and its
    ``backward_config`` the backward (two programs a multiprocessor, a token a step), and the
    outputs and every gradient still match float64."""
    leaves, (q, k), (wq, wk), cos, sin = _leaves(2, 7, 3, 2, 16, torch.float32, "bshd")
    fwd = ops.QkNormRopeConfig(block_t=1, block_h=2, num_warps=1)
    bwd = ops.QkNormRopeConfig(block_t=1, block_h=1, num_warps=1, programs_per_sm=2)
    ops._FWD.clear()
    ops._BWD.clear()
    out = ops.QK_NORM_ROPE(q, k, wq, wk, cos, sin, ops.QkNormRopeOptions(1e-6, "bshd"), config=fwd,
                           backward_config=bwd)
    ups = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, (q, k, wq, wk), ups)
    assert [key.config for key in ops._FWD] == [fwd] and [key.config for key in ops._BWD] == [bwd]
    leaves64 = [t.detach().to(F64).requires_grad_() for t in (q, k, wq, wk)]
    ref = reference.qk_norm_rope(*leaves64, cos.to(F64), sin.to(F64), eps=1e-6, layout="bshd", compute_dtype=F64)
    for name, o, r in zip(("q_out", "k_out"), out, ref):
        assert_close(o, r, torch.float32, name)
    want = torch.autograd.grad(ref, leaves64, [u.to(F64) for u in ups])
    for name, g_, w in zip(("dq", "dk", "dwq", "dwk"), got, want):
        assert_close(g_, w, torch.float32, name)


@pytest.mark.parametrize("use_v", [True, False])
def test_qkv_form_is_the_op_with_one_gradient_buffer(use_v):
    """qkv_norm_rope of a fused ``[B, S, H, 3, D]``: the outputs and every gradient bitwise those
    of qk_norm_rope of ``qkv.unbind(3)`` (the same kernels), v a view of qkv, and its backward
    node its own (the three gradients in one buffer); an unused v gets a zero gradient."""
    leaves, _, (wq, wk), cos, sin = _leaves(2, 6, 3, 3, 16, torch.bfloat16, "bshd", fused_qkv=True)
    qkv = leaves[0]
    with poisoned():
        got = llmkernels.qkv_norm_rope(qkv, wq, wk, cos, sin, eps=1e-5)
    q, k, v = qkv.unbind(3)
    want = (*llmkernels.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-5, layout="bshd"), v)
    assert type(got[0].grad_fn).__name__ == "_QkvNormRopeBackward"
    assert got[2].data_ptr() == qkv[..., 2, :].data_ptr() and got[2].stride() == v.stride()
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    ups = [torch.randn_like(t) for t in want] if use_v else [torch.randn_like(t) for t in want[:2]]
    with poisoned():
        grads = torch.autograd.grad(got[:len(ups)], (qkv, wq, wk), ups)
    for g_, w in zip(grads, torch.autograd.grad(want[:len(ups)], (qkv, wq, wk), ups)):
        assert torch.equal(g_, w)
    assert use_v or not grads[0][..., 2, :].any()


def test_matches_the_two_ops_in_float32():
    """``apply_rope(rms_norm(q), ...)`` of the library's own ops gives the same in float32."""
    _, (q, k), (wq, wk), cos, sin = _leaves(2, 6, 4, 2, 32, torch.float32, "bhsd")
    fused = llmkernels.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6)
    qn = llmkernels.rms_norm(q, wq, eps=1e-6)
    kn = llmkernels.rms_norm(k, wk, eps=1e-6)
    for o, r in zip(fused, llmkernels.apply_rope(qn, kn, cos, sin)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_nan_stays_in_its_row():
    _, (q, k), (wq, wk), cos, sin = _leaves(1, 4, 2, 2, 16, torch.float32, "bshd")
    q = q.detach().clone()
    q[0, 2, 1, 5] = float("nan")
    q_out, k_out = llmkernels.qk_norm_rope(q, k.detach(), wq.detach(), wk.detach(), cos, sin, layout="bshd")
    bad = torch.isnan(q_out)
    assert bad[0, 2, 1].all() and bad.sum() == q.shape[-1] and not torch.isnan(k_out).any()


def test_float64_and_empty_take_the_reference():
    _, (q, k), (wq, wk), cos, sin = _leaves(1, 3, 2, 2, 8, F64, "bshd")
    q_out, k_out = llmkernels.qk_norm_rope(q, k, wq, wk, cos.double(), sin.double(), layout="bshd")
    assert q_out.dtype == F64 and q_out.is_contiguous()
    empty = q[:, :0]
    out = llmkernels.qk_norm_rope(empty, k[:, :0], wq, wk, cos[:0], sin[:0], layout="bshd")
    assert out[0].shape == empty.shape


def test_torch_compile_fullgraph():
    """The custom ops trace with fullgraph=True: outputs and every gradient equal eager."""
    backend = "aot_eager" if INTERPRETED else "inductor"
    leaves, (q, k), (wq, wk), cos, sin = _leaves(2, 5, 2, 2, 16, torch.bfloat16, "bshd", fused_qkv=True)

    def fn(qkv, wq, wk):
        q, k, _ = qkv.unbind(3)
        return llmkernels.qk_norm_rope(q, k, wq, wk, cos, sin, layout="bshd")

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got, want = compiled(leaves[0], wq, wk), fn(leaves[0], wq, wk)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    ups = [torch.randn_like(o) for o in want]
    for g_, w in zip(torch.autograd.grad(got, (leaves[0], wq, wk), ups),
                     torch.autograd.grad(want, (leaves[0], wq, wk), ups)):
        assert torch.equal(g_, w)


def _bad_cases():
    _, (q, k), (wq, wk), cos, sin = _leaves(2, 4, 2, 2, 8, torch.float32, "bshd")
    call = lambda **kw: (lambda: llmkernels.qk_norm_rope(  # noqa: E731
        kw.get("q", q), kw.get("k", k), kw.get("q_weight", wq), kw.get("k_weight", wk), kw.get("cos", cos),
        kw.get("sin", sin), eps=kw.get("eps", 1e-6), layout=kw.get("layout", "bshd")))
    return [
        ("q must be a torch.Tensor", TypeError, call(q=q.tolist())),
        ("k must be a floating-point", TypeError, call(k=k.long())),
        ("layout must be one of", ValueError, call(layout="sbhd")),
        ("q must be 4-D", ValueError, call(q=q[0])),
        ("k .* must have q's batch size", ValueError, call(k=k[:, :3])),
        ("k dtype", TypeError, call(k=k.double())),
        ("head_dim must be even", ValueError, call(q=q[..., :7], k=k[..., :7], q_weight=wq[:7], k_weight=wk[:7],
                                                  cos=cos[:, :7], sin=sin[:, :7])),
        ("q_weight must have shape", ValueError, call(q_weight=wq[:4])),
        ("cos shape .* must equal sin shape", ValueError, call(sin=sin[:2])),
        (r"cos/sin must be \[S, D\]", ValueError, call(cos=cos[:2], sin=sin[:2])),
        ("eps must be a non-negative number", ValueError, call(eps=-1.0)),
    ]


test_bad_input = bad_input_test(_bad_cases)


def test_qkv_form_names_a_bad_qkv():
    _, _, (wq, wk), cos, sin = _leaves(1, 4, 2, 2, 8, torch.float32, "bshd")
    with pytest.raises(ValueError, match=r"qkv must be \[B, S, H, 3, D\]"):
        llmkernels.qkv_norm_rope(torch.randn(1, 4, 2, 2, 8, device=DEVICE), wq, wk, cos, sin)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        llmkernels.qkv_norm_rope(None, wq, wk, cos, sin)
