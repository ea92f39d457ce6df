"""The row kernels of the losses over a vocabulary: cross-entropy rows with an online logsumexp.

``logits [M, V]`` (rows may be strided, unit stride along V), ``target [M]``. Per row, with
``z = softcap * tanh(logits / softcap)`` (or ``z = logits``), ``lse = logsumexp(z)`` and label
smoothing ``eps``::

    loss_row = lse - (1 - eps) * z[target] - eps / V * sum(z) + z_loss * lse**2
    d loss_row / d z = softmax(z) * (1 + 2 * z_loss * lse) - (1 - eps) * onehot(target) - eps / V

times ``1 - (z / softcap)**2`` for the softcap. Rows whose target is ``ignore_index`` have loss 0
and gradient 0.

One kernel does everything, chosen by constexpr switches (``ce_kernel``):
  - the forward reads each row once, chunk by chunk, keeping a running max and a running sum
    of ``exp(z - max)`` rescaled whenever the max grows (the online logsumexp);
  - the backward re-reads the logits with the saved ``lse`` and writes the gradient times the
    upstream gradient (forward + backward: logits read twice, gradient written once);
  - the gradient formed in the forward and written over the logits, so training needs no second
    ``[M, V]`` buffer, and the logits are read once: rows wider than one block are split over
    programs that each hold a slice in registers (as ``exp(z - max)``: one exp an element) and
    exchange the row's statistics (``ce_fused_split_kernel``), which keeps the pass near the copy
    bandwidth; where programs cannot wait for each other (the interpreter) one program reads
    each row twice. Rows of up to ``CrossEntropyConfig.one_block_max`` classes are held in
    registers by one program.
A forward over few rows splits each row over programs that store partial logsumexps
(``ce_partial_kernel``), then combines them (``ce_combine_kernel``). ``scale_rows_kernel``
multiplies a gradient formed in the forward by the upstream gradient, skipping rows where that
is exactly 1 (``loss.backward()``); ``finish_kernel`` reduces the rows' losses. Statistics are
fp32 whatever the logits' dtype. The launchers are ``rows.py``'s.
"""
from __future__ import annotations

from ..._rowsplit import collect, publish, row_slice
from ..._triton import tl, triton


@triton.jit
def online_step(z, m):
    """One block of an online log-sum-exp over rows ``z [R, B]`` (fp32, -inf where masked) with
    running maxima ``m [R]``: ``(m_new, exp(m - m_new), exp(z - m_new))``, -inf maxima kept
    finite (``m_ref``) so that an all-masked row stays 0, not NaN."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp(m - m_ref), tl.exp(z - m_ref[:, None])


@triton.jit
def row_online(x_row, V, inv_temp, m, s, w, z_sum, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, SUM: tl.constexpr):
    """``row_lse``'s online log-sum-exp carried on over V more logits (``x_row``: the first) from
    a row's running state ``(m, s, w, z_sum)`` (each ``[1]`` fp32): the state updated. A row cut
    into pieces (vocabulary chunks) is thus reduced exactly as in one pass."""
    for offset in range(0, V, BLOCK_V):
        cols = offset + tl.arange(0, BLOCK_V)
        mask = (cols < V)[None, :]
        z = tl.load(x_row + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m, scale, e = online_step(z, m)
        s = s * scale + tl.sum(e, axis=1)
        if ENTROPY:
            w = w * scale + tl.sum(tl.where(e > 0, e * z, 0.0), axis=1)  # masked classes: e = 0, z = -inf
        if SUM:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
    return m, s, w, z_sum


@triton.jit
def row_lse(x_row, V, inv_temp, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, SUM: tl.constexpr):
    """A row's ``lse`` of ``z = x * inv_temp`` (``x_row``: its first logit, V of them) by an
    online log-sum-exp, with its sum of exps ``s`` and, with ENTROPY, ``w = sum(exp(z - m) * z)``
    rescaled alike (``w / s = E_p[z]``), with SUM the plain sum of z: ``(lse, s, w, z_sum)``."""
    zero = tl.zeros([1], dtype=tl.float32)
    m, s, w, z_sum = row_online(x_row, V, inv_temp, zero + float("-inf"), zero, zero, zero, BLOCK_V, ENTROPY, SUM)
    return lse_of(m, s), s, w, z_sum


@triton.jit
def lse_of(m, s):
    """The log-sum-exp of an online state's max ``m`` and sum of ``exp(z - m)`` ``s`` (0 for a
    row of no classes: m is -inf)."""
    return tl.where(m == float("-inf"), 0.0, m) + tl.log(s)


@triton.jit
def softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap * tanh(x / softcap), tanh written with one exp (exact limits at +-inf). Public:
    the kernels of the other losses over the logits cap them the same way."""
    if HAS_SOFTCAP:
        x = softcap - 2.0 * softcap / (tl.exp(x * (2.0 / softcap)) + 1.0)
    return x


