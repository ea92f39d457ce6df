"""The MoE router against transformers' own router modules and auxiliary losses (Mixtral, Qwen 2/3
MoE, OLMoE, DeepSeek-V3, gpt-oss), its tie-break, its gradients and its argument checks."""
import pytest
import torch

import llmkernels as lk
from llmkernels.ops.moe import RouterOptions

from tests.conftest import DEVICE
from tests.helpers import bad_input_test, rel_err

transformers = pytest.importorskip("transformers")

T, H = 37, 24


def _sorted_by_index(weights, index):
    """Rows of ``(weights, index)`` ordered by expert index (DeepSeek-V3's top-k is unsorted)."""
    index, order = index.sort(-1)
    return weights.gather(-1, order), index


def _config(model_type: str, **extra):
    cls = transformers.CONFIG_MAPPING[model_type]
    return cls(hidden_size=H, **extra)


# model_type -> (router module path, config arguments, our options, bias attribute)
ROUTERS = {
    "mixtral": ("mixtral.modeling_mixtral.MixtralTopKRouter", dict(num_local_experts=8, num_experts_per_tok=2),
                RouterOptions(2, "softmax", True, weights_dtype=torch.float32)),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
                  dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
                  RouterOptions(4, "softmax", True, weights_dtype=torch.float32)),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
                  dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
                  RouterOptions(4, "softmax", False, weights_dtype=torch.float32)),
    "olmoe": ("olmoe.modeling_olmoe.OlmoeTopKRouter", dict(num_experts=8, num_experts_per_tok=8, norm_topk_prob=False),
              RouterOptions(8, "softmax", False, weights_dtype=torch.float32)),
    "deepseek_v3": ("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                    dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5),
                    RouterOptions(4, "sigmoid", True, n_group=4, topk_group=2, scaling=2.5)),
    "gpt_oss": ("gpt_oss.modeling_gpt_oss.GptOssTopKRouter", dict(num_local_experts=8, num_experts_per_tok=4),
                RouterOptions(4, "topk_softmax", weights_dtype=torch.float32)),
}


def _hf_router(model_type):
    path, extra, options = ROUTERS[model_type]
    module_path, cls = path.rsplit(".", 1)
    module = __import__(f"transformers.models.{module_path}", fromlist=[cls])
    router = getattr(module, cls)(_config(model_type, **extra)).to(DEVICE)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_()
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.1)
    return router, options


@pytest.mark.parametrize("model_type", ROUTERS)
def test_route_matches_transformers_router(model_type):
    router, options = _hf_router(model_type)
    x = torch.randn(T, H, device=DEVICE)
    logits, ref_weights, ref_index = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, index = lk.moe_route(logits, options, correction_bias=bias)
    assert weights.dtype == torch.float32 and index.dtype == torch.int64
    weights, index = _sorted_by_index(weights, index)
    ref_weights, ref_index = _sorted_by_index(ref_weights, ref_index)
    assert torch.equal(index, ref_index)
    assert rel_err(weights, ref_weights) < 1e-6


def test_route_weights_dtype_and_gradient_against_float64():
    logits = torch.randn(T, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    options = RouterOptions(4, "softmax", True, weights_dtype=torch.bfloat16)
    weights, index = lk.moe_route(logits, options)
    assert weights.dtype == torch.bfloat16
    ref_logits = logits.detach().double().requires_grad_()
    ref_weights, ref_index = lk.moe_route(ref_logits, options._replace(weights_dtype=None))
    assert torch.equal(index, ref_index)
    assert rel_err(weights, ref_weights) < 1e-2
    g = torch.randn_like(ref_weights)
    weights.backward(g.to(weights.dtype))
    ref_weights.backward(g)
    assert rel_err(logits.grad, ref_logits.grad) < 2e-2


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax", "sigmoid"])
def test_route_gradcheck(scoring):
    logits = torch.randn(5, 8, device=DEVICE, dtype=torch.float64, requires_grad=True)
    options = RouterOptions(3, scoring, True, n_group=2 if scoring == "sigmoid" else 1,
                            topk_group=2 if scoring == "sigmoid" else 1, scaling=1.5)
    assert torch.autograd.gradcheck(lambda z: lk.moe_route(z, options)[0], (logits,))


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax", "sigmoid"])
def test_ties_go_to_the_lower_expert(scoring):
    """Every score equal: the first k experts, in order, whatever the device's top-k does."""
    logits = torch.zeros(4, 8, device=DEVICE)
    options = RouterOptions(3, scoring, True, n_group=2 if scoring == "sigmoid" else 1,
                            topk_group=1 if scoring == "sigmoid" else 1)
    weights, index = lk.moe_route(logits, options)
    assert torch.equal(index, torch.arange(3, device=DEVICE).expand(4, 3))
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 3))
    partial = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 0.0, 2.0, 1.0]], device=DEVICE)
    assert lk.moe_route(partial, RouterOptions(4, "topk_softmax"))[1].tolist() == [[1, 3, 6, 2]]


