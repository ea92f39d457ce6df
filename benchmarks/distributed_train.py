"""Train a small llmkernels-patched Llama under DDP and FSDP2 on K processes and check the losses,
the parameters and the gradients after the last step against one process; check a
sequence-parallel (DTensor) RMSNorm against the plain one; check the FSDP2 path of
benchmarks/e2e_train.py (its llmkernels provider at its --tiny size) against its one-process run.

    python benchmarks/distributed_train.py --check                # K = 2: runs everything, compares
    python benchmarks/distributed_train.py --check --nproc 8 --out-dir benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/distributed_train.py --mode ddp,fsdp2 --out many.json
    torchrun --nproc-per-node 2 benchmarks/distributed_train.py --mode sp_norm

Modes (``--mode`` takes several, comma-separated, run one after another in the same processes):
  single   one process trains on the global batch (the reference).
  ddp      DistributedDataParallel; each rank takes batch / world rows of every global batch.
  fsdp2    ``fully_shard`` on every decoder layer and the root (e2e_train.shard_fsdp2). FSDP2
           unshards the parameters before each forward, so the norm kernel sees plain tensors.
  fsdp2_head  as fsdp2, with the output head a group of its own: the fused loss reads the head's
           weight outside the head's forward, as a sharded DTensor (llmkernels.ops.losses.base.sharded).
  fsdp2_ckpt  as fsdp2_head, with activation checkpointing of every decoder layer.
  ddp_ckpt    as ddp, with activation checkpointing of every decoder layer.
  sp_norm  a patched RMSNorm whose input is a DTensor sharded along the sequence and whose
           weight is a replicated DTensor parameter: output and weight gradient vs one process.
  e2e      e2e_train.run_provider("llmkernels", --tiny, this global batch): one process, or FSDP2
           over the ranks.
Every rank holds the same number of non-ignored tokens, so the mean of the ranks' mean losses
(and DDP's/FSDP's gradient average) equals the single-process loss and gradient. The check writes
rank 0's losses, full parameters and gradients (FSDP2's gathered from their shards) and compares
every tensor by its relative error norm.
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
import time

import torch
import torch.distributed as dist

import e2e_train
from e2e_train import exit_distributed, init_distributed, shard_fsdp2

MODES = ("single", "ddp", "fsdp2", "fsdp2_head", "fsdp2_ckpt", "ddp_ckpt", "sp_norm", "e2e")
TRAINED = ("ddp", "fsdp2", "fsdp2_head", "fsdp2_ckpt", "ddp_ckpt")  # compared with "single" after --steps


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy; an FSDP2 shard is gathered first (every rank must call this)."""
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def train(args, mode, rank, world, device) -> dict | None:
    model = _model(args, device)
    if mode.endswith("_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif mode.startswith("fsdp2"):
        shard_fsdp2(model, head=mode != "fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    rows = args.batch // world
    losses = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)  # before the step, so that the last step's gradients stay to compare
        ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)[rank * rows:(rank + 1) * rows]
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    named = list((model.module if mode.startswith("ddp") else model).named_parameters())
    tensors = {"params": {n: _full(p) for n, p in named}, "grads": {n: _full(p.grad) for n, p in named}}
    return {"losses": losses, "tensors": tensors} if rank == 0 else None