@triton.jit
def grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    """(p_coef, off, hot) of a row's gradient ``exp(z - lse) * p_coef - off - hot * onehot``
    for the row's upstream ``scale`` (V: the whole vocabulary's size). Public, as ``grad_tile``."""
    p_coef = scale
    if HAS_Z:
        p_coef = scale * (1.0 + 2.0 * z_coef * lse)
    if HAS_SMOOTHING:
        off = scale * (smoothing / V)
        hot = scale * (1.0 - smoothing)
    else:
        off = scale * 0.0
        hot = scale
    return p_coef, off, hot


@triton.jit
def through_softcap(g, z, softcap, HAS_SOFTCAP: tl.constexpr):
    """A gradient with respect to softcapped logits ``z``, taken back through the soft cap
    (d z / d x = 1 - (z / softcap)**2). Public, as ``softcapped``."""
    if HAS_SOFTCAP:
        th = z / softcap
        g = g * (1.0 - th * th)
    return g


@triton.jit
def grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP: tl.constexpr):
    """d loss / d logits for a [BLOCK_M, BLOCK_V] tile of softcapped logits ``z`` (``t``: each row's
    target as a column of the tile). Public: the vocabulary-parallel gradient is this one."""
    g = tl.exp(z - lse[:, None]) * p_coef[:, None] - off[:, None]
    g = tl.where(cols[None, :] == t[:, None], g - hot[:, None], g)
    return tl.where(valid[:, None], through_softcap(g, z, softcap, HAS_SOFTCAP), 0.0)


@triton.jit
def _online_lse(x_row, row_mask, col_start, span, col_end, softcap, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVICT: tl.constexpr):
    """Online logsumexp of columns [col_start, min(col_start + span, col_end)) of BLOCK_M rows
    (``x_row``: [BLOCK_M, 1] row pointers): the running max m, the sum s of exp(z - m),
    rescaled as m grows, and the sum of z (label smoothing)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    z_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for offset in range(0, span, BLOCK_V):
        cols = col_start + offset + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < col_end)[None, :]
        x = tl.load(x_row + cols[None, :], mask=mask, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
        z = softcapped(x, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = tl.where(mask, z, float("-inf"))
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref[:, None]), axis=1)
        m = m_new
    return m, s, z_sum


@triton.jit
def _row_loss(X, rows64, stride_x, t, row_mask, lse, z_sum, V, ignore_index, smoothing, z_coef, softcap,
              HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Per-row loss (0 for ignored rows, NaN for out-of-range targets, which are not read) and
    its z-loss part, from the row's lse (and sum of z)."""
    valid = row_mask & (t != ignore_index)
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(X + rows64 * stride_x + tl.where(in_range, t, 0), mask=valid & in_range, other=0.0)
    z_t = softcapped(x_t.to(tl.float32), softcap, HAS_SOFTCAP)
    return _loss_terms(lse, z_t, z_sum, valid, in_range, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)


