"""The public experts call, ``moe_experts``: argument checks, the layouts transformers stores
expert weights in, and the plain-PyTorch fallback where no kernel can run."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ... import reference_moe
from .._args import as_rows, check_tensor
from .._launch import use_kernels
from .configs import MoeConfig
from .experts import ACTIVATIONS, ExpertsOptions
from .register import EXPERTS


class ExpertLora(NamedTuple):
    """Rank-r LoRA adapters on every expert's projections, in the logical orientation whatever
    the weights' layout: ``gate_up = (A [E, r, H], B [E, 2I, r])`` (B's rows in the weight's own
    gate/up order), ``down = (A [E, r, I], B [E, H, r])``, either None; the projection becomes
    ``x W[e]^T + (scale * x A[e]^T) B[e]^T`` (``scale``: PEFT's ``lora_alpha / r``). Adapters
    may be float32 beside bf16 weights (PEFT's default); they are read in x's dtype, and the
    rank-r rows ``scale * x A[e]^T`` are kept in it."""

    gate_up: Optional[tuple] = None
    down: Optional[tuple] = None
    scale: float = 1.0


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_routing(x, top_k_index, top_k_weights) -> None:
    check_tensor("top_k_index", top_k_index, like=x, floating=False)
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if top_k_index.dim() != x.dim() or top_k_index.shape[:-1] != x.shape[:-1] or top_k_index.shape[-1] < 1:
        raise ValueError(f"top_k_index must have shape {list(x.shape[:-1])} + [k] (x's leading dims), "
                         f"got {list(top_k_index.shape)}")
    check_tensor("top_k_weights", top_k_weights, like=x)
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights shape {list(top_k_weights.shape)} must equal top_k_index shape "
                         f"{list(top_k_index.shape)}")


def _check_weights(x, gate_up, down, gate_up_bias, down_bias) -> None:
    """Shapes and dtypes of the logical ``gate_up [E, 2I, H]``, ``down [E, H, I]``, biases."""
    hidden = x.shape[-1]
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        check_tensor(name, w, like=x)
        if w.dtype != x.dtype:
            raise TypeError(f"{name} dtype {w.dtype} must equal x dtype {x.dtype}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D [experts, out, in], got shape {list(w.shape)}")
    n_experts, inter = down.shape[0], down.shape[2]
    if gate_up.shape != (n_experts, 2 * inter, hidden) or down.shape[1] != hidden:
        raise ValueError(f"expert weights must be gate_up_proj [E, 2I, H] and down_proj [E, H, I] (transposed=True: "
                         f"[E, H, 2I] and [E, I, H]) with H = {hidden} (x's last dim); got gate_up_proj "
                         f"{list(gate_up.shape)} and down_proj {list(down.shape)} as [E, out, in]")
    for name, b, n in (("gate_up_bias", gate_up_bias, 2 * inter), ("down_bias", down_bias, hidden)):
        if b is None:
            continue
        check_tensor(name, b, like=x)
        if b.shape != (n_experts, n):
            raise ValueError(f"{name} must have shape [{n_experts}, {n}], got {list(b.shape)}")
        if b.dtype != x.dtype:
            raise TypeError(f"{name} dtype {b.dtype} must equal x dtype {x.dtype}")


def _check_lora(x, lora, gate_up, down) -> tuple:
    """The four adapter tensors of ``lora`` (None where absent), checked against the weights."""
    if lora is None:
        return None, None, None, None
    if not isinstance(lora, ExpertLora):
        raise TypeError(f"lora must be an ExpertLora, got {type(lora).__name__}")
    _check_float("lora.scale", lora.scale)
    tensors = []
    for name, pair, weight in (("gate_up", lora.gate_up, gate_up), ("down", lora.down, down)):
        if pair is None:
            tensors += [None, None]
            continue
        n_experts, n, k = weight.shape
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"lora.{name} must be a pair (A, B) or None")
        a, b = pair
        check_tensor(f"lora.{name}[0]", a, like=x)
        check_tensor(f"lora.{name}[1]", b, like=x)
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != n_experts or a.shape[2] != k or b.shape[:2] != (n_experts, n) \
                or b.shape[2] != a.shape[1] or a.shape[1] < 1:
            raise ValueError(f"lora.{name}[0] and lora.{name}[1] must be A [{n_experts}, r, {k}] and "
                             f"B [{n_experts}, {n}, r], got {list(a.shape)} and {list(b.shape)}")
        tensors += [a, b]
    return tuple(tensors)


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, *, gate_up_bias: Optional[torch.Tensor] = None,
                down_bias: Optional[torch.Tensor] = None, activation: str = "silu", interleaved: bool = False,
                transposed: bool = False, alpha: float = 1.702, limit: float = 7.0,
                lora: Optional[ExpertLora] = None, config: Optional[MoeConfig] = None) -> torch.Tensor:
    """The routed experts of a Mixture-of-Experts layer, as grouped GEMMs (transformers' experts
    interface: ``experts(hidden_states, top_k_index, top_k_weights)``).

    ``out[t] = sum_j top_k_weights[t, j] * down_e(gated(gate_up_e(x[t])))`` with
    ``e = top_k_index[t, j]`` (``llmkernels.reference_moe.experts`` defines the roundings).

    Args:
        x: ``[..., H]`` bfloat16 / float16 / float32 (float64 runs the reference); any strides
            with a unit-stride last dim.
        top_k_index: ``[..., k]`` int32 / int64 expert ids; an id outside ``[0, E)`` is a dropped
            slot (it adds nothing; expert parallelism's marker of another rank's expert).
        top_k_weights: ``[..., k]`` any float dtype (its gradient comes in it).
        gate_up_proj: ``[E, 2I, H]`` (transformers' Mixtral, Qwen 2/3 MoE, OLMoE, DeepSeek-V3),
            or with ``transposed`` ``[E, H, 2I]`` (gpt-oss); read in place whatever its strides.
        down_proj: ``[E, H, I]``, or ``[E, I, H]`` with ``transposed``.
        gate_up_bias, down_bias: ``[E, 2I]`` and ``[E, H]`` or None (gpt-oss has both).
        activation: ``"silu"`` (SwiGLU: ``silu(gate) * up``) or ``"clamped_swiglu"`` (gpt-oss,
            with ``alpha`` and ``limit``).
        interleaved: gate and up alternate along ``2I`` (gpt-oss) instead of gate's ``I``
            columns first.
        lora: rank-r adapters on the projections (an :class:`ExpertLora`), in the same grouped
            kernels; freeze the weights (``requires_grad=False``) to train the adapters alone.
        config: the kernels' launch configuration (a ``MoeConfig``; tests and tuning, eager
            calls only).

    Returns:
        ``[..., H]`` in x's dtype, differentiable in x, top_k_weights, the weights, biases and
        adapters (only the gradients that are needed are formed).
        The routing is sorted once per call; every gradient is summed in a fixed order (bitwise
        deterministic run to run).
    """
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., hidden] with at least one token dim, got shape {list(x.shape)}")
    _check_routing(x, top_k_index, top_k_weights)
    gate_up = gate_up_proj.transpose(-1, -2) if transposed and isinstance(gate_up_proj, torch.Tensor) else gate_up_proj
    down = down_proj.transpose(-1, -2) if transposed and isinstance(down_proj, torch.Tensor) else down_proj
    _check_weights(x, gate_up, down, gate_up_bias, down_bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(interleaved, bool) or not isinstance(transposed, bool):
        raise TypeError("interleaved and transposed must be bools")
    adapters = _check_lora(x, lora, gate_up, down)
    options = ExpertsOptions(activation, interleaved, _check_float("alpha", alpha), _check_float("limit", limit),
                             1.0 if lora is None else float(lora.scale))
    if config is not None and not isinstance(config, MoeConfig):
        raise TypeError(f"config must be a MoeConfig, got {type(config).__name__}")
    shape, hidden, k = x.shape, x.shape[-1], top_k_index.shape[-1]
    rows = as_rows(x, hidden)
    # (already [T, k] and [T, H] as transformers passes them: no view, and no view node in the backward)
    flat = x.dim() == 2
    index, weights = ((top_k_index, top_k_weights) if flat
                      else (top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)))
    if not use_kernels(x) or x.dtype == torch.float64 or rows.shape[0] == 0:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = reference_moe.experts(rows, index, weights, gate_up, down, gate_up_bias, down_bias,
                                    activation=activation, interleaved=interleaved, alpha=options.alpha,
                                    limit=options.limit, compute_dtype=compute,
                                    lora=None if lora is None else reference_moe.Lora(*lora))
        return out if flat else out.view(shape)
    # (biases are read with unit column stride; a [E, N] copy where they are not)
    biases = [None if b is None else b.contiguous() for b in (gate_up_bias, down_bias)]
    out = EXPERTS(rows, index, weights, gate_up, down, *biases, *adapters, options, config=config)
    return out if flat else out.view(shape)
