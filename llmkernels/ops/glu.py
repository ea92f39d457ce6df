"""Gated-MLP activation: ``y = act(gate) * up`` (SwiGLU, GeGLU), one kernel each way.

A Llama-style MLP computes ``down_proj(act(gate_proj(x)) * up_proj(x))``. With ``gate, up [..., I]``
(or the two halves of a fused ``gate_up_proj`` output, as Phi-3 and the MoE experts store it)::

    forward:   y      = q(act(gate)) * up
    backward:  d_up   = dy * q(act(gate))
               d_gate = dy * up * act'(gate)

``act`` is ``silu(g) = g * sigmoid(g)`` (SwiGLU), ``gelu_tanh`` (GELU's tanh approximation, as
Gemma uses it; computed as ``g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))``, which equals
``0.5 g (1 + tanh(...))``) or ``gelu`` (exact, ``g * Phi(g)`` with erf).

Dtypes: gate and up share one float dtype (bf16, fp16, fp32); y, d_gate and d_up are in that
dtype. Arithmetic is fp32. ``q`` rounds ``act(gate)`` to the input dtype before the product, as
Hugging Face's eager MLP does (it computes ``act_fn(gate)`` in the model's dtype), so bf16/fp16
outputs equal HF's up to the last bit of the fp32 transcendental (identity for fp32). The
gradients are rounded once each; ``d_up`` uses the same ``q(act(gate))`` that the forward
multiplied by, ``d_gate`` passes ``q`` straight through.

Memory: the backward recomputes ``act(gate)`` from the saved gate and up, so the op saves two
``[..., I]`` tensors where HF's eager MLP saves three (gate, up and ``act(gate)``).
``glu_linear`` also takes the down projection, so that its input ``y`` is not kept either
(``down_proj`` would save it): two ``[..., I]`` tensors per MLP instead of HF's four.

The kernels are elementwise and memory bound (fwd: gate, up read, y written; bwd: gate, up, dy
read, d_gate, d_up written). They see ``[M, I]`` rows (leading dimensions flattened) through
row strides with a unit-stride last dimension, so slices of a fused projection run without
copies; outputs are new contiguous tensors. Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of
about ``GluTiles.tile_elements`` elements on a 1-D grid, column tiles fastest (``configs/glu.py``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from ._args import as_rows, cdiv, check_tensor
from ._launch import PlanCache, launcher_of, use_kernels
from ._register import Op
from ._triton import tl, triton
from .configs.glu import GluConfig, glu_config

ACTIVATIONS = tuple(reference.GLU_ACTIVATIONS)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """``(act(g), act'(g))`` of fp32 ``g``, a branch for each of ``reference.GLU_ACTIVATIONS``."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        # 0.5 (1 + tanh(z)) = sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3); 1.5957... = 2 sqrt(2/pi)
        s = tl.sigmoid(1.5957691216057308 * g * (1.0 + 0.044715 * g * g))
        a = g * s
        da = s + a * (1.0 - s) * 1.5957691216057308 * (1.0 + 3 * 0.044715 * g * g)
    elif ACTIVATION == "gelu":
        # Phi(g) = 0.5 (1 + erf(g / sqrt(2))); phi(g) = exp(-g^2 / 2) / sqrt(2 pi)
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        tl.static_assert(False, "an activation of reference.GLU_ACTIVATIONS without its branch in _activation")
    return a, da


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: rows [BLOCK_M, 1] (int64), columns [1, BLOCK_N], mask."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // col_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid - pid_m * col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _glu_fwd_kernel(G, U, Y, M, N, stride_g, stride_u,
                    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y [M, N] contiguous = q(act(G)) * U; G, U: [M, N] with row strides."""
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation(g, ACTIVATION)
    a = a.to(Y.dtype.element_ty).to(tl.float32)  # HF's act_fn(gate) in the model's dtype
    tl.store(Y + rows * N + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(DY, G, U, DG, DU, M, N, stride_dy, stride_g, stride_u,
                    ACTIVATION: tl.constexpr, STORE_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """DG, DU [M, N] contiguous: dy * up * act'(gate) and dy * q(act(gate)). With STORE_Y, the
    forward's y = q(act(gate)) * up is written over DY, each element after it was read."""
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation(g, ACTIVATION)
    a = a.to(DU.dtype.element_ty).to(tl.float32)
    tl.store(DG + rows * N + cols, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + rows * N + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)
    if STORE_Y:
        tl.store(DY + rows * stride_dy + cols, (a * u).to(DY.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
class GluOptions(NamedTuple):
    """The options of a GLU call, named once: the custom ops' schemas and the plan keys are made
    of these fields."""

    activation: str  # one of ACTIVATIONS


class GluKey(NamedTuple):
    """What decides a GLU launch: ``[m, n]``, the options, whether the backward also writes the
    forward's product, and a configuration given instead of ``glu_config``'s."""

    m: int
    n: int
    options: GluOptions
    store_y: bool
    config: Optional[GluConfig]


def _plan(kernel, key: GluKey, **flags):
    """(the Launcher, the grid) of ``kernel`` over ``[m, n]`` in ``config`` (default ``glu_config``'s)."""
    m, n = key.m, key.n
    config = key.config or glu_config(m, n)
    handle = launcher_of(kernel, ACTIVATION=key.options.activation, **flags, BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, num_warps=config.num_warps)
    return handle, (cdiv(m, config.block_m) * cdiv(n, config.block_n),)


_FWD = PlanCache(lambda key: _plan(_glu_fwd_kernel, key))
_BWD = PlanCache(lambda key: _plan(_glu_bwd_kernel, key, STORE_Y=key.store_y))


def _rows(t: torch.Tensor, n: int) -> tuple:
    """(rows, row stride) of ``t`` as ``glu`` passes it: ``[M, N]`` with a row stride, or
    contiguous with any leading dimensions (its rows N apart)."""
    return (t.shape[0], t.stride(0)) if t.dim() == 2 else (t.numel() // n if n else 0, n)


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, options: GluOptions, *,
            config: Optional[GluConfig] = None) -> torch.Tensor:
    """``q(act(gate)) * up`` of ``gate, up [M, N]`` (row strides allowed; or both contiguous
    ``[..., N]``) as a new contiguous tensor of gate's shape and dtype. ``config``: the launch
    configuration (tests and tuning)."""
    n = gate.shape[-1]
    m, stride_g = _rows(gate, n)
    y = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if m and n:
        handle, grid = _FWD[GluKey(m, n, options, False, config)]
        handle(grid, gate, up, y, m, n, stride_g, _rows(up, n)[1])
    return y


def glu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, options: GluOptions, *, store_y: bool = False,
            config: Optional[GluConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up)``, new contiguous tensors of gate's shape and dtype, from ``dy`` (any
    strides) and ``gate, up`` as ``glu_fwd`` takes them. ``store_y``: ``dy`` (then a ``[M, N]``
    buffer the caller owns) is overwritten with the forward's ``y``, recomputed. ``config``: as
    ``glu_fwd``'s."""
    n = gate.shape[-1]
    m, stride_g = _rows(gate, n)
    dy = as_rows(dy, n)  # the upstream gradient may come with any strides
    d_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    d_up = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if m and n:
        handle, grid = _BWD[GluKey(m, n, options, store_y, config)]
        handle(grid, dy, gate, up, d_gate, d_up, m, n, dy.stride(0), stride_g, _rows(up, n)[1])
    return d_gate, d_up


# --------------------------------------------------------------------------------------------
# registration: eager autograd and torch.compile custom ops (llmkernels::glu_fwd / glu_bwd).
# Only gate and up are saved; the backward recomputes the activation.
# --------------------------------------------------------------------------------------------
def _glu_backward(ctx, bwd, dy):
    gate, up = ctx.saved_tensors
    return bwd(dy, gate, up, ctx.options)


GLU = Op("glu", forward=glu_fwd, backward=_glu_backward, grad_inputs=(0, 1),
         once_differentiable=True, fake=lambda gate, up, options: gate.new_empty(gate.shape), backward_launcher=glu_bwd,
         backward_fake=lambda dy, gate, up, options: (gate.new_empty(gate.shape), gate.new_empty(gate.shape)))


def _glu_linear_fwd(gate, up, weight, bias, options: GluOptions):
    return torch.nn.functional.linear(glu_fwd(gate, up, options), weight, bias)


def _glu_linear_setup(ctx, inputs, options: GluOptions, output):
    gate, up, weight, bias = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.options, ctx.has_bias = options, bias is not None


def _glu_linear_backward(ctx, bwd, d_out):
    gate, up, weight = ctx.saved_tensors
    d_out = as_rows(d_out, d_out.shape[-1])
    dy = torch.mm(d_out, weight)  # [M, I], overwritten with the recomputed product below
    d_gate, d_up = glu_bwd(dy, gate, up, ctx.options, store_y=True)
    d_weight = torch.mm(d_out.t(), dy) if ctx.needs_input_grad[2] else None
    d_bias = d_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
    return d_gate, d_up, d_weight, d_bias


# ``F.linear(glu(gate, up), weight, bias)`` saving gate, up and weight, not the product: the backward
# recomputes it in the pass that forms d_gate and d_up. Eager only: torch.compile plans its own
# recomputation of ``F.linear(glu(...))``.
GLU_LINEAR = Op("glu_linear", forward=_glu_linear_fwd, setup=_glu_linear_setup, backward=_glu_linear_backward,
                grad_inputs=(0, 1, 2, 3), once_differentiable=True,
                base=lambda gate, up, weight, bias, options: torch.nn.functional.linear(
                    GLU(gate, up, options), weight, bias))


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def _check_glu_args(gate, up, activation) -> None:
    check_tensor("gate", gate)
    check_tensor("up", up, like=gate, like_name="gate")
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension (the intermediate one)")
    if up.shape != gate.shape:
        raise ValueError(f"up shape {list(up.shape)} must equal gate shape {list(gate.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up dtype {up.dtype} must equal gate dtype {gate.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _kernel_args(gate, up):
    """``(gate, up, shape)`` as the kernels read them: themselves where both are contiguous, or
    ``[M, N]`` with unit column stride (no view made); else ``[M, N]`` views (copies where none
    exists) and the shape to view the result back to (None: it has gate's shape already)."""
    n = gate.shape[-1]
    if gate.dim() != 2 and gate.is_contiguous() and up.is_contiguous():
        return gate, up, None
    return as_rows(gate, n), as_rows(up, n), None if gate.dim() == 2 else gate.shape


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The gated-MLP activation ``act(gate) * up``, fused: SwiGLU (``"silu"``) and GeGLU.

    Args:
        gate: ``[..., I]`` float32/bfloat16/float16 (float64 runs the reference), e.g.
            ``gate_proj(x)``. Any strides with a unit-stride last dimension: the halves of a
            fused projection, ``gate_up_proj(x).chunk(2, dim=-1)``, are read in place.
        up: same shape, dtype and device as gate.
        activation: ``"silu"`` (Llama, Mistral, Qwen, Phi-3, OLMo: SwiGLU), ``"gelu_tanh"``
            (Gemma's ``gelu_pytorch_tanh``: GeGLU) or ``"gelu"`` (exact erf GELU).

    Returns:
        ``y [..., I]`` contiguous, in gate's dtype: ``act(gate)`` rounded to that dtype, times
        ``up``, as Hugging Face's eager MLP computes it (fp32 arithmetic). Differentiable in
        gate and up; only gate and up are saved for the backward, which recomputes
        ``act(gate)``.
    """
    _check_glu_args(gate, up, activation)
    if not use_kernels(gate) or gate.dtype == torch.float64 or gate.numel() == 0:
        compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
        return reference.glu(gate, up, activation, compute_dtype=compute)
    gate_rows, up_rows, shape = _kernel_args(gate, up)
    y = GLU(gate_rows, up_rows, GluOptions(activation))
    return y if shape is None else y.view(shape)


def glu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu") -> torch.Tensor:
    """A gated MLP's down projection, ``F.linear(glu(gate, up, activation), weight, bias)``,
    without keeping the product for the backward.

    ``nn.Linear`` saves its input, so ``down_proj(glu(gate, up))`` keeps three ``[..., I]``
    tensors per MLP until the backward (gate, up and the product). This saves gate and up only:
    the backward forms ``dy = d_out @ weight``, then one kernel reads dy, gate and up, writes
    d_gate and d_up, and writes the recomputed product over dy for ``d_weight = d_out^T @ y``:
    one ``[..., I]`` write more than keeping it. Outputs and gradients are bitwise those of
    ``down_proj(glu(gate, up))`` (the same kernels and matmuls).

    Args:
        gate, up: as for :func:`glu` (``[..., I]``, one float dtype, strided halves allowed).
        weight: ``[O, I]`` of gate's dtype and device (``down_proj.weight``).
        bias: ``[O]`` or None.
        activation: as for :func:`glu`.

    Returns:
        ``[..., O]`` in gate's dtype; differentiable in gate, up, weight and bias. Without a
        gradient to form, and under torch.compile (which plans its own recomputation), it is
        ``F.linear(glu(gate, up), weight, bias)``.
    """
    _check_glu_args(gate, up, activation)
    check_tensor("weight", weight, like=gate, like_name="gate")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"weight must have shape [out_features, {gate.shape[-1]}] (the last dim of gate), "
                         f"got {list(weight.shape)}")
    if weight.dtype != gate.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal gate dtype {gate.dtype}")
    if bias is not None:
        check_tensor("bias", bias, like=gate, like_name="gate")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (out_features), got {list(bias.shape)}")
        if bias.dtype != gate.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must equal gate dtype {gate.dtype}")
    if not use_kernels(gate) or gate.dtype == torch.float64 or gate.numel() == 0:
        return torch.nn.functional.linear(glu(gate, up, activation), weight, bias)
    gate_rows, up_rows, shape = _kernel_args(gate, up)
    out = GLU_LINEAR(gate_rows, up_rows, weight, bias, GluOptions(activation))
    return out if shape is None else out.view(*shape[:-1], weight.shape[0])
