"""Benchmark registrations of the gated-MLP activation: ``swiglu`` (``silu(gate) * up``) and
``geglu`` (``gelu(gate, approximate="tanh") * up``, Gemma's).

Inputs are ``gate, up [M, I]`` in the benchmark dtype; the sweep is over the intermediate size I
with ``M = 2^27 / I`` rows (256 MiB per bf16 tensor). Minimum bytes (``e`` = element size):
fwd reads gate and up and writes y (3 M I e); bwd reads gate, up and dy and writes d_gate and
d_up (5 M I e); fwd+bwd counts both (8 M I e). Providers: llmkernels; torch eager as Hugging
Face's MLP computes it (``act(gate) * up``, two kernels; its backward also reads the saved
``act(gate)``); torch.compile of the reference; Liger's ``LigerSiLUMulFunction`` /
``LigerGELUMulFunction``. Liger writes its gradients over the saved gate and up, which here are
the benchmark's inputs, so it is handed copies when gradients are wanted: its fwd and bwd times
are its own, its fwd+bwd time includes the two copies (4 M I e more).
"""
from __future__ import annotations

import functools

import torch

import llmkernels

from .. import reference
from .registry import BenchOp, Provider, compile_static, liger_function, register

DEFAULT_SIZES = (4096, 8192, 14336, 28672)
QUICK_SIZES = (4096, 14336)
DECODE_SHAPES = tuple({"M": m, "I": 14336} for m in (1, 8, 32, 128, 256))
SMALL_SHAPES = ({"M": 4, "I": 256}, {"M": 3, "I": 1000})
EAGER_SHAPES = ({"M": 4096, "I": 14336},)


def _shape(i: int, rows):
    return {"M": rows if rows is not None else max(1, 2**27 // i), "I": i}


def _inputs(shape, dtype, device):
    m, i = shape["M"], shape["I"]
    return {"gate": torch.randn((m, i), device=device).to(dtype), "up": torch.randn((m, i), device=device).to(dtype)}


def _min_bytes(shape, dtype, mode):
    units = {"fwd": 3, "bwd": 5, "fwd+bwd": 8}[mode]
    return units * shape["M"] * shape["I"] * dtype.itemsize


def _liger(name: str):
    apply = liger_function(*name)

    def fn(gate, up):
        if gate.requires_grad or up.requires_grad:
            gate, up = gate.clone(), up.clone()
        return apply(gate, up)
    return fn


for _name, _activation, _liger_name in (("swiglu", "silu", ("swiglu", "LigerSiLUMulFunction")),
                                        ("geglu", "gelu_tanh", ("geglu", "LigerGELUMulFunction"))):
    register(BenchOp(
        name=_name, axis="I", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
        decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES,
        make_inputs=_inputs, grad_inputs=("gate", "up"), outputs=("y",),
        reference=functools.partial(reference.glu, activation=_activation, compute_dtype=torch.float64),
        min_bytes=_min_bytes,
        providers={
            "llmkernels": Provider(lambda a=_activation: functools.partial(llmkernels.glu, activation=a)),
            "torch": Provider(lambda a=_activation: lambda gate, up: reference.glu_activation(gate, a) * up),
            "torch_compile": Provider(lambda a=_activation: compile_static(
                functools.partial(reference.glu, activation=a))),
            "liger": Provider(lambda n=_liger_name: _liger(n), gpu_only=True),
        },
    ))
