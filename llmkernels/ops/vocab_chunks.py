"""Gradients of an LM-head loss over vocabulary chunks: exact weight gradients without an fp32
``[V, H]`` accumulator.

For ``hidden [M, H]``, ``weight [V, H]`` and a loss whose gradient with respect to the logits
row ``z = (hidden @ weight.T + bias) / temperature`` (soft-capped, optionally) is, per class k::

    G[k] = (p[k] * (A + B * (z[k] - mu)) - C - D * onehot(target)[k]) * dz/dlogits[k]

with ``p = exp(z - lse)`` and per-row coefficients ``A, B, C, D`` (``mu``: a per-row constant),
the columns ``v`` of a chunk give::

    logits[:, v] = hidden @ weight[v].T (+ bias[v])      cuBLAS, [M, Cv] in hidden's dtype
    G[:, v] written over the logits                     ``_vocab_grad_kernel``
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
Rows whose target is ``ignore_index`` get a zero gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._launch import cdiv, check_tensor, launch, pointer
from ._triton import tl, triton
from .cross_entropy import softcapped, through_softcap

# Bytes of the one [M, Cv] block of logits the loop holds: large enough for the three matmuls
# of a chunk to run near cuBLAS's peak (Cv = 8192 at M = 16384 bf16), small beside the weight
# gradient it produces.
CHUNK_BYTES = 256 * 2**20
BLOCK_V = 4096  # columns a program of the gradient kernel writes
COLUMN_ALIGN = 128  # chunks of a multiple of 128 columns keep every row of a block 16-byte aligned for cuBLAS
GRAD_WARPS = 8


@triton.jit
def _vocab_grad_kernel(X, T, LSE, MU, COEF, M, N, v0, stride_x, ignore_index, inv_temp, softcap,
                       HAS_B: tl.constexpr, HAS_C: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """``X [M, N]`` (columns ``v0 .. v0 + N`` of the logits) overwritten with ``G`` (module
    docstring); ``COEF [4, M]`` fp32 holds A, B, C, D. Grid: (M, cdiv(N, BLOCK))."""
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
    tl.store(X + row * stride_x + cols, g.to(X.dtype.element_ty), mask=mask)


def chunk_rows(m: int, v: int, element_size: int, device: torch.device, chunk_size: Optional[int] = None,
               chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per row chunk: ``chunk_bytes`` of ``[C, V]`` logits (at most a quarter of the free
    device memory), evened out so the last chunk is not a sliver; ``chunk_size`` overrides."""
    if m == 0:
        return 1
    if chunk_size is not None:
        return min(chunk_size, m)
    return _fit(m, v, element_size, device, chunk_bytes)


def chunk_cols(m: int, v: int, element_size: int, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Columns per vocabulary chunk: ``chunk_bytes`` of ``[M, Cv]`` logits, likewise, aligned."""
    return aligned_cols(_fit(v, m, element_size, device, chunk_bytes), v)


def aligned_cols(cols: int, v: int) -> int:
    """``cols`` rounded up to a multiple of ``COLUMN_ALIGN`` (at most ``v``)."""
    return min(v, cdiv(cols, COLUMN_ALIGN) * COLUMN_ALIGN)


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


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` possibly wider than ``a, b`` (fp32 sums of bf16 products,
    in cuBLAS's epilogue on CUDA: no temporary of ``acc``'s size)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (TypeError, RuntimeError):  # torch < 2.8 has no out_dtype: products rounded to a's dtype
            acc += torch.mm(a, b).to(acc.dtype)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def grads_by_vocab_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          target: torch.Tensor, lse: torch.Tensor, coefs: torch.Tensor, mu: Optional[torch.Tensor],
                          *, need: tuple, ignore_index: int, inv_temp: float = 1.0, softcap: Optional[float] = None,
                          has_c: bool = False, cols: Optional[int] = None):
    """``(grad_hidden, grad_weight, grad_bias)`` (each None unless ``need``-ed) of the loss whose
    logits gradient the module docstring describes: ``coefs [4, M]`` fp32 (A, B, C, D), ``mu``
    ``[M]`` fp32 or None (B = 0), ``has_c``: C is not all zero. ``cols``: columns per chunk."""
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
        cols = cols or chunk_cols(m, v, hidden.element_size(), hidden.device)
        buffer = torch.empty(m * min(cols, v), dtype=hidden.dtype, device=hidden.device)
        for v0 in range(0, v, cols):
            n = min(v, v0 + cols) - v0
            block = buffer[: m * n].view(m, n)  # contiguous, so cuBLAS writes it in place
            w = weight[v0:v0 + n]
            if bias is None:
                torch.mm(hidden, w.t(), out=block)
            else:
                torch.addmm(bias[v0:v0 + n], hidden, w.t(), out=block)
            launch(_vocab_grad_kernel, (m, cdiv(n, BLOCK_V)), block, target, lse, pointer(mu, lse), coefs,
                   m, n, v0, block.stride(0), ignore_index, inv_temp, 1.0 if softcap is None else softcap,
                   HAS_B=mu is not None, HAS_C=has_c, HAS_SOFTCAP=softcap is not None, BLOCK=BLOCK_V,
                   num_warps=GRAD_WARPS)
            if need_w:
                torch.mm(block.t(), hidden, out=grad_weight[v0:v0 + n])
            if need_b:
                torch.sum(block, 0, dtype=torch.float32, out=grad_bias[v0:v0 + n])
            if need_h:
                accumulate_mm(grad_hidden, block, w)
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight,
            None if grad_bias is None else grad_bias.to(bias.dtype))


def check_head(hidden_name: str, hidden, weight_name: str, weight, bias_name: str = "bias", bias=None, *,
               like: Optional[torch.Tensor] = None, like_name: str = "x") -> None:
    """Raise TypeError/ValueError naming the argument unless ``hidden [M, H]`` and ``weight
    [V, H]`` (V >= 1) are floating-point tensors of one dtype on one device (``like``'s, when
    given) and ``bias`` is None or ``[V]`` of weight's dtype."""
    check_tensor(hidden_name, hidden, like=like, like_name=like_name)
    if hidden.dim() != 2:
        raise ValueError(f"{hidden_name} must have shape [M, H], got {list(hidden.shape)}")
    check_tensor(weight_name, weight, like=hidden, like_name=hidden_name)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"{weight_name} must have shape [V, H] = [V, {hidden.shape[1]}] (H of {hidden_name}) "
                         f"with V >= 1, got {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} dtype {weight.dtype} must equal {hidden_name} dtype {hidden.dtype}")
    if bias is not None:
        check_tensor(bias_name, bias, like=hidden, like_name=hidden_name)
        if bias.shape != weight.shape[:1] or bias.dtype != weight.dtype:
            raise ValueError(f"{bias_name} must have shape [{weight.shape[0]}] and dtype {weight.dtype}, "
                             f"got {list(bias.shape)} {bias.dtype}")
