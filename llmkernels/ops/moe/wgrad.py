"""The expert weights' gradients through PyTorch's grouped GEMM (``torch._grouped_mm``, public as
``F.grouped_mm``): the ``weight_grad_backend="grouped_mm"`` of ``MoeConfig``.

Same contract as ``experts._weight_grad`` (``kernels.weight_grad_kernel``): ``dW[e] = sum over
expert e's sorted rows r of a_r^T b_r``, ``a_r`` gathered by token and times the slot's routing
weight where asked (rounded to the rows' dtype before the product, as the kernel does), summed in
fp32 and stored once in the weight's dtype and layout; a bias's gradient ``sum_r a_r``; zeros for
an expert without rows. Rows are passed to the GEMM in expert order as its jagged K dimension,
``offsets[1:]`` its groups' ends (``routing.sort_slots`` puts every dropped slot after the last
expert, where the GEMM ignores it).

Memory: a gathered operand is materialised in expert order (``kernels.sorted_rows_kernel``: the
gather and the routing weight in one pass), one ``[S, H]`` buffer a weight gradient (the scaled
``dy`` rows for ``down_proj``, then ``x``'s rows for ``gate_up_proj``; the other operands, ``h``
and ``d(gate, up)``, are already sorted), and a bias's gradient adds an ``[S, 8]`` column of ones
and an ``[E, N, 8]`` product (the sums as a GEMM: deterministic, where an index_add over rows would
use atomics).

The call is usable where torch's fast kernel runs (``usable``): bf16 rows and weights, widths
that keep every stride a multiple of 16 bytes, a weight stored contiguous or transposed (the
product is formed in the weight's own orientation, so ``.grad`` needs no copy).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import _device
from .._launch import launcher_of
from .._triton import triton
from . import kernels

# (a [M, S], b [S, N], ends [E] int32) -> [E, M, N]: group e sums rows ends[e - 1] to ends[e].
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS = ("triton", "grouped_mm")
ALIGN = 8  # bf16 elements in 16 bytes: the grouped kernel's stride alignment
ONES = 8  # columns of the ones operand of a bias's sums (the narrowest aligned width)


class RowsTile(NamedTuple):
    """``sorted_rows_kernel``'s tile: 8 KB of bf16 a program, enough in flight to copy at the
    card's bandwidth."""
    block_s: int = 32
    block_n: int = 128
    num_warps: int = 4


ROWS_TILE = RowsTile()


def grouped_mm_op() -> Optional[Gemm]:
    """This torch's grouped GEMM (``F.grouped_mm``, else ``torch._grouped_mm``), None without one."""
    op = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return None if op is None else lambda a, b, ends: op(a, b, offs=ends)


def available(device: torch.device) -> bool:
    """Whether ``device`` runs torch's grouped GEMM in its own kernel: CUDA sm90 (Hopper). Older
    cards take a host-synchronising loop; sm100's kernel has returned nonzero sums for groups
    without rows in some torch versions, which an expert without tokens would then receive."""
    return (device.type == "cuda" and torch.cuda.is_available() and grouped_mm_op() is not None
            and _device.properties(_device.device_index(device)).major == 9)


def _orientation(w: torch.Tensor) -> Optional[bool]:
    """False: ``w [E, M, N]`` stored contiguous; True: stored as ``[E, N, M]`` (its transpose);
    None: neither."""
    if w.is_contiguous():
        return False
    return True if w.transpose(1, 2).is_contiguous() else None


def usable(out_like: torch.Tensor, rows_dtype: torch.dtype, bias_like: Optional[torch.Tensor] = None) -> bool:
    """Whether ``grouped_weight_grad`` can form ``out_like``'s gradient (and ``bias_like``'s) in
    torch's fast kernel (see the module notes)."""
    bf16 = torch.bfloat16
    return (grouped_mm_op() is not None and rows_dtype == bf16 and out_like.dtype == bf16
            and out_like.shape[1] % ALIGN == 0 and out_like.shape[2] % ALIGN == 0
            and _orientation(out_like) is not None and (bias_like is None or bias_like.dtype == bf16))


def _sorted_rows(t: torch.Tensor, gather: bool, order: torch.Tensor, top_k: int,
                 scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``t``'s rows in expert order, contiguous: gathered by token (``order // top_k``) or
    already sorted, times ``scale`` (``[S]`` or ``[T, k]``, contiguous) at the row's slot
    (computed in fp32, rounded once); ``t`` itself when it needs neither."""
    if not gather and scale is None:
        return t.contiguous()
    if t.stride(1) != 1:
        t = t.contiguous()
    rows, n = order.shape[0], t.shape[1]
    out = torch.empty((rows, n), device=t.device, dtype=t.dtype)
    if out.numel() == 0:
        return out
    tile = ROWS_TILE
    handle = launcher_of(kernels.sorted_rows_kernel, TOP_K=top_k, GATHER=gather, HAS_SCALE=scale is not None,
                         BLOCK_S=tile.block_s, BLOCK_N=tile.block_n, num_warps=tile.num_warps)
    handle((triton.cdiv(rows, tile.block_s) * triton.cdiv(n, tile.block_n),), t, order, t if scale is None else scale,
           out, rows, n, t.stride(0))
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, top_k: int,
                        out_like: torch.Tensor, *, gather_a: bool = False, gather_b: bool = False,
                        scale: Optional[torch.Tensor] = None, bias_like: Optional[torch.Tensor] = None,
                        gemm: Optional[Gemm] = None) -> tuple:
    """``(dW, d_bias)`` as ``experts._weight_grad`` forms them (module notes), through ``gemm``
    (torch's grouped GEMM when None): ``a [S or T, M]``, ``b [S or T, N]`` (rows sorted, or
    tokens with ``gather_*``), ``order [S]`` and ``offsets [E + 1]`` of ``sort_slots``,
    ``out_like [E, M, N]``; ``d_bias`` (like ``bias_like [E, M]``) None without it."""
    gemm = gemm or grouped_mm_op()
    rows_a = _sorted_rows(a, gather_a, order, top_k, scale)
    rows_b = _sorted_rows(b, gather_b, order, top_k, None)
    ends = offsets[1:].clone()  # its own allocation: an aligned pointer, as torch's other callers pass
    if _orientation(out_like):  # stored [E, N, M]: its product, viewed back
        dw = gemm(rows_b.T, rows_a, ends).transpose(1, 2)
    else:
        dw = gemm(rows_a.T, rows_b, ends)
    del rows_b
    db = None
    if bias_like is not None:
        ones = torch.ones((rows_a.shape[0], ONES), device=a.device, dtype=rows_a.dtype)
        db = torch.empty_like(bias_like).copy_(gemm(rows_a.T, ones, ends)[:, :, 0])
    return dw, db
