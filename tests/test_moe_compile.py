"""The MoE layer under torch.compile(fullgraph=True): the router and the experts' custom ops
(``llmkernels::moe_experts_fwd`` / ``_bwd``) give the eager results, forward and backward, and
``torch.library.opcheck`` passes on the arguments ``moe_experts`` gives them. On CPU the
``aot_eager`` backend runs the real kernels through Triton's interpreter."""
import copy

import pytest
import torch

import llmkernels as lk
from llmkernels.ops._register import flat_fields
from llmkernels.ops.moe import RouterOptions
from llmkernels.ops.moe.experts import ExpertsOptions

from tests.conftest import DEVICE
from tests.helpers import rel_err

BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"
E, K, H, I, T = 4, 2, 32, 16, 9


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _weights(transposed=False):
    gate_up = torch.randn(E, 2 * I, H, device=DEVICE) * H ** -0.5
    down = torch.randn(E, H, I, device=DEVICE) * I ** -0.5
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return gate_up.requires_grad_(), down.requires_grad_()


@pytest.mark.parametrize("layout", ["qwen", "gpt_oss"])
def test_compiled_layer_matches_eager(layout):
    gpt_oss = layout == "gpt_oss"
    router = (torch.randn(E, H, device=DEVICE) * H ** -0.5).requires_grad_()
    gate_up, down = _weights(transposed=gpt_oss)
    bias = (torch.randn(E, 2 * I, device=DEVICE) * 0.1).requires_grad_() if gpt_oss else None
    options = RouterOptions(K, "topk_softmax" if gpt_oss else "softmax")
    kwargs = dict(activation="clamped_swiglu", interleaved=True, transposed=True, limit=2.0) if gpt_oss else {}

    def layer(x):
        weights, index = lk.moe_route(x @ router.T, options)
        return lk.moe_experts(x, index, weights, gate_up, down, gate_up_bias=bias, **kwargs)

    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    leaves = [x, router, gate_up, down] + ([bias] if gpt_oss else [])
    d_out = torch.randn(T, H, device=DEVICE)
    ref = layer(x)
    ref_grads = torch.autograd.grad(ref, leaves, d_out)
    out = torch.compile(layer, fullgraph=True, backend=BACKEND)(x)
    grads = torch.autograd.grad(out, leaves, d_out)
    assert rel_err(out, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


def test_experts_custom_op_opcheck():
    """Schema, fake kernels (shapes, dtypes and strides of every output), autograd registration;
    with adapters on both projections."""
    gate_up, down = _weights()
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    weights, index = lk.moe_route(torch.randn(T, E, device=DEVICE), RouterOptions(K))
    lora = [(torch.randn(*shape, device=DEVICE) * 0.1).requires_grad_()
            for shape in ((E, 4, H), (E, 2 * I, 4), (E, 4, I), (E, H, 4))]
    options = ExpertsOptions("silu", False, 1.702, 7.0, 0.5)
    args = (x, index, weights.requires_grad_(), gate_up, down, None, None, *lora, *flat_fields(options))
    torch.library.opcheck(torch.ops.llmkernels.moe_experts_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compiled_patched_moe_model_matches_eager():
    """A patched Qwen3-MoE compiles with ``fullgraph=True`` whole, the fused loss and the router's
    auxiliary loss included (no read back to the host to break the graph), and gives the eager
    unpatched model's loss and gradients."""
    pytest.importorskip("transformers")
    from llmkernels import hf
    from tests.test_moe_hf import batch, make_moe

    torch.manual_seed(0)
    model = make_moe("qwen3_moe").train()
    patched = copy.deepcopy(model)
    ids, labels = batch(0, model.config.vocab_size)
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    try:
        lk.patch(patched)
        with torch.no_grad():  # transformers installs its router-logit hooks on a first call, under a lock
            patched(input_ids=ids, labels=labels)  # that dynamo cannot enter: that call is eager
        out = torch.compile(patched, fullgraph=True, backend=BACKEND)(input_ids=ids, labels=labels)
        out.loss.backward()
    finally:
        hf.unpatch_all()
    assert out.aux_loss is not None and rel_err(out.aux_loss, ref.aux_loss) < 1e-6
    assert rel_err(out.loss, ref.loss) < 1e-5
    grads = {name: p.grad for name, p in patched.named_parameters() if p.grad is not None}
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(grads[name], p.grad) < 1e-4, name
