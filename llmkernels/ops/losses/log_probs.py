"""Per-token log-probabilities (and entropy) of an LM head without the ``[M, V]`` logits.

``hidden [M, H]``, ``weight [V, H]``, ``target [M]``; ``z = (hidden @ weight.T + bias) / T``::

    logp[i] = z[i, target[i]] - lse(z[i])           entropy[i] = lse(z[i]) - E_p[z[i]]

the primitive of RL and preference losses (GRPO, PPO, DPO: ``examples/post_training.py``).

Both passes go over the same vocabulary chunks (``base.vocab_chunks``: ``[M, Cv]`` logits of Cv
classes a GEMM, in ``logits_dtype``), made by the same cuBLAS calls (the same arguments, shapes,
strides and output dtype), so that the backward's recomputed logits are bitwise the forward's:
the probabilities ``exp(z - lse)`` it forms from the forward's ``lse`` then sum to 1 whatever
the GEMMs round (logits of the two passes formed by different GEMMs, rounded to bf16, put the
gradients far off, the more so at low temperature). The width Cv and the logits' dtype are fixed
once per call, in the options record, for both passes.

The logits' dtype: by default hidden's, the values of the unfused ``hidden @ weight.T``; with
``logits_dtype=torch.float32`` the GEMMs sum into fp32 logits that are never rounded to a 16-bit
dtype (exact to float64 within fp32 rounding at any temperature, for twice the bytes of logits
read and written per chunk).

Forward: ``_chunk_logp_kernel`` merges each chunk into every row's running online log-sum-exp
(``base.row_online``: the max, the sum of ``exp(z - max)``, with the entropy the sum of
``exp(z - max) * z``; fp32) and z at the target where the target falls in the chunk; after the
last chunk it writes ``logp``, ``entropy``, ``lse`` and ``E_p[z]`` (fp32). Only ``lse`` and
``E_p[z]`` are kept for the backward.

Backward: the upstream gradients of ``logp`` and ``entropy`` are known only now, so the logits
are recomputed (``base.vocab_grads``): the gradient block is formed in hidden's dtype over the
logits, the weight gradient of a chunk is one matmul over all rows (exact, no fp32 ``[V, H]``
accumulator) and the hidden gradient is summed in an fp32 ``[M, H]`` buffer. Matmuls: 1
(forward) + 3 (backward: logits again, weight gradient, hidden gradient), each of ``2 M H V``
flops; the unfused computation (logits, log_softmax, gather) does 3.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from ... import reference
from .._args import next_pow2, or_stand_in
from .._launch import launch, reference_dtype
from .._triton import tl, triton
from ..configs.linear_losses import DEFAULT_CONFIG
from .base import (Head, check_chunk_sizes, check_fp32_or_none, check_ignore_index, check_target, check_temperature,
                   checked_head, finish_target_check, grad_chunk_cols, grads_needed, lse_of, row_online,
                   start_target_check, vocab_chunks, vocab_grads, vocab_loss_op)


class LogProbsOptions(NamedTuple):
    """The options of a ``linear_log_probs`` call, named once: the custom ops' schemas and the
    autograd context are made of these fields."""

    temperature: float
    want_entropy: bool  # return_entropy
    ignore_index: int
    check: bool  # check_targets
    cols: int  # vocabulary columns per chunk of both passes (``_chunk_width``)
    logits_dtype: Optional[torch.dtype]  # both passes' logits: None (hidden's) or torch.float32
    need: tuple[bool, ...]  # which of hidden, weight and bias want a gradient


Outputs = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]


@triton.jit
def _chunk_logp_kernel(X, T, STATE, NEXT, LOGP, ENT, LSE, MU, M, N, v0, V, stride_x, ignore_index, inv_temp,
                       ENTROPY: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row a program: the vocabulary chunk ``X [M, N]`` (classes ``v0 .. v0 + N`` of V)
    merged into the row's running state of ``z = x * inv_temp``, ``STATE [4, M]`` fp32 (the max,
    the sum of exps and, with ENTROPY, the sum of exp * z of ``row_online``, then z[target] once
    the target's chunk is seen; FIRST: none yet), written to ``NEXT [4, M]`` (a buffer apart, so
    that no program's store can overtake another thread's read of the same row). LAST: the
    outputs instead, ``lse``, ``logp = z[t] - lse`` and with ENTROPY ``mu = E_p[z]``,
    ``entropy = lse - mu`` (both 0 where t is ignore_index, NaN where it is outside [0, V))."""
    row = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    zero = tl.zeros([1], dtype=tl.float32)
    if FIRST:
        m, s, w, z_t = zero + float("-inf"), zero, zero, zero
    else:
        m = tl.load(STATE + row + one)
        s = tl.load(STATE + M + row + one)
        w = tl.load(STATE + 2 * M + row + one)
        z_t = tl.load(STATE + 3 * M + row + one)
    x_row = X + row * stride_x
    m, s, w, _ = row_online(x_row, N, inv_temp, m, s, w, zero, BLOCK_V, ENTROPY, False)
    t = tl.load(T + row + tl.zeros([1], tl.int64)).to(tl.int64)
    here = (t >= v0) & (t < v0 + N)
    z_t = tl.where(here, tl.load(x_row + tl.where(here, t - v0, 0), mask=here, other=0.0).to(tl.float32) * inv_temp,
                   z_t)
    if LAST:
        lse = lse_of(m, s)
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= V))
        tl.store(LOGP + row + one, tl.where(bad, float("nan"), tl.where(valid, z_t - lse, 0.0)))
        tl.store(LSE + row + one, lse)
        if ENTROPY:
            mu = w / s
            tl.store(MU + row + one, mu)
            tl.store(ENT + row + one, tl.where(bad, float("nan"), tl.where(valid, lse - mu, 0.0)))
    else:
        tl.store(NEXT + row + one, m)
        tl.store(NEXT + M + row + one, s)
        tl.store(NEXT + 2 * M + row + one, w)
        tl.store(NEXT + 3 * M + row + one, z_t)


