"""Benchmark registrations of the normalization family: rmsnorm, layernorm, add_rmsnorm.

Inputs are ``x [M, N]`` (and ``residual [M, N]``) in the benchmark dtype, with ``weight [N]`` (and
``bias [N]``) in the same dtype, as in a bf16 model. Default rows ``M = 2^27 / N``: 256 MiB per
bf16 tensor. Minimum bytes count each tensor once (``e`` = element size):

=============  ====================================  ========================================
op             fwd                                   bwd
=============  ====================================  ========================================
rmsnorm        x, w read; y written                  x, dy, w read; dx, dw written
layernorm      x, w, b read; y written               x, dy, w read; dx, dw, db written
add_rmsnorm    x, residual, w read; y, h written     h, dy, dh, w read; dx, dw written
=============  ====================================  ========================================

``fwd+bwd`` counts both. add_rmsnorm (prenorm: ``h = x + residual``, ``y = rmsnorm(h)``, both
returned) writes one gradient for x and residual: they are the same tensor when the dtypes match
and neither is an autograd leaf. In a model they come out of earlier layers, so the bench passes
views of its leaves (``BenchOp.inputs_from_graph``), for every provider alike.
Per-row statistics (rstd, mean: 4 bytes a row) are not counted.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import llmkernels

from .. import reference
from .registry import BenchOp, Provider, Unavailable, compile_static, liger_function, need_module, register

RMS_EPS = 1e-6
LN_EPS = 1e-5
DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_SIZES = (1024, 8192, 65536)
DECODE_SHAPES = tuple({"M": m, "N": 4096} for m in (1, 8, 32, 128, 256))
SMALL_SHAPES = ({"M": 4, "N": 256}, {"M": 3, "N": 1000})
EAGER_SHAPES = ({"M": 4096, "N": 4096},)


def _shape(n: int, rows):
    return {"M": rows if rows is not None else max(1, 2**27 // n), "N": n}


def _randn(shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale + shift).to(dtype)


def _bytes(fwd: tuple, bwd: tuple):
    """min_bytes from ``(tensors, vectors)`` per mode: how many ``[M, N]`` tensors and ``[N]``
    vectors the mode reads or writes, each once."""
    def count(shape, dtype, mode):
        m, n = shape["M"], shape["N"]
        per_mode = {p: (big * m * n + vec * n) * dtype.itemsize for p, (big, vec) in (("fwd", fwd), ("bwd", bwd))}
        return per_mode["fwd"] + per_mode["bwd"] if mode == "fwd+bwd" else per_mode[mode]
    return count


def _quack():
    return need_module("quack.rmsnorm", "quack-kernels (quack)").rmsnorm


# --------------------------------------------------------------------------------------------
# rmsnorm
# --------------------------------------------------------------------------------------------
def _rms_inputs(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    return {"x": _randn((m, n), dtype, device), "weight": _randn((n,), dtype, device, 0.5, 1.0)}


def _rms_hf(x, weight):
    """Hugging Face ``LlamaRMSNorm.forward``, op for op: fp32 statistics, ``weight * x_hat.to(dtype)``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return weight * h.to(x.dtype)


def _rms_ref(x, weight):
    """The definition (``llmkernels.reference``, fp32 arithmetic), for torch.compile."""
    return reference.rms_norm(x, weight, eps=RMS_EPS, casting="llama")


def _torch_rms(x, weight):
    return F.rms_norm(x, x.shape[-1:], weight, RMS_EPS)


def _torch_rms_factory():
    if not hasattr(F, "rms_norm"):
        raise Unavailable(f"torch {torch.__version__} has no F.rms_norm (torch >= 2.4)")
    return _torch_rms


def _torch_fused_rms_factory():
    """PyTorch's fused RMSNorm kernel (``aten._fused_rms_norm``, the one ``F.rms_norm`` takes on
    CUDA where it applies), called directly so that its kernel is timed whatever the dispatch."""
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is None:
        raise Unavailable(f"torch {torch.__version__} has no aten._fused_rms_norm")
    return lambda x, weight: fused(x, [x.shape[-1]], weight, RMS_EPS)[0]


def _liger_rms_factory():
    apply = liger_function("rms_norm", "LigerRMSNormFunction")
    # in_place=False: keep dy intact across the repeated timed backward calls (same bytes moved).
    return lambda x, weight: apply(x, weight, RMS_EPS, 0.0, "llama", False)


def _quack_rms_factory():
    rmsnorm = _quack()
    return lambda x, weight: rmsnorm(x, weight, eps=RMS_EPS)


