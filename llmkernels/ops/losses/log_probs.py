"""Per-token log-probabilities (and entropy) of an LM head without the ``[M, V]`` logits.

``hidden [M, H]``, ``weight [V, H]``, ``target [M]``; ``z = (hidden @ weight.T + bias) / T``::

    logp[i] = z[i, target[i]] - lse(z[i])           entropy[i] = lse(z[i]) - E_p[z[i]]

the primitive of RL and preference losses (GRPO, PPO, DPO: ``examples/post_training.py``).

Forward: row chunks. Each chunk's logits ``[C, V] = hidden_chunk @ weight.T`` (cuBLAS, summed
and kept in fp32) are read once by ``_row_logp_kernel``, which keeps a running max, the sum of
``exp(z - max)`` and (entropy) the sum of ``exp(z - max) * z``, and writes ``logp``,
``entropy``, ``lse`` and ``E_p[z]`` (fp32). Only ``lse`` and ``E_p[z]`` are kept for the
backward.

Backward: the upstream gradients of ``logp`` and ``entropy`` are known only now, so the logits
are recomputed in fp32, over vocabulary chunks (``base.vocab_grads``): the gradient block is
formed in hidden's dtype, the weight gradient of a chunk is one matmul over all rows (exact,
no fp32 ``[V, H]`` accumulator) and the hidden gradient is summed in an fp32 ``[M, H]`` buffer.
Matmuls: 1 (forward) + 3 (backward: logits again, weight gradient, hidden gradient), each of
``2 M H V`` flops; the unfused computation (logits, log_softmax, gather) does 3.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import reference
from .._args import or_stand_in
from .._launch import launch, reference_dtype
from .._triton import tl, triton
from ..configs.linear_losses import DEFAULT_CONFIG
from .base import (Head, check_chunk_sizes, check_ignore_index, check_target, check_temperature, checked_head,
                   chunk_rows, finish_target_check, grads_needed, row_chunks, row_lse, start_target_check, vocab_grads,
                   vocab_loss_op)


class LogProbsOptions(NamedTuple):
    """The options of a ``linear_log_probs`` call, named once: the custom ops' schemas and the
    autograd context are made of these fields."""

    temperature: float
    want_entropy: bool  # return_entropy
    ignore_index: int
    check: bool  # check_targets
    chunk_size: Optional[int]  # rows of logits per forward chunk
    vocab_chunk_size: Optional[int]  # vocabulary columns per backward chunk
    need: tuple[bool, ...]  # which of hidden, weight and bias want a gradient


# The logits of both passes in fp32: the backward's, formed over vocabulary chunks by other GEMMs,
# then differ from the forward's (whose lse and E_p[z] they are paired with) by fp32 rounding only,
# which 1 / temperature magnifies far less than a bf16 rounding.
LOGITS_DTYPE = torch.float32

Outputs = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]


@triton.jit
def _row_logp_kernel(X, T, LOGP, ENT, LSE, MU, V, stride_x, ignore_index, inv_temp, ENTROPY: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    """One row of logits ``X`` per program: ``lse`` of ``z = x * inv_temp``, ``logp = z[t] - lse``
    (0 where ``t`` is ``ignore_index``, NaN where it is out of range) and, with ENTROPY,
    ``mu = E_p[z]`` and ``entropy = lse - mu`` (0 where ignored, NaN where out of range)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    lse, s, w, _ = row_lse(x_row, V, inv_temp, BLOCK_V, ENTROPY, False)
    t = tl.load(T + row + tl.zeros([1], tl.int64)).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    z_t = tl.load(x_row + tl.where(in_range, t, 0), mask=valid & in_range, other=0.0).to(tl.float32) * inv_temp
    one = tl.arange(0, 1)
    tl.store(LOGP + row + one, tl.where(valid & ~in_range, float("nan"), tl.where(valid, z_t - lse, 0.0)))
    tl.store(LSE + row + one, lse)
    if ENTROPY:
        mu = w / s
        tl.store(MU + row + one, mu)
        tl.store(ENT + row + one, tl.where(valid & ~in_range, float("nan"), tl.where(valid, lse - mu, 0.0)))


