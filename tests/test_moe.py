"""The routed experts (``moe_experts``) against the float64 reference, expert by expert: the
output and every gradient (x, routing weights, expert weights, biases) under an upstream gradient
that is not 1, bf16 and fp32, both weight layouts (Mixtral / Qwen ``[E, 2I, H]`` and gpt-oss's
transposed, interleaved, biased, clamped SwiGLU), odd sizes, strided inputs; the routing corner
cases (empty experts, every token on one expert, top-k = E, dropped slots); bitwise determinism;
outputs poisoned with NaN before the kernels write them; bad input."""
import pytest
import torch

import llmkernels as lk
from llmkernels import reference_moe
from llmkernels.testing import poisoned
from llmkernels.ops._triton import tl, triton
from llmkernels.ops.moe import GemmTiles, MoeConfig, kernels
from llmkernels.ops.moe.configs import CombineTiles

from tests.conftest import DEVICE
from tests.helpers import assert_close, bad_input_test

# name -> experts, top-k, hidden, intermediate, options of moe_experts, biases
LAYOUTS = {
    "qwen": (4, 2, 32, 16, dict(activation="silu"), False),
    "gpt_oss": (4, 2, 32, 16, dict(activation="clamped_swiglu", interleaved=True, transposed=True, alpha=1.702,
                                   limit=1.5), True),
    "odd": (3, 2, 23, 13, dict(activation="silu"), False),
}
TOKENS = 13


@pytest.fixture(autouse=True)
def _poison():
    with poisoned():
        yield


def make_weights(n_experts, hidden, inter, options, biased, dtype):
    """Expert weights in their storage layout (gpt-oss's transposed one too), gate/up scaled so
    that the clamped SwiGLU's limits are crossed."""
    gate_up = torch.randn(n_experts, 2 * inter, hidden, device=DEVICE) * 1.5 * hidden ** -0.5
    down = torch.randn(n_experts, hidden, inter, device=DEVICE) * inter ** -0.5
    if options.get("transposed"):
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    weights = {"gate_up_proj": gate_up, "down_proj": down}
    if biased:
        weights.update(gate_up_bias=torch.randn(n_experts, 2 * inter, device=DEVICE) * 0.5,
                       down_bias=torch.randn(n_experts, hidden, device=DEVICE) * 0.5)
    return {name: w.to(dtype).requires_grad_() for name, w in weights.items()}


def routed(tokens, n_experts, k, weights_dtype=torch.float32):
    """Each token's k distinct experts (random) and positive weights."""
    index = torch.rand(tokens, n_experts, device=DEVICE).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, device=DEVICE) + 0.1
    return index, weights.to(weights_dtype).requires_grad_()


