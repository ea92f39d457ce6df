"""RoPE: forward and q/k gradients against the float64 reference, both layouts, both pairings,
GQA, partial rotary, position_ids, strided views, in place, Hugging Face equality, bad input."""
import pytest
import torch

import llmkernels
from llmkernels import reference
from llmkernels.ops import rope as rope_ops

from tests.conftest import DEVICE, INTERPRETED
from llmkernels.testing import poisoned
from tests.helpers import assert_close, bad_input_test, rel_err

F64 = torch.float64


def rope_tables(n_pos: int, dim: int, *, interleaved: bool = False, base: float = 10000.0, device=DEVICE):
    """cos/sin ``[n_pos, dim]`` fp32 as the models build them: frequencies duplicated over the
    two halves (rotate_half) or over each feature pair (interleaved)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    angles = torch.arange(n_pos, dtype=F64)[:, None] * inv_freq[None, :]
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def qk_shapes(layout, b, hq, hk, s, d):
    if layout == "bhsd":
        return (b, hq, s, d), (b, hk, s, d)
    return (b, s, hq, d), (b, s, hk, d)


def check(q, k, cos, sin, *, scale=1.0, check_grads=True, **kw):
    """Run apply_rope on q/k (leaves), compare outputs and q/k gradients with the float64
    reference driven by the same random upstream gradients."""
    q = q.detach().requires_grad_(check_grads)
    k = None if k is None else k.detach().requires_grad_(check_grads)
    q_out, k_out = llmkernels.apply_rope(q, k, cos, sin, **kw)
    q64 = q.detach().to(F64).requires_grad_(check_grads)
    k64 = None if k is None else k.detach().to(F64).requires_grad_(check_grads)
    q_ref, k_ref = reference.apply_rope(q64, k64, cos.to(F64), sin.to(F64), compute_dtype=F64,
                                        **{n: v for n, v in kw.items() if n != "inplace"})
    assert q_out.dtype == q.dtype
    assert_close(q_out, q_ref, q.dtype, "q_out", scale)
    if k is None:
        assert k_out is None
    else:
        assert k_out.dtype == k.dtype
        assert_close(k_out, k_ref, k.dtype, "k_out", scale)
    if not check_grads:
        return q_out, k_out
    outs = [q_out] + ([] if k is None else [k_out])
    grads = [torch.randn_like(t) for t in outs]
    got = torch.autograd.grad(outs, [q] + ([] if k is None else [k]), grads)
    want = torch.autograd.grad([q_ref] + ([] if k is None else [k_ref]), [q64] + ([] if k is None else [k64]),
                               [g.to(F64) for g in grads])
    for name, g, w, t in zip(("dq", "dk"), got, want, (q, k)):
        assert g.dtype == t.dtype
        assert_close(g, w, t.dtype, name, scale)
    return q_out, k_out


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [None, 24])
def test_forward_backward(layout, interleaved, dtype, rotary_dim):
    """GQA (Hq=6, Hk=2), fp32 cos/sin [1, S, W] with q/k of every dtype, outputs poisoned."""
    b, hq, hk, s, d = 2, 6, 2, 9, 40
    qs, ks = qk_shapes(layout, b, hq, hk, s, d)
    q = torch.randn(qs, device=DEVICE, dtype=dtype)
    k = torch.randn(ks, device=DEVICE, dtype=dtype)
    cos, sin = rope_tables(s, rotary_dim or d, interleaved=interleaved)
    with poisoned():
        q_out, _ = check(q, k, cos[None], sin[None], layout=layout, interleaved=interleaved, rotary_dim=rotary_dim)
    if rotary_dim:  # the features past rotary_dim are copied bit for bit
        assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_general_tables_and_batched_cos(interleaved):
    """Arbitrary cos/sin (the two features of a pair use different values), one row per
    (batch, token): the backward must use each feature's own sine, not just negate it. bf16 cos."""
    b, hq, hk, s, d = 3, 4, 1, 5, 32
    qs, ks = qk_shapes("bhsd", b, hq, hk, s, d)
    q, k = torch.randn(qs, device=DEVICE), torch.randn(ks, device=DEVICE)
    cos = torch.randn(b, s, d, device=DEVICE).bfloat16()
    sin = torch.randn(b, s, d, device=DEVICE).bfloat16()
    check(q, k, cos, sin, interleaved=interleaved)
    check(q, None, cos[0], sin[0], interleaved=interleaved)  # [S, D] tables, k None


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_position_ids(layout, pos_dtype, rotary_dim):
    """Gather rows of a [max_pos, W] table: [B, S] positions (a packed batch) and [S] ones; W is
    the head dim (first rotary_dim features used) or rotary_dim."""
    b, hq, hk, s, d, max_pos = 2, 4, 2, 7, 32, 50
    qs, ks = qk_shapes(layout, b, hq, hk, s, d)
    q = torch.randn(qs, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(ks, device=DEVICE, dtype=torch.bfloat16)
    width = d if rotary_dim is None else rotary_dim
    cos, sin = rope_tables(max_pos, width)
    pos = torch.randint(0, max_pos, (b, s), device=DEVICE, dtype=pos_dtype)
    kw = dict(layout=layout, rotary_dim=rotary_dim)
    check(q, k, cos, sin, position_ids=pos, **kw)
    check(q, k, cos, sin, position_ids=pos[0], **kw)
    # Rows picked by position equal the precomputed per-token rows.
    q_pos, _ = llmkernels.apply_rope(q, k, cos, sin, position_ids=pos, **kw)
    q_pre, _ = llmkernels.apply_rope(q, k, cos[pos.long()], sin[pos.long()], **kw)
    assert torch.equal(q_pos, q_pre)


def test_decode_single_token():
    """Serving: S = 1, one position per sequence."""
    b, hq, hk, d = 5, 8, 2, 64
    qs, ks = qk_shapes("bshd", b, hq, hk, 1, d)
    q, k = torch.randn(qs, device=DEVICE, dtype=torch.float16), torch.randn(ks, device=DEVICE, dtype=torch.float16)
    cos, sin = rope_tables(4096, d)
    pos = torch.randint(0, 4096, (b, 1), device=DEVICE)
    check(q, k, cos, sin, position_ids=pos, layout="bshd", check_grads=False)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_strided_views_of_fused_qkv(layout):
    """q, k are slices of one [B, S, (Hq + 2 Hk) * D] projection, viewed (and for bhsd
    transposed) as Hugging Face does: no copies, and the gradient reaches the fused tensor."""
    b, hq, hk, s, d = 2, 4, 2, 6, 16
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=DEVICE, requires_grad=True)
    heads = qkv.view(b, s, hq + 2 * hk, d)
    q, k = heads[:, :, :hq], heads[:, :, hq:hq + hk]
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    assert not q.is_contiguous()
    cos, sin = rope_tables(s, d)
    q_out, k_out = llmkernels.apply_rope(q, k, cos, sin, layout=layout)
    q_ref, k_ref = reference.apply_rope(q.detach().to(F64), k.detach().to(F64), cos.to(F64), sin.to(F64),
                                        layout=layout, compute_dtype=F64)
    assert_close(q_out, q_ref, torch.float32, "q_out")
    assert_close(k_out, k_ref, torch.float32, "k_out")
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    (dqkv,) = torch.autograd.grad((q_out, k_out), qkv, (gq, gk))
    x64 = qkv.detach().to(F64).requires_grad_()
    h64 = x64.view(b, s, hq + 2 * hk, d)
    q64, k64 = h64[:, :, :hq], h64[:, :, hq:hq + hk]
    if layout == "bhsd":
        q64, k64 = q64.transpose(1, 2), k64.transpose(1, 2)
    outs = reference.apply_rope(q64, k64, cos.to(F64), sin.to(F64), layout=layout, compute_dtype=F64)
    (want,) = torch.autograd.grad(outs, x64, (gq.to(F64), gk.to(F64)))
    assert_close(dqkv, want, torch.float32, "dqkv")
    assert (dqkv[..., (hq + hk) * d:] == 0).all()  # v gets no gradient