def sp_norm(args, rank, world, device) -> dict | None:
    """RMSNorm on a sequence-sharded DTensor input with a replicated DTensor weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    import llmkernels

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


def e2e(args, rank, world, device) -> dict | None:
    """The benchmark's own training loop (FSDP2 when world > 1) at its tiny size and this global batch,
    two steps: the second loss follows the first update (the modes above cover more steps)."""
    e2e_args = e2e_train.parse_args(["--provider", "llmkernels", "--tiny", f"--batch={args.batch}", "--warmup=1",
                                     "--steps=1"])
    result = e2e_train.run_provider(e2e_args, rank, world, device)
    return None if result is None else {"losses": result["losses"]}


def run_modes(args) -> dict:
    """Each mode of ``--mode`` in turn, in this process group; rank 0 writes the results."""
    rank, world, device = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch}: the global batch must divide into {world} processes")
    results, tensors = {}, {}
    for mode in args.mode.split(","):
        if mode == "sp_norm":
            results[mode] = sp_norm(args, rank, world, device)
        elif mode == "e2e":
            results[mode] = e2e(args, rank, world, device)
        else:
            results[mode] = train(args, mode, rank, world, device)
            if rank == 0:
                tensors[mode] = results[mode].pop("tensors")
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
        if tensors:
            torch.save(tensors, _tensor_path(args.out))
    return results


def _tensor_path(out: str) -> str:
    return os.path.splitext(out)[0] + ".pt"


def _max_rel_err(got: dict, ref: dict) -> tuple[float, str]:
    """Largest ||got - ref|| / ||ref|| over the named tensors, and its name."""
    errs = {n: ((got[n] - r).norm() / r.norm()).item() for n, r in ref.items()}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def _max_rel_diff(got: list, ref: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def _launch(args, modes: str, nproc: int, out: str) -> str | None:
    """Run ``modes`` in one process or under torchrun; None, or the failure's output."""
    base = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = base + [os.path.abspath(__file__), "--mode", modes, "--out", out, f"--steps={args.steps}",
                  f"--batch={args.batch}", f"--seq={args.seq}", f"--hidden={args.hidden}", f"--layers={args.layers}",
                  f"--vocab={args.vocab}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stdout[-2000:] + proc.stderr[-3000:])


def check(args) -> int:
    """One process (single, e2e) and one torchrun of K (ddp, fsdp2, sp_norm, e2e); compare; print a
    table; nonzero exit on a mismatch."""
    ok, lines = True, []
    trained = args.trained.split(",")

    def verdict(name, err, detail=""):
        nonlocal ok
        passed = err <= args.rtol
        ok &= passed
        lines.append(f"{name:>20}: max rel diff vs one process {err:.2e}{detail} {'ok' if passed else 'MISMATCH'}")
        return err

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        one, many = os.path.join(tmp, "one.json"), os.path.join(tmp, "many.json")
        failed = [(name, err) for name, err in (("one process", _launch(args, "single,e2e", 1, one)),
                  (f"{args.nproc} processes", _launch(args, ",".join((*trained, "sp_norm", "e2e")), args.nproc, many))) if err]
        for name, err in failed:
            print(f"{name}: FAILED\n{err}")
        if failed:
            print("FAILED")
            return 1
        with open(one) as f:
            results = json.load(f)
        with open(many) as f:
            distributed = json.load(f)
        results["e2e_fsdp2"] = distributed.pop("e2e")
        results.update(distributed)
        tensors = {**torch.load(_tensor_path(one)), **torch.load(_tensor_path(many))}
    summary = {}
    ref = results["single"]["losses"]
    for mode in trained:
        got = results[mode]["losses"]
        summary[mode] = {"losses": verdict(f"{mode} losses", _max_rel_diff(got, ref), f" {['%.5f' % v for v in got]}")}
        for kind in ("params", "grads"):
            err, worst = _max_rel_err(tensors[mode][kind], tensors["single"][kind])
            summary[mode][kind] = verdict(f"{mode} {kind}", err, f" (worst: {worst})")
    summary["e2e_fsdp2"] = {"losses": verdict("e2e fsdp2 losses", _max_rel_diff(results["e2e_fsdp2"]["losses"],
                                                                                results["e2e"]["losses"]))}
    r = results["sp_norm"]
    summary["sp_norm"] = verdict("sp_norm", max(r["y_rel_err"], r["dx_rel_err"], r["dw_rel_err"]),
                                 f" (y, dx, dw: {r['y_rel_err']:.1e}, {r['dx_rel_err']:.1e}, {r['dw_rel_err']:.1e})")
    print(f" single losses: {['%.5f' % v for v in ref]}")
    print("\n".join(lines))
    device = e2e_train.device_name("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or (args.out_dir and os.path.join(args.out_dir, e2e_train.result_name(
        "distributed", device, args.nproc, time.strftime("%Y-%m-%d"))))
    if out:
        with open(out, "w") as f:
            json.dump(dict(results, rel_err=summary, passed=ok, nproc=args.nproc, rtol=args.rtol, steps=args.steps,
                           batch=args.batch, torch=torch.__version__, device=device, gpus=args.nproc if
                           torch.cuda.is_available() else 0, date=time.strftime("%Y-%m-%d"),
                           seconds=time.perf_counter() - t0,
                           multicast_env={k: os.environ.get(k) for k in e2e_train.MULTICAST_ENV}), f, indent=1)
        print(f"wrote {out}")
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", help=f"one or more of {', '.join(MODES)}, comma-separated")
    p.add_argument("--check", action="store_true", help="run every mode and compare")
    p.add_argument("--nproc", type=int, default=2, help="--check: processes (GPUs) of the distributed runs")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=None, help="global batch (rows), divisible by the world size "
                   "(default: the smallest multiple of it from 4)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--trained", default=",".join(TRAINED), help="--check: the trained modes to compare with one "
                   "process (default: all)")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--out", help="--check: the summary JSON; --mode: rank 0's results (and tensors beside, .pt)")
    p.add_argument("--out-dir", help="--check: write distributed-<device>-<K>gpu-<date>.json into this folder")
    args = p.parse_args()
    if args.mode and any(m not in MODES for m in args.mode.split(",")):
        p.error(f"--mode: expected some of {', '.join(MODES)}, got {args.mode!r}")
    if any(m not in TRAINED for m in args.trained.split(",")):
        p.error(f"--trained: expected some of {', '.join(TRAINED)}, got {args.trained!r}")
    if args.batch is None:
        world = args.nproc if args.check else int(os.environ.get("WORLD_SIZE", "1"))
        args.batch = world * -(-4 // world)
    if args.check:
        sys.exit(check(args))
    if not args.mode:
        p.error("give --check or --mode")
    run_modes(args)
    exit_distributed()


if __name__ == "__main__":
    main()
