"""Benchmark registrations of the losses with the LM head fused in: ``linear_cross_entropy``
(``cross_entropy(hidden @ weight.T, target)``), ``linear_log_probs`` (per-token ``log p(target)``
and entropy, the policy side of GRPO / PPO / DPO) and ``linear_distill`` (the JSD between a
student's and a teacher's head distributions).

Inputs are ``hidden [M, H]`` and ``weight [V, H]`` in the benchmark dtype and ``target [M]``
(a few rows ``ignore_index``); distillation adds the teacher's ``hidden [M, H]`` and
``weight [V, H]``, which get no gradient. The sweep is over the vocabulary V at M = 16384 tokens
and H = 4096, the end-to-end benchmark's head. These ops are bound by their matmuls
(``2 M V H`` multiply-adds forward, twice that backward), not by memory: the time is the figure to
compare; GB/s from the minimum bytes (each input read once, each gradient written once; the
``[M, V]`` logits never exist) is low by design. The torch peers form the logits. llmkernels'
losses form their gradients in the forward (``Provider.single_backward``: no bwd mode).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import llmkernels

from .. import reference
from .registry import BenchOp, Provider, Unavailable, compile_static, register

H = 4096
ROWS = 16384
DEFAULT_SIZES = (32000, 128256, 262144)
QUICK_SIZES = (32000, 128256)
DECODE_SHAPES = tuple({"M": m, "H": H, "V": 128256} for m in (1, 32, 256))
SMALL_SHAPES = ({"M": 5, "H": 32, "V": 300}, {"M": 3, "H": 48, "V": 1000})
EAGER_SHAPES = ({"M": 4096, "H": H, "V": 32000},)


def _shape(v: int, rows):
    return {"M": ROWS if rows is None else rows, "H": H, "V": v}


def _head(shape, dtype, device, prefix=""):
    """``{prefix}hidden [M, H]`` and ``{prefix}weight [V, H]``, scaled so that the logits are
    O(1) (softmax neither flat nor one-hot)."""
    m, h, v = shape["M"], shape["H"], shape["V"]
    return {f"{prefix}hidden": torch.randn((m, h), device=device).to(dtype),
            f"{prefix}weight": (torch.randn((v, h), device=device) * h**-0.5).to(dtype)}


def _target(shape, device):
    target = torch.randint(0, shape["V"], (shape["M"],), device=device)
    target[1::7] = -100  # a few ignored rows (not the first: one row alone must count)
    return target


def _inputs(shape, dtype, device):
    return {**_head(shape, dtype, device), "target": _target(shape, device)}


def _distill_inputs(shape, dtype, device):
    return {**_head(shape, dtype, device, "student_"), **_head(shape, dtype, device, "teacher_"),
            "target": _target(shape, device)}


def _bytes(heads: int):
    """min_bytes: fwd reads each of the ``heads`` (hidden, weight) pairs once; bwd and fwd+bwd
    also write the gradients of the first pair (the targets and [M] vectors are not counted)."""
    def count(shape, dtype, mode):
        pair = (shape["M"] + shape["V"]) * shape["H"] * dtype.itemsize
        return heads * pair + (0 if mode == "fwd" else pair)
    return count


# --------------------------------------------------------------------------------------------
# linear_cross_entropy
# --------------------------------------------------------------------------------------------
def _torch_lce(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def _torch_native_lce_factory():
    """PyTorch's own chunked ``F.linear_cross_entropy`` (torch >= 2.13), its options at their
    defaults ("auto" chunking and accumulation)."""
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or not hasattr(F, "linear_cross_entropy"):
        raise Unavailable(f"torch {torch.__version__} has no chunked F.linear_cross_entropy (torch >= 2.13)")
    return lambda hidden, weight, target: F.linear_cross_entropy(hidden, weight, target, options=options())


register(BenchOp(
    name="linear_cross_entropy", axis="V", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_inputs, grad_inputs=("hidden", "weight"), outputs=("loss",),
    reference=lambda hidden, weight, target: reference.linear_cross_entropy(
        hidden, weight, target, compute_dtype=torch.float64)[0],
    min_bytes=_bytes(1), is_loss=True,
    providers={
        "llmkernels": Provider(lambda: llmkernels.linear_cross_entropy, single_backward=True),
        "llmkernels_low_memory": Provider(lambda: functools.partial(llmkernels.linear_cross_entropy, memory="low"),
                                          single_backward=True),
        "torch": Provider(lambda: _torch_lce),
        "torch_native": Provider(_torch_native_lce_factory, single_backward=True),
        "torch_compile": Provider(lambda: compile_static(_torch_lce)),
    },
))


# --------------------------------------------------------------------------------------------
# linear_log_probs
# --------------------------------------------------------------------------------------------
def _torch_log_probs(hidden, weight, target):
    log_p = torch.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    valid = target != -100
    logp = log_p.gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


register(BenchOp(
    name="linear_log_probs", axis="V", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_inputs, grad_inputs=("hidden", "weight"), outputs=("logp", "entropy"),
    reference=functools.partial(reference.linear_log_probs, compute_dtype=torch.float64),
    min_bytes=_bytes(1),
    providers={
        "llmkernels": Provider(lambda: functools.partial(llmkernels.linear_log_probs, return_entropy=True)),
        "torch": Provider(lambda: _torch_log_probs),
        "torch_compile": Provider(lambda: compile_static(_torch_log_probs)),
    },
))


# --------------------------------------------------------------------------------------------
# linear_distill (JSD, beta = 0.5)
# --------------------------------------------------------------------------------------------
def _torch_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target):
    log_q = torch.log_softmax(F.linear(student_hidden, student_weight).float(), dim=-1)
    log_p = torch.log_softmax(F.linear(teacher_hidden, teacher_weight).float(), dim=-1)
    rows = reference.distill_divergence(log_q, log_p, kind="jsd")
    valid = target != -100
    return torch.where(valid, rows, 0.0).sum() / valid.sum()


register(BenchOp(
    name="linear_distill", axis="V", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
    make_inputs=_distill_inputs, grad_inputs=("student_hidden", "student_weight"), outputs=("loss",),
    reference=functools.partial(reference.linear_distill_loss, compute_dtype=torch.float64),
    min_bytes=_bytes(2), is_loss=True,
    providers={
        "llmkernels": Provider(lambda: llmkernels.linear_distill_loss, single_backward=True),
        "torch": Provider(lambda: _torch_jsd),
        "torch_compile": Provider(lambda: compile_static(_torch_jsd)),
    },
))