@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace(interleaved):
    """inplace=True rotates the views of a fused qkv in their storage and returns them; it is
    differentiable (the backward needs only cos/sin)."""
    b, hq, hk, s, d, rd = 2, 4, 2, 5, 32, 16
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=DEVICE, dtype=torch.bfloat16)
    before = qkv.clone()
    heads = qkv.view(b, s, hq + 2 * hk, d)
    q, k = heads[:, :, :hq].transpose(1, 2), heads[:, :, hq:hq + hk].transpose(1, 2)
    cos, sin = rope_tables(s, rd, interleaved=interleaved)
    q_ref, k_ref = reference.apply_rope(q.to(F64), k.to(F64), cos.to(F64), sin.to(F64), interleaved=interleaved,
                                        compute_dtype=F64)
    q_out, k_out = llmkernels.apply_rope(q, k, cos, sin, interleaved=interleaved, inplace=True)
    assert q_out is q and k_out is k
    assert_close(q, q_ref, torch.bfloat16, "q (in place)")
    assert_close(k, k_ref, torch.bfloat16, "k (in place)")
    assert torch.equal(qkv[..., (hq + hk) * d:], before[..., (hq + hk) * d:])  # v untouched
    assert torch.equal(q[..., rd:], before.view(b, s, -1, d)[:, :, :hq, rd:].transpose(1, 2))

    # Autograd through the in-place op, on non-leaf inputs.
    x = torch.randn(b, hq, s, d, device=DEVICE, requires_grad=True)
    y = x * 1.0
    y_out, _ = llmkernels.apply_rope(y, None, cos, sin, interleaved=interleaved, inplace=True)
    g = torch.randn_like(y_out)
    (dx,) = torch.autograd.grad(y_out, x, g)
    x64 = x.detach().to(F64).requires_grad_()
    (want,) = torch.autograd.grad(reference.apply_rope(x64, None, cos.to(F64), sin.to(F64), interleaved=interleaved,
                                                       compute_dtype=F64)[0], x64, g.to(F64))
    assert_close(dx, want, torch.float32, "dx (in place)")


