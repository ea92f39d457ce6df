"""Candidates for wide rows on Hopper, measured by ``benchmarks/wide_rows.py`` before they may become
strategies of the library: a row a thread-block cluster, for the norms' forward and backward and
for cross-entropy with its gradient written over the logits.

One program a row, the whole row one ``[1, BLOCK_N]`` tile, launched with ``num_ctas`` = the
columns over ``cols_per_cta``: Triton spreads the tile over the cluster's CTAs (each loads its
``cols_per_cta`` columns at once, 32 KB of bf16 at 16384) and reduces the sum of squares across
them (LayerNorm's sum and sum of squares as one pair) through distributed shared memory. It is
the shape of Quack's forward (a row a cluster of 2-8 CTAs, 16384 columns each): enough reads in
flight per SM without a global-memory exchange. Cross-entropy's row (a vocabulary of 32K-256K)
is read once the same way: its max, its sum of exponentials and its target's logit are reductions
across the cluster, after which each CTA writes the gradient of the mean loss over its own columns.
The norms' backward is persistent instead: a program a cluster the GPU holds at once, looping over
rows (a row's two dot products reduced across the cluster, as the forward's statistics) and
keeping its columns' dW (and dB) sums in registers, written once as a partial per program.

Triton compiles a reduction across a cluster's CTAs from 3.7 on; 3.6 refuses it at compile time
("Layout has 4 CTAs per CGA, but the context requires 2"), so on 3.6 a row wider than
``cols_per_cta`` would fail to build: ``why_not_here`` says so first, and the benchmark records
the candidate as skipped. Triton's interpreter ignores ``num_ctas``: there the kernel's
arithmetic is checked, not its clusters.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from llmkernels.ops._device import persistent_programs
from llmkernels.ops._launch import INTERPRET
from llmkernels.ops._triton import tl, triton
from llmkernels.ops.losses.base import count_rows, finish_loss, scale_rows_
from llmkernels.ops.norm.tile import dy_terms, shifted_var, sum_pair, tile_x_hat

CLUSTER_REDUCE_TRITON = (3, 7)  # the first Triton that compiles a reduction across a cluster's CTAs


class ClusterRows(NamedTuple):
    """A row over a cluster of ``next_pow2(N) / cols_per_cta`` CTAs (at least one) of ``num_warps``;
    the backward's persistent programs sized for ``per_sm`` CTAs an SM."""

    cols_per_cta: int
    num_warps: int = 8
    per_sm: int = 1
    prefetch: bool = False  # the backward: the next row's loads issued before this row's reductions


@triton.jit
def rms_fwd_cluster_kernel(X, W, Y, RSTD, N, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    """``y = w * (x * rstd).to(x.dtype)`` (Llama's casting) and ``rstd`` of row ``program_id``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)  # (before the row's reduction: its latency overlaps)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + row + tl.arange(0, 1), rstd)
    x_hat = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x_hat * w.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def ln_fwd_cluster_kernel(X, W, B, Y, MEAN, RSTD, N, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    """``y = (x - mean) * rstd * w + b``, ``mean`` and ``rstd`` of row ``program_id``; the sums taken
    less the row's first element, as the library's kernels do, so that the variance does not
    cancel when |mean| >> std."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)
    b = tl.load(B + cols, mask=mask, other=0.0)
    shift = tl.load(X + row * stride_x).to(tl.float32)
    xs = tl.where(mask, tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) - shift, 0.0)
    sum_shifted, sum_sq = sum_pair(xs, xs * xs, 1)
    mean_shifted = sum_shifted / N
    rstd = tl.rsqrt(shifted_var(mean_shifted, sum_sq / N) + eps)
    tl.store(MEAN + row + tl.arange(0, 1), shift + mean_shifted)
    tl.store(RSTD + row + tl.arange(0, 1), rstd)
    y = (xs - mean_shifted[:, None]) * rstd[:, None] * w.to(tl.float32) + b.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_x_dy(X, DY, r, M, cols, mask, stride_x, stride_dy):
    """Row ``r``'s x and dy as loaded (nothing past the last row): [1, BLOCK_N] each."""
    rows = tl.arange(0, 1).to(tl.int64) + r
    valid = mask & (rows < M)[:, None]
    return (tl.load(X + rows[:, None] * stride_x + cols, mask=valid, other=0.0),
            tl.load(DY + rows[:, None] * stride_dy + cols, mask=valid, other=0.0))


