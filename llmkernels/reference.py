"""Plain-PyTorch definitions of every llmkernels op.

This module is the single source of truth for what each op computes. Tests run it in float64
against the kernels, the benchmark uses it as the "eager" and "torch.compile" providers, and
the public functions fall back to it for CPU tensors when Triton's interpreter is not enabled.

Every function takes the same arguments as its kernel counterpart plus ``compute_dtype``: the
precision of the arithmetic (float32 for the CPU fallback, float64 in tests). Rounding that is
part of the op's definition (Llama's ``x_hat.to(input_dtype)``, the residual stream stored in
its own dtype) happens at the same points whatever ``compute_dtype`` is.
"""
from __future__ import annotations

import math

import torch

NORM_CASTINGS = ("llama", "gemma", "none")


def resolve_norm_dtypes(x, weight, residual, *, casting, weight_offset, out_dtype, residual_in_fp32):
    """Fill in the defaults that depend on the inputs.

    Returns ``(weight_offset, out_dtype, h_dtype)``:
      - weight_offset: 1.0 for ``casting="gemma"`` (``x_hat * (1 + weight)``), else 0.0, unless given.
      - out_dtype: as the matching Hugging Face module returns it: for ``"llama"``
        ``weight * x_hat.to(input_dtype)`` promotes to the wider of weight and input dtype; the
        other modes return the input dtype.
      - h_dtype: dtype of the residual stream ``h = x + residual`` (float32 when
        ``residual_in_fp32``, else the wider of x and residual); ``None`` without a residual.
    """
    if weight_offset is None:
        weight_offset = 1.0 if casting == "gemma" else 0.0
    h_dtype = None
    if residual is not None:
        h_dtype = torch.float32 if residual_in_fp32 else torch.promote_types(x.dtype, residual.dtype)
    if out_dtype is None:
        in_dtype = h_dtype or x.dtype
        out_dtype = torch.promote_types(in_dtype, weight.dtype) if (casting == "llama" and weight is not None) else in_dtype
    return float(weight_offset), out_dtype, h_dtype


