"""The backward kernels: ``norm_bwd_kernel`` (a persistent grid over row tiles, one pass or in
column chunks after ``norm_bwd_dots_kernel``), ``norm_bwd_split_kernel`` (a row shared by
programs that exchange its dot products) and ``sum_partials_kernel`` (dW / dB from the
programs' partials)."""
from __future__ import annotations

from .._rowsplit import collect, keep_packed, publish, row_slice
from .._triton import tl, triton
from .tile import dy_terms, sum_pair, tile_x_hat


@triton.jit
def norm_bwd_dots_kernel(
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
def _tile_load(X, DY, tile, rows_per_head, HEADS, head, cols, col_mask, stride_x, stride_dy, BLOCK_M: tl.constexpr):
    """x and dy of a tile of rows, in the input dtype (nothing read past the last row)."""
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = i.to(tl.int64) * HEADS + head
    mask = (i < rows_per_head)[:, None] & col_mask[None, :]
    return (tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0),
            tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0))


@triton.jit
def norm_bwd_kernel(
    X, W, DY, DH, DX, DRES, DW_PART, DB_PART, MEAN, RSTD, DOTS,
    rows_per_head, N, HEADS,
    stride_x, stride_dy, stride_dh, stride_dx, stride_dres,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr, ROUND_X_HAT: tl.constexpr, PRECOMPUTED_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
    DW_COLS: tl.constexpr, DW_ROWS: tl.constexpr, TAIL_N: tl.constexpr = 0,
):
    """dx (and dresidual), and this program's partial dW/dB over the rows it owns; with DW_COLS
    (one head and column chunk: decode sizes), instead of partials, dW/dB themselves (DW_PART /
    DB_PART, their dtypes) for columns [p * DW_COLS, (p + 1) * DW_COLS) over every row: those
    need x and dy but not dx, so no program waits for another and no second launch sums
    partials (``sum_partials_kernel``, a launch more).

    Grid: (programs, heads, column chunks). Program p of head h owns rows
    ``(i * HEADS + h)`` for ``i`` in tiles p, p + programs, ... With one column chunk the row
    dot products are computed here; with several they come from ``norm_bwd_dots_kernel``.
    PREFETCH 1: a program issues its next tile's loads before it reduces the current one;
    k >= 2: Triton pipelines the row loop in k stages, its loads copied asynchronously into
    shared memory k - 1 tiles ahead (no registers held for them); 0: neither.
    The weight is loaded again for every tile (from L1, kept there with ``evict_last``) rather
    than held across the loop: holding it would spill a 16384-column tile's registers.
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
            x, dy, w, MEAN, RSTD, rows, row_mask, col_mask, dw_acc, db_acc, in_ty, IS_RMS, HAS_W, HAS_B, ROUND_X_HAT)
        if TAIL_N:
            t_x_hat, t_wdy, _, t_mask, t_dw_acc, t_db_acc = _bwd_tile_terms(
                t_x, t_dy, t_w, MEAN, RSTD, rows, row_mask, t_col_mask, t_dw_acc, t_db_acc, in_ty, IS_RMS, HAS_W,
                HAS_B, ROUND_X_HAT)
        if PRECOMPUTED_DOTS:
            mean_xw = tl.load(DOTS + 2 * rows, mask=row_mask, other=0.0)
            mean_w = tl.load(DOTS + 2 * rows + 1, mask=row_mask, other=0.0)
        elif not IS_RMS:  # LayerNorm's two row sums in one reduction (a tail's in another)
            sum_xw, sum_w = sum_pair(x_hat * wdy, wdy, 1)
            if TAIL_N:
                t_sum_xw, t_sum_w = sum_pair(t_x_hat * t_wdy, t_wdy, 1)
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
                    prog * DW_COLS + tl.arange(0, DW_COLS), in_ty, IS_RMS, HAS_W, HAS_B, ROUND_X_HAT, DW_ROWS)
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
                    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr):
    """The one-pass backward on a tile's columns: x_hat, w * dy, the rows' rstd, the tile's mask
    and the dW / dB accumulators with this tile added."""
    mask = row_mask[:, None] & col_mask[None, :]
    x_hat, rstd = tile_x_hat(x, rows, row_mask, mask, MEAN, RSTD, IS_RMS)
    wdy, dw_acc, db_acc = dy_terms(x_hat, dy, w, dw_acc, db_acc, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
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
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr,
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
        x_hat, _ = tile_x_hat(x, rows, row_mask, row_mask[:, None] & col_mask[None, :], MEAN, RSTD, IS_RMS)
        _, dw_acc, db_acc = dy_terms(x_hat, dy, 0.0, dw_acc, db_acc, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
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
                   HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr, W_PACKED: tl.constexpr):
    """Publish a row slice's parts of the row dot products; returns the dW/dB accumulators."""
    x_hat, _ = _split_x_hat(x, row, MEAN, RSTD, mask, M, IS_RMS)
    w = _split_weight(w, weight_offset, HAS_W, W_PACKED)
    wdy, dw_acc, db_acc = dy_terms(x_hat, dy.to(tl.float32), w, dw_acc, db_acc, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
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
def norm_bwd_split_kernel(
    X, W, DY, DH, DX, DRES, DW_PART, DB_PART, MEAN, RSTD, SLOTS,
    M, N,
    stride_x, stride_dy, stride_dh, stride_dx, stride_dres,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr, ROUND_X_HAT: tl.constexpr,
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
                                        mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, ROUND_X_HAT, W_PACKED)
        for row in tl.range(group + step, M + step, step, num_stages=STAGES):
            row64 = row + tl.zeros([], dtype=tl.int64)  # (a plain int under the interpreter)
            x_next, dy_next = _split_load(X, DY, row64, stride_x, stride_dy, cols, M, N)
            dw_acc, db_acc = _split_publish(x_next, dy_next, row64, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN,
                                            RSTD, mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, ROUND_X_HAT,
                                            W_PACKED)
            _split_write_dx(x_now, dy_now, row64 - step, w, weight_offset, SLOTS, idx, slot_mask, MEAN, RSTD, DH, DX,
                            DRES, cols, mask, M, N, stride_dh, stride_dx, stride_dres, PARTS, IS_RMS, HAS_W, HAS_DH,
                            HAS_DRES, True, W_PACKED)
            x_now, dy_now = x_next, dy_next
    else:
        for row in range(group, M, step):
            row64 = row + tl.zeros([], dtype=tl.int64)
            dw_acc, db_acc = _split_publish(x_now, dy_now, row64, w, weight_offset, dw_acc, db_acc, SLOTS, MEAN,
                                            RSTD, mask, M, part, PARTS, in_ty, IS_RMS, HAS_W, HAS_B, ROUND_X_HAT,
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
def sum_partials_kernel(DW_PART, DB_PART, DW, DB, P, NCOLS, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
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