def check(x, index, weights, experts, options, dtype, *, config=None):
    """moe_experts against the float64 reference: the output and every gradient."""
    out = lk.moe_experts(x, index, weights, **experts, **options, config=config)
    leaves = {"x": x, "top_k_weights": weights, **experts}
    refs = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    ref_experts = {n: refs[n] for n in experts}
    opts = {n: v for n, v in options.items() if n != "transposed"}
    ref = reference_moe.experts(refs["x"].reshape(-1, x.shape[-1]), index.reshape(-1, index.shape[-1]),
                                refs["top_k_weights"].reshape(-1, index.shape[-1]), **ref_experts, **opts,
                                transposed=options.get("transposed", False), compute_dtype=torch.float64,
                                model_dtype=dtype)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, ref.view(out.shape), dtype, "out")
    d_out = torch.randn_like(out) * 3
    grads = torch.autograd.grad(out, list(leaves.values()), d_out)
    ref_grads = torch.autograd.grad(ref, list(refs.values()), d_out.double().view(ref.shape))
    for (name, leaf), g, r in zip(leaves.items(), grads, ref_grads):
        assert g.dtype == leaf.dtype, name
        if name.endswith("_proj"):  # written in the weight's own layout: no copy when .grad accumulates
            assert g.stride() == leaf.stride(), name
        assert_close(g, r, dtype, f"d_{name}", scale=2)
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_match_reference(layout, dtype):
    n_experts, k, hidden, inter, options, biased = LAYOUTS[layout]
    if dtype == torch.bfloat16 and "limit" in options:
        # one bf16 ulp decides whether a value near the limit is clamped (and its gradient zero):
        # the clamps are checked in fp32, bf16 keeps the values well inside them
        options = dict(options, limit=7.0)
    x = torch.randn(TOKENS, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    index, weights = routed(TOKENS, n_experts, k, torch.float32 if biased else dtype)
    check(x, index, weights, make_weights(n_experts, hidden, inter, options, biased, dtype), options, dtype)


@pytest.mark.parametrize("case", ["empty_experts", "one_expert", "top_k_all", "dropped", "int32"])
def test_routing_corner_cases(case):
    n_experts, k, hidden, inter = 5, 2, 32, 16
    index, weights = routed(TOKENS, n_experts, k)
    if case == "empty_experts":  # experts 1 and 3 get no token
        index = torch.tensor([0, 2, 4], device=DEVICE)[torch.rand(TOKENS, 3, device=DEVICE).argsort(-1)[:, :k]]
    elif case == "one_expert":
        index, weights = routed(TOKENS, n_experts, 1)
        index = torch.full_like(index, 3)
    elif case == "top_k_all":
        index, weights = routed(TOKENS, n_experts, n_experts)
    elif case == "dropped":  # slots of experts outside [0, E): expert parallelism's other ranks
        index[::3, 0] = n_experts
        index[1::4, 1] = -1
    else:
        index = index.int()
    x = torch.randn(TOKENS, hidden, device=DEVICE, requires_grad=True)
    _, grads = check(x, index, weights, make_weights(n_experts, hidden, inter, {}, False, torch.float32), {},
                     torch.float32)
    if case == "dropped":
        assert (grads[1][::3, 0] == 0).all() and (grads[1][1::4, 1] == 0).all()


def test_strided_inputs_and_weights():
    """x a slice of a wider tensor with batch dims, index and weights transposed views, weights
    stored column-major: read in place, gradients in each leaf's own layout."""
    n_experts, k, hidden, inter = 4, 2, 32, 16
    x = torch.randn(2, 7, hidden + 8, device=DEVICE)[..., 4:4 + hidden].requires_grad_()
    index = torch.rand(2, 7, n_experts, device=DEVICE).argsort(-1)[..., :k].transpose(0, 1).contiguous().transpose(0, 1)
    weights = (torch.rand(k, 7, 2, device=DEVICE) + 0.1).permute(2, 1, 0).requires_grad_()
    experts = {"gate_up_proj": (torch.randn(n_experts, hidden, 2 * inter, device=DEVICE) * hidden ** -0.5)
               .transpose(1, 2).requires_grad_(),
               "down_proj": (torch.randn(n_experts, inter, hidden, device=DEVICE) * inter ** -0.5)
               .transpose(1, 2).requires_grad_()}
    check(x, index, weights, experts, {}, torch.float32)


def test_biases_in_any_layout():
    """A column-major down bias and a gate/up bias expanded over the experts (the fuzzer found a
    column-major bias read as row-major)."""
    n_experts, k, hidden, inter, options, _ = LAYOUTS["gpt_oss"]
    experts = make_weights(n_experts, hidden, inter, options, False, torch.float32)
    experts["down_bias"] = torch.randn(hidden, n_experts, device=DEVICE).T.requires_grad_()
    experts["gate_up_bias"] = torch.randn(1, 2 * inter, device=DEVICE).expand(n_experts, -1).requires_grad_()
    x = torch.randn(TOKENS, hidden, device=DEVICE, requires_grad=True)
    index, weights = routed(TOKENS, n_experts, k)
    check(x, index, weights, experts, options, torch.float32)


@pytest.mark.parametrize("group_m", [1, 3])
def test_small_tiles_span_rows_columns_and_steps(group_m):
    """tl.dot's smallest tiles over 30 tokens: experts spanning several row tiles (the last one
    ragged), several column tiles and K steps in every kernel (the interpreter's default tiles
    hold these shapes whole); row tiles in groups of 3 too, which divides no tile count here."""
    n_experts, k, hidden, inter = 3, 2, 40, 24
    gemm = GemmTiles(16, 16, 16, 4, 1, group_m)
    config = MoeConfig(gemm, gemm, gemm, gemm, CombineTiles(4, 16, 4))
    x = torch.randn(30, hidden, device=DEVICE, requires_grad=True)
    index, weights = routed(30, n_experts, k)
    check(x, index, weights, make_weights(n_experts, hidden, inter, {}, True, torch.float32), {}, torch.float32,
          config=config)


@triton.jit
def _tiles_of(OUT, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = kernels._swizzled(pid, m_tiles, n_tiles, GROUP_M)
    tl.store(OUT + 2 * pid, pid_m)
    tl.store(OUT + 2 * pid + 1, pid_n)


@pytest.mark.parametrize("m_tiles, n_tiles, group_m", [(7, 5, 3), (8, 4, 4), (1, 9, 8), (10, 1, 4), (6, 6, 1)])
def test_swizzled_tiles_cover_the_grid_once(m_tiles, n_tiles, group_m):
    """Every (row tile, column tile) is one program's, whatever the group divides; a group's row
    tiles take column tile 0 first; group 1 is row-major."""
    out = torch.full((m_tiles * n_tiles, 2), -1, dtype=torch.int32, device=DEVICE)
    _tiles_of[(m_tiles * n_tiles,)](out, m_tiles, n_tiles, GROUP_M=group_m)
    pairs = [tuple(p) for p in out.tolist()]
    assert sorted(pairs) == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]
    first = min(group_m, m_tiles)
    assert pairs[:first] == [(i, 0) for i in range(first)]
    if group_m == 1:
        assert pairs == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]


