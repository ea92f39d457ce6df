"""Vocabulary-parallel cross-entropy: the logits of tensor parallelism, sharded over the vocabulary.

Rank k of a group of K holds the columns ``[v0_k, v0_k + V_k)`` of the ``[M, V]`` logits (a
column-parallel head: ``ColwiseParallel`` or Megatron's); every rank holds the same ``M``
targets. No rank ever holds ``[M, V]``:

  1. one pass over the local shard (``_shard_stats_kernel``) writes three fp32 numbers a row:
     the shard's logsumexp, the target's logit if the target is in the shard (else 0), and the
     sum of the shard's logits (label smoothing);
  2. one all-gather of those ``[M, 3]`` (12 K bytes a row); every rank combines them into the
     row's ``lse = logsumexp_k lse_k``, target logit and sum, hence the same loss on every rank;
  3. the gradient ``softmax(z) (1 + 2 z_loss lse) - (1 - eps) onehot - eps / V`` of the local
     shard from the global ``lse`` (``_shard_grad_kernel``): no communication. By default in the
     backward, into a new buffer; with ``inplace_backward`` in the forward, over the logits.

Statistics are fp32 whatever the logits' dtype. Where the kernels cannot run (no Triton, a CPU
tensor without the interpreter, float64) steps 1 and 3 are plain PyTorch with the same contract.
The fused linear form (the head's rows sharded) builds on these steps: ``vocab_parallel_linear``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..ops._args import cdiv, check_tensor
from ..ops._launch import launch, use_kernels
from ..ops._triton import tl, triton
from ..ops.losses.base import (check_loss_options, check_target, finish_target_check,
                               grad_coefs, grad_tile, is_dtensor, row_lse, scale_rows_, start_target_check)

STATS_BLOCK_V = 4096  # columns per step of the statistics pass's online loop
GRAD_BLOCK_V = 2048  # columns of one program of the gradient pass
NUM_WARPS = 8


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _shard_stats_kernel(X, T, STATS, V, v0, stride_x, ignore_index, HAS_SMOOTHING: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    """One row of the shard ``X [M, V]`` per program: STATS[row] = (logsumexp of the row, the
    logit of the target if it lies in [v0, v0 + V) and is not ignore_index else 0, the row's sum
    (HAS_SMOOTHING; else 0)), by an online logsumexp (running max, rescaled sum)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    lse, _, _, z_sum = row_lse(x_row, V, 1.0, BLOCK_V, False, HAS_SMOOTHING)
    t = tl.load(T + row + tl.zeros([1], tl.int64)).to(tl.int64) - v0
    here = (t >= 0) & (t < V) & (t + v0 != ignore_index)
    z_t = tl.load(x_row + tl.where(here, t, 0), mask=here, other=0.0).to(tl.float32)
    one = tl.arange(0, 1)
    tl.store(STATS + row * 3 + one, lse)
    tl.store(STATS + row * 3 + 1 + one, z_t)
    tl.store(STATS + row * 3 + 2 + one, z_sum)


@triton.jit
def _shard_grad_kernel(X, DX, T, LSE, SCALE, V, v0, vocab, stride_x, stride_dx, ignore_index, smoothing, z_coef,
                       HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row, block): DX = the gradient of the row's loss with respect to BLOCK_V columns
    of the shard (``vocab`` columns in all), times the row's SCALE (the upstream gradient,
    1 / count for ``mean``; NaN for an out-of-range target): the cross-entropy kernels' own
    ``grad_tile``. Rows whose target is ignore_index get 0. DX may be X (each program reads its
    block, then writes it)."""
    row = tl.program_id(0).to(tl.int64) + tl.zeros([1], tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = (cols < V)[None, :]
    x = tl.load(X + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row)
    t = tl.load(T + row).to(tl.int64)
    p_coef, off, hot = grad_coefs(tl.load(SCALE + row), lse, vocab, smoothing, z_coef, HAS_SMOOTHING, HAS_Z)
    g = grad_tile(x, cols, t - v0, lse, p_coef, off, hot, t != ignore_index, 0.0, False)
    tl.store(DX + row[:, None] * stride_dx + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# the two passes over the shard: kernels, or plain PyTorch
# --------------------------------------------------------------------------------------------
class VocabShard(NamedTuple):
    """Where a rank's logits lie: the group, its columns ``[start, start + width)`` of ``size``."""

    group: object
    start: int
    size: int


