"""Benchmark registration of the routed experts, ``moe_experts`` (one MoE layer's experts, the
routing given), and its peers, also used by ``benchmarks/moe_bench.py``.

Inputs (Qwen3-30B-A3B's layer by default, E 128, top-8, H 2048, I 768, over T tokens):
``x [T, H]``, ``top_k_index [T, k]`` (each token's k best of random router logits, so experts get
unequal shares), ``top_k_weights [T, k]`` (renormalized softmax), ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` in transformers' layout; the shapes' ``M`` is T, the rows of x. A grouped GEMM is compute bound: the figure of
merit is TFLOP/s of the routed FLOPs (``routed_flops``); ``min_bytes`` (each input read once, the
output written once) is there for the runner's GB/s column.

Providers: llmkernels; transformers' experts as Qwen 3 MoE builds them, its eager loop over the
experts (``hf_eager``) and its grouped-mm backend (``hf_grouped_mm``, transformers' default);
``torch_grouped_mm``: ``F.grouped_mm`` (or ``torch._grouped_mm``) with the permutation in
PyTorch; Liger's ``LigerFusedMoEFunction``; SonicMoE's ``moe_general_routing_inputs`` where it
imports (Hopper, CuTe-DSL).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

import llmkernels

from .. import reference_moe
from .registry import BenchOp, Provider, Unavailable, liger_function, need_module, register

QWEN3 = {"E": 128, "K": 8, "H": 2048, "I": 768}
MIXTRAL = {"E": 8, "K": 2, "H": 4096, "I": 14336}
DEFAULT_SIZES = (2048, 8192, 32768)
QUICK_SIZES = (8192,)
DECODE_SHAPES = tuple({"M": t, **QWEN3} for t in (1, 8, 64))
SMALL_SHAPES = ({"M": 9, "E": 3, "K": 2, "H": 24, "I": 16},)  # (grouped_mm: 16-byte strides)
EAGER_SHAPES = ({"M": 4096, **QWEN3},)
GRAD_INPUTS = ("x", "top_k_weights", "gate_up_proj", "down_proj")


def routed_flops(shape: dict, mode: str) -> int:
    """The routed experts' multiply-adds x 2: the forward's two GEMMs over T k rows
    (``2 T k (2 I H + I H)``); the backward's four (dx and dW of each) twice that."""
    forward = 6 * shape["M"] * shape["K"] * shape["H"] * shape["I"]
    return {"fwd": forward, "bwd": 2 * forward, "fwd+bwd": 3 * forward}[mode]


def _shape(t: int, rows):
    return {"M": t, **QWEN3}


