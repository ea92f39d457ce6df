"""Benchmark registration of ``qk_norm_rope``: each head's RMSNorm of q and k, then RoPE.

RoPE's bench shapes (Qwen3-8B's heads too: Hq = 32, Hk = 8, D = 128), in ``[B, S, H, D]`` as the projections give
them (Qwen3 normalises before it transposes); the sweep is over the sequence length S with
``B = 2^15 / S`` (q is 2^27 elements, 256 MiB in bf16). The norms' weights ``[D]`` and cos/sin
``[1, S, D]`` in the benchmark dtype. Minimum bytes: fwd reads q and k and writes their outputs;
bwd reads the outputs' gradients and q and k again (the norm's backward needs them) and writes
their gradients (the per-row statistics, weights and tables are under 1% and not counted).
Providers: the fused op; the library's two ops in turn (``rms_norm`` then ``apply_rope``); Qwen3's
eager formulas (``Qwen3RMSNorm``: the normalised rows rounded to q's dtype before the weight,
then ``apply_rotary_pos_emb``); torch.compile of those.
"""
from __future__ import annotations

import torch

import llmkernels

from .. import reference
from .ops_rope import (DECODE_SHAPES, DEFAULT_SIZES, EAGER_SHAPES, QUICK_SIZES, SMALL_SHAPES, heads_shape,
                       rope_inputs)
from .registry import BenchOp, Provider, compile_static, register

EPS = 1e-6
_ROPE_INPUTS = rope_inputs("bshd")


def _inputs(shape, dtype, device):
    """RoPE's bench inputs in ``[B, S, H, D]`` and the two norms' weights ``[D]``."""
    d = shape["D"]
    return {**_ROPE_INPUTS(shape, dtype, device),
            "q_weight": (1 + 0.2 * torch.randn(d, device=device)).to(dtype),
            "k_weight": (1 + 0.2 * torch.randn(d, device=device)).to(dtype)}


def _min_bytes(shape, dtype, mode):
    one = shape["B"] * shape["S"] * (shape["Hq"] + shape["Hk"]) * shape["D"] * dtype.itemsize
    return {"fwd": 2 * one, "bwd": 3 * one, "fwd+bwd": 5 * one}[mode]


def _fused():
    return lambda **a: llmkernels.qk_norm_rope(**a, eps=EPS, layout="bshd")


def _two_ops():
    def run(q, k, q_weight, k_weight, cos, sin):
        return llmkernels.apply_rope(llmkernels.rms_norm(q, q_weight, eps=EPS), llmkernels.rms_norm(k, k_weight, eps=EPS),
                                     cos, sin, layout="bshd")
    return run


def _qwen3_norm(x, weight):
    """transformers' ``Qwen3RMSNorm.forward``."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x32.to(x.dtype)


def _hf_eager():
    def run(q, k, q_weight, k_weight, cos, sin):
        return reference.hf_apply_rotary_pos_emb(_qwen3_norm(q, q_weight), _qwen3_norm(k, k_weight), cos, sin,
                                                 unsqueeze_dim=2)
    return run


register(BenchOp(
    name="qk_norm_rope", axis="S", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=heads_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES, make_inputs=_inputs,
    grad_inputs=("q", "k", "q_weight", "k_weight"), outputs=("q_out", "k_out"),
    reference=lambda **a: reference.qk_norm_rope(**a, eps=EPS, layout="bshd", compute_dtype=torch.float64),
    min_bytes=_min_bytes, providers={
        "llmkernels": Provider(_fused),
        "llmkernels_two_ops": Provider(_two_ops),
        "hf_eager": Provider(_hf_eager),
        "torch_compile": Provider(lambda: compile_static(_hf_eager())),
    },
))
