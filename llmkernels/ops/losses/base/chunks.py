"""The chunk loops of every loss over an LM head, written once, and their sizes.

A loss over ``hidden [M, H]`` and a head ``weight [V, H]`` (``bias [V]``) never holds the
``[M, V]`` logits: it goes over row chunks (``row_chunks``: ``[C, V]`` logits of C rows at a
time) or over vocabulary chunks (``vocab_chunks``: ``[M, Cv]`` logits of Cv classes at a time),
each chunk's logits made by cuBLAS into one buffer that every chunk reuses (a fresh product per
chunk would be allocated while the previous one is still referenced: two chunks' logits at the
peak), in hidden's dtype or, where a loss asks (``logits_dtype``), summed and kept in fp32.
``chunk_rows`` / ``chunk_cols`` size the chunks in bytes of logits (``configs/linear_losses.py``);
``logsumexp_rows`` is the row pass that most losses start with.
"""
from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Optional

import torch

from ..._args import cdiv
from ..._launch import launch
from ..._triton import tl, triton
from ...configs.linear_losses import DEFAULT_CONFIG
from .row_kernels import row_lse


class Head(NamedTuple):
    """An LM head's inputs: ``hidden [M, H]``, ``weight [V, H]`` and ``bias [V]`` or None."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor):
    """``out = hidden @ weight.T (+ bias)``, returned (contiguous: cuBLAS writes it in place). With
    ``out`` wider than hidden (fp32 logits of bf16 inputs) the products are summed in fp32 and never
    rounded to hidden's dtype, so that logits formed in another pass, by other shapes and GEMM
    kernels, differ from these by fp32 rounding only: what a backward that pairs recomputed logits
    with the forward's statistics needs."""
    if out.dtype == hidden.dtype and bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    if out.dtype == hidden.dtype:
        return torch.addmm(bias, hidden, weight.t(), out=out)
    if bias is None:
        accumulate_mm(out, hidden, weight.t(), beta=0)
    else:
        out.copy_(bias.expand_as(out))
        accumulate_mm(out, hidden, weight.t())
    return out


def _every_row(t):
    return t


_every_row.span = slice(None)


def _rows(a: int, b: int):
    """The rows ``[a, b)`` of a per-row tensor (None for None), and their slice as ``.span``."""
    def rows(t):
        return None if t is None else t[a:b]
    rows.span = slice(a, b)
    return rows


def row_chunks(chunk: int, *heads: Head, logits_dtype: Optional[torch.dtype] = None) -> Iterable[tuple]:
    """For each chunk of ``chunk`` rows: ``(rows, *logits)``, ``rows(t)`` the chunk's rows of a
    per-row tensor ``t`` (``t`` itself where one chunk holds every row; ``rows.span`` their slice,
    for other dims) and one ``[rows, V]`` block of logits per head (the heads share M and V), in
    ``logits_dtype`` (default each hidden's)."""
    m = heads[0].hidden.shape[0]
    buffers = [h.hidden.new_empty((min(chunk, m), h.weight.shape[0]), dtype=logits_dtype or h.hidden.dtype)
               for h in heads]
    if 0 < m <= chunk:  # one chunk of every row: a list (a generator costs the host more than the loop)
        return [(_every_row, *[head_logits(h.hidden, h.weight, h.bias, buffer) for h, buffer in zip(heads, buffers)])]
    return _chunks_of_rows(chunk, m, heads, buffers)


def _chunks_of_rows(chunk: int, m: int, heads: tuple, buffers: list) -> Iterator[tuple]:
    """``row_chunks`` of several chunks (or of no rows), made one at a time into the buffers."""
    for a in range(0, m, chunk):
        b = min(m, a + chunk)
        rows = _rows(a, b)
        yield (rows, *[head_logits(rows(h.hidden), h.weight, h.bias, buffer[: b - a])
                       for h, buffer in zip(heads, buffers)])


