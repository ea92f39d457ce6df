"""The gradients of a row loss over an LM head, over vocabulary chunks: exact weight gradients
without an fp32 ``[V, H]`` accumulator, for any loss whose gradient with respect to a row of
logits ``z = (hidden @ weight.T + bias) / temperature`` (soft-capped, optionally) is, per class k::

    G[k] = (p[k] * (a + b * (z[k] - mu)) - c - d * onehot(target)[k]) * dz/dlogits[k]

with ``p = exp(z - lse)`` and per-row coefficients ``a`` and, where the loss has them, ``b``
(with ``mu``, a per-row constant), ``c`` and ``d`` (with the rows' targets). The columns ``v`` of
a vocabulary chunk (``chunks.vocab_chunks``) give::

    logits[:, v] = hidden @ weight[v].T (+ bias[v])      cuBLAS, [M, Cv] in hidden's dtype
    G[:, v] written over the logits                     ``_vocab_grad_kernel``
    grad_weight[v] = G[:, v].T @ hidden                 one matmul over all M rows: cuBLAS sums in
                                                        fp32 and rounds once (no accumulator)
    grad_bias[v] = G[:, v] summed over rows             fp32
    grad_hidden += G[:, v] @ weight[v]                  fp32 [M, H] accumulator (M << V)

The coefficients of the losses built on this, for a row's upstream gradient ``s``:
  - cross-entropy (``linear_cross_entropy(memory="low")``): ``a = s (1 + 2 z_loss lse)``,
    ``c = s eps / V``, ``d = s (1 - eps)``;
  - ``log p(target)`` and entropy (``linear_log_probs``), upstream ``s1, s2``: ``a = -s1``,
    ``b = -s2`` with ``mu = E_p[z]``, ``d = -s1`` (d logp / dz = onehot - p, d H / dz = -p (z - mu));
  - the z-loss ``lse**2`` (``linear_z_loss``): ``a = 2 s lse``.
Rows whose target is ``ignore_index`` get a zero gradient, rows whose target is outside [0, V)
a NaN one (as the row kernels give them).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..._args import cdiv, or_stand_in
from ..._launch import launch
from ..._register import Op
from ..._triton import tl, triton
from ...configs.linear_losses import DEFAULT_CONFIG
from .chunks import Head, accumulate_mm, chunk_cols, vocab_chunks
from .head import grads_fake
from .row_kernels import softcapped, through_softcap


@triton.jit
def _vocab_grad_kernel(X, G_OUT, T, LSE, MU, A, B, C, D, M, N, v0, stride_x, stride_g, ignore_index, inv_temp,
                       softcap, HAS_TARGET: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr,
                       HAS_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """``G_OUT [M, N]`` (``X`` itself, or a buffer of hidden's dtype) written with ``G`` (module
    notes) of the logits ``X [M, N]``, columns ``v0 .. v0 + N``; A, B, C, D, MU, LSE: fp32
    ``[M]``. Grid: (M, cdiv(N, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z = softcapped(x * inv_temp, softcap, HAS_SOFTCAP)
    p = tl.exp(z - tl.load(LSE + row))
    g = p * tl.load(A + row)
    if HAS_B:  # (masked classes: p = 0, z = -inf)
        g += tl.where(p > 0, p * tl.load(B + row) * (z - tl.load(MU + row)), 0.0)
    if HAS_C:
        g -= tl.load(C + row)
    if HAS_TARGET:
        t = tl.load(T + row).to(tl.int64)
        if HAS_D:
            g = tl.where(cols + v0 == t, g - tl.load(D + row), g)
    g = through_softcap(g, z, softcap, HAS_SOFTCAP) * inv_temp
    if HAS_TARGET:
        g = tl.where(t != ignore_index, g, 0.0)
    tl.store(G_OUT + row * stride_g + cols, g.to(G_OUT.dtype.element_ty), mask=mask)


class VocabGradOptions(NamedTuple):
    """What a ``vocab_grads`` call needs besides its tensors."""

    need: tuple[bool, ...]  # which of hidden, weight and bias want a gradient
    ignore_index: int  # rows whose target it is get no gradient (with a target)
    inv_temp: float  # 1 / temperature: the logits are scaled by it
    softcap: Optional[float]  # the logits' soft cap, or None
    cols: Optional[int]  # columns per chunk (None: ``chunk_bytes`` of logits)
    logits_dtype: Optional[torch.dtype]  # the logits' (None: hidden's, the gradient written over them)


Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def grad_chunk_cols(hidden: torch.Tensor, v: int, logits_dtype: Optional[torch.dtype],
                    device: Optional[torch.device]) -> int:
    """Columns per chunk of ``vocab_grads``: ``chunk_cols`` of the bytes a logit takes, with
    logits not in hidden's dtype (None: in it) a gradient block of hidden's dtype beside them;
    ``device`` None: not capped by free memory."""
    logits_dtype = logits_dtype or hidden.dtype
    size = hidden.element_size() + (logits_dtype != hidden.dtype) * logits_dtype.itemsize
    return chunk_cols(hidden.shape[0], v, size, device)


def _vocab_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 target: Optional[torch.Tensor], lse: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor],
                 mu: Optional[torch.Tensor], c: Optional[torch.Tensor], d: Optional[torch.Tensor],
                 options: VocabGradOptions) -> Grads:
    """The launcher: ``(grad_hidden, grad_weight, grad_bias)``, each None unless ``need``-ed."""
    need_h, need_w, need_b = options.need
    m, v = hidden.shape[0], weight.shape[0]
    if target is not None:  # an unchecked target outside [0, V) makes its row's gradient NaN
        a = torch.where((target != options.ignore_index) & ((target < 0) | (target >= v)), math.nan, a)
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
    grad_bias = torch.empty(v, dtype=torch.float32, device=weight.device) if need_b else None
    if m == 0 or not any(options.need):
        for t in (grad_weight, grad_bias):
            if t is not None:
                t.zero_()
    else:
        kernel = DEFAULT_CONFIG.kernel("vocab_grad")
        logits_dtype = options.logits_dtype or hidden.dtype
        apart = logits_dtype != hidden.dtype  # the gradient then goes to a buffer of hidden's dtype
        cols = options.cols or grad_chunk_cols(hidden, v, logits_dtype, hidden.device)
        buffer = hidden.new_empty(m * min(cols, v)) if apart else None
        softcap = options.softcap
        for v0, n, logits in vocab_chunks(cols, Head(hidden, weight, bias), logits_dtype=logits_dtype):
            block = buffer[: m * n].view(m, n) if apart else logits
            launch(_vocab_grad_kernel, (m, cdiv(n, kernel.block_v)), logits, block, or_stand_in(target, lse), lse,
                   or_stand_in(mu, lse), a, or_stand_in(b, a), or_stand_in(c, a), or_stand_in(d, a), m, n, v0,
                   logits.stride(0), block.stride(0), options.ignore_index, options.inv_temp,
                   1.0 if softcap is None else softcap, HAS_TARGET=target is not None, HAS_B=b is not None,
                   HAS_C=c is not None, HAS_D=d is not None, HAS_SOFTCAP=softcap is not None, BLOCK=kernel.block_v,
                   num_warps=kernel.num_warps)
            if need_w:
                torch.mm(block.t(), hidden, out=grad_weight[v0:v0 + n])
            if need_b:
                torch.sum(block, 0, dtype=torch.float32, out=grad_bias[v0:v0 + n])
            if need_h:
                accumulate_mm(grad_hidden, block, weight[v0:v0 + n])
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight,
            None if grad_bias is None else grad_bias.to(bias.dtype))


