"""Cross-entropy over a vocabulary: one pass over the logits with an online logsumexp.

``logits [M, V]`` (rows may be strided, unit stride along V), ``target [M]``. Per row, with
``z = softcap * tanh(logits / softcap)`` (or ``z = logits``), ``lse = logsumexp(z)`` and label
smoothing ``eps``::

    loss_row = lse - (1 - eps) * z[target] - eps / V * sum(z) + z_loss * lse**2
    d loss_row / d z = softmax(z) * (1 + 2 * z_loss * lse) - (1 - eps) * onehot(target) - eps / V

times ``1 - (z / softcap)**2`` for the softcap. Rows whose target is ``ignore_index`` have loss 0
and gradient 0; ``mean`` divides by the number of the other rows, as ``F.cross_entropy`` does.

One kernel does everything, chosen by constexpr switches:
  - the forward reads each row once, chunk by chunk, keeping a running max and a running sum
    of ``exp(z - max)`` rescaled whenever the max grows (the online logsumexp);
  - the backward re-reads the logits with the saved ``lse`` and writes the gradient times the
    upstream gradient (forward + backward: logits read twice, gradient written once);
  - with ``inplace_backward`` the gradient is formed in the forward and written over the logits,
    so training needs no second ``[M, V]`` buffer, and the logits are read once: rows wider than
    one block are split over programs that each hold a slice in registers (as ``exp(z - max)``:
    one exp an element) and exchange the row's statistics (``_ce_fused_split_kernel``), which
    keeps the pass near the copy bandwidth; where programs cannot wait for each other (the
    interpreter) one program reads each row twice. Rows of up to
    ``CrossEntropyConfig.one_block_max`` classes are held in registers by one program. The
    backward only multiplies the gradient by the upstream gradient in place, skipping rows
    where that is exactly 1 (``loss.backward()``).
Statistics are fp32 whatever the logits' dtype. ``ce_rows`` is the row launcher the fused linear
cross-entropy (and any loss built on per-row logsumexps) runs over blocks of logits.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple, Optional

import torch

from .. import reference
from ._launch import (Plans, cdiv, check_tensor, device_of, launcher, next_pow2, persistent_programs, pointer,
                      row_stride, use_kernels)
from ._register import Op
from ._rowsplit import collect, publish, resident_registers, row_slice
from ._triton import tl, triton
# (DEFAULT_CONFIG and SplitInplace: the family's records, importable from the family's module)
from .configs.cross_entropy import (DEFAULT_CONFIG, CrossEntropyConfig, SplitInplace, ce_config,  # noqa: F401
                                    inplace_split, row_tiles, split_forward_parts)


REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` / ``linear_cross_entropy`` return when ``return_z_loss`` or
    ``return_lse`` is set. ``loss`` includes the z-loss term; ``z_loss`` is that term alone,
    reduced like ``loss`` (for logging, no gradient); ``lse`` is the fp32 logsumexp of each
    row ``[M]`` (no gradient). Fields not asked for are ``None``."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap * tanh(x / softcap), tanh written with one exp (exact limits at +-inf). Public:
    the kernels of other losses over the logits (``vocab_chunks``) cap them the same way."""
    if HAS_SOFTCAP:
        x = softcap - 2.0 * softcap / (tl.exp(x * (2.0 / softcap)) + 1.0)
    return x


