"""The MoE kernels: grouped GEMMs over the expert-sorted slots (``routing.py``), with the token
gather fused into their loads, the gated activation into their epilogues and the scatter back to
slot order into their stores; the per-expert weight gradients; the weighted combine; the
routing's offsets and tile table.

Names: ``S = T * k`` slots, rows of the sorted order; ``E`` experts; a program of a row-tiled
kernel owns one tile of ``tile_table`` (one expert's rows) and one column tile. Weights are read
through strides as ``B[e][kk, n]`` (the operand of ``A @ B``), so a weight stored either way
(``[E, N, K]`` as ``F.linear`` takes it, or gpt-oss's ``[E, K, N]``) is read in place.

The pair layout of the ``2I`` gate/up columns (``GU``, a weight's rows, a bias): gate column n
at ``n * PAIR``, up at ``n * PAIR + up_offset`` (concatenated: PAIR 1, offset I; interleaved:
PAIR 2, offset 1). ``GU [S, 2I]`` keeps the weight's layout, so the backward's GEMMs over 2I
are plain GEMMs.

Everything accumulates in fp32 (``tl.dot``; fp32 inputs in IEEE precision, not TF32); each
weight gradient is summed over its expert's rows in sorted order by one program: no atomics,
bitwise the same run to run.
"""
from __future__ import annotations

from .._launch import INTERPRET_CONST
from .._triton import tl, triton


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to the storage dtype, back in fp32."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _swizzled(pid, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """``(row tile, column tile)`` of program ``pid`` of ``m_tiles x n_tiles``: GROUP_M row tiles
    take each column tile in turn before the next GROUP_M, so that programs running together
    share a weight tile from L2 instead of each streaming the whole weight (1: row tile by row
    tile, column tiles innermost)."""
    width = GROUP_M * n_tiles
    first = (pid // width) * GROUP_M
    size = tl.minimum(m_tiles - first, GROUP_M)
    inner = pid % width
    return first + inner % size, inner // size


@triton.jit
def _program_tile(TILES, OFFS, E, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(expert, rows [BLOCK_M], row mask, column tile, columns [BLOCK_N], column mask)`` of this
    program: row tile of the tile table ``TILES`` (``routing.py``: the grid's row tiles' experts,
    then their first rows) and column tile of ``N`` by ``_swizzled`` over the grid of row tiles x
    column tiles; expert ``E`` past the last row tile (the caller returns)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.num_programs(0) // n_tiles
    pid_m, pid_n = _swizzled(tl.program_id(0), m_tiles, n_tiles, GROUP_M)
    e = tl.load(TILES + pid_m)
    start = tl.load(TILES + m_tiles + pid_m)
    end = tl.load(OFFS + tl.minimum(e, E - 1) + 1)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, rows < end, pid_n, cols, cols < N


@triton.jit
def _slots(ORDER, rows, mask):
    return tl.load(ORDER + rows, mask=mask, other=0)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b``; in fp32 under the interpreter, whose bf16 ``tl.dot`` returns garbage
    (Triton 3.9 with NumPy 2.4)."""
    if INTERPRET_CONST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mma(acc, A, a_off, a_mask, B, cols, c_mask, stride_bk, stride_bn, K,
         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += A[a_off, :K] @ B[:K, cols]``: rows of A at element offsets ``a_off`` (int64,
    unit stride along K), B through its strides and cast to A's dtype (an fp32 LoRA adapter
    beside bf16 activations)."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(A + a_off[:, None] + ks[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=k_mask[:, None] & c_mask[None, :],
                    other=0.0)
        acc = _dot(a, b.to(a.dtype), acc, PRECISION)
    return acc


