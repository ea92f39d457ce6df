"""RMSNorm and LayerNorm: one forward and one backward kernel family for both.

Rows are the last dimension of ``x [..., N]``. Constexpr switches select RMS vs LayerNorm,
a fused residual add (``h = x + residual``), weight, bias, per-head weights ``[H, D]`` and
Llama's rounding of ``x_hat`` to the input dtype. Statistics and dW/dB accumulate in fp32;
``rstd`` (and ``mean``) are saved in fp32 for the backward.

Paths by row width:
  - one pass: the whole row (several rows for small N) sits in registers; x is read once.
  - split: rows wider than ``BWD_ONE_PASS_MAX`` (backward) or ``FWD_ONE_PASS_MAX`` (forward,
    the cases of ``FWD_SPLIT``; some from 16385) are shared by several programs, each
    holding a slice in registers, that exchange partial row sums through global memory; x (and
    dy) are read once from memory (the forward reads its slice a second time, from L2).
  - blocked: other forwards of rows wider than ``FWD_ONE_PASS_MAX`` loop over column chunks,
    reading the row a second time right after the first, from L2; a backward that cannot be
    split computes the two row dot products in a first kernel, then dx and dW per chunk.
The backward uses a persistent grid: each program loops over its rows, accumulating dW/dB in
fp32 registers, and writes one ``[programs, N]`` partial that a small sum reduces. At decode
sizes (few rows) each program instead also sums dW/dB over every row for its share of the
columns: one launch, no partials.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import reference
from ._launch import (INTERPRET_CONST, as_rows, cdiv, check_tensor, fit_stages, launch, next_pow2,
                      persistent_programs, pointer, row_stride, use_kernels)
from ._register import Op
from ._rowsplit import (collect, collect_pair, keep_packed, publish, publish_pair, resident_registers, row_slice,
                        split_grid)
from ._triton import tl, triton

# Widest row (elements) that the one-pass kernels keep in registers; wider rows take the
# blocked loop. Chosen by measurement on H100 (benchmarks/results).
FWD_ONE_PASS_MAX = 32768
BWD_ONE_PASS_MAX = 16384
FWD_BLOCKED = (1, 16384, 32, False)  # (BLOCK_M, column chunk, num_warps, one_pass)
# Rows of 2-byte elements up to this wide loop over half that chunk: H100, bf16, 256 MiB
# (tune-norm-h100-2026-11-23/14-*): LayerNorm 87.9 / 85.4% of copy at 40960 / 49152 (16384-element
# chunks: 70.9 / 80.0), RMSNorm 95.8 / 92.9 (77.6 / 85.7); at 65536 and wider the full chunk is
# faster (LayerNorm 82.5 against 78.7), and fp32 (add + RMSNorm) keeps it (97.8 / 93.7 at 40960 /
# 49152 against 95.6 / 92.1).
FWD_BLOCKED_HALF_CHUNK_MAX = 49152
BWD_BLOCKED = (4, 1024, 4, False, 4)  # (BLOCK_M, column chunk, num_warps, one_pass, programs/SM)
# Backward programs at most when the rows are few (decode sizes, M <= 256): a program a row up
# to this many, then 2 or 4 rows a program; each also writes dW/dB of its share of the columns
# (no partials, no second launch). H100 sweep (N = 4096, 4 warps for 1-2 rows a program, CUDA
# graphs, benchmarks/results/decode-h100-2026-11-24/): RMSNorm 3.3 / 3.5 / 4.4 / 6.2 us at
# M = 8 / 32 / 128 / 256 (partials summed by a second launch: 4.2 / 4.6 / 5.7 / 6.8).
BWD_DECODE_PROGRAMS = 64
# Backward rows too wide for the one-pass kernel are split across programs that exchange their
# partial row dot products (``_norm_bwd_split_kernel``), one program per SM so that every
# program of the grid is resident at once, which the exchange needs:
# (RMSNorm?, dtype) -> (columns per program, num_warps, stages: 0 the exchange in step, >= 2 a
# row ahead with the loads pipelined by Triton, weight slice kept packed: converted to fp32 where
# used, not held so). LLMKERNELS_ROW_SPLIT=0 turns the split off
# (``_rowsplit.split_grid``; the blocked loops then take every wide row).
# H100, 256 MiB (benchmarks/results/tune-norm-h100-2026-11-23/16-*): bf16 RMSNorm 94.5 / 92.8 /
# 92.3% of copy at 32768 / 65536 / 131072 (the exchange a row ahead with the next row in
# registers, as before: 76 / 73 / 75), bf16 LayerNorm 90.1 / 89.6 / 87.2 / 86.7 at 16384 ...
# 131072 (81 / 82 / 76 / 75), fp32 LayerNorm 96.0 / 97.4 / 97.3 at 16384 / 32768 / 65536 (94 /
# 86 / 91); fp32 RMSNorm 97.7 / 98.1 at 32768 / 65536 pipelined at 8 warps (in step 100.0 / 99.6;
# the in-step 16-warp entry shipped before read 86 / 86), fp32 add + RMSNorm 101.8 / 101.7 (in
# step 97.2 / 99.6; tune-norm-h100-2026-11-24/7-*). fp16 RMSNorm (Llama's
# rounding of x_hat to fp16) with its weight kept packed (``keep_packed``: 248 registers, no
# spill at 8 warps; held as fp32 it spilled 56 B), 93.6 / 92.2 / 92.3 at 32768 / 65536 / 131072
# (held: 75 / 74 / 71 at 8 warps, 93 / 91 / 88 at 32), fp16 add + RMSNorm 98.6 / 98.0 / 98.1
# (held: 94 / 92 / 91 at 16 warps; tune-norm-h100-2026-11-24/6-*). Kept packed, bf16 RMSNorm
# measured the same and bf16 LayerNorm 66-67 against 87-90: not there.
# The forward of rows wider than FWD_ONE_PASS_MAX likewise (``_norm_fwd_split_kernel``: the
# exchange a row ahead, each slice read again from L2 for y, that read issued before the wait on
# the siblings' sums), where measured faster than the blocked loop: (RMSNorm?, bytes per element,
# residual?) -> (columns per program, num_warps, programs per SM, narrowest row split, 0: wider
# than FWD_ONE_PASS_MAX; a 2-byte row that fills its power of two stays in one pass). Two-byte
# rows run two programs an SM: the loads of two 16 KB slices in flight (one is too little to cover
# the latency). LayerNorm's two sums go through one reduction into one slot (``publish_pair``) and
# its weight and bias are kept packed (``keep_packed``: 121 registers at 8 warps, no spill).
# H100, 256 MiB, % of copy (benchmarks/results/tune-norm-h100-2026-11-24/13-*), N = 36864 / 45056 /
# 65536 / 131072: bf16 LayerNorm 95.7 / 95.8 / 96.1 / 95.5 (the read after the wait: 92.5 / 92.2 /
# 94.4 / 94.1), fp16 96.2-96.4, fp32 97.1-99.0; bf16 RMSNorm 96.2 (blocked) / 96.2 / 96.6 / 95.8,
# fp16 96.8-97.2, fp32 97.7-99.0; 2-byte add + RMSNorm 96.7-98.1, fp32 96.8-99.3. fp32 add +
# RMSNorm rows up to 45056 are faster in the blocked loop (99.1 / 97.5 at 36864 / 40960 against
# 95.3 / 95.1; 2-byte RMSNorm there: 96.4 / 96.1 blocked, 95.8 / 96.1 split). RMSNorm and LayerNorm
# split from 16385, narrower than FWD_ONE_PASS_MAX, where the one-pass row's 32 warps leave part
# of a 32768 tile masked or hold fp32 (tune-norm-h100-2026-11-24/15-*, 16-*): bf16 LayerNorm 95.5 /
# 95.8 / 95.7 at 20480 / 24576 / 28672 (one pass: 80.8 / 89.7 / 94.0), RMSNorm 96.1 / 96.2 / 96.1
# (83.7 / 93.2 / 95.8); fp32 LayerNorm 95.2 / 98.6 / 97.2 / 98.8 at 20480 ... 32768 (95.1 / 93.5 /
# 92.9 / 91.7); a 2-byte row that fills its power of two stays in one pass (bf16 LayerNorm 97.1
# against 96.1 at 32768, RMSNorm 98.4).
FWD_SPLIT = {
    (True, 2, False): (8192, 8, 2, 16385),
    (True, 2, True): (8192, 4, 2, 0),
    (True, 4, False): (8192, 8, 1, 0),
    (True, 4, True): (8192, 8, 1, 49152),
    (False, 2, False): (8192, 8, 2, 16385),
    (False, 4, False): (8192, 8, 1, 16385),
}
# Rows that do not fill whole slices of the entry's columns: 2-byte rows then split into
# 4096-column slices, 4 warps, 4 programs an SM. H100, bf16, 256 MiB, % of copy
# (benchmarks/results/tune-norm-h100-2026-11-24/9-*, 13-*): LayerNorm 95.7 / 92.4 / 93.4 at
# N = 36864 / 70000 / 100000 (8192 x 8, 2 an SM, before the read was moved ahead of the wait: 89.5
# at 36864; after it 91.9 / 91.2 at 70000 / 100000); RMSNorm 93.0 / 93.9 at 70000 / 100000 against
# 93.2 / 92.6.
FWD_SPLIT_RAGGED = {
    (True, 2, False): (4096, 4, 4),
    (False, 2, False): (4096, 4, 4),
}
BWD_SPLIT = {
    (True, torch.bfloat16): (8192, 8, 3, False),
    (True, torch.float16): (8192, 8, 4, True),
    (True, torch.float32): (8192, 8, 3, False),
    (False, torch.bfloat16): (8192, 8, 3, False),
    (False, torch.float16): (8192, 8, 3, False),
    (False, torch.float32): (8192, 8, 4, False),
}


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _shifted_var(mean_shifted, mean_sq_shifted):
    """A row's variance from the mean and mean square of its elements less a shift (the row's
    first element, so that the variance does not cancel when |mean| >> std), clamped at 0
    against rounding."""
    return tl.maximum(mean_sq_shifted - mean_shifted * mean_shifted, 0.0)


@triton.jit
def _add_pair(a0, b0, a1, b1):
    """Combine function of two sums taken in one reduction (``tl.reduce((a, b), axis, _add_pair)``):
    one pass through shared memory and its barriers instead of two."""
    return a0 + a1, b0 + b1


@triton.jit
def _sum_pair(a, b, AXIS: tl.constexpr):
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
def _load_wb(W, B, w_offs, w_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
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
def _scale_shift(x_hat, w, b, weight_offset, in_ty: tl.constexpr,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANTIZE: tl.constexpr):
    """y = q(x_hat) * (w + offset) + b in fp32, q = rounding to the input dtype (Llama)."""
    if QUANTIZE:
        x_hat = x_hat.to(in_ty).to(tl.float32)
    y = x_hat
    if HAS_W:
        y = y * (w.to(tl.float32) + weight_offset)
    if HAS_B:
        y = y + b.to(tl.float32)
    return y


@triton.jit
def _norm_fwd_kernel(
    X, RES, W, B, Y, H, MEAN, RSTD,
    M, N, HEADS,
    stride_x, stride_res, stride_y, stride_h,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    PER_HEAD: tl.constexpr, QUANTIZE: tl.constexpr, STORE_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr, EARLY_W: tl.constexpr,
    TAIL_N: tl.constexpr = 0,
):
    """A tile of BLOCK_M rows a program (grid: cdiv(M, BLOCK_M)), whole in registers (ONE_PASS)
    or in BLOCK_N-column chunks read twice. EARLY_W (one-pass): the weight and bias are loaded
    with the row, not after its reduction, so that their latency overlaps. A one-pass tile is
    addressed from its first row's 64-bit offset plus 32-bit offsets within it (a one-row tile:
    the columns alone; rows of a tile several rows apart keep 64-bit offsets). TAIL_N (one-pass,
    N > BLOCK_N): the columns past BLOCK_N as a second, masked tile of TAIL_N (a power of two), so
    that a row of 5120 is 4096 + 1024 columns, not 8192 with 3072 masked."""
    # The norm's input dtype: the residual stream's when there is one.
    in_ty = H.dtype.element_ty if HAS_RES else X.dtype.element_ty
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:  # a program a row: its row exists
        row_mask = tl.full([BLOCK_M], 1, tl.int1)
    else:
        row_mask = rows < M
    rows64 = rows.to(tl.int64)
    if PER_HEAD:
        w_row = (rows % HEADS).to(tl.int64)[:, None] * N
    else:
        w_row = tl.zeros([BLOCK_M, 1], dtype=tl.int64)
    if ONE_PASS:
        row0 = tile.to(tl.int64) * BLOCK_M
        in_tile = tl.arange(0, BLOCK_M)[:, None]
        if BLOCK_M > 1:
            in_tile = in_tile.to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        if TAIL_N:  # the first BLOCK_N columns are all there; the tail's are masked
            mask = row_mask[:, None] & (cols < BLOCK_N)[None, :]
            t_cols = BLOCK_N + tl.arange(0, TAIL_N)
            t_mask = row_mask[:, None] & (t_cols < N)[None, :]
        else:
            mask = row_mask[:, None] & (cols < N)[None, :]
        x, w, b = _fwd_tile_in(X, RES, H, W, B, row0, in_tile, w_row, cols, mask, stride_x, stride_res, stride_h,
                               in_ty, HAS_RES, HAS_W, HAS_B, EARLY_W)
        if TAIL_N:
            t_x, t_w, t_b = _fwd_tile_in(X, RES, H, W, B, row0, in_tile, w_row, t_cols, t_mask, stride_x, stride_res,
                                         stride_h, in_ty, HAS_RES, HAS_W, HAS_B, EARLY_W)
        if IS_RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            sum_sq = tl.sum(x * x, axis=1)
            if TAIL_N:
                sum_sq += tl.sum(t_x * t_x, axis=1)
            rstd = tl.rsqrt(sum_sq / N + eps)
        else:
            # Sum and sum of squares in one reduction (not the mean then the centred squares in
            # sequence, nor two reductions each with its own shared-memory exchange), shifted by
            # the row's first element as in the blocked loop so that the variance does not
            # cancel when |mean| >> std.
            shift = tl.load(X + rows64 * stride_x, mask=row_mask, other=0.0).to(tl.float32)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            sum_shifted, sum_sq = _sum_pair(xs, xs * xs, 1)
            if TAIL_N:
                t_xs = tl.where(t_mask, t_x - shift[:, None], 0.0)
                t_sum_shifted, t_sum_sq = _sum_pair(t_xs, t_xs * t_xs, 1)
                sum_shifted += t_sum_shifted
                sum_sq += t_sum_sq
            mean_shifted = sum_shifted / N
            mean = shift + mean_shifted
            rstd = tl.rsqrt(_shifted_var(mean_shifted, sum_sq / N) + eps)
            x = xs - mean_shifted[:, None]  # x - mean, from xs: x itself need not stay live
            if TAIL_N:
                t_x = t_xs - mean_shifted[:, None]
        if STORE_STATS:
            _store_stats(MEAN, RSTD, rows, row_mask, mean, rstd, IS_RMS)
        _fwd_tile_out(Y, W, B, x, w, b, rstd, row0, in_tile, w_row, cols, mask, stride_y, weight_offset, in_ty,
                      HAS_W, HAS_B, QUANTIZE, EARLY_W)
        if TAIL_N:
            _fwd_tile_out(Y, W, B, t_x, t_w, t_b, rstd, row0, in_tile, w_row, t_cols, t_mask, stride_y, weight_offset,
                          in_ty, HAS_W, HAS_B, QUANTIZE, EARLY_W)
    else:
        # Pass 1: sum and sum of squares, shifted by the row's first element so that the
        # LayerNorm variance does not cancel when |mean| >> std.
        if IS_RMS:
            shift = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            shift = tl.load(X + rows64 * stride_x, mask=row_mask, other=0.0).to(tl.float32)
        acc_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            if HAS_RES:
                r = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
                h = (x + r.to(tl.float32)).to(in_ty)
                tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask,
                         eviction_policy="evict_last")
                x = h.to(tl.float32)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            acc_sum += xs
            acc_sq += xs * xs
        if IS_RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            var = tl.sum(acc_sq, axis=1) / N
        else:
            mean_shifted = tl.sum(acc_sum, axis=1) / N
            mean = shift + mean_shifted
            var = _shifted_var(mean_shifted, tl.sum(acc_sq, axis=1) / N)
        rstd = tl.rsqrt(var + eps)
        if STORE_STATS:
            _store_stats(MEAN, RSTD, rows, row_mask, mean, rstd, IS_RMS)
        # Pass 2: normalize; the row was just read, so most of it comes back from L2.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            if HAS_RES:
                x = tl.load(H + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
            w, b = _load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
            y = _scale_shift((x - mean[:, None]) * rstd[:, None], w, b, weight_offset, in_ty, HAS_W, HAS_B,
                             QUANTIZE)
            tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_tile_in(X, RES, H, W, B, row0, in_tile, w_row, cols, mask, stride_x, stride_res, stride_h,
                 in_ty: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                 EARLY_W: tl.constexpr):
    """A one-pass tile's columns ``cols``: x in fp32 (x + residual, stored to H, with a residual),
    and with EARLY_W the weight and bias (else 0.0: loaded by ``_fwd_tile_out``)."""
    x = tl.load(X + row0 * stride_x + (in_tile * stride_x + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
    w = 0.0
    b = 0.0
    if EARLY_W:
        w, b = _load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
    if HAS_RES:
        r = tl.load(RES + row0 * stride_res + (in_tile * stride_res + cols[None, :]), mask=mask, other=0.0)
        h = (x + r.to(tl.float32)).to(in_ty)
        tl.store(H + row0 * stride_h + (in_tile * stride_h + cols[None, :]), h, mask=mask)
        x = h.to(tl.float32)
    return x, w, b


@triton.jit
def _fwd_tile_out(Y, W, B, x_centred, w, b, rstd, row0, in_tile, w_row, cols, mask, stride_y, weight_offset,
                  in_ty: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANTIZE: tl.constexpr,
                  EARLY_W: tl.constexpr):
    """y of a one-pass tile's columns ``cols`` from x - mean (x for RMSNorm) and the rows' rstd."""
    if not EARLY_W:
        w, b = _load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
    y = _scale_shift(x_centred * rstd[:, None], w, b, weight_offset, in_ty, HAS_W, HAS_B, QUANTIZE)
    tl.store(Y + row0 * stride_y + (in_tile * stride_y + cols[None, :]), y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _store_stats(MEAN, RSTD, rows, row_mask, mean, rstd, IS_RMS: tl.constexpr):
    """The rows' statistics where ``row_mask``, stored as soon as they are known (before y)."""
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_mask)