@triton.jit
def norm_bwd_cluster_kernel(X, W, DY, DX, DW_PART, DB_PART, MEAN, RSTD, M, N, stride_x, stride_dy, stride_dx,
                            IS_RMS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of rows ``program_id``, ``program_id + programs``, ... and this program's partial dW
    (LayerNorm: and dB) over them, each row a ``[1, BLOCK_N]`` tile over the cluster whose dot
    products (LayerNorm's two as one pair) are reduced across its CTAs; the terms are the
    library's (``dy_terms``: RMSNorm's dW from Llama's rounded x_hat). ``PREFETCH``: the next
    row's loads are issued before this row's reductions, so that a row's reads are in flight
    while the cluster waits on the last one's."""
    prog = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        x_next, dy_next = _row_x_dy(X, DY, prog, M, cols, mask, stride_x, stride_dy)
    for r in range(prog, M, step):
        rows = tl.arange(0, 1).to(tl.int64) + r
        if PREFETCH:
            x, dy = x_next, dy_next
            x_next, dy_next = _row_x_dy(X, DY, r + step, M, cols, mask, stride_x, stride_dy)
        else:
            x, dy = _row_x_dy(X, DY, r, M, cols, mask, stride_x, stride_dy)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        x_hat, rstd = tile_x_hat(x, rows, rows < M, mask, MEAN, RSTD, IS_RMS)
        wdy, dw_acc, db_acc = dy_terms(x_hat, dy, w, dw_acc, db_acc, X.dtype.element_ty, True, not IS_RMS, IS_RMS)
        if IS_RMS:
            dx = wdy - x_hat * (tl.sum(x_hat * wdy, axis=1) / N)[:, None]
        else:
            sum_xw, sum_w = sum_pair(x_hat * wdy, wdy, 1)
            dx = wdy - x_hat * (sum_xw / N)[:, None] - (sum_w / N)[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols, (dx * rstd[:, None]).to(DX.dtype.element_ty), mask=mask)
    part = prog.to(tl.int64) * N + cols
    tl.store(DW_PART + part, dw_acc, mask=mask)
    if not IS_RMS:
        tl.store(DB_PART + part, db_acc, mask=mask)


@triton.jit
def ce_inplace_cluster_kernel(LOGITS, TARGET, LOSS, COUNT, V, stride, ignore_index, BLOCK_V: tl.constexpr):
    """Row ``program_id``'s loss ``lse - x[target]`` (0 where ignored) and, over its logits, the
    gradient of the mean loss, ``(softmax - onehot) / count``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)[None, :]
    mask = cols < V
    target = tl.load(TARGET + row)
    ptrs = LOGITS + row * stride + cols
    x = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    e = tl.exp(x - row_max[:, None])
    total = tl.sum(e, axis=1)
    is_target = cols == target
    # (the target's logit from the registers, not re-read: another CTA may have written its gradient)
    loss = row_max + tl.log(total) - tl.sum(tl.where(is_target, x, 0.0), axis=1)
    valid = target != ignore_index
    tl.store(LOSS + row + tl.arange(0, 1), tl.where(valid, loss, 0.0))
    scale = tl.where(valid, 1.0 / tl.load(COUNT).to(tl.float32), 0.0)
    grad = (e / total[:, None] - is_target.to(tl.float32)) * scale
    tl.store(ptrs, grad.to(LOGITS.dtype.element_ty), mask=mask)


def why_not_here() -> str | None:
    """None where this Triton can build the kernel for a GPU (the interpreter runs it at any
    version), else why not."""
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if INTERPRET or version >= CLUSTER_REDUCE_TRITON:
        return None
    return (f"Triton {triton.__version__} cannot build a reduction across a cluster's CTAs "
            f"({'.'.join(map(str, CLUSTER_REDUCE_TRITON))} or newer can)")


def _rows(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """``x [..., N]`` as rows (each of unit stride, as the parameters must be)."""
    if x.stride(-1) != 1 or any(p.stride(-1) != 1 for p in params):
        raise ValueError("x and the norm's parameters must have unit stride in their last dim")
    return x.reshape(-1, x.shape[-1])


def _cluster(n: int, config: ClusterRows) -> tuple[int, dict]:
    """A row of ``n`` a program: its tile's width and the launch options (warps, CTAs of its cluster)."""
    block = triton.next_power_of_2(n)
    return block, {"num_warps": config.num_warps, "num_ctas": max(1, block // config.cols_per_cta)}


def _launch(kernel, rows: torch.Tensor, y: torch.Tensor, pointers: tuple, eps: float, config: ClusterRows) -> None:
    """``kernel`` a row a program, over a cluster of ``next_pow2(N) / cols_per_cta`` CTAs."""
    block, options = _cluster(rows.shape[1], config)
    kernel[(rows.shape[0],)](*pointers, rows.shape[1], rows.stride(0), y.stride(0), eps, BLOCK_N=block, **options)


def _stat(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape[0], device=rows.device, dtype=torch.float32)


def _programs(rows: torch.Tensor, num_ctas: int, per_sm: int) -> int:
    """The backward's persistent programs: one a cluster of CTAs that the GPU holds at once
    (``per_sm`` CTAs an SM), so that the dW partials stay few; two under the interpreter, to test
    the loop."""
    if rows.device.type != "cuda":
        return max(1, min(rows.shape[0], 2))
    return max(1, min(rows.shape[0], persistent_programs(rows.device, per_sm) // num_ctas))


class _ClusterNorm(torch.autograd.Function):
    """RMSNorm (``bias`` None) or LayerNorm, forward and backward a row a cluster."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, config):
        rows = _rows(x, weight, *([] if bias is None else [bias]))
        y, rstd = torch.empty_like(rows), _stat(rows)
        if bias is None:
            mean = None
            _launch(rms_fwd_cluster_kernel, rows, y, (rows, weight, y, rstd), eps, config)
        else:
            mean = _stat(rows)
            _launch(ln_fwd_cluster_kernel, rows, y, (rows, weight, bias, y, mean, rstd), eps, config)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.config, ctx.shape = config, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, mean, rstd = ctx.saved_tensors
        m, n = rows.shape
        dy = dy.reshape(m, n)
        if dy.stride(1) != 1:
            dy = dy.contiguous()
        dx = torch.empty_like(rows)
        block, options = _cluster(n, ctx.config)
        programs = _programs(rows, options["num_ctas"], ctx.config.per_sm)
        dw_part = torch.empty(programs, n, device=rows.device, dtype=torch.float32)
        db_part = dw_part if mean is None else torch.empty_like(dw_part)
        norm_bwd_cluster_kernel[(programs,)](rows, weight, dy, dx, dw_part, db_part, rstd if mean is None else mean,
                                             rstd, m, n, rows.stride(0), dy.stride(0), dx.stride(0),
                                             IS_RMS=mean is None, PREFETCH=ctx.config.prefetch,
                                             BLOCK_N=block, **options)
        db = None if mean is None else db_part.sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), db, None, None


def rms_norm_cluster(x: torch.Tensor, weight: torch.Tensor, eps: float, config: ClusterRows) -> torch.Tensor:
    """RMSNorm of ``x [..., N]`` by ``weight [N]``, a row a cluster (differentiable)."""
    return _ClusterNorm.apply(x, weight, None, eps, config)


def layer_norm_cluster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       config: ClusterRows) -> torch.Tensor:
    """LayerNorm of ``x [..., N]`` by ``weight [N]`` and ``bias [N]``, a row a cluster (differentiable)."""
    return _ClusterNorm.apply(x, weight, bias, eps, config)


IGNORE_INDEX = -100


class _ClusterCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy whose forward writes its gradient over the logits (the library's
    ``inplace_backward``); the backward scales it by the upstream gradient, skipping a factor of 1."""

    @staticmethod
    def forward(ctx, logits, target, config):
        count = count_rows(target, IGNORE_INDEX)
        loss_rows = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        block, options = _cluster(logits.shape[1], config)
        ce_inplace_cluster_kernel[(logits.shape[0],)](logits, target, loss_rows, count, logits.shape[1],
                                                       logits.stride(0), IGNORE_INDEX, BLOCK_V=block,
                                                       **options)
        ctx.save_for_backward(logits)
        loss, _, _ = finish_loss(loss_rows, None, target, ignore_index=IGNORE_INDEX, reduction="mean", want_z=False,
                                 dtype=logits.dtype, count=count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (dlogits,) = ctx.saved_tensors
        scale_rows_(dlogits, grad)
        return dlogits, None, None


def cross_entropy_inplace_cluster(logits: torch.Tensor, target: torch.Tensor, config: ClusterRows) -> torch.Tensor:
    """The mean cross-entropy of ``logits [M, V]`` (rows of unit column stride; overwritten by the
    gradient) against ``target [M]`` (``-100`` ignored; in range otherwise, unchecked), a row a cluster."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [M, V] with unit column stride, got strides {tuple(logits.stride())}")
    return _ClusterCrossEntropy.apply(logits, target, config)