def make_inputs(shape: dict, dtype: torch.dtype, device) -> dict:
    t, n_experts, k, hidden, inter = (shape[n] for n in ("M", "E", "K", "H", "I"))
    logits = torch.randn(t, n_experts, device=device) + torch.randn(n_experts, device=device)  # unequal experts
    weights, index = torch.softmax(logits, -1).topk(k, dim=-1)
    return {"x": torch.randn(t, hidden, device=device).to(dtype), "top_k_index": index,
            "top_k_weights": (weights / weights.sum(-1, keepdim=True)).to(dtype),
            "gate_up_proj": (torch.randn(n_experts, 2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype),
            "down_proj": (torch.randn(n_experts, hidden, inter, device=device) * inter ** -0.5).to(dtype)}


def _min_bytes(shape, dtype, mode):
    activations = 2 * shape["M"] * shape["H"]  # x read, out written (dy read, dx written)
    weights = 3 * shape["E"] * shape["H"] * shape["I"]  # read (and their gradients written)
    units = {"fwd": activations + weights, "bwd": activations + 2 * weights,
             "fwd+bwd": 2 * activations + 3 * weights}[mode]
    return units * dtype.itemsize


# --------------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------------
def _sorted_offsets(top_k_index: torch.Tensor, n_experts: int) -> tuple:
    """``(order, offsets)``: the slots sorted by expert and each expert's end row (int32),
    without a host synchronisation."""
    flat = top_k_index.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(1, n_experts + 1, device=flat.device, dtype=experts.dtype)
    return order, torch.searchsorted(experts, bounds).to(torch.int32)


def grouped_mm():
    """``F.grouped_mm``, or ``torch._grouped_mm`` where this torch has only that."""
    mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if mm is None:
        raise Unavailable(f"torch {torch.__version__} has no grouped_mm")
    return mm


def torch_grouped_mm():
    """``grouped_mm`` with the tokens permuted by PyTorch: gather, two grouped GEMMs, SiLU-and-mul,
    the weights, and the unpermute as a scatter to slot order and a sum over k."""
    mm = grouped_mm()

    def fn(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        t, k = top_k_index.shape
        order, offsets = _sorted_offsets(top_k_index, gate_up_proj.shape[0])
        gate, up = mm(x[order // k], gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        y = mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offsets)
        y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        slots = torch.empty_like(y).index_copy(0, order, y)
        return slots.view(t, k, -1).sum(1)
    return fn


def hf_experts(implementation: str):
    """transformers' experts of Qwen 3 MoE with ``experts_implementation=implementation``, the
    benchmark's tensors as their weights (a module made once per shape, on the meta device)."""
    transformers = need_module("transformers", "transformers")
    modeling = need_module("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers")
    if not hasattr(modeling, "Qwen3MoeExperts"):
        raise Unavailable(f"transformers {transformers.__version__} has no Qwen3MoeExperts")
    modules: dict = {}

    def fn(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        module = modules.get(gate_up_proj.shape)
        if module is None:
            n_experts, two_i, hidden = gate_up_proj.shape
            config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=two_i // 2,
                                                 num_experts=n_experts, num_experts_per_tok=top_k_index.shape[1])
            config._experts_implementation = implementation
            with torch.device("meta"):
                module = modules[gate_up_proj.shape] = modeling.Qwen3MoeExperts(config)
            del module.gate_up_proj, module.down_proj  # plain attributes from here on
        module.gate_up_proj, module.down_proj = gate_up_proj, down_proj
        return module(x, top_k_index, top_k_weights)
    return fn


def liger():
    apply = liger_function("fused_moe", "LigerFusedMoEFunction")
    return lambda x, top_k_index, top_k_weights, gate_up_proj, down_proj: apply(
        x, gate_up_proj, down_proj, top_k_index.to(torch.int32), top_k_weights)


def sonicmoe():
    """SonicMoE's general-routing entry: slots as (token, expert, score) triples sorted by token;
    weights ``(2I, H, E)`` / ``(H, I, E)`` views; gate/up concatenated where this version takes
    ``concat_layout``, else interleaved (a copy)."""
    package = need_module("sonicmoe", "sonicmoe")
    enums = need_module("sonicmoe.enums", "sonicmoe")
    run = getattr(package, "moe_general_routing_inputs", None)
    if run is None:
        run = getattr(need_module("sonicmoe.functional", "sonicmoe"), "moe_general_routing_inputs", None)
    if run is None:
        raise Unavailable("sonicmoe has no moe_general_routing_inputs")
    concat = "concat_layout" in inspect.signature(run).parameters

    def fn(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
        t, k = top_k_index.shape
        n_experts, two_i, hidden = gate_up_proj.shape
        w1 = gate_up_proj if concat else gate_up_proj.view(n_experts, 2, two_i // 2, hidden).transpose(1, 2).reshape(
            n_experts, two_i, hidden)
        tokens = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)
        out, _ = run(x, top_k_weights.reshape(-1).to(x.dtype), tokens, top_k_index.reshape(-1).to(torch.int32),
                     w1.permute(1, 2, 0), None, down_proj.permute(1, 2, 0), None, n_experts, None,
                     enums.ActivationType.SWIGLU, not torch.is_grad_enabled(), **({"concat_layout": True} if concat
                                                                                  else {}))
        return out
    return fn


PROVIDERS = {
    "llmkernels": Provider(lambda: llmkernels.moe_experts),
    "hf_eager": Provider(lambda: hf_experts("eager")),
    "hf_grouped_mm": Provider(lambda: hf_experts("grouped_mm")),
    "torch_grouped_mm": Provider(torch_grouped_mm),
    "liger": Provider(liger, gpu_only=True),
    "sonicmoe": Provider(sonicmoe, gpu_only=True),
}

register(BenchOp(
    name="moe_experts", axis="M", sizes=DEFAULT_SIZES, quick_sizes=QUICK_SIZES, shape=_shape,
    decode_shapes=DECODE_SHAPES, small_shapes=SMALL_SHAPES, eager_shapes=EAGER_SHAPES, make_inputs=make_inputs,
    grad_inputs=GRAD_INPUTS, outputs=("out",),
    reference=functools.partial(reference_moe.experts, compute_dtype=torch.float64), min_bytes=_min_bytes,
    providers=PROVIDERS))
