"""Several processes (2 ranks: gloo on CPU, NCCL where there are 2 GPUs), each path against one
process in float64: the fused linear losses with a sharded (DTensor) head weight over 5 optimiser
steps, and the vocabulary-parallel cross-entropy (plain group, DTensor logits, a ColwiseParallel
head, the fused-linear form), with ignore_index rows, label smoothing, z-loss, in-place gradients,
sliced and transposed shards, NaN rows, out-of-range targets and bad arguments."""
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import llmkernels
from llmkernels.ops.losses.base import gathered

from .helpers import rel_err, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
STEPS = 5


def _close(got, ref, tol, name):
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def _mesh(world, device):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (world,))


class _AdamW:
    """AdamW over DTensor and plain parameters as a user must run it: one optimizer each, since
    the foreach implementation (PyTorch's default on CUDA; asked for here on the CPU too, where the
    default is a loop that takes any mix) refuses DTensors and plain tensors in one call."""

    def __init__(self, params):
        from torch.distributed.tensor import DTensor

        groups = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
        self.optimizers = [torch.optim.AdamW(group, lr=1e-3, foreach=True) for group in groups if group]

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self):
        for opt in self.optimizers:
            opt.step()


# -- fused linear losses on a sharded head ---------------------------------------------------------
def _head_losses(hidden, weight, target, teacher, upstream):
    """The three fused losses of one batch, summed: cross-entropy (ignore_index rows, label
    smoothing), log-probs times per-row advantages, JSD distillation against a frozen teacher."""
    t_hidden, t_weight = teacher
    ce = llmkernels.linear_cross_entropy(hidden, weight, target, label_smoothing=0.1)
    logp = (llmkernels.linear_log_probs(hidden, weight, target) * upstream).mean()
    jsd = llmkernels.linear_distill_loss(hidden, weight, t_hidden, t_weight, target)
    return ce + logp + jsd


def _sharded_head_rank(rank, world, device, ckpt):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    m, h, v = 6 * world, 16, 37  # V not divisible by the ranks: uneven shards
    w0, teacher_w0 = torch.randn(v, h, generator=g), torch.randn(v, h, generator=g)
    proj0 = torch.randn(h, h + 3, generator=g) / h ** 0.5
    batches = []
    for _ in range(STEPS):
        x, t = torch.randn(m, h, generator=g), torch.randint(0, v, (m,), generator=g)
        t[::3] = -100  # as many ignored rows on every rank: the mean of the ranks' means is the global mean
        batches.append((x.to(device), t.to(device), torch.randn(m, h, generator=g).to(device),
                        (torch.randn(m, generator=g) + 2).to(device)))

    def train(weight, proj, teacher_w, rows, dtype, average):
        opt = _AdamW([weight, proj])
        losses = []
        for x, t, tx, adv in batches:
            opt.zero_grad()
            hidden = (x[rows].to(dtype) @ proj)[:, :h]  # a column slice of a product: strided rows
            args = (hidden, weight, t[rows], (tx[rows].to(dtype), teacher_w), adv[rows].to(dtype))
            loss = checkpoint(_head_losses, *args, use_reentrant=False) if ckpt else _head_losses(*args)
            loss.backward()
            average(proj.grad)
            opt.step()
            losses.append(loss.detach())
        return losses

    def ddp_average(grad):  # the replicated parameter, as DDP averages it
        dist.all_reduce(grad)
        grad /= world

    ref_w, ref_p = (torch.nn.Parameter(p.double().to(device)) for p in (w0, proj0))
    ref_losses = train(ref_w, ref_p, teacher_w0.double().to(device), slice(None), torch.float64, lambda grad: None)
    mesh = _mesh(world, device)
    weight = torch.nn.Parameter(distribute_tensor(w0.to(device), mesh, [Shard(0)]))
    teacher_w = distribute_tensor(teacher_w0.to(device), mesh, [Shard(0)])  # frozen, sharded too
    proj = torch.nn.Parameter(proj0.to(device, copy=True))
    mine = slice(rank * m // world, (rank + 1) * m // world)
    losses = train(weight, proj, teacher_w, mine, torch.float32, ddp_average)
    for step, (got, ref) in enumerate(zip(losses, ref_losses)):
        dist.all_reduce(got)
        assert abs(got.item() / world - ref.item()) <= LOSS_RTOL * abs(ref.item()), (step, got.item() / world, ref)
    _close(weight.grad.full_tensor(), ref_w.grad, GRAD_RTOL, "weight grad (last step)")
    _close(proj.grad, ref_p.grad, GRAD_RTOL, "projection grad (last step)")
    _close(weight.full_tensor(), ref_w, GRAD_RTOL, f"weight after {STEPS} steps")
    _close(proj, ref_p, GRAD_RTOL, f"projection after {STEPS} steps")

    # an fp64 sharded head with fp32 activations (as FSDP2's fp32 parameters with a lower param_dtype):
    # cast, then gathered; the gradient reaches the fp64 shards
    x, t = batches[0][0], batches[0][1]
    ref_w = torch.nn.Parameter(w0.double().to(device))
    llmkernels.linear_cross_entropy(x.double(), ref_w, t).backward()
    master = torch.nn.Parameter(distribute_tensor(w0.double().to(device), mesh, [Shard(0)]))
    llmkernels.linear_cross_entropy(x[mine], master, t[mine]).backward()
    assert master.grad.dtype == torch.float64
    _close(master.grad.full_tensor(), ref_w.grad, GRAD_RTOL, "fp64 head grad through fp32 activations")


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_fused_losses_with_a_sharded_dtensor_head_match_one_process(ckpt):
    run_ranks(_sharded_head_rank, ckpt)


def test_gathered_passes_plain_tensors_and_none_through():
    w = torch.randn(3, 2)
    assert gathered(w) is w and gathered(None) is None


# -- vocabulary-parallel cross-entropy ----------------------------------------------------------------
OPTIONS = [dict(), dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
           dict(reduction="none", label_smoothing=0.2), dict(z_loss=1e-2, inplace_backward=True),
           dict(reduction="none", inplace_backward=True, label_smoothing=0.05)]


# (loss, gradient) relative tolerances against float64; bf16: the inputs' rounding and the output's
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (LOSS_RTOL, GRAD_RTOL), torch.bfloat16: (1e-2, 2e-2)}