register(BenchOp(
    name="rmsnorm", axis="N", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_rms_inputs, grad_inputs=("x", "weight"), outputs=("y",),
    reference=lambda x, weight: reference.rms_norm(x, weight, eps=RMS_EPS, compute_dtype=torch.float64),
    min_bytes=_bytes(fwd=(2, 1), bwd=(3, 2)),
    providers={
        "llmkernels": Provider(lambda: functools.partial(llmkernels.rms_norm, eps=RMS_EPS)),
        "torch": Provider(_torch_rms_factory),
        "torch_fused": Provider(_torch_fused_rms_factory),
        "hf_eager": Provider(lambda: _rms_hf),
        "torch_compile": Provider(lambda: compile_static(_rms_ref)),
        "liger": Provider(_liger_rms_factory, gpu_only=True),
        "quack": Provider(_quack_rms_factory, gpu_only=True),
    },
))


# --------------------------------------------------------------------------------------------
# layernorm
# --------------------------------------------------------------------------------------------
def _ln_inputs(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    # A non-zero mean, so the centering matters.
    return {"x": _randn((m, n), dtype, device, 1.0, 0.5), "weight": _randn((n,), dtype, device, 0.5, 1.0),
            "bias": _randn((n,), dtype, device, 0.5)}


def _ln_eager(x, weight, bias):
    """LayerNorm written out in PyTorch: fp32 arithmetic, one final cast."""
    return reference.layer_norm(x, weight, bias, eps=LN_EPS)


def _liger_ln_factory():
    apply = liger_function("layer_norm", "LigerLayerNormFunction")
    return lambda x, weight, bias: apply(x, weight, bias, LN_EPS)


register(BenchOp(
    name="layernorm", axis="N", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_ln_inputs, grad_inputs=("x", "weight", "bias"), outputs=("y",),
    reference=lambda x, weight, bias: reference.layer_norm(x, weight, bias, eps=LN_EPS,
                                                           compute_dtype=torch.float64),
    min_bytes=_bytes(fwd=(2, 2), bwd=(3, 3)),
    providers={
        "llmkernels": Provider(lambda: functools.partial(llmkernels.layer_norm, eps=LN_EPS)),
        "torch": Provider(lambda: lambda x, weight, bias: F.layer_norm(x, x.shape[-1:], weight, bias, LN_EPS)),
        "hf_eager": Provider(lambda: _ln_eager),
        "torch_compile": Provider(lambda: compile_static(_ln_eager)),
        "liger": Provider(_liger_ln_factory, gpu_only=True),
    },
))


# --------------------------------------------------------------------------------------------
# add_rmsnorm: h = x + residual; y = rmsnorm(h); returns (y, h) (pre-norm block)
# --------------------------------------------------------------------------------------------
def _add_rms_inputs(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    return {"x": _randn((m, n), dtype, device), "residual": _randn((m, n), dtype, device),
            "weight": _randn((n,), dtype, device, 0.5, 1.0)}


def _add_rms_hf(x, residual, weight):
    """The HF decoder layer's ``residual + hidden_states``, then ``LlamaRMSNorm``: unfused."""
    h = x + residual
    return _rms_hf(h, weight), h


def _add_rms_ref(x, residual, weight):
    return reference.rms_norm(x, weight, eps=RMS_EPS, residual=residual, prenorm=True, casting="llama")


def _torch_add_rms_factory():
    rms = _torch_rms_factory()

    def add_rms(x, residual, weight):
        h = x + residual
        return rms(h, weight), h
    return add_rms


def _liger_add_rms_factory():
    apply = liger_function("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    return lambda x, residual, weight: apply(x, residual, weight, RMS_EPS, 0.0, "llama", False)


def _quack_add_rms_factory():
    rmsnorm = _quack()
    return lambda x, residual, weight: rmsnorm(x, weight, residual=residual, eps=RMS_EPS, prenorm=True)


register(BenchOp(
    name="add_rmsnorm", axis="N", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_add_rms_inputs, grad_inputs=("x", "residual", "weight"), outputs=("y", "h"),
    reference=lambda x, residual, weight: reference.rms_norm(
        x, weight, eps=RMS_EPS, residual=residual, prenorm=True, compute_dtype=torch.float64),
    min_bytes=_bytes(fwd=(4, 1), bwd=(4, 2)), inputs_from_graph=True,
    providers={
        "llmkernels": Provider(lambda: functools.partial(llmkernels.rms_norm, eps=RMS_EPS, prenorm=True)),
        "torch": Provider(_torch_add_rms_factory),
        "hf_eager": Provider(lambda: _add_rms_hf),
        "torch_compile": Provider(lambda: compile_static(_add_rms_ref)),
        "liger": Provider(_liger_add_rms_factory, gpu_only=True),
        "quack": Provider(_quack_add_rms_factory, gpu_only=True),
    },
))