@triton.jit
def _norm_fwd_split_kernel(
    X, RES, W, B, Y, H, MEAN, RSTD, SLOTS,
    M, N,
    stride_x, stride_res, stride_y, stride_h,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    QUANTIZE: tl.constexpr, STORE_STATS: tl.constexpr,
    PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
):
    """Forward of rows too wide for one program: ``PARTS`` programs share each row, each taking a
    ``BLOCK_N``-column slice and holding its weight (and bias) in registers. The row loop runs a
    row ahead: the iteration that loads row r + 1's slice publishes row r's sums (RMSNorm: sum of
    squares; LayerNorm: sum of squares and sum, shifted by the row's first element as the other
    paths do; both in one slot) to ``SLOTS [M, PARTS]`` (int64, zeroed; see ``publish``/``collect``),
    then collects row r - 1's sums, which its siblings published an iteration before, and writes its
    slice of y, reading the slice again (from L2, where the first read left it: ``evict_last``;
    y streams out with ``evict_first``). That read is issued before the wait on the siblings' sums,
    so that its latency and the wait overlap. With a residual, h = x + residual is written when
    published and read back for y. Two slices (the one loading, the one published) are all a
    program holds across iterations, so that two programs fit an SM. Part 0 writes the row's
    statistics. EVEN: N is a multiple of BLOCK_N (no masked columns to keep out of the sums).
    Grid: (groups * PARTS,), all resident at once; group g takes rows g, g + groups, ..."""
    part = tl.program_id(0) % PARTS
    group = tl.program_id(0) // PARTS
    groups = tl.num_programs(0) // PARTS
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    in_ty = H.dtype.element_ty if HAS_RES else X.dtype.element_ty
    w, b = _load_wb(W, B, cols, mask, HAS_W, HAS_B)
    slot_idx = tl.arange(0, PARTS_POW2)
    slot_mask = slot_idx < PARTS
    row = group + tl.zeros([], dtype=tl.int64)  # the row published this iteration
    # x is read again for y (h, with a residual, is what is read again)
    x_evict_last: tl.constexpr = not HAS_RES
    x_next = row_slice(X, row, stride_x, cols, M, N, 0.0, x_evict_last)
    if HAS_RES:
        r_next = row_slice(RES, row, stride_res, cols, M, N, 0.0)
    if not IS_RMS:
        shift_next = _fwd_split_shift(X, RES, row, stride_x, stride_res, M, in_ty, HAS_RES)
    shift_now = 0.0
    shift_prev = 0.0
    for _ in range(group, M + groups, groups):
        x_now = x_next
        x_next = row_slice(X, row + groups, stride_x, cols, M, N, 0.0, x_evict_last)
        if HAS_RES:
            x_now = (x_now.to(tl.float32) + r_next.to(tl.float32)).to(in_ty)
            r_next = row_slice(RES, row + groups, stride_res, cols, M, N, 0.0)
        if not IS_RMS:
            shift_now = shift_next
            shift_next = _fwd_split_shift(X, RES, row + groups, stride_x, stride_res, M, in_ty, HAS_RES)
        if row < M:
            if HAS_RES:
                tl.store(H + row * stride_h + cols, x_now, mask=mask, eviction_policy="evict_last")
            _fwd_split_publish(x_now.to(tl.float32), shift_now, mask, SLOTS + row * PARTS + part, IS_RMS, EVEN)
        if row >= groups:
            _fwd_split_write(row - groups, shift_prev, part, SLOTS, slot_idx, slot_mask, w, b, X, H, Y, MEAN, RSTD,
                             cols, mask, N, stride_x, stride_h, stride_y, eps, weight_offset, in_ty, PARTS, IS_RMS,
                             HAS_RES, HAS_W, HAS_B, QUANTIZE, STORE_STATS)
        shift_prev = shift_now
        row += groups


