"""Vocabulary-parallel cross-entropy over K ranks: llmkernels against PyTorch's ``loss_parallel``
and against gathering the logits, forward + backward: time, peak memory per rank, and agreement
with an fp32 one-process reference.

    torchrun --standalone --nproc-per-node 4 benchmarks/vocab_parallel.py --out-dir $OUT
    TRITON_INTERPRET=1 torchrun --standalone --nproc-per-node 2 benchmarks/vocab_parallel.py --tokens 64 \\
        --vocab 1000 --hidden 32 --iters 2 --out /tmp/vp.json                       # CPU, gloo

Each rank holds ``[M, V / K]`` bf16 logits (its columns; every rank the same M targets, a tenth of
them ignore_index). Providers, each timed on fresh logits every iteration (the copy is outside the
timed span):
  llmkernels          ``vocab_parallel_cross_entropy(local, target, group=...)``: one all-gather of
                      ``[M, 3]`` fp32, the gradient in a new buffer in the backward
  llmkernels_inplace  the same with ``inplace_backward=True`` (gradient over the logits)
  loss_parallel       ``F.cross_entropy`` of the ``Shard(1)`` DTensor under
                      ``torch.distributed.tensor.parallel.loss_parallel()``
  gathered            the DTensor's ``full_tensor()`` ([M, V] on every rank), then ``F.cross_entropy``
  linear_llmkernels   ``vocab_parallel_linear_cross_entropy(hidden, weight rows, target)``, the
                      head ``[V / K, H]`` per rank (hidden's gradient all-reduced)
  linear_gathered     ``llmkernels.linear_cross_entropy(hidden, weight)`` with the weight a
                      ``Shard(0)`` DTensor, gathered for the call (``[V, H]`` on every rank)
Time: CUDA events around each iteration's forward + backward (the ranks meet at the all-gather),
median over ``--iters`` of the slowest rank; memory: peak allocated during one forward + backward
above what was allocated before it (the input logits / head are already there), the largest rank.
Writes ``vocab-parallel-<device>-<K>gpu-<date>.json`` (or ``--out``), with world_size, the card,
versions and the date.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_train  # noqa: E402  (the distributed helpers and the result names)

PROVIDERS = ("llmkernels", "llmkernels_inplace", "loss_parallel", "gathered", "linear_llmkernels",
             "linear_gathered")


def _inputs(args, rank, world, device):
    """(logits shard [M, V_k], whole-logits columns of this rank, target [M], hidden [M, H], head rows
    [V_k, H], whole head [V, H]); every rank the same random whole tensors (same seed)."""
    g = torch.Generator(device=device).manual_seed(0)
    v_k = -(-args.vocab // world)  # DTensor's split: ceil(V / K) columns a rank, the last fewer
    cols = slice(min(rank * v_k, args.vocab), min((rank + 1) * v_k, args.vocab))
    target = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    target[:: 10] = -100
    hidden = torch.randn(args.tokens, args.hidden, device=device, generator=g, dtype=torch.float32)
    head = torch.randn(args.vocab, args.hidden, device=device, generator=g) / args.hidden ** 0.5
    logits = (hidden @ head[cols].t()).to(args.dtype)
    return logits, cols, target, hidden.to(args.dtype), head[cols].to(args.dtype), head


def _step(provider, args, mesh, x, target, hidden, head_rows):
    """One forward + backward of ``provider`` on fresh inputs; returns (loss, grad of the rank's
    logits or head rows, grad of hidden or None)."""
    import llmkernels
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    group = mesh.get_group() if mesh is not None else None
    if provider.startswith("linear"):
        h = hidden.detach().requires_grad_()
        if provider == "linear_llmkernels":
            w = head_rows.detach().requires_grad_()
            loss = llmkernels.vocab_parallel_linear_cross_entropy(h, w, target, group=group, vocab_size=args.vocab,
                                                                  vocab_start=args.cols.start)
            leaf = w
        else:
            leaf = DTensor.from_local(head_rows.detach(), mesh, [Shard(0)], run_check=False,
                                      shape=(args.vocab, args.hidden),
                                      stride=(args.hidden, 1)).requires_grad_()
            loss = llmkernels.linear_cross_entropy(h, leaf, target)
        loss.backward()
        grad = leaf.grad.to_local() if isinstance(leaf.grad, DTensor) else leaf.grad
        return loss.detach(), grad, h.grad
    leaf = x.detach().requires_grad_()
    if provider in ("llmkernels", "llmkernels_inplace"):
        # in place: a view of the leaf takes the gradient over the logits (as a head's output would), no copy
        logits = leaf.view_as(leaf) if provider == "llmkernels_inplace" else leaf
        loss = llmkernels.vocab_parallel_cross_entropy(logits, target, group=group, vocab_size=args.vocab,
                                                       vocab_start=args.cols.start,
                                                       inplace_backward=provider == "llmkernels_inplace")
    else:
        dt = DTensor.from_local(leaf, mesh, [Shard(1)], run_check=False, shape=(args.tokens, args.vocab),
                                stride=(args.vocab, 1))
        if provider == "loss_parallel":
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(dt, target)
                loss.backward()
            return loss.full_tensor().detach(), leaf.grad, None
        loss = torch.nn.functional.cross_entropy(dt.full_tensor(), target)
    loss.backward()
    return loss.detach(), leaf.grad, None


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _reference(args, mesh, logits, target, hidden, head, cols):
    """fp32 loss and gradients of the whole problem, one process (every rank computes it): the
    logits as the providers see them (gathered exactly), the head rounded as theirs is."""
    from torch.distributed.tensor import DTensor, Shard

    full = DTensor.from_local(logits, mesh, [Shard(1)], run_check=False, shape=(args.tokens, args.vocab),
                              stride=(args.vocab, 1)).full_tensor().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(full, target)
    loss.backward()
    h = hidden.float().requires_grad_()
    w = head.to(hidden.dtype).float().requires_grad_()
    torch.nn.functional.cross_entropy(h @ w.t(), target).backward()
    return loss.item(), full.grad[:, cols].clone(), w.grad[cols].clone(), h.grad


def run(args) -> dict | None:
    rank, world, device = e2e_train.init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    cuda = device.type == "cuda"
    x0, args.cols, target, hidden, head_rows, head = _inputs(args, rank, world, device)
    ref_loss, ref_dx, ref_dw, ref_dh = _reference(args, mesh, x0, target, hidden, head, args.cols)
    del head
    results = []
    for provider in args.providers.split(","):
        entry = {"provider": provider}
        try:
            times = []
            for i in range(args.warmup + args.iters):
                x = x0.clone()
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    t0 = time.perf_counter()
                loss, grad, dh = _step(provider, args, mesh, x, target, hidden, head_rows)
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    ms = start.elapsed_time(end)
                else:
                    ms = 1e3 * (time.perf_counter() - t0)
                if i >= args.warmup:
                    times.append(ms)
                del x, grad, dh
            x = x0.clone()
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss, grad, dh = _step(provider, args, mesh, x, target, hidden, head_rows)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
            linear = provider.startswith("linear")
            errs = [abs(loss.float().item() - ref_loss) / abs(ref_loss), _rel(grad, ref_dw if linear else ref_dx),
                    _rel(dh, ref_dh) if dh is not None else 0.0]
            stats = torch.tensor([statistics.median(times), min(times), peak, *errs], dtype=torch.float64,
                                 device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak and error
            entry.update(ms_median=stats[0].item(), ms_min=stats[1].item(),
                         peak_mem_gib=None if not cuda else stats[2].item(), loss=loss.float().item(),
                         loss_rel_err=stats[3].item(), grad_rel_err=stats[4].item(),
                         hidden_grad_rel_err=stats[5].item() if linear else None)
            del x, grad, dh
        except Exception as e:  # a provider that fails is recorded; the others still run
            entry["error"] = f"{type(e).__name__}: {e}"[:1500]
        if rank == 0:
            print(json.dumps(entry), flush=True)
        results.append(entry)
    if rank != 0:
        return None
    env = e2e_train.environment(device.type, world)
    return {"benchmark": "vocabulary-parallel cross-entropy, forward + backward", "world_size": world,
            "device": env["device"], "environment": env,
            "shape": {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": str(args.dtype),
                      "ignored_rows": "every tenth", "iters": args.iters, "warmup": args.warmup},
            "reference": {"loss": ref_loss, "what": "fp32 F.cross_entropy of the whole logits, one process"},
            "providers": results}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048, help="H of the linear providers (the 1.28B Llama's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--out-dir", help="write vocab-parallel-<device>-<K>gpu-<date>.json into this folder")
    args = p.parse_args()
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    result = run(args)
    if result is not None:
        out = args.out or (args.out_dir and os.path.join(args.out_dir, e2e_train.result_name(
            "vocab-parallel", result["device"], result["world_size"], result["environment"]["date"])))
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {out}")
    e2e_train.exit_distributed()


if __name__ == "__main__":
    main()
