"""Chunks of an LM head's logits, and the gradients of a loss over vocabulary chunks: exact
weight gradients without an fp32 ``[V, H]`` accumulator.

For ``hidden [M, H]``, ``weight [V, H]`` and a loss whose gradient with respect to the logits
row ``z = (hidden @ weight.T + bias) / temperature`` (soft-capped, optionally) is, per class k::

    G[k] = (p[k] * (A + B * (z[k] - mu)) - C - D * onehot(target)[k]) * dz/dlogits[k]

with ``p = exp(z - lse)`` and per-row coefficients ``A, B, C, D`` (``mu``: a per-row constant),
the columns ``v`` of a chunk give::

    logits[:, v] = hidden @ weight[v].T (+ bias[v])      cuBLAS, [M, Cv] in hidden's dtype
    G[:, v] written over the logits                     ``vocab_grad_kernel``
    grad_weight[v] = G[:, v].T @ hidden                 one matmul over all M rows: cuBLAS sums in
                                                        fp32 and rounds once (no accumulator)
    grad_bias[v] = G[:, v] summed over rows             fp32
    grad_hidden += G[:, v] @ weight[v]                  fp32 [M, H] accumulator (M << V)

The coefficients of the losses built on this:
  - cross-entropy (``linear_cross_entropy(memory="low")``): ``s (1 + 2 z_loss lse), 0,
    s eps / V, s (1 - eps)`` with ``s`` the row's upstream gradient (times ``1 / count``);
  - ``log p(target)`` and entropy (``linear_log_probs``) for upstream gradients ``g1, g2``:
    ``-g1, -g2, 0, -g1`` with ``mu = E_p[z]`` (d logp / dz = onehot - p,
    d H / dz = -p (z - E_p[z])).
Rows whose target is ``ignore_index`` get a zero gradient. ``chunk_rows`` / ``chunk_cols`` cut
the rows or the vocabulary into chunks of a number of bytes of logits (``configs/linear_losses.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..._launch import cdiv, launch, pointer
from ..._triton import tl, triton
from ...configs.linear_losses import DEFAULT_CONFIG
from .row_kernels import softcapped, through_softcap


@triton.jit
def vocab_grad_kernel(X, G_OUT, T, LSE, MU, COEF, M, N, v0, stride_x, stride_g, ignore_index, inv_temp, softcap,
                      HAS_B: tl.constexpr, HAS_C: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """``G_OUT [M, N]`` (``X`` itself, or a buffer of another dtype) written with ``G`` (module
    docstring) of ``X [M, N]``, columns ``v0 .. v0 + N`` of the logits; ``COEF [4, M]`` fp32 holds
    A, B, C, D. Grid: (M, cdiv(N, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    t = tl.load(T + row).to(tl.int64)
    a = tl.load(COEF + row)
    d = tl.load(COEF + 3 * M + row)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z = softcapped(x * inv_temp, softcap, HAS_SOFTCAP)
    p = tl.exp(z - tl.load(LSE + row))
    g = p * a
    if HAS_B:  # (masked classes: p = 0, z = -inf)
        g += tl.where(p > 0, p * tl.load(COEF + M + row) * (z - tl.load(MU + row)), 0.0)
    if HAS_C:
        g -= tl.load(COEF + 2 * M + row)
    g = tl.where(cols + v0 == t, g - d, g)
    g = through_softcap(g, z, softcap, HAS_SOFTCAP) * inv_temp
    g = tl.where(t != ignore_index, g, 0.0)
    tl.store(G_OUT + row * stride_g + cols, g.to(G_OUT.dtype.element_ty), mask=mask)


def chunk_rows(m: int, v: int, element_size: int, device: torch.device, chunk_size: Optional[int] = None,
               chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes) -> int:
    """Rows per row chunk: ``chunk_bytes`` of ``[C, V]`` logits (at most a quarter of the free
    device memory), evened out so the last chunk is not a sliver; ``chunk_size`` overrides."""
    if m == 0:
        return 1
    if chunk_size is not None:
        return min(chunk_size, m)
    return _fit(m, v, element_size, device, chunk_bytes)


def chunk_cols(m: int, v: int, element_size: int, device: torch.device,
               chunk_bytes: int = DEFAULT_CONFIG.chunk_bytes) -> int:
    """Columns per vocabulary chunk: ``chunk_bytes`` of ``[M, Cv]`` logits, likewise, aligned."""
    return aligned_cols(_fit(v, m, element_size, device, chunk_bytes), v)


def aligned_cols(cols: int, v: int) -> int:
    """``cols`` rounded up to a multiple of ``column_align`` (at most ``v``)."""
    align = DEFAULT_CONFIG.column_align
    return min(v, cdiv(cols, align) * align)


def _fit(n: int, other: int, element_size: int, device: torch.device, chunk_bytes: int) -> int:
    """Slices of ``n`` whose ``[slice, other]`` logits take ``chunk_bytes`` (at most a quarter of
    the free device memory), evened out."""
    per = max(1, other) * element_size
    size = max(1, chunk_bytes // per)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        size = max(1, min(size, free // (4 * per)))
    size = min(n, size)
    return cdiv(n, cdiv(n, size)) if n else 1


def head_logits(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``out = hidden @ weight.T (+ bias)``. With ``out`` wider than hidden (fp32 logits of bf16
    inputs) the products are summed in fp32 and never rounded to hidden's dtype, so that logits
    formed in another pass, by other shapes and GEMM kernels, differ from these by fp32 rounding
    only: what a backward that pairs recomputed logits with the forward's statistics needs."""
    if bias is None:
        torch.mm(hidden, weight.t(), out=out) if out.dtype == hidden.dtype else accumulate_mm(out, hidden,
                                                                                               weight.t(), beta=0)
    elif out.dtype == hidden.dtype:
        torch.addmm(bias, hidden, weight.t(), out=out)
    else:
        out.copy_(bias.expand_as(out))
        accumulate_mm(out, hidden, weight.t())


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """``acc = beta * acc + a @ b`` with ``acc`` possibly wider than ``a, b`` (fp32 sums of bf16
    products, in cuBLAS's epilogue on CUDA: no temporary of ``acc``'s size); ``beta`` 0 or 1."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


def grads_by_vocab_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          target: torch.Tensor, lse: torch.Tensor, coefs: torch.Tensor, mu: Optional[torch.Tensor],
                          *, need: tuple, ignore_index: int, inv_temp: float = 1.0, softcap: Optional[float] = None,
                          has_c: bool = False, cols: Optional[int] = None,
                          logits_dtype: Optional[torch.dtype] = None):
    """``(grad_hidden, grad_weight, grad_bias)`` (each None unless ``need``-ed) of the loss whose
    logits gradient the module docstring describes: ``coefs [4, M]`` fp32 (A, B, C, D), ``mu``
    ``[M]`` fp32 or None (B = 0), ``has_c``: C is not all zero. ``cols``: columns per chunk.
    ``logits_dtype`` (fp32): the logits are formed in it (``head_logits``), as the forward formed
    the ``lse`` they are paired with, and the gradient written to a second buffer in hidden's
    dtype; None: in hidden's dtype, the gradient written over them."""
    need_h, need_w, need_b = need
    m, v = hidden.shape[0], weight.shape[0]
    # An unchecked target outside [0, V) makes its row's gradient NaN, as the row kernels do.
    coefs = torch.where((target != ignore_index) & ((target < 0) | (target >= v)), math.nan, coefs)
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
    grad_bias = torch.empty(v, dtype=torch.float32, device=weight.device) if need_b else None
    if m == 0 or not any(need):
        if need_w:
            grad_weight.zero_()
        if need_b:
            grad_bias.zero_()
    else:
        apart = logits_dtype not in (None, hidden.dtype)
        per_element = hidden.element_size() + (logits_dtype.itemsize if apart else 0)
        cols = cols or chunk_cols(m, v, per_element, hidden.device)
        buffer = torch.empty(m * min(cols, v), dtype=hidden.dtype, device=hidden.device)
        logits_buffer = torch.empty(m * min(cols, v), dtype=logits_dtype, device=hidden.device) if apart else buffer
        kernel = DEFAULT_CONFIG.vocab_grad
        for v0 in range(0, v, cols):
            n = min(v, v0 + cols) - v0
            block = buffer[: m * n].view(m, n)  # contiguous, so cuBLAS writes it in place
            logits = logits_buffer[: m * n].view(m, n)
            w = weight[v0:v0 + n]
            head_logits(logits, hidden, w, None if bias is None else bias[v0:v0 + n])
            launch(vocab_grad_kernel, (m, cdiv(n, kernel.block_v)), logits, block, target, lse, pointer(mu, lse),
                   coefs, m, n, v0, logits.stride(0), block.stride(0), ignore_index, inv_temp,
                   1.0 if softcap is None else softcap, HAS_B=mu is not None, HAS_C=has_c,
                   HAS_SOFTCAP=softcap is not None, BLOCK=kernel.block_v, num_warps=kernel.num_warps)
            if need_w:
                torch.mm(block.t(), hidden, out=grad_weight[v0:v0 + n])
            if need_b:
                torch.sum(block, 0, dtype=torch.float32, out=grad_bias[v0:v0 + n])
            if need_h:
                accumulate_mm(grad_hidden, block, w)
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight,
            None if grad_bias is None else grad_bias.to(bias.dtype))
