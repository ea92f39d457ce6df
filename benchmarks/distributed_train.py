"""Train a small llmkernels-patched Llama under DDP and FSDP2 and check the losses against one
process; check a sequence-parallel (DTensor) RMSNorm against the plain one.

    python benchmarks/distributed_train.py --check            # runs everything below, compares
    torchrun --nproc-per-node 2 benchmarks/distributed_train.py --mode ddp --out ddp.json
    torchrun --nproc-per-node 2 benchmarks/distributed_train.py --mode fsdp2 --out fsdp2.json
    torchrun --nproc-per-node 2 benchmarks/distributed_train.py --mode sp_norm

Modes:
  single   one process trains on the global batch (the reference).
  ddp      DistributedDataParallel; each rank takes batch / world rows of every global batch.
  fsdp2    ``fully_shard`` on every decoder layer and the root (torch.distributed.fsdp, or
           torch.distributed._composable.fsdp on torch < 2.6). FSDP2 unshards the parameters
           before each forward, so the norm kernel sees plain tensors.
  sp_norm  a patched RMSNorm whose input is a DTensor sharded along the sequence and whose
           weight is a replicated DTensor parameter: output and weight gradient vs one process.
Every rank holds the same number of non-ignored tokens, so the mean of the ranks' mean losses
(and DDP's/FSDP's gradient average) equals the single-process loss and gradient.
CUDA + NCCL when GPUs are present, else CPU + gloo (set TRITON_INTERPRET=1 so the kernels run
through Triton's interpreter). Weights are fp32 so the comparison can be tight.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist


def _setup():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        return dist.get_rank(), world, torch.device("cuda", rank)
    dist.init_process_group("gloo")
    return dist.get_rank(), world, torch.device("cpu")


def _finish(result, out):
    """Rank 0 writes ``result``; then, under torchrun, the ranks leave together and exit at once.
    Tearing gloo down (destroy_process_group, or the interpreter's exit with its threads alive)
    intermittently aborted a rank ("terminate called without an active exception") after the
    work was done, failing the run; a worker that is about to exit has nothing to release."""
    if result is not None and out:
        with open(out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _model(args, device):
    import transformers
    import llmkernels

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    report = llmkernels.patch(model)
    assert "loss" not in report.not_patched and "rope" not in report.not_patched, str(report)
    return model


def train(args) -> list:
    rank, world, device = _setup()
    model = _model(args, device)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif args.mode == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    rows = args.batch // world
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)[rank * rows:(rank + 1) * rows]
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses if rank == 0 else None


def sp_norm(args) -> dict:
    """RMSNorm on a sequence-sharded DTensor input with a replicated DTensor weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    import llmkernels

    rank, world, device = _setup()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    x = torch.randn(2, 8 * world, args.hidden, device=device)
    dy = torch.randn_like(x)
    ref = LlamaRMSNorm(args.hidden).to(device)
    with torch.no_grad():
        ref.weight.normal_()
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)

    norm = LlamaRMSNorm(args.hidden).to(device)
    norm.weight = torch.nn.Parameter(distribute_tensor(ref.weight.detach().clone(), mesh, [Replicate()]))
    llmkernels.patch(norm)
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    y = norm(xd)
    y.backward(distribute_tensor(dy, mesh, [Shard(1)]))
    out = {
        "y_placements": str(y.placements),
        "y_rel_err": ((y.full_tensor() - ref(x)).norm() / ref(x).norm()).item(),
        "dx_rel_err": ((xd.grad.full_tensor() - xr.grad).norm() / xr.grad.norm()).item(),
        "dw_rel_err": ((norm.weight.grad.full_tensor() - ref.weight.grad).norm() / ref.weight.grad.norm()).item(),
    }
    return out if rank == 0 else None


def check(args) -> int:
    """Run single, ddp, fsdp2 and sp_norm; compare; print a table; nonzero exit on mismatch."""
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("single", "ddp", "fsdp2", "sp_norm"):
            out = os.path.join(tmp, f"{mode}.json")
            base = [sys.executable] if mode == "single" else [
                sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--master-port=29533"]
            cmd = base + [os.path.abspath(__file__), "--mode", mode, "--out", out, f"--steps={args.steps}",
                          f"--batch={args.batch}", f"--seq={args.seq}", f"--hidden={args.hidden}",
                          f"--layers={args.layers}", f"--vocab={args.vocab}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{mode}: FAILED\n{proc.stderr[-3000:]}")
                ok = False
                continue
            with open(out) as f:
                results[mode] = json.load(f)
    ref = results.get("single")
    for mode in ("ddp", "fsdp2"):
        if mode in results and ref:
            err = max(abs(a - b) / abs(b) for a, b in zip(results[mode], ref))
            passed = err <= args.rtol
            ok &= passed
            print(f"{mode:>7}: losses {['%.5f' % v for v in results[mode]]} max rel diff vs single {err:.2e} "
                  f"{'ok' if passed else 'MISMATCH'}")
    if ref:
        print(f" single: losses {['%.5f' % v for v in ref]}")
    if "sp_norm" in results:
        r = results["sp_norm"]
        passed = max(r["y_rel_err"], r["dx_rel_err"], r["dw_rel_err"]) <= args.rtol
        ok &= passed
        print(f"sp_norm: {r} {'ok' if passed else 'MISMATCH'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results, passed=ok, nproc=args.nproc, torch=torch.__version__,
                           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"), f, indent=1)
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("single", "ddp", "fsdp2", "sp_norm"))
    p.add_argument("--check", action="store_true", help="run every mode and compare")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="global batch (rows), divisible by the world size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--out")
    args = p.parse_args()
    if args.check:
        sys.exit(check(args))
    _finish(sp_norm(args) if args.mode == "sp_norm" else train(args), args.out)


if __name__ == "__main__":
    main()