class Options(NamedTuple):
    """A call's options, as the public function's arguments (``check``: check_targets)."""

    ignore_index: int
    reduction: str
    smoothing: float
    z_coef: float
    check: bool


def shard_stats(logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, opts: Options) -> torch.Tensor:
    """``[M, 3]`` fp32: each row's logsumexp over the shard, its target's logit if the target is
    in the shard (else 0), and (label smoothing) the sum of its logits."""
    m, v = logits.shape
    if use_kernels(logits) and logits.dtype != torch.float64:
        stats = torch.empty((m, 3), dtype=torch.float32, device=logits.device)
        if m:
            launch(_shard_stats_kernel, (m,), logits, target, stats, v, shard.start, logits.stride(0),
                   opts.ignore_index, HAS_SMOOTHING=opts.smoothing > 0, BLOCK_V=STATS_BLOCK_V, num_warps=NUM_WARPS)
        return stats
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    local = target.long() - shard.start
    here = (local >= 0) & (local < v) & (target != opts.ignore_index)
    z_t = torch.where(here, z.gather(1, torch.where(here, local, 0)[:, None])[:, 0], 0.0)
    z_sum = z.sum(1) if opts.smoothing > 0 else torch.zeros_like(z_t)
    return torch.stack((torch.logsumexp(z, 1), z_t, z_sum), 1)


def shard_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, shard: VocabShard,
               opts: Options, out: torch.Tensor) -> torch.Tensor:
    """Writes into ``out`` (may be ``logits``) the gradient of the rows' losses with respect to
    the shard, each row's times ``scale [M]`` fp32; returns ``out``."""
    m, v = logits.shape
    if use_kernels(logits) and logits.dtype != torch.float64:
        if m:
            launch(_shard_grad_kernel, (m, cdiv(v, GRAD_BLOCK_V)), logits, out, target, lse, scale, v, shard.start,
                   shard.size, logits.stride(0), out.stride(0), opts.ignore_index, opts.smoothing, opts.z_coef,
                   HAS_SMOOTHING=opts.smoothing > 0, HAS_Z=opts.z_coef > 0, BLOCK_V=GRAD_BLOCK_V,
                   num_warps=NUM_WARPS)
        return out
    off, hot = opts.smoothing / shard.size, 1.0 - opts.smoothing
    z = logits.to(lse.dtype)
    p_coef = scale * (1.0 + 2.0 * opts.z_coef * lse)
    g = torch.exp(z - lse[:, None]) * p_coef[:, None] - (scale * off)[:, None]
    local = target.long() - shard.start
    hot_cols = torch.arange(v, device=logits.device)[None, :] == local[:, None]
    g = torch.where(hot_cols, g - (scale * hot)[:, None], g)
    return out.copy_(torch.where((target != opts.ignore_index)[:, None], g, 0.0))


# --------------------------------------------------------------------------------------------
# across the group, and the rows' losses
# --------------------------------------------------------------------------------------------
def group_size(group) -> int:
    """Processes of ``group`` (None: the default group); 1 without torch.distributed."""
    import torch.distributed as dist
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def combine(stats: torch.Tensor, group) -> tuple:
    """(lse, target logit, sum of logits), each ``[M]`` fp32, of the whole rows, from every rank's
    ``shard_stats`` (one all-gather)."""
    k = group_size(group)
    if k > 1:
        import torch.distributed as dist
        every = stats.new_empty((k * stats.shape[0], 3))
        # (all_gather_single: all_gather_into_tensor's name from torch 2.13, which deprecates the old one)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, stats, group=group)
        every = every.view(k, -1, 3)
    else:
        every = stats[None]
    return torch.logsumexp(every[..., 0], 0), every[..., 1].sum(0), every[..., 2].sum(0)


