"""The MoE family's registration, in this one place: the experts call described once for
``ops/_register.Op`` (eager ``torch.autograd.Function`` and the torch.compile custom ops
``llmkernels::moe_experts_fwd`` / ``moe_experts_bwd``). The forward keeps ``x``, the routing,
the expert weights and adapters, the ``[S, 2I]`` gate/up values, the routing's tile table and the
adapters' ``[S, r]`` inputs; the backward computes only the gradients its inputs need (``ExpertsGrads``)."""
from __future__ import annotations

import torch

from .._register import Op
from .configs import choose
from .experts import ExpertsGrads, ExpertsOptions, experts_bwd, experts_fwd, experts_infer
from .routing import max_tiles

# The tensors of a call, in order: x, top_k_index, top_k_weights, gate_up_proj, down_proj,
# gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b. Every one
# but the index may need a gradient.
GRAD_INPUTS = (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)


def _setup(ctx, inputs, options: ExpertsOptions, outputs, *, config=None):
    x, index, weights, gate_up, down, gate_up_bias, down_bias, *lora = inputs
    _, gu, order, offsets, tiles, xa, ha = outputs
    has_lora = lora[0] is not None, lora[2] is not None
    # (under torch.compile an absent adapter's rows are a placeholder: the inputs say which are real)
    ctx.save_for_backward(x, index, weights, gate_up, down, down_bias, *lora, gu, order, offsets, tiles,
                          xa if has_lora[0] else None, ha if has_lora[1] else None)
    ctx.options, ctx.has_gate_up_bias, ctx.config = options, gate_up_bias is not None, config


def _backward(ctx, bwd, d_out, *_):
    saved = ctx.saved_tensors
    down_bias, lora = saved[5], saved[6:10]
    need = ctx.needs_input_grad
    present = (True, True, True, True, ctx.has_gate_up_bias, down_bias is not None, *(t is not None for t in lora))
    grads = ExpertsGrads(ctx.options, *(need[i] and real for i, real in zip(GRAD_INPUTS, present)))
    outputs = bwd(d_out, *saved, grads, config=ctx.config)
    return tuple(g if wanted else None for g, wanted in zip(outputs, grads[1:]))


def _fake(x, index, weights, gate_up, down, gate_up_bias, down_bias, gate_up_a, gate_up_b, down_a, down_b,
          options: ExpertsOptions):
    rows, n_experts = index.shape[0] * index.shape[1], down.shape[0]
    # (choose, not the cached moe_config: under torch.compile the sizes may be symbolic)
    block_m = choose(rows, n_experts, x.shape[1], down.shape[2], x.device).gate_up.block_m
    return (x.new_empty(x.shape), x.new_empty((rows, gate_up.shape[1])),
            index.new_empty(rows, dtype=torch.int32), index.new_empty(n_experts + 1, dtype=torch.int32),
            index.new_empty(2 * max_tiles(rows, n_experts, block_m), dtype=torch.int32),
            None if gate_up_a is None else x.new_empty((rows, gate_up_a.shape[1])),
            None if down_a is None else x.new_empty((rows, down_a.shape[1])))


def _backward_fake(d_out, x, index, weights, gate_up, down, down_bias, gate_up_a, gate_up_b, down_a, down_b, gu,
                   order, offsets, tiles, xa, ha, grads: ExpertsGrads):
    n_experts = down.shape[0]
    fakes = (x.new_empty(x.shape), weights.new_empty(weights.shape), torch.empty_like(gate_up), torch.empty_like(down),
             x.new_empty((n_experts, gate_up.shape[1])), x.new_empty((n_experts, down.shape[1])),
             *(None if t is None else torch.empty_like(t) for t in (gate_up_a, gate_up_b, down_a, down_b)))
    return tuple(f if wanted else None for f, wanted in zip(fakes, grads[1:]))


EXPERTS = Op("moe_experts", forward=experts_fwd, infer=experts_infer, setup=_setup, backward=_backward,
             grad_inputs=GRAD_INPUTS, returns=1, fake=_fake, backward_launcher=experts_bwd,
             backward_fake=_backward_fake, once_differentiable=True)
