"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the logits.

``hidden [M, H]``, ``weight [V, H]`` (an LM head), ``target [M]``. Rows are processed in chunks
of ``C`` so that only a ``[C, V]`` block of logits ever exists. Per chunk:

    logits = hidden_chunk @ weight.T (+ bias)                 cuBLAS, in hidden's dtype
    loss rows, lse, and d logits written over the logits       the cross-entropy kernel
    grad_hidden_chunk = d logits @ weight                      cuBLAS
    grad_weight += d logits.T @ hidden_chunk                   cuBLAS, fp32 accumulator
    grad_bias += d logits summed over rows                     fp32

With ``reduction`` ``"mean"`` or ``"sum"`` the gradients are formed during the forward (for an
upstream gradient of 1; the backward multiplies them by the actual one, skipping that when it
is 1). With ``"none"`` the upstream gradient differs per row, so the forward keeps only ``lse``
and the backward recomputes each chunk's logits (one more matmul).

``memory="low"``: no ``[V, H]`` accumulator. The row chunks give the loss, lse and the hidden
gradient as above (one ``[C, V]`` block at a time, ``grad_hidden_chunk = d logits @ weight``
exact), then the weight gradient goes over vocabulary chunks (``base/chunks.py``): the logits
``[M, Cv] = hidden @ weight[v].T`` are recomputed, the gradient written over them from the
saved ``lse``, and ``grad_weight[v] = d logits.T @ hidden`` is one matmul over all rows, summed
in fp32 inside cuBLAS and rounded once. Matmuls: 4 for ``"mean"``/``"sum"`` (3 by default), 5
for ``"none"`` (4); memory beyond the gradients: one block of ``low_memory_chunk_bytes``.

Chunk size (``configs/linear_losses.py``): ``rows_per_chunk`` rows by default, fewer if a
chunk's logits would take over a quarter of the free device memory, then evened out so the last
chunk is not a sliver.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import reference
from .._launch import reference_dtype
from ..configs.linear_losses import DEFAULT_CONFIG
from .base import (DEFAULT_MEMORY, Head, RowLoss, accumulate_mm, aligned_cols, ce_rows, check_chunking,
                   check_loss_options, check_target, checked_head, chunk_rows, count_rows, finish_loss,
                   finish_target_check, grads_fake, grads_needed, head_loss_ops, package_output, row_buffers,
                   row_chunks, start_target_check, vocab_grads)


class LinearCrossEntropyOptions(NamedTuple):
    """The options of a ``linear_cross_entropy`` call, named once: the custom ops' schemas and the
    autograd context are made of these fields."""

    row: RowLoss
    reduction: str
    want_z: bool  # return_z_loss
    check: bool  # check_targets
    chunk_size: Optional[int]
    accum_dtype: Optional[torch.dtype]
    need: tuple[bool, ...]  # which of hidden, weight and bias want a gradient
    memory: str


Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def rows_per_chunk(m: int, v: int, element_size: int, device: torch.device, chunk_size: Optional[int],
                   memory: str = DEFAULT_MEMORY) -> int:
    """Rows per chunk (see the module docstring): ``rows_per_chunk`` rows, or (``memory="low"``)
    ``low_memory_chunk_bytes`` of logits; ``chunk_size`` overrides."""
    chunk_bytes = (DEFAULT_CONFIG.rows_per_chunk * v * element_size if memory == "fast"
                   else DEFAULT_CONFIG.low_memory_chunk_bytes)
    return chunk_rows(m, v, element_size, device, chunk_size, chunk_bytes)


def _chunked(hidden, weight, target, bias, lse, options: LinearCrossEntropyOptions, *, chunk: int, grads: tuple,
             g=None, count=None, loss_rows=None, z_rows=None) -> None:
    """The row chunks. With ``loss_rows``: the forward, writing ``loss_rows`` (``z_rows``) and
    ``lse``; without: the backward, using ``lse``. ``grads = (grad_hidden, grad_weight_acc,
    grad_bias_acc)``, each optional: filled with the gradient for upstream gradient ``g`` (None:
    1) and ``1 / count`` (``mean``)."""
    grad_hidden, grad_weight, grad_bias = grads
    want_grad = any(t is not None for t in grads)
    for rows, logits in row_chunks(chunk, Head(hidden, weight, bias)):
        ce_rows(logits, rows(target), rows(lse), options.row, loss=rows(loss_rows), z_loss=rows(z_rows),
                dlogits=logits if want_grad else None,
                grad_output=None if g is None else (g if g.dim() == 0 else rows(g)),
                count=count)
        if grad_hidden is not None:
            torch.mm(logits, weight, out=rows(grad_hidden))
        if grad_weight is not None:
            accumulate_mm(grad_weight, logits.t(), rows(hidden))
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=grad_bias.dtype)


