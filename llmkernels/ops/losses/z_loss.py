"""Fused LM-head z-loss, the worked example of a row loss on the base (ARCHITECTURE.md, "Add a loss")."""
from typing import NamedTuple, Optional

import torch

from ... import reference
from .._launch import reference_dtype
from .base import (Head, check_chunk_sizes, check_reduction, checked_head, logsumexp_rows, reduced, reduced_fake,
                   row_grads, vocab_grads, vocab_loss_op)


class ZLossOptions(NamedTuple):
    reduction: str
    chunk_size: Optional[int]  # rows of logits per forward chunk
    vocab_chunk_size: Optional[int]  # vocabulary columns per backward chunk


def _forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             options: ZLossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    lse = logsumexp_rows(Head(hidden, weight, bias), options.chunk_size)
    return reduced(lse.square(), options.reduction), lse  # the caller gets the loss; the backward reads lse


def _backward(ctx, bwd, grad, *_):  # d lse**2 / dz = 2 lse p: the coefficient a of base.vocab_grads
    *head, lse = ctx.saved_tensors  # (the default setup saves the tensors, then the outputs not returned)
    a = 2.0 * lse * row_grads(grad, ctx.options.reduction, lse.shape[0])
    return vocab_grads(Head(*head), lse, a, need=ctx.needs_input_grad[:3], cols=ctx.options.vocab_chunk_size, run=bwd)


Z_LOSS = vocab_loss_op("linear_z_loss", forward=_forward, backward=_backward, grad_inputs=(0, 1, 2), returns=1,
                       fake=lambda h, w, b, options: (reduced_fake(h, options.reduction), reduced_fake(h, "none")))


def linear_z_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  reduction: str = "mean", chunk_size: Optional[int] = None, vocab_chunk_size: Optional[int] = None):
    """Each row's ``logsumexp(hidden @ weight.T + bias)**2``, reduced, without the ``[M, V]`` logits (PaLM adds
    1e-4 of it); float32. ``chunk_size``: rows per forward chunk, ``vocab_chunk_size``: columns per backward chunk."""
    head = checked_head(hidden, weight, bias)
    check_reduction(reduction)
    check_chunk_sizes(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    if (compute := reference_dtype(hidden)) is not None:
        return reference.linear_z_loss(*head, reduction=reduction, compute_dtype=compute)
    return Z_LOSS(*head, ZLossOptions(reduction, chunk_size, vocab_chunk_size))