def vocab_chunks(cols: int, *heads: Head, logits_dtype: Optional[torch.dtype] = None) -> Iterator[tuple]:
    """For each chunk of ``cols`` classes ``[v0, v0 + n)``: ``(v0, n, *logits)``, one ``[M, n]``
    block of logits per head (contiguous), in ``logits_dtype`` (default each hidden's)."""
    m, v = heads[0].hidden.shape[0], heads[0].weight.shape[0]
    buffers = [h.hidden.new_empty(m * min(cols, v), dtype=logits_dtype or h.hidden.dtype) for h in heads]
    for v0 in range(0, v, cols):
        n = min(v, v0 + cols) - v0
        yield (v0, n, *[head_logits(h.hidden, h.weight[v0:v0 + n], None if h.bias is None else h.bias[v0:v0 + n],
                                    buffer[: m * n].view(m, n)) for h, buffer in zip(heads, buffers)])


def chunk_rows(m: int, v: int, element_size: int, device: torch.device, chunk_size: Optional[int] = None,
               chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes) -> int:
    """Rows per row chunk: ``chunk_bytes`` of ``[C, V]`` logits (at most a quarter of the free
    device memory), evened out so the last chunk is not a sliver; ``chunk_size`` overrides."""
    if m == 0:
        return 1
    if chunk_size is not None:
        return min(chunk_size, m)
    return _fit(m, v, element_size, device, chunk_bytes)


def chunk_cols(m: int, v: int, element_size: int, device: Optional[torch.device],
               chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes) -> int:
    """Columns per vocabulary chunk: ``chunk_bytes`` of ``[M, Cv]`` logits, likewise, aligned
    (``device`` None: not capped by free memory, for a width fixed while torch.compile traces)."""
    return aligned_cols(_fit(v, m, element_size, device, chunk_bytes), v)


def aligned_cols(cols: int, v: int) -> int:
    """``cols`` rounded up to a multiple of ``column_align`` (at most ``v``)."""
    align = DEFAULT_CONFIG.column_align
    return min(v, cdiv(cols, align) * align)


def _fit(n: int, other: int, element_size: int, device: Optional[torch.device], chunk_bytes: int) -> int:
    """Slices of ``n`` whose ``[slice, other]`` logits take ``chunk_bytes`` (at most a quarter of
    the free device memory), evened out."""
    per = max(1, other) * element_size
    size = max(1, chunk_bytes // per)
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        size = max(1, min(size, free // (4 * per)))
    size = min(n, size)
    return cdiv(n, cdiv(n, size)) if n else 1


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """``acc = beta * acc + a @ b`` with ``acc`` possibly wider than ``a, b`` (fp32 sums of bf16
    products, in cuBLAS's epilogue on CUDA: no temporary of ``acc``'s size); ``beta`` 0 or 1."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


@triton.jit
def _logsumexp_kernel(X, LSE, V, stride_x, inv_temp, BLOCK_V: tl.constexpr):
    """One row of logits ``X`` a program: ``LSE[row]`` = logsumexp of ``x * inv_temp``."""
    row = tl.program_id(0).to(tl.int64)
    lse, _, _, _ = row_lse(X + row * stride_x, V, inv_temp, BLOCK_V, False, False)
    tl.store(LSE + row + tl.arange(0, 1), lse)


def logsumexp_rows(head: Head, chunk_size: Optional[int] = None, inv_temp: float = 1.0) -> torch.Tensor:
    """The fp32 logsumexp ``[M]`` of every row of ``head``'s logits times ``inv_temp``, over row
    chunks of ``chunk_size`` rows (default: ``chunk_bytes`` of logits), the logits summed and kept
    in fp32 (as ``vocab_grads`` recomputes them by default)."""
    hidden, weight = head.hidden, head.weight
    m, v = hidden.shape[0], weight.shape[0]
    lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
    kernel = DEFAULT_CONFIG.kernel("logsumexp")
    chunk = chunk_rows(m, v, torch.float32.itemsize, hidden.device, chunk_size)
    for rows, logits in row_chunks(chunk, head, logits_dtype=torch.float32):
        launch(_logsumexp_kernel, (logits.shape[0],), logits, rows(lse), v, logits.stride(0), inv_temp,
               BLOCK_V=kernel.block_v, num_warps=kernel.num_warps)
    return lse
