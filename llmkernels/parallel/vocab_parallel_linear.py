"""Vocabulary-parallel fused linear cross-entropy: the head's rows sharded over the vocabulary.

Rank k holds ``weight [V_k, H]`` (``bias [V_k]``), the rows ``[v0_k, v0_k + V_k)`` of the head
(``ColwiseParallel``'s shard); every rank holds the same ``hidden [M, H]`` and targets. With
``reduction`` ``"mean"`` or ``"sum"`` the rows go in chunks of ``C`` (``linear_cross_entropy``'s
scheme), so that only ``[C, V_k]`` logits ever exist on a rank::

    logits = hidden_chunk @ weight.T (+ bias)            cuBLAS
    statistics of the chunk's rows, one all-gather       vocab_parallel.shard_stats / combine
    the gradient written over the logits                 vocab_parallel.shard_grad
    grad_hidden_chunk = d logits @ weight                a partial sum: all-reduced once at the end
    grad_weight += d logits.T @ hidden_chunk             fp32 accumulator

all in the forward, for an upstream gradient of 1 (the backward multiplies). With ``"none"`` the
upstream gradient differs per row, so the ``[M, V_k]`` logits are formed at once and the
vocabulary-parallel cross-entropy runs on them (gradient in place), autograd doing the matmuls.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.configs.linear_losses import DEFAULT_CONFIG
from ..ops.losses.base import (Head, accumulate_mm, check_chunk_size, check_head, check_target, chunk_rows,
                               finish_target_check, is_dtensor, row_chunks, start_target_check)
from .vocab_parallel import (Options, VocabShard, check_no_layout, combine, dtensor_shard, group_size, loss_options,
                             plain_shard, replicated_local, row_losses, row_scales, shard_grad, shard_stats,
                             sharded_loss)

def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist
    dist.all_reduce(t, group=group)
    return t


class _SumGradOverGroup(torch.autograd.Function):
    """Identity; the backward sums the gradient over the group: each rank's copy of the input
    feeds only that rank's shard of the logits (Megatron's copy to the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


class _ChunkedLinearCE(torch.autograd.Function):
    """``"mean"`` / ``"sum"`` over row chunks, the gradients formed in the forward (module notes)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, shard: VocabShard, opts: Options, chunk: int, sum_hidden: bool):
        m = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        pending = start_target_check(target, shard.size, opts.ignore_index) if opts.check else None
        count = (target != opts.ignore_index).sum()
        loss_rows = torch.empty(m, dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        for rows, logits in row_chunks(chunk, Head(hidden, weight, bias)):
            t = rows(target)
            lse, z_t, z_sum = combine(shard_stats(logits, t, shard, opts), shard.group)
            losses, valid, in_range = row_losses(lse, z_t, z_sum, t, shard.size, opts)
            rows(loss_rows).copy_(losses)
            if need_h or need_w or need_b:
                shard_grad(logits, t, lse, row_scales(one, valid, in_range, count, opts, lse.dtype), shard, opts,
                           out=logits)
            if need_h:
                torch.mm(logits, weight, out=rows(dh))
            if need_w:
                accumulate_mm(dw, logits.t(), rows(hidden))
            if need_b:
                db += logits.sum(0, dtype=torch.float32)
        finish_target_check(pending, target, shard.size, opts.ignore_index)
        if need_h and sum_hidden and group_size(shard.group) > 1:
            _all_reduce(dh, shard.group)
        ctx.save_for_backward(dh, None if dw is None else dw.to(weight.dtype),
                              None if db is None else db.to(bias.dtype))
        return loss_rows.sum() / count if opts.reduction == "mean" else loss_rows.sum()

    @staticmethod
    def backward(ctx, grad):
        return (*(None if t is None else t * grad for t in ctx.saved_tensors), None, None, None, None, None)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        bias: Optional[torch.Tensor] = None, *, group=None,
                                        vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                                        ignore_index: int = -100, reduction: str = "mean",
                                        label_smoothing: float = 0.0, z_loss: float = 0.0,
                                        check_targets: bool = True, chunk_size: Optional[int] = None):
    """``vocab_parallel_cross_entropy(hidden @ weight.T + bias, ...)`` with the head's rows sharded
    over the vocabulary across ``group``: each rank multiplies by its own rows ``weight [V_k, H]``
    (``bias [V_k]``); equal to ``llmkernels.linear_cross_entropy`` with the whole head.

    ``hidden [M, H]`` and ``target [M]`` are the same on every rank; hidden's gradient is summed
    over the group (one all-reduce of ``[M, H]``), so that every rank gets the whole one.
    ``weight`` (and ``bias``) may be DTensors sharded along dim 0 (``ColwiseParallel``'s), the mesh
    then giving the group and the rows, and ``hidden`` a replicated DTensor (its gradient then left
    to DTensor to reduce). ``chunk_size``: rows per chunk (default 2048, fewer where memory is
    short; ``"mean"`` / ``"sum"`` only: ``"none"`` forms the ``[M, V_k]`` logits, module notes).
    Other arguments: as in :func:`vocab_parallel_cross_entropy`. Returns the loss in float32,
    equal on every rank. With ``"mean"``/``"sum"`` the gradients are formed during the forward.
    """
    shard = (group, vocab_start, vocab_size)
    if is_dtensor(weight):
        check_no_layout("weight", group, vocab_start, vocab_size)
        shard = dtensor_shard(weight, "weight", 0)
        weight = weight.to_local()
        if bias is not None:
            dtensor_shard(bias, "bias", 0)
            bias = bias.to_local()
    sum_hidden = not is_dtensor(hidden)
    if not sum_hidden:  # DTensor reduces the partial gradients of its replicated input
        from torch.distributed.tensor import Partial
        hidden = replicated_local(hidden, "hidden", grad_placements=[Partial()] * hidden.device_mesh.ndim)
    check_head("hidden", hidden, "weight", weight, "bias", bias)
    opts = loss_options(ignore_index, reduction, label_smoothing, z_loss, check_targets)
    check_chunk_size("chunk_size", chunk_size)
    check_target(target, hidden.shape[0], hidden, "hidden")
    if not isinstance(shard, VocabShard):
        shard = plain_shard(weight.shape[0], *shard)
    if reduction == "none":
        if sum_hidden and group_size(shard.group) > 1:
            hidden = _SumGradOverGroup.apply(hidden, shard.group)
        logits = torch.nn.functional.linear(hidden, weight, bias)
        return sharded_loss(logits, target, shard, opts, True, loss_dtype=torch.float32)
    m, v_k, size = hidden.shape[0], weight.shape[0], hidden.element_size()
    # (rows a chunk as linear_cross_entropy's: each chunk's weight-gradient matmul stays compute-bound)
    chunk = chunk_rows(m, v_k, size, hidden.device, chunk_size, DEFAULT_CONFIG.rows_per_chunk * v_k * size)
    return _ChunkedLinearCE.apply(hidden, weight, bias, target, shard, opts, chunk, sum_hidden)