@triton.jit
def _loss_terms(lse, z_t, z_sum, valid, in_range, V, smoothing, z_coef, HAS_SMOOTHING: tl.constexpr,
                HAS_Z: tl.constexpr):
    """A row's loss (0 where not ``valid``, NaN where the target is not ``in_range``) and its
    z-loss part, from its lse, target logit ``z_t`` and sum of logits ``z_sum``."""
    if HAS_SMOOTHING:
        loss = lse - (1.0 - smoothing) * z_t - (smoothing / V) * z_sum
    else:
        loss = lse - z_t
    z_part = tl.zeros_like(lse)
    if HAS_Z:
        z_part = tl.where(valid, z_coef * lse * lse, 0.0)
        loss += z_part
    return tl.where(valid & ~in_range, float("nan"), tl.where(valid, loss, 0.0)), z_part


@triton.jit
def ce_kernel(
    X, T, LOSS, ZLOSS, LSE, DX, G, COUNT,
    M, V, stride_x, stride_dx, stride_g, ignore_index,
    smoothing, z_coef, softcap,
    FORWARD: tl.constexpr, GRAD: tl.constexpr, HAS_G: tl.constexpr, MEAN: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, STORE_Z: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PASS1_EVICT: tl.constexpr, PASS2_EVICT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    """FORWARD: per-row loss (LOSS, ZLOSS; NaN where the target is out of range) and LSE.
    GRAD: DX = d loss / d logits times the row's scale (G, 1 / COUNT for ``mean``); without
    FORWARD the statistics come from LSE (the separate backward).
    A persistent loop: program p handles row tiles p, p + programs, ..."""
    if MEAN:
        count_scale = 1.0 / tl.load(COUNT).to(tl.float32)
    else:
        count_scale = 1.0
    for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        t = tl.load(T + rows, mask=row_mask, other=ignore_index).to(tl.int64)
        valid = row_mask & (t != ignore_index)
        bad = valid & ((t < 0) | (t >= V))
        x_row = X + rows64[:, None] * stride_x

        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (cols < V)[None, :]
            x = tl.load(x_row + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            z = softcapped(x, softcap, HAS_SOFTCAP)
            if HAS_SOFTCAP:
                z = tl.where(mask, z, float("-inf"))
            m = tl.max(z, axis=1)
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            lse = m_ref + tl.log(tl.sum(tl.exp(z - m_ref[:, None]), axis=1))
            if HAS_SMOOTHING:
                z_sum = tl.sum(tl.where(mask, z, 0.0), axis=1)
            else:
                z_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        elif FORWARD:
            m, s, z_sum = _online_lse(x_row, row_mask, 0, V, V, softcap, BLOCK_M, BLOCK_V, HAS_SMOOTHING, HAS_SOFTCAP,
                                      PASS1_EVICT)
            lse = lse_of(m, s)
        else:
            lse = tl.load(LSE + rows, mask=row_mask, other=0.0)

        if FORWARD:
            loss, z_part = _row_loss(X, rows64, stride_x, t, row_mask, lse, z_sum, V, ignore_index, smoothing, z_coef,
                                     softcap, HAS_SMOOTHING, HAS_Z, HAS_SOFTCAP)
            if STORE_Z:
                tl.store(ZLOSS + rows, z_part, mask=row_mask)
            tl.store(LOSS + rows, loss, mask=row_mask)
            tl.store(LSE + rows, lse, mask=row_mask)

        if GRAD:
            if FORWARD:  # DX may be X: every thread's read of z[target] before any thread's store
                tl.debug_barrier()
            scale = tl.full([BLOCK_M], 1.0, tl.float32) * count_scale
            if HAS_G:
                scale *= tl.load(G + rows64 * stride_g, mask=row_mask, other=0.0).to(tl.float32)
            scale = tl.where(bad, float("nan"), scale)
            p_coef, off, hot = grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
            dx_row = DX + rows64[:, None] * stride_dx
            if ONE_BLOCK:
                g = grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP)
                tl.store(dx_row + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)
            else:
                # Reverse chunk order: the chunks the forward read last are still in L2.
                n_chunks = tl.cdiv(V, BLOCK_V)
                for i in range(0, n_chunks):
                    cols = (n_chunks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
                    mask = row_mask[:, None] & (cols < V)[None, :]
                    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0, eviction_policy=PASS2_EVICT)
                    z = softcapped(x.to(tl.float32), softcap, HAS_SOFTCAP)
                    g = grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP)
                    tl.store(dx_row + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def ce_fused_split_kernel(
    X, T, LOSS, ZLOSS, LSE, DX, COUNT, SLOTS,
    M, V, stride_x, stride_dx, ignore_index, smoothing, z_coef, softcap,
    MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, STORE_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The forward with the gradient (upstream gradient 1, times 1 / COUNT for ``mean``) of
    rows too wide for one program, reading the logits once: ``PARTS`` programs share each row,
    each holding a ``BLOCK_V``-column slice of it in registers, as ``e = exp(z - m)`` with m the
    slice's max (one exp an element: the gradient is ``e * exp(m - lse)`` scaled). Each publishes
    m, the sum of e and (label smoothing) the sum of z to ``SLOTS [M, PARTS, 4]`` (int64,
    zeroed; see ``publish``/``collect``); part 0 also loads and publishes z[target]. Each then
    loads its slice of the group's next row, collects the row's values, forms lse and writes
    its slice of the gradient to DX, then the one-hot term at the target if the target is in
    its slice. DX may be X: a row is written only after every part has published, that is,
    after every read of the row. Part 0 writes the row's LOSS, ZLOSS and LSE.
    Grid: (groups * PARTS,), all resident at once; group g takes rows g, g + groups, ..."""
    part = tl.program_id(0) % PARTS
    group = tl.program_id(0) // PARTS
    groups = tl.num_programs(0) // PARTS
    cols = part * BLOCK_V + tl.arange(0, BLOCK_V)
    if MEAN:
        count_scale = 1.0 / tl.load(COUNT).to(tl.float32)
    else:
        count_scale = 1.0
    slot_part = tl.arange(0, PARTS_POW2)[:, None]
    slot_kind = tl.arange(0, 4)[None, :]  # max, sum of e, sum of z, z[target] (part 0's)
    slot_mask = (slot_part < PARTS) & ((slot_kind < 2) | ((slot_kind == 2) & HAS_SMOOTHING) |
                                       ((slot_kind == 3) & (slot_part == 0)))
    row = group + tl.zeros([], dtype=tl.int64)
    x_next = row_slice(X, row, stride_x, cols, M, V, float("-inf"))
    for _ in range(group, M, groups):
        z = softcapped(x_next.to(tl.float32), softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = tl.where(cols < V, z, float("-inf"))
        t = tl.load(T + row).to(tl.int64)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        m_part = tl.max(z, axis=0)
        m_ref = tl.where(m_part == float("-inf"), 0.0, m_part)
        e = tl.exp(z - m_ref)
        s_part = tl.sum(e, axis=0)
        z_sum = tl.zeros([], dtype=tl.float32)
        if HAS_SMOOTHING:
            z_sum = tl.sum(tl.where(cols < V, z, 0.0), axis=0)
        z_t = tl.zeros([], dtype=tl.float32)
        if part == 0:
            x_t = tl.load(X + row * stride_x + tl.where(in_range, t, 0), mask=valid & in_range, other=0.0)
            z_t = softcapped(x_t.to(tl.float32), softcap, HAS_SOFTCAP)
        next_row = row + groups
        if PARTS == 1:  # nothing to exchange
            x_next = row_slice(X, next_row, stride_x, cols, M, V, float("-inf"))
            lse = m_ref + tl.log(s_part)
            tl.debug_barrier()  # DX may be X: every thread's read of z[target] before any thread's store
        else:
            slot = SLOTS + (row * PARTS + part) * 4
            publish(slot, m_part)
            publish(slot + 1, s_part)
            if HAS_SMOOTHING:
                publish(slot + 2, z_sum)
            if part == 0:
                publish(slot + 3, z_t)
            x_next = row_slice(X, next_row, stride_x, cols, M, V, float("-inf"))
            stats = collect(SLOTS + row * PARTS * 4 + slot_part * 4 + slot_kind, slot_mask)
            m_parts = tl.max(tl.where((slot_kind == 0) & (slot_part < PARTS), stats, float("-inf")), axis=1)
            m = tl.max(m_parts, axis=0)
            m_row = tl.where(m == float("-inf"), 0.0, m)
            s_parts = tl.sum(tl.where(slot_kind == 1, stats, 0.0), axis=1)
            lse = m_row + tl.log(tl.sum(tl.where(m_parts == float("-inf"), 0.0, s_parts * tl.exp(m_parts - m_row)),
                                        axis=0))
            z_sum = tl.sum(tl.sum(tl.where(slot_kind == 2, stats, 0.0), axis=1), axis=0)
            z_t = tl.sum(tl.sum(tl.where(slot_kind == 3, stats, 0.0), axis=1), axis=0)
        if part == 0:
            loss, z_part = _loss_terms(lse, z_t, z_sum, valid, in_range, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
            if STORE_Z:
                tl.store(ZLOSS + row, z_part)
            tl.store(LOSS + row, loss)
            tl.store(LSE + row, lse)
        scale = tl.where(valid, tl.where(in_range, count_scale, float("nan")), 0.0)
        p_coef, off, hot = grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
        g = through_softcap(e * (tl.exp(m_ref - lse) * p_coef) - off, z, softcap, HAS_SOFTCAP)
        dx_row = DX + row * stride_dx
        tl.store(dx_row + cols, g.to(DX.dtype.element_ty), mask=cols < V)
        if (t // BLOCK_V == part) & valid & in_range:
            # The one-hot term, after the slice's store (the barrier orders the two writes).
            tl.debug_barrier()
            g_t = through_softcap(tl.exp(z_t - lse) * p_coef - off - hot, z_t, softcap, HAS_SOFTCAP)
            tl.store(dx_row + t, g_t.to(DX.dtype.element_ty))
        row = next_row


@triton.jit
def ce_partial_kernel(X, PART, M, V, stride_x, softcap, PARTS, SPAN,
                       HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Split forward, step 1 (rows too few to fill the GPU): program (row, part) reduces columns
    [part * SPAN, (part + 1) * SPAN) of its row to its online-logsumexp partials, stored in
    PART [3, M, PARTS] fp32: max, sum of exp(z - max), sum of z. No program waits for another."""
    row = tl.program_id(0) // PARTS
    part = tl.program_id(0) % PARTS
    rows = row + tl.arange(0, 1)
    row_mask = rows < M
    x_row = X + rows.to(tl.int64)[:, None] * stride_x
    m, s, z_sum = _online_lse(x_row, row_mask, part * SPAN, SPAN, V, softcap, 1, BLOCK_V, HAS_SMOOTHING, HAS_SOFTCAP,
                              "evict_first")
    slot = rows * PARTS + part
    tl.store(PART + slot, m, mask=row_mask)
    tl.store(PART + M * PARTS + slot, s, mask=row_mask)
    if HAS_SMOOTHING:
        tl.store(PART + 2 * M * PARTS + slot, z_sum, mask=row_mask)


@triton.jit
def ce_combine_kernel(X, T, PART, LOSS, ZLOSS, LSE, M, V, stride_x, ignore_index, smoothing, z_coef, softcap,
                       PARTS, PARTS_POW2: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                       HAS_Z: tl.constexpr, STORE_Z: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr):
    """Split forward, step 2: each row's lse from its PARTS partials, then its loss (LOSS,
    ZLOSS) and LSE, as the one-pass forward writes them."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < M
    parts = tl.arange(0, PARTS_POW2)
    mask = row_mask[:, None] & (parts < PARTS)[None, :]
    slots = rows[:, None] * PARTS + parts[None, :]
    m_part = tl.load(PART + slots, mask=mask, other=float("-inf"))
    m = tl.max(m_part, axis=1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.load(PART + M * PARTS + slots, mask=mask, other=0.0) * tl.exp(m_part - m_ref[:, None]), axis=1)
    lse = m_ref + tl.log(s)
    z_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_SMOOTHING:
        z_sum = tl.sum(tl.load(PART + 2 * M * PARTS + slots, mask=mask, other=0.0), axis=1)
    t = tl.load(T + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    loss, z_part = _row_loss(X, rows.to(tl.int64), stride_x, t, row_mask, lse, z_sum, V, ignore_index, smoothing,
                             z_coef, softcap, HAS_SMOOTHING, HAS_Z, HAS_SOFTCAP)
    if STORE_Z:
        tl.store(ZLOSS + rows, z_part, mask=row_mask)
    tl.store(LOSS + rows, loss, mask=row_mask)
    tl.store(LSE + rows, lse, mask=row_mask)


@triton.jit
def scale_rows_kernel(DX, G, M, N, stride_dx, stride_g, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """DX[r, :] *= G[r * stride_g] in place (stride_g = 0: one scalar), leaving tiles of rows
    whose factors are all exactly 1 untouched: ``loss.backward()`` costs no pass over DX."""
    for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_R), tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        g = tl.load(G + rows64 * stride_g, mask=row_mask, other=1.0).to(tl.float32)
        if tl.sum((g != 1.0).to(tl.int32), axis=0) > 0:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < N)[None, :]
                ptrs = DX + rows64[:, None] * stride_dx + cols[None, :]
                d = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(ptrs, (d * g[:, None]).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def finish_kernel(LOSS_ROWS, Z_ROWS, T, COUNT, OUT, OUT_Z, M, ignore_index,
                   REDUCE: tl.constexpr, MEAN: tl.constexpr, HAS_Z: tl.constexpr, COUNT_GIVEN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program over the per-row results of the forward: OUT (and OUT_Z) = their sum or mean
    (REDUCE) or the rows themselves, in OUT's dtype; for the mean, COUNT = the rows not ignored
    unless COUNT_GIVEN. Sums in fp32 in a fixed order (deterministic)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK], dtype=tl.float32)
    valid_rows = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < M
        loss = tl.load(LOSS_ROWS + rows, mask=mask, other=0.0)
        if HAS_Z:
            z = tl.load(Z_ROWS + rows, mask=mask, other=0.0)
        if REDUCE:
            acc += loss
            if HAS_Z:
                acc_z += z
            if MEAN and not COUNT_GIVEN:
                t = tl.load(T + rows, mask=mask, other=ignore_index)
                valid_rows += (mask & (t != ignore_index)).to(tl.int32)
        else:
            tl.store(OUT + rows, loss.to(OUT.dtype.element_ty), mask=mask)
            if HAS_Z:
                tl.store(OUT_Z + rows, z.to(OUT_Z.dtype.element_ty), mask=mask)
    if REDUCE:
        total = tl.sum(acc, axis=0)
        total_z = tl.sum(acc_z, axis=0)
        if MEAN:
            if COUNT_GIVEN:
                count = tl.load(COUNT).to(tl.float32)
            else:
                n_valid = tl.sum(valid_rows, axis=0)
                tl.store(COUNT, n_valid.to(tl.int64))
                count = n_valid.to(tl.float32)
            total = total / count
            total_z = total_z / count
        tl.store(OUT, total.to(OUT.dtype.element_ty))
        if HAS_Z:
            tl.store(OUT_Z, total_z.to(OUT_Z.dtype.element_ty))


