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
exact), then the weight gradient goes over vocabulary chunks (``vocab_chunks``): the logits
``[M, Cv] = hidden @ weight[v].T`` are recomputed, the gradient written over them from the
saved ``lse``, and ``grad_weight[v] = d logits.T @ hidden`` is one matmul over all rows, summed
in fp32 inside cuBLAS and rounded once. Matmuls: 4 for ``"mean"``/``"sum"`` (3 by default), 5
for ``"none"`` (4); memory beyond the gradients: one block of ``LOW_MEMORY_CHUNK_BYTES``.

Chunk size: ``ROWS_PER_CHUNK`` rows by default (each chunk's weight-gradient matmul then does
~500 flops per byte of the ``[V, H]`` fp32 accumulator it reads and writes, so it stays
compute-bound on H100-class GPUs), fewer if a chunk's logits would take over a quarter of the
free device memory, then evened out so the last chunk is not a sliver.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import reference
from ..parallel.sharded import gathered
from ._launch import use_kernels
from ._register import Op
from .cross_entropy import (ce_rows, check_loss_options, check_target, count_rows, finish_loss, finish_target_check,
                            package_output, row_buffers, scale_rows_, start_target_check)
from . import vocab_chunks
from .vocab_chunks import accumulate_mm, aligned_cols, check_head, grads_by_vocab_chunks

ROWS_PER_CHUNK = 2048
LOW_MEMORY_CHUNK_BYTES = 64 * 2**20  # memory="low": logits of a chunk (its rows, or its vocabulary columns)
MEMORY_MODES = ("fast", "low")


def chunk_rows(m: int, v: int, element_size: int, device: torch.device, chunk_size: Optional[int],
               memory: str = "fast") -> int:
    """Rows per chunk (see the module docstring): ``ROWS_PER_CHUNK`` rows, or (``memory="low"``)
    ``LOW_MEMORY_CHUNK_BYTES`` of logits; ``chunk_size`` overrides."""
    chunk_bytes = ROWS_PER_CHUNK * v * element_size if memory == "fast" else LOW_MEMORY_CHUNK_BYTES
    return vocab_chunks.chunk_rows(m, v, element_size, device, chunk_size, chunk_bytes)


def _chunked(hidden, weight, target, bias, lse, *, chunk: int, grads: tuple, g=None, count=None,
             loss_rows=None, z_rows=None, ignore_index: int, smoothing: float, z_coef: float,
             softcap: Optional[float]) -> None:
    """The chunk loop. With ``loss_rows``: the forward, writing ``loss_rows`` (``z_rows``) and
    ``lse``; without: the backward, using ``lse``. ``grads = (grad_hidden, grad_weight_acc, grad_bias_acc)``, each optional: filled
    with the gradient for upstream gradient ``g`` (None: 1) and ``1 / count`` (``mean``)."""
    grad_hidden, grad_weight, grad_bias = grads
    want_grad = any(t is not None for t in grads)
    m = hidden.shape[0]
    # One [chunk, V] buffer for every chunk: a fresh product per chunk would be allocated while
    # the previous chunk's is still referenced, two chunks' logits at the peak.
    buffer = hidden.new_empty((min(chunk, m), weight.shape[0]))
    weight_t = weight.t()
    rows = lambda t: t if t is None or whole else t[a:b]  # noqa: E731  (one chunk: no slicing)
    for a in range(0, m, chunk):
        b = min(m, a + chunk)
        whole = b - a == m
        h = rows(hidden)
        logits = buffer if whole else buffer[: b - a]
        if bias is None:
            torch.mm(h, weight_t, out=logits)
        else:
            torch.addmm(bias, h, weight_t, out=logits)
        ce_rows(logits, rows(target), rows(lse), loss=rows(loss_rows), z_loss=rows(z_rows),
                dlogits=logits if want_grad else None,
                grad_output=None if g is None else (g if g.dim() == 0 else rows(g)),
                count=count, ignore_index=ignore_index, smoothing=smoothing, z_coef=z_coef, softcap=softcap)
        if grad_hidden is not None:
            torch.mm(logits, weight, out=rows(grad_hidden))
        if grad_weight is not None:
            accumulate_mm(grad_weight, logits.t(), h)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=grad_bias.dtype)


