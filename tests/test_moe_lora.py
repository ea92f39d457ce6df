"""LoRA on the routed experts (``moe_experts(..., lora=ExpertLora(...))``) against the float64
reference: the output and the gradients of x, the routing weights and every adapter, with the
expert weights frozen (the adapters alone train) or not, both weight layouts, bf16 weights with
float32 adapters (PEFT's default), one projection adapted; bad adapters."""
import pytest
import torch

import llmkernels as lk
from llmkernels import reference_moe
from llmkernels.testing import poisoned
from llmkernels.ops.moe import ExpertLora

from tests.conftest import DEVICE
from tests.helpers import assert_close, bad_input_test
from tests.test_moe import LAYOUTS, TOKENS, make_weights, routed

RANK = 4


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def adapters(n_experts, hidden, inter, dtype, which=("gate_up", "down")):
    """Random A and B (B not zero, as a trained adapter) of each projection in ``which``."""
    shapes = {"gate_up": ((n_experts, RANK, hidden), (n_experts, 2 * inter, RANK)),
              "down": ((n_experts, RANK, inter), (n_experts, hidden, RANK))}
    return {name: tuple((torch.randn(*shape, device=DEVICE) * 0.3).to(dtype).requires_grad_() for shape in shapes[name])
            if name in which else None for name in shapes}


def check_lora(layout, dtype, adapter_dtype, *, frozen=True, which=("gate_up", "down")):
    n_experts, k, hidden, inter, options, biased = LAYOUTS[layout]
    experts = make_weights(n_experts, hidden, inter, options, biased, dtype)
    if frozen:
        experts = {n: w.detach() for n, w in experts.items()}
    pairs = adapters(n_experts, hidden, inter, adapter_dtype, which)
    lora = ExpertLora(pairs["gate_up"], pairs["down"], scale=2.0)
    x = torch.randn(TOKENS, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    index, weights = routed(TOKENS, n_experts, k, dtype)
    out = lk.moe_experts(x, index, weights, **experts, **options, lora=lora)

    leaves = {"x": x, "top_k_weights": weights, **{n: w for n, w in experts.items() if w.requires_grad}}
    for name, pair in pairs.items():
        if pair is not None:
            leaves.update({f"{name}_A": pair[0], f"{name}_B": pair[1]})
    refs = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    ref_experts = {n: refs.get(n, w.detach().double()) for n, w in experts.items()}
    ref_lora = reference_moe.Lora(*((refs[f"{n}_A"], refs[f"{n}_B"]) if pairs[n] is not None else None
                                    for n in ("gate_up", "down")), 2.0)
    opts = {n: v for n, v in options.items() if n != "transposed"}
    ref = reference_moe.experts(refs["x"], index, refs["top_k_weights"], **ref_experts, **opts, lora=ref_lora,
                                transposed=options.get("transposed", False), compute_dtype=torch.float64,
                                model_dtype=dtype)
    assert_close(out, ref, dtype, "out")
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(leaves.values()), d_out)
    ref_grads = torch.autograd.grad(ref, list(refs.values()), d_out.double())
    for (name, leaf), g, r in zip(leaves.items(), grads, ref_grads):
        assert g.dtype == leaf.dtype and (g.stride() == leaf.stride() or name in ("x", "top_k_weights")), name
        assert_close(g, r, dtype, f"d_{name}", scale=2)


@pytest.mark.parametrize("layout", ["qwen", "gpt_oss"])
def test_lora_frozen_experts_fp32(layout):
    check_lora(layout, torch.float32, torch.float32)


def test_lora_bf16_weights_fp32_adapters():
    check_lora("qwen", torch.bfloat16, torch.float32)


@pytest.mark.parametrize("which", [("gate_up",), ("down",)])
def test_lora_on_one_projection_with_trainable_experts(which):
    check_lora("odd", torch.float32, torch.float32, frozen=False, which=which)


def _bad_cases():
    x = torch.randn(4, 8, device=DEVICE)
    index = torch.zeros(4, 2, dtype=torch.long, device=DEVICE)
    w = torch.ones(4, 2, device=DEVICE)
    gu, dn = torch.randn(3, 12, 8, device=DEVICE), torch.randn(3, 8, 6, device=DEVICE)
    a, b = torch.randn(3, 2, 8, device=DEVICE), torch.randn(3, 12, 2, device=DEVICE)

    def call(lora):
        return lambda: lk.moe_experts(x, index, w, gu, dn, lora=lora)

    return [
        ("lora must be an ExpertLora", TypeError, call(((a, b), None, 1.0))),
        ("lora.gate_up must be a pair", TypeError, call(ExpertLora(gate_up=a))),
        (r"lora.gate_up\[0\] and lora.gate_up\[1\] must be A \[3, r, 8\] and B \[3, 12, r\]", ValueError,
         call(ExpertLora(gate_up=(a, b[:, :, :1])))),
        (r"lora.down\[0\] and lora.down\[1\] must be A \[3, r, 6\]", ValueError, call(ExpertLora(down=(a, b)))),
        (r"lora.gate_up\[1\] must be a floating-point", TypeError, call(ExpertLora(gate_up=(a, b.long())))),
        ("lora.scale must be a finite number", ValueError, call(ExpertLora(gate_up=(a, b), scale=float("nan")))),
    ]


test_bad_input = bad_input_test(_bad_cases)