def _norm(x, weight, bias, residual, *, is_rms, eps, prenorm, residual_in_fp32, weight_offset, casting,
          out_dtype, compute_dtype):
    weight_offset, out_dtype, h_dtype = resolve_norm_dtypes(
        x, weight, residual, casting=casting, weight_offset=weight_offset, out_dtype=out_dtype,
        residual_in_fp32=residual_in_fp32)
    if residual is not None:
        h = (x.to(compute_dtype) + residual.to(compute_dtype)).to(h_dtype)
        in_dtype = h_dtype
    else:
        h = x
        in_dtype = x.dtype
    hc = h.to(compute_dtype)
    if is_rms:
        x_hat = hc * torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps)
    else:
        centered = hc - hc.mean(-1, keepdim=True)
        x_hat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        x_hat = x_hat.to(in_dtype).to(compute_dtype)
    y = x_hat
    if weight is not None:
        y = y * (weight.to(compute_dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    y = y.to(out_dtype)
    return (y, h) if prenorm else y


def rms_norm(x, weight=None, bias=None, *, eps=1e-6, residual=None, prenorm=False, residual_in_fp32=False,
             weight_offset=None, casting="llama", out_dtype=None, compute_dtype=torch.float32):
    """RMSNorm of ``x [..., N]`` (optionally of ``x + residual``); see ``llmkernels.rms_norm``."""
    return _norm(x, weight, bias, residual, is_rms=True, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting,
                 out_dtype=out_dtype, compute_dtype=compute_dtype)


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, residual=None, prenorm=False, residual_in_fp32=False,
               weight_offset=None, casting="none", out_dtype=None, compute_dtype=torch.float32):
    """LayerNorm of ``x [..., N]`` (optionally of ``x + residual``); see ``llmkernels.layer_norm``."""
    return _norm(x, weight, bias, residual, is_rms=False, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting,
                 out_dtype=out_dtype, compute_dtype=compute_dtype)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def rotate_half(x):
    """Hugging Face / GPT-NeoX pairing: halves ``(x1, x2)`` of the last dim -> ``(-x2, x1)``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    """GPT-J (interleaved) pairing: features ``(x[2i], x[2i+1])`` -> ``(-x[2i+1], x[2i])``."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rope(q, k, cos, sin, *, position_ids=None, layout="bhsd", interleaved=False, rotary_dim=None,
               compute_dtype=torch.float32):
    """RoPE of ``q`` and ``k`` (or None); see ``llmkernels.apply_rope``. Returns ``(q_out, k_out)``
    in the inputs' dtypes. ``x[..., :R] * cos + rot(x[..., :R]) * sin`` with the token's cos/sin
    rows (first R features), ``x[..., R:]`` passed through."""
    rotary_dim = rotary_dim or cos.shape[-1]
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    head_axis = 1 if layout == "bhsd" else 2
    cos = cos[..., :rotary_dim].to(compute_dtype).unsqueeze(head_axis)
    sin = sin[..., :rotary_dim].to(compute_dtype).unsqueeze(head_axis)
    rot = rotate_every_two if interleaved else rotate_half

    def one(x):
        if x is None:
            return None
        xc = x.to(compute_dtype)
        xr = xc[..., :rotary_dim]
        out = xr * cos + rot(xr) * sin
        if rotary_dim < x.shape[-1]:  # partial rotary: the other features pass through
            out = torch.cat((out, xc[..., rotary_dim:]), dim=-1)
        return out.to(x.dtype)

    return one(q), one(k)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, *, eps=1e-6, layout="bhsd", compute_dtype=torch.float32):
    """RMSNorm of every head row of ``q`` and ``k`` (weights ``[D]``), then RoPE over all ``D``
    features (``rotate_half``); see ``llmkernels.qk_norm_rope``. Returns ``(q_out, k_out)``
    contiguous in q's dtype, computed in ``compute_dtype`` and rounded once."""
    def norm(x, w):  # unrounded: in compute_dtype, into the rotation
        return rms_norm(x, w, eps=eps, casting="none", out_dtype=compute_dtype, compute_dtype=compute_dtype)

    q_out, k_out = apply_rope(norm(q, q_weight), norm(k, k_weight), cos, sin, layout=layout,
                              compute_dtype=compute_dtype)
    return q_out.to(q.dtype).contiguous(), k_out.to(q.dtype).contiguous()


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` formula, in the inputs' own dtypes (k may be None)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_out = q * cos + rotate_half(q) * sin
    return q_out, (None if k is None else k * cos + rotate_half(k) * sin)


# --------------------------------------------------------------------------------------------
# Cross-entropy and fused linear cross-entropy
# --------------------------------------------------------------------------------------------
def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                  softcap=None, check_targets=True, compute_dtype=torch.float32):
    """Cross-entropy of ``logits [M, V]`` against ``target [M]``; see ``llmkernels.cross_entropy``.

    Returns ``(loss, z_loss_part, lse)``: the loss (including ``z_loss * lse**2``) and the z-loss
    term alone, reduced alike and cast to the logits' dtype, and ``lse [M]`` in
    ``compute_dtype`` (of the softcapped logits). Equal to ``F.cross_entropy`` with the same
    ``ignore_index``, ``reduction`` and ``label_smoothing`` when ``z_loss = 0`` and no softcap.
    """
    v = logits.shape[-1]
    z = logits.to(compute_dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid, in_range = _target_rows(target, v, ignore_index, check_targets)
    lse = torch.logsumexp(z, dim=-1)
    z_target = z.gather(-1, torch.where(valid & in_range, target, 0).long()[:, None])[:, 0]
    # (1 - eps) * (lse - z[target]) + eps * mean_j (lse - z[j])
    rows = lse - (1.0 - label_smoothing) * z_target
    if label_smoothing > 0:
        rows = rows - label_smoothing * z.mean(-1)
    z_rows = z_loss * lse * lse
    rows = _poisoned(rows + z_rows, valid, in_range)
    z_rows = _poisoned(z_rows, valid, in_range)
    if reduction == "mean":
        n = valid.sum()
        rows, z_rows = rows.sum() / n, z_rows.sum() / n
    elif reduction == "sum":
        rows, z_rows = rows.sum(), z_rows.sum()
    if z_loss == 0:  # no z-loss term: zeros, even where the reduced loss is NaN (no rows counted)
        z_rows = torch.zeros_like(rows)
    return rows.to(logits.dtype), z_rows.to(logits.dtype), lse


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, check_targets=True,
                         compute_dtype=torch.float32, logits_dtype=None):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)``; see
    ``llmkernels.linear_cross_entropy``. Returns ``(loss, z_loss_part, lse)`` as ``cross_entropy``,
    the first two in float32 (float64 for float64 inputs)."""
    logits = _linear_logits(hidden, weight, bias, 1.0, compute_dtype, logits_dtype)
    loss, z, lse = cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                 label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                 check_targets=check_targets, compute_dtype=compute_dtype)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    return loss.to(out_dtype), z.to(out_dtype), lse


# --------------------------------------------------------------------------------------------
# Gated-MLP activation (SwiGLU, GeGLU)
# --------------------------------------------------------------------------------------------
# The activations of ``llmkernels.glu``, each name with its definition: the one list that the API,
# the kernel (``ops/glu.py:_activation``, a branch each) and the tests go by.
GLU_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,  # SwiGLU
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),  # GeGLU as Gemma computes it
    "gelu": torch.nn.functional.gelu,  # exact, erf
}


def glu_activation(x, activation):
    """``act(x)`` of the activation named ``activation`` (``GLU_ACTIVATIONS``)."""
    return GLU_ACTIVATIONS[activation](x)


def glu(gate, up, activation="silu", *, compute_dtype=torch.float32):
    """``act(gate) * up`` of two tensors of one shape and dtype; see ``llmkernels.glu``.

    ``act(gate)`` is rounded to the inputs' dtype before the product, as Hugging Face's MLPs
    compute it (``act_fn(gate_proj(x)) * up_proj(x)`` in the model's dtype); the product is
    rounded once more. Both roundings vanish for float64 inputs."""
    a = glu_activation(gate.to(compute_dtype), activation).to(gate.dtype).to(compute_dtype)
    return (a * up.to(compute_dtype)).to(gate.dtype)


# --------------------------------------------------------------------------------------------
# Post-training: per-token log-probabilities, entropy, distillation
# --------------------------------------------------------------------------------------------
DISTILL_KINDS = ("jsd", "forward_kl", "reverse_kl")


def _linear_logits(hidden, weight, bias, temperature, compute_dtype, logits_dtype=None):
    """``(hidden @ weight.T + bias) / temperature``; ``logits_dtype``: round the product to it
    first, as the kernels' cuBLAS product is (in value only: the gradient passes straight)."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    if logits_dtype is not None:
        logits = logits + (logits.to(logits_dtype).to(compute_dtype) - logits).detach()
    return logits / temperature


def _target_rows(target, v, ignore_index, check_targets=True):
    """``(valid, in_range)``: rows whose target is not ``ignore_index``, and rows whose target is
    in ``[0, v)``. ``check_targets``: ValueError for a valid row whose target is out of range
    (else that row's outputs and gradient are NaN: :func:`_poisoned`). Under torch.compile the
    check is the custom op ``llmkernels::checked_target_rows``, which the graph keeps (its outputs
    are used) and which raises when the compiled code runs, where a branch on the values could not
    be traced."""
    if check_targets and torch.compiler.is_compiling():
        return checked_target_rows(target, v, ignore_index)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < v)
    if check_targets:
        _raise_bad_target(target, valid & ~in_range, v, ignore_index)
    return valid, in_range


def _raise_bad_target(target, bad, v, ignore_index):
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"target[{row}] = {int(target[row])} is outside [0, {v}) (the vocabulary size) and "
                         f"is not ignore_index ({ignore_index})")


@torch.library.custom_op("llmkernels::checked_target_rows", mutates_args=())
def checked_target_rows(target: torch.Tensor, v: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_target_rows` with the check, as one op for torch.compile."""
    return _target_rows(target, v, ignore_index)


@checked_target_rows.register_fake
def _(target, v, ignore_index):
    return torch.empty_like(target, dtype=torch.bool), torch.empty_like(target, dtype=torch.bool)


def _poisoned(rows, valid, in_range):
    """``rows`` with 0 where not ``valid`` and NaN, value and gradient, where the target is out
    of range (a product, not a ``where``, so that the NaN reaches the gradient too)."""
    return torch.where(valid, rows * torch.where(valid & ~in_range, math.nan, 1.0), 0.0)


def _plogq(p, log_q):
    """``p * log_q`` with 0 where ``p`` is 0 (classes masked to -inf); NaN stays NaN."""
    return torch.where(p == 0, 0.0, p * log_q)


def linear_log_probs(hidden, weight, target, bias=None, *, temperature=1.0, ignore_index=-100, check_targets=True,
                     compute_dtype=torch.float32, logits_dtype=None):
    """Per-token ``log p(target)`` and entropy of ``softmax((hidden @ weight.T + bias) / temperature)``;
    see ``llmkernels.linear_log_probs``. Returns ``(logp [M], entropy [M])`` in float32 (float64
    for float64 inputs), both 0 on rows whose target is ``ignore_index``. ``logits_dtype``: the
    dtype the logits are rounded to (``_linear_logits``; None: not rounded); the op rounds them to
    a 16-bit hidden's dtype unless its own ``logits_dtype`` is torch.float32."""
    z = _linear_logits(hidden, weight, bias, temperature, compute_dtype, logits_dtype)
    valid, in_range = _target_rows(target, z.shape[-1], ignore_index, check_targets)
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, torch.where(valid & in_range, target, 0).long()[:, None])[:, 0]
    entropy = -_plogq(log_p.exp(), log_p).sum(-1)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    return _poisoned(logp, valid, in_range).to(out_dtype), _poisoned(entropy, valid, in_range).to(out_dtype)


