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
are recomputed in fp32, over vocabulary chunks (``base.grads_by_vocab_chunks``): the gradient
block is formed in hidden's dtype, the weight gradient of a chunk is one matmul over all rows (exact,
no fp32 ``[V, H]`` accumulator) and the hidden gradient is summed in an fp32 ``[M, H]`` buffer.
Matmuls: 1 (forward) + 3 (backward: logits again, weight gradient, hidden gradient), each of
``2 M H V`` flops; the unfused computation (logits, log_softmax, gather) does 3.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import reference
from .._launch import launch, pointer, use_kernels
from .._register import Op
from .._triton import tl, triton
from ..configs.linear_losses import DEFAULT_CONFIG
from .base import (check_chunk_size, check_head, check_ignore_index, check_target, check_temperature, chunk_rows,
                   finish_target_check, gathered, grads_by_vocab_chunks, grads_fake, head_logits, row_lse,
                   start_target_check)


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
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    kernel = DEFAULT_CONFIG.log_probs
    pending = start_target_check(target, v, ignore_index) if options.check else None
    rows = lambda: torch.empty(m, dtype=torch.float32, device=hidden.device)  # noqa: E731
    logp, lse = rows(), rows()
    entropy, mu = (rows(), rows()) if want_entropy else (None, None)
    chunk = chunk_rows(m, v, LOGITS_DTYPE.itemsize, hidden.device, options.chunk_size)
    buffer = torch.empty((min(chunk, m), v), dtype=LOGITS_DTYPE, device=hidden.device)
    for a in range(0, m, chunk):
        b = min(m, a + chunk)
        logits = buffer[: b - a]
        head_logits(logits, hidden[a:b], weight, bias)
        launch(_row_logp_kernel, (b - a,), logits, target[a:b], logp[a:b], pointer(entropy, lse)[a:b],
               lse[a:b], pointer(mu, lse)[a:b], v, logits.stride(0), ignore_index, 1.0 / options.temperature,
               ENTROPY=want_entropy, BLOCK_V=kernel.block_v, num_warps=kernel.num_warps)
    finish_target_check(pending, target, v, ignore_index)
    return logp, entropy, lse, mu


def _logp_backward_launcher(grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                            hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            bias: Optional[torch.Tensor], lse: torch.Tensor, mu: Optional[torch.Tensor],
                            options: LogProbsOptions) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` for upstream gradients ``grad_logp [M]`` and
    ``grad_entropy [M]`` (or None), recomputing the logits over vocabulary chunks."""
    m = hidden.shape[0]
    g1 = (torch.zeros(m, dtype=torch.float32, device=hidden.device) if grad_logp is None
          else grad_logp.to(torch.float32))
    g2 = None if grad_entropy is None or mu is None else grad_entropy.to(torch.float32)
    # (A, B, C, D) = (-g1, -g2, unused, -g1): G = inv_T (g1 onehot - p (g1 + g2 (z - mu)))
    n1 = -g1
    coefs = torch.stack((n1, n1 if g2 is None else -g2, n1, n1))
    return grads_by_vocab_chunks(hidden, weight, bias, target, lse, coefs, None if g2 is None else mu,
                                 need=options.need, ignore_index=options.ignore_index,
                                 inv_temp=1.0 / options.temperature, cols=options.vocab_chunk_size,
                                 logits_dtype=LOGITS_DTYPE)


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::linear_log_probs_fwd /
# _bwd). The forward keeps lse and E_p[z] for the backward; the caller gets logp and entropy.
# --------------------------------------------------------------------------------------------
def _logp_fake(hidden, weight, target, bias, options: LogProbsOptions):
    rows = lambda: hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # noqa: E731
    return rows(), (rows() if options.want_entropy else None), rows(), (rows() if options.want_entropy else None)


def _logp_setup(ctx, inputs, options: LogProbsOptions, outputs):
    _, _, lse, mu = outputs
    ctx.save_for_backward(*inputs, lse, mu if options.want_entropy else None)
    ctx.options = options


def _logp_backward(ctx, bwd, grad_logp, grad_entropy, *_):
    hidden, weight, target, bias, lse, mu = ctx.saved_tensors
    grads = bwd(grad_logp, grad_entropy if mu is not None else None, hidden, weight, target, bias, lse, mu, ctx.options)
    return tuple(t if n else None for t, n in zip(grads, ctx.options.need))


def _logp_backward_fake(grad_logp, grad_entropy, hidden, weight, target, bias, lse, mu, options: LogProbsOptions):
    return grads_fake((hidden, weight, bias), options.need)


LOG_PROBS = Op("linear_log_probs", forward=_logp_forward, setup=_logp_setup, backward=_logp_backward,
               grad_inputs=(0, 1, 3), returns=2, fake=_logp_fake, backward_launcher=_logp_backward_launcher,
               backward_fake=_logp_backward_fake)


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
    weight, bias = gathered(weight, hidden), gathered(bias, hidden)
    check_head("hidden", hidden, "weight", weight, "bias", bias)
    check_target(target, hidden.shape[0], hidden, "hidden")
    check_ignore_index(ignore_index)
    temperature = check_temperature(temperature)
    check_chunk_size("chunk_size", chunk_size)
    check_chunk_size("vocab_chunk_size", vocab_chunk_size)
    if not use_kernels(hidden) or hidden.dtype == torch.float64:
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp, entropy = reference.linear_log_probs(hidden, weight, target, bias, temperature=temperature,
                                                   ignore_index=ignore_index, check_targets=check_targets,
                                                   compute_dtype=compute)
    else:
        grad_on = torch.is_grad_enabled()
        need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                grad_on and bias is not None and bias.requires_grad)
        options = LogProbsOptions(temperature, return_entropy, ignore_index, check_targets, chunk_size,
                                  vocab_chunk_size, need)
        logp, entropy = LOG_PROBS(hidden, weight, target, bias, options)
    return (logp, entropy) if return_entropy else logp
