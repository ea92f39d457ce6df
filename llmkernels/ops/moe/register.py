"""The MoE family's registration, in this one place: the experts call described once for
``ops/_register.Op`` (eager ``torch.autograd.Function`` and the torch.compile custom ops
``llmkernels::moe_experts_fwd`` / ``moe_experts_bwd``). The forward keeps ``x``, the routing,
the expert weights and the ``[S, 2I]`` gate/up values; the backward computes only the gradients
its inputs need (``ExpertsGrads``)."""
from __future__ import annotations

import torch

from .._register import Op
from .experts import ExpertsGrads, ExpertsOptions, experts_bwd, experts_fwd, experts_infer

# The tensors of a call, in order: x, top_k_index, top_k_weights, gate_up_proj, down_proj,
# gate_up_bias, down_bias. Every one but the index may need a gradient.
GRAD_INPUTS = (0, 2, 3, 4, 5, 6)


def _setup(ctx, inputs, options: ExpertsOptions, outputs, *, config=None):
    x, index, weights, gate_up, down, gate_up_bias, down_bias = inputs
    _, gu, order, offsets = outputs
    ctx.save_for_backward(x, index, weights, gate_up, down, down_bias, gu, order, offsets)
    ctx.options, ctx.has_gate_up_bias, ctx.config = options, gate_up_bias is not None, config


def _backward(ctx, bwd, d_out, *_):
    x, index, weights, gate_up, down, down_bias, gu, order, offsets = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = ExpertsGrads(ctx.options, need[0], need[2], need[3], need[4], need[5] and ctx.has_gate_up_bias,
                         need[6] and down_bias is not None)
    outputs = bwd(d_out, x, index, weights, gate_up, down, down_bias, gu, order, offsets, grads, config=ctx.config)
    # (under torch.compile an absent gradient is a placeholder: the flags say which are real)
    return tuple(g if wanted else None for g, wanted in zip(outputs, grads[1:]))


def _fake(x, index, weights, gate_up, down, gate_up_bias, down_bias, options: ExpertsOptions):
    rows = index.shape[0] * index.shape[1]
    return (x.new_empty(x.shape), x.new_empty((rows, gate_up.shape[1])),
            index.new_empty(rows, dtype=torch.int32), index.new_empty(down.shape[0] + 1, dtype=torch.int32))


def _backward_fake(d_out, x, index, weights, gate_up, down, down_bias, gu, order, offsets, grads: ExpertsGrads):
    n_experts = down.shape[0]
    return (x.new_empty(x.shape) if grads.x else None, weights.new_empty(weights.shape) if grads.weights else None,
            torch.empty_like(gate_up) if grads.gate_up else None, torch.empty_like(down) if grads.down else None,
            x.new_empty((n_experts, gate_up.shape[1])) if grads.gate_up_bias else None,
            x.new_empty((n_experts, down.shape[1])) if grads.down_bias else None)


EXPERTS = Op("moe_experts", forward=experts_fwd, infer=experts_infer, setup=_setup, backward=_backward,
             grad_inputs=GRAD_INPUTS, returns=1, fake=_fake, backward_launcher=experts_bwd,
             backward_fake=_backward_fake, once_differentiable=True)