def linear_z_loss(hidden, weight, bias=None, *, reduction="mean", compute_dtype=torch.float32, logits_dtype=None):
    """``llmkernels.linear_z_loss``: float32 (float64 for float64 inputs)."""
    rows = torch.logsumexp(_linear_logits(hidden, weight, bias, 1.0, compute_dtype, logits_dtype), -1) ** 2
    rows = rows.mean() if reduction == "mean" else rows.sum() if reduction == "sum" else rows
    return rows.to(torch.promote_types(hidden.dtype, torch.float32))


def distill_divergence(student_log_q, teacher_log_p, *, kind="jsd", beta=0.5):
    """Per-row divergence between the teacher's ``P`` and the student's ``Q`` given as
    log-probabilities ``[M, V]``: ``"forward_kl"`` KL(P || Q), ``"reverse_kl"`` KL(Q || P),
    ``"jsd"`` the generalised Jensen-Shannon divergence ``beta KL(P || M) + (1 - beta) KL(Q || M)``
    with ``M = beta P + (1 - beta) Q`` (Liger's convention for 0 < beta < 1)."""
    p, q = teacher_log_p.exp(), student_log_q.exp()
    if kind == "forward_kl":
        return _plogq(p, teacher_log_p - student_log_q).sum(-1)
    if kind == "reverse_kl":
        return _plogq(q, student_log_q - teacher_log_p).sum(-1)
    log_m = torch.logaddexp(teacher_log_p + math.log(beta), student_log_q + math.log1p(-beta))
    return (beta * _plogq(p, teacher_log_p - log_m).sum(-1)
            + (1.0 - beta) * _plogq(q, student_log_q - log_m).sum(-1))


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, *, kind="jsd",
                        beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean", check_targets=True,
                        compute_dtype=torch.float32, logits_dtypes=(None, None)):
    """Distillation loss between the student's and the teacher's ``softmax(hidden @ weight.T /
    temperature)``; see ``llmkernels.linear_distill_loss``. Rows whose ``target`` is
    ``ignore_index`` contribute 0 (``mean`` divides by the other rows); the target is a mask only
    (``check_targets``: ValueError for one outside ``[0, V)``). ``logits_dtypes``: the dtypes
    the student's and the teacher's logits are rounded to (``_linear_logits``). Float32 (float64
    for float64 inputs)."""
    zs = _linear_logits(student_hidden, student_weight, None, temperature, compute_dtype, logits_dtypes[0])
    zt = _linear_logits(teacher_hidden, teacher_weight, None, temperature, compute_dtype, logits_dtypes[1])
    rows = distill_divergence(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), kind=kind, beta=beta)
    valid = (torch.ones_like(rows, dtype=torch.bool) if target is None
             else _target_rows(target, zs.shape[-1], ignore_index, check_targets)[0])
    rows = torch.where(valid, rows, 0.0)
    if reduction == "mean":
        rows = rows.sum() / valid.sum()
    elif reduction == "sum":
        rows = rows.sum()
    return rows.to(torch.promote_types(student_hidden.dtype, torch.float32))