@triton.jit
def _fwd_split_shift(X, RES, row, stride_x, stride_res, M, in_ty: tl.constexpr, HAS_RES: tl.constexpr):
    """The row's first element (of h with a residual), by which LayerNorm's sums are shifted so
    that its variance does not cancel when |mean| >> std; 0 past the last row."""
    shift = tl.load(X + row * stride_x, mask=row < M, other=0.0).to(tl.float32)
    if HAS_RES:
        shift = (shift + tl.load(RES + row * stride_res, mask=row < M, other=0.0).to(tl.float32)).to(in_ty)
    return shift.to(tl.float32)


@triton.jit
def _fwd_split_publish(x, shift, mask, SLOT, IS_RMS: tl.constexpr, EVEN: tl.constexpr):
    """Publish a row slice's sums (fp32 ``x``): RMSNorm its sum of squares; LayerNorm its sum of
    squares and sum, shifted by ``shift``."""
    if IS_RMS:
        publish(SLOT, tl.sum(x * x, axis=0))
    else:
        xs = x - shift
        if not EVEN:
            xs = tl.where(mask, xs, 0.0)
        sum_sq, total = _sum_pair(xs * xs, xs, 0)
        publish_pair(SLOT, sum_sq, total)


@triton.jit
def _fwd_split_write(row, shift, part, SLOTS, slot_idx, slot_mask, w, b, X, H, Y, MEAN, RSTD, cols, mask, N,
                     stride_x, stride_h, stride_y, eps, weight_offset, in_ty: tl.constexpr, PARTS: tl.constexpr,
                     IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     QUANTIZE: tl.constexpr, STORE_STATS: tl.constexpr):
    """Read row ``row``'s slice again (x, or h with a residual), collect the row's sums from its
    slots and write y of the slice (part 0: and the row's statistics). The read goes first: it
    is in flight while the program waits on the slots (H100, bf16, 65536 / 131072: LayerNorm 95.9 /
    95.3% of copy against 94.4 / 94.1 read after the wait; RMSNorm 96.4 / 95.7 against 95.1 / 94.9)."""
    if HAS_RES:
        x = tl.load(H + row * stride_h + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    if IS_RMS:
        sums_sq = collect(SLOTS + row * PARTS + slot_idx, slot_mask)
    else:
        sums_sq, sums = collect_pair(SLOTS + row * PARTS + slot_idx, slot_mask)
    x = x.to(tl.float32)
    if HAS_W:
        w = keep_packed(w)
    if HAS_B:
        b = keep_packed(b)
    if IS_RMS:
        mean = 0.0
        var = tl.sum(sums_sq, axis=0) / N
    else:
        mean_shifted = tl.sum(sums, axis=0) / N
        var = _shifted_var(mean_shifted, tl.sum(sums_sq, axis=0) / N)
        mean = shift + mean_shifted
        x = x - mean  # columns past N: not stored
    rstd = tl.rsqrt(var + eps)
    if STORE_STATS:
        _store_stats(MEAN, RSTD, row, part == 0, mean, rstd, IS_RMS)
    y = _scale_shift(x * rstd, w, b, weight_offset, in_ty, HAS_W, HAS_B, QUANTIZE)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _norm_bwd_dots_kernel(
    X, W, DY, MEAN, RSTD, DOTS,
    N, HEADS, stride_x, stride_dy, weight_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, PER_HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Blocked backward, step 1: per row, mean(x_hat * w*dy) and mean(w*dy) over the row."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(RSTD + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + row)
    w_row = 0
    if PER_HEAD:
        w_row = (row % HEADS) * N
    acc_xw = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            dy = dy * (tl.load(W + w_row + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
        acc_xw += tl.where(mask, (x - mean) * rstd, 0.0) * dy
        acc_w += dy
    tl.store(DOTS + 2 * row, tl.sum(acc_xw, axis=0) / N)
    tl.store(DOTS + 2 * row + 1, tl.sum(acc_w, axis=0) / N)


@triton.jit
def _dy_terms(x_hat, dy, w, dw_acc, db_acc, in_ty: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              QUANTIZE: tl.constexpr):
    """Backward per tile: returns ``w * dy`` (for the row dot products and dx) and the dW / dB
    accumulators plus this tile's ``dy * q(x_hat)`` / ``dy`` (q: Llama's rounding)."""
    wdy = dy
    if HAS_W:
        wdy = dy * w
        if QUANTIZE:
            dw_acc += dy * x_hat.to(in_ty).to(tl.float32)
        else:
            dw_acc += dy * x_hat
    if HAS_B:
        db_acc += dy
    return wdy, dw_acc, db_acc


@triton.jit
def _tile_x_hat(x, rows, row_mask, mask, MEAN, RSTD, IS_RMS: tl.constexpr):
    """x_hat of a tile of rows (fp32 ``x`` [BLOCK_M, BLOCK_N], 0 outside ``mask``) and the rows'
    rstd [BLOCK_M], from the forward's statistics."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        x_hat = x * rstd[:, None]
    else:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    return x_hat, rstd


@triton.jit
def _tile_load(X, DY, tile, rows_per_head, HEADS, head, cols, col_mask, stride_x, stride_dy, BLOCK_M: tl.constexpr):
    """x and dy of a tile of rows, in the input dtype (nothing read past the last row)."""
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = i.to(tl.int64) * HEADS + head
    mask = (i < rows_per_head)[:, None] & col_mask[None, :]
    return (tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0),
            tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0))


@triton.jit
def _norm_bwd_kernel(
    X, W, DY, DH, DX, DRES, DW_PART, DB_PART, MEAN, RSTD, DOTS,
    rows_per_head, N, HEADS,
    stride_x, stride_dy, stride_dh, stride_dx, stride_dres,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr, QUANTIZE: tl.constexpr, PRECOMPUTED_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
    DW_COLS: tl.constexpr, DW_ROWS: tl.constexpr, TAIL_N: tl.constexpr = 0,
):
    """dx (and dresidual), and this program's partial dW/dB over the rows it owns; with DW_COLS
    (one head and column chunk: decode sizes), instead of partials, dW/dB themselves (DW_PART /
    DB_PART, their dtypes) for columns [p * DW_COLS, (p + 1) * DW_COLS) over every row: those
    need x and dy but not dx, so no program waits for another and no second launch sums
    partials (``_sum_partials_kernel``, 2 us more inside a CUDA graph on H100).

    Grid: (programs, heads, column chunks). Program p of head h owns rows
    ``(i * HEADS + h)`` for ``i`` in tiles p, p + programs, ... With one column chunk the row
    dot products are computed here; with several they come from ``_norm_bwd_dots_kernel``.
    PREFETCH 1: a program issues its next tile's loads before it reduces the current one;
    k >= 2: Triton pipelines the row loop in k stages, its loads copied asynchronously into
    shared memory k - 1 tiles ahead (no registers held for them); 0: neither.
    The weight is loaded again for every tile (from L1, kept there with ``evict_last``) rather
    than held across the loop: its registers are what the 16384-column tile was spilling.
    TAIL_N (one column chunk, N > BLOCK_N): the columns past BLOCK_N as a second, masked tile of
    TAIL_N columns with its own loads and dW / dB accumulators (10240 = 8192 + 2048).
    """
    prog = tl.program_id(0)
    n_progs = tl.num_programs(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if TAIL_N:  # (one column chunk) the first BLOCK_N columns are all there; the tail's are masked
        col_mask = cols < BLOCK_N
        t_cols = BLOCK_N + tl.arange(0, TAIL_N)
        t_col_mask = t_cols < N
        t_dw_acc = tl.zeros([BLOCK_M, TAIL_N], dtype=tl.float32)
        t_db_acc = tl.zeros([BLOCK_M, TAIL_N], dtype=tl.float32)
    else:
        col_mask = cols < N
    in_ty = X.dtype.element_ty
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH == 1:
        x_next, dy_next = _tile_load(X, DY, prog, rows_per_head, HEADS, head, cols, col_mask, stride_x, stride_dy,
                                     BLOCK_M)
        if TAIL_N:
            t_x_next, t_dy_next = _tile_load(X, DY, prog, rows_per_head, HEADS, head, t_cols, t_col_mask, stride_x,
                                             stride_dy, BLOCK_M)
    for tile in tl.range(prog, tl.cdiv(rows_per_head, BLOCK_M), n_progs, num_stages=max(PREFETCH, 1)):
        if PREFETCH == 1:
            x, dy = x_next, dy_next
            x_next, dy_next = _tile_load(X, DY, tile + n_progs, rows_per_head, HEADS, head, cols, col_mask,
                                         stride_x, stride_dy, BLOCK_M)
            if TAIL_N:
                t_x, t_dy = t_x_next, t_dy_next
                t_x_next, t_dy_next = _tile_load(X, DY, tile + n_progs, rows_per_head, HEADS, head, t_cols,
                                                 t_col_mask, stride_x, stride_dy, BLOCK_M)
        else:
            x, dy = _tile_load(X, DY, tile, rows_per_head, HEADS, head, cols, col_mask, stride_x, stride_dy, BLOCK_M)
            if TAIL_N:
                t_x, t_dy = _tile_load(X, DY, tile, rows_per_head, HEADS, head, t_cols, t_col_mask, stride_x,
                                       stride_dy, BLOCK_M)
        x, dy, w = _bwd_tile_in(x, dy, W, head, N, cols, col_mask, weight_offset, HAS_W)
        if TAIL_N:
            t_x, t_dy, t_w = _bwd_tile_in(t_x, t_dy, W, head, N, t_cols, t_col_mask, weight_offset, HAS_W)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = i < rows_per_head
        rows = i.to(tl.int64) * HEADS + head
        x_hat, wdy, rstd, mask, dw_acc, db_acc = _bwd_tile_terms(
            x, dy, w, MEAN, RSTD, rows, row_mask, col_mask, dw_acc, db_acc, in_ty, IS_RMS, HAS_W, HAS_B, QUANTIZE)
        if TAIL_N:
            t_x_hat, t_wdy, _, t_mask, t_dw_acc, t_db_acc = _bwd_tile_terms(
                t_x, t_dy, t_w, MEAN, RSTD, rows, row_mask, t_col_mask, t_dw_acc, t_db_acc, in_ty, IS_RMS, HAS_W,
                HAS_B, QUANTIZE)
        if PRECOMPUTED_DOTS:
            mean_xw = tl.load(DOTS + 2 * rows, mask=row_mask, other=0.0)
            mean_w = tl.load(DOTS + 2 * rows + 1, mask=row_mask, other=0.0)
        elif not IS_RMS:  # LayerNorm's two row sums in one reduction (a tail's in another)
            sum_xw, sum_w = _sum_pair(x_hat * wdy, wdy, 1)
            if TAIL_N:
                t_sum_xw, t_sum_w = _sum_pair(t_x_hat * t_wdy, t_wdy, 1)
                sum_xw += t_sum_xw
                sum_w += t_sum_w
            mean_xw, mean_w = sum_xw / N, sum_w / N
        else:  # (RMSNorm does not use mean_w)
            sum_xw = tl.sum(x_hat * wdy, axis=1)
            if TAIL_N:
                sum_xw += tl.sum(t_x_hat * t_wdy, axis=1)
            mean_xw = sum_xw / N
            mean_w = tl.sum(wdy, axis=1) / N
        _bwd_tile_dx(x_hat, wdy, rstd, mean_xw, mean_w, DH, DX, DRES, rows, cols, mask, stride_dh, stride_dx,
                     stride_dres, IS_RMS, HAS_DH, HAS_DRES)
        if TAIL_N:
            _bwd_tile_dx(t_x_hat, t_wdy, rstd, mean_xw, mean_w, DH, DX, DRES, rows, t_cols, t_mask, stride_dh,
                         stride_dx, stride_dres, IS_RMS, HAS_DH, HAS_DRES)
    if DW_COLS:
        _dw_db_cols(X, DY, MEAN, RSTD, DW_PART, DB_PART, rows_per_head, N, stride_x, stride_dy,
                    prog * DW_COLS + tl.arange(0, DW_COLS), in_ty, IS_RMS, HAS_W, HAS_B, QUANTIZE, DW_ROWS)
    else:
        part = prog.to(tl.int64) * HEADS * N + head * N
        _store_col_sums(DW_PART, DB_PART, part + cols, dw_acc, db_acc, col_mask, HAS_W, HAS_B)
        if TAIL_N:
            _store_col_sums(DW_PART, DB_PART, part + t_cols, t_dw_acc, t_db_acc, t_col_mask, HAS_W, HAS_B)


@triton.jit
def _bwd_tile_in(x, dy, W, head, N, cols, col_mask, weight_offset, HAS_W: tl.constexpr):
    """x and dy of a tile (as loaded) in fp32, and the weight (+ offset) of its columns ``cols``."""
    x, dy = x.to(tl.float32), dy.to(tl.float32)
    w = 0.0  # unused without a weight
    if HAS_W:
        w = tl.load(W + head * N + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
        w = w.to(tl.float32) + weight_offset
    return x, dy, w


@triton.jit
def _bwd_tile_terms(x, dy, w, MEAN, RSTD, rows, row_mask, col_mask, dw_acc, db_acc, in_ty: tl.constexpr,
                    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANTIZE: tl.constexpr):
    """The one-pass backward on a tile's columns: x_hat, w * dy, the rows' rstd, the tile's mask
    and the dW / dB accumulators with this tile added."""
    mask = row_mask[:, None] & col_mask[None, :]
    x_hat, rstd = _tile_x_hat(x, rows, row_mask, mask, MEAN, RSTD, IS_RMS)
    wdy, dw_acc, db_acc = _dy_terms(x_hat, dy, w, dw_acc, db_acc, in_ty, HAS_W, HAS_B, QUANTIZE)
    return x_hat, wdy, rstd, mask, dw_acc, db_acc


@triton.jit
def _bwd_tile_dx(x_hat, wdy, rstd, mean_xw, mean_w, DH, DX, DRES, rows, cols, mask, stride_dh, stride_dx, stride_dres,
                 IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr):
    """dx (+ dh) of a tile's columns ``cols``, stored to DX (and DRES)."""
    if IS_RMS:
        dx = (wdy - x_hat * mean_xw[:, None]) * rstd[:, None]
    else:
        dx = (wdy - x_hat * mean_xw[:, None] - mean_w[:, None]) * rstd[:, None]
    if HAS_DH:
        dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + rows[:, None] * stride_dres + cols[None, :], dx.to(DRES.dtype.element_ty), mask=mask)


@triton.jit
def _store_col_sums(DW, DB, offs, acc_w, acc_b, col_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """dW / dB (or a program's partials of them) at ``offs``: the accumulators summed over their
    rows (axis 0), in DW's / DB's dtypes."""
    if HAS_W:
        tl.store(DW + offs, tl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_B:
        tl.store(DB + offs, tl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=col_mask)


@triton.jit
def _dw_db_cols(X, DY, MEAN, RSTD, DW, DB, M, N, stride_x, stride_dy, cols, in_ty: tl.constexpr,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, QUANTIZE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """dW = sum over the M rows of dy * q(x_hat), dB = sum of dy, at columns ``cols`` (one head),
    BLOCK_M rows a step, stored in DW's / DB's dtypes."""
    col_mask = cols < N
    dw_acc = tl.zeros([BLOCK_M, cols.shape[0]], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, cols.shape[0]], dtype=tl.float32)
    for tile in range(0, tl.cdiv(M, BLOCK_M)):
        x, dy = _tile_load(X, DY, tile, M, 1, 0, cols, col_mask, stride_x, stride_dy, BLOCK_M)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        x_hat, _ = _tile_x_hat(x, rows, row_mask, row_mask[:, None] & col_mask[None, :], MEAN, RSTD, IS_RMS)
        _, dw_acc, db_acc = _dy_terms(x_hat, dy, 0.0, dw_acc, db_acc, in_ty, HAS_W, HAS_B, QUANTIZE)
    _store_col_sums(DW, DB, cols, dw_acc, db_acc, col_mask, HAS_W, HAS_B)


@triton.jit
def _split_load(X, DY, row, stride_x, stride_dy, cols, M, N):
    """One row's slice of x and dy, in the input dtype; zeros for a row past the last."""
    return row_slice(X, row, stride_x, cols, M, N, 0.0), row_slice(DY, row, stride_dy, cols, M, N, 0.0)


@triton.jit
def _split_x_hat(x, row, MEAN, RSTD, mask, M, IS_RMS: tl.constexpr):
    """x_hat of a row's slice and the row's rstd (a row past the last reads the last's)."""
    stat_row = tl.minimum(row, M - 1)
    rstd = tl.load(RSTD + stat_row)
    if IS_RMS:
        x_hat = x.to(tl.float32) * rstd
    else:
        x_hat = tl.where(mask, (x.to(tl.float32) - tl.load(MEAN + stat_row)) * rstd, 0.0)
    return x_hat, rstd


@triton.jit
def _split_weight(w, weight_offset, HAS_W: tl.constexpr, W_PACKED: tl.constexpr):
    """The split backward's weight slice as used, fp32 with the offset: ``w`` as held (already so,
    or, W_PACKED, in its dtype and converted here, inside the row loop)."""
    if W_PACKED:  # (nested: Triton 3.6 takes `a and b` of constexprs for a runtime test here)
        if HAS_W:
            w = keep_packed(w).to(tl.float32) + weight_offset
    return w


@triton.jit
def _split_publish(x, dy, row, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN, RSTD, mask, M, part,
                   PARTS: tl.constexpr, in_ty: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, QUANTIZE: tl.constexpr, W_PACKED: tl.constexpr):
    """Publish a row slice's parts of the row dot products; returns the dW/dB accumulators."""
    x_hat, _ = _split_x_hat(x, row, MEAN, RSTD, mask, M, IS_RMS)
    w = _split_weight(w, weight_offset, HAS_W, W_PACKED)
    wdy, dw_acc, db_acc = _dy_terms(x_hat, dy.to(tl.float32), w, dw_acc, db_acc, in_ty, HAS_W, HAS_B, QUANTIZE)
    slot = SLOTS + (row * PARTS + part) * 2
    publish(slot, tl.sum(x_hat * wdy, axis=0))
    if not IS_RMS:
        publish(slot + 1, tl.sum(wdy, axis=0))
    return dw_acc, db_acc


@triton.jit
def _split_write_dx(x, dy, row, w, weight_offset, SLOTS, idx, slot_mask, MEAN, RSTD, DH, DX, DRES, cols, mask, M,
                    N, stride_dh, stride_dx, stride_dres, PARTS: tl.constexpr, IS_RMS: tl.constexpr,
                    HAS_W: tl.constexpr, HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, PIPELINED: tl.constexpr,
                    W_PACKED: tl.constexpr):
    """Collect a row's dot products from its slots and write dx (and dresidual) of its slice.
    PIPELINED: called in a loop that Triton pipelines."""
    x_hat, rstd = _split_x_hat(x, row, MEAN, RSTD, mask, M, IS_RMS)
    wdy = dy.to(tl.float32)
    if HAS_W:
        wdy = wdy * _split_weight(w, weight_offset, HAS_W, W_PACKED)
    dots = collect(SLOTS + row * PARTS * 2 + idx, slot_mask, PIPELINED)
    dx = wdy - x_hat * (tl.sum(tl.where(idx % 2 == 0, dots, 0.0), axis=0) / N)
    if not IS_RMS:
        dx -= tl.sum(tl.where(idx % 2 == 1, dots, 0.0), axis=0) / N
    dx *= rstd
    if HAS_DH:
        dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + row * stride_dres + cols, dx.to(DRES.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_split_kernel(
    X, W, DY, DH, DX, DRES, DW_PART, DB_PART, MEAN, RSTD, SLOTS,
    M, N,
    stride_x, stride_dy, stride_dh, stride_dx, stride_dres,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr, QUANTIZE: tl.constexpr,
    PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    W_PACKED: tl.constexpr,
):
    """Backward of rows too wide for one program: ``PARTS`` programs share each row, each
    holding a ``BLOCK_N``-column slice of x and dy in registers, so both are read once. Each
    publishes its slice's part of the two row dot products to ``SLOTS [M + groups, PARTS, 2]``
    (int64, zeroed; see ``publish``/``collect``), collects its siblings' parts, sums them and
    writes dx. A program accumulates dW/dB for its columns over its group's rows and writes one
    row of ``DW_PART [groups, N]``. Grid: (groups * PARTS,), all resident at once; group g takes
    rows g, g + groups, ...

    STAGES = 0: the exchange in step with the row, the next row's slice loaded into registers
    before the wait. STAGES >= 2: the exchange a row ahead (the iteration that loads and
    publishes row r + 1 collects row r's parts, published an iteration ago, and writes its dx:
    a program seldom waits), with the loads pipelined by Triton in STAGES stages (rows
    STAGES - 1 ahead copied into shared memory, no registers held for them). Rows past the last
    publish zeros into the spare slots. W_PACKED: the weight slice is held in its dtype and
    converted where used (``_split_weight``), not held in fp32.
    """
    part = tl.program_id(0) % PARTS
    group = tl.program_id(0) // PARTS
    step = tl.num_programs(0) // PARTS
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    in_ty = X.dtype.element_ty
    idx = tl.arange(0, 2 * PARTS_POW2)  # [part, dot] of a row's slots, flattened
    if IS_RMS:
        slot_mask = (idx < 2 * PARTS) & (idx % 2 == 0)
    else:
        slot_mask = idx < 2 * PARTS
    w = 0.0  # unused without a weight
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0)
        if not W_PACKED:
            w = w.to(tl.float32) + weight_offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group + tl.zeros([], dtype=tl.int64)
    x_now, dy_now = _split_load(X, DY, first, stride_x, stride_dy, cols, M, N)
    if STAGES > 0:
        dw_acc, db_acc = _split_publish(x_now, dy_now, first, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN, RSTD,
                                        mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, QUANTIZE, W_PACKED)
        for row in tl.range(group + step, M + step, step, num_stages=STAGES):
            row64 = row + tl.zeros([], dtype=tl.int64)  # (a plain int under the interpreter)
            x_next, dy_next = _split_load(X, DY, row64, stride_x, stride_dy, cols, M, N)
            dw_acc, db_acc = _split_publish(x_next, dy_next, row64, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN,
                                            RSTD, mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, QUANTIZE,
                                            W_PACKED)
            _split_write_dx(x_now, dy_now, row64 - step, w, weight_offset, SLOTS, idx, slot_mask, MEAN, RSTD, DH, DX,
                            DRES, cols, mask, M, N, stride_dh, stride_dx, stride_dres, PARTS, IS_RMS, HAS_W, HAS_DH,
                            HAS_DRES, True, W_PACKED)
            x_now, dy_now = x_next, dy_next
    else:
        for row in range(group, M, step):
            row64 = row + tl.zeros([], dtype=tl.int64)
            dw_acc, db_acc = _split_publish(x_now, dy_now, row64, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN,
                                            RSTD, mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, QUANTIZE,
                                            W_PACKED)
            x_next, dy_next = _split_load(X, DY, row64 + step, stride_x, stride_dy, cols, M, N)
            _split_write_dx(x_now, dy_now, row64, w, weight_offset, SLOTS, idx, slot_mask, MEAN, RSTD, DH, DX, DRES,
                            cols, mask, M, N, stride_dh, stride_dx, stride_dres, PARTS, IS_RMS, HAS_W, HAS_DH,
                            HAS_DRES, False, W_PACKED)
            x_now, dy_now = x_next, dy_next
    out = first * N + cols
    if HAS_W:
        tl.store(DW_PART + out, dw_acc.to(DW_PART.dtype.element_ty), mask=mask)
    if HAS_B:
        tl.store(DB_PART + out, db_acc.to(DB_PART.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(DW_PART, DB_PART, DW, DB, P, NCOLS, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """DW = the sum of the P rows of DW_PART [P, NCOLS] (fp32) in DW's dtype, DB likewise from
    DB_PART: the backward's per-program partials, one launch for both (fixed order)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NCOLS
    acc_w = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < P)[:, None] & col_mask[None, :]
        offs = parts.to(tl.int64)[:, None] * NCOLS + cols[None, :]
        if HAS_W:
            acc_w += tl.load(DW_PART + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(DB_PART + offs, mask=mask, other=0.0)
    _store_col_sums(DW, DB, cols, acc_w, acc_b, col_mask, HAS_W, HAS_B)


# --------------------------------------------------------------------------------------------
# launch heuristics
# --------------------------------------------------------------------------------------------
def _fwd_config(n: int, m: int, is_rms: bool = True, sms: int = 0, elem_size: int = 2, residual: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, one_pass, early_w, tail_n) for the forward of M rows of N
    elements of ``elem_size`` bytes (``residual``: with the residual add) on ``sms``
    multiprocessors (0: unknown, no decode rule); early_w: the weight loaded with the row; tail_n:
    0, or the power-of-two tile of the columns past BLOCK_N (``_norm_fwd_kernel``'s TAIL_N).

    H100 sweep (bf16, 256 MiB, statistics stored as in training; benchmarks/results/tune-norm-*):
    up to 4096 columns, tiles of 8192 (RMSNorm) or 4096 (LayerNorm) elements with 32 elements a
    thread, 98-99% of copy (16 warps on the same tiles: 72-88%). One row per program up to
    32768, 32 elements a thread as well: RMSNorm 98.4-99.7% at 5120-32768 with or without the
    statistics (96.6 at 28672), LayerNorm 98-99% at 8192 / 16384, 95-97 at 5120 / 12288 before
    the tail below (64 or 128 elements a thread, as chosen before: RMSNorm 78-94% with the
    statistics stored at 12288-32768, LayerNorm 92-93% at 5120 / 12288;
    tune-norm-h100-2026-11-24/15-*). Wider rows loop
    over 16384-element chunks with 32 warps (a persistent grid measured no better), 8192-element
    ones for 2-byte rows up to FWD_BLOCKED_HALF_CHUNK_MAX.

    Too few rows of 1K-8K elements to fill the GPU, or M <= 256 (decode sizes): latency, not
    bandwidth. A row per program, 8 warps (LayerNorm 4), the weight loaded with the row (N = 4096,
    H100, CUDA graphs, M = 1-256: 0.2-0.5 us faster than the bandwidth configuration,
    benchmarks/results/decode-h100-2026-11-23/; LayerNorm at M = 256 3.0 vs 3.5 us,
    decode-h100-2026-11-24/6-*; LayerNorm's 4 warps, with its two sums in one reduction: 0.03-0.12
    us faster than 8 at M = 1-128, level at 256, decode-h100-2026-11-24/15-*).

    A row of 4353-6144 or 8705-12288 elements without a residual is half its power of two (A)
    whole and a power-of-two tail of at least A / 8, A // 1024 warps but no more than leave the
    tail 8 elements a thread (fewer: LayerNorm 78% of copy at 4608 with 4 warps, 64 at 9216 with
    8). H100, 256 MiB, statistics stored, % of copy (tune-norm-h100-2026-11-25/3-*, 8-*):
    LayerNorm bf16 96.8 / 97.8 / 97.7 / 98.2 / 98.0 at 4608 / 5120 / 9216 / 10240 / 12288 (the power
    of two, 32 elements a thread: 90.3 / 94.0 / 87.5 / 89.1 / 94.2), fp32 98.1 / 99.9 / 99.6 at
    9216 / 10240 / 12288 (88.5 / 92.3 / 98.1); RMSNorm bf16 98.2 / 98.7 / 98.1 at 4608 / 9216 /
    10240 (95.8 / 91.4 / 94.0); within 1% elsewhere. Not with a residual: 99-101% either way, up
    to 1% less with the tail (fp32 24576: 92 against 101).
    """
    if n > FWD_ONE_PASS_MAX:
        block_m, chunk, num_warps, one_pass = FWD_BLOCKED
        if n <= FWD_BLOCKED_HALF_CHUNK_MAX and elem_size == 2:
            chunk //= 2
        return block_m, chunk, num_warps, one_pass, False, 0
    block_n = max(16, next_pow2(n))
    if block_n <= 4096:
        tile = 8192 if is_rms else 4096
        block_m = min(max(1, tile // block_n), next_pow2(m))
        num_warps = max(4, block_m * block_n // 1024)
    else:
        block_m = 1
        num_warps = block_n // 1024
    if 1024 <= block_n <= 8192 and sms and (cdiv(m, block_m) < sms or m <= 256):
        return 1, block_n, max(4, min(8, block_n // 512)) if is_rms else 4, True, True, 0
    if 8192 <= block_n <= 16384 and not residual and block_n // 32 < n - block_n // 2 <= block_n // 4:
        block_n //= 2
        tail_n = next_pow2(n - block_n)
        return 1, block_n, min(block_n // 1024, tail_n // 256), True, False, tail_n
    return block_m, block_n, num_warps, True, False, 0


# block_n -> (tile elements, num_warps, programs per SM, prefetch) of the one-pass backward;
# prefetch as ``_norm_bwd_kernel``'s PREFETCH: 0 none, 1 the next tile into registers, k >= 2
# Triton's pipelining with k stages (tiles k - 1 ahead copied into shared memory). H100 sweeps
# (bf16, 256 MiB, benchmarks/results/tune-norm-h100-2026-11-23/8-*, 14-*): LayerNorm 94.5 / 94.5 /
# 94.4 / 93.9% of copy at 1024 ... 8192 pipelined (registers: 91.4 / 90.1 / 90.5 / 83.8, none: 83 /
# 86 / 85 / 82); RMSNorm 95.9 / 95.9 at 1024 / 2048 pipelined (registers 90.0 / 92.9), 95.7 / 95.4
# / 95.2 at 4096 ... 16384 (16384: any prefetch spills); at 8192 pipelined for add + RMSNorm's
# sake, 98.2% (registers: 88.4; 19-*).
_BWD_TABLE = {
    True: {1024: (4096, 8, 1, 4), 2048: (4096, 4, 1, 4), 4096: (4096, 16, 2, 1),
           8192: (8192, 8, 1, 3), 16384: (16384, 16, 1, 0)},
    False: {1024: (4096, 4, 1, 4), 2048: (4096, 4, 1, 4), 4096: (8192, 16, 1, 3),
            8192: (8192, 16, 1, 3)},
}
# fp32 inputs where their own sweep found better (11-*): RMSNorm 101 / 98.9 / 96.9% at 2048 / 4096
# / 16384 (the 2-byte entries: 95.7 / 90.2 / 89), LayerNorm 98.4 / 97.1 / 97.2 at 2048 / 4096 / 8192
# (83 / 86-88 / 92-96); RMSNorm 8192 keeps the configuration measured for fp32 (98.8%, 15-*).
_BWD_TABLE_FP32 = {
    True: {2048: (2048, 8, 2, 1), 4096: (8192, 16, 1, 1), 8192: (8192, 16, 1, 1), 16384: (16384, 8, 1, 0)},
    False: {2048: (4096, 16, 1, 1), 4096: (8192, 8, 1, 1), 8192: (8192, 8, 1, 1)},
}

# Rows between two powers of two (the next power's tile partly masked) where their sweeps found
# other configurations better: (RMSNorm?, bytes per element) -> {power of two: (configuration, the
# widest such row in eighths of that power)}. H100, 256 MiB, % of copy (tune-norm-h100-2026-11-24/15-*,
# tune-norm-h100-2026-11-25/3-*), against the power of two's entry: 2-byte rows filling at most 5/8
# of it, tiles of 8192, 8 warps, 4 stages: RMSNorm 96.6 / 95.4 / 96.2 / 94.6 at 2304 / 2560 / 4608 /
# 5120 (85.3 / 89.5 / 86.6 / 90.3), add + RMSNorm 95.2 / 95.3 / 96.6 / 96.7 (86.0 / 89.9 / 96.5 /
# 97.4), LayerNorm 94.7 / 94.5 / 86.8 / 94.5 (79.9 / 84.9 / 81.8 / 84.8); fuller rows lose 1-3% with
# it (RMSNorm 93.7 / 93.9 / 93.7 against 94.1 / 95.6 / 96.4 at 3072 / 3584 / 7168). fp32 RMSNorm
# every row between 2048 and 4096 in tiles of 4096, 8 warps, 2 programs an SM: 100.3 / 100.8 / 100.2
# / 98.0 at 2304 / 2560 / 3072 / 3584 (92.7 / 95.4 / 98.6 / 99.0), add + RMSNorm 102.7 / 103.0 /
# 100.4 / 100.5 (82.7 / 84.4 / 88.1 / 92.4); fp32 LayerNorm up to 5/8, 3 stages: 95.9 / 96.0 / 95.8
# / 96.0 at 2304 / 2560 / 4608 / 5120 (88.9 / 92.7 / 89.3 / 93.0).
_BWD_TABLE_RAGGED = {
    (True, 2): {4096: ((8192, 8, 1, 4), 5), 8192: ((8192, 8, 1, 4), 5)},
    (False, 2): {4096: ((8192, 8, 1, 4), 5), 8192: ((8192, 8, 1, 4), 5)},
    (True, 4): {4096: ((4096, 8, 2, 1), 8)},
    (False, 4): {4096: ((8192, 8, 1, 3), 5), 8192: ((8192, 8, 1, 3), 5)},
}


def _bwd_config(n: int, m: int, is_rms: bool = True, sms: int = 0, elem_size: int = 2):
    """(BLOCK_M, BLOCK_N, num_warps, one_pass, programs per SM, most programs or 0, prefetch, tail_n)
    for the backward of inputs of ``elem_size`` bytes on ``sms`` multiprocessors (0: unknown, no
    decode rule); tail_n: 0, or the power-of-two tile of the columns past BLOCK_N
    (``_norm_bwd_kernel``'s TAIL_N).

    LayerNorm keeps a dB accumulator beside dW; a 16384-wide row then spills registers (fp32:
    14% of copy on H100, bf16: 51%), so LayerNorm rows over 8192 leave the one-pass kernel
    (for the split one where it applies), but for the tail below.

    2-byte rows of 8193-12288 (not at decode sizes): 8192 columns whole and a power-of-two tail,
    8 warps, 3 stages. H100, bf16, 256 MiB, % of copy at 9216 / 10240 / 12288
    (tune-norm-h100-2026-11-25/6-*): RMSNorm 94.8 / 94.2 / 94.4 (a 16384 tile: 84.7 / 87.7 / 93.2),
    add + RMSNorm 97.7 / 97.3 / 98.0 (86.7 / 90.0 / 94.2), LayerNorm 91.2 / 92.2 / 91.7 (the split
    backward: 60.3 / 66.6 / 77.4). Narrower rows lose with a tail (2560 / 5120: 70-94 against
    94-97 for their ragged entries).

    Few rows (decode sizes: M <= 4 * BWD_DECODE_PROGRAMS, no more tiles than persistent
    programs): at most BWD_DECODE_PROGRAMS programs, each taking its rows as one tile (two for
    LayerNorm at M = 256: 8192-element tiles at most, for the same spills; two for LayerNorm at
    M = 5-16 too), 4 warps up to 2 rows of 4096 (8 for 4: 0.3-0.5 us faster than 8 and 16 at
    M = 8-128 on H100).
    """
    head = BWD_ONE_PASS_MAX // 2
    if elem_size == 2 and head < n <= head * 3 // 2 and not (sms and m <= 4 * BWD_DECODE_PROGRAMS):
        return 1, head, 8, True, 1, 0, 3, next_pow2(n - head)
    if n > BWD_ONE_PASS_MAX or (not is_rms and n > head):
        return BWD_BLOCKED + (0, 0, 0)
    block_n = max(16, next_pow2(n))
    width = max(1024, block_n)
    fp32_cfg = _BWD_TABLE_FP32[is_rms].get(width) if elem_size == 4 else None
    ragged_cfg, widest = _BWD_TABLE_RAGGED.get((is_rms, elem_size), {}).get(width, (None, 0))
    if n == block_n or n * 8 > widest * block_n:
        ragged_cfg = None
    tile, num_warps, per_sm, prefetch = ragged_cfg or fp32_cfg or _BWD_TABLE[is_rms][width]
    block_m = min(max(1, tile // block_n), next_pow2(m))
    if m <= 4 * BWD_DECODE_PROGRAMS and cdiv(m, block_m) <= sms * per_sm:
        max_tile = 16384 if is_rms else 8192
        block_m = min(max(1, max_tile // block_n), next_pow2(cdiv(m, BWD_DECODE_PROGRAMS)))
        if not is_rms and 4 < m <= 16:  # measured: LayerNorm 3.5 vs 4.3 us at M = 8, 4.9 vs 5.5 at 16
            block_m = min(2, max(1, max_tile // block_n))
        return block_m, block_n, max(4, min(8, block_m * block_n // 2048)), True, per_sm, BWD_DECODE_PROGRAMS, 0, 0
    return block_m, block_n, num_warps, True, per_sm, 0, prefetch, 0


def _fwd_split_config(is_rms: bool, elem_size: int, has_residual: bool, n: int):
    """(columns per program, num_warps, programs per SM) of the split forward of rows of ``n``
    (from the entry's narrowest row split; 0: wider than FWD_ONE_PASS_MAX), or None: the one-pass
    kernel (also for a 2-byte row that fills its power of two) or the blocked loop."""
    key = (is_rms, elem_size, has_residual)
    cfg = FWD_SPLIT.get(key)
    if cfg is None or n < (cfg[3] or FWD_ONE_PASS_MAX + 1):
        return None
    if elem_size == 2 and n <= FWD_ONE_PASS_MAX and n == next_pow2(n):
        return None
    return FWD_SPLIT_RAGGED[key] if n % cfg[0] and key in FWD_SPLIT_RAGGED else cfg[:3]


def _split_config(is_rms: bool, dtype: torch.dtype):
    """(columns per program, num_warps, stages, weight kept packed) of the split backward of
    ``dtype`` inputs."""
    return BWD_SPLIT[is_rms, dtype]


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def _norm_fwd(x, weight, bias, residual, heads: int, eps: float, weight_offset: float, is_rms: bool,
              quantize: bool, out_dtype: torch.dtype, h_dtype: Optional[torch.dtype], store_stats: bool):
    """x, residual: [M, N] with unit column stride. Returns (y [M, N], h [M, N] or None,
    mean [M] fp32 or None, rstd [M] fp32 or None)."""
    m, n = x.shape
    dev = x.device
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    h = torch.empty((m, n), dtype=h_dtype, device=dev) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=dev) if store_stats else None
    mean = torch.empty(m, dtype=torch.float32, device=dev) if store_stats and not is_rms else None
    if m == 0:
        return y, h, mean, rstd
    split_cfg = _fwd_split_config(is_rms, x.element_size(), residual is not None, n) if heads == 1 else None
    split = split_grid(n, m, split_cfg[0], dev, split_cfg[2]) if split_cfg is not None else None
    if split is not None:
        parts, groups = split
        block_n, num_warps, per_sm = split_cfg
        launch(_norm_fwd_split_kernel, (groups * parts,),
            x, pointer(residual, x), pointer(weight, x), pointer(bias, x),
            y, pointer(h, y), pointer(mean, y), pointer(rstd, y),
            torch.zeros((m, parts), dtype=torch.int64, device=dev),
            m, n,
            x.stride(0), row_stride(residual), y.stride(0), row_stride(h),
            eps, weight_offset,
            IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            QUANTIZE=quantize, STORE_STATS=store_stats,
            PARTS=parts, PARTS_POW2=next_pow2(parts), BLOCK_N=block_n, EVEN=n % block_n == 0,
            num_warps=num_warps, maxnreg=resident_registers(num_warps, per_sm),
        )
        return y, h, mean, rstd
    block_m, block_n, num_warps, one_pass, early_w, tail_n = _fwd_config(n, m, is_rms, persistent_programs(dev, 1),
                                                                        x.element_size(), residual is not None)
    launch(_norm_fwd_kernel, (cdiv(m, block_m),),
        x, pointer(residual, x), pointer(weight, x), pointer(bias, x),
        y, pointer(h, y), pointer(mean, y), pointer(rstd, y),
        m, n, heads,
        x.stride(0), row_stride(residual), y.stride(0), row_stride(h),
        eps, weight_offset,
        IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        PER_HEAD=heads > 1, QUANTIZE=quantize, STORE_STATS=store_stats,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, EARLY_W=early_w, TAIL_N=tail_n, num_warps=num_warps,
    )
    return y, h, mean, rstd


def _norm_bwd(dy, dh, xin, weight, bias_dtype: Optional[torch.dtype], mean, rstd, heads: int, weight_offset: float,
              is_rms: bool, quantize: bool, x_dtype: torch.dtype, res_dtype: Optional[torch.dtype],
              share_dres: bool = False):
    """Gradients of the forward above. ``xin [M, N]`` is the norm's input (``h`` with a
    residual); ``dy`` and ``dh`` (gradient of the returned ``h``, or None) are ``[M, N]``.
    ``share_dres``: return dx itself as dresidual when the dtypes match (saves a write; only
    safe when neither input is a leaf whose ``.grad`` would then alias the other's).
    Returns (dx, dresidual or None, dweight or None, dbias [heads * N] of ``bias_dtype`` (None
    without a bias))."""
    has_bias = bias_dtype is not None
    m, n = xin.shape
    dev = xin.device
    dx = torch.empty((m, n), dtype=x_dtype, device=dev)
    dres = None
    if res_dtype is not None:
        share = share_dres and res_dtype == x_dtype
        dres = dx if share else torch.empty((m, n), dtype=res_dtype, device=dev)
    # The decode rule is measured for one weight row (heads == 1) only.
    block_m, block_n, num_warps, one_pass, per_sm, max_programs, prefetch, tail_n = _bwd_config(
        n, m, is_rms, persistent_programs(dev, 1) if heads == 1 else 0, xin.element_size())
    rows_per_head = m // heads
    # bytes of one row's loads in the loops (x, dy, dh): what a pipeline stage holds in shared memory
    row_bytes = xin.element_size() + dy.element_size() + (0 if dh is None else dh.element_size())
    split = None
    if not one_pass and heads == 1:
        split_cols, split_warps, split_stages, split_w_packed = _split_config(is_rms, xin.dtype)
        split = split_grid(n, m, split_cols, dev)
    n_chunks = 1 if one_pass else cdiv(n, block_n)
    if split is not None:
        parts, n_progs = split
    else:
        n_progs = max(1, min(cdiv(rows_per_head, block_m), cdiv(persistent_programs(dev, per_sm), heads * n_chunks)))
        if max_programs:
            n_progs = min(n_progs, max_programs)
    # Decode sizes (a program cap), one head and column chunk: each program of several also
    # computes dW/dB of its share of the columns over all rows; one program sums its rows'.
    # Either way the kernel writes dW/dB in their dtypes, no partials to sum in a second launch.
    dw_cols = next_pow2(cdiv(n, n_progs)) if max_programs and n_progs > 1 and heads == 1 and one_pass else 0
    direct = n_progs == 1 or dw_cols > 0
    dw_part = (torch.empty((1 if direct else n_progs, heads * n), dtype=weight.dtype if direct else torch.float32,
                           device=dev) if weight is not None else None)
    db_part = (torch.empty((1 if direct else n_progs, heads * n), dtype=bias_dtype if direct else torch.float32,
                           device=dev) if has_bias else None)
    if m > 0 and split is not None:
        launch(_norm_bwd_split_kernel, (n_progs * parts,),
               xin, pointer(weight, xin), dy, pointer(dh, dy), dx,
               pointer(dres, dx),
               pointer(dw_part, dx), pointer(db_part, dx),
               pointer(mean, rstd), rstd,
               torch.zeros((m + n_progs, parts, 2), dtype=torch.int64, device=dev),
               m, n,
               xin.stride(0), dy.stride(0), row_stride(dh), dx.stride(0),
               row_stride(dres),
               weight_offset,
               IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=has_bias, HAS_DH=dh is not None,
               HAS_DRES=dres is not None and dres is not dx, QUANTIZE=quantize,
               PARTS=parts, PARTS_POW2=next_pow2(parts), BLOCK_N=split_cols,
               STAGES=fit_stages(split_stages, split_cols * row_bytes, dev), W_PACKED=split_w_packed,
               num_warps=split_warps)
    elif m > 0:
        dots = None
        if not one_pass:
            dots = torch.empty((m, 2), dtype=torch.float32, device=dev)
            launch(_norm_bwd_dots_kernel, (m,),
                xin, pointer(weight, xin), dy, pointer(mean, rstd), rstd, dots,
                n, heads, xin.stride(0), dy.stride(0), weight_offset,
                IS_RMS=is_rms, HAS_W=weight is not None, PER_HEAD=heads > 1, BLOCK_N=8192, num_warps=16,
            )
        launch(_norm_bwd_kernel, (n_progs, heads, n_chunks),
            xin, pointer(weight, xin), dy, pointer(dh, dy), dx,
            pointer(dres, dx),
            pointer(dw_part, dx), pointer(db_part, dx),
            pointer(mean, rstd), rstd, pointer(dots, rstd),
            rows_per_head, n, heads,
            xin.stride(0), dy.stride(0), row_stride(dh), dx.stride(0),
            row_stride(dres),
            weight_offset,
            IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=has_bias, HAS_DH=dh is not None,
            HAS_DRES=dres is not None and dres is not dx, QUANTIZE=quantize,
            PRECOMPUTED_DOTS=not one_pass, BLOCK_M=block_m, BLOCK_N=block_n,
            PREFETCH=fit_stages(prefetch, (block_n + tail_n) * (block_m * row_bytes + (0 if weight is None else
                                                                                        weight.element_size())), dev),
            DW_COLS=dw_cols, DW_ROWS=min(next_pow2(m), max(1, 4096 // dw_cols)) if dw_cols else 1, TAIL_N=tail_n,
            num_warps=num_warps,
        )
    elif dw_part is not None or db_part is not None:
        dw_part = None if dw_part is None else dw_part.zero_()
        db_part = None if db_part is None else db_part.zero_()
    if direct:
        dw, db = (None if dw_part is None else dw_part[0]), (None if db_part is None else db_part[0])
    else:
        dw = None if weight is None else torch.empty(heads * n, dtype=weight.dtype, device=dev)
        db = torch.empty(heads * n, dtype=bias_dtype, device=dev) if has_bias else None
        block_n = min(64, next_pow2(heads * n))
        launch(_sum_partials_kernel, (cdiv(heads * n, block_n),), pointer(dw_part, db_part),
               pointer(db_part, dw_part), pointer(dw, db), pointer(db, dw),
               n_progs, heads * n, HAS_W=dw is not None, HAS_B=db is not None, BLOCK_P=32, BLOCK_N=block_n,
               num_warps=4)
    return dx, dres, None if dw is None else dw.view(weight.shape), db


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::norm_fwd / norm_bwd)
# --------------------------------------------------------------------------------------------
def _norm_fwd_saving(*args, share_dres: bool = False):
    """The forward of a call that records an autograd node: the statistics are kept for the
    backward. (``share_dres``, an option of the call, is for the backward: see ``_norm_setup``.)"""
    return _norm_fwd(*args, True)


def _norm_fwd_inference(*args, share_dres: bool = False):
    """The forward of a call that needs no gradient: no statistics."""
    return _norm_fwd(*args, False)


def _norm_fwd_fake(x, weight, bias, residual, heads, eps, weight_offset, is_rms, quantize, out_dtype, h_dtype):
    m, n = x.shape
    h = x.new_empty((m, n), dtype=h_dtype) if residual is not None else None
    mean = None if is_rms else x.new_empty(m, dtype=torch.float32)
    return x.new_empty((m, n), dtype=out_dtype), h, mean, x.new_empty(m, dtype=torch.float32)


def _norm_bwd_fake(dy, dh, xin, weight, bias_dtype, mean, rstd, heads, weight_offset, is_rms, quantize, x_dtype,
                   res_dtype):
    m, n = xin.shape
    return (xin.new_empty((m, n), dtype=x_dtype),
            None if res_dtype is None else xin.new_empty((m, n), dtype=res_dtype),
            None if weight is None else weight.new_empty(weight.shape),
            None if bias_dtype is None else xin.new_empty(heads * n, dtype=bias_dtype))


def _norm_setup(ctx, inputs, outputs, share_dres: bool = False):
    """``share_dres`` (eager only): dx may double as dresidual, a write less (custom ops may not
    return aliases)."""
    x, weight, bias, residual, heads, eps, weight_offset, is_rms, quantize, out_dtype, h_dtype = inputs
    y, h, mean, rstd = outputs
    ctx.save_for_backward(x if residual is None else h, weight, None if is_rms else mean, rstd)
    ctx.options = (None if bias is None else (bias.shape, bias.dtype),
                   None if residual is None else residual.dtype, heads, weight_offset, is_rms, quantize, x.dtype)
    ctx.share_dres = share_dres


def _norm_backward(ctx, bwd, dy, dh, *_):
    xin, weight, mean, rstd = ctx.saved_tensors
    bias_meta, res_dtype, heads, weight_offset, is_rms, quantize, x_dtype = ctx.options
    n = xin.shape[1]
    dx, dres, dw, db = bwd(as_rows(dy, n), as_rows(dh, n) if res_dtype is not None and dh is not None else None,
                           xin, weight, None if bias_meta is None else bias_meta[1], mean, rstd, heads,
                           weight_offset, is_rms, quantize, x_dtype, res_dtype, share_dres=ctx.share_dres)
    return (dx, dw if weight is not None else None, None if bias_meta is None else db.view(bias_meta[0]),
            dres if res_dtype is not None else None)


NORM = Op("norm", forward=_norm_fwd_saving, infer=_norm_fwd_inference, setup=_norm_setup,
          backward=_norm_backward, grad_inputs=(0, 1, 2, 3), returns=2, fake=_norm_fwd_fake,
          backward_launcher=_norm_bwd, backward_fake=_norm_bwd_fake,
          schema="(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, SymInt heads, float eps, "
                 "float weight_offset, bool is_rms, bool quantize, ScalarType out_dtype, ScalarType? h_dtype) "
                 "-> (Tensor, Tensor, Tensor, Tensor)",
          backward_schema="(Tensor dy, Tensor? dh, Tensor xin, Tensor? weight, ScalarType? bias_dtype, Tensor? mean, "
                          "Tensor rstd, SymInt heads, float weight_offset, bool is_rms, bool quantize, "
                          "ScalarType x_dtype, ScalarType? res_dtype) -> (Tensor, Tensor, Tensor, Tensor)")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _check_norm_args(x, weight, bias, residual, eps, casting) -> int:
    """Validate; return the number of heads (1 unless weight is per-head ``[H, D]``)."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one)")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x's last dimension (the normalized one) is empty")
    if casting not in reference.NORM_CASTINGS:
        raise ValueError(f"casting must be one of {reference.NORM_CASTINGS}, got {casting!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    heads = 1
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(name, p, like=x)
        if p.dim() == 1 and p.shape[0] == n:
            continue
        if p.dim() == 2 and x.dim() >= 2 and tuple(p.shape) == tuple(x.shape[-2:]):
            heads = p.shape[0]
            continue
        raise ValueError(f"{name} must have shape [{n}] (x's last dim) or [H, D] = x's last two dims "
                         f"{list(x.shape[-2:])} for per-head norm; got {list(p.shape)}")
    if weight is not None and bias is not None and weight.shape != bias.shape:
        raise ValueError(f"bias shape {list(bias.shape)} must match weight shape {list(weight.shape)}")
    if residual is not None:
        check_tensor("residual", residual, like=x)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {list(residual.shape)} must equal x's shape {list(x.shape)}")
    return heads


def _norm(x, weight, bias, residual, *, is_rms, eps, prenorm, residual_in_fp32, weight_offset, casting, out_dtype):
    heads = _check_norm_args(x, weight, bias, residual, eps, casting)
    if not use_kernels(x) or x.dtype == torch.float64:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        fn = reference.rms_norm if is_rms else reference.layer_norm
        return fn(x, weight, bias, eps=eps, residual=residual, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                  weight_offset=weight_offset, casting=casting, out_dtype=out_dtype, compute_dtype=compute)
    weight_offset, out_dtype, h_dtype = reference.resolve_norm_dtypes(
        x, weight, residual, casting=casting, weight_offset=weight_offset, out_dtype=out_dtype,
        residual_in_fp32=residual_in_fp32)
    shape, n = x.shape, x.shape[-1]
    # Per-head weights are indexed by row % H, so they need contiguous [H, D] rows.
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    args = (as_rows(x, n), weight, bias, None if residual is None else as_rows(residual, n), heads, float(eps),
            weight_offset, is_rms, casting == "llama", out_dtype, h_dtype)
    # dx can double as dresidual unless x or residual is a leaf (their .grad would alias).
    y, h = NORM(*args, share_dres=residual is not None and not (x.is_leaf or residual.is_leaf))
    h = h if residual is not None else None  # (under torch.compile, a placeholder)
    if y.dim() != len(shape):
        y = y.view(shape)
    if not prenorm:
        return y
    if h is None:
        h = x.to(torch.float32) if residual_in_fp32 else x
    else:
        h = h.view(shape)
    return y, h


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
             eps: float = 1e-6, residual: Optional[torch.Tensor] = None, prenorm: bool = False,
             residual_in_fp32: bool = False, weight_offset: Optional[float] = None, casting: str = "llama",
             out_dtype: Optional[torch.dtype] = None):
    """RMSNorm over the last dimension, with an optional fused residual add.

    ``y = q(x_hat) * (weight + weight_offset) + bias`` with ``x_hat = h / sqrt(mean(h^2) + eps)``
    and ``h = x`` or ``h = x + residual``.

    Args:
        x: ``[..., N]`` float32/bfloat16/float16 (float64 runs the reference). Rows may be
            strided (a slice of a bigger tensor) as long as the last dim has unit stride.
        weight: ``[N]``, or ``[H, D]`` for a per-head (QK) norm over ``x [..., H, D]``; any
            float dtype (fp32 master weights with bf16 activations is fine). ``None``: no scale.
        bias: same shape as weight (or ``[N]``); optional.
        eps: added to the mean square, >= 0.
        residual: same shape as x; ``h = x + residual`` is normalized instead of x.
        prenorm: return ``(y, h)``: the pre-norm transformer block's next residual stream.
        residual_in_fp32: keep ``h`` in float32 (else the wider of x's and residual's dtype).
        weight_offset: added to weight (Gemma's ``1 + weight``); default 1.0 for
            ``casting="gemma"``, else 0.0.
        casting: ``"llama"`` (HF LlamaRMSNorm exactly: ``weight * x_hat.to(input_dtype)``),
            ``"gemma"`` (``x_hat * (1 + weight)`` in fp32, one cast) or ``"none"`` (fp32
            throughout, one final cast).
        out_dtype: dtype of y; default as the matching HF module returns it (llama: the wider of
            weight and input dtype; otherwise the input dtype).

    Returns:
        ``y [..., N]``, or ``(y, h)`` when ``prenorm``. Differentiable in x, weight, bias and
        residual.
    """
    return _norm(x, weight, bias, residual, is_rms=True, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting, out_dtype=out_dtype)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
               eps: float = 1e-5, residual: Optional[torch.Tensor] = None, prenorm: bool = False,
               residual_in_fp32: bool = False, weight_offset: Optional[float] = None, casting: str = "none",
               out_dtype: Optional[torch.dtype] = None):
    """LayerNorm over the last dimension, with an optional fused residual add.

    ``y = x_hat * (weight + weight_offset) + bias``, ``x_hat = (h - mean(h)) / sqrt(var(h) + eps)``.
    Arguments and shapes as ``rms_norm``; the default ``casting="none"`` matches
    ``torch.nn.functional.layer_norm`` (fp32 arithmetic, one final cast to x's dtype).
    """
    return _norm(x, weight, bias, residual, is_rms=False, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting, out_dtype=out_dtype)
