"""The experts call's host path: the routing metadata (``routing.py``'s one launch for the offsets
and the tile table) against a plain recount, and the aten calls and kernel launches of one
forward and one backward with LoRA pinned, so that a regression (the backward sorting or
rebuilding the tile table again, a new per-call copy) fails here rather than in a GPU profile."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import llmkernels as lk
from llmkernels.ops import _launch
from llmkernels.ops.moe import ExpertLora
from llmkernels.ops.moe.routing import max_tiles, sort_slots, tile_table

from tests.conftest import DEVICE
from tests.test_moe import routed


def expected_tables(index: torch.Tensor, n_experts: int, block_m: int):
    """The order, offsets and tile table counted in Python, slot by slot."""
    flat = index.reshape(-1).tolist()
    key = [e if 0 <= e < n_experts else n_experts for e in flat]
    order = sorted(range(len(flat)), key=lambda s: (key[s], s))
    counts = [key.count(e) for e in range(n_experts)]
    offsets = [sum(counts[:e]) for e in range(n_experts + 1)]
    experts, starts = [], []
    for e in range(n_experts):
        for start in range(offsets[e], offsets[e + 1], block_m):
            experts.append(e)
            starts.append(start)
    n = max_tiles(len(flat), n_experts, block_m)
    assert len(experts) <= n
    return order, offsets, experts + [n_experts] * (n - len(experts)), starts


@pytest.mark.parametrize("case", ["spread", "empty_experts", "dropped", "one_expert", "int32", "many_experts"])
@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_routing_tables_match_a_recount(case, block_m):
    n_experts, k, tokens = (70, 4, 45) if case == "many_experts" else (5, 2, 37)
    index, _ = routed(tokens, n_experts, k)
    if case == "empty_experts":
        index = torch.tensor([0, 2, 4], device=DEVICE)[torch.rand(tokens, 3, device=DEVICE).argsort(-1)[:, :k]]
    elif case == "dropped":
        index[::3, 0] = n_experts
        index[1::4, 1] = -1
        index[2::5, 1] = -7
        index[4::6, 0] = n_experts + 9
    elif case == "one_expert":
        index = torch.full((tokens * 4, 1), 3, device=DEVICE)
    elif case == "int32":
        index = index.int()
    order, offsets, experts, starts = expected_tables(index, n_experts, block_m)
    routing = sort_slots(index, n_experts, block_m)
    assert routing.order.dtype == routing.offsets.dtype == routing.tiles.dtype == torch.int32
    assert routing.order.tolist() == order and routing.offsets.tolist() == offsets
    n = len(experts)
    assert routing.tiles[:n].tolist() == experts and routing.tiles[n:n + len(starts)].tolist() == starts
    assert torch.equal(tile_table(routing.offsets, index.numel(), block_m), routing.tiles)


class AtenCalls(TorchDispatchMode):
    """Counts the aten calls under it, by name."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel launches by kernel name, and launches nothing (the interpreter's own
    tensor copies would count as aten calls; nothing on the host path reads what a kernel writes)."""
    counts = collections.Counter()

    def counting(self, grid, *args):
        counts[self.kernel.fn.__name__] += 1
    monkeypatch.setattr(_launch.Launcher, "__call__", counting)
    return counts


# The aten calls and launches of one layer with LoRA on both projections (x and the routing
# weights take gradients, the expert weights are frozen): the forward's routing is one sort and
# one launch, and the backward reuses it (no sort, no table).
FORWARD_ATEN = {"view": 1, "clamp": 1, "remainder": 1, "sort": 1, "_to_copy": 1, "empty": 8}
BACKWARD_ATEN = {"empty": 5, "empty_like": 5, "zeros": 1, "sum": 1, "_to_copy": 1}
FORWARD_LAUNCHES = {"routing_kernel": 1, "grouped_mm_kernel": 3, "gate_up_kernel": 1, "combine_kernel": 1}
BACKWARD_LAUNCHES = {"grouped_mm_kernel": 3, "down_bwd_kernel": 1, "weight_grad_kernel": 4, "combine_kernel": 1}


def test_lora_layer_host_calls_are_pinned(launches):
    n_experts, k, hidden, inter, r, tokens = 6, 2, 32, 16, 4, 11
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16().requires_grad_()
    index, weights = routed(tokens, n_experts, k, torch.bfloat16)
    index = index.contiguous()  # (as a router's top-k returns it: no copy to flatten)
    gate_up = torch.randn(n_experts, 2 * inter, hidden, device=DEVICE).bfloat16()
    down = torch.randn(n_experts, hidden, inter, device=DEVICE).bfloat16()
    adapters = [torch.randn(shape, device=DEVICE, requires_grad=True) for shape in (
        (n_experts, r, hidden), (n_experts, 2 * inter, r), (n_experts, r, inter), (n_experts, hidden, r))]
    lora = ExpertLora(tuple(adapters[:2]), tuple(adapters[2:]), 2.0)
    with AtenCalls() as forward:
        out = lk.moe_experts(x, index, weights, gate_up, down, lora=lora)
    forward_launches = dict(launches)
    launches.clear()
    d_out = torch.randn_like(out)
    with AtenCalls() as backward:
        torch.autograd.grad(out, [x, weights, *adapters], d_out)
    assert (dict(forward.calls), forward_launches) == (FORWARD_ATEN, FORWARD_LAUNCHES)
    assert (dict(backward.calls), dict(launches)) == (BACKWARD_ATEN, BACKWARD_LAUNCHES)
