"""torch.compile of patched models: ``fullgraph=True`` (any graph break raises) gives the eager
result, forward and backward; and ``torch.library.opcheck`` of the norm and GLU custom ops. On CPU the
``aot_eager`` backend needs no C++ compiler, and the custom ops run the real kernels through
Triton's interpreter; on CUDA the default (inductor) backend is used."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import llmkernels  # noqa: E402
from llmkernels import hf  # noqa: E402
from llmkernels.ops.norm import NormOptions  # noqa: E402

from tests.conftest import DEVICE  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.test_hf import batch, make_model  # noqa: E402

BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    hf.unpatch_all()


def _loss_and_grads(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_neox"])
def test_compiled_patched_model_matches_eager(model_type):
    """Llama (llama casting), Gemma 2 (gemma casting, softcapped loss), GPT-NeoX (LayerNorm,
    partial rotary): the compiled patched model matches the eager unpatched one."""
    torch.manual_seed(0)
    model = make_model(model_type).train()
    ids, labels = batch(0)
    ref_loss, ref_grads = _loss_and_grads(model, ids, labels)
    with torch.no_grad():
        ref_logits = model.eval()(input_ids=ids).logits

    patched = copy.deepcopy(model).train()
    llmkernels.patch(patched)
    compiled = torch.compile(patched, fullgraph=True, backend=BACKEND)
    loss, grads = _loss_and_grads(compiled, ids, labels)
    with torch.no_grad():
        logits = compiled.eval()(input_ids=ids).logits

    assert rel_err(logits, ref_logits) < 1e-5
    assert rel_err(loss, ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-4, f"grad {name}: rel err {rel_err(g, ref_grads[name]):.2e}"


@pytest.mark.parametrize("residual", [False, True])
def test_norm_custom_ops_opcheck(residual):
    """Schema, fake (meta) kernels, autograd registration and dispatch of llmkernels::norm_fwd /
    norm_bwd, on the arguments the public functions pass them."""
    m, n = 6, 32
    x = torch.randn(m, n, device=DEVICE, requires_grad=True)
    w = torch.randn(n, device=DEVICE, requires_grad=True)
    r = torch.randn(m, n, device=DEVICE, requires_grad=True) if residual else None
    options = NormOptions(is_rms=True, round_x_hat=True, heads=1, eps=1e-6, weight_offset=0.0, out_dtype=torch.float32,
                          h_dtype=torch.float32 if residual else None, x_dtype=torch.float32,
                          res_dtype=torch.float32 if residual else None, bias_dtype=None)
    fwd_args = (x, w, None, r, *options)
    torch.library.opcheck(torch.ops.llmkernels.norm_fwd.default, fwd_args)
    with torch.no_grad():  # norm_bwd is not differentiable (no double backward)
        _, h, _, rstd = torch.ops.llmkernels.norm_fwd(*fwd_args)
    xin = (h if residual else x).detach()
    dy = torch.randn(m, n, device=DEVICE)
    bwd_args = (dy, dy.clone() if residual else None, xin, w.detach(), None, rstd, *options)
    torch.library.opcheck(torch.ops.llmkernels.norm_bwd.default, bwd_args)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_custom_ops_opcheck(activation):
    """llmkernels::glu_fwd / glu_bwd, with up a strided half of a fused gate_up tensor."""
    m, n = 6, 32
    gate = torch.randn(m, n, device=DEVICE, requires_grad=True)
    up = torch.randn(m, 2 * n, device=DEVICE)[:, n:].requires_grad_()
    torch.library.opcheck(torch.ops.llmkernels.glu_fwd.default, (gate, up, activation))
    dy = torch.randn(m, n, device=DEVICE)
    torch.library.opcheck(torch.ops.llmkernels.glu_bwd.default, (dy, gate.detach(), up.detach(), activation))


LOSSES = {  # (loss of (hidden, weight, target)): the losses that check their targets
    "cross_entropy": lambda h, w, t: llmkernels.cross_entropy(h @ w.T, t),
    "linear_cross_entropy": lambda h, w, t: llmkernels.linear_cross_entropy(h, w, t),
    "linear_log_probs": lambda h, w, t: llmkernels.linear_log_probs(h, w, t, return_entropy=True)[1].sum(),
    "linear_log_probs_fp32_logits": lambda h, w, t: llmkernels.linear_log_probs(
        h, w, t, return_entropy=True, logits_dtype=torch.float32)[1].sum(),
    "linear_distill_loss": lambda h, w, t: llmkernels.linear_distill_loss(h, w, h.detach(), 2 * w.detach(), t),
}


@pytest.mark.parametrize("loss", LOSSES)
def test_plain_pytorch_losses_compile_fullgraph_with_the_target_check(loss):
    """The plain-PyTorch path (float64 takes it on every device, as a machine without a GPU does
    for every dtype) under fullgraph compile: its target check is an op of the graph, so a bad
    target still raises ValueError when the compiled code runs."""
    h = torch.randn(8, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (8,), device=DEVICE)
    compiled = torch.compile(LOSSES[loss], fullgraph=True, backend=BACKEND)
    out = compiled(h, w, t)
    assert rel_err(out, LOSSES[loss](h, w, t)) < 1e-12
    out.backward()
    assert h.grad is not None and w.grad is not None
    bad = t.clone()
    bad[3] = 77
    with pytest.raises(ValueError, match=r"target\[3\] = 77 is outside \[0, 50\)"):
        compiled(h, w, bad)
