"""Distillation losses between two LM heads without either model's ``[M, V]`` logits.

Student ``hidden [M, Hs]``, ``weight [V, Hs]``; teacher ``hidden [M, Ht]``, ``weight [V, Ht]``;
``Q = softmax(student logits / T)``, ``P = softmax(teacher logits / T)``. Per row:

    forward_kl   KL(P || Q) = sum P (log P - log Q)        d / d zs = Q - P
    reverse_kl   KL(Q || P) = sum Q (log Q - log P)        d / d zs = Q (log Q - log P - KL)
    jsd          beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q
                                                           d / d zs = Q (d - sum Q d),
                                                           d = (1 - beta) (log Q - log M)

(``jsd`` is Liger's generalised JSD for 0 < beta < 1: beta weighs the teacher; beta = 0.5 is
the symmetric JSD.) Gradients reach the student's hidden states and weight only; ``zs`` is the
student's logits over T, so the chain rule adds ``1 / T``.

Rows go through in chunks of C: both ``[C, V]`` logits blocks come from cuBLAS in the models'
dtypes, ``_distill_kernel`` reads them row by row (a pass for the log-sum-exps and, for the
KLs, the loss; a second for the JSD's sums; a last one writes the gradient over the student's
logits), then ``grad_hidden[chunk] = G @ weight`` and ``grad_weight += G.T @ hidden_chunk``.
With ``reduction`` ``"mean"``/``"sum"`` this happens during the forward (for an upstream
gradient of 1; the backward scales in place); with ``"none"`` the backward recomputes the
chunks. Matmuls: 4 (student and teacher logits, two gradients), as Liger's FusedLinearJSD.

The weight gradient is summed over chunks in fp32 (``accum_dtype=torch.float32``, a
``[V, Hs]`` fp32 buffer during the forward) or in the weight's dtype (``accum_dtype=None``:
half the memory, one rounding per chunk); with ``memory="low"`` it goes over vocabulary chunks
instead, each one matmul over all rows (2 more matmuls, no accumulator).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import reference
from .._args import cdiv, or_stand_in
from .._launch import launch, use_kernels
from .._triton import tl, triton
from ..configs.linear_losses import DEFAULT_CONFIG
from .base import (DEFAULT_MEMORY, Head, accumulate_mm, aligned_cols, check_chunking, check_head, check_ignore_index,
                   check_reduction, check_target, check_temperature, chunk_rows, count_rows, finish_target_check,
                   gathered, grads_fake, grads_needed, head_loss_ops, online_step, reduced, row_chunks,
                   start_target_check, vocab_chunks)

KINDS = reference.DISTILL_KINDS


class DistillOptions(NamedTuple):
    """The options of a ``linear_distill_loss`` call, named once: the custom ops' schemas and the
    autograd context are made of these fields."""

    kind: str  # one of KINDS
    beta: float
    temperature: float
    ignore_index: int
    reduction: str
    check: bool  # check_targets
    chunk_size: Optional[int]
    accum_dtype: Optional[torch.dtype]
    need: tuple[bool, ...]  # which of student_hidden and student_weight want a gradient
    memory: str


Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _logits_pair(s_row, t_row, offset, V, inv_temp, BLOCK_V: tl.constexpr):
    """Columns ``offset ..`` of a student and a teacher row over the temperature (-inf past V)."""
    cols = (offset + tl.arange(0, BLOCK_V))[None, :]
    zs = tl.load(s_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
    zt = tl.load(t_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
    return cols, zs, zt


@triton.jit
def _jsd_terms(zs, zt, lse_s, lse_t, beta):
    """(row loss terms, d = (1 - beta)(log Q - log M), Q) of a tile; 0 where the class is masked
    (probability exactly 0: tests are ``== 0``, not ``> 0``, so that a NaN stays NaN)."""
    log_q = zs - lse_s[:, None]
    log_p = zt - lse_t[:, None]
    q = tl.exp(log_q)
    p = tl.exp(log_p)
    mix = beta * p + (1.0 - beta) * q
    log_m = tl.log(tl.where(mix == 0, 1.0, mix))
    d = tl.where(q == 0, 0.0, (1.0 - beta) * (log_q - log_m))
    terms = tl.where(p == 0, 0.0, beta * p * (log_p - log_m)) + q * d
    return terms, d, q


@triton.jit
def _grad_tile(zs, zt, lse_s, lse_t, aux, beta, KIND: tl.constexpr):
    """d loss / d zs of a tile from the row statistics (``aux``: the row's KL for the reverse KL,
    ``sum Q d`` for the JSD)."""
    if KIND == "forward_kl":
        g = tl.exp(zs - lse_s[:, None]) - tl.exp(zt - lse_t[:, None])
    elif KIND == "reverse_kl":
        q = tl.exp(zs - lse_s[:, None])
        g = tl.where(q == 0, 0.0, q * ((zs - lse_s[:, None]) - (zt - lse_t[:, None]) - aux[:, None]))
    elif KIND == "jsd":
        _, d, q = _jsd_terms(zs, zt, lse_s, lse_t, beta)
        g = q * (d - aux[:, None])
    else:
        tl.static_assert(False, "a kind of reference.DISTILL_KINDS without its branch in _grad_tile")
    return g


@triton.jit
def _row_scale(TGT, SCALE, row, stride_scale, ignore_index, inv_temp, HAS_TARGET: tl.constexpr,
               HAS_SCALE: tl.constexpr):
    """(whether the row counts, its gradient scale: upstream times ``inv_temp``), each ``[1]``."""
    one = tl.arange(0, 1)
    valid = tl.full([1], 1, tl.int1)
    if HAS_TARGET:
        valid = tl.load(TGT + row + one) != ignore_index
    scale = tl.full([1], 1.0, tl.float32) * inv_temp
    if HAS_SCALE:
        scale *= tl.load(SCALE + row * stride_scale + one).to(tl.float32)
    return valid, scale


@triton.jit
def _distill_kernel(S, TT, LOSS, STATS, TGT, SCALE, V, stride_s, stride_t, stride_stats, stride_scale, ignore_index,
                    inv_temp, beta, KIND: tl.constexpr, GRAD: tl.constexpr, HAS_TARGET: tl.constexpr,
                    HAS_SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row per program of student logits ``S`` and teacher logits ``TT``: ``LOSS[row]`` (0 for
    ignored rows), ``STATS[:, row]`` (lse of each, and ``aux`` of ``_grad_tile``) and, with GRAD,
    the gradient times ``SCALE`` (0-d or per row) and ``inv_temp`` written over the row of ``S``.
    KIND: one of ``reference.DISTILL_KINDS``."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * stride_s
    t_row = TT + row * stride_t
    one = tl.arange(0, 1)
    ms = tl.full([1], float("-inf"), tl.float32)
    mt = tl.full([1], float("-inf"), tl.float32)
    ss = tl.zeros([1], dtype=tl.float32)
    st = tl.zeros([1], dtype=tl.float32)
    w = tl.zeros([1], dtype=tl.float32)
    for offset in range(0, V, BLOCK_V):
        cols, zs, zt = _logits_pair(s_row, t_row, offset, V, inv_temp, BLOCK_V)
        ms, scale_s, es = online_step(zs, ms)
        mt, scale_t, et = online_step(zt, mt)
        ss = ss * scale_s + tl.sum(es, axis=1)
        st = st * scale_t + tl.sum(et, axis=1)
        if KIND == "forward_kl":  # sum over classes of exp(zt - mt) (zt - zs): KL(P || Q) without a second pass
            w = w * scale_t + tl.sum(tl.where(et == 0, 0.0, et * (zt - zs)), axis=1)
        elif KIND == "reverse_kl":
            w = w * scale_s + tl.sum(tl.where(es == 0, 0.0, es * (zs - zt)), axis=1)
        elif KIND == "jsd":  # (its sums need both rows' lse: a second pass below)
            pass
    lse_s = tl.where(ms == float("-inf"), 0.0, ms) + tl.log(ss)
    lse_t = tl.where(mt == float("-inf"), 0.0, mt) + tl.log(st)
    if KIND == "forward_kl":
        loss = w / st - lse_t + lse_s
        aux = loss
    elif KIND == "reverse_kl":
        loss = w / ss - lse_s + lse_t
        aux = loss
    elif KIND == "jsd":
        loss = tl.zeros([1], dtype=tl.float32)
        aux = tl.zeros([1], dtype=tl.float32)  # sum over classes of Q d
        for offset in range(0, V, BLOCK_V):
            cols, zs, zt = _logits_pair(s_row, t_row, offset, V, inv_temp, BLOCK_V)
            terms, d, q = _jsd_terms(zs, zt, lse_s, lse_t, beta)
            loss += tl.sum(terms, axis=1)
            aux += tl.sum(q * d, axis=1)
    else:
        tl.static_assert(False, "a kind of reference.DISTILL_KINDS without its branch in _distill_kernel")
    valid, scale = _row_scale(TGT, SCALE, row, stride_scale, ignore_index, inv_temp, HAS_TARGET, HAS_SCALE)
    tl.store(LOSS + row + one, tl.where(valid, loss, 0.0))
    tl.store(STATS + row + one, lse_s)
    tl.store(STATS + stride_stats + row + one, lse_t)
    tl.store(STATS + 2 * stride_stats + row + one, aux)
    if GRAD:
        for offset in range(0, V, BLOCK_V):
            cols, zs, zt = _logits_pair(s_row, t_row, offset, V, inv_temp, BLOCK_V)
            g = _grad_tile(zs, zt, lse_s, lse_t, aux, beta, KIND)
            g = tl.where(valid[:, None], g * scale[:, None], 0.0)
            tl.store(s_row + cols, g.to(S.dtype.element_ty), mask=cols < V)


@triton.jit
def _distill_block_kernel(S, TT, STATS, TGT, SCALE, N, stride_s, stride_t, stride_stats, stride_scale, ignore_index,
                          inv_temp, beta, KIND: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):
    """``memory="low"``: the gradient of columns ``[0, N)`` of a vocabulary chunk (student logits
    ``S [M, N]``, teacher's ``TT``) from the row statistics ``STATS [3, M]`` of the row pass,
    written over ``S``. Grid: (M, cdiv(N, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    offset = tl.program_id(1) * BLOCK
    cols, zs, zt = _logits_pair(S + row * stride_s, TT + row * stride_t, offset, N, inv_temp, BLOCK)
    lse_s = tl.load(STATS + row + one)
    lse_t = tl.load(STATS + stride_stats + row + one)
    aux = tl.load(STATS + 2 * stride_stats + row + one)
    valid, scale = _row_scale(TGT, SCALE, row, stride_scale, ignore_index, inv_temp, HAS_TARGET, HAS_SCALE)
    g = tl.where(valid[:, None], _grad_tile(zs, zt, lse_s, lse_t, aux, beta, KIND) * scale[:, None], 0.0)
    tl.store(S + row * stride_s + cols, g.to(S.dtype.element_ty), mask=cols < N)


def _kernel_flags(options: DistillOptions, target, scale) -> dict:
    """The constexprs the two kernels share, and the kernels' launch."""
    kernel = DEFAULT_CONFIG.kernel("distill")
    return dict(KIND=options.kind, HAS_TARGET=target is not None, HAS_SCALE=scale is not None,
                num_warps=kernel.num_warps)


def _scale_stride(scale: Optional[torch.Tensor]) -> int:
    """The row stride of an upstream ``scale``: 0 when it is absent or one value (0-d) for every row."""
    return 0 if scale is None or scale.dim() == 0 else scale.stride(0)


def _chunked(student: Head, teacher: Head, target, loss_rows, stats, options: DistillOptions, *, chunk: int,
             grads=(None, None), scale=None, grad: bool = False):
    """The row chunks: ``loss_rows [M]`` and ``stats [3, M]``; with ``grad`` also ``grads =
    (grad_hidden [M, Hs], grad_weight accumulator [V, Hs])`` (each optional) for the upstream
    ``scale`` (None: 1; a 0-d or ``[M]`` fp32 tensor)."""
    grad_hidden, grad_weight = grads
    v = student.weight.shape[0]
    for rows, s, t in row_chunks(chunk, student, teacher):
        row_scale = scale if scale is None or scale.dim() == 0 else rows(scale)
        launch(_distill_kernel, (s.shape[0],), s, t, rows(loss_rows), stats[:, rows.span],
               or_stand_in(rows(target), loss_rows), or_stand_in(row_scale, loss_rows), v, s.stride(0), t.stride(0),
               stats.stride(0), _scale_stride(row_scale), options.ignore_index, 1.0 / options.temperature,
               options.beta, GRAD=grad, BLOCK_V=DEFAULT_CONFIG.kernel("distill").block_v,
               **_kernel_flags(options, target, row_scale))
        if grad and grad_hidden is not None:
            torch.mm(s, student.weight, out=rows(grad_hidden))
        if grad and grad_weight is not None:
            accumulate_mm(grad_weight, s.t(), rows(student.hidden))


def _weight_grad_by_vocab(student: Head, teacher: Head, target, stats, scale, options: DistillOptions, *,
                          chunk: int):
    """``memory="low"``: the student's weight gradient over vocabulary chunks of a row chunk's
    worth of logits (``chunk * V / M`` columns, aligned), from the row statistics: both models'
    logits ``[M, Cv]`` recomputed, the gradient written over the student's, ``grad_weight[v] =
    G.T @ student_hidden`` one matmul over all rows (fp32 sums in cuBLAS, rounded once)."""
    m, v = student.hidden.shape[0], student.weight.shape[0]
    if m == 0:  # no rows: a zero gradient (and no chunk width to derive from M)
        return torch.zeros_like(student.weight, memory_format=torch.contiguous_format)
    block = DEFAULT_CONFIG.kernel("distill").block_v
    grad_weight = torch.empty_like(student.weight, memory_format=torch.contiguous_format)
    for v0, n, s, t in vocab_chunks(aligned_cols(max(1, chunk * v // m), v), student, teacher):
        launch(_distill_block_kernel, (m, cdiv(n, block)), s, t, stats, or_stand_in(target, stats),
               or_stand_in(scale, stats), n, s.stride(0), t.stride(0), stats.stride(0), _scale_stride(scale),
               options.ignore_index, 1.0 / options.temperature, options.beta, BLOCK=block,
               **_kernel_flags(options, target, scale))
        torch.mm(s.t(), student.hidden, out=grad_weight[v0:v0 + n])
    return grad_weight


def _grads(student: Head, teacher: Head, target, loss_rows, scale, options: DistillOptions, need: tuple):
    """(grad_hidden, grad_weight) each None unless ``need``-ed, for the upstream ``scale``
    (None: 1), writing ``loss_rows``: the row chunks (and, with ``memory="low"``, the
    vocabulary chunks for the weight gradient)."""
    m, v = student.hidden.shape[0], student.weight.shape[0]
    low = options.memory == "low"
    gh = torch.empty_like(student.hidden, memory_format=torch.contiguous_format) if need[0] else None
    gw = None
    if need[1] and not low:
        gw = torch.zeros(student.weight.shape, dtype=options.accum_dtype or student.weight.dtype,
                         device=student.weight.device)
    stats = torch.empty((3, m), dtype=torch.float32, device=student.hidden.device)
    size = max(student.hidden.element_size(), teacher.hidden.element_size())
    chunk = chunk_rows(m, v, size, student.hidden.device, options.chunk_size,
                       DEFAULT_CONFIG.low_memory_chunk_bytes if low else DEFAULT_CONFIG.chunk_bytes)
    _chunked(student, teacher, target, loss_rows, stats, options, chunk=chunk, grads=(gh, gw), scale=scale,
             grad=gh is not None or gw is not None)
    if need[1] and low:
        gw = _weight_grad_by_vocab(student, teacher, target, stats, scale, options, chunk=chunk)
    return gh, (None if gw is None else gw.to(student.weight.dtype))


def _distill_forward(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                     teacher_weight: torch.Tensor, target: Optional[torch.Tensor],
                     options: DistillOptions) -> Outputs:
    """Returns (loss, grad_hidden, grad_weight): the gradients (each None unless ``need``-ed, and
    only for reductions other than ``"none"``) for an upstream gradient of 1."""
    m, v = student_hidden.shape[0], student_weight.shape[0]
    dev = student_hidden.device
    ignore_index, reduction = options.ignore_index, options.reduction
    pending = start_target_check(target, v, ignore_index) if options.check and target is not None else None
    loss_rows = torch.empty(m, dtype=torch.float32, device=dev)
    fused = reduction != "none" and any(options.need)
    count = scale = None
    if fused and reduction == "mean":
        count = torch.full((), m, dtype=torch.int64, device=dev) if target is None else count_rows(target, ignore_index)
        scale = 1.0 / count.to(torch.float32)
    gh, gw = _grads(Head(student_hidden, student_weight), Head(teacher_hidden, teacher_weight), target, loss_rows,
                    scale, options, options.need if fused else (False, False))
    finish_target_check(pending, target, v, ignore_index)
    if reduction == "mean" and count is None and target is not None:
        count = count_rows(target, ignore_index)
    return reduced(loss_rows, reduction, count), gh, gw


def _distill_backward_launcher(grad: torch.Tensor, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                               teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                               target: Optional[torch.Tensor], options: DistillOptions) -> Grads:
    """Backward of ``reduction="none"`` (``grad [M]``): recompute both models' chunks."""
    loss_rows = torch.empty(student_hidden.shape[0], dtype=torch.float32, device=student_hidden.device)
    return _grads(Head(student_hidden, student_weight), Head(teacher_hidden, teacher_weight), target, loss_rows,
                  grad.to(torch.float32), options, options.need)


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::linear_distill_fwd /
# _bwd), the gradients formed in the forward unless the reduction is "none" (base/head.py).
# --------------------------------------------------------------------------------------------
def _distill_fake(student_hidden, student_weight, teacher_hidden, teacher_weight, target, options: DistillOptions):
    fused = options.reduction != "none"
    loss = student_hidden.new_empty(() if fused else (student_hidden.shape[0],), dtype=torch.float32)
    return loss, *grads_fake((student_hidden, student_weight), [fused and n for n in options.need])


def _distill_backward_fake(grad, student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                           options: DistillOptions):
    return grads_fake((student_hidden, student_weight), options.need)


DISTILL, DISTILL_FUSED = head_loss_ops(
    "linear_distill", kept_for_none=lambda tensors, outputs: tensors,
    once="linear_distill_loss formed its gradients in the forward and scales them in place: backward can run "
         "through it only once (retain_graph is not supported)",
    forward=_distill_forward, grad_inputs=(0, 1), returns=1, fake=_distill_fake,
    backward_launcher=_distill_backward_launcher, backward_fake=_distill_backward_fake)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def linear_distill_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                        teacher_weight: torch.Tensor, target: Optional[torch.Tensor] = None, *, kind: str = "jsd",
                        beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                        reduction: str = "mean", chunk_size: Optional[int] = None, memory: str = DEFAULT_MEMORY,
                        accum_dtype: Optional[torch.dtype] = torch.float32, check_targets: bool = True):
    """Distillation loss between a student's and a teacher's LM-head distributions, without
    either ``[M, V]`` logits (see the module docstring for the losses and their gradients).

    Args:
        student_hidden: ``[M, Hs]`` float32/bfloat16/float16 (float64 runs the reference).
        student_weight: ``[V, Hs]`` of student_hidden's dtype.
        teacher_hidden: ``[M, Ht]`` (Ht may differ from Hs; any float dtype), teacher_weight:
            ``[V, Ht]`` of teacher_hidden's dtype: the same V. They get no gradient.
        target: optional ``[M]`` int64/int32: rows equal to ``ignore_index`` contribute 0 (and
            ``mean`` does not count them); other values are not used beyond ``check_targets``.
        kind: ``"jsd"`` (generalised, ``beta`` in (0, 1) weighs the teacher in the mixture M, as
            in Liger's FusedLinearJSD), ``"forward_kl"`` KL(teacher || student) or
            ``"reverse_kl"`` KL(student || teacher).
        temperature: both models' logits are divided by it (the loss is not rescaled by T^2).
        reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"`` (``[M]``).
        chunk_size: rows per chunk (default: ``chunk_bytes`` of logits per model, or
            ``low_memory_chunk_bytes`` with ``memory="low"``: ``configs/linear_losses.py``).
        memory: ``"fast"`` (default): the weight gradient summed over the row chunks in an
            ``accum_dtype`` ``[V, Hs]`` buffer; ``"low"``: over vocabulary chunks, each one
            matmul summed in fp32 by cuBLAS (no accumulator; 2 more matmuls; module docstring).
            The linear losses share the default ``"fast"``: the faster path, and the one an LM's
            training step takes; ``"low"`` is the choice of a run bound by memory.
        accum_dtype: ``memory="fast"``'s weight-gradient sum: float32 (default) or None (the
            weight's dtype: half the memory, one rounding per chunk).
        check_targets: raise ValueError for a target outside ``[0, V)`` that is not
            ``ignore_index``, as the other losses do (a small kernel, one host wait); with False
            such a row counts as any other.

    Returns:
        The loss in float32 (0-d, or ``[M]`` for ``"none"``), differentiable in student_hidden
        and student_weight. With ``"mean"``/``"sum"`` the gradients are formed during the
        forward and the backward can run only once.
    """
    student_weight, teacher_weight = gathered(student_weight, student_hidden), gathered(teacher_weight, teacher_hidden)
    check_head("student_hidden", student_hidden, "student_weight", student_weight)
    check_head("teacher_hidden", teacher_hidden, "teacher_weight", teacher_weight, like=student_hidden,
               like_name="student_hidden")
    m, v = student_hidden.shape[0], student_weight.shape[0]
    if teacher_hidden.shape[0] != m:
        raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} rows but student_hidden has {m}: "
                         "one row per token in both")
    if teacher_weight.shape[0] != v:
        raise ValueError(f"teacher_weight has a vocabulary of {teacher_weight.shape[0]} but student_weight of {v}: "
                         "the two models must share the vocabulary")
    if target is not None:
        check_target(target, m, student_hidden, "student_hidden")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "jsd" and (isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0):
        raise ValueError(f"beta must be a number in (0, 1) for kind='jsd' (0 and 1 make it 0: use 'forward_kl' or "
                         f"'reverse_kl'), got {beta!r}")
    temperature = check_temperature(temperature)
    check_ignore_index(ignore_index)
    check_reduction(reduction)
    check_chunking(chunk_size, accum_dtype, memory)
    beta = float(beta)
    if not use_kernels(student_hidden) or torch.float64 in (student_hidden.dtype, teacher_hidden.dtype):
        compute = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
        return reference.linear_distill_loss(student_hidden, student_weight, teacher_hidden.detach(),
                                             teacher_weight.detach(), target, kind=kind, beta=beta,
                                             temperature=temperature, ignore_index=ignore_index, reduction=reduction,
                                             check_targets=check_targets, compute_dtype=compute)
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    options = DistillOptions(kind, beta, temperature, ignore_index, reduction, check_targets, chunk_size, accum_dtype,
                             grads_needed(student_hidden, student_weight), memory)
    op = DISTILL if reduction == "none" else DISTILL_FUSED
    return op(student_hidden, student_weight, teacher_hidden, teacher_weight, target, options)
