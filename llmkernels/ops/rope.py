"""Rotary position embedding (RoPE): one kernel for the forward and the backward.

For each head row ``x [D]`` of q and k, with ``R = rotary_dim`` and per-token ``cos``/``sin``
rows of at least ``R`` features::

    y[:R] = x[:R] * cos[:R] + rot(x[:R]) * sin[:R]        y[R:] = x[R:]

``rot`` pairs the features and turns each pair ``(a, b)`` into ``(-b, a)``. Pairs are
``(i, i + R/2)`` in the Hugging Face / GPT-NeoX convention (``rotate_half``) and ``(2i, 2i + 1)``
in the GPT-J one (``interleaved=True``). Writing a pair's features as ``1`` and ``2``::

    forward:   y1 = x1 * c1 - x2 * s1      y2 = x2 * c2 + x1 * s2
    backward: dx1 = dy1 * c1 + dy2 * s2   dx2 = dy2 * c2 - dy1 * s1

so the backward is the forward with ``(s1, s2)`` replaced by ``(-s2, -s1)``: with Hugging
Face's tables (``s1 == s2``) it is the forward with the sine negated. One kernel does both
(``BACKWARD`` swaps the sines), so the gradient of the op is the op itself and double backward
comes for free. Arithmetic is fp32 whatever the input dtypes; each output is rounded once.

The kernel is memory bound: q and k are read once and written once. A program owns
``BLOCK_T`` tokens: it loads their cos/sin rows once (small tables, they stay in L2) and
reuses them for every head of q and then of k, ``BLOCK_H`` heads per step. Tensors are
addressed through their strides in a ``[B, S, H, D]`` view, so both layouts, GQA and slices of a
fused qkv projection run without copies (the last dimension needs unit stride).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from ._args import cdiv, check_tensor, is_dense, next_pow2
from ._device import device_of
from ._launch import PlanCache, launcher_of, use_kernels
from ._register import Op
from ._triton import tl, triton
# (rope_config: the family's default, importable from the family's module)
from .configs.rope import RopeConfig, rope_config, rope_tiles  # noqa: F401

LAYOUTS = ("bhsd", "bshd")

# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _rope_heads(X, Y, base_x, base_y, tok_mask, c1, s1, c2, s2, H, R, D, stride_xh, stride_yh,
                INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, PASS: tl.constexpr):
    """Rotate every head of the tokens whose element offsets are ``base_x`` (into ``base_y``),
    ``BLOCK_H`` heads at a time. ``base_*``: [BLOCK_T, 1, 1] int64; c1..s2: [BLOCK_T, 1, HALF]."""
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        row_mask = tok_mask & (heads < H)[None, :, None]
        px = X + base_x + heads.to(tl.int64)[None, :, None] * stride_xh
        py = Y + base_y + heads.to(tl.int64)[None, :, None] * stride_yh
        if INTERLEAVED:
            # Load whole rows (contiguous, vectorised) and split them into even/odd features.
            j = tl.arange(0, 2 * HALF)[None, None, :]
            mask = row_mask & (j < R)
            x = tl.load(px + j, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, HALF, 2]))
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            y = tl.reshape(tl.join(y1, y2), [BLOCK_T, BLOCK_H, 2 * HALF])
            tl.store(py + j, y.to(Y.dtype.element_ty), mask=mask)
        else:
            i = tl.arange(0, HALF)[None, None, :]
            mask = row_mask & (i < R // 2)
            x1 = tl.load(px + i, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(px + i + R // 2, mask=mask, other=0.0).to(tl.float32)
            tl.store(py + i, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
            tl.store(py + i + R // 2, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)
        if COPY_PASS:
            p = R + tl.arange(0, PASS)[None, None, :]
            mask = row_mask & (p < D)
            tl.store(py + p, tl.load(px + p, mask=mask).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    n_tokens, S, HQ, HK, R, D, max_pos,
    sqb, sqs, sqh, sob, sos, soh,
    skb, sks, skh, spb, sps, sph,
    scb, scs, spos_b, spos_s,
    HAS_K: tl.constexpr, HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    COPY_PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr, PASS: tl.constexpr,
):
    """Grid: one program per BLOCK_T tokens of the flattened [B, S]. q/k/outputs are addressed
    as [B, S, H, D] through (batch, seq, head) strides; cos/sin rows through (batch, seq) strides,
    or, with HAS_POS, row ``position_ids[b, s]`` of a [max_pos, >= R] table."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_valid = tok < n_tokens
    tok = tok.to(tl.int64)
    b = tok // S
    s = tok - b * S
    if HAS_POS:
        pos = tl.load(POS + b * spos_b + s * spos_s, mask=tok_valid, other=0).to(tl.int64)
        # The host checks the range; where it can't (torch.compile) a bad position gives NaN
        # rows instead of an out-of-bounds read.
        c_mask = (tok_valid & (pos >= 0) & (pos < max_pos))[:, None]
        c_row = pos * scs
    else:
        c_mask = tok_valid[:, None]
        c_row = b * scb + s * scs
    if INTERLEAVED:
        j = tl.arange(0, 2 * HALF)[None, :]
        m = c_mask & (j < R)
        cos = tl.load(COS + c_row[:, None] + j, mask=m, other=float("nan")).to(tl.float32)
        sin = tl.load(SIN + c_row[:, None] + j, mask=m, other=float("nan")).to(tl.float32)
        c1, c2 = tl.split(tl.reshape(cos, [BLOCK_T, HALF, 2]))
        s1, s2 = tl.split(tl.reshape(sin, [BLOCK_T, HALF, 2]))
    else:
        i = tl.arange(0, HALF)[None, :]
        m = c_mask & (i < R // 2)
        c1 = tl.load(COS + c_row[:, None] + i, mask=m, other=float("nan")).to(tl.float32)
        c2 = tl.load(COS + c_row[:, None] + i + R // 2, mask=m, other=float("nan")).to(tl.float32)
        s1 = tl.load(SIN + c_row[:, None] + i, mask=m, other=float("nan")).to(tl.float32)
        s2 = tl.load(SIN + c_row[:, None] + i + R // 2, mask=m, other=float("nan")).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1
    c1 = c1[:, None, :]
    c2 = c2[:, None, :]
    s1 = s1[:, None, :]
    s2 = s2[:, None, :]
    tok_mask = tok_valid[:, None, None]
    b = b[:, None, None]
    s = s[:, None, None]
    _rope_heads(Q, QO, b * sqb + s * sqs, b * sob + s * sos, tok_mask, c1, s1, c2, s2, HQ, R, D, sqh, soh,
                INTERLEAVED, COPY_PASS, BLOCK_T, BLOCK_HQ, HALF, PASS)
    if HAS_K:
        _rope_heads(K, KO, b * skb + s * sks, b * spb + s * sps, tok_mask, c1, s1, c2, s2, HK, R, D, skh, sph,
                    INTERLEAVED, COPY_PASS, BLOCK_T, BLOCK_HK, HALF, PASS)


# --------------------------------------------------------------------------------------------
# launch heuristics and launcher
# --------------------------------------------------------------------------------------------
class RopeOptions(NamedTuple):
    """The options of a rotation, named once: custom-op schemas, autograd context, plan keys."""

    interleaved: bool  # GPT-J's pairs (2i, 2i + 1), else rotate_half's (i, i + R / 2)
    rotary_dim: int  # R: the features rotated
    backward: bool  # rotate the other way (the op's derivative)
    q_dtype: torch.dtype  # q_out's (out of place)
    k_dtype: torch.dtype  # k_out's (out of place; q's without k)
    layout: str  # one of LAYOUTS


class RopeKey(NamedTuple):
    """What decides a launch (``config``: instead of ``rope_config``'s; ``copy_pass``: the
    features past R copied, out of place)."""

    n_tokens: int
    hq: int
    hk: int
    d: int
    has_k: bool
    has_pos: bool
    copy_pass: bool
    device_index: int
    options: RopeOptions
    config: Optional[RopeConfig]


def _plan(key: RopeKey):
    """(the Launcher, the grid) of one call's sizes and switches."""
    n_tokens, hq, hk, d, config, options = key.n_tokens, key.hq, key.hk, key.d, key.config, key.options
    config = config or rope_config(n_tokens, hq, hk, d, rope_tiles(d, hq, hk, device_of(key.device_index)))
    r = options.rotary_dim
    handle = launcher_of(_rope_kernel, HAS_K=key.has_k, HAS_POS=key.has_pos, INTERLEAVED=options.interleaved,
                      BACKWARD=options.backward, COPY_PASS=key.copy_pass, BLOCK_T=config.block_t,
                      BLOCK_HQ=config.block_hq, BLOCK_HK=config.block_hk, HALF=max(1, next_pow2(r // 2)),
                      PASS=max(1, next_pow2(d - r)), num_warps=config.num_warps)
    return handle, (cdiv(n_tokens, config.block_t),)


_PLANS = PlanCache(_plan)
_NO_STRIDES = (0, 0, 0, 0)
# Where batch, sequence and head are in q's dimensions, by layout.
_DIMS = {"bshd": (0, 1, 2), "bhsd": (0, 2, 1)}


def _bsh(t: torch.Tensor, dims: tuple) -> tuple:
    """(batch, sequence, head) strides of a ``[B, S, H, D]`` or ``[B, H, S, D]`` tensor."""
    st = t.stride()
    return st[dims[0]], st[dims[1]], st[dims[2]]


def rope_launch(q, k, cos, sin, position_ids, options: RopeOptions, q_out, k_out, *,
                config: Optional[RopeConfig] = None) -> None:
    """The launcher: rotate ``q [B, S, Hq, D]`` (and ``k [B, S, Hk, D]``, or None) into
    ``q_out``/``k_out`` of the same shapes (which may be q/k themselves), ``options.backward``
    rotating the other way (the op's derivative); with ``options.layout="bhsd"`` all four are
    ``[B, H, S, D]``. All are strided tensors with unit last stride. ``cos``/``sin``: ``[B or 1,
    S, >= R]`` (batch stride 0 broadcasts too) or ``[S, >= R]``, or with ``position_ids [B or 1,
    S]`` or ``[S]`` (int, strides may be 0) a ``[max_pos, >= R]`` table. ``config``: a
    :class:`RopeConfig` (tuning), default ``rope_config``'s of the device's ``rope_tiles``."""
    dims = _DIMS[options.layout]
    shape = q.shape
    bsz, seq, hq, d = shape[0], shape[dims[1]], shape[dims[2]], shape[3]
    hk = 0 if k is None else k.shape[dims[2]]
    n_tokens = bsz * seq
    if n_tokens == 0 or hq + hk == 0:
        return
    has_pos = position_ids is not None
    copy_pass = options.rotary_dim < d and q_out.data_ptr() != q.data_ptr()
    key = RopeKey(n_tokens, hq, hk, d, k is not None, has_pos, copy_pass, q.get_device(), options, config)
    handle, grid = _PLANS[key] if config is None else _plan(key)
    cs = cos.stride()
    if has_pos:
        ps = position_ids.stride()
        tables = (0, cs[0], *((0, ps[0]) if len(ps) == 1 else (ps[0] if position_ids.shape[0] > 1 else 0, ps[1])))
        max_pos = cos.shape[0]
    else:
        tables = (0, cs[0], 0, 0) if len(cs) == 2 else (cs[0] if cos.shape[0] > 1 else 0, cs[1], 0, 0)
        max_pos = 0
    handle(grid, q, q if k is None else k, q_out, q_out if k_out is None else k_out, cos, sin,
           cos if position_ids is None else position_ids, n_tokens, seq, hq, hk, options.rotary_dim, d, max_pos,
           *_bsh(q, dims), *_bsh(q_out, dims),
           *(_NO_STRIDES[:3] if k is None else _bsh(k, dims)), *(_NO_STRIDES[:3] if k is None else _bsh(k_out, dims)),
           *tables)


def _rope(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
          position_ids: Optional[torch.Tensor], options: RopeOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: ``(q_out, k_out)`` (``k_out`` None without k) in the options' dtypes, laid
    out like q and k where they are dense, else contiguous in ``[B, S, H, D]`` order."""
    q_out = _empty_like(q, options.q_dtype, options.layout)
    k_out = None if k is None else _empty_like(k, options.k_dtype, options.layout)
    rope_launch(q, k, cos, sin, position_ids, options, q_out, k_out)
    return q_out, k_out


def _empty_like(t, dtype, layout):
    """``t``'s shape in ``dtype``: t's strides where t is dense (judged from them, as the fake under
    torch.compile judges alike), else contiguous in the kernel's ``[B, S, H, D]`` order."""
    if t.is_contiguous() or is_dense(t):  # the first, in C++, spares the common case is_dense's ~1.6 µs
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    if layout == "bhsd":
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)
    return t.new_empty(t.shape, dtype=dtype)


# --------------------------------------------------------------------------------------------
# registration: llmkernels::rope, and rope_ in place. The derivative of the op is the op with
# BACKWARD flipped: its backward calls the op itself (double backward). cos, sin and
# position_ids get no gradient.
# --------------------------------------------------------------------------------------------
def _unit_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope_fake(q, k, cos, sin, position_ids, options: RopeOptions):
    return (_empty_like(q, options.q_dtype, options.layout),
            None if k is None else _empty_like(k, options.k_dtype, options.layout))


def _rope_setup(ctx, inputs, options: RopeOptions, outputs):
    ctx.save_for_backward(*inputs[2:])  # cos, sin, position_ids
    ctx.options, ctx.has_k = options, inputs[1] is not None
    ctx.shapes = (outputs[0].shape, outputs[1].shape if ctx.has_k else None)


def _rope_backward(ctx, rope, dq, dk):
    cos, sin, position_ids = ctx.saved_tensors
    options = ctx.options
    # The gradient of an unused output comes as zeros (eager) or None (torch.compile).
    if dq is None:
        dq = cos.new_zeros(ctx.shapes[0], dtype=options.q_dtype)
    if ctx.has_k and dk is None:
        dk = cos.new_zeros(ctx.shapes[1], dtype=options.k_dtype)
    dq, dk = rope(_unit_last(dq), _unit_last(dk) if ctx.has_k else None, cos, sin, position_ids,
                  options._replace(backward=not options.backward))
    return dq, (dk if ctx.has_k else None), None, None


ROPE = Op("rope", forward=_rope, setup=_rope_setup, backward=_rope_backward, grad_inputs=(0, 1, 2, 3),
          fake=_rope_fake)


def _rope_inplace(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  position_ids: Optional[torch.Tensor], options: RopeOptions) -> None:
    rope_launch(q, k, cos, sin, position_ids, options, q, k)


def _rope_inplace_setup(ctx, inputs, options: RopeOptions, outputs):
    ctx.save_for_backward(*inputs[2:])
    ctx.options = options


def _rope_inplace_backward(ctx, _, dy):
    dx, _ = ROPE(_unit_last(dy), None, *ctx.saved_tensors, ctx.options._replace(backward=True))
    return (dx,)


# In place (``options.backward`` False, the dtypes q's and k's). Autograd allows a Function that
# modifies a view in place to return only that tensor, so a call that needs a gradient rotates q
# and k in one call each (k None).
ROPE_INPLACE = Op("rope_", forward=_rope_inplace, setup=_rope_inplace_setup, backward=_rope_inplace_backward,
                  grad_inputs=(0, 1), mutates=("q", "k"), fake=lambda *args: None)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _check_rope_args(q, k, cos, sin, position_ids, layout, rotary_dim) -> int:
    """Validate (reading attributes only, except the range of position_ids); return rotary_dim."""
    check_tensor("q", q)
    dims = _DIMS.get(layout)
    if dims is None:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shape = q.shape
    if len(shape) != 4:
        raise ValueError(f"q must be 4-D [{', '.join(layout.upper())}], got shape {list(shape)}")
    bsz, seq, d = shape[0], shape[dims[1]], shape[3]
    if k is not None:
        check_tensor("k", k, like=q, like_name="q")
        k_shape = k.shape
        if len(k_shape) != 4:
            raise ValueError(f"k must be 4-D [{', '.join(layout.upper())}], got shape {list(k_shape)}")
        if k_shape[3] != d:
            raise ValueError(f"k's head_dim {k_shape[3]} must equal q's head_dim {d}")
        if k_shape[0] != bsz or k_shape[dims[1]] != seq:
            raise ValueError(f"k (shape {list(k_shape)}) must have q's batch size {bsz} and sequence length "
                             f"{seq} (layout {layout!r})")
    check_tensor("cos", cos, like=q, like_name="q")
    check_tensor("sin", sin, like=q, like_name="q")
    c_shape = cos.shape
    if c_shape != sin.shape:
        raise ValueError(f"cos shape {list(c_shape)} must equal sin shape {list(sin.shape)}")
    width = c_shape[-1] if c_shape else 0
    if rotary_dim is None:
        rotary_dim = width
    if type(rotary_dim) is not int and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool)):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={d}], got {rotary_dim}")
    if width != rotary_dim and width != d:
        raise ValueError(f"cos/sin last dim must be rotary_dim={rotary_dim} or head_dim={d}, got {width}")
    if position_ids is None:
        rows = len(c_shape)
        if not (rows == 2 and c_shape[0] == seq) and not (
                rows == 3 and (c_shape[0] == 1 or c_shape[0] == bsz) and c_shape[1] == seq):
            raise ValueError(f"cos/sin must be [S, {width}], [1, S, {width}] or [B, S, {width}] with B={bsz}, "
                             f"S={seq}; got {list(c_shape)} (pass position_ids to gather from a table)")
        return rotary_dim
    check_tensor("position_ids", position_ids, like=q, like_name="q", floating=False)
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}")
    p_shape = position_ids.shape
    if not (len(p_shape) == 1 and p_shape[0] == seq) and not (
            len(p_shape) == 2 and p_shape[1] == seq and p_shape[0] in (1, bsz)):
        raise ValueError(f"position_ids must be [S] or [B, S] with B={bsz}, S={seq}; got {list(p_shape)}")
    if len(c_shape) != 2:
        raise ValueError(f"with position_ids, cos/sin must be a [max_pos, {width}] table; got {list(c_shape)}")
    if position_ids.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(position_ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= c_shape[0]:
            raise ValueError(f"position_ids must lie in [0, {c_shape[0]}) (the cos/sin table's length); "
                             f"got values in [{lo}, {hi}]")
    return rotary_dim


def _apply_rope(q, k, cos, sin, position_ids, layout, interleaved, rotary_dim, inplace, q_dtype, k_dtype):
    rotary_dim = _check_rope_args(q, k, cos, sin, position_ids, layout, rotary_dim)
    if not use_kernels(q) or torch.float64 in (q.dtype, q_dtype) or (k is not None and k.dtype == torch.float64):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        if position_ids is not None:
            position_ids = (position_ids if position_ids.dim() == 2 else position_ids[None]).expand(
                q.shape[0], q.shape[_DIMS[layout][1]])
        q_out, k_out = reference.apply_rope(q, k, cos, sin, position_ids=position_ids, layout=layout,
                                            interleaved=interleaved, rotary_dim=rotary_dim, compute_dtype=compute)
        if inplace:
            q.copy_(q_out)
            if k is not None:
                k.copy_(k_out)
            return q, k
        return q_out.to(q_dtype), (None if k_out is None else k_out.to(k_dtype))
    if inplace and (q.stride(-1) != 1 or (k is not None and k.stride(-1) != 1)):
        raise ValueError("inplace=True needs q and k with unit stride along the last dimension")
    # The kernel reads q/k (either layout) and cos/sin through their strides, as they come.
    qu = _unit_last(q)
    ku = None if k is None else _unit_last(k)
    cos, sin = _unit_last(cos), _unit_last(sin)
    # (no None dtype in the schema: an absent k's is q's)
    options = RopeOptions(interleaved, rotary_dim, False, q_dtype, k_dtype or q_dtype, layout)
    if inplace:
        if not ROPE_INPLACE.needs_grad((qu, ku)):
            ROPE_INPLACE(qu, ku, cos, sin, position_ids, options)  # the launcher, or the custom op under torch.compile
            return q, k
        if not torch.compiler.is_compiling():
            ROPE_INPLACE(qu, None, cos, sin, position_ids, options)
            if ku is not None:  # (k as the q of its own call)
                ROPE_INPLACE(ku, None, cos, sin, position_ids, options._replace(q_dtype=k_dtype))
            return q, k
    q_out, k_out = ROPE(qu, ku, cos, sin, position_ids, options)
    if inplace:  # under torch.compile: out of place, for the custom op's autograd, then copied
        return q.copy_(q_out), (None if k is None else k.copy_(k_out))
    return q_out, (None if k is None else k_out)  # (under torch.compile an absent k comes back as a placeholder)


def apply_rope(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, *,
               position_ids: Optional[torch.Tensor] = None, layout: str = "bhsd", interleaved: bool = False,
               rotary_dim: Optional[int] = None, inplace: bool = False):
    """Apply rotary position embeddings to q and k.

    ``y[..., :R] = x[..., :R] * cos + rot(x[..., :R]) * sin`` and ``y[..., R:] = x[..., R:]``
    for every head, with ``R = rotary_dim`` and ``cos``/``sin`` the token's rows (their first R
    features). ``rot`` is Hugging Face's ``rotate_half`` (pairs ``(i, i + R/2)``), or GPT-J's
    ``(2i, 2i + 1)`` pairs with ``interleaved=True``.

    Args:
        q: ``[B, Hq, S, D]`` (``layout="bhsd"``, Hugging Face's) or ``[B, S, Hq, D]``
            (``"bshd"``); float32/bfloat16/float16 (float64 runs the reference). Any strides
            (e.g. a slice of a fused qkv projection) with a unit-stride last dimension.
        k: ``[B, Hk, S, D]`` or ``[B, S, Hk, D]`` with any Hk (GQA), or None to rotate q only.
        cos, sin: same shape, any float dtype (fp32 tables with bf16 q/k are fine): without
            ``position_ids`` the per-token rows ``[B, S, W]``, ``[1, S, W]`` or ``[S, W]``
            (broadcast over the batch), as Hugging Face's rotary embedding returns them; with
            ``position_ids`` a table ``[max_pos, W]``. ``W`` is ``rotary_dim`` or ``D``.
        position_ids: optional ``[B, S]`` or ``[S]`` integer positions: token ``(b, s)`` uses
            table row ``position_ids[b, s]``. Checked on the host (one device sync) to lie in
            ``[0, max_pos)``; under torch.compile the check is skipped and a bad position gives
            NaN for that token instead of an out-of-bounds read.
        layout: ``"bhsd"`` or ``"bshd"``.
        interleaved: GPT-J pairs ``(2i, 2i + 1)`` instead of ``rotate_half``.
        rotary_dim: features rotated (even, <= D); default the width of cos/sin. The other
            ``D - R`` features pass through unchanged.
        inplace: write the result into q and k and return them.

    Returns:
        ``(q_out, k_out)`` in q's and k's dtypes and shapes (``k_out`` None when k is None).
        Differentiable in q and k (the backward is the same kernel with the sines negated);
        cos, sin and position_ids receive no gradient.
    """
    return _apply_rope(q, k, cos, sin, position_ids, layout, interleaved, rotary_dim, inplace,
                       q.dtype if isinstance(q, torch.Tensor) else None,
                       k.dtype if isinstance(k, torch.Tensor) else None)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Drop-in for Hugging Face's ``apply_rotary_pos_emb`` (Llama and the models that copy it).

    ``q * cos.unsqueeze(unsqueeze_dim) + rotate_half(q) * sin.unsqueeze(unsqueeze_dim)`` and the
    same for k, with the same result dtype (torch's promotion of q's and cos's dtypes).
    ``unsqueeze_dim=1`` means q/k ``[B, H, S, D]``, ``2`` means ``[B, S, H, D]``; cos/sin are
    ``[B or 1, S, D]``. ``position_ids`` is ignored, as in transformers 4.38+, unless cos/sin
    are ``[max_pos, D]`` tables (transformers < 4.38): then rows ``position_ids`` are used.
    Calls the kernel when the inputs fit it, else computes Hugging Face's formula in torch (other
    shapes, or cos/sin that need a gradient).
    """
    _check_hf_rope_args(q, k, cos, sin, unsqueeze_dim, position_ids is not None and cos.dim() == 2)
    layout = _UNSQUEEZE_LAYOUTS.get(unsqueeze_dim)
    table = position_ids is not None and cos.dim() == 2
    fits = (layout is not None and q.dim() == 4 and (k is None or k.dim() == 4) and cos.shape[-1] == q.shape[-1]
            and (cos.dim() == 3 or table) and use_kernels(q)
            and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)))
    if not fits:
        if table:
            cos, sin = cos[position_ids], sin[position_ids]
        return reference.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    promoted = torch.promote_types
    return _apply_rope(q, k, cos, sin, position_ids if table else None, layout, False, None, False,
                       promoted(q.dtype, cos.dtype), None if k is None else promoted(k.dtype, cos.dtype))


_UNSQUEEZE_LAYOUTS = {1: "bhsd", -3: "bhsd", 2: "bshd", -2: "bshd"}


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _check_hf_rope_args(q, k, cos, sin, unsqueeze_dim, table: bool) -> None:
    """Hugging Face's formula takes any shapes that broadcast: TypeError / ValueError naming the
    argument where they don't, instead of torch's anonymous size mismatch."""
    check_tensor("q", q)
    if k is not None:
        check_tensor("k", k, like=q, like_name="q")
    check_tensor("cos", cos, like=q, like_name="q")
    check_tensor("sin", sin, like=q, like_name="q")
    if cos.shape != sin.shape:
        raise ValueError(f"cos shape {list(cos.shape)} must equal sin shape {list(sin.shape)}")
    if table:  # rows picked by position_ids: checked where they are gathered
        return
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or not -cos.dim() - 1 <= unsqueeze_dim <= cos.dim():
        raise ValueError(f"unsqueeze_dim must be an int in [{-cos.dim() - 1}, {cos.dim()}], got {unsqueeze_dim!r}")
    angles = cos.unsqueeze(unsqueeze_dim).shape
    for name, x in (("q", q), ("k", k)):
        if x is not None and not _broadcasts_to(angles, x.shape):
            raise ValueError(f"cos/sin of shape {list(cos.shape)} (unsqueezed at unsqueeze_dim={unsqueeze_dim}: "
                             f"{list(angles)}) do not broadcast to {name}'s shape {list(x.shape)}")
