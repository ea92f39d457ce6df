"""The public API (``rms_norm``, ``layer_norm``) and its registration: eager autograd and the
torch.compile custom ops ``llmkernels::norm_fwd`` / ``norm_bwd``."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ... import reference
from .._args import as_rows, check_tensor
from .._launch import reference_dtype
from .._register import Op
from .configs import NormConfig, check_config
from .launchers import NormOptions, NormOutputs, norm_bwd, norm_fwd


def _norm_fwd_saving(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     residual: Optional[torch.Tensor], options: NormOptions, *, share_dres: bool = False,
                     config: Optional[NormConfig] = None) -> NormOutputs:
    """The forward of a call that records an autograd node: the statistics are kept for the
    backward. (``share_dres``, an option of the call, is for the backward: see ``_norm_setup``.)"""
    return norm_fwd(x, weight, bias, residual, options, store_stats=True,
                    config=None if config is None else config.forward)


def _norm_fwd_inference(x, weight, bias, residual, options: NormOptions, *, share_dres: bool = False,
                        config: Optional[NormConfig] = None):
    """The forward of a call that needs no gradient: no statistics."""
    return norm_fwd(x, weight, bias, residual, options, store_stats=False,
                    config=None if config is None else config.forward)


def _norm_fwd_fake(x, weight, bias, residual, options: NormOptions):
    m, n = x.shape
    h = x.new_empty((m, n), dtype=options.h_dtype) if residual is not None else None
    mean = None if options.is_rms else x.new_empty(m, dtype=torch.float32)
    return x.new_empty((m, n), dtype=options.out_dtype), h, mean, x.new_empty(m, dtype=torch.float32)


def _norm_bwd_fake(dy, dh, xin, weight, mean, rstd, options: NormOptions):
    m, n = xin.shape
    return (xin.new_empty((m, n), dtype=options.x_dtype),
            None if options.res_dtype is None else xin.new_empty((m, n), dtype=options.res_dtype),
            None if weight is None else weight.new_empty(weight.shape),
            None if options.bias_dtype is None else xin.new_empty(options.heads * n, dtype=options.bias_dtype))


def _norm_setup(ctx, inputs, options: NormOptions, outputs, *, share_dres: bool = False,
                config: Optional[NormConfig] = None):
    """``share_dres`` (eager only): dx may double as dresidual, a write less (custom ops may not
    return aliases). ``config`` (eager only): the backward's launch configuration."""
    x, weight, bias, residual = inputs
    y, h, mean, rstd = outputs
    ctx.save_for_backward(x if residual is None else h, weight, None if options.is_rms else mean, rstd)
    ctx.options, ctx.bias_shape = options, None if bias is None else bias.shape
    ctx.share_dres = share_dres
    ctx.backward_config = None if config is None else config.backward


def _norm_backward(ctx, bwd, dy, dh, *_):
    xin, weight, mean, rstd = ctx.saved_tensors
    options = ctx.options
    residual = options.res_dtype is not None
    n = xin.shape[1]
    dx, dres, dw, db = bwd(as_rows(dy, n), as_rows(dh, n) if residual and dh is not None else None, xin, weight,
                           mean, rstd, options, share_dres=ctx.share_dres, config=ctx.backward_config)
    if ctx.bias_shape is None:  # (under torch.compile, a placeholder)
        db = None
    elif len(ctx.bias_shape) > 1:  # a per-head bias [H, D]
        db = db.view(ctx.bias_shape)
    return dx, dw if weight is not None else None, db, dres if residual else None


