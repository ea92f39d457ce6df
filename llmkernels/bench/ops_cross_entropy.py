"""Benchmark registration of cross-entropy: ``loss = cross_entropy(logits [M, V], target [M])``.

bf16 (or the benchmark dtype) logits, int64 targets, ``reduction="mean"``; the backward starts
from an upstream gradient of 1, as ``loss.backward()`` does (``BenchOp.is_loss``: a gradient formed in
the forward needs no further pass then; with any other factor it is scaled in place, two more
``M V e``). Default rows: 32768 / 8192 / 4096 at V = 32000 / 128256 / 262144 (the tokens of a
training micro-batch), 2 GiB of bf16 logits, so that the GPU's time, not the host's, is measured
(smaller cases were host-bound: ``benchmarks/RESULTS.md``). Minimum bytes (``e`` = element size;
the targets and the per-row statistics, negligible at these sizes, are not counted):

  fwd       logits read once:                          M V e
  bwd       logits read, gradient written:             2 M V e
  fwd+bwd   logits read once, gradient written once:   2 M V e

The fwd+bwd bound needs the gradient formed in the forward pass from a single read of the
logits: ``llmkernels_inplace`` (``cross_entropy(..., inplace_backward=True)``) does that, each
row's slices held in registers by the programs sharing it; Liger forms it in the forward too, over
the logits, but re-reads each row. Both overwrite the logits (``Provider.mutates``: checked on
copies, no bwd mode). The default llmkernels path re-reads the logits in the backward (3 M V e),
so that the logits stay intact and the backward can run more than once, as the bwd mode does.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import llmkernels

from .. import reference
from .registry import BenchOp, Provider, compile_static, liger_function, register

DEFAULT_SIZES = (32000, 128256, 262144)
QUICK_SIZES = (32000, 128256)
DECODE_SHAPES = tuple({"M": m, "V": 128256} for m in (1, 32, 256))
SMALL_SHAPES = ({"M": 3, "V": 1000}, {"M": 5, "V": 9000})
EAGER_SHAPES = ({"M": 4096, "V": 32000},)


LOGITS = 2**30  # logits per case by default: 2 GiB in bf16, what the float64 check can hold


def _shape(v: int, rows):
    """The largest power of two of rows with at most 2^30 logits: 32768 / 8192 / 4096 at V =
    32000 / 128256 / 262144."""
    return {"M": rows if rows is not None else 1 << ((LOGITS // v).bit_length() - 1), "V": v}


def _inputs(shape, dtype, device):
    m, v = shape["M"], shape["V"]
    logits = (torch.randn((m, v), device=device) * 2).to(dtype)
    target = torch.randint(0, v, (m,), device=device)
    target[1::97] = -100  # a few ignored rows (not the first: one row alone must count)
    return {"logits": logits, "target": target}


def _min_bytes(shape, dtype, mode):
    n = shape["M"] * shape["V"] * dtype.itemsize
    return n if mode == "fwd" else 2 * n


def _torch_ce(logits, target):
    return F.cross_entropy(logits, target)


def _liger_factory():
    apply = liger_function("cross_entropy", "LigerCrossEntropyFunction")
    # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
    #  return_z_loss, return_token_accuracy, return_predicted_tokens) -> (loss, ...)
    return lambda logits, target: apply(logits, target, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]


register(BenchOp(
    name="cross_entropy", axis="V", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_inputs, grad_inputs=("logits",), outputs=("loss",),
    reference=lambda logits, target: reference.cross_entropy(logits, target, compute_dtype=torch.float64)[0],
    min_bytes=_min_bytes, is_loss=True,
    providers={
        "llmkernels": Provider(lambda: llmkernels.cross_entropy),
        # The default's target check reads a flag from the device: one sync per call, which
        # leaves the GPU idle while the host catches up. This row times the op without it.
        "llmkernels_unchecked": Provider(lambda: functools.partial(llmkernels.cross_entropy, check_targets=False)),
        "llmkernels_inplace": Provider(lambda: functools.partial(llmkernels.cross_entropy, inplace_backward=True),
                                       mutates=True),
        "llmkernels_inplace_unchecked": Provider(lambda: functools.partial(
            llmkernels.cross_entropy, inplace_backward=True, check_targets=False), mutates=True),
        "torch": Provider(lambda: _torch_ce),
        "torch_compile": Provider(lambda: compile_static(_torch_ce)),
        "liger": Provider(_liger_factory, gpu_only=True, mutates=True),
    },
))
