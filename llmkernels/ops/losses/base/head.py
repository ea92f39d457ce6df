"""What the losses over an LM head share around their kernels: which gradients a call needs, the
reduction of per-row losses and the upstream gradient of each row, fake gradients, and the two
Ops of a loss whose gradients are formed in the forward unless the reduction is ``"none"``.

With ``reduction`` ``"mean"`` or ``"sum"`` the upstream gradient is one number, so the forward
forms the gradients for an upstream gradient of 1 as it goes (no second pass over the logits):
the eager variant scales them in place in the backward (once), the custom op's backward
multiplies them. With ``"none"`` the upstream gradient differs per row, so the forward keeps what
its backward launcher needs to recompute the logits.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..._register import Op
from .rows import scale_rows_


def _scaled(t: Optional[torch.Tensor], grad: torch.Tensor) -> Optional[torch.Tensor]:
    """``t *= grad`` (a 0-d upstream gradient) in place, skipped when it is 1. ``t``: ``[R, N]``
    or ``[N]``."""
    if t is not None:
        scale_rows_(t if t.dim() == 2 else t.view(1, -1), grad)
    return t


def grads_needed(*params) -> tuple[bool, ...]:
    """Which of ``params`` (tensors or None) a call must form a gradient for."""
    if not torch.is_grad_enabled():
        return (False,) * len(params)
    return tuple([t is not None and t.requires_grad for t in params])


def grads_fake(params: tuple, need) -> tuple:
    """Fake gradients of ``params`` (None where not ``need``-ed), for the fake kernels."""
    return tuple(t.new_empty(t.shape) if n else None for t, n in zip(params, need))


def reduced(rows: torch.Tensor, reduction: str, count=None) -> torch.Tensor:
    """Per-row losses ``[M]`` reduced: their sum, their mean (over ``count`` rows where given, a
    number or a 0-d tensor), or themselves (``"none"``)."""
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (rows.shape[0] if count is None else count)


def reduced_fake(like: torch.Tensor, reduction: str) -> torch.Tensor:
    """The fake of ``reduced``'s fp32 loss over the rows of ``like``."""
    return like.new_empty(() if reduction != "none" else like.shape[:1], dtype=torch.float32)


def row_grads(grad: torch.Tensor, reduction: str, m: int) -> torch.Tensor:
    """The fp32 upstream gradient ``[M]`` of each row of a loss ``reduced`` over its ``m`` rows
    (``mean``: without a count), from the upstream gradient of the loss."""
    grad = grad.to(torch.float32)
    if reduction == "none":
        return grad
    return (grad / m if reduction == "mean" else grad).expand(m)


def head_loss_ops(name: str, *, kept_for_none: Callable, once: str, **description) -> tuple[Op, Op]:
    """``(op, fused)``: the two Ops of a loss over an LM head (see the module notes).

    The forward launcher returns the ``returns`` outputs the caller gets, then the gradients of
    the tensors at ``grad_inputs`` (each None unless ``options.need``-ed, and all None for
    ``options.reduction == "none"``). ``op`` (eager for ``"none"``, and torch.compile for every
    reduction) saves, for ``"none"``, ``kept_for_none(tensors, outputs)`` and calls the backward
    launcher with ``(grad, *kept, options)``; otherwise it saves the gradients and multiplies
    them by the upstream gradient. ``fused``, eager-only for ``"mean"``/``"sum"``, scales them in
    place instead (so its backward runs ``once``). ``description``: the rest of :class:`Op`'s
    arguments."""
    grads_from = description["returns"]

    def setup(ctx, tensors, options, outputs):
        ctx.options = options
        ctx.save_for_backward(*(kept_for_none(tensors, outputs) if options.reduction == "none"
                                else outputs[grads_from:]))

    def backward(ctx, bwd, grad, *_):
        options = ctx.options
        if options.reduction == "none":
            grads = bwd(grad, *ctx.saved_tensors, options)
        else:
            grads = tuple(t * grad for t in ctx.saved_tensors)
        return tuple(t if n else None for t, n in zip(grads, options.need))

    def fused_setup(ctx, tensors, options, outputs):
        ctx.save_for_backward(*outputs[grads_from:])

    def fused_backward(ctx, _, grad, *__):
        return tuple(_scaled(t, grad) for t in ctx.saved_tensors)

    op = Op(name, setup=setup, backward=backward, **description)
    fused = Op(name + "_fused", forward=description["forward"], setup=fused_setup, backward=fused_backward,
               grad_inputs=description["grad_inputs"], returns=grads_from,
               non_differentiable=description.get("non_differentiable", ()), base=op, once=once)
    return op, fused