def _logp_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                  options: LogProbsOptions) -> Outputs:
    """Returns ``(logp, entropy or None, lse, mu or None)``, each ``[M]`` fp32."""
    m, v, cols = hidden.shape[0], weight.shape[0], options.cols
    ignore_index, want_entropy = options.ignore_index, options.want_entropy
    pending = start_target_check(target, v, ignore_index) if options.check else None
    new_rows = lambda: torch.empty(m, dtype=torch.float32, device=hidden.device)  # noqa: E731
    logp, lse = new_rows(), new_rows()
    entropy, mu = (new_rows(), new_rows()) if want_entropy else (None, None)
    if m:
        kernel = DEFAULT_CONFIG.kernel("log_probs")
        block_v = min(kernel.block_v, next_pow2(min(cols, v)))
        state = torch.empty(2, 4, m, dtype=torch.float32, device=hidden.device)  # read one, write the other
        for v0, n, logits in vocab_chunks(cols, Head(hidden, weight, bias), logits_dtype=options.logits_dtype):
            k = v0 // cols % 2
            launch(_chunk_logp_kernel, (m,), logits, target, state[k], state[1 - k], logp,
                   or_stand_in(entropy, lse), lse, or_stand_in(mu, lse), m, n, v0, v, logits.stride(0), ignore_index,
                   1.0 / options.temperature, ENTROPY=want_entropy, FIRST=v0 == 0, LAST=v0 + n == v, BLOCK_V=block_v,
                   num_warps=kernel.num_warps)
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
                       cols=options.cols, logits_dtype=options.logits_dtype, run=bwd)


LOG_PROBS = vocab_loss_op("linear_log_probs", forward=_logp_forward, fake=_logp_fake, backward=_logp_backward,
                          grad_inputs=(0, 1, 3), returns=2)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _chunk_width(hidden: torch.Tensor, weight: torch.Tensor, vocab_chunk_size: Optional[int],
                 logits_dtype: Optional[torch.dtype]) -> int:
    """The vocabulary columns per chunk of both passes, chosen once, before the forward: the free
    device memory it reads may have changed by the backward, whose chunks must be the forward's.
    Sized as the backward sizes its own (``grad_chunk_cols``)."""
    v = weight.shape[0]
    if vocab_chunk_size is not None:
        return min(vocab_chunk_size, v)
    return grad_chunk_cols(hidden, v, logits_dtype, None if torch.compiler.is_compiling() else hidden.device)


def _rounded_to(hidden: torch.Tensor, logits_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the plain-PyTorch path rounds its logits to, as the kernels' GEMMs do: hidden's
    where it is narrower than fp32 and ``logits_dtype`` is None, else none (fp32 or wider)."""
    return hidden.dtype if logits_dtype is None and hidden.element_size() < 4 else None


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0, return_entropy: bool = False,
                     ignore_index: int = -100, check_targets: bool = True,
                     logits_dtype: Optional[torch.dtype] = None, vocab_chunk_size: Optional[int] = None,
                     chunk_size: Optional[int] = None):
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
        logits_dtype: the logits' dtype in both passes: None (default) hidden's, the values of
            ``hidden @ weight.T`` (the unfused computation's and TRL's, the fastest), or
            ``torch.float32``, exact to float64 at any temperature (float32 and float64 inputs
            form their logits in their own dtype either way). Choose float32 at low temperature
            or with an entropy bonus, where bf16 logits move the entropy by tens of percent and
            the gradients by a few at temperature 0.05. It costs time at large vocabularies (fp32
            logits to write and read; ``benchmarks/RESULTS.md`` section 2.6 gives the measured cost).
        vocab_chunk_size: vocabulary columns per chunk of both passes (default: ``chunk_bytes``
            of ``[M, Cv]`` logits, ``configs/linear_losses.py``, at most a quarter of the free
            device memory; under torch.compile the width is fixed at tracing, by the shapes alone).
        chunk_size: no longer applies (it was the rows per forward chunk: the forward now goes
            over the backward's vocabulary chunks); still checked, and a FutureWarning when
            given, outside torch.compile.

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
    check_fp32_or_none("logits_dtype", logits_dtype)
    if chunk_size is not None and not torch.compiler.is_compiling():
        warnings.warn("linear_log_probs: chunk_size no longer applies (both passes go over vocabulary chunks of "
                      "vocab_chunk_size columns)", FutureWarning, stacklevel=2)
    compute = reference_dtype(hidden)
    if compute is not None:
        logp, entropy = reference.linear_log_probs(hidden, weight, target, bias, temperature=temperature,
                                                   ignore_index=ignore_index, check_targets=check_targets,
                                                   compute_dtype=compute,
                                                   logits_dtype=_rounded_to(hidden, logits_dtype))
    else:
        options = LogProbsOptions(temperature, return_entropy, ignore_index, check_targets,
                                  _chunk_width(hidden, weight, vocab_chunk_size, logits_dtype), logits_dtype,
                                  grads_needed(hidden, weight, bias))
        logp, entropy = LOG_PROBS(hidden, weight, target, bias, options)
    return (logp, entropy) if return_entropy else logp
