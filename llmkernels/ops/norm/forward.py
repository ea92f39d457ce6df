"""The forward kernels: ``norm_fwd_kernel`` (whole rows a program, or a row in column chunks
read twice) and ``norm_fwd_split_kernel`` (a row shared by programs that exchange its sums)."""
from __future__ import annotations

from .._rowsplit import collect, collect_pair, keep_packed, publish, publish_pair, row_slice
from .._triton import tl, triton
from .tile import load_wb, row_shift, scale_shift, shifted_var, sum_pair


@triton.jit
def norm_fwd_kernel(
    X, RES, W, B, Y, H, MEAN, RSTD,
    M, N, HEADS,
    stride_x, stride_res, stride_y, stride_h,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    PER_HEAD: tl.constexpr, ROUND_X_HAT: tl.constexpr, STORE_STATS: tl.constexpr,
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
            shift = row_shift(X, RES, rows64, row_mask, stride_x, stride_res, in_ty, HAS_RES)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            sum_shifted, sum_sq = sum_pair(xs, xs * xs, 1)
            if TAIL_N:
                t_xs = tl.where(t_mask, t_x - shift[:, None], 0.0)
                t_sum_shifted, t_sum_sq = sum_pair(t_xs, t_xs * t_xs, 1)
                sum_shifted += t_sum_shifted
                sum_sq += t_sum_sq
            mean_shifted = sum_shifted / N
            mean = shift + mean_shifted
            rstd = tl.rsqrt(shifted_var(mean_shifted, sum_sq / N) + eps)
            x = xs - mean_shifted[:, None]  # x - mean, from xs: x itself need not stay live
            if TAIL_N:
                t_x = t_xs - mean_shifted[:, None]
        if STORE_STATS:
            _store_stats(MEAN, RSTD, rows, row_mask, mean, rstd, IS_RMS)
        _fwd_tile_out(Y, W, B, x, w, b, rstd, row0, in_tile, w_row, cols, mask, stride_y, weight_offset, in_ty,
                      HAS_W, HAS_B, ROUND_X_HAT, EARLY_W)
        if TAIL_N:
            _fwd_tile_out(Y, W, B, t_x, t_w, t_b, rstd, row0, in_tile, w_row, t_cols, t_mask, stride_y, weight_offset,
                          in_ty, HAS_W, HAS_B, ROUND_X_HAT, EARLY_W)
    else:
        # Pass 1: sum and sum of squares, shifted by the row's first element so that the
        # LayerNorm variance does not cancel when |mean| >> std.
        if IS_RMS:
            shift = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            shift = row_shift(X, RES, rows64, row_mask, stride_x, stride_res, in_ty, HAS_RES)
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
            var = shifted_var(mean_shifted, tl.sum(acc_sq, axis=1) / N)
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
            w, b = load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
            if not IS_RMS:  # x - mean from the shifted values: the mean alone rounds at |mean| >> std
                x = (x - shift[:, None]) - mean_shifted[:, None]
            y = scale_shift(x * rstd[:, None], w, b, weight_offset, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
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
        w, b = load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
    if HAS_RES:
        r = tl.load(RES + row0 * stride_res + (in_tile * stride_res + cols[None, :]), mask=mask, other=0.0)
        h = (x + r.to(tl.float32)).to(in_ty)
        tl.store(H + row0 * stride_h + (in_tile * stride_h + cols[None, :]), h, mask=mask)
        x = h.to(tl.float32)
    return x, w, b


@triton.jit
def _fwd_tile_out(Y, W, B, x_centred, w, b, rstd, row0, in_tile, w_row, cols, mask, stride_y, weight_offset,
                  in_ty: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr,
                  EARLY_W: tl.constexpr):
    """y of a one-pass tile's columns ``cols`` from x - mean (x for RMSNorm) and the rows' rstd."""
    if not EARLY_W:
        w, b = load_wb(W, B, w_row + cols[None, :], mask, HAS_W, HAS_B)
    y = scale_shift(x_centred * rstd[:, None], w, b, weight_offset, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
    tl.store(Y + row0 * stride_y + (in_tile * stride_y + cols[None, :]), y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _store_stats(MEAN, RSTD, rows, row_mask, mean, rstd, IS_RMS: tl.constexpr):
    """The rows' statistics where ``row_mask``, stored as soon as they are known (before y)."""
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_mask)


@triton.jit
def norm_fwd_split_kernel(
    X, X_DESC, RES, W, B, Y, H, MEAN, RSTD, SLOTS,
    M, N,
    stride_x, stride_res, stride_y, stride_h,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ROUND_X_HAT: tl.constexpr, STORE_STATS: tl.constexpr,
    PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr = 0, TMA: tl.constexpr = False, LAG: tl.constexpr = 1,
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
    Grid: (groups * PARTS,), all resident at once; group g takes rows g, g + groups, ...

    STAGES >= 2: Triton pipelines the row loop's loads in STAGES stages (rows STAGES - 1 ahead
    copied into shared memory, no registers held for them), so that more bytes are in flight
    than two register slices allow; the previous row's slice stays in registers for its y
    instead of being read again, and rows past the last publish zeros into spare slots
    (``SLOTS [M + LAG * groups, PARTS]``) so that the loop holds no branch. TMA (pipelined): x's
    slices are read through ``X_DESC``, x's tensor descriptor of ``[1, BLOCK_N]`` blocks made on
    the host, which the pipeliner copies with TMA (zeros past the last row and column, as the
    masked loads; without TMA, X_DESC is x and unread). LAG (pipelined, 1
    or 2): y is written for the row LAG rows behind the one loaded, so that the siblings' sums
    have had LAG iterations to arrive before they are waited on (LAG 2: its slice read again)."""
    part = tl.program_id(0) % PARTS
    group = tl.program_id(0) // PARTS
    groups = tl.num_programs(0) // PARTS
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    in_ty = H.dtype.element_ty if HAS_RES else X.dtype.element_ty
    w, b = load_wb(W, B, cols, mask, HAS_W, HAS_B)
    slot_idx = tl.arange(0, PARTS_POW2)
    slot_mask = slot_idx < PARTS
    row = group + tl.zeros([], dtype=tl.int64)  # the row published this iteration
    if STAGES > 0:
        x_prev, shift_prev = _fwd_split_in(X, X_DESC, RES, H, SLOTS, row, part, stride_x, stride_res, stride_h, cols,
                                           mask, M, N, in_ty, PARTS, IS_RMS, HAS_RES, EVEN, TMA)
        if LAG == 2:
            shift_prev2 = shift_prev
            _, shift_prev = _fwd_split_in(X, X_DESC, RES, H, SLOTS, row + groups, part, stride_x, stride_res,
                                          stride_h, cols, mask, M, N, in_ty, PARTS, IS_RMS, HAS_RES, EVEN, TMA)
        for nxt in tl.range(group + LAG * groups, M + LAG * groups, groups, num_stages=STAGES):
            nxt64 = nxt + tl.zeros([], dtype=tl.int64)  # (a plain int under the interpreter)
            x, shift = _fwd_split_in(X, X_DESC, RES, H, SLOTS, nxt64, part, stride_x, stride_res, stride_h, cols, mask,
                                     M, N, in_ty, PARTS, IS_RMS, HAS_RES, EVEN, TMA)
            if LAG == 2:  # (the slice read again, from L2: held in registers it stops the pipelining)
                x_out = _fwd_split_again(X, H, nxt64 - 2 * groups, stride_x, stride_h, cols, mask, HAS_RES)
                shift_out, shift_prev2 = shift_prev2, shift_prev
            else:
                x_out, shift_out = x_prev, shift_prev
            _fwd_split_write(nxt64 - LAG * groups, x_out, shift_out, part, SLOTS, slot_idx, slot_mask, w, b, Y, MEAN,
                             RSTD, cols, mask, N, stride_y, eps, weight_offset, in_ty, PARTS, IS_RMS, HAS_W, HAS_B,
                             ROUND_X_HAT, STORE_STATS, True)
            x_prev, shift_prev = x, shift
        return
    # x is read again for y (h, with a residual, is what is read again)
    x_evict_last: tl.constexpr = not HAS_RES
    x_next = row_slice(X, row, stride_x, cols, M, N, 0.0, x_evict_last)
    if HAS_RES:
        r_next = row_slice(RES, row, stride_res, cols, M, N, 0.0)
    if not IS_RMS:
        shift_next = row_shift(X, RES, row, row < M, stride_x, stride_res, in_ty, HAS_RES)
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
            shift_next = row_shift(X, RES, row + groups, row + groups < M, stride_x, stride_res, in_ty, HAS_RES)
        if row < M:
            if HAS_RES:
                tl.store(H + row * stride_h + cols, x_now, mask=mask, eviction_policy="evict_last")
            _fwd_split_publish(x_now.to(tl.float32), shift_now, mask, SLOTS + row * PARTS + part, IS_RMS, EVEN)
        if row >= groups:
            # The slice is read again first: that read is in flight while the program waits on
            # the slots (measured: benchmarks/RESULTS.md 1.2).
            x_again = _fwd_split_again(X, H, row - groups, stride_x, stride_h, cols, mask, HAS_RES)
            _fwd_split_write(row - groups, x_again, shift_prev, part, SLOTS, slot_idx, slot_mask, w, b, Y, MEAN,
                             RSTD, cols, mask, N, stride_y, eps, weight_offset, in_ty, PARTS, IS_RMS, HAS_W, HAS_B,
                             ROUND_X_HAT, STORE_STATS, False)
        shift_prev = shift_now
        row += groups


@triton.jit
def _fwd_split_again(X, H, row, stride_x, stride_h, cols, mask, HAS_RES: tl.constexpr):
    """Row ``row``'s slice read again for its y (h with a residual), its last use."""
    if HAS_RES:
        return tl.load(H + row * stride_h + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")


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
        sum_sq, total = sum_pair(xs * xs, xs, 0)
        publish_pair(SLOT, sum_sq, total)


@triton.jit
def _fwd_split_in(X, X_DESC, RES, H, SLOTS, row, part, stride_x, stride_res, stride_h, cols, mask, M, N,
                  in_ty: tl.constexpr, PARTS: tl.constexpr, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr,
                  EVEN: tl.constexpr, TMA: tl.constexpr):
    """Load row ``row``'s slice (x, or h = x + residual, stored to H; zeros past the last row) and
    publish its sums; returns the slice in the norm's input dtype and its shift (LayerNorm).
    TMA: x's slice through the descriptor ``X_DESC``."""
    if TMA:
        block_n: tl.constexpr = X_DESC.block_shape[1]
        x = tl.reshape(X_DESC.load([row.to(tl.int32), part * block_n]), [block_n])
    else:
        x = row_slice(X, row, stride_x, cols, M, N, 0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + row_slice(RES, row, stride_res, cols, M, N, 0.0).to(tl.float32)).to(in_ty)
        tl.store(H + row * stride_h + cols, x, mask=cols < tl.where(row < M, N, 0))
    shift = 0.0
    if not IS_RMS:
        shift = row_shift(X, RES, row, row < M, stride_x, stride_res, in_ty, HAS_RES)
    _fwd_split_publish(x.to(tl.float32), shift, mask, SLOTS + row * PARTS + part, IS_RMS, EVEN)
    return x, shift


@triton.jit
def _fwd_split_write(row, x, shift, part, SLOTS, slot_idx, slot_mask, w, b, Y, MEAN, RSTD, cols, mask, N, stride_y,
                     eps, weight_offset, in_ty: tl.constexpr, PARTS: tl.constexpr, IS_RMS: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_X_HAT: tl.constexpr, STORE_STATS: tl.constexpr,
                     IN_PIPELINED_LOOP: tl.constexpr):
    """Collect row ``row``'s sums from its slots and write y of its slice ``x`` (x, or h with a
    residual; part 0: and the row's statistics)."""
    if IS_RMS:
        sums_sq = collect(SLOTS + row * PARTS + slot_idx, slot_mask, IN_PIPELINED_LOOP)
    else:
        sums_sq, sums = collect_pair(SLOTS + row * PARTS + slot_idx, slot_mask, IN_PIPELINED_LOOP)
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
        var = shifted_var(mean_shifted, tl.sum(sums_sq, axis=0) / N)
        mean = shift + mean_shifted
        x = (x - shift) - mean_shifted  # (not x - mean: the mean alone rounds); columns past N: not stored
    rstd = tl.rsqrt(var + eps)
    if STORE_STATS:
        _store_stats(MEAN, RSTD, row, part == 0, mean, rstd, IS_RMS)
    y = scale_shift(x * rstd, w, b, weight_offset, in_ty, HAS_W, HAS_B, ROUND_X_HAT)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")