def _reference(x, target, upstream, **options):
    """Loss and gradient of the whole logits, one process, float64."""
    options = {k: v for k, v in options.items() if k != "inplace_backward"}
    x = x.double().detach().requires_grad_()
    loss = llmkernels.cross_entropy(x, target, **options)
    loss.backward(upstream.double())
    return loss.detach(), x.grad


def _upstream(reduction, m, g, device):
    return (torch.randn(m, generator=g) if reduction == "none" else torch.tensor(1.7)).to(device)


def _check_shard(x, target, cols, local, dtype, options, upstream, tag, **layout):
    ref_loss, ref_grad = _reference(x, target, upstream, **options)
    local.requires_grad_()
    leaf = local
    if options.get("inplace_backward"):
        local = local * 1  # the gradient is written over this copy, not over the leaf
    loss = llmkernels.vocab_parallel_cross_entropy(local, target, **layout, **options)
    loss.backward(upstream.to(loss.dtype))
    loss_tol, grad_tol = TOLERANCES[dtype]
    _close(loss.double(), ref_loss, loss_tol, f"{tag} loss {options}")
    _close(leaf.grad.double(), ref_grad[:, cols], grad_tol, f"{tag} grad {options}")


def _vocab_parallel_rank(rank, world, device, dtype):
    g = torch.Generator().manual_seed(2)
    m, vk = 11, 48
    v = vk * world
    for options in OPTIONS:
        x = (torch.randn(m, v, generator=g) * 3).to(device, dtype)
        target = torch.randint(0, v, (m,), generator=g).to(device)
        target[3] = target[7] = -100
        target[5] = v - 1  # the last class (on the last rank)
        upstream = _upstream(options.get("reduction", "mean"), m, g, device)
        cols = slice(rank * vk, (rank + 1) * vk)
        # equal shards (default layout): a column slice of the whole logits, strided rows
        _check_shard(x, target, cols, x.clone()[:, cols], dtype, options, upstream, "slice")
        # transposed shard (not unit stride along V: copied) with an explicit layout
        transposed = x[:, cols].t().contiguous().t()
        _check_shard(x, target, cols, transposed, dtype, options, upstream, "transposed", vocab_start=cols.start,
                     vocab_size=v, group=dist.group.WORLD)
    # uneven shards of 48 columns (2 ranks: 27 + 21)
    x = torch.randn(m, 48, generator=g).to(device, dtype)
    target = torch.randint(0, 48, (m,), generator=g).to(device)
    cuts = [0, *(48 * i // world + (3 if i % 2 else -3) for i in range(1, world)), 48]
    cols = slice(cuts[rank], cuts[rank + 1])
    up = _upstream("mean", m, g, device)
    _check_shard(x, target, cols, x[:, cols].clone(), dtype, {}, up, "uneven", vocab_start=cols.start, vocab_size=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32-kernels", "bf16-kernels", "fp64-pytorch"])
def test_vocab_parallel_cross_entropy_matches_one_process(dtype):
    run_ranks(_vocab_parallel_rank, dtype)


def _dtensor_rank(rank, world, device):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = _mesh(world, device)
    g = torch.Generator().manual_seed(3)
    m, v, h = 9, 45, 8  # 45 over 2 ranks: 23 + 22 columns, as DTensor splits them
    x = (torch.randn(m, v, generator=g) * 2).to(device)
    target = torch.randint(0, v, (m,), generator=g).to(device)
    target[1] = -100
    ref_loss, ref_grad = _reference(x, target, torch.tensor(1.0, device=device), label_smoothing=0.1)
    for inplace in (False, True):
        xd = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
        leaf = xd
        if inplace:
            xd = xd * 1
        loss = llmkernels.vocab_parallel_cross_entropy(xd, distribute_tensor(target, mesh, [Replicate()]),
                                                       label_smoothing=0.1, inplace_backward=inplace)
        loss.backward()
        _close(loss.double(), ref_loss, LOSS_RTOL, "DTensor loss")
        _close(leaf.grad.full_tensor().double(), ref_grad, GRAD_RTOL, "DTensor grad")

    for logits, tgt, layout, match in (
            (distribute_tensor(x, mesh, [Replicate()]), target, {}, "logits: a DTensor must be sharded"),
            (distribute_tensor(x, mesh, [Shard(1)]), target, dict(vocab_size=v), "leave them None"),
            (distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(target, mesh, [Shard(0)]), {},
             "target: a DTensor must be replicated")):
        with pytest.raises(ValueError, match=match):
            llmkernels.vocab_parallel_cross_entropy(logits, tgt, **layout)

    # a ColwiseParallel head [B, S, V]: head and input gradients equal one process's, and torch's
    # loss_parallel gives the same loss
    head = torch.nn.Linear(h, v, bias=False).to(device)
    ref_head = torch.nn.Linear(h, v, bias=False).to(device, torch.float64)
    ref_head.load_state_dict(head.state_dict())
    inp = torch.randn(3, 4, h, generator=g).to(device)
    labels = torch.randint(0, v, (3, 4), generator=g).to(device)
    ref_inp = inp.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_head(ref_inp).flatten(0, 1), labels.flatten())
    ref.backward()
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    inp = inp.requires_grad_()
    logits = head(inp)
    loss = llmkernels.vocab_parallel_cross_entropy(logits, labels)
    loss.backward()
    _close(loss.double(), ref.detach(), LOSS_RTOL, "ColwiseParallel loss")
    _close(head.weight.grad.full_tensor().double(), ref_head.weight.grad, GRAD_RTOL, "ColwiseParallel weight grad")
    _close(inp.grad.double(), ref_inp.grad, GRAD_RTOL, "ColwiseParallel input grad")
    with loss_parallel():
        theirs = torch.nn.functional.cross_entropy(head(inp).flatten(0, 1), labels.flatten())
    _close(loss.double(), theirs.full_tensor().double().detach(), LOSS_RTOL, "vs loss_parallel")


def test_vocab_parallel_cross_entropy_of_dtensor_logits_and_colwise_parallel_head():
    run_ranks(_dtensor_rank)


def _linear_rank(rank, world, device, reduction, chunk_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(4)
    m, h, v = 10, 12, 40
    w0, b0 = torch.randn(v, h, generator=g), torch.randn(v, generator=g)
    h0 = torch.randn(m, h, generator=g)
    row_weights = (torch.rand(m, generator=g) + 0.5).to(device)  # reduction="none": an upstream gradient a row
    batches = [torch.randint(0, v, (m,), generator=g).to(device) for _ in range(STEPS)]
    for t in batches:
        t[2] = -100
    rows = slice(rank * v // world, (rank + 1) * v // world)
    mesh = _mesh(world, device)
    options = dict(z_loss=1e-3, label_smoothing=0.1, reduction=reduction)

    def train(params, loss_fn, **layout):
        opt = _AdamW(params)
        losses = []
        for t in batches:
            opt.zero_grad()
            loss = loss_fn(*params[:2], t, params[2], **layout, **options)
            loss = (loss * row_weights.to(loss.dtype)).sum() if reduction == "none" else loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref = [torch.nn.Parameter(p.double().to(device)) for p in (h0, w0, b0)]
    ref_losses = train(ref, llmkernels.linear_cross_entropy)
    plain = [torch.nn.Parameter(p.to(device, copy=True)) for p in (h0, w0[rows], b0[rows])]
    losses = train(plain, llmkernels.vocab_parallel_linear_cross_entropy, vocab_start=rows.start, vocab_size=v,
                   chunk_size=chunk_size)
    dt = [torch.nn.Parameter(h0.to(device, copy=True))] + [
        torch.nn.Parameter(distribute_tensor(p.to(device), mesh, [Shard(0)])) for p in (w0, b0)]
    dt_losses = train(dt, llmkernels.vocab_parallel_linear_cross_entropy, chunk_size=chunk_size)
    for name, got in (("plain", losses), ("DTensor", dt_losses)):
        assert all(math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(got, ref_losses)), (name, got, ref_losses)
    for i, name in enumerate(("hidden", "weight", "bias")):
        whole = slice(None) if i == 0 else rows
        _close(plain[i].detach(), ref[i].detach()[whole], GRAD_RTOL, f"plain {name} after {STEPS} steps")
        _close(plain[i].grad, ref[i].grad[whole], GRAD_RTOL, f"plain {name} grad")
        _close(dt[i].detach().full_tensor() if i else dt[i].detach(), ref[i].detach(), GRAD_RTOL,
               f"DTensor {name} after {STEPS} steps")


@pytest.mark.parametrize("reduction,chunk_size", [("mean", 3), ("sum", None), ("none", None)])
def test_vocab_parallel_linear_cross_entropy_trains_as_one_process(reduction, chunk_size):
    run_ranks(_linear_rank, reduction, chunk_size)


def _contract_rank(rank, world, device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 20, generator=g).to(device)
    v = 20 * world
    target = torch.tensor([0, v - 1, 5, -100, 21, 30], device=device)
    local = x.clone()
    if rank == 0:
        local[2, 3] = math.nan  # in rank 0's shard: row 2 is NaN on every rank, the others are not
    rows = llmkernels.vocab_parallel_cross_entropy(local.requires_grad_(), target, reduction="none")
    rows.sum().backward()
    assert rows[2].isnan() and rows[[0, 1, 4, 5]].isfinite().all() and rows[3] == 0
    assert local.grad[2].isnan().all() and local.grad[[0, 1, 3, 4, 5]].isfinite().all()
    assert (local.grad[3] == 0).all()
    bad = torch.tensor([0, v, 5, -100, 21, 30], device=device)  # V is out of range
    with pytest.raises(ValueError, match=rf"target\[1\] = {v}"):
        llmkernels.vocab_parallel_cross_entropy(x, bad)
    nan_row = llmkernels.vocab_parallel_cross_entropy(x, bad, reduction="none", check_targets=False)
    assert nan_row[1].isnan() and nan_row[[0, 2, 4, 5]].isfinite().all()
    for kwargs, error, name in ((dict(reduction="avg"), ValueError, "reduction"),
                                (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
                                (dict(vocab_start=1.0), TypeError, "vocab_start"),
                                (dict(vocab_size=-3), ValueError, "vocab_size"),
                                (dict(vocab_start=v - 10), ValueError, "vocab_start"),
                                (dict(ignore_index=None), TypeError, "ignore_index")):
        with pytest.raises(error, match=name):
            llmkernels.vocab_parallel_cross_entropy(x, target, **kwargs)
    with pytest.raises(ValueError, match="target must have shape"):
        llmkernels.vocab_parallel_cross_entropy(x, target[:3])
    with pytest.raises(TypeError, match="logits"):
        llmkernels.vocab_parallel_cross_entropy(x.long(), target)
    with pytest.raises(TypeError, match="weight"):
        llmkernels.vocab_parallel_linear_cross_entropy(x, x.double(), target)


def test_vocab_parallel_cross_entropy_contract():
    run_ranks(_contract_rank)


def test_vocab_parallel_cross_entropy_in_one_process_is_cross_entropy(device):
    # without torch.distributed initialized, one process holds the whole vocabulary
    x = torch.randn(8, 3, 50, device=device) * 2
    target = torch.randint(0, 50, (8, 3), device=device)
    target[0, 1] = -100
    ref = x.clone().requires_grad_()
    want = llmkernels.cross_entropy(ref.flatten(0, 1), target.flatten(), reduction="none", label_smoothing=0.1)
    want.backward(torch.arange(24.0, device=device))
    mine = x.clone().requires_grad_()
    got = llmkernels.vocab_parallel_cross_entropy(mine, target, reduction="none", label_smoothing=0.1)
    assert got.shape == (8, 3)
    got.backward(torch.arange(24.0, device=device).view(8, 3), retain_graph=True)
    _close(got.flatten(), want.detach(), 1e-6, "loss")
    _close(mine.grad, ref.grad, 1e-6, "grad")
    mine.grad = None
    got.backward(torch.arange(24.0, device=device).view(8, 3))  # the default keeps no state: again
    _close(mine.grad, ref.grad, 1e-6, "grad, second backward")

    logits = x.clone().requires_grad_()
    written = logits * 1
    loss = llmkernels.vocab_parallel_cross_entropy(written, target, inplace_backward=True)
    loss.backward(retain_graph=True)
    assert not torch.equal(written, logits)  # the gradient went over the logits
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()
