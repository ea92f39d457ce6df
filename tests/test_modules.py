"""The nn.Module drop-ins: each is an instance of the torch class it replaces, keeps its
attributes and state-dict keys, and gives the outputs and gradients of the module it replaces
(torch's or Hugging Face's) on random inputs and weights."""
import copy

import pytest
import torch
from torch import nn

import llmkernels as lk
from llmkernels import reference

from tests.helpers import assert_close

DTYPES = (torch.float32, torch.bfloat16)


def _outputs_and_grads(module, x, dy, *extra):
    """``module(x, *extra)``'s outputs, then the gradients of ``<outputs, dy>`` for x, extra and
    every parameter, as float64 CPU tensors, from fresh leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, *extra)]
    out = module(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(sum((o.double() * d).sum() for o, d in zip(outs, dy)), leaves + params)
    return [o.detach() for o in outs] + list(grads)


def assert_same(mine, theirs, x, dtype, *extra, names=None):
    """Outputs and every gradient of ``mine`` equal those of ``theirs`` at ``dtype``'s tolerance."""
    with torch.no_grad():
        probe = theirs(x, *extra)
    probe = probe if isinstance(probe, tuple) else (probe,)
    dy = [torch.randn(p.shape, dtype=torch.float64, device=x.device) for p in probe]
    got, want = _outputs_and_grads(mine, x, dy, *extra), _outputs_and_grads(theirs, x, dy, *extra)
    names = names or [f"out{i}" for i in range(len(got))]
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, dtype, name)


def random_weight(module, offset=1.0):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + offset)
    return module


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------
def test_rmsnorm_is_a_torch_rmsnorm_with_hf_attributes():
    norm = lk.RMSNorm(64, eps=1e-5)
    assert isinstance(norm, nn.RMSNorm)
    assert list(norm.state_dict()) == ["weight"] == list(nn.RMSNorm(64).state_dict())
    assert norm.normalized_shape == (64,) and norm.elementwise_affine and torch.equal(norm.weight, torch.ones(64))
    assert norm.eps == norm.variance_epsilon == 1e-5
    norm.variance_epsilon = 1e-3
    assert norm.eps == 1e-3
    assert torch.equal(lk.RMSNorm(8, casting="gemma").weight, torch.zeros(8))  # Gemma's weight is 1 + w
    assert "casting='llama'" in repr(norm)
    with pytest.raises(ValueError, match="normalized shape"):
        norm(torch.randn(3, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_matches_hf_llama_rmsnorm(dtype, device):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = random_weight(llama.LlamaRMSNorm(96, eps=1e-5)).to(device)
    mine = lk.RMSNorm(96, eps=1e-5).to(device)
    mine.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 96, device=device, dtype=dtype)
    assert_same(mine, hf, x, dtype, names=["y", "dx", "dweight"])

    converted = lk.RMSNorm.from_llama_rmsnorm(hf)
    assert converted.weight is hf.weight and converted.variance_epsilon == 1e-5
    assert isinstance(converted, nn.RMSNorm) and converted.casting == "llama"
    assert_same(converted, hf, x, dtype, names=["y", "dx", "dweight"])


def test_from_llama_rmsnorm_keeps_gemma_arithmetic(device):
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    hf = random_weight(gemma.GemmaRMSNorm(64, eps=1e-6), offset=0.0).to(device)
    mine = lk.RMSNorm.from_llama_rmsnorm(hf)
    assert mine.casting == "gemma" and mine.weight is hf.weight and mine.eps == 1e-6
    assert_same(mine, hf, torch.randn(4, 64, device=device), torch.float32, names=["y", "dx", "dweight"])


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_from_torch_rmsnorm(eps, dtype, device):
    """Inputs of a small magnitude, so that eps moves the result: eps=None is the epsilon of the
    dtype torch computes in (float32 for 16-bit inputs), read at run time."""
    theirs = random_weight(nn.RMSNorm(80, eps=eps)).to(device)
    mine = lk.RMSNorm.from_llama_rmsnorm(theirs)
    assert mine.weight is theirs.weight and mine.eps is eps and mine.casting == "none"
    x = (torch.randn(6, 80, device=device) * 1e-3).to(dtype)
    assert_same(mine, theirs, x, dtype, names=["y", "dx", "dweight"])
    # ... and that is the float64 definition with that epsilon.
    used = torch.finfo(torch.float32).eps if eps is None else eps
    ref = reference.rms_norm(x, theirs.weight.detach(), eps=used, casting="none", compute_dtype=torch.float64)
    with torch.no_grad():
        assert_close(mine(x), ref, dtype, "y vs float64")
        assert_close(theirs(x), ref, dtype, "torch's y vs float64")


def test_from_torch_rmsnorm_over_two_dims_and_without_weight(device):
    for theirs in (random_weight(nn.RMSNorm((4, 16), eps=1e-6)), nn.RMSNorm(16, elementwise_affine=False)):
        theirs = theirs.to(device)
        mine = lk.RMSNorm.from_llama_rmsnorm(theirs)
        assert mine.normalized_shape == theirs.normalized_shape
        x = torch.randn(3, 2, 4, 16, device=device)
        names = ["y", "dx"] + (["dweight"] if theirs.weight is not None else [])
        assert_same(mine, theirs, x, torch.float32, names=names)


def test_from_llama_rmsnorm_refuses_other_modules():
    with pytest.raises(TypeError, match="module must be a torch.nn.RMSNorm"):
        lk.RMSNorm.from_llama_rmsnorm(nn.Linear(4, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rmsnorm(dtype, device):
    """``(y, h)`` with ``h = x + residual`` and ``y = LlamaRMSNorm(h)``; every gradient."""
    class AddThenNorm(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x, residual):
            h = x + residual
            return reference.rms_norm(h, self.norm.weight, eps=self.norm.eps), h

    mine = random_weight(lk.FusedAddRMSNorm(64)).to(device)
    assert isinstance(mine, nn.RMSNorm) and list(mine.state_dict()) == ["weight"]
    theirs = AddThenNorm(copy.deepcopy(mine))
    x, residual = (torch.randn(5, 64, device=device, dtype=dtype) for _ in range(2))
    assert_same(mine, theirs, x, dtype, residual, names=["y", "h", "dx", "dresidual", "dweight"])


# --------------------------------------------------------------------------------------------
# LayerNorm
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_matches_torch(kwargs, dtype, device):
    # (parameters in the input's dtype, as in a model cast to it: torch's CUDA LayerNorm takes no other)
    theirs = random_weight(nn.LayerNorm(96, **kwargs)).to(device, dtype)
    mine = lk.LayerNorm(96, **kwargs).to(device, dtype)
    assert isinstance(mine, nn.LayerNorm) and list(mine.state_dict()) == list(theirs.state_dict())
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 7, 96, device=device, dtype=dtype)
    assert_same(mine, theirs, x, dtype)


def test_layernorm_over_two_dims(device):
    theirs = random_weight(nn.LayerNorm((3, 32))).to(device)
    mine = lk.LayerNorm((3, 32)).to(device)
    mine.load_state_dict(theirs.state_dict())
    assert_same(mine, theirs, torch.randn(4, 3, 32, device=device), torch.float32, names=["y", "dx", "dw", "db"])