def _grad_buffers(hidden, weight, bias, options: LinearCrossEntropyOptions):
    """(grad_hidden, grad_weight accumulator, grad_bias accumulator) of the row chunks: with
    ``memory="low"`` only the first (the vocabulary chunks give the others)."""
    need_h, need_w, need_b = options.need
    if options.memory == "low":
        need_w = need_b = False
    accum_dtype = options.accum_dtype
    acc = accum_dtype or weight.dtype
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None,
            torch.zeros_like(weight, dtype=acc, memory_format=torch.contiguous_format) if need_w else None,
            torch.zeros_like(bias, dtype=accum_dtype or bias.dtype, memory_format=torch.contiguous_format)
            if need_b else None)


def _weight_grads_by_vocab(hidden, weight, target, bias, lse, scale, options: LinearCrossEntropyOptions, *, chunk: int):
    """``memory="low"``: (grad_weight, grad_bias) over vocabulary chunks of ``chunk * V / M``
    columns (a row chunk's worth of logits, aligned), for the per-row upstream ``scale`` (0-d or
    ``[M]`` fp32); the gradient is ``s (p (1 + 2 z_loss lse) - eps / V - (1 - eps) onehot)``."""
    m, v = hidden.shape[0], weight.shape[0]
    row, smoothing = options.row, options.row.smoothing
    s = scale.to(torch.float32).expand(m)
    _, gw, gb = vocab_grads(Head(hidden, weight, bias), lse, s * (1.0 + 2.0 * row.z_coef * lse),
                            need=(False, *options.need[1:]), c=s * (smoothing / v) if smoothing > 0 else None,
                            d=s * (1.0 - smoothing), target=target, ignore_index=row.ignore_index,
                            softcap=row.softcap, cols=aligned_cols(max(1, chunk * v // max(m, 1)), v),
                            logits_dtype=None)
    return gw, gb


def _lce_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                 options: LinearCrossEntropyOptions) -> Outputs:
    """Returns (loss, z part or None, lse [M] fp32, grad_hidden, grad_weight, grad_bias), the
    gradients (each None unless ``need``-ed, and only for reductions other than ``"none"``) for
    an upstream gradient of 1, in the parameters' dtypes."""
    m, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    ignore_index, reduction, need, memory = options.row.ignore_index, options.reduction, options.need, options.memory
    pending = start_target_check(target, v, ignore_index) if options.check else None
    lse, loss_rows, z_rows = row_buffers(m, options.want_z, options.row.z_coef, dev)
    fused = reduction != "none" and any(need)
    count = count_rows(target, ignore_index) if fused and reduction == "mean" else None
    grads = _grad_buffers(hidden, weight, bias, options) if fused else (None, None, None)
    chunk = rows_per_chunk(m, v, hidden.element_size(), dev, options.chunk_size, memory)
    _chunked(hidden, weight, target, bias, lse, options, chunk=chunk, grads=grads, count=count, loss_rows=loss_rows,
             z_rows=z_rows)
    loss, z, _ = finish_loss(loss_rows, z_rows, target, ignore_index=ignore_index, reduction=reduction,
                             want_z=options.want_z, dtype=torch.float32, count=count)
    finish_target_check(pending, target, v, ignore_index)
    if fused and memory == "low":
        scale = torch.ones((), device=dev) if count is None else 1.0 / count.to(torch.float32)
        grads = (grads[0], *_weight_grads_by_vocab(hidden, weight, target, bias, lse, scale, options, chunk=chunk))
    return (loss, z, lse, *_in_dtypes(grads, weight, bias))


def _lce_backward_launcher(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: Optional[torch.Tensor], lse: torch.Tensor,
                           options: LinearCrossEntropyOptions) -> Grads:
    """Backward of ``reduction="none"`` (``grad [M]``): recompute each chunk's logits (and with
    ``memory="low"`` the vocabulary chunks' for the weight and bias gradients)."""
    grads = _grad_buffers(hidden, weight, bias, options)
    chunk = rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.element_size(), hidden.device, options.chunk_size,
                           options.memory)
    if options.need[0] or options.memory == "fast":
        _chunked(hidden, weight, target, bias, lse, options, chunk=chunk, grads=grads, g=grad)
    if options.memory == "low":
        grads = (grads[0], *_weight_grads_by_vocab(hidden, weight, target, bias, lse, grad, options, chunk=chunk))
    return _in_dtypes(grads, weight, bias)