def test_only_q_output_used():
    """A gradient for q's output only: k still gets its (zero) gradient."""
    q, k = torch.randn(1, 2, 3, 8, device=DEVICE, requires_grad=True), torch.randn(1, 1, 3, 8, device=DEVICE,
                                                                                   requires_grad=True)
    cos, sin = rope_tables(3, 8)
    q_out, _ = llmkernels.apply_rope(q, k, cos, sin)
    q_out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert k.grad is None or (k.grad == 0).all()


def test_double_backward():
    """The backward is the op itself, so it is differentiable too (e.g. gradient penalties)."""
    q = torch.randn(2, 3, 4, 16, device=DEVICE, requires_grad=True)
    cos, sin = (torch.randn(4, 16, device=DEVICE) for _ in range(2))
    g = torch.randn(2, 3, 4, 16, device=DEVICE, requires_grad=True)
    h = torch.randn(2, 3, 4, 16, device=DEVICE)
    (dq,) = torch.autograd.grad(llmkernels.apply_rope(q, None, cos, sin)[0], q, g, create_graph=True)
    (dg,) = torch.autograd.grad(dq, g, h)
    q64, g64 = q.detach().to(F64).requires_grad_(), g.detach().to(F64).requires_grad_()
    out64 = reference.apply_rope(q64, None, cos.to(F64), sin.to(F64), compute_dtype=F64)[0]
    (dq64,) = torch.autograd.grad(out64, q64, g64, create_graph=True)
    (dg64,) = torch.autograd.grad(dq64, g64, h.to(F64))
    assert_close(dq, dq64, torch.float32, "dq")
    assert_close(dg, dg64, torch.float32, "d(dq)/dg")


def test_empty_sequence():
    q, k = torch.randn(2, 4, 0, 16, device=DEVICE), torch.randn(2, 2, 0, 16, device=DEVICE)
    cos, sin = rope_tables(0, 16)
    q_out, k_out = llmkernels.apply_rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("cos_dtype", [torch.bfloat16, torch.float32])
