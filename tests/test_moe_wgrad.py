"""The expert weights' gradients through torch's grouped GEMM (``ops/moe/wgrad.py``): the
offsets and permutation bookkeeping against a float64 per-expert sum of the same contract (token
gather, routing-weight scale rounded first, bias sums, both weight layouts, an expert without
rows, dropped slots poisoned), through torch's own ``_grouped_mm`` where it runs on this device
and through a per-expert matmul loop injected in its place (it may not run on a CPU torch); the
whole layer with the backend against the float64 reference; its choice and its fallback."""
import dataclasses

import pytest
import torch

from llmkernels.ops import _device
from llmkernels.ops.moe import configs, wgrad
from llmkernels.ops.moe.configs import INTERPRETER
from llmkernels.ops.moe.routing import sort_slots
from llmkernels.testing import poisoned

from tests.conftest import DEVICE
from tests.test_moe import LAYOUTS, TOKENS, assert_bitwise_deterministic, check, make_weights, routed

GROUPED = dataclasses.replace(INTERPRETER, weight_grad_backend="grouped_mm")


def loop_gemm(a, b, ends):
    """``wgrad.Gemm`` as a per-expert float64 matmul, rounded once to a's dtype."""
    out, start = [], 0
    for end in ends.tolist():
        out.append((a[:, start:end].double() @ b[start:end].double()).to(a.dtype))
        start = end
    return torch.stack(out)