def assert_bitwise_deterministic(config=None):
    """Two calls (bf16, gpt-oss's layout) give the same output and gradients, bit for bit."""
    n_experts, k, hidden, inter, options, biased = LAYOUTS["gpt_oss"]
    x = torch.randn(TOKENS, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    index, weights = routed(TOKENS, n_experts, k)
    experts = make_weights(n_experts, hidden, inter, options, biased, torch.bfloat16)
    d_out = torch.randn(TOKENS, hidden, device=DEVICE, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        out = lk.moe_experts(x, index, weights, **experts, **options, config=config)
        runs.append((out, *torch.autograd.grad(out, [x, weights, *experts.values()], d_out)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bitwise_deterministic():
    assert_bitwise_deterministic()


def test_no_grad_call_and_frozen_weights():
    """Without gradients the call records nothing; with the expert weights frozen only dx and the
    routing weights' gradient are formed (LoRA's base)."""
    n_experts, k, hidden, inter = 4, 2, 32, 16
    experts = make_weights(n_experts, hidden, inter, {}, False, torch.float32)
    x = torch.randn(TOKENS, hidden, device=DEVICE)
    index, weights = routed(TOKENS, n_experts, k)
    with torch.no_grad():
        out = lk.moe_experts(x, index, weights, **experts)
    assert out.grad_fn is None
    ref = reference_moe.experts(x.double(), index, weights.double(), *(w.double() for w in experts.values()),
                                compute_dtype=torch.float64)
    assert_close(out, ref, torch.float32, "out")
    frozen = {n: w.detach() for n, w in experts.items()}
    x.requires_grad_()
    out = lk.moe_experts(x, index, weights, **frozen)
    dx, dw = torch.autograd.grad(out, [x, weights], torch.ones_like(out))
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


def test_float64_and_empty_batch_take_the_reference():
    experts = make_weights(3, 16, 8, {}, False, torch.float64)
    x = torch.randn(5, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    index, weights = routed(5, 3, 2, torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: lk.moe_experts(x, index, w, **experts), (x, weights))
    empty = lk.moe_experts(x[:0].float(), index[:0], weights[:0].float(),
                           **{n: w.float() for n, w in experts.items()})
    assert empty.shape == (0, 16)


def _bad_cases():
    x = torch.randn(4, 8, device=DEVICE)
    index = torch.zeros(4, 2, dtype=torch.long, device=DEVICE)
    w = torch.ones(4, 2, device=DEVICE)
    gu, dn = torch.randn(3, 12, 8, device=DEVICE), torch.randn(3, 8, 6, device=DEVICE)

    def call(**kw):
        args = dict(x=x, top_k_index=index, top_k_weights=w, gate_up_proj=gu, down_proj=dn)
        return lambda: lk.moe_experts(**{**args, **kw})

    return [
        ("x must be a torch.Tensor", TypeError, call(x=[1.0])),
        ("x must be \\[..., hidden\\]", ValueError, call(x=x[0])),
        ("top_k_index must be int32 or int64", TypeError, call(top_k_index=index.to(torch.int16))),
        ("top_k_index must have shape \\[4\\] \\+ \\[k\\]", ValueError, call(top_k_index=index[:3])),
        ("top_k_weights shape \\[4, 1\\] must equal", ValueError, call(top_k_weights=w[:, :1])),
        ("top_k_weights must be a floating-point", TypeError, call(top_k_weights=index)),
        ("gate_up_proj dtype torch.bfloat16 must equal x dtype", TypeError, call(gate_up_proj=gu.bfloat16())),
        ("down_proj must be 3-D", ValueError, call(down_proj=dn[0])),
        ("expert weights must be gate_up_proj \\[E, 2I, H\\]", ValueError, call(gate_up_proj=gu[:, :10])),
        ("expert weights must be", ValueError, call(transposed=True)),
        ("gate_up_bias must have shape \\[3, 12\\]", ValueError, call(gate_up_bias=torch.zeros(3, 6, device=DEVICE))),
        ("down_bias dtype", TypeError, call(down_bias=torch.zeros(3, 8, device=DEVICE, dtype=torch.float64))),
        ("activation must be one of", ValueError, call(activation="relu")),
        ("limit must be a finite number", ValueError, call(limit=float("inf"))),
        ("interleaved and transposed must be bools", TypeError, call(interleaved=1)),
        ("config must be a MoeConfig", TypeError, call(config=(16, 16))),
        ("top_k_index is on meta but x is on", ValueError, call(top_k_index=index.to("meta"))),
    ]


test_bad_input = bad_input_test(_bad_cases)


@pytest.mark.parametrize("rows,experts,hidden,inter", [(16384, 8, 4096, 14336), (65536, 128, 2048, 768),
                                                       (4096, 128, 2048, 768), (64, 8, 4096, 14336)])
def test_moe_config_on_a_gpu_model(monkeypatch, rows, experts, hidden, inter):
    """The GPU choice, on the reference H100 model: full 128-row tiles take the wide, grouped tiles;
    fewer rows an expert keep narrow, ungrouped ones; every choice's shared memory fits and its
    forward fills the multiprocessors unless its columns are already at the minimum."""
    from llmkernels.ops import _device
    from llmkernels.ops.moe import configs
    from llmkernels.ops.moe.routing import max_tiles
    monkeypatch.setattr(_device, "model_of", lambda device: _device.REFERENCE)
    config = configs.choose(rows, experts, hidden, inter, torch.device("cuda"))  # (not kept: a fake model)
    full = configs.row_block(rows / experts) == 128
    assert (config.gate_up.group_m, config.down.group_m) == ((8, 8) if full else (1, 1))
    programs = 2 * _device.REFERENCE.sms
    tiles = max_tiles(rows, experts, config.gate_up.block_m)
    for gemm, width in ((config.gate_up, inter), (config.down, hidden)):
        assert gemm.block_n >= configs.MIN_BLOCK_N and gemm.num_stages >= 2
        assert gemm.block_n == configs.MIN_BLOCK_N or tiles * -(-width // gemm.block_n) >= programs
    if full:  # both full cases here have tiles enough for the measured widths
        assert (config.gate_up.block_n, config.down.block_n, config.weight_grad.block_k) == (128, 256, 64)