def test_hf_apply_rotary_pos_emb(unsqueeze_dim, cos_dtype):
    """The drop-in equals transformers' Llama apply_rotary_pos_emb within rounding: same
    output dtype (fp32 cos promotes bf16 q to fp32, as torch does there), same values up to
    HF's own bf16 rounding, gradients too."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    b, hq, hk, s, d = 2, 4, 2, 8, 32
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    qs, ks = qk_shapes(layout, b, hq, hk, s, d)
    q = torch.randn(qs, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(ks, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(s, d)
    cos, sin = cos.expand(b, s, d).to(cos_dtype), sin.expand(b, s, d).to(cos_dtype)
    hq_out, hk_out = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q_out, k_out = llmkernels.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert q_out.dtype == hq_out.dtype and k_out.dtype == hk_out.dtype and q_out.shape == hq_out.shape
    # HF rounds three times in bf16, the kernel once (fp32 arithmetic): compare at bf16 tolerance.
    assert_close(q_out, hq_out, torch.bfloat16, "q vs HF")
    assert_close(k_out, hk_out, torch.bfloat16, "k vs HF")
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    want = torch.autograd.grad((hq_out, hk_out), (q, k), (gq, gk))
    got = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    assert_close(got[0], want[0], torch.bfloat16, "dq vs HF")
    assert_close(got[1], want[1], torch.bfloat16, "dk vs HF")
    # Old transformers: a [max_pos, D] table and position_ids.
    table_cos, table_sin = rope_tables(64, d)
    pos = torch.randint(0, 64, (b, s), device=DEVICE)
    hq_old, _ = llama.apply_rotary_pos_emb(q, k, table_cos[pos], table_sin[pos], unsqueeze_dim=unsqueeze_dim)
    q_old, _ = llmkernels.apply_rotary_pos_emb(q, k, table_cos, table_sin, pos, unsqueeze_dim)
    assert_close(q_old, hq_old, torch.float32, "q vs HF (position_ids)")


def test_hf_drop_in_falls_back_for_trainable_tables():
    """cos/sin that need a gradient (or shapes the kernel does not take) go through HF's formula."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = torch.randn(1, 2, 4, 8, device=DEVICE), torch.randn(1, 2, 4, 8, device=DEVICE)
    cos, sin = (t[None].requires_grad_() for t in rope_tables(4, 8))
    q_out, _ = llmkernels.apply_rotary_pos_emb(q, k, cos, sin)
    hq_out, _ = llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(q_out, hq_out)
    q_out.sum().backward()
    assert cos.grad is not None and sin.grad is not None


def test_torch_compile_fullgraph():
    """The custom ops trace with fullgraph=True: forward, gradients, and in place without grad."""
    backend = "aot_eager" if INTERPRETED else "inductor"
    b, hq, hk, s, d = 2, 4, 2, 8, 32
    cos, sin = rope_tables(s, d)
    pos = torch.arange(s, device=DEVICE)

    def fn(q, k, inplace):
        return llmkernels.apply_rope(q, k, cos, sin, position_ids=pos, rotary_dim=16, inplace=inplace)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    q = torch.randn(b, hq, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hk, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    outs = compiled(q, k, False)
    want = fn(q, k, False)
    for o, w in zip(outs, want):
        assert torch.equal(o, w)
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, (q, k), grads)
    ref = torch.autograd.grad(want, (q, k), grads)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    with torch.no_grad():
        q2, k2 = q.detach().clone(), k.detach().clone()
        compiled(q2, k2, True)
    assert torch.equal(q2, want[0]) and torch.equal(k2, want[1])


def test_torch_compile_without_k():
    """apply_rope(q, None, ...) under torch.compile: q's output and gradient as eager, k None."""
    backend = "aot_eager" if INTERPRETED else "inductor"
    cos, sin = rope_tables(8, 16)
    q = torch.randn(2, 4, 8, 16, device=DEVICE, requires_grad=True)
    fn = lambda q: llmkernels.apply_rope(q, None, cos, sin)  # noqa: E731
    (got, k_out), (want, _) = torch.compile(fn, fullgraph=True, backend=backend)(q), fn(q)
    assert k_out is None and torch.equal(got, want)
    dy = torch.randn_like(want)
    assert torch.equal(torch.autograd.grad(got, q, dy)[0], torch.autograd.grad(want, q, dy)[0])


def test_rope_custom_op_opcheck_on_strided_halves():
    """The fake kernel allocates as the real one (torch.compile trusts its strides): q and k as the
    halves of a fused [B, H, S, 2D] projection, which are not dense."""
    b, h, s, d = 2, 4, 8, 16
    cos, sin = rope_tables(s, d)
    fused = torch.randn(b, h, s, 2 * d, device=DEVICE)
    q, k = fused[..., :d], fused[..., d:]
    options = rope_ops.RopeOptions(interleaved=False, rotary_dim=d, backward=False, q_dtype=q.dtype, k_dtype=k.dtype,
                                   layout="bhsd")
    torch.library.opcheck(rope_ops.ROPE.op, (q, k, cos[None], sin[None], None, *options))