def _logp_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                  options: LogProbsOptions) -> Outputs:
    """Returns ``(logp, entropy or None, lse, mu or None)``, each ``[M]`` fp32."""
    m, v = hidden.shape[0], weight.shape[0]
    ignore_index, want_entropy = options.ignore_index, options.want_entropy
    kernel = DEFAULT_CONFIG.kernel("log_probs")
    pending = start_target_check(target, v, ignore_index) if options.check else None
    new_rows = lambda: torch.empty(m, dtype=torch.float32, device=hidden.device)  # noqa: E731
    logp, lse = new_rows(), new_rows()
    entropy, mu = (new_rows(), new_rows()) if want_entropy else (None, None)
    chunk = chunk_rows(m, v, LOGITS_DTYPE.itemsize, hidden.device, options.chunk_size)
    for rows, logits in row_chunks(chunk, Head(hidden, weight, bias), logits_dtype=LOGITS_DTYPE):
        launch(_row_logp_kernel, (logits.shape[0],), logits, rows(target), rows(logp), rows(or_stand_in(entropy, lse)),
               rows(lse), rows(or_stand_in(mu, lse)), v, logits.stride(0), ignore_index, 1.0 / options.temperature,
               ENTROPY=want_entropy, BLOCK_V=kernel.block_v, num_warps=kernel.num_warps)
    finish_target_check(pending, target, v, ignore_index)
    return logp, entropy, lse, mu


# --------------------------------------------------------------------------------------------
# registration: eager autograd and the custom ops llmkernels::linear_log_probs_fwd / _bwd; the
# caller gets logp and entropy, the backward reads lse and E_p[z] (the default setup saves them).
# --------------------------------------------------------------------------------------------
def _logp_fake(hidden, weight, target, bias, options: LogProbsOptions):
    rows = lambda: hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # noqa: E731
    return rows(), (rows() if options.want_entropy else None), rows(), (rows() if options.want_entropy else None)


def _logp_backward(ctx, bwd, grad_logp, grad_entropy, *_):
    """G = (g1 onehot - p (g1 + g2 (z - mu))) / T: a = d = -g1, b = -g2 (``base.vocab_grads``)."""
    hidden, weight, target, bias, lse, mu = ctx.saved_tensors
    options = ctx.options
    g1 = -(lse.new_zeros(lse.shape) if grad_logp is None else grad_logp.to(torch.float32))
    g2 = None if grad_entropy is None or not options.want_entropy else -grad_entropy.to(torch.float32)
    return vocab_grads(Head(hidden, weight, bias), lse, g1, need=options.need, b=g2, mu=None if g2 is None else mu,
                       d=g1, target=target, ignore_index=options.ignore_index, inv_temp=1.0 / options.temperature,
                       cols=options.vocab_chunk_size, logits_dtype=LOGITS_DTYPE, run=bwd)


LOG_PROBS = vocab_loss_op("linear_log_probs", forward=_logp_forward, fake=_logp_fake, backward=_logp_backward,
                          grad_inputs=(0, 1, 3), returns=2)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0, return_entropy: bool = False,
                     ignore_index: int = -100, check_targets: bool = True, chunk_size: Optional[int] = None,
                     vocab_chunk_size: Optional[int] = None):
    """Per-token ``log p(target)`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    without materializing the ``[M, V]`` logits (see the module docstring).

    Args:
        hidden: ``[M, H]`` float32/bfloat16/float16 (float64 runs the reference): the final
            hidden states, one row per token.
        weight: ``[V, H]`` of hidden's dtype (an LM head / tied embedding). bias: ``[V]`` or None.
        target: ``[M]`` int64/int32 token ids, or ``ignore_index``: such rows get 0 (and no gradient).
        temperature: the logits are divided by it (sampling temperature of the policy).
        return_entropy: also return the entropy ``-sum_j p_j log p_j`` of each row's distribution.
        check_targets: raise ValueError for a target outside ``[0, V)`` (a small kernel, one
            host wait); with False such rows give NaN (log-probability, entropy and gradient),
            on every path.
        chunk_size: rows of logits per forward chunk; vocab_chunk_size: vocabulary columns per
            backward chunk (defaults: ``chunk_bytes`` of logits each, ``configs/linear_losses.py``).

    Returns:
        ``logp [M]`` float32, or ``(logp, entropy)`` with ``return_entropy``. Differentiable in
        hidden, weight and bias for any upstream gradient of either output (the backward
        recomputes the logits).
    """
    hidden, weight, bias = checked_head(hidden, weight, bias)
    check_target(target, hidden.shape[0], hidden, "hidden")
    check_ignore_index(ignore_index)
    temperature = check_temperature(temperature)
    check_chunk_sizes(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    compute = reference_dtype(hidden)
    if compute is not None:
        logp, entropy = reference.linear_log_probs(hidden, weight, target, bias, temperature=temperature,
                                                   ignore_index=ignore_index, check_targets=check_targets,
                                                   compute_dtype=compute)
    else:
        options = LogProbsOptions(temperature, return_entropy, ignore_index, check_targets, chunk_size,
                                  vocab_chunk_size, grads_needed(hidden, weight, bias))
        logp, entropy = LOG_PROBS(hidden, weight, target, bias, options)
    return (logp, entropy) if return_entropy else logp