@triton.jit
def _grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    """(p_coef, off, hot) of a row's gradient ``exp(z - lse) * p_coef - off - hot * onehot``
    for the row's upstream ``scale``."""
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
def _grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP: tl.constexpr):
    """d loss / d logits for a [BLOCK_M, BLOCK_V] tile of softcapped logits ``z``."""
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
def _ce_kernel(
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
            lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(s)
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
            scale = tl.full([BLOCK_M], 1.0, tl.float32) * count_scale
            if HAS_G:
                scale *= tl.load(G + rows64 * stride_g, mask=row_mask, other=0.0).to(tl.float32)
            scale = tl.where(bad, float("nan"), scale)
            p_coef, off, hot = _grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
            dx_row = DX + rows64[:, None] * stride_dx
            if ONE_BLOCK:
                g = _grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP)
                tl.store(dx_row + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)
            else:
                # Reverse chunk order: the chunks the forward read last are still in L2.
                n_chunks = tl.cdiv(V, BLOCK_V)
                for i in range(0, n_chunks):
                    cols = (n_chunks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
                    mask = row_mask[:, None] & (cols < V)[None, :]
                    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0, eviction_policy=PASS2_EVICT)
                    z = softcapped(x.to(tl.float32), softcap, HAS_SOFTCAP)
                    g = _grad_tile(z, cols, t, lse, p_coef, off, hot, valid, softcap, HAS_SOFTCAP)
                    tl.store(dx_row + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fused_split_kernel(
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
        p_coef, off, hot = _grad_coefs(scale, lse, V, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
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
def _ce_partial_kernel(X, PART, M, V, stride_x, softcap, PARTS, SPAN,
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
def _ce_combine_kernel(X, T, PART, LOSS, ZLOSS, LSE, M, V, stride_x, ignore_index, smoothing, z_coef, softcap,
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
def _scale_rows_kernel(DX, G, M, N, stride_dx, stride_g, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
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
def _check_targets_kernel(T, ERR, M, V, ignore_index, BLOCK: tl.constexpr):
    """One program: ERR = 1 + the first row whose target is outside [0, V) and not
    ignore_index, or 0."""
    first_bad = tl.full([BLOCK], M, tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t = tl.load(T + rows, mask=rows < M, other=ignore_index).to(tl.int64)
        first_bad = tl.minimum(first_bad, tl.where((t != ignore_index) & ((t < 0) | (t >= V)), rows, M))
    bad_row = tl.min(first_bad, axis=0)
    tl.store(ERR, tl.where(bad_row < M, bad_row + 1, 0).to(tl.int64))


@triton.jit
def _finish_kernel(LOSS_ROWS, Z_ROWS, T, COUNT, OUT, OUT_Z, M, ignore_index,
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


# --------------------------------------------------------------------------------------------
# launch heuristics and launchers
# --------------------------------------------------------------------------------------------
def ce_rows(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, *, loss: Optional[torch.Tensor] = None,
            z_loss: Optional[torch.Tensor] = None, dlogits: Optional[torch.Tensor] = None,
            grad_output: Optional[torch.Tensor] = None, count: Optional[torch.Tensor] = None,
            ignore_index: int = -100, smoothing: float = 0.0, z_coef: float = 0.0, softcap: Optional[float] = None,
            config: Optional[CrossEntropyConfig] = None) -> None:
    """Per-row cross-entropy over a block of logits: the row launcher of this module.

    ``logits [R, V]`` (unit stride along V; rows may be strided, e.g. a chunk of a bigger
    block), ``target [R]``, ``lse [R]`` fp32. Nothing is reduced over rows and nothing is
    allocated but scratch; each output is written in place:

    - ``loss`` given (``[R]`` fp32): the forward. Writes each row's loss (0 for ignored rows,
      NaN for targets outside ``[0, V)``, which are not read), its z-loss part into ``z_loss``
      (``[R]`` fp32, optional) and its logsumexp into ``lse``.
    - ``dlogits`` given (``[R, V]``, strided rows allowed; may be ``logits`` itself): writes
      ``d loss_row / d logits`` times the row's scale: ``grad_output`` (0-d, or ``[R]`` with any
      stride: an upstream gradient per row; default 1) times ``1 / count`` when ``count`` (0-d
      int, the rows of a ``mean``) is given. With ``loss`` too the gradient is formed in the
      forward, which reads the logits once (``grad_output`` is for a gradient after the
      forward); without, ``lse`` must hold the rows' logsumexps from an earlier forward.

    ``smoothing``, ``z_coef``, ``softcap`` are ``cross_entropy``'s label_smoothing, z_loss and
    softcap; ``config`` the launch configuration (default ``ce_config``'s: tuned on this device,
    else derived from ``DEFAULT_CONFIG``).
    """
    m, v = logits.shape
    if m == 0:
        return
    forward, grad = loss is not None, dlogits is not None
    if forward and grad_output is not None:
        raise ValueError("ce_rows: grad_output scales a gradient formed after the forward (loss=None)")
    has_softcap = softcap is not None
    run = _ROWS[m, v, forward, grad, grad_output is not None, count is not None, smoothing > 0, z_coef > 0,
                z_loss is not None, has_softcap, logits.get_device(), config]
    run(logits, target, lse, loss, z_loss, dlogits, grad_output, count, ignore_index, smoothing, z_coef,
        softcap if has_softcap else 1.0)


def _rows_plan(m: int, v: int, forward: bool, grad: bool, has_g: bool, mean: bool, has_smoothing: bool, has_z: bool,
               store_z: bool, has_softcap: bool, device_index: int, config: Optional[CrossEntropyConfig]):
    """The launches of one ``ce_rows`` call's sizes and switches, resolved once:
    ``run(logits, target, lse, loss, z_loss, dlogits, grad_output, count, ignore_index, smoothing,
    z_coef, cap)``."""
    device = device_of(device_index)
    config = config or ce_config(v, device)
    switches = dict(HAS_SMOOTHING=has_smoothing, HAS_SOFTCAP=has_softcap)
    parts, span = split_forward_parts(v, m, config) if forward and not grad else (1, v)
    if parts > 1:
        combine = config.split_forward
        partial_kernel = launcher(_ce_partial_kernel, **switches, BLOCK_V=config.forward.block_v,
                                  num_warps=config.forward.num_warps)
        combine_kernel = launcher(_ce_combine_kernel, PARTS_POW2=next_pow2(parts), HAS_SMOOTHING=has_smoothing,
                                  HAS_Z=has_z, STORE_Z=store_z, HAS_SOFTCAP=has_softcap,
                                  BLOCK_R=combine.combine_rows, num_warps=combine.combine_warps)
        partial_grid, combine_grid = (m * parts,), (cdiv(m, combine.combine_rows),)

        def split_forward(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
            partials = logits.new_empty((3, m, parts), dtype=torch.float32)
            partial_kernel(partial_grid, logits, partials, m, v, logits.stride(0), cap, parts, span)
            combine_kernel(combine_grid, logits, target, partials, loss, pointer(z_loss, loss), lse, m, v,
                           logits.stride(0), ignore_index, smoothing, z_coef, cap, parts)
        return split_forward
    split = inplace_split(v, m, device, config) if forward and grad else None
    if split is not None:
        parts, groups = split
        inplace = config.split_inplace
        # (several programs a multiprocessor: registers capped so that every program is resident)
        resident = {} if inplace.per_sm == 1 else {"maxnreg": resident_registers(inplace.num_warps, inplace.per_sm)}
        handle = launcher(_ce_fused_split_kernel, MEAN=mean, HAS_SMOOTHING=has_smoothing, HAS_Z=has_z,
                          STORE_Z=store_z, HAS_SOFTCAP=has_softcap, PARTS=parts, PARTS_POW2=next_pow2(parts),
                          BLOCK_V=inplace.block_v, num_warps=inplace.num_warps, **resident)
        grid = (groups * parts,)

        def split_inplace(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
            handle(grid, logits, target, loss, pointer(z_loss, loss), lse, dlogits, pointer(count, lse),
                   logits.new_zeros((m, parts, 4), dtype=torch.int64),
                   m, v, logits.stride(0), dlogits.stride(0), ignore_index, smoothing, z_coef, cap)
        return split_inplace
    row_pass = (config.inplace if forward else config.backward) if grad else config.forward
    block_m, block_v, num_warps, one_block = row_tiles(v, m, row_pass, config)
    tiles = cdiv(m, block_m)
    grid = (tiles if row_pass.per_sm == 0 else min(tiles, persistent_programs(device, row_pass.per_sm)),)
    handle = launcher(_ce_kernel, FORWARD=forward, GRAD=grad, HAS_G=has_g, MEAN=mean, HAS_SMOOTHING=has_smoothing,
                      HAS_Z=has_z, STORE_Z=store_z, HAS_SOFTCAP=has_softcap, PASS1_EVICT=row_pass.evict[0],
                      PASS2_EVICT=row_pass.evict[1], BLOCK_M=block_m, BLOCK_V=block_v, ONE_BLOCK=one_block,
                      num_warps=num_warps)

    def rows(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
        handle(grid, logits, target, pointer(loss, lse), pointer(z_loss, lse), lse, pointer(dlogits, logits),
               pointer(g, lse), pointer(count, lse), m, v, logits.stride(0), row_stride(dlogits),
               0 if g is None or g.dim() == 0 else g.stride(0), ignore_index, smoothing, z_coef, cap)
    return rows


_ROWS = Plans(_rows_plan)


def _scale_plan(r: int, n: int, device_index: int):
    block_n = min(4096, max(16, next_pow2(n)))
    block_r = max(1, 4096 // block_n)
    device = device_of(device_index)
    programs = min(cdiv(r, block_r), persistent_programs(device, 8))
    return launcher(_scale_rows_kernel, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=8), (programs,)


_SCALE = Plans(_scale_plan)


def scale_rows_(dx: torch.Tensor, g: torch.Tensor) -> None:
    """``dx [R, N] *= g`` in place, ``g`` 0-d or ``[R]``; rows whose factor is 1 are skipped."""
    r, n = dx.shape
    if r == 0 or n == 0:
        return
    if n > 1 and dx.stride(1) != 1:  # the kernel steps along a row by one element
        raise RuntimeError(f"scale_rows_ needs rows of unit column stride, got strides {dx.stride()}")
    handle, grid = _SCALE[r, n, dx.get_device()]
    handle(grid, dx, g, r, n, dx.stride(0), 0 if g.dim() == 0 else g.stride(0))


def _one_program(kernel, m: int, **switches):
    """The Launcher of a one-program kernel over M rows."""
    block, num_warps = (128, 4) if m <= 128 else (2048, 8)
    return launcher(kernel, **switches, BLOCK=block, num_warps=num_warps)


class _TargetFlag(threading.local):
    """Per thread: the host word the target check writes (pinned on a GPU: the kernel writes it
    through its device mapping, with no copy back; the host reads it after the check kernel's
    event, so a call's check is done before the next call's starts), and an event per device."""

    def __init__(self):
        self.words: dict = {}  # pinned or not -> int64 [1]
        self.events: dict = {}

    def word(self, pinned: bool) -> torch.Tensor:
        word = self.words.get(pinned)
        if word is None:
            word = self.words[pinned] = torch.empty(1, dtype=torch.int64, device="cpu", pin_memory=pinned)
        return word

    def event(self, device_index: int):
        event = self.events.get(device_index)
        if event is None:
            event = self.events[device_index] = torch.cuda.Event()
        return event


_FLAG = _TargetFlag()
_CHECK = Plans(lambda m: _one_program(_check_targets_kernel, m))
# Whether the check kernel writes the pinned host word itself (unified addressing makes pinned host
# memory a kernel's to write); turned off, and the word copied back from the device instead, where
# Triton refuses it.
MAPPED_FLAG = True


def start_target_check(target: torch.Tensor, v: int, ignore_index: int):
    """Launch the search for a target outside ``[0, V)`` (not ``ignore_index``) ahead of the
    main kernel; ``finish_target_check`` reads its answer. On a GPU the host then waits for this
    small kernel only, not for the cross-entropy kernels queued after it, so the GPU does not
    idle while the host checks. None while a CUDA graph is being captured (no check then)."""
    m = target.shape[0]
    check = _CHECK[m]
    if not target.is_cuda:  # (the interpreter)
        word = _FLAG.word(False)
        check((1,), target, word, m, v, ignore_index)
        return word, None
    if torch.cuda.is_current_stream_capturing():
        return None
    word = _check_to_host(check, target, v, ignore_index)
    done = _FLAG.event(target.get_device())
    done.record()
    return word, done


def _check_to_host(check, target: torch.Tensor, v: int, ignore_index: int) -> torch.Tensor:
    """Launch ``check`` on a GPU's ``target`` writing the thread's pinned host word, or where
    Triton refuses host memory (then from now on) a device word copied back to the host."""
    global MAPPED_FLAG
    m = target.shape[0]
    if MAPPED_FLAG:
        word = _FLAG.word(True)
        try:
            check((1,), target, word, m, v, ignore_index)
            return word
        except ValueError:  # "Pointer argument cannot be accessed from Triton"
            MAPPED_FLAG = False
    on_device = target.new_empty(1, dtype=torch.int64)
    check((1,), target, on_device, m, v, ignore_index)
    return on_device.to("cpu", non_blocking=True)


def finish_target_check(pending, target: torch.Tensor, v: int, ignore_index: int) -> None:
    """Raise ValueError naming the first out-of-range target found by ``start_target_check``."""
    if pending is None:
        return
    word, done = pending
    if done is not None:
        done.synchronize()
    row = word.item() - 1
    if row >= 0:
        raise ValueError(f"target[{row}] = {int(target[row].item())} is outside [0, {v}) (the vocabulary "
                         f"size) and is not ignore_index ({ignore_index})")


def row_buffers(m: int, want_z: bool, z_coef: float, device: torch.device):
    """What a forward writes per row: (lse [M] fp32, loss [M] fp32, z-loss [M] fp32 or None)."""
    lse = torch.empty(m, dtype=torch.float32, device=device)
    return lse, torch.empty_like(lse), (torch.empty_like(lse) if want_z and z_coef > 0 else None)


def count_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Rows not ignored (0-d int64): for passes that scale a gradient by ``1 / count`` as they go."""
    return (target != ignore_index).sum()


def _finish_plan(m: int, reduce: bool, mean: bool, has_z: bool, count_given: bool):
    return _one_program(_finish_kernel, m, REDUCE=reduce, MEAN=mean, HAS_Z=has_z, COUNT_GIVEN=count_given)


_FINISH = Plans(_finish_plan)


def finish_loss(loss_rows, z_rows, target, *, ignore_index: int, reduction: str, want_z: bool,
                dtype: torch.dtype, count: Optional[torch.Tensor] = None):
    """Reduce the per-row losses to ``dtype`` (and the z-loss part when ``want_z``) in one
    small kernel, which also counts the rows for ``mean`` unless ``count`` is given.
    Returns (loss, z-loss part or None, count (0-d int64, ``mean`` only) or None)."""
    m = loss_rows.shape[0]
    reduce = reduction != "none"
    loss = loss_rows.new_empty(() if reduce else (m,), dtype=dtype)
    z = None if z_rows is None else torch.empty_like(loss)
    out_count = None
    if reduction == "mean":
        out_count = count if count is not None else target.new_empty((), dtype=torch.int64)
    _FINISH[m, reduce, out_count is not None, z is not None, count is not None](
        (1,), loss_rows, pointer(z_rows, loss_rows), target, pointer(out_count, loss_rows), loss, pointer(z, loss), m,
        ignore_index)
    if want_z and z is None:
        z = torch.zeros_like(loss)
    return loss, z, out_count


def _ce_forward(logits, target, ignore_index: int, reduction: str, smoothing: float, z_coef: float,
                softcap: Optional[float], want_z: bool, check: bool, config: Optional[CrossEntropyConfig] = None,
                dlogits: Optional[torch.Tensor] = None):
    """Forward of ``cross_entropy``. With ``dlogits`` (``logits`` itself, or a ``[M, V]``
    buffer), also writes the gradient of the reduced loss for an upstream gradient of 1.
    Returns (loss, z-loss part or None, lse [M] fp32, count (0-d int64, ``mean`` only) or None)."""
    m, v = logits.shape
    pending = start_target_check(target, v, ignore_index) if check else None
    lse, loss_rows, z_rows = row_buffers(m, want_z, z_coef, logits.device)
    # A gradient formed in this pass needs 1 / count before the rows are summed.
    count = count_rows(target, ignore_index) if dlogits is not None and reduction == "mean" else None
    ce_rows(logits, target, lse, loss=loss_rows, z_loss=z_rows, dlogits=dlogits, count=count,
            ignore_index=ignore_index, smoothing=smoothing, z_coef=z_coef, softcap=softcap, config=config)
    loss, z, count = finish_loss(loss_rows, z_rows, target, ignore_index=ignore_index, reduction=reduction,
                                 want_z=want_z, dtype=logits.dtype, count=count)
    finish_target_check(pending, target, v, ignore_index)
    return loss, z, lse, count


def _ce_forward_inplace(logits, *args, config: Optional[CrossEntropyConfig] = None):
    """The forward that writes the gradient over the logits (``inplace_backward``)."""
    return _ce_forward(logits, *args, config=config, dlogits=logits)


def _ce_backward_launcher(grad, logits, target, lse, count, ignore_index: int, smoothing: float, z_coef: float,
                          softcap: Optional[float], config: Optional[CrossEntropyConfig] = None):
    """The separate backward: re-reads the logits, with the forward's ``lse``."""
    dx = torch.empty_like(logits, memory_format=torch.contiguous_format)
    ce_rows(logits, target, lse, dlogits=dx, grad_output=grad, count=count, ignore_index=ignore_index,
            smoothing=smoothing, z_coef=z_coef, softcap=softcap, config=config)
    return dx


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::cross_entropy_fwd /
# cross_entropy_bwd); the in-place gradient is an eager-only variant (torch.compile plans the
# logits' memory itself).
# --------------------------------------------------------------------------------------------
def _ce_fake(logits, target, ignore_index, reduction, smoothing, z_coef, softcap, want_z, check):
    m = logits.shape[0]
    loss = logits.new_empty((m,) if reduction == "none" else ())
    count = target.new_empty((), dtype=torch.int64) if reduction == "mean" else None
    return loss, (loss.new_empty(loss.shape) if want_z else None), logits.new_empty(m, dtype=torch.float32), count


def _ce_setup(ctx, inputs, outputs, config: Optional[CrossEntropyConfig] = None):
    logits, target, ignore_index, reduction, smoothing, z_coef, softcap, want_z, check = inputs
    _, _, lse, count = outputs
    ctx.save_for_backward(logits, target, lse, count if reduction == "mean" else None)
    ctx.options = (ignore_index, smoothing, z_coef, softcap)
    ctx.config = config


def _ce_backward(ctx, bwd, grad, *_):
    logits, target, lse, count = ctx.saved_tensors
    return (bwd(grad, logits, target, lse, count, *ctx.options, config=ctx.config),)


CE = Op("cross_entropy", forward=_ce_forward, setup=_ce_setup, backward=_ce_backward, grad_inputs=(0,), returns=3,
        non_differentiable=(1, 2), fake=_ce_fake,
        schema="(Tensor logits, Tensor target, SymInt ignore_index, str reduction, float smoothing, float z_coef, "
               "float? softcap, bool want_z, bool check) -> (Tensor, Tensor, Tensor, Tensor)",
        backward_launcher=_ce_backward_launcher,
        backward_fake=lambda grad, logits, *_: logits.new_empty(logits.shape),
        backward_schema="(Tensor grad, Tensor logits, Tensor target, Tensor lse, Tensor? count, SymInt ignore_index, "
                        "float smoothing, float z_coef, float? softcap) -> Tensor")


def _ce_inplace_setup(ctx, inputs, outputs, config: Optional[CrossEntropyConfig] = None):
    ctx.save_for_backward(inputs[0])


def _mark_overwritten(logits: torch.Tensor) -> None:
    """Before the in-place forward is recorded: bump the logits' version, so that other autograd
    nodes that saved them fail loudly instead of silently using the gradient written over them.
    A view's history is remade on its first use after a version change; reading ``grad_fn`` here
    remakes it before autograd takes it as the op's input, so ``autograd.grad(loss, logits)`` and
    ``retain_grad`` reach the op's gradient (bumped inside the forward, they found a stale node)."""
    torch.autograd.graph.increment_version(logits)
    logits.grad_fn


def _ce_inplace_backward(ctx, _, grad, *__):
    (dx,) = ctx.saved_tensors
    scale_rows_(dx, grad)
    return (dx,)


CE_INPLACE = Op("cross_entropy_inplace", forward=_ce_forward_inplace, setup=_ce_inplace_setup,
                backward=_ce_inplace_backward, grad_inputs=(0,), returns=3, non_differentiable=(1, 2), base=CE,
                once="cross_entropy(inplace_backward=True) formed its gradient in the forward and scaled it in "
                     "place: backward can run through it only once")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def check_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap) -> None:
    """Validate the options shared by ``cross_entropy`` and ``linear_cross_entropy``."""
    if type(ignore_index) is not int and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_target(target, m: int, like: torch.Tensor, rows_of: str) -> None:
    """Validate class indices ``target [m]`` for ``m`` rows of ``rows_of`` (an argument's name)."""
    check_tensor("target", target, like=like, like_name=rows_of, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got dtype {target.dtype}")
    if target.dim() != 1 or target.shape[0] != m:
        raise ValueError(f"target must have shape [{m}] (one class index per row of {rows_of}), "
                         f"got {list(target.shape)}")


def package_output(loss, z, lse, return_z_loss: bool, return_lse: bool):
    """``loss``, or the :class:`CrossEntropyOutput` the ``return_*`` flags ask for."""
    if not (return_z_loss or return_lse):
        return loss
    return CrossEntropyOutput(loss, z.detach() if return_z_loss else None, lse.detach() if return_lse else None)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                  return_z_loss: bool = False, return_lse: bool = False, inplace_backward: bool = False,
                  check_targets: bool = True, config: Optional[CrossEntropyConfig] = None):
    """Cross-entropy of ``logits [M, V]`` against class indices ``target [M]``.

    Equal to ``torch.nn.functional.cross_entropy(logits, target, ignore_index=...,
    reduction=..., label_smoothing=...)`` (within rounding), plus:

    Args:
        logits: ``[M, V]`` float32/bfloat16/float16 (float64 runs the reference); rows may be
            strided (a slice of a bigger tensor) as long as V has unit stride. V up to 262144
            and beyond; statistics in fp32.
        target: ``[M]`` int64 or int32 in ``[0, V)``, or ``ignore_index``.
        ignore_index: rows with this target get loss 0 and gradient 0, and ``mean`` does not
            count them (all rows ignored: ``mean`` is NaN, as in PyTorch).
        reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"`` (``[M]``).
        label_smoothing: eps in [0, 1]: the target distribution is ``(1 - eps) * onehot + eps / V``.
        z_loss: adds ``z_loss * lse**2`` per row (PaLM's auxiliary loss keeping ``lse`` near 0).
        softcap: Gemma 2's final-logit soft cap: the logits become ``softcap * tanh(logits /
            softcap)`` before the softmax.
        return_z_loss, return_lse: return a :class:`CrossEntropyOutput` ``(loss, z_loss, lse)``
            instead of ``loss`` alone: ``z_loss`` is the z-loss term reduced like ``loss``
            (already included in ``loss``; zeros when ``z_loss=0``), ``lse`` the fp32
            logsumexp of every row ``[M]`` (of the softcapped logits). Both carry no gradient.
        inplace_backward: when a gradient is needed, form it during the forward and write it
            into ``logits``: training then needs no second ``[M, V]`` buffer. **The logits
            are overwritten** (autograd raises if another op saved them for its backward), and
            the backward can run only once. The backward multiplies by the upstream gradient
            in place, a pass it skips when that is exactly 1 (``loss.backward()``). Ignored
            under torch.compile. (Faster than the default, which reads the logits twice; see the
            module notes.)
        check_targets: raise ValueError when a target is outside ``[0, V)`` and not
            ``ignore_index``. A small kernel searches the targets before the main kernel and
            the host waits for that one alone (not for the kernels queued after it; skipped
            during CUDA graph capture). With ``False`` there is no wait, and such rows give a
            NaN loss. Either way no memory outside the logits is read.
        config: the launch configuration of the kernels (a :class:`CrossEntropyConfig`, for
            tests and tuning); default the one tuned on this device, else derived from
            ``DEFAULT_CONFIG`` (``configs/cross_entropy.py``). Not used under
            torch.compile.

    Returns:
        ``loss`` in the logits' dtype (0-d, or ``[M]`` for ``"none"``), or a
        :class:`CrossEntropyOutput`. Differentiable in ``logits``.

    Without ``inplace_backward`` the backward re-reads the logits (saved, not copied) with the
    forward's fp32 ``lse`` and writes a new gradient.
    """
    check_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape [M, V] with V >= 1, got {list(logits.shape)}")
    check_target(target, logits.shape[0], logits, "logits")
    check_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    smoothing, z_coef = float(label_smoothing), float(z_loss)
    softcap = None if softcap is None else float(softcap)
    if not use_kernels(logits) or logits.dtype == torch.float64:
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss, z, lse = reference.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                               label_smoothing=smoothing, z_loss=z_coef, softcap=softcap,
                                               check_targets=check_targets, compute_dtype=compute)
        return package_output(loss, z, lse, return_z_loss, return_lse)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    op = CE
    if inplace_backward:
        op = CE_INPLACE
        if not torch.compiler.is_compiling() and CE_INPLACE.needs_grad((logits,)):
            _mark_overwritten(logits)
    loss, z, lse = op(logits, target, ignore_index, reduction, smoothing, z_coef, softcap, return_z_loss,
                      check_targets, config=config)
    return package_output(loss, z, lse, return_z_loss, return_lse)
