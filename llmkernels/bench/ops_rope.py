"""Benchmark registrations of RoPE: ``rope`` (q/k ``[B, H, S, D]``, Hugging Face's layout) and
``rope_bshd`` (``[B, S, H, D]``).

Llama-like heads: Hq = 32, Hk = 8 (GQA), D = 128; the sweep is over the sequence length S with
``B = 2^15 / S`` (q is 2^27 elements, 256 MiB in bf16). cos/sin are ``[1, S, D]`` in the
benchmark dtype, as Hugging Face's rotary embedding returns them. Minimum bytes: q and k read
once and written once (fwd: q, k in, q_out, k_out out; bwd: dq_out, dk_out in, dq, dk out);
cos/sin (2 S D elements, under 1% of that at these sizes) are not counted: they stay in L2.
Liger runs on ``rope`` only: it takes ``[B, H, S, D]``, and with transposed ``[B, S, H, D]``
views it would rotate the inputs in place.
"""
from __future__ import annotations

import functools

import torch

import llmkernels

from .. import reference
from .registry import BenchOp, Provider, compile_static, need_module, register

HQ, HK, D = 32, 8, 128
DEFAULT_SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (1024, 4096)
DECODE_SHAPES = tuple({"M": b, "B": b, "Hq": HQ, "Hk": HK, "S": 1, "D": D} for b in (1, 8, 32, 128, 256))
SMALL_SHAPES = ({"B": 2, "Hq": 4, "Hk": 2, "S": 8, "D": 64}, {"B": 1, "Hq": 3, "Hk": 1, "S": 5, "D": 96})
EAGER_SHAPES = ({"M": 4096, "B": 1, "Hq": HQ, "Hk": HK, "S": 4096, "D": D},)


def heads_shape(s: int, rows):
    """Llama-like heads at sequence length ``s``, ``B = 2^15 / s`` sequences (or ``rows``)."""
    return {"B": rows if rows is not None else max(1, 2**15 // s), "Hq": HQ, "Hk": HK, "S": s, "D": D}


def rope_inputs(layout):
    """``make(shape, dtype, device)``: random q and k in ``layout``, Llama's cos/sin ``[1, S, D]``."""
    def make(shape, dtype, device):
        b, s, d = shape["B"], shape["S"], shape["D"]

        def heads(h):
            size = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
            return torch.randn(size, device=device).to(dtype)

        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)[None]
        return {"q": heads(shape["Hq"]), "k": heads(shape["Hk"]), "cos": angles.cos().to(dtype),
                "sin": angles.sin().to(dtype)}
    return make


def _min_bytes(shape, dtype, mode):
    one = 2 * shape["B"] * shape["S"] * (shape["Hq"] + shape["Hk"]) * shape["D"] * dtype.itemsize
    return 2 * one if mode == "fwd+bwd" else one


def _hf(layout):
    """transformers' Llama apply_rotary_pos_emb (the same formula from reference.py without it)."""
    unsqueeze_dim = 1 if layout == "bhsd" else 2
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    except ImportError:
        fn = reference.hf_apply_rotary_pos_emb
    return lambda q, k, cos, sin: fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _liger():
    return need_module("liger_kernel.transformers.rope", "liger-kernel").liger_rotary_pos_emb


for _name, _layout in (("rope", "bhsd"), ("rope_bshd", "bshd")):
    _providers = {
        "llmkernels": Provider(lambda layout=_layout: functools.partial(llmkernels.apply_rope, layout=layout)),
        "hf_eager": Provider(lambda layout=_layout: _hf(layout)),
        "torch_compile": Provider(lambda layout=_layout: compile_static(_hf(layout))),
    }
    if _layout == "bhsd":
        _providers["liger"] = Provider(_liger, gpu_only=True)
    register(BenchOp(
        name=_name, axis="S", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=heads_shape,
        decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
        make_inputs=rope_inputs(_layout), grad_inputs=("q", "k"), outputs=("q_out", "k_out"),
        reference=functools.partial(reference.apply_rope, layout=_layout, compute_dtype=torch.float64),
        min_bytes=_min_bytes, providers=_providers,
    ))
