"""Cross-entropy over a vocabulary: one pass over the logits with an online logsumexp.

``logits [M, V]`` (rows may be strided, unit stride along V), ``target [M]``: the row maths and
the kernels are the base's (``base/row_kernels.py``); ``mean`` divides by the rows whose target is
not ``ignore_index``, as ``F.cross_entropy`` does. With ``inplace_backward`` the gradient is
formed in the forward and written over the logits (read once), and the backward only multiplies
it by the upstream gradient in place, skipping that when it is exactly 1 (``loss.backward()``);
otherwise the backward re-reads the logits with the forward's fp32 ``lse``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import reference
from .._args import check_tensor
from .._launch import reference_dtype
from .._register import Op
from ..configs.cross_entropy import CrossEntropyConfig
from .base import (RowLoss, ce_rows, check_loss_options, check_target, count_rows, finish_loss, finish_target_check,
                   package_output, row_buffers, scale_rows_, start_target_check)


class CrossEntropyOptions(NamedTuple):
    """The options of a ``cross_entropy`` call, named once: the custom ops' schemas and the
    autograd context are made of these fields."""

    row: RowLoss
    reduction: str
    want_z: bool  # return_z_loss
    check: bool  # check_targets


Outputs = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]


def _ce_forward(logits: torch.Tensor, target: torch.Tensor, options: CrossEntropyOptions, *,
                config: Optional[CrossEntropyConfig] = None, dlogits: Optional[torch.Tensor] = None) -> Outputs:
    """Forward of ``cross_entropy``. With ``dlogits`` (``logits`` itself, or a ``[M, V]``
    buffer), also writes the gradient of the reduced loss for an upstream gradient of 1.
    Returns (loss, z-loss part or None, lse [M] fp32, count (0-d int64, ``mean`` only) or None)."""
    m, v = logits.shape
    ignore_index, reduction = options.row.ignore_index, options.reduction
    pending = start_target_check(target, v, ignore_index) if options.check else None
    lse, loss_rows, z_rows = row_buffers(m, options.want_z, options.row.z_coef, logits.device)
    # A gradient formed in this pass needs 1 / count before the rows are summed.
    count = count_rows(target, ignore_index) if dlogits is not None and reduction == "mean" else None
    ce_rows(logits, target, lse, options.row, loss=loss_rows, z_loss=z_rows, dlogits=dlogits, count=count,
            config=config)
    loss, z, count = finish_loss(loss_rows, z_rows, target, ignore_index=ignore_index, reduction=reduction,
                                 want_z=options.want_z, dtype=logits.dtype, count=count)
    finish_target_check(pending, target, v, ignore_index)
    return loss, z, lse, count


def _ce_forward_inplace(logits, target, options: CrossEntropyOptions, *, config: Optional[CrossEntropyConfig] = None):
    """The forward that writes the gradient over the logits (``inplace_backward``)."""
    return _ce_forward(logits, target, options, config=config, dlogits=logits)


def _ce_backward_launcher(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                          count: Optional[torch.Tensor], options: CrossEntropyOptions, *,
                          config: Optional[CrossEntropyConfig] = None) -> torch.Tensor:
    """The separate backward: re-reads the logits, with the forward's ``lse``."""
    dx = torch.empty_like(logits, memory_format=torch.contiguous_format)
    ce_rows(logits, target, lse, options.row, dlogits=dx, grad_output=grad, count=count, config=config)
    return dx


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::cross_entropy_fwd /
# cross_entropy_bwd); the in-place gradient is an eager-only variant (torch.compile plans the
# logits' memory itself).
# --------------------------------------------------------------------------------------------
def _ce_fake(logits, target, options: CrossEntropyOptions):
    m = logits.shape[0]
    loss = logits.new_empty((m,) if options.reduction == "none" else ())
    count = target.new_empty((), dtype=torch.int64) if options.reduction == "mean" else None
    return (loss, (loss.new_empty(loss.shape) if options.want_z else None), logits.new_empty(m, dtype=torch.float32),
            count)


def _ce_setup(ctx, inputs, options: CrossEntropyOptions, outputs, *, config: Optional[CrossEntropyConfig] = None):
    _, _, lse, count = outputs
    ctx.save_for_backward(*inputs, lse, count if options.reduction == "mean" else None)
    ctx.options, ctx.config = options, config


def _ce_backward(ctx, bwd, grad, *_):
    return (bwd(grad, *ctx.saved_tensors, ctx.options, config=ctx.config),)


CE = Op("cross_entropy", forward=_ce_forward, setup=_ce_setup, backward=_ce_backward, grad_inputs=(0,), returns=3,
        non_differentiable=(1, 2), fake=_ce_fake, backward_launcher=_ce_backward_launcher,
        backward_fake=lambda grad, logits, *_: logits.new_empty(logits.shape))


def _ce_inplace_setup(ctx, inputs, options: CrossEntropyOptions, outputs, *,
                      config: Optional[CrossEntropyConfig] = None):
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
    compute = reference_dtype(logits)
    if compute is not None:
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
    options = CrossEntropyOptions(RowLoss(ignore_index, smoothing, z_coef, softcap), reduction, return_z_loss,
                                  check_targets)
    loss, z, lse = op(logits, target, options, config=config)
    return package_output(loss, z, lse, return_z_loss, return_lse)