def _bad_cases():
    d = 16
    q = torch.randn(2, 4, 5, d, device=DEVICE)
    k = torch.randn(2, 2, 5, d, device=DEVICE)
    cos, sin = rope_tables(5, d)
    table_cos, table_sin = rope_tables(10, d)
    return [
        ("head_dim", ValueError, lambda: llmkernels.apply_rope(q, torch.randn(2, 2, 5, 8, device=DEVICE), cos, sin)),
        ("sequence length", ValueError, lambda: llmkernels.apply_rope(q, k[:, :, :4], cos, sin)),
        ("rotary_dim", ValueError, lambda: llmkernels.apply_rope(q, k, cos, sin, rotary_dim=7)),
        ("rotary_dim", ValueError, lambda: llmkernels.apply_rope(q, k, cos, sin, rotary_dim=2 * d)),
        ("last dim", ValueError, lambda: llmkernels.apply_rope(q, k, cos[:, :10], sin[:, :10], rotary_dim=8)),
        ("sin shape", ValueError, lambda: llmkernels.apply_rope(q, k, cos, sin[:4])),
        ("cos/sin must be", ValueError, lambda: llmkernels.apply_rope(q, k, cos[:4], sin[:4])),
        ("cos/sin must be", ValueError, lambda: llmkernels.apply_rope(q, k, cos.expand(3, 5, d), sin.expand(3, 5, d))),
        ("q must be 4-D", ValueError, lambda: llmkernels.apply_rope(q[0], k, cos, sin)),
        ("layout", ValueError, lambda: llmkernels.apply_rope(q, k, cos, sin, layout="sbhd")),
        ("q must be a floating", TypeError, lambda: llmkernels.apply_rope(q.long(), k, cos, sin)),
        ("k must be a floating", TypeError, lambda: llmkernels.apply_rope(q, k.int(), cos, sin)),
        ("cos must be a floating", TypeError, lambda: llmkernels.apply_rope(q, k, cos.long(), sin)),
        ("sin must be a torch.Tensor", TypeError, lambda: llmkernels.apply_rope(q, k, cos, 1.0)),
        ("position_ids must be an integer", TypeError,
         lambda: llmkernels.apply_rope(q, k, table_cos, table_sin, position_ids=torch.zeros(5, device=DEVICE))),
        ("must lie in", ValueError,
         lambda: llmkernels.apply_rope(q, k, table_cos, table_sin, position_ids=torch.arange(5, device=DEVICE) + 6)),
        ("must lie in", ValueError,
         lambda: llmkernels.apply_rope(q, k, table_cos, table_sin, position_ids=torch.arange(5, device=DEVICE) - 1)),
        ("position_ids must be", ValueError,
         lambda: llmkernels.apply_rope(q, k, table_cos, table_sin, position_ids=torch.arange(4, device=DEVICE))),
        ("table", ValueError,
         lambda: llmkernels.apply_rope(q, k, table_cos[None], table_sin[None], position_ids=torch.arange(5, device=DEVICE))),
        ("inplace", ValueError,
         lambda: llmkernels.apply_rope(q.transpose(-1, -2).contiguous().transpose(-1, -2), None, cos, sin, inplace=True)),
        ("rotary_dim must be an int", TypeError, lambda: llmkernels.apply_rope(q, k, cos, sin, rotary_dim=8.0)),
    ]


test_bad_input = bad_input_test(_bad_cases)


def test_wrong_device():
    if DEVICE == "cpu":
        pytest.skip("needs a second device")
    q, k = torch.randn(1, 2, 3, 8, device=DEVICE), torch.randn(1, 2, 3, 8, device=DEVICE)
    cos, sin = rope_tables(3, 8, device="cpu")
    with pytest.raises(ValueError, match="cos is on cpu"):
        llmkernels.apply_rope(q, k, cos, sin)
    with pytest.raises(ValueError, match="k is on cpu"):
        llmkernels.apply_rope(q, k.cpu(), cos.to(DEVICE), sin.to(DEVICE))


def test_reference_conventions():
    """The reference's pairings match their textbook definitions on a tiny example."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(reference.rotate_half(x), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    assert torch.equal(reference.rotate_every_two(x), torch.tensor([-2.0, 1.0, -4.0, 3.0]))
    # A rotation by angle t of each pair: rotating by t then by -t gives x back.
    cos, sin = rope_tables(3, 4, device="cpu")
    q = torch.randn(1, 1, 3, 4, dtype=F64)
    y, _ = reference.apply_rope(q, None, cos.to(F64), sin.to(F64), compute_dtype=F64)
    back, _ = reference.apply_rope(y, None, cos.to(F64), -sin.to(F64), compute_dtype=F64)
    assert rel_err(back, q) < 1e-6
