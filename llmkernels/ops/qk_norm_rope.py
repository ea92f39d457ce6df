"""QK-norm and RoPE in one pass: an RMSNorm of each head of q and k, then its rotation.

Qwen3, OLMo 2, Gemma 3 and the scaling experiments' decoder normalise every head row
``x [D]`` of q and k over its ``D`` features before the rotary embedding::

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)
    out1 = y1 * c1 - y2 * s1      out2 = y2 * c2 + y1 * s2

(``1`` and ``2`` the halves of a row: Hugging Face's ``rotate_half`` pairs ``(i, i + D/2)``,
all ``D`` features rotated). Two ops would read and write q and k twice and keep the normalised
rows for the rotation's backward; here each row is read once and written once, and the backward
reads the upstream gradient and the input again (the per-row ``rstd`` is saved) and writes the
input gradient: the rotation's transpose, then the norm's backward::

    dy1 = do1 * c1 + do2 * s2     dy2 = do2 * c2 - do1 * s1
    dx = rstd * (dy * w - xhat * mean(dy * w * xhat)),   dw = sum over rows of dy * xhat

Arithmetic is float32; each output is rounded once (the two ops round the normalised rows to
q's dtype between them). The weight gradients are summed in a fixed order: each program of a
persistent grid keeps its rows' sums in registers and writes them once, and the host adds the
programs' sums.

``qkv_norm_rope`` takes q, k and v as a fused projection gives them (``[B, S, H, 3, D]``) and
returns v as a view, so that its backward writes the three gradients into one tensor.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from ._args import cdiv, check_tensor, next_pow2
from ._device import persistent_programs
from ._launch import PlanCache, launcher_of, use_kernels
from ._register import Op
from ._triton import tl, triton
from .configs.qk_norm_rope import QkNormRopeConfig, qk_norm_rope_config
# (RoPE's layouts, and its addressing of q and k through their strides in either)
from .rope import _DIMS, LAYOUTS, _bsh, _unit_last

# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _halves(P, i, D, mask):
    """The halves ``(P[i], P[i + D/2])`` of the rows at ``P`` as float32, 0 where masked."""
    return (tl.load(P + i, mask=mask, other=0.0).to(tl.float32),
            tl.load(P + i + D // 2, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _tables(COS, SIN, b, s, tok_valid, scb, scs, D, HALF: tl.constexpr):
    """The tokens' ``c1, s1, c2, s2 [BLOCK_T, 1, HALF]`` (float32) from rows ``b * scb + s * scs``;
    0 past the features and for absent tokens."""
    i = tl.arange(0, HALF)[None, :]
    m = tok_valid[:, None] & (i < D // 2)
    row = (b * scb + s * scs)[:, None]
    c1, c2 = _halves(COS + row, i, D, m)
    s1, s2 = _halves(SIN + row, i, D, m)
    return c1[:, None, :], s1[:, None, :], c2[:, None, :], s2[:, None, :]


@triton.jit
def _head_step(tok_valid, h0, H, feat, BLOCK_H: tl.constexpr):
    """Heads ``h0 .. h0 + BLOCK_H`` of the tokens: their indices, the rows that exist
    ``[BLOCK_T, BLOCK_H]``, the elements that exist and the heads as int64 ``[1, BLOCK_H, 1]``."""
    heads = h0 + tl.arange(0, BLOCK_H)
    rows = tok_valid[:, None] & (heads < H)[None, :]
    return heads, rows, rows[:, :, None] & feat, heads.to(tl.int64)[None, :, None]


@triton.jit
def _fwd_heads(X, Y, RSTD, W, tok, tok_valid, b, s, c1, s1, c2, s2, H, D, eps,
               sxb, sxs, sxh, syb, sys, syh, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Normalise and rotate every head of the tokens ``tok`` of X into Y, ``BLOCK_H`` at a time;
    their ``rstd`` into ``RSTD [tokens, H]``."""
    i = tl.arange(0, HALF)[None, None, :]
    feat = i < D // 2
    w1, w2 = _halves(W, i, D, feat)
    bx = (b * sxb + s * sxs)[:, None, None]
    by = (b * syb + s * sys)[:, None, None]
    for h0 in range(0, H, BLOCK_H):
        heads, rows, mask, hh = _head_step(tok_valid, h0, H, feat, BLOCK_H)
        x1, x2 = _halves(X + bx + hh * sxh, i, D, mask)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / D + eps)
        y1 = x1 * rstd[:, :, None] * w1
        y2 = x2 * rstd[:, :, None] * w2
        py = Y + by + hh * syh
        tl.store(py + i, (y1 * c1 - y2 * s1).to(Y.dtype.element_ty), mask=mask)
        tl.store(py + i + D // 2, (y2 * c2 + y1 * s2).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + tok[:, None] * H + heads[None, :], rstd, mask=rows)


@triton.jit
def _qk_norm_rope_fwd(Q, K, QO, KO, QR, KR, WQ, WK, COS, SIN, n_tokens, S, HQ, HK, D, eps,
                      sqb, sqs, sqh, skb, sks, skh, sob, sos, soh, spb, sps, sph, scb, scs,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Grid: one program per ``BLOCK_T`` tokens of the flattened ``[B, S]``; q, k and their
    outputs addressed as ``[B, S, H, D]`` through (batch, seq, head) strides."""
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tok_valid = tok < n_tokens
    b = tok // S
    s = tok - b * S
    c1, s1, c2, s2 = _tables(COS, SIN, b, s, tok_valid, scb, scs, D, HALF)
    _fwd_heads(Q, QO, QR, WQ, tok, tok_valid, b, s, c1, s1, c2, s2, HQ, D, eps,
               sqb, sqs, sqh, sob, sos, soh, BLOCK_H, HALF)
    _fwd_heads(K, KO, KR, WK, tok, tok_valid, b, s, c1, s1, c2, s2, HK, D, eps,
               skb, sks, skh, spb, sps, sph, BLOCK_H, HALF)


@triton.jit
def _bwd_heads(DO, X, DX, RSTD, W, tok, tok_valid, b, s, c1, s1, c2, s2, H, D, acc1, acc2,
               sgb, sgs, sgh, sxb, sxs, sxh, sdb, sds, sdh, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """The input gradient of every head of the tokens ``tok`` into DX, ``BLOCK_H`` at a time;
    returns ``acc1, acc2`` with their weight-gradient terms added."""
    i = tl.arange(0, HALF)[None, None, :]
    feat = i < D // 2
    w1, w2 = _halves(W, i, D, feat)
    bg = (b * sgb + s * sgs)[:, None, None]
    bx = (b * sxb + s * sxs)[:, None, None]
    bd = (b * sdb + s * sds)[:, None, None]
    for h0 in range(0, H, BLOCK_H):
        heads, rows, mask, hh = _head_step(tok_valid, h0, H, feat, BLOCK_H)
        do1, do2 = _halves(DO + bg + hh * sgh, i, D, mask)
        dy1 = do1 * c1 + do2 * s2
        dy2 = do2 * c2 - do1 * s1
        rstd = tl.load(RSTD + tok[:, None] * H + heads[None, :], mask=rows, other=0.0)[:, :, None]
        x1, x2 = _halves(X + bx + hh * sxh, i, D, mask)
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        g1 = dy1 * w1
        g2 = dy2 * w2
        mean = ((tl.sum(g1 * xh1, axis=2) + tl.sum(g2 * xh2, axis=2)) / D)[:, :, None]
        pd = DX + bd + hh * sdh
        tl.store(pd + i, (rstd * (g1 - xh1 * mean)).to(DX.dtype.element_ty), mask=mask)
        tl.store(pd + i + D // 2, (rstd * (g2 - xh2 * mean)).to(DX.dtype.element_ty), mask=mask)
        acc1 += dy1 * xh1
        acc2 += dy2 * xh2
    return acc1, acc2


@triton.jit
def _qk_norm_rope_bwd(DQO, DKO, Q, K, DQ, DK, QR, KR, WQ, WK, COS, SIN, DWQ, DWK, n_tokens, S, HQ, HK, D,
                      sgqb, sgqs, sgqh, sgkb, sgks, sgkh, sqb, sqs, sqh, skb, sks, skh,
                      sdqb, sdqs, sdqh, sdkb, sdks, sdkh, scb, scs,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Persistent grid: program p takes the token blocks p, p + programs, ...; it writes its
    weight-gradient sums to row p of ``DWQ``/``DWK [programs, D]`` (float32)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # each element's weight-gradient terms summed where they are, and across the tokens and heads
    # once at the end: a step needs no reduction between warps (shared memory and barriers)
    aq1 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
    aq2 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
    ak1 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
    ak2 = tl.zeros([BLOCK_T, BLOCK_H, HALF], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_tokens, BLOCK_T), programs):
        tok = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tok_valid = tok < n_tokens
        b = tok // S
        s = tok - b * S
        c1, s1, c2, s2 = _tables(COS, SIN, b, s, tok_valid, scb, scs, D, HALF)
        aq1, aq2 = _bwd_heads(DQO, Q, DQ, QR, WQ, tok, tok_valid, b, s, c1, s1, c2, s2, HQ, D, aq1, aq2,
                              sgqb, sgqs, sgqh, sqb, sqs, sqh, sdqb, sdqs, sdqh, BLOCK_H, HALF)
        ak1, ak2 = _bwd_heads(DKO, K, DK, KR, WK, tok, tok_valid, b, s, c1, s1, c2, s2, HK, D, ak1, ak2,
                              sgkb, sgks, sgkh, skb, sks, skh, sdkb, sdks, sdkh, BLOCK_H, HALF)
    i = tl.arange(0, HALF)
    feat = i < D // 2
    row = pid.to(tl.int64) * D
    tl.store(DWQ + row + i, tl.sum(tl.sum(aq1, axis=1), axis=0), mask=feat)
    tl.store(DWQ + row + i + D // 2, tl.sum(tl.sum(aq2, axis=1), axis=0), mask=feat)
    tl.store(DWK + row + i, tl.sum(tl.sum(ak1, axis=1), axis=0), mask=feat)
    tl.store(DWK + row + i + D // 2, tl.sum(tl.sum(ak2, axis=1), axis=0), mask=feat)


# --------------------------------------------------------------------------------------------
# launchers (their configurations: configs/qk_norm_rope.py)
# --------------------------------------------------------------------------------------------
class QkNormRopeOptions(NamedTuple):
    """The options of a call, named once: custom-op schemas, autograd context, plan keys."""

    eps: float
    layout: str  # one of LAYOUTS


class QkNormRopeKey(NamedTuple):
    hq: int
    hk: int
    d: int
    config: QkNormRopeConfig


def _plan(kernel, key: QkNormRopeKey):
    config = key.config
    return launcher_of(kernel, BLOCK_T=config.block_t, BLOCK_H=config.block_h, HALF=next_pow2(key.d // 2),
                       num_warps=config.num_warps)


_FWD = PlanCache(lambda key: _plan(_qk_norm_rope_fwd, key))
_BWD = PlanCache(lambda key: _plan(_qk_norm_rope_bwd, key))


def _sizes(q, k, options: QkNormRopeOptions):
    """``(batch, seq, hq, hk, d, dims)`` of q and k in the options' layout."""
    dims = _DIMS[options.layout]
    return q.shape[0], q.shape[dims[1]], q.shape[dims[2]], k.shape[dims[2]], q.shape[3], dims


def _contiguous_like(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """New contiguous tensors of q's and k's shapes and dtypes: the outputs, or the inputs' gradients."""
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _table_strides(cos: torch.Tensor) -> tuple:
    """(batch, sequence) strides of the cos/sin rows: ``[S, D]`` and ``[1, S, D]`` broadcast."""
    st = cos.stride()
    return (0, st[0]) if cos.dim() == 2 else (st[0] if cos.shape[0] > 1 else 0, st[1])


def qk_norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, options: QkNormRopeOptions, *,
                     config: Optional[QkNormRopeConfig] = None, backward_config: Optional[QkNormRopeConfig] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_out, k_out, q_rstd, k_rstd)``: the outputs, contiguous in q's and k's shapes and
    dtypes, and each row's ``rstd`` (float32, ``[tokens, H]`` in ``[B, S]`` order). ``config``:
    the launch's tiles (tests and tuning), default ``qk_norm_rope_config``'s; ``backward_config``
    is the eager backward's (kept by the autograd node, unused here)."""
    bsz, seq, hq, hk, d, dims = _sizes(q, k, options)
    q_out, k_out = _contiguous_like(q, k)
    n_tokens = bsz * seq
    q_rstd = q.new_empty((n_tokens, hq), dtype=torch.float32)
    k_rstd = q.new_empty((n_tokens, hk), dtype=torch.float32)
    if n_tokens:
        config = config or qk_norm_rope_config("fwd", hq, hk, d, q.device)
        _FWD[QkNormRopeKey(hq, hk, d, config)](
            (cdiv(n_tokens, config.block_t),), q, k, q_out, k_out, q_rstd, k_rstd, q_weight, k_weight, cos, sin,
            n_tokens, seq, hq, hk, d, options.eps, *_bsh(q, dims), *_bsh(k, dims), *_bsh(q_out, dims),
            *_bsh(k_out, dims), *_table_strides(cos))
    return q_out, k_out, q_rstd, k_rstd


def qk_norm_rope_bwd(dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_rstd: torch.Tensor, k_rstd: torch.Tensor, options: QkNormRopeOptions, *,
                     config: Optional[QkNormRopeConfig] = None, out: Optional[tuple] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, d_q_weight, d_k_weight)`` from the outputs' gradients (unit last stride, any
    other strides): dq and dk contiguous in q's and k's dtypes, or written into ``out``'s two
    tensors of their shapes (unit last stride), the weights' gradients in their dtypes."""
    bsz, seq, hq, hk, d, dims = _sizes(q, k, options)
    dq, dk = out or _contiguous_like(q, k)
    n_tokens = bsz * seq
    if not n_tokens:
        return dq, dk, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    config = config or qk_norm_rope_config("bwd", hq, hk, d, q.device)
    programs = min(cdiv(n_tokens, config.block_t), persistent_programs(q.device, config.programs_per_sm))
    dwq = q.new_empty((programs, d), dtype=torch.float32)
    dwk = q.new_empty((programs, d), dtype=torch.float32)
    _BWD[QkNormRopeKey(hq, hk, d, config)](
        (programs,), dq_out, dk_out, q, k, dq, dk, q_rstd, k_rstd, q_weight, k_weight, cos, sin, dwq, dwk,
        n_tokens, seq, hq, hk, d, *_bsh(dq_out, dims), *_bsh(dk_out, dims), *_bsh(q, dims), *_bsh(k, dims),
        *_bsh(dq, dims), *_bsh(dk, dims), *_table_strides(cos))
    return dq, dk, dwq.sum(0).to(q_weight.dtype), dwk.sum(0).to(k_weight.dtype)


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::qk_norm_rope_fwd /
# _bwd). Saved: q, k, the weights, cos, sin and the rows' rstd.
# --------------------------------------------------------------------------------------------
def _fwd_fake(q, k, q_weight, k_weight, cos, sin, options: QkNormRopeOptions):
    bsz, seq, hq, hk, _, _ = _sizes(q, k, options)
    return (*_contiguous_like(q, k), q.new_empty((bsz * seq, hq), dtype=torch.float32),
            q.new_empty((bsz * seq, hk), dtype=torch.float32))


def _bwd_fake(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, options):
    return (*_contiguous_like(q, k), torch.empty_like(q_weight), torch.empty_like(k_weight))


def _upstream(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """An output's gradient as the backward kernel reads it: unit last stride, and zeros for an
    unused output (whose gradient comes as None under torch.compile and from autograd's Functions)."""
    return torch.zeros_like(like) if grad is None else _unit_last(grad)


def _setup(ctx, tensors, options, outputs, backward_config=None, **_):
    ctx.save_for_backward(*tensors, *outputs[2:])
    ctx.options, ctx.backward_config = options, backward_config


def _backward(ctx, bwd, dq_out, dk_out, *_):
    q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd = ctx.saved_tensors
    # an eager call's backward configuration (tuning); the custom op's backward takes none
    eager = {"config": ctx.backward_config} if getattr(ctx, "backward_config", None) else {}
    return bwd(_upstream(dq_out, q), _upstream(dk_out, k), q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd,
               ctx.options, **eager)


QK_NORM_ROPE = Op("qk_norm_rope", forward=qk_norm_rope_fwd, backward=_backward, grad_inputs=(0, 1, 2, 3),
                  setup=_setup, returns=2, once_differentiable=True, fake=_fwd_fake,
                  backward_launcher=qk_norm_rope_bwd, backward_fake=_bwd_fake)


class _QkvNormRope(torch.autograd.Function):
    """Eager: ``(q_out, k_out, v)`` of a fused projection's ``qkv [B, S, H, 3, D]``, ``v`` a view
    of it. The backward writes the gradients of q, k and v into one buffer of qkv's layout, where
    autograd's backward of ``unbind`` would stack three."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, options):
        q, k, v = qkv.unbind(3)
        q_out, k_out, q_rstd, k_rstd = qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, options)
        ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin, q_rstd, k_rstd)
        ctx.options = options
        return q_out, k_out, v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq_out, dk_out, dv):
        qkv, q_weight, k_weight, cos, sin, q_rstd, k_rstd = ctx.saved_tensors
        q, k, _ = qkv.unbind(3)
        dqkv = torch.empty_like(qkv)
        dq, dk, dv_in = dqkv.unbind(3)
        _, _, dwq, dwk = qk_norm_rope_bwd(_upstream(dq_out, q), _upstream(dk_out, k), q, k, q_weight, k_weight,
                                          cos, sin, q_rstd, k_rstd, ctx.options, out=(dq, dk))
        if dv is None:
            dv_in.zero_()
        else:
            dv_in.copy_(dv)
        return dqkv, dwq, dwk, None, None, None


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _check_args(q, k, q_weight, k_weight, cos, sin, eps, layout) -> None:
    check_tensor("q", q)
    for name, t in (("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)):
        check_tensor(name, t, like=q, like_name="q")
    if layout not in _DIMS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    order = ", ".join(layout.upper())
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [{order}], got shape {list(t.shape)}")
    dims = _DIMS[layout]
    bsz, seq, d = q.shape[0], q.shape[dims[1]], q.shape[3]
    if k.shape[3] != d or k.shape[0] != bsz or k.shape[dims[1]] != seq:
        raise ValueError(f"k (shape {list(k.shape)}) must have q's batch size {bsz}, sequence length {seq} and "
                         f"head_dim {d} (layout {layout!r})")
    if k.dtype != q.dtype:
        raise TypeError(f"k dtype {k.dtype} must equal q dtype {q.dtype}")
    if d % 2:
        raise ValueError(f"head_dim must be even (rotate_half pairs its halves), got {d}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,):
            raise ValueError(f"{name} must have shape [{d}] (head_dim), got {list(w.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos shape {list(cos.shape)} must equal sin shape {list(sin.shape)}")
    if not ((cos.dim() == 2 and cos.shape[0] == seq) or (cos.dim() == 3 and cos.shape[0] in (1, bsz)
                                                           and cos.shape[1] == seq)) or cos.shape[-1] != d:
        raise ValueError(f"cos/sin must be [S, D], [1, S, D] or [B, S, D] with B={bsz}, S={seq}, D={d}; "
                         f"got {list(cos.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, eps: float = 1e-6, layout: str = "bhsd"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of every head of q and k over ``head_dim``, then the rotary embedding, in one pass.

    ``rope(rms_norm(q, q_weight), cos, sin)`` and the same for k, as Qwen3 (``q_norm``,
    ``k_norm`` before ``apply_rotary_pos_emb``) and OLMo 2 compute them, with Hugging Face's
    ``rotate_half`` pairs over all ``head_dim`` features.

    Args:
        q: ``[B, Hq, S, D]`` (``layout="bhsd"``) or ``[B, S, Hq, D]`` (``"bshd"``),
            float32/bfloat16/float16 (float64 runs the reference); any strides with a unit last
            stride, e.g. a slice of a fused qkv projection. ``D`` even.
        k: the same with any ``Hk`` (GQA), q's dtype.
        q_weight, k_weight: ``[D]``, the norms' weights (any float dtype; their gradients come
            in it).
        cos, sin: the tokens' rows ``[S, D]``, ``[1, S, D]`` or ``[B, S, D]``, as Hugging
            Face's rotary embedding returns them (any float dtype).
        eps: added to the mean square.
        layout: ``"bhsd"`` or ``"bshd"``.

    Returns:
        ``(q_out, k_out)``, contiguous, in q's dtype: float32 arithmetic rounded once (the
        unfused ops round the normalised rows between norm and rotation). Differentiable in q,
        k and both weights; cos and sin get no gradient. A NaN stays in its row.
    """
    _check_args(q, k, q_weight, k_weight, cos, sin, eps, layout)
    return _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, layout)


def _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, layout):
    """``qk_norm_rope`` of checked arguments: the kernels, or the reference where they do not run."""
    if not use_kernels(q) or q.dtype == torch.float64 or q.numel() == 0 or k.numel() == 0:
        return reference.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=eps, layout=layout,
                                      compute_dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return QK_NORM_ROPE(_unit_last(q), _unit_last(k), q_weight, k_weight, _unit_last(cos), _unit_last(sin),
                        QkNormRopeOptions(float(eps), layout))


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, *, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope` of the q and k of a fused projection, and its v, with one gradient.

    ``qkv [B, S, H, 3, D]`` holds each head's q, k and v side by side (``qkv_proj(x).view(B, S, H,
    3, D)``). Returns ``(q_out, k_out, v)``: ``qk_norm_rope(q, k, ..., layout="bshd")`` and
    ``v = qkv[..., 2, :]`` (a view). Eagerly, the backward writes the gradients of q, k and v
    into one tensor of qkv's layout instead of three that autograd's backward of ``unbind`` then
    stacks: a pass over q's and k's gradients fewer. Under torch.compile, and where the kernels
    do not run, it is ``qk_norm_rope`` of ``qkv.unbind(3)``, whose gradients are the same.
    """
    check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[3] != 3:
        raise ValueError(f"qkv must be [B, S, H, 3, D], got shape {list(qkv.shape)}")
    q, k, v = qkv.unbind(3)
    _check_args(q, k, q_weight, k_weight, cos, sin, eps, "bshd")
    if (torch.compiler.is_compiling() or not use_kernels(qkv) or qkv.dtype == torch.float64 or qkv.numel() == 0
            or qkv.stride(-1) != 1 or not (torch.is_grad_enabled() and qkv.requires_grad)):
        return (*_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, "bshd"), v)
    return _QkvNormRope.apply(qkv, q_weight, k_weight, _unit_last(cos), _unit_last(sin),
                              QkNormRopeOptions(float(eps), "bshd"))