@triton.jit
def _mma_pair(acc_g, acc_u, A, a_off, a_mask, B, gate_cols, up_cols, c_mask, stride_bk, stride_bn, K,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``_mma`` into two accumulators, B's gate and up columns, each A tile loaded once."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(A + a_off[:, None] + ks[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & c_mask[None, :]
        b_gate = tl.load(B + ks[:, None] * stride_bk + gate_cols[None, :] * stride_bn, mask=b_mask, other=0.0)
        b_up = tl.load(B + ks[:, None] * stride_bk + up_cols[None, :] * stride_bn, mask=b_mask, other=0.0)
        acc_g = _dot(a, b_gate.to(a.dtype), acc_g, PRECISION)
        acc_u = _dot(a, b_up.to(a.dtype), acc_u, PRECISION)
    return acc_g, acc_u


# --------------------------------------------------------------------------------------------
# the gated activations: silu (SwiGLU) and gpt-oss's clamped SwiGLU
# --------------------------------------------------------------------------------------------
@triton.jit
def _clamp(x, lo, hi):
    """``torch.clamp(x, lo, hi)``: NaN stays NaN (Triton's minimum and maximum drop it by default)."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _gated(g, u, alpha, limit, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr):
    """``h`` of the stored (rounded) ``g, u``, rounded as the reference rounds it."""
    if ACTIVATION == "silu":
        h = _round(g * tl.sigmoid(g), DTYPE) * u
    elif ACTIVATION == "clamped_swiglu":
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        h = (_clamp(u, -limit, limit) + 1.0) * (gc * tl.sigmoid(alpha * gc))
    else:
        tl.static_assert(False, "an activation of experts.ACTIVATIONS without its branch in _gated")
    return _round(h, DTYPE)


@triton.jit
def _gated_grads(g, u, dh, alpha, limit, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr):
    """``(h, d_gate, d_up)`` of ``h = gated(g, u)`` and its gradient ``dh`` (fp32). SwiGLU's
    d_up uses the rounded ``silu(g)`` the forward multiplied by; the clamps pass the gradient
    where the value is within them, bounds included (as ``torch.clamp``)."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = _round(g * s, DTYPE)
        d_gate = dh * u * (s * (1.0 + g * (1.0 - s)))
        d_up = dh * a
        h = _round(a * u, DTYPE)
    elif ACTIVATION == "clamped_swiglu":
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = _clamp(u, -limit, limit)
        s = tl.sigmoid(alpha * gc)
        glu = gc * s
        d_gate = tl.where(g <= limit, dh * (uc + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
        d_up = tl.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
        h = _round((uc + 1.0) * glu, DTYPE)
    else:
        tl.static_assert(False, "an activation of experts.ACTIVATIONS without its branch in _gated_grads")
    return h, d_gate, d_up


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------
@triton.jit
def gate_up_kernel(X, ORDER, TILES, OFFS, W, BIAS, LA, LB, GU, HS, E, K, N, R, stride_x, stride_we,
                   stride_wk, stride_wn, stride_be, stride_la, stride_lbe, stride_lbk, stride_lbn, up_offset, alpha,
                   limit, PAIR: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, STORE_GU: tl.constexpr, BLOCK_M: tl.constexpr,
                   GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    """``gate, up = X[token] @ W[e]`` (+ bias) for a tile of sorted rows and N = I columns, the
    tokens gathered on load; with HAS_LORA ``+ LA[row] @ LB[e]`` (``LA [S, R]``: the rows'
    scaled LoRA inputs ``s x A^T``). Stores ``HS [S, I] = gated(gate, up)`` and, with STORE_GU,
    the rounded ``gate, up`` in ``GU [S, 2I]`` for the backward."""
    e, rows, r_mask, col_tile, cols, c_mask = _program_tile(TILES, OFFS, E, N, BLOCK_M, BLOCK_N, GROUP_M)
    if e >= E:
        return
    token = (_slots(ORDER, rows, r_mask) // TOP_K).to(tl.int64)
    gate_cols, up_cols = cols * PAIR, cols * PAIR + up_offset
    rows64 = rows.to(tl.int64)
    acc_g, acc_u = _mma_pair(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), tl.zeros((BLOCK_M, BLOCK_N), tl.float32),
                             X, token * stride_x, r_mask, W + e.to(tl.int64) * stride_we, gate_cols, up_cols, c_mask,
                             stride_wk, stride_wn, K, BLOCK_K, PRECISION)
    if HAS_LORA:
        acc_g, acc_u = _mma_pair(acc_g, acc_u, LA, rows64 * stride_la, r_mask, LB + e * stride_lbe, gate_cols,
                                 up_cols, c_mask, stride_lbk, stride_lbn, R, BLOCK_R, PRECISION)
    if HAS_BIAS:
        acc_g += tl.load(BIAS + e * stride_be + gate_cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(BIAS + e * stride_be + up_cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    dtype = HS.dtype.element_ty
    g, u = _round(acc_g, dtype), _round(acc_u, dtype)
    mask = r_mask[:, None] & c_mask[None, :]
    if STORE_GU:
        tl.store(GU + rows64[:, None] * (2 * N) + gate_cols[None, :], g.to(dtype), mask=mask)
        tl.store(GU + rows64[:, None] * (2 * N) + up_cols[None, :], u.to(dtype), mask=mask)
    tl.store(HS + rows64[:, None] * N + cols[None, :], _gated(g, u, alpha, limit, ACTIVATION, dtype).to(dtype),
             mask=mask)


@triton.jit
def grouped_mm_kernel(A, ORDER, TILES, OFFS, W, BIAS, LA, LB, C, E, K, N, R, stride_a, stride_we, stride_wk,
                      stride_wn, stride_be, stride_la, stride_lbe, stride_lbk, stride_lbn, stride_c, scale,
                      TOP_K: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """``C[out_row] = scale * A[a_row] @ W[e]`` (+ ``LA[row] @ LB[e]``, + bias) for a tile of
    sorted rows: ``a_row`` the row itself or, GATHER_A, its token; ``out_row`` the row itself
    or, SCATTER_C, its slot id."""
    e, rows, r_mask, col_tile, cols, c_mask = _program_tile(TILES, OFFS, E, N, BLOCK_M, BLOCK_N, GROUP_M)
    if e >= E:
        return
    if GATHER_A or SCATTER_C:
        slots = _slots(ORDER, rows, r_mask)
    a_rows = (slots // TOP_K if GATHER_A else rows).to(tl.int64)
    acc = _mma(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), A, a_rows * stride_a, r_mask,
               W + e.to(tl.int64) * stride_we, cols, c_mask, stride_wk, stride_wn, K, BLOCK_K, PRECISION) * scale
    if HAS_LORA:
        acc = _mma(acc, LA, rows.to(tl.int64) * stride_la, r_mask, LB + e * stride_lbe, cols, c_mask, stride_lbk,
                   stride_lbn, R, BLOCK_R, PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + e * stride_be + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    out_rows = (slots if SCATTER_C else rows).to(tl.int64)
    tl.store(C + out_rows[:, None] * stride_c + cols[None, :], acc.to(C.dtype.element_ty),
             mask=r_mask[:, None] & c_mask[None, :])


@triton.jit
def combine_kernel(Y, INDEX, WEIGHTS, OUT, T, N, E, stride_i, stride_ij, stride_w, stride_wj, stride_o,
                   TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """``OUT[t] = sum_j w[t, j] * Y[t * TOP_K + j]`` (no weights unless WEIGHTED) in fp32, in
    the order j = 0, 1, ...; slots whose expert is outside ``[0, E)`` add nothing."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tokens = (pid // n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask, c_mask = tokens < T, cols < N
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(INDEX + tokens64 * stride_i + j * stride_ij, mask=t_mask, other=-1)
        valid = t_mask & (expert >= 0) & (expert < E)
        y = tl.load(Y + (tokens64 * TOP_K + j)[:, None] * N + cols[None, :], mask=valid[:, None] & c_mask[None, :],
                    other=0.0).to(tl.float32)
        if WEIGHTED:
            y *= tl.load(WEIGHTS + tokens64 * stride_w + j * stride_wj, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc += y
    tl.store(OUT + tokens64[:, None] * stride_o + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=t_mask[:, None] & c_mask[None, :])


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------
@triton.jit
def down_bwd_kernel(DY, ORDER, TILES, OFFS, W, LA, LB, GU, WEIGHTS, DGU, HS, P, E, K, N, R, stride_dy,
                    stride_we, stride_wk, stride_wn, stride_la, stride_lbe, stride_lbk, stride_lbn, stride_p,
                    up_offset, alpha, limit, PAIR: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
                    HAS_LORA: tl.constexpr, STORE_H: tl.constexpr, STORE_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                    PRECISION: tl.constexpr):
    """The down projection's and the activation's backward for a tile of sorted rows and
    N = I columns: ``g = DY[token] @ W[e]`` (the tokens gathered on load; with HAS_LORA
    ``+ LA[row] @ LB[e]``, the adapter's part ``s (dy B) A``), then from the saved ``GU``:
    ``DGU = d(gate, up)`` of ``dh = w * g``; with STORE_H the recomputed ``h`` in ``HS`` (for
    the down weight's gradient); with STORE_P ``P[slot, column tile] = sum_n g * h``, this
    column tile's part of the routing weight's gradient ``<dy, y>``."""
    e, rows, r_mask, col_tile, cols, c_mask = _program_tile(TILES, OFFS, E, N, BLOCK_M, BLOCK_N, GROUP_M)
    if e >= E:
        return
    slots = _slots(ORDER, rows, r_mask)
    token = (slots // TOP_K).to(tl.int64)
    g = _mma(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DY, token * stride_dy, r_mask,
             W + e.to(tl.int64) * stride_we, cols, c_mask, stride_wk, stride_wn, K, BLOCK_K, PRECISION)
    if HAS_LORA:
        g = _mma(g, LA, rows.to(tl.int64) * stride_la, r_mask, LB + e * stride_lbe, cols, c_mask, stride_lbk,
                 stride_lbn, R, BLOCK_R, PRECISION)
    mask = r_mask[:, None] & c_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_cols, up_cols = (cols * PAIR)[None, :], (cols * PAIR + up_offset)[None, :]
    gate = tl.load(GU + rows64 * (2 * N) + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + rows64 * (2 * N) + up_cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(WEIGHTS + slots, mask=r_mask, other=0.0).to(tl.float32)
    dtype = DGU.dtype.element_ty
    h, d_gate, d_up = _gated_grads(gate, up, g * w[:, None], alpha, limit, ACTIVATION, dtype)
    tl.store(DGU + rows64 * (2 * N) + gate_cols, d_gate.to(dtype), mask=mask)
    tl.store(DGU + rows64 * (2 * N) + up_cols, d_up.to(dtype), mask=mask)
    if STORE_H:
        tl.store(HS + rows64 * N + cols[None, :], h.to(dtype), mask=mask)
    if STORE_P:
        tl.store(P + slots.to(tl.int64) * stride_p + col_tile, tl.sum(tl.where(mask, g * h, 0.0), axis=1),
                 mask=r_mask)


@triton.jit
def sorted_rows_kernel(SRC, ORDER, SCALE, DST, S, N, stride_src, TOP_K: tl.constexpr, GATHER: tl.constexpr,
                       HAS_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DST[r] = SRC[ORDER[r] // TOP_K if GATHER else r] * SCALE[ORDER[r]]`` (no factor unless
    HAS_SCALE), the product in fp32 rounded once to nearest even: a GEMM operand's rows in expert
    order in one pass, the gather and the routing weight together."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rows = ((pid // n_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < S
    mask = r_mask[:, None] & (cols < N)[None, :]
    slots = tl.load(ORDER + rows, mask=r_mask, other=0).to(tl.int64)
    src = slots // TOP_K if GATHER else rows
    v = tl.load(SRC + src[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        v = v.to(tl.float32) * tl.load(SCALE + slots, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(DST + rows[:, None] * N + cols[None, :], v.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def weight_grad_kernel(A, B, ORDER, OFFS, SCALE, C, DB, M, N, stride_a, stride_b, stride_ce, stride_cm, stride_cn,
                       stride_db, TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``C[e] = sum over expert e's sorted rows r of a_r^T b_r`` (``[M, N]``, through C's
    strides), ``a_r = A[row or token] (* SCALE[slot])``, ``b_r = B[row or token]``, summed in
    row order by this one program; with HAS_DB the column tile ``pid_n == 0`` also stores
    ``DB[e] = sum_r a_r`` (a bias gradient). An expert without rows gets zeros."""
    pid = tl.program_id(0)
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    e = pid // (m_tiles * n_tiles)
    pid_m, pid_n = _swizzled(pid % (m_tiles * n_tiles), m_tiles, n_tiles, GROUP_M)
    start, end = tl.load(OFFS + e), tl.load(OFFS + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = ms < M, ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db = tl.zeros((BLOCK_M,), tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        r_mask = rows < end
        if GATHER_A or GATHER_B or HAS_SCALE:
            slots = _slots(ORDER, rows, r_mask)
        a_rows = (slots // TOP_K if GATHER_A else rows).to(tl.int64)
        b_rows = (slots // TOP_K if GATHER_B else rows).to(tl.int64)
        a = tl.load(A + a_rows[:, None] * stride_a + ms[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0)
        if HAS_SCALE:
            a = (a.to(tl.float32) * tl.load(SCALE + slots, mask=r_mask, other=0.0).to(tl.float32)[:, None]).to(
                A.dtype.element_ty)
        if HAS_DB:
            db += tl.sum(a.to(tl.float32), axis=0)
        b = tl.load(B + b_rows[:, None] * stride_b + ns[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(tl.trans(a), b, acc, PRECISION)
    out = C + e.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :] * stride_cn
    tl.store(out, acc.to(C.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if HAS_DB:
        if pid_n == 0:
            tl.store(DB + e * stride_db + ms, db.to(DB.dtype.element_ty), mask=m_mask)


# --------------------------------------------------------------------------------------------
# routing metadata
# --------------------------------------------------------------------------------------------
@triton.jit
def _lower_bound(KEYS, S, values, steps):
    """How many of the ascending ``KEYS[:S]`` are below each of ``values`` (binary searches of
    ``steps`` halvings, ``S.bit_length()`` enough)."""
    lo = tl.zeros_like(values)
    hi = tl.zeros_like(values) + S
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        less = tl.load(KEYS + mid, mask=active, other=0) < values
        lo = tl.where(active & less, mid + 1, lo)
        hi = tl.where(active & ~less, mid, hi)
    return lo


@triton.jit
def routing_kernel(KEYS, OFFS, TILES, S, E, T, steps, BLOCK_M: tl.constexpr, FIND_OFFSETS: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program. With FIND_OFFSETS, ``OFFS[e]`` (e = 0 ... E) = how many of the sorted expert
    ids ``KEYS [S]`` are below e; else ``OFFS`` is read (and KEYS unused). Then the tile table of
    ``BLOCK_M`` rows: ``TILES[t]`` the expert of tile t (E past the last tile), ``TILES[T + t]``
    its first row ``OFFS[e] + (t - first tile of e) * BLOCK_M`` (e clamped to E - 1)."""
    es = tl.arange(0, BLOCK_E)
    experts = es < E
    if FIND_OFFSETS:
        lo = _lower_bound(KEYS, S, es, steps)
        hi = _lower_bound(KEYS, S, es + 1, steps)
        tl.store(OFFS + es, lo, mask=es <= E)
    else:
        lo = tl.load(OFFS + es, mask=es <= E, other=0)
        hi = tl.load(OFFS + es + 1, mask=experts, other=0)
    tiles = tl.where(experts, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    base = lo - (ends - tiles) * BLOCK_M  # + t * BLOCK_M: the first row of tile t of this expert
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        expert = tl.sum(((ends[None, :] <= t[:, None]) & experts[None, :]).to(tl.int32), axis=1)
        pick = es[None, :] == tl.minimum(expert, E - 1)[:, None]
        start = tl.sum(tl.where(pick, base[None, :], 0), axis=1) + t * BLOCK_M
        tl.store(TILES + t, expert, mask=t < T)
        tl.store(TILES + T + t, start, mask=t < T)