NORM = Op("norm", forward=_norm_fwd_saving, infer=_norm_fwd_inference, setup=_norm_setup,
          backward=_norm_backward, grad_inputs=(0, 1, 2, 3), returns=2, fake=_norm_fwd_fake,
          backward_launcher=norm_bwd, backward_fake=_norm_bwd_fake)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _check_norm_args(x, weight, bias, residual, eps, casting) -> int:
    """Validate; return the number of heads (1 unless weight is per-head ``[H, D]``)."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one)")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x's last dimension (the normalized one) is empty")
    if casting not in reference.NORM_CASTINGS:
        raise ValueError(f"casting must be one of {reference.NORM_CASTINGS}, got {casting!r}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    heads = 1
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(name, p, like=x)
        if p.dim() == 1 and p.shape[0] == n:
            continue
        if p.dim() == 2 and x.dim() >= 2 and tuple(p.shape) == tuple(x.shape[-2:]):
            heads = p.shape[0]
            continue
        raise ValueError(f"{name} must have shape [{n}] (x's last dim) or [H, D] = x's last two dims "
                         f"{list(x.shape[-2:])} for per-head norm; got {list(p.shape)}")
    if weight is not None and bias is not None and weight.shape != bias.shape:
        raise ValueError(f"bias shape {list(bias.shape)} must match weight shape {list(weight.shape)}")
    if residual is not None:
        check_tensor("residual", residual, like=x)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {list(residual.shape)} must equal x's shape {list(x.shape)}")
    return heads


def _check_config(config, n: int) -> None:
    """``config=``: a NormConfig whose records can launch rows of ``n`` (TypeError / ValueError)."""
    if not isinstance(config, NormConfig):
        raise TypeError(f"config must be a NormConfig, got {type(config).__name__}")
    for backward, name, part in ((False, "config.forward", config.forward), (True, "config.backward", config.backward)):
        if part is not None:
            check_config(part, n, backward, name)


def _norm(x, weight, bias, residual, *, is_rms, eps, prenorm, residual_in_fp32, weight_offset, casting, out_dtype,
          config):
    heads = _check_norm_args(x, weight, bias, residual, eps, casting)
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be None or a floating-point torch.dtype, got {out_dtype!r}")
    if config is not None:
        _check_config(config, x.shape[-1])
    compute = reference_dtype(x)
    if compute is not None:
        fn = reference.rms_norm if is_rms else reference.layer_norm
        return fn(x, weight, bias, eps=eps, residual=residual, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                  weight_offset=weight_offset, casting=casting, out_dtype=out_dtype, compute_dtype=compute)
    weight_offset, out_dtype, h_dtype = reference.resolve_norm_dtypes(
        x, weight, residual, casting=casting, weight_offset=weight_offset, out_dtype=out_dtype,
        residual_in_fp32=residual_in_fp32)
    shape, n = x.shape, x.shape[-1]
    # Per-head weights are indexed by row % H, so they need contiguous [H, D] rows.
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    options = NormOptions(is_rms, casting == "llama", heads, float(eps), weight_offset, out_dtype, h_dtype, x.dtype,
                          None if residual is None else residual.dtype, None if bias is None else bias.dtype)
    # dx can double as dresidual unless x or residual is a leaf (their .grad would alias).
    y, h = NORM(as_rows(x, n), weight, bias, None if residual is None else as_rows(residual, n), options,
                share_dres=residual is not None and not (x.is_leaf or residual.is_leaf), config=config)
    h = h if residual is not None else None  # (under torch.compile, a placeholder)
    if y.dim() != len(shape):
        y = y.view(shape)
    if not prenorm:
        return y
    if h is None:
        h = x.to(torch.float32) if residual_in_fp32 else x
    else:
        h = h.view(shape)
    return y, h


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
             eps: float = 1e-6, residual: Optional[torch.Tensor] = None, prenorm: bool = False,
             residual_in_fp32: bool = False, weight_offset: Optional[float] = None, casting: str = "llama",
             out_dtype: Optional[torch.dtype] = None, config: Optional[NormConfig] = None):
    """RMSNorm over the last dimension, with an optional fused residual add.

    ``y = q(x_hat) * (weight + weight_offset) + bias`` with ``x_hat = h / sqrt(mean(h^2) + eps)``
    and ``h = x`` or ``h = x + residual``.

    Args:
        x: ``[..., N]`` float32/bfloat16/float16 (float64 runs the reference). Rows may be
            strided (a slice of a bigger tensor) as long as the last dim has unit stride.
        weight: ``[N]``, or ``[H, D]`` for a per-head (QK) norm over ``x [..., H, D]``; any
            float dtype (fp32 master weights with bf16 activations is fine). ``None``: no scale.
        bias: same shape as weight (or ``[N]``); optional.
        eps: added to the mean square, >= 0.
        residual: same shape as x; ``h = x + residual`` is normalized instead of x.
        prenorm: return ``(y, h)``: the pre-norm transformer block's next residual stream.
        residual_in_fp32: keep ``h`` in float32 (else the wider of x's and residual's dtype).
        weight_offset: added to weight (Gemma's ``1 + weight``); default 1.0 for
            ``casting="gemma"``, else 0.0.
        casting: ``"llama"`` (HF LlamaRMSNorm exactly: ``weight * x_hat.to(input_dtype)``),
            ``"gemma"`` (``x_hat * (1 + weight)`` in fp32, one cast) or ``"none"`` (fp32
            throughout, one final cast).
        out_dtype: dtype of y; default as the matching HF module returns it (llama: the wider of
            weight and input dtype; otherwise the input dtype).
        config: the kernels' launch configuration (a ``NormConfig``; its None fields, and
            every field by default, as the tables choose): for tests and tuning, eager calls
            only (torch.compile drops it).

    Returns:
        ``y [..., N]``, or ``(y, h)`` when ``prenorm``. Differentiable in x, weight, bias and
        residual.
    """
    return _norm(x, weight, bias, residual, is_rms=True, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting, out_dtype=out_dtype,
                 config=config)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
               eps: float = 1e-5, residual: Optional[torch.Tensor] = None, prenorm: bool = False,
               residual_in_fp32: bool = False, weight_offset: Optional[float] = None, casting: str = "none",
               out_dtype: Optional[torch.dtype] = None, config: Optional[NormConfig] = None):
    """LayerNorm over the last dimension, with an optional fused residual add.

    ``y = x_hat * (weight + weight_offset) + bias``, ``x_hat = (h - mean(h)) / sqrt(var(h) + eps)``.
    Arguments and shapes as ``rms_norm``; the default ``casting="none"`` matches
    ``torch.nn.functional.layer_norm`` (fp32 arithmetic, one final cast to x's dtype).
    """
    return _norm(x, weight, bias, residual, is_rms=False, eps=eps, prenorm=prenorm,
                 residual_in_fp32=residual_in_fp32, weight_offset=weight_offset, casting=casting, out_dtype=out_dtype,
                 config=config)