def _vocab_grads_fake(hidden, weight, bias, target, lse, a, b, mu, c, d, options: VocabGradOptions) -> Grads:
    return grads_fake((hidden, weight, bias), options.need)


def vocab_loss_op(name: str, **description) -> Op:
    """The :class:`Op` of a row loss over an LM head whose backward goes over vocabulary chunks:
    its backward launcher is this module's (custom op ``llmkernels::<name>_bwd``), which the
    loss's ``backward(ctx, bwd, ...)`` reaches as ``vocab_grads(..., run=bwd)``.
    ``description``: the rest of the Op's arguments (``forward``, ``fake``, ``backward``, ...)."""
    return Op(name, backward_launcher=_vocab_grads, backward_fake=_vocab_grads_fake, **description)


def vocab_grads(head: Head, lse: torch.Tensor, a: torch.Tensor, *, need: tuple, b: Optional[torch.Tensor] = None,
                mu: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None,
                d: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None, ignore_index: int = -100,
                inv_temp: float = 1.0, softcap: Optional[float] = None, cols: Optional[int] = None,
                logits_dtype: Optional[torch.dtype] = torch.float32, run=_vocab_grads) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` of the loss whose gradient with respect to the
    logits the module notes describe (each None unless ``need``-ed): ``lse`` and the
    coefficients fp32 ``[M]`` (``b`` with ``mu``; ``d`` with ``target``); ``cols``: columns per
    vocabulary chunk. ``logits_dtype``: the recomputed logits', as the forward formed those its
    ``lse`` came from (fp32 by default, as ``logsumexp_rows``: recomputed by other GEMMs they then
    differ by fp32 rounding only; None: hidden's). ``run``: the launcher, or in a loss's backward
    its ``bwd`` (the custom op under torch.compile: ``vocab_loss_op``)."""
    if d is not None and target is None:
        raise ValueError("vocab_grads: the coefficient d multiplies onehot(target): give the target")
    grads = run(head.hidden, head.weight, head.bias, target, lse, a, b, mu, c, d,
                VocabGradOptions(tuple(need), ignore_index, inv_temp, softcap, cols, logits_dtype))
    return tuple(g if n else None for g, n in zip(grads, need))