def _grad_buffers(hidden, weight, bias, need: tuple, accum_dtype, memory: str):
    """(grad_hidden, grad_weight accumulator, grad_bias accumulator) of the row chunks: with
    ``memory="low"`` only the first (the vocabulary chunks give the others)."""
    need_h, need_w, need_b = need
    if memory == "low":
        need_w = need_b = False
    acc = accum_dtype or weight.dtype
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None,
            torch.zeros_like(weight, dtype=acc, memory_format=torch.contiguous_format) if need_w else None,
            torch.zeros_like(bias, dtype=accum_dtype or bias.dtype, memory_format=torch.contiguous_format)
            if need_b else None)


def _weight_grads_by_vocab(hidden, weight, target, bias, lse, scale, *, need: tuple, chunk: int,
                           ignore_index: int, smoothing: float, z_coef: float, softcap: Optional[float]):
    """``memory="low"``: (grad_weight, grad_bias) over vocabulary chunks of ``chunk * V / M``
    columns (a row chunk's worth of logits, aligned), for the per-row upstream ``scale`` (0-d or
    ``[M]`` fp32); the gradient is ``s (p (1 + 2 z_loss lse) - eps / V - (1 - eps) onehot)``."""
    m, v = hidden.shape[0], weight.shape[0]
    s = scale.to(torch.float32).expand(m)
    coefs = torch.stack((s * (1.0 + 2.0 * z_coef * lse), s, s * (smoothing / v), s * (1.0 - smoothing)))
    _, gw, gb = grads_by_vocab_chunks(hidden, weight, bias, target, lse, coefs, None, need=(False, *need[1:]),
                                      ignore_index=ignore_index, softcap=softcap, has_c=smoothing > 0,
                                      cols=aligned_cols(max(1, chunk * v // max(m, 1)), v))
    return gw, gb


def _lce_forward(hidden, weight, target, bias, ignore_index: int, reduction: str, smoothing: float, z_coef: float,
                 softcap: Optional[float], want_z: bool, check: bool, chunk_size: Optional[int],
                 accum_dtype: Optional[torch.dtype], need: tuple, memory: str = "fast"):
    """Returns (loss, z part or None, lse [M] fp32, grad_hidden, grad_weight, grad_bias), the
    gradients (each None unless ``need``-ed, and only for reductions other than ``"none"``) for
    an upstream gradient of 1, in the parameters' dtypes."""
    m, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    pending = start_target_check(target, v, ignore_index) if check else None
    lse, loss_rows, z_rows = row_buffers(m, want_z, z_coef, dev)
    fused = reduction != "none" and any(need)
    count = count_rows(target, ignore_index) if fused and reduction == "mean" else None
    grads = _grad_buffers(hidden, weight, bias, need, accum_dtype, memory) if fused else (None, None, None)
    chunk = chunk_rows(m, v, hidden.element_size(), dev, chunk_size, memory)
    _chunked(hidden, weight, target, bias, lse, chunk=chunk, grads=grads, count=count,
             loss_rows=loss_rows, z_rows=z_rows, ignore_index=ignore_index, smoothing=smoothing,
             z_coef=z_coef, softcap=softcap)
    loss, z, _ = finish_loss(loss_rows, z_rows, target, ignore_index=ignore_index, reduction=reduction,
                             want_z=want_z, dtype=torch.float32, count=count)
    finish_target_check(pending, target, v, ignore_index)
    if fused and memory == "low":
        scale = torch.ones((), device=dev) if count is None else 1.0 / count.to(torch.float32)
        grads = (grads[0], *_weight_grads_by_vocab(hidden, weight, target, bias, lse, scale, need=need, chunk=chunk,
                                                   ignore_index=ignore_index, smoothing=smoothing, z_coef=z_coef,
                                                   softcap=softcap))
    return (loss, z, lse, *_in_dtypes(grads, weight, bias))


def _lce_backward_launcher(grad, hidden, weight, target, bias, lse, ignore_index: int, smoothing: float,
                           z_coef: float, softcap: Optional[float], chunk_size: Optional[int],
                           accum_dtype: Optional[torch.dtype], need: tuple, memory: str):
    """Backward of ``reduction="none"`` (``grad [M]``): recompute each chunk's logits (and with
    ``memory="low"`` the vocabulary chunks' for the weight and bias gradients)."""
    grads = _grad_buffers(hidden, weight, bias, need, accum_dtype, memory)
    chunk = chunk_rows(hidden.shape[0], weight.shape[0], hidden.element_size(), hidden.device, chunk_size, memory)
    if need[0] or memory == "fast":
        _chunked(hidden, weight, target, bias, lse, chunk=chunk, grads=grads, g=grad,
                 ignore_index=ignore_index, smoothing=smoothing, z_coef=z_coef, softcap=softcap)
    if memory == "low":
        grads = (grads[0], *_weight_grads_by_vocab(hidden, weight, target, bias, lse, grad, need=need, chunk=chunk,
                                                   ignore_index=ignore_index, smoothing=smoothing, z_coef=z_coef,
                                                   softcap=softcap))
    return _in_dtypes(grads, weight, bias)


def _in_dtypes(grads: tuple, weight, bias) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` with the accumulated ones in their parameter's dtype."""
    gh, gw, gb = grads
    return gh, (None if gw is None else gw.to(weight.dtype)), (None if gb is None else gb.to(bias.dtype))


def _scaled(t: Optional[torch.Tensor], grad: torch.Tensor) -> Optional[torch.Tensor]:
    """``t *= grad`` (a 0-d upstream gradient) in place, skipped when it is 1. ``t``: ``[R, N]``
    or ``[N]``."""
    if t is not None:
        scale_rows_(t if t.dim() == 2 else t.view(1, -1), grad)
    return t


def grads_fake(params: tuple, need) -> tuple:
    """Fake gradients of ``params`` (None where not ``need``-ed), for the fake kernels."""
    return tuple(t.new_empty(t.shape) if n else None for t, n in zip(params, need))


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::linear_cross_entropy_fwd
# / _bwd). With "mean" and "sum" the gradients are formed in the forward: the eager variant
# scales them in place in the backward (once), the custom op's backward multiplies them.
# --------------------------------------------------------------------------------------------
def head_loss_ops(name: str, *, kept_for_none: Callable, reduction_at: int, need_at: int, grads_from: int,
                  once: str, **description) -> tuple[Op, Op]:
    """``(op, fused)``: the two Ops of a loss over an LM head whose forward forms the gradients
    (for an upstream gradient of 1) unless the reduction is ``"none"``, as this module's.

    ``op`` (eager for ``"none"``, and torch.compile for every reduction) saves, for ``"none"``,
    ``kept_for_none(inputs, outputs) -> (tensors, options)`` and calls the backward launcher
    with ``(grad, *tensors, *options)``; otherwise it saves the gradients (the outputs from
    ``grads_from`` on) and multiplies them by the upstream gradient. ``fused``, eager-only for
    ``"mean"``/``"sum"``, scales them in place instead (so its backward runs ``once``).
    ``inputs[reduction_at]`` is the reduction and ``inputs[need_at]`` which of the inputs at
    ``grad_inputs`` want a gradient; ``description``: the rest of :class:`Op`'s arguments."""
    def setup(ctx, inputs, outputs):
        ctx.reduction, ctx.need = inputs[reduction_at], inputs[need_at]
        if ctx.reduction == "none":
            tensors, ctx.options = kept_for_none(inputs, outputs)
            ctx.save_for_backward(*tensors)
        else:
            ctx.save_for_backward(*outputs[grads_from:])

    def backward(ctx, bwd, grad, *_):
        if ctx.reduction == "none":
            grads = bwd(grad, *ctx.saved_tensors, *ctx.options)
        else:
            grads = tuple(t * grad for t in ctx.saved_tensors)
        return tuple(t if n else None for t, n in zip(grads, ctx.need))

    def fused_setup(ctx, inputs, outputs):
        ctx.save_for_backward(*outputs[grads_from:])

    def fused_backward(ctx, _, grad, *__):
        return tuple(_scaled(t, grad) for t in ctx.saved_tensors)

    op = Op(name, setup=setup, backward=backward, **description)
    fused = Op(name + "_fused", forward=description["forward"], setup=fused_setup, backward=fused_backward,
               grad_inputs=description["grad_inputs"], returns=description.get("returns"),
               non_differentiable=description.get("non_differentiable", ()), base=op, once=once)
    return op, fused


def _lce_fake(hidden, weight, target, bias, ignore_index, reduction, smoothing, z_coef, softcap, want_z, check,
              chunk_size, accum_dtype, need, memory="fast"):
    m = hidden.shape[0]
    loss = hidden.new_empty((m,) if reduction == "none" else (), dtype=torch.float32)
    fused = reduction != "none"
    return (loss, loss.new_empty(loss.shape) if want_z else None, hidden.new_empty(m, dtype=torch.float32),
            *grads_fake((hidden, weight, bias), [fused and n for n in need]))


def _lce_kept_for_none(inputs, outputs):
    (hidden, weight, target, bias, ignore_index, reduction, smoothing, z_coef, softcap, want_z, check, chunk_size,
     accum_dtype, need, memory) = inputs
    return ((hidden, weight, target, bias, outputs[2]),
            (ignore_index, smoothing, z_coef, softcap, chunk_size, accum_dtype, need, memory))


LCE, LCE_FUSED = head_loss_ops(
    "linear_cross_entropy", kept_for_none=_lce_kept_for_none, reduction_at=5, need_at=13, grads_from=3,
    once="linear_cross_entropy formed its gradients in the forward and scales them in place: backward can run "
         "through it only once (retain_graph is not supported)",
    forward=_lce_forward, grad_inputs=(0, 1, 3), returns=3, non_differentiable=(1, 2), fake=_lce_fake,
    schema="(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, SymInt ignore_index, str reduction, "
           "float smoothing, float z_coef, float? softcap, bool want_z, bool check, SymInt? chunk_size, "
           "ScalarType? accum_dtype, bool[] need, str memory=\"fast\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
           "Tensor)",
    backward_launcher=_lce_backward_launcher,
    backward_fake=lambda grad, hidden, weight, target, bias, lse, *options: grads_fake((hidden, weight, bias),
                                                                                       options[6]),
    backward_schema="(Tensor grad, Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor lse, "
                    "SymInt ignore_index, float smoothing, float z_coef, float? softcap, SymInt? chunk_size, "
                    "ScalarType? accum_dtype, bool[] need, str memory) -> (Tensor, Tensor, Tensor)")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                         return_z_loss: bool = False, return_lse: bool = False, check_targets: bool = True,
                         chunk_size: Optional[int] = None, accum_dtype: Optional[torch.dtype] = torch.float32,
                         memory: str = "fast"):
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
            ``LOW_MEMORY_CHUNK_BYTES`` (``chunk_size`` rows, or ``chunk_size * V / M`` columns).

    Returns:
        ``loss`` in float32 (0-d, or ``[M]`` for ``"none"``; as Hugging Face computes its LM
        loss in float32: a bf16 loss near 12 would be rounded to steps of 0.06), or a
        :class:`llmkernels.CrossEntropyOutput`. Differentiable in hidden, weight and bias.

    With ``"mean"``/``"sum"`` and gradients needed, they are computed during the forward and
    the backward can run only once through this call.
    """
    weight, bias = gathered(weight, hidden), gathered(bias, hidden)
    check_head("hidden", hidden, "weight", weight, "bias", bias)
    check_target(target, hidden.shape[0], hidden, "hidden")
    check_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"accum_dtype must be torch.float32 or None, got {accum_dtype!r}")
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
    smoothing, z_coef = float(label_smoothing), float(z_loss)
    softcap = None if softcap is None else float(softcap)
    if not use_kernels(hidden) or hidden.dtype == torch.float64:
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        loss, z, lse = reference.linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing,
            z_loss=z_coef, softcap=softcap, check_targets=check_targets, compute_dtype=compute)
        return package_output(loss, z, lse, return_z_loss, return_lse)
    grad_on = torch.is_grad_enabled()
    need = [grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad]
    op = LCE if reduction == "none" else LCE_FUSED
    loss, z, lse = op(hidden, weight, target, bias, ignore_index, reduction, smoothing, z_coef, softcap, return_z_loss,
                      check_targets, chunk_size, accum_dtype, need, memory)
    return package_output(loss, z, lse, return_z_loss, return_lse)