def _in_dtypes(grads: tuple, weight, bias) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` with the accumulated ones in their parameter's dtype."""
    gh, gw, gb = grads
    return gh, (None if gw is None else gw.to(weight.dtype)), (None if gb is None else gb.to(bias.dtype))


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::linear_cross_entropy_fwd
# / _bwd), the gradients formed in the forward unless the reduction is "none" (base/head.py).
# --------------------------------------------------------------------------------------------
def _lce_fake(hidden, weight, target, bias, options: LinearCrossEntropyOptions):
    m = hidden.shape[0]
    loss = hidden.new_empty((m,) if options.reduction == "none" else (), dtype=torch.float32)
    fused = options.reduction != "none"
    return (loss, loss.new_empty(loss.shape) if options.want_z else None, hidden.new_empty(m, dtype=torch.float32),
            *grads_fake((hidden, weight, bias), [fused and n for n in options.need]))


LCE, LCE_FUSED = head_loss_ops(
    "linear_cross_entropy", kept_for_none=lambda tensors, outputs: (*tensors, outputs[2]),
    once="linear_cross_entropy formed its gradients in the forward and scales them in place: backward can run "
         "through it only once (retain_graph is not supported)",
    forward=_lce_forward, grad_inputs=(0, 1, 3), returns=3, non_differentiable=(1, 2), fake=_lce_fake,
    backward_launcher=_lce_backward_launcher,
    backward_fake=lambda grad, hidden, weight, target, bias, lse, options: grads_fake((hidden, weight, bias),
                                                                                      options.need))


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                         return_z_loss: bool = False, return_lse: bool = False, check_targets: bool = True,
                         chunk_size: Optional[int] = None, accum_dtype: Optional[torch.dtype] = torch.float32,
                         memory: str = DEFAULT_MEMORY):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without materializing the
    ``[M, V]`` logits: rows go through in chunks (see the module docstring).

    Args:
        hidden: ``[M, H]`` float32/bfloat16/float16 (float64 runs the reference).
        weight: ``[V, H]``, hidden's dtype (an LM head / tied embedding).
        target: ``[M]`` int64/int32 class indices, or ``ignore_index``.
        bias: ``[V]`` in weight's dtype, or None.
        ignore_index, reduction, label_smoothing, z_loss, softcap, return_z_loss, return_lse,
        check_targets: as in :func:`llmkernels.cross_entropy`.
        chunk_size: rows per chunk (default: chosen from M, V and the free device memory; a
            chunk's logits take ``chunk_size * V`` elements).
        accum_dtype: dtype in which the weight and bias gradients are summed over chunks:
            float32 (default; a ``[V, H]`` fp32 buffer during the forward) or None for the
            parameters' own dtype (half the memory, one rounding per chunk). Unused with
            ``memory="low"``.
        memory: ``"fast"`` (default) or ``"low"``: no ``[V, H]`` accumulator, the weight
            gradient over vocabulary chunks (each summed in fp32 by cuBLAS), one more matmul
            (module docstring); extra memory beyond the gradients is one chunk of
            ``low_memory_chunk_bytes`` (``chunk_size`` rows, or ``chunk_size * V / M`` columns).
            The linear losses share the default ``DEFAULT_MEMORY = "fast"``: the faster path,
            and the one an LM's training step takes; ``"low"`` is the choice of a run bound by
            memory.

    Returns:
        ``loss`` in float32 (0-d, or ``[M]`` for ``"none"``; as Hugging Face computes its LM
        loss in float32: a bf16 loss near 12 would be rounded to steps of 0.06), or a
        :class:`llmkernels.CrossEntropyOutput`. Differentiable in hidden, weight and bias.

    With ``"mean"``/``"sum"`` and gradients needed, they are computed during the forward and
    the backward can run only once through this call.
    """
    hidden, weight, bias = checked_head(hidden, weight, bias)
    check_target(target, hidden.shape[0], hidden, "hidden")
    check_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    check_chunking(chunk_size, accum_dtype, memory)
    smoothing, z_coef = float(label_smoothing), float(z_loss)
    softcap = None if softcap is None else float(softcap)
    compute = reference_dtype(hidden)
    if compute is not None:
        loss, z, lse = reference.linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing,
            z_loss=z_coef, softcap=softcap, check_targets=check_targets, compute_dtype=compute)
        return package_output(loss, z, lse, return_z_loss, return_lse)
    options = LinearCrossEntropyOptions(RowLoss(ignore_index, smoothing, z_coef, softcap), reduction, return_z_loss,
                                        check_targets, chunk_size, accum_dtype, grads_needed(hidden, weight, bias),
                                        memory)
    op = LCE if reduction == "none" else LCE_FUSED
    loss, z, lse = op(hidden, weight, target, bias, options)
    return package_output(loss, z, lse, return_z_loss, return_lse)
