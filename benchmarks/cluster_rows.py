"""Candidates for the norms' forward at wide rows on Hopper, measured by ``benchmarks/wide_rows.py``
before they may become strategies of the library: a row a thread-block cluster.

One program a row, the whole row one ``[1, BLOCK_N]`` tile, launched with ``num_ctas`` = the
columns over ``cols_per_cta``: Triton spreads the tile over the cluster's CTAs (each loads its
``cols_per_cta`` columns at once, 32 KB of bf16 at 16384) and reduces the sum of squares across
them (LayerNorm's sum and sum of squares as one pair) through distributed shared memory. It is
the shape of Quack's forward (a row a cluster of 2-8 CTAs, 16384 columns each): enough reads in
flight per SM without a global-memory exchange.

Triton compiles a reduction across a cluster's CTAs from 3.7 on; 3.6 refuses it at compile time
("Layout has 4 CTAs per CGA, but the context requires 2"), so on 3.6 a row wider than
``cols_per_cta`` would fail to build: ``why_not_here`` says so first, and the benchmark records
the candidate as skipped. Triton's interpreter ignores ``num_ctas``: there the kernel's
arithmetic is checked, not its clusters.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from llmkernels.ops._launch import INTERPRET
from llmkernels.ops._triton import tl, triton
from llmkernels.ops.norm.tile import shifted_var, sum_pair

CLUSTER_REDUCE_TRITON = (3, 7)  # the first Triton that compiles a reduction across a cluster's CTAs


class ClusterRows(NamedTuple):
    """A row over a cluster of ``next_pow2(N) / cols_per_cta`` CTAs (at least one), 8 warps each."""

    cols_per_cta: int
    num_warps: int = 8


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


def _launch(kernel, rows: torch.Tensor, y: torch.Tensor, pointers: tuple, eps: float, config: ClusterRows) -> None:
    """``kernel`` a row a program, over a cluster of ``next_pow2(N) / cols_per_cta`` CTAs."""
    block = triton.next_power_of_2(rows.shape[1])
    kernel[(rows.shape[0],)](*pointers, rows.shape[1], rows.stride(0), y.stride(0), eps, BLOCK_N=block,
                             num_warps=config.num_warps, num_ctas=max(1, block // config.cols_per_cta))


def _stat(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape[0], device=rows.device, dtype=torch.float32)


def rms_norm_cluster(x: torch.Tensor, weight: torch.Tensor, eps: float, config: ClusterRows) -> torch.Tensor:
    """RMSNorm of ``x [..., N]`` by ``weight [N]``, a row a cluster."""
    rows = _rows(x, weight)
    y = torch.empty_like(rows)
    _launch(rms_fwd_cluster_kernel, rows, y, (rows, weight, y, _stat(rows)), eps, config)
    return y.view(x.shape)


def layer_norm_cluster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       config: ClusterRows) -> torch.Tensor:
    """LayerNorm of ``x [..., N]`` by ``weight [N]`` and ``bias [N]``, a row a cluster."""
    rows = _rows(x, weight, bias)
    y = torch.empty_like(rows)
    _launch(ln_fwd_cluster_kernel, rows, y, (rows, weight, bias, y, _stat(rows), _stat(rows)), eps, config)
    return y.view(x.shape)