def _torch_gemm_runs() -> bool:
    op = wgrad.grouped_mm_op()
    if op is None:
        return False
    a = torch.randn(16, 8, device=DEVICE, dtype=torch.bfloat16)
    try:
        op(a.T, a, torch.tensor([3, 8], device=DEVICE, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.fixture(params=["torch", "loop"])
def gemm(request, monkeypatch):
    """The grouped GEMM under test: this torch's (skipped where it does not run on the test
    device), or the loop put in its place."""
    if request.param == "torch":
        if not _torch_gemm_runs():
            pytest.skip(f"torch {torch.__version__}'s grouped GEMM does not run on {DEVICE}")
    else:
        monkeypatch.setattr(wgrad, "grouped_mm_op", lambda: loop_gemm)
    return request.param


def _index(tokens, n_experts, k):
    """Random distinct experts a token, expert 1 given no row, some slots dropped (ids -1 and E)."""
    index = torch.rand(tokens, n_experts, device=DEVICE).argsort(-1)[:, :k]
    index[index == 1] = 0 if k == 1 else n_experts
    index[::4, 0] = -1
    return index


def reference(a_slots, b_slots, index, scale, n_experts):
    """``(dW [E, M, N], d_bias [E, M])`` in float64: per expert, the sum over its slots of
    ``a^T b`` with ``a`` times the slot's weight rounded to bf16 first (the kernel's contract)."""
    flat = index.reshape(-1)
    if scale is not None:
        a_slots = (a_slots.float() * scale[:, None].float()).to(a_slots.dtype)
    dw = torch.stack([a_slots[flat == e].double().T @ b_slots[flat == e].double() for e in range(n_experts)])
    return dw, torch.stack([a_slots[flat == e].double().sum(0) for e in range(n_experts)])


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("step", ["down", "gate_up"])
def test_grouped_weight_grad_matches_per_expert_sums(gemm, step, transposed):
    """d down_proj (a: dy gathered by token and scaled, b: sorted h) and d gate_up_proj (a: sorted
    d(gate, up), b: x gathered): each expert's sum, zeros for the expert without rows, the dropped
    slots' sorted rows (NaN) left out, the gradient in the weight's layout, the bias's sums."""
    tokens, n_experts, k, m, n = 21, 4, 2, 24, 16
    index = _index(tokens, n_experts, k)
    order, offsets, _ = sort_slots(index, n_experts, 16)
    assert offsets[0] == 0 and offsets[-1] < tokens * k  # dropped slots sort last
    slots = torch.arange(tokens * k, device=DEVICE)
    token_rows = torch.randn(tokens, m if step == "down" else n, device=DEVICE).bfloat16()
    slot_rows = torch.randn(tokens * k, n if step == "down" else m, device=DEVICE).bfloat16()
    sorted_rows = slot_rows[order.long()].clone()
    sorted_rows[offsets[-1]:] = float("nan")  # dropped slots' rows: never written by the kernels
    scale = (torch.rand(tokens * k, device=DEVICE) + 0.5) if step == "down" else None
    out_like = torch.randn(n_experts, n, m, device=DEVICE).bfloat16().transpose(1, 2) if transposed else \
        torch.randn(n_experts, m, n, device=DEVICE).bfloat16()
    bias_like = torch.randn(n_experts, m, device=DEVICE).bfloat16()
    if step == "down":
        a, b, a_slots, b_slots, gather = token_rows, sorted_rows, token_rows[slots // k], slot_rows, {"gather_a": True}
    else:
        a, b, a_slots, b_slots, gather = sorted_rows, token_rows, slot_rows, token_rows[slots // k], {"gather_b": True}
    with poisoned():
        dw, db = wgrad.grouped_weight_grad(a, b, order, offsets, k, out_like, scale=scale, bias_like=bias_like,
                                           **gather)
    ref_dw, ref_db = reference(a_slots, b_slots, index, scale, n_experts)
    assert dw.dtype == out_like.dtype and dw.stride() == out_like.stride()
    assert db.dtype == bias_like.dtype and db.shape == bias_like.shape
    assert (dw[1] == 0).all() and (db[1] == 0).all() and ref_dw[1].abs().max() == 0
    a_abs = (a_slots.double().abs() * (1 if scale is None else scale[:, None].double()))
    bound = torch.stack([a_abs[index.reshape(-1) == e].T @ b_slots[index.reshape(-1) == e].double().abs()
                         for e in range(n_experts)])
    # one bf16 rounding of the result, fp32 (torch) or float64 (loop) sums before it
    assert ((dw.double() - ref_dw).abs() <= 2 ** -8 * ref_dw.abs() + 1e-5 * bound).all()
    assert ((db.double() - ref_db).abs() <= 2 ** -8 * ref_db.abs() + 1e-4).all()
    assert ref_dw.abs().max() > 1 and ref_db.abs().max() > 1


@pytest.mark.parametrize("layout", ["qwen", "gpt_oss", "odd"])
@pytest.mark.parametrize("routing", ["random", "empty_and_dropped"])
def test_layer_with_grouped_weight_grads(gemm, monkeypatch, layout, routing):
    """The whole layer (bf16) with ``weight_grad_backend="grouped_mm"`` against the float64
    reference: every gradient, the weights' in their own layout (checked by ``check``); both
    weights' gradients go through torch's GEMM where their widths allow (the odd layout's do
    not: the kernel forms them)."""
    n_experts, k, hidden, inter, options, biased = LAYOUTS[layout]
    if "limit" in options:
        options = dict(options, limit=7.0)  # as test_moe's bf16 case: values well inside the clamp
    calls = []
    real = wgrad.grouped_weight_grad
    monkeypatch.setattr(wgrad, "grouped_weight_grad", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x = torch.randn(TOKENS, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    index, weights = routed(TOKENS, n_experts, k, torch.float32 if biased else torch.bfloat16)
    if routing == "empty_and_dropped":
        index = _index(TOKENS, n_experts, k)
    experts = make_weights(n_experts, hidden, inter, options, biased, torch.bfloat16)
    _, grads = check(x, index, weights, experts, options, torch.bfloat16, config=GROUPED)
    assert len(calls) == (0 if layout == "odd" else 2)
    if routing == "empty_and_dropped":
        assert (grads[2][1] == 0).all() and (grads[3][1] == 0).all()


def test_grouped_weight_grads_bitwise_deterministic(gemm):
    assert_bitwise_deterministic(GROUPED)


def test_usable_only_where_torch_fast_kernel_runs():
    w = torch.zeros(4, 32, 16, dtype=torch.bfloat16)
    assert wgrad.usable(w, torch.bfloat16) and wgrad.usable(w.transpose(1, 2), torch.bfloat16)
    assert wgrad.usable(w, torch.bfloat16, torch.zeros(4, 32, dtype=torch.bfloat16))
    assert not wgrad.usable(w.float(), torch.float32)  # fp32: torch's loop, not its kernel
    assert not wgrad.usable(w, torch.bfloat16, torch.zeros(4, 32))  # an fp32 bias's sums
    assert not wgrad.usable(torch.zeros(4, 30, 16, dtype=torch.bfloat16), torch.bfloat16)  # 60-byte rows
    assert not wgrad.usable(torch.zeros(4, 32, 32, dtype=torch.bfloat16)[:, :, :16], torch.bfloat16)
    assert not wgrad.available(torch.device("cpu"))


@pytest.mark.parametrize("has_torch_gemm", [True, False])
@pytest.mark.parametrize("rows,experts,full", [(16384, 8, True), (65536, 128, True), (4096, 128, False)])
def test_moe_config_chooses_the_backend(monkeypatch, rows, experts, full, has_torch_gemm):
    """Torch's grouped GEMM for full 128-row tiles where the device runs it, else the kernel; a
    backend of another name is refused."""
    monkeypatch.setattr(_device, "model_of", lambda device: _device.REFERENCE)
    monkeypatch.setattr(configs, "available", lambda device: has_torch_gemm)
    config = configs.choose(rows, experts, 2048, 768, torch.device("cuda"))  # (not kept: a fake model)
    assert config.weight_grad_backend == ("grouped_mm" if full and has_torch_gemm else "triton")
    assert configs.choose(rows, experts, 2048, 768, torch.device("cpu")).weight_grad_backend == "triton"
    with pytest.raises(ValueError, match="weight_grad_backend must be one of"):
        dataclasses.replace(INTERPRETER, weight_grad_backend="cutlass")


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "sorted"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, None], ids=["fp32", "bf16", "none"])
def test_sorted_rows_are_torchs_gather_and_scale_bitwise(gather, scale_dtype):
    """One pass (``kernels.sorted_rows_kernel``) gives the rows that index_select and an fp32
    product rounded once give, bit for bit; a NaN stays in its row; a column-strided input is read."""
    tokens, n_experts, k, n = 37, 5, 3, 40
    index = _index(tokens, n_experts, k)
    order, _, _ = sort_slots(index, n_experts, 16)
    rows = tokens if gather else tokens * k
    t = torch.randn(n, rows, device=DEVICE).bfloat16().T  # stride(1) != 1
    t[rows // 2, 3] = float("nan")
    scale = None if scale_dtype is None else (torch.rand(tokens, k, device=DEVICE) + 0.5).to(scale_dtype)
    with poisoned():
        out = wgrad._sorted_rows(t, gather, order, k, scale)
    want = t[order.long() // k] if gather else t.contiguous()
    if scale is not None:
        want = (want.float() * scale.reshape(-1)[order.long()][:, None].float()).bfloat16()
    assert out.is_contiguous() and out.dtype == t.dtype
    assert torch.equal(out.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert out.isnan().sum() == want.isnan().sum() > 0
    if gather or scale is not None:  # (sorted rows without a scale are returned as they are)
        assert wgrad._sorted_rows(t, gather, order[:0], k, scale).shape == (0, n)  # no slots: no launch
