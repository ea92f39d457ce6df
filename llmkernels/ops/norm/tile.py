"""The norm's arithmetic on tiles, shared by the forward and backward kernels: LayerNorm's
shifted variance, two sums in one reduction, the weight and bias loads, y from x_hat, and the
backward's x_hat and dW / dB terms."""
from __future__ import annotations

from .._launch import INTERPRET_CONST
from .._triton import tl, triton


@triton.jit
def shifted_var(mean_shifted, mean_sq_shifted):
    """A row's variance from the mean and mean square of its elements less a shift (the row's
    first element, so that the variance does not cancel when |mean| >> std), clamped at 0
    against rounding."""
    return tl.maximum(mean_sq_shifted - mean_shifted * mean_shifted, 0.0)


@triton.jit
def row_shift(X, RES, rows, mask, stride_x, stride_res, in_ty: tl.constexpr, HAS_RES: tl.constexpr):
    """The first element of each of ``rows`` of the norm's input (h = x + residual rounded to
    ``in_ty`` with a residual; 0 where masked off): LayerNorm's shift."""
    shift = tl.load(X + rows * stride_x, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        shift = (shift + tl.load(RES + rows * stride_res, mask=mask, other=0.0).to(tl.float32)).to(in_ty)
    return shift.to(tl.float32)


@triton.jit
def _add_pair(a0, b0, a1, b1):
    """Combine function of two sums taken in one reduction (``tl.reduce((a, b), axis, _add_pair)``):
    one pass through shared memory and its barriers instead of two."""
    return a0 + a1, b0 + b1


@triton.jit
def sum_pair(a, b, AXIS: tl.constexpr):
    """The sums of ``a`` and ``b`` along AXIS, in one reduction. (Triton's interpreter calls a
    tl.reduce combine function element by element in Python: a 257 x 5120 LayerNorm took two
    minutes in CI; there the two are summed by tl.sum, which it runs in NumPy.)"""
    if INTERPRET_CONST:
        sum_a = tl.sum(a, axis=AXIS)
        sum_b = tl.sum(b, axis=AXIS)
    else:
        sum_a, sum_b = tl.reduce((a, b), AXIS, _add_pair)
    return sum_a, sum_b


@triton.jit
def load_wb(W, B, w_offs, w_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """The weight and bias tiles at ``w_offs`` (0.0 where absent), as stored. Loaded as full
    [BLOCK_M, BLOCK_N] tiles (rows repeat from L1): a broadcast [1, BLOCK_N] row measured 10-25%
    slower on H100 (a layout conversion per tile)."""
    w = 0.0
    b = 0.0
    if HAS_W:
        w = tl.load(W + w_offs, mask=w_mask, other=0.0)
    if HAS_B:
        b = tl.load(B + w_offs, mask=w_mask, other=0.0)
    return w, b


@triton.jit
def scale_shift(x_hat, w, b, weight_offset, in_ty: tl.constexpr,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr):
    """y = q(x_hat) * (w + offset) + b in fp32, q = rounding to the input dtype (Llama)."""
    if ROUND_X_HAT:
        x_hat = x_hat.to(in_ty).to(tl.float32)
    y = x_hat
    if HAS_W:
        y = y * (w.to(tl.float32) + weight_offset)
    if HAS_B:
        y = y + b.to(tl.float32)
    return y


@triton.jit
def dy_terms(x_hat, dy, w, dw_acc, db_acc, in_ty: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              ROUND_X_HAT: tl.constexpr):
    """Backward per tile: returns ``w * dy`` (for the row dot products and dx) and the dW / dB
    accumulators plus this tile's ``dy * q(x_hat)`` / ``dy`` (q: Llama's rounding)."""
    wdy = dy
    if HAS_W:
        wdy = dy * w
        if ROUND_X_HAT:
            dw_acc += dy * x_hat.to(in_ty).to(tl.float32)
        else:
            dw_acc += dy * x_hat
    if HAS_B:
        db_acc += dy
    return wdy, dw_acc, db_acc


@triton.jit
def tile_x_hat(x, rows, row_mask, mask, MEAN, RSTD, IS_RMS: tl.constexpr):
    """x_hat of a tile of rows (fp32 ``x`` [BLOCK_M, BLOCK_N], 0 outside ``mask``) and the rows'
    rstd [BLOCK_M], from the forward's statistics."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        x_hat = x * rstd[:, None]
    else:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return x_hat, rstd