def row_losses(lse, z_t, z_sum, target, v: int, opts: Options):
    """Each row's loss ``lse - (1 - eps) z_t - eps / V sum(z) + z_loss lse**2`` (0 where ignored,
    NaN where the target is outside [0, V)), and the rows counted (not ignored)."""
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < v)
    loss = lse - (1.0 - opts.smoothing) * z_t + opts.z_coef * lse * lse
    if opts.smoothing > 0:
        loss = loss - (opts.smoothing / v) * z_sum
    loss = torch.where(valid, torch.where(in_range, loss, math.nan), 0.0)
    return loss, valid, in_range


def row_scales(grad: torch.Tensor, valid, in_range, count, opts: Options, dtype: torch.dtype) -> torch.Tensor:
    """``[M]`` of the statistics' ``dtype``: each row's factor of the gradient for the upstream
    ``grad`` (0-d or ``[M]``): times ``1 / count`` for ``mean``, NaN for an out-of-range target,
    0 for an ignored row."""
    scale = grad.to(dtype).expand(valid.shape)
    if opts.reduction == "mean":
        scale = scale / count
    return torch.where(valid, torch.where(in_range, scale, math.nan), 0.0).contiguous()


class _VocabParallelCE(torch.autograd.Function):
    """The loss of one call (identical on every rank) and the gradient of the local shard.
    ``logits`` may be a DTensor: its local tensor is used (and, in place, written) here, inside the
    Function, where autograd does not forbid writing into the view ``to_local`` returns."""

    @staticmethod
    def forward(ctx, logits, target, shard: VocabShard, opts: Options, inplace: bool, loss_dtype: torch.dtype):
        local = logits.to_local() if is_dtensor(logits) else logits
        ctx.layout = (local.shape, (logits.device_mesh, logits.placements, logits.shape, logits.stride())
                      if is_dtensor(logits) else None)
        x = local.reshape(-1, local.shape[-1])
        if x.stride(1) != 1:
            x = x.contiguous()
        pending = start_target_check(target, shard.size, opts.ignore_index) if opts.check else None
        lse, z_t, z_sum = combine(shard_stats(x, target, shard, opts), shard.group)
        rows, valid, in_range = row_losses(lse, z_t, z_sum, target, shard.size, opts)
        finish_target_check(pending, target, shard.size, opts.ignore_index)
        count = valid.sum()
        loss = {"mean": lambda: rows.sum() / count, "sum": rows.sum, "none": lambda: rows}[opts.reduction]()
        ctx.inplace = inplace and ctx.needs_input_grad[0]
        # x: an attribute, not saved: autograd refuses to unpack a view made here (in no-grad mode)
        ctx.opts, ctx.shard, ctx.x = opts, shard, x
        if ctx.inplace:  # the gradient for an upstream gradient of 1, over the logits
            one = torch.ones((), dtype=lse.dtype, device=x.device)
            shard_grad(x, target, lse, row_scales(one, valid, in_range, count, opts, lse.dtype), shard, opts, out=x)
        else:
            ctx.save_for_backward(target, lse, valid, in_range, count)
        return loss.to(loss_dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.inplace:
            if ctx.x is None:
                raise RuntimeError("vocab_parallel_cross_entropy(inplace_backward=True) formed its gradient in the "
                                   "forward and scales it in place: backward can run through it only once")
            dx, ctx.x = ctx.x, None
            if use_kernels(dx) and dx.dtype != torch.float64:
                scale_rows_(dx, grad)  # skips rows whose factor is 1 (loss.backward())
            else:
                dx.mul_(grad if grad.dim() == 0 else grad[:, None])
        else:
            x = ctx.x
            target, lse, valid, in_range, count = ctx.saved_tensors
            scale = row_scales(grad, valid, in_range, count, ctx.opts, lse.dtype)
            dx = shard_grad(x, target, lse, scale, ctx.shard, ctx.opts,
                            out=torch.empty_like(x, memory_format=torch.contiguous_format))
        local_shape, spec = ctx.layout
        dx = dx.reshape(local_shape)
        if spec is not None:
            from torch.distributed.tensor import DTensor
            mesh, placements, shape, stride = spec
            dx = DTensor.from_local(dx, mesh, placements, run_check=False, shape=shape, stride=stride)
        return dx, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def dtensor_shard(t, name: str, dim: int) -> VocabShard:
    """The VocabShard of a DTensor ``t`` sharded along ``dim`` (its vocabulary) on one mesh dimension
    and replicated on the others: ``ColwiseParallel``'s weight (dim 0), or its output with
    ``use_local_output=False`` (the last dim)."""
    from torch.distributed.tensor import Replicate

    placements = t.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % t.dim() == dim % t.dim()]
    if len(dims) != 1 or any(not isinstance(p, Replicate) for i, p in enumerate(placements) if i != dims[0]):
        raise ValueError(f"{name}: a DTensor must be sharded along its vocabulary dimension ({dim}) on one mesh "
                         f"dimension and replicated on the others, got placements {placements}")
    mesh, mesh_dim = t.device_mesh, dims[0]
    v, k = t.shape[dim], mesh.size(mesh_dim)
    # DTensor's Shard splits as torch.chunk does: ceil(V / K) rows a rank, the last ones fewer.
    return VocabShard(mesh.get_group(mesh_dim), min(mesh.get_local_rank(mesh_dim) * -(-v // k), v), v)


def replicated_local(t, name: str, grad_placements=None):
    """The local tensor of ``t`` (a plain tensor as it is), which must be the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if any(not isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name}: a DTensor must be replicated (the same on every rank), got placements "
                         f"{t.placements}")
    return t.to_local(grad_placements=grad_placements)


def plain_shard(width: int, group, vocab_start, vocab_size) -> VocabShard:
    """The VocabShard of this rank's ``width`` columns (of plain tensors): equal shards in rank order
    unless ``vocab_start`` / ``vocab_size`` say otherwise."""
    for name, value in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be None or an int, got {value!r}")
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    k = group_size(group)
    if vocab_start is None:
        import torch.distributed as dist
        vocab_start = width * (dist.get_rank(group) if k > 1 else 0)
    vocab_size = width * k if vocab_size is None else vocab_size
    if vocab_start + width > vocab_size:
        raise ValueError(f"vocab_start + the shard's width ({vocab_start} + {width}) exceeds vocab_size "
                         f"({vocab_size})")
    return VocabShard(group, vocab_start, vocab_size)


def _mark_overwritten(logits: torch.Tensor) -> None:
    """Bump the logits' version before the gradient is written over them, so that another op
    that saved them for its backward fails loudly; reading ``grad_fn`` remakes a view's history
    now, before autograd records the call (as ``cross_entropy(inplace_backward=True)`` does)."""
    torch.autograd.graph.increment_version(logits)
    logits.grad_fn


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group=None,
                                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                 z_loss: float = 0.0, inplace_backward: bool = False, check_targets: bool = True):
    """Cross-entropy of logits sharded over the vocabulary across ``group`` (tensor parallelism),
    without gathering them: equal to ``llmkernels.cross_entropy`` of the whole ``[M, V]`` logits
    on every rank (module docstring).

    Args:
        logits: this rank's ``[..., V_k]`` columns ``[vocab_start, vocab_start + V_k)`` of the
            logits (float32/bfloat16/float16; float64 in plain PyTorch), unit stride along the
            vocabulary; or a DTensor sharded along its last dimension (``Shard(-1)``, e.g. the
            output of a ``ColwiseParallel(use_local_output=False)`` head), whose mesh gives the
            group and the columns.
        target: ``[...]`` int64/int32 class indices of the whole vocabulary, or ``ignore_index``:
            the same on every rank (a replicated DTensor, or a plain tensor).
        group: the process group that shards the vocabulary (None: the default group; without
            torch.distributed initialized, this process alone). Not with a DTensor.
        vocab_start: the first column of this rank's shard (default: ``rank * V_k``, equal shards
            in rank order). vocab_size: V (default: ``V_k * group size``). Not with a DTensor.
        ignore_index, reduction, label_smoothing, z_loss, check_targets: as in
            :func:`llmkernels.cross_entropy` (targets checked against V).
        inplace_backward: form this shard's gradient in the forward (one more pass over the shard
            then, none in the backward) and write it over ``logits``: no second ``[M, V_k]``
            buffer. **The logits are overwritten** and the backward can run only once.

    Returns:
        The loss in the logits' dtype (0-d, or ``[...]`` for ``"none"``), a plain tensor equal on
        every rank, differentiable in this rank's logits. Communication: one all-gather of
        ``[M, 3]`` fp32 in the forward, none in the backward.

    Eager only: it has no torch.compile form (torch.compile breaks the graph around it;
    ``fullgraph=True`` refuses it).
    """
    if is_dtensor(logits):
        check_no_layout("logits", group, vocab_start, vocab_size)
        shard = dtensor_shard(logits, "logits", -1)
        target = replicated_local(target, "target")
    else:
        shard = (group, vocab_start, vocab_size)
    opts = loss_options(ignore_index, reduction, label_smoothing, z_loss, check_targets)
    return sharded_loss(logits, target, shard, opts, inplace_backward)


def check_no_layout(name: str, group, vocab_start, vocab_size) -> None:
    """A DTensor ``name`` carries its layout: refuse one given beside it."""
    if group is not None or vocab_start is not None or vocab_size is not None:
        raise ValueError(f"group, vocab_start and vocab_size come from the mesh of a DTensor {name}: leave them None")


def loss_options(ignore_index, reduction, label_smoothing, z_loss, check_targets) -> Options:
    """The checked :class:`Options` of a call (ValueError / TypeError naming a bad one)."""
    check_loss_options(ignore_index, reduction, label_smoothing, z_loss, None)
    return Options(ignore_index, reduction, float(label_smoothing), float(z_loss), bool(check_targets))


def sharded_loss(logits: torch.Tensor, target, shard, opts: Options, inplace_backward: bool,
                  loss_dtype: Optional[torch.dtype] = None):
    """The loss of logits ``[..., V_k]`` (plain, or a DTensor whose ``shard`` is resolved) and
    plain targets; ``shard``: a VocabShard, or ``(group, vocab_start, vocab_size)`` to resolve. In
    ``loss_dtype`` (default the logits')."""
    with torch.no_grad():
        local = logits.to_local() if is_dtensor(logits) else logits
    check_tensor("logits", local)
    if local.dim() < 1 or local.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V_k] with V_k >= 1, got {list(local.shape)}")
    lead = local.shape[:-1]
    check_target(target.reshape(-1) if isinstance(target, torch.Tensor) and target.shape == lead else target,
                 lead.numel(), local, "logits")
    if not isinstance(shard, VocabShard):
        shard = plain_shard(local.shape[-1], *shard)
    inplace = bool(inplace_backward) and torch.is_grad_enabled() and logits.requires_grad
    if inplace:
        _mark_overwritten(logits)
    loss = _VocabParallelCE.apply(logits, target.reshape(-1), shard, opts, inplace, loss_dtype or local.dtype)
    return loss.reshape(lead) if opts.reduction == "none" else loss