def _hf_load_balancing(model_type):
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])
    return module.load_balancing_loss_func


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(model_type, masked):
    batch, seq, experts, k = 3, 7, 8, 2
    layers = tuple(torch.randn(batch * seq, experts, device=DEVICE, requires_grad=True) for _ in range(3))
    mask = (torch.rand(batch, seq, device=DEVICE) > 0.3).long() if masked else None
    ref = _hf_load_balancing(model_type)(layers, experts, k, mask)
    loss = lk.moe_load_balancing_loss(layers, k, mask)
    assert rel_err(loss, ref) < 1e-6
    grads = torch.autograd.grad(loss, layers)
    ref_grads = torch.autograd.grad(ref, layers)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


def test_router_z_loss_matches_switch_transformers():
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    logits = torch.randn(2, 9, 8, device=DEVICE, requires_grad=True)
    loss = lk.moe_router_z_loss(logits)
    ref = router_z_loss_func(logits)
    assert rel_err(loss, ref) < 1e-6
    assert rel_err(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0]) < 1e-6


def _bad_cases():
    z = torch.randn(4, 8, device=DEVICE)
    ok = RouterOptions(2)
    return [
        ("logits must be a torch.Tensor", TypeError, lambda: lk.moe_route([[1.0]], ok)),
        ("logits must be a floating-point", TypeError, lambda: lk.moe_route(z.long(), ok)),
        (r"logits must be \[tokens, experts\]", ValueError, lambda: lk.moe_route(z[0], ok)),
        ("router must be a RouterOptions", TypeError, lambda: lk.moe_route(z, (2,))),
        ("router.top_k = 9 exceeds the 8 experts", ValueError, lambda: lk.moe_route(z, RouterOptions(9))),
        ("router.top_k must be an int >= 1", ValueError, lambda: lk.moe_route(z, RouterOptions(0))),
        ("router.scoring must be one of", ValueError, lambda: lk.moe_route(z, RouterOptions(2, "relu"))),
        ("router.n_group = 3 must divide", ValueError, lambda: lk.moe_route(z, RouterOptions(2, "sigmoid", n_group=3))),
        ("exceeds the experts of router.topk_group", ValueError,
         lambda: lk.moe_route(z, RouterOptions(5, "sigmoid", n_group=4, topk_group=2))),
        ("correction_bias must have shape", ValueError,
         lambda: lk.moe_route(z, RouterOptions(2, "sigmoid"), torch.zeros(7, device=DEVICE))),
        ("needs router.scoring='sigmoid'", ValueError, lambda: lk.moe_route(z, ok, torch.zeros(8, device=DEVICE))),
        ("router.weights_dtype must be", TypeError,
         lambda: lk.moe_route(z, RouterOptions(2, weights_dtype=torch.int32))),
        ("router_logits must be a tensor or a non-empty", ValueError, lambda: lk.moe_load_balancing_loss([], 2)),
        (r"router_logits\[1\] must be \[tokens, experts\]", ValueError,
         lambda: lk.moe_load_balancing_loss([z, z[:, :4]], 2)),
        ("top_k = 9 exceeds", ValueError, lambda: lk.moe_load_balancing_loss(z, 9)),
        ("attention_mask has 3 tokens", ValueError,
         lambda: lk.moe_load_balancing_loss(z, 2, torch.ones(3, device=DEVICE))),
        ("router_logits must be a floating-point", TypeError, lambda: lk.moe_router_z_loss(z.long())),
    ]


test_bad_input = bad_input_test(_bad_cases)
