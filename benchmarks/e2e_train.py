"""End-to-end training step of a ~1.3B-parameter Llama-style model: tokens/s and peak memory, on
one GPU or under FSDP2 on K GPUs.

Providers (each runs in its own process, or its own torchrun of K processes, so that patches and
allocator state don't leak):
  hf        transformers eager (sdpa attention), loss from materialized logits
  llmkernels  the same model after ``llmkernels.patch(model)``: RMSNorm, RoPE, the SwiGLU
            MLP activation with its down projection (``glu_linear``: the product is recomputed
            in the backward, not kept), fused linear cross-entropy (whatever the report says
            was patched is recorded in the JSON)
  liger     ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` (its defaults: RMSNorm,
            RoPE, SwiGLU, fused linear cross-entropy) before the model is built
  compile   ``torch.compile(model)`` of the HF model (inductor); compile time reported apart

Every provider builds the same model from the same seed, in bf16 (weights and activations),
trains with AdamW (fused) on the same random token batches, runs ``--warmup`` steps, then
times ``--steps`` steps (CUDA-synchronized wall clock). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (weights, grads, optimizer state and
activations). Losses of every step are recorded, so providers can be checked against hf.

Several GPUs (``--nproc K``, K > 1): each provider runs under ``torchrun --nproc-per-node K`` with
``fully_shard`` (FSDP2, default policy: the parameters are bf16, so are the all-gathers and
reduce-scatters) on every decoder layer and the root, applied after the provider's patch and
before ``torch.compile``; ``--reshard-after-forward``, ``--prefetch`` and ``--shard-head`` set its
knobs (recorded under ``fsdp2``). ``--batch`` is the global batch: rank r trains rows
[r * batch / K, (r + 1) * batch / K) of the same random batches, so the mean of the ranks' losses
is the one-GPU loss of that batch. tokens/s counts every rank's tokens; the JSON also gives it per
GPU, the slowest rank's step time and every rank's peak memory. ``--compare`` reads the JSONs of
K = 1, 2, 4, 8: tokens/s per GPU against one GPU (scaling efficiency) and each provider's losses
against its own one-GPU losses (same global batch and seed).

    python benchmarks/e2e_train.py --out benchmarks/results/e2e-h100-DATE.json
    python benchmarks/e2e_train.py --provider llmkernels --layers 2   # one provider, small
    python benchmarks/e2e_train.py --nproc 8 --batch 8 --out-dir benchmarks/results   # FSDP2, 8 GPUs
    python benchmarks/e2e_train.py --compare benchmarks/results/e2e-h100-*gpu-DATE.json
    TRITON_INTERPRET=1 python benchmarks/e2e_train.py --tiny --nproc 2 --providers hf,llmkernels  # CPU, gloo
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

PROVIDERS = ("hf", "llmkernels", "liger", "compile")
# --tiny: a model the Triton interpreter trains in seconds on CPU (fp32, where gloo and the
# interpreter are exact enough to compare K processes with one).
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, seq=16, batch=4, warmup=1,
            steps=2, dtype="fp32")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# NVLink multicast stays off on the shared multi-GPU machines; each result records these settings.
MULTICAST_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


# -- distributed helpers (benchmarks/distributed_train.py uses them too) -------------------------
def init_distributed(device_type: str):
    """(rank, world size, device) of this process: under torchrun (WORLD_SIZE > 1) the process group
    is NCCL on its own GPU, or gloo on CPU; otherwise one process on GPU 0 or the CPU."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world == 1:
        return 0, 1, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def fsdp2_options(args) -> dict:
    """shard_fsdp2's keyword arguments from the command line's FSDP2 flags."""
    return {"reshard_after_forward": bool(args.reshard_after_forward), "head": bool(args.shard_head),
            "prefetch": args.prefetch}


def shard_fsdp2(model, reshard_after_forward: bool = True, head: bool = False, prefetch: int = 0):
    """FSDP2: ``fully_shard`` on every decoder layer, then on the root (embedding, final norm, head).

    ``reshard_after_forward``: the decoder layers free their gathered parameters after the forward
    (gathered again for the backward) or keep them (more memory, one all-gather a step fewer).
    ``head``: the output head is a group of its own, which the fused loss reads outside the head's
    forward (the weight is then a sharded DTensor there: ``llmkernels.ops.losses.base.sharded``).
    ``prefetch``: each layer's forward (backward) also starts the all-gathers of the next (previous)
    ``prefetch`` layers, beyond FSDP2's implicit one-ahead prefetch."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    if head:
        fully_shard(model.get_output_embeddings(), reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    for i, layer in enumerate(layers if prefetch > 0 else ()):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + prefetch])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - prefetch):i][::-1])
    return model


def exit_distributed():
    """Under torchrun the ranks leave together and exit at once. Tearing gloo down
    (destroy_process_group, or the interpreter's exit with its threads alive) intermittently
    aborted a rank ("terminate called without an active exception") after the work was done,
    failing the run; a worker that is about to exit has nothing to release."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is available")
    return name


def device_name(device_type: str) -> str:
    import torch
    return torch.cuda.get_device_name() if device_type == "cuda" else "cpu"


def result_name(kind: str, device: str, world: int, date: str) -> str:
    """``<kind>-<device>-<K>gpu-<date>.json``, device shortened ("NVIDIA H100 80GB HBM3" -> h100);
    on CPU ``<kind>-cpu-<K>proc-<date>.json``."""
    if device == "cpu":
        return f"{kind}-cpu-{world}proc-{date}.json"
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device)
    short = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"{kind}-{short}-{world}gpu-{date}.json"


# -- one provider, in this process (one rank of it under torchrun) -------------------------------
def build_model(args, device):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           dtype=getattr(torch, DTYPES[args.dtype]))
    return model


def training_step(step_model, opt):
    """One training step on ``ids`` (``input_ids`` = ``labels``): forward, backward, ``opt``'s
    step; returns the loss, detached (not synchronized)."""
    def step(ids):
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def train_steps(step_model, opt, batches: list, warmup: int, device, barrier=None) -> dict:
    """Train on ``batches`` (``input_ids`` = ``labels``): ``warmup`` steps, then the rest timed
    (CUDA-synchronized wall clock, then ``barrier()`` where given). Returns ``first_step_s`` (the
    first step's time: compilation and autotuning included), ``elapsed_s`` of the timed steps, the
    peak memory over them (``peak_gib``, None on CPU) and every step's loss (a float64 tensor)."""
    import torch

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if barrier is not None:
            barrier()

    step = training_step(step_model, opt)
    losses, first_step_s = [], None
    t0 = time.perf_counter()
    for i in range(warmup):
        losses.append(step(batches[i]))
        if i == 0:
            sync()
            first_step_s = time.perf_counter() - t0
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for ids in batches[warmup:]:
        losses.append(step(ids))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"first_step_s": first_step_s, "elapsed_s": elapsed, "losses": torch.stack(losses).double(),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run_provider(args, rank: int = 0, world: int = 1, device=None) -> dict | None:
    """Train ``args.provider``; every rank takes part, rank 0 returns the result (others None)."""
    import torch
    import torch.distributed as dist

    device = device if device is not None else torch.device(resolve_device(args.device))
    cuda = device.type == "cuda"
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch}: the global batch must divide into {world} processes")
    rows = args.batch // world
    result = {"provider": args.provider}
    if args.provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        import liger_kernel
        apply_liger_kernel_to_llama()
        result["liger_version"] = getattr(liger_kernel, "__version__", None) or _dist_version("liger_kernel")
    model = build_model(args, device)
    model.train()
    result["params"] = sum(p.numel() for p in model.parameters())
    if args.provider == "llmkernels":
        import llmkernels
        report = llmkernels.patch(model)
        if rank == 0:
            print(report, flush=True)
        result["patched"], result["not_patched"] = report.patched, report.not_patched
    if world > 1:
        shard_fsdp2(model, **fsdp2_options(args))
    step_model = torch.compile(model) if args.provider == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    g = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
               [rank * rows:(rank + 1) * rows] for _ in range(args.warmup + args.steps)]
    timed = train_steps(step_model, opt, batches, args.warmup, device, barrier=dist.barrier if world > 1 else None)
    result["first_step_s"] = timed["first_step_s"]
    elapsed = torch.tensor([timed["elapsed_s"]], dtype=torch.float64, device=device)
    peak = torch.tensor([timed["peak_gib"] if cuda else math.nan], dtype=torch.float64, device=device)
    losses = timed["losses"]
    peaks = [peak]
    if world > 1:  # the slowest rank's time, every rank's peak, the mean of the ranks' losses
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(losses)
        losses /= world
        peaks = [torch.empty_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
    elapsed = elapsed.item()
    peaks = [None if math.isnan(p.item()) else p.item() for p in peaks]
    tokens_per_s = args.batch * args.seq * args.steps / elapsed
    result.update(
        step_ms=1e3 * elapsed / args.steps,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / world,
        rows_per_gpu=rows,
        peak_mem_gib=max(peaks) if cuda else None,
        peak_mem_gib_per_rank=peaks,
        losses=losses.tolist(),
    )
    return result if rank == 0 else None


def _dist_version(name: str):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device_type: str, world: int) -> dict:
    import torch
    import transformers
    import triton
    return {"device": device_name(device_type), "gpus": world if device_type == "cuda" else 0, "world_size": world,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "multicast_env": {k: os.environ.get(k) for k in MULTICAST_ENV}}


# -- comparison of the runs at K = 1, 2, 4, 8 ----------------------------------------------------
def _key(run: dict, batch: int | None = None) -> tuple:
    """What two runs must share to be compared: the device and the shape (with ``batch``: all but the
    global batch, which is then ``batch``)."""
    shape = {"dtype": "bf16", **run["shape"]}  # files from before the dtype option were bf16
    return run["environment"]["device"], shape if batch is None else dict(shape, batch=batch)


def _baseline(ones: list[dict], run: dict, entry: dict) -> tuple:
    """The same provider's one-process result to set ``entry`` against: ("strong", it) at the same
    global batch, else ("weak", it) at the same rows per process, else (None, None)."""
    rows = entry.get("rows_per_gpu", run["shape"]["batch"])
    for kind, key in (("strong", _key(run)), ("weak", _key(run, batch=rows))):
        for one in ones:
            base = next((e for e in one["providers"] if e["provider"] == entry["provider"] and "error" not in e), None)
            if base is not None and _key(one) == key:
                return kind, base
    return None, None


def compare(runs: list[dict], loss_tol: float) -> dict:
    """Each provider of each run at K processes against its one-process run on the same device:
    tokens/s per GPU over the one-process run's (scaling efficiency), strong scaling (same global
    batch and seed, where every step's loss must agree within ``loss_tol`` nats) or else weak
    (same rows per GPU: speed only)."""
    ones = [r for r in runs if r["environment"].get("world_size", 1) == 1]
    rows = []
    for run in sorted(runs, key=lambda r: r["environment"].get("world_size", 1)):
        for entry in run["providers"]:
            row = {"provider": entry["provider"], "world_size": run["environment"].get("world_size", 1),
                   "device": run["environment"]["device"], "batch": run["shape"]["batch"]}
            if "error" in entry:
                rows.append(dict(row, error=entry["error"].strip().splitlines()[-1][:200]))
                continue
            per_gpu = entry.get("tokens_per_s_per_gpu", entry["tokens_per_s"])
            row.update(rows_per_gpu=entry.get("rows_per_gpu", run["shape"]["batch"]), tokens_per_s_per_gpu=per_gpu,
                       tokens_per_s=entry["tokens_per_s"], peak_mem_gib=entry["peak_mem_gib"])
            kind, base = _baseline(ones, run, entry)
            if base is not None:
                row.update(scaling=kind, efficiency=per_gpu / base.get("tokens_per_s_per_gpu", base["tokens_per_s"]))
            if kind == "strong":
                dloss = max(abs(a - b) for a, b in zip(entry["losses"], base["losses"]))
                row.update(max_abs_dloss_vs_1=dloss, losses_agree=dloss <= loss_tol)
            rows.append(row)
    return {"loss_tol": loss_tol, "rows": rows,
            "passed": all(r.get("losses_agree", True) and "error" not in r for r in rows)}


def print_compare(summary: dict):
    print(f"{'provider':<12}{'K':>3}{'rows/GPU':>9}{'tok/s/GPU':>11}{'efficiency':>11}{'peak GiB':>9}"
          f"{'max|dloss| vs 1 GPU':>21}  device")
    for r in summary["rows"]:
        if "error" in r:
            print(f"{r['provider']:<12}{r['world_size']:>3}  error: {r['error'][:90]}  {r['device']}")
            continue
        eff = f"{r['efficiency']:.1%} {r['scaling'][0]}" if "efficiency" in r else "-"
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        dloss = (f"{r['max_abs_dloss_vs_1']:.2e} {'ok' if r['losses_agree'] else 'MISMATCH'}"
                 if "max_abs_dloss_vs_1" in r else "-")
        print(f"{r['provider']:<12}{r['world_size']:>3}{r['rows_per_gpu']:>9}{r['tokens_per_s_per_gpu']:>11.0f}"
              f"{eff:>11}{peak:>9}{dloss:>21}  {r['device']}")
    print(f"efficiency: tokens/s per GPU over the one-GPU run's (s: same global batch, w: same rows per GPU); "
          f"losses agree within {summary['loss_tol']} nats: {'yes' if summary['passed'] else 'NO'}")


# -- the command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", choices=PROVIDERS, help="run one provider in this process (default: all, "
                   "each in a subprocess); under torchrun, one rank of it")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per provider: K > 1 runs each provider "
                   "under torchrun with FSDP2 (default: %(default)s, no sharding)")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model and 3 steps (the CPU test); options given "
                   "beside it still apply")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: gloo between processes; set TRITON_INTERPRET=1 for the kernels (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="weights and activations")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="global batch (rows over all processes)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=int, default=400, help="seconds per provider subprocess")
    p.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1,
                   help="FSDP2: the decoder layers free their gathered parameters after the forward (1) or keep "
                        "them for the backward (0)")
    p.add_argument("--prefetch", type=int, default=0, help="FSDP2: layers whose all-gathers each layer starts ahead "
                   "(beyond FSDP2's implicit one; default %(default)s)")
    p.add_argument("--shard-head", type=int, choices=(0, 1), default=0,
                   help="FSDP2: the output head a group of its own (1) or in the root's (0)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--out-dir", help="write the JSON into this folder as e2e-<device>-<K>gpu-<date>.json")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare result files of several process counts "
                   "(--out writes the comparison)")
    p.add_argument("--loss-tol", type=float, default=5e-3,
                   help="--compare: largest |loss difference| (nats) at any step between K processes and one "
                        "(default: %(default)s; bf16 providers differ from each other by up to 8e-4 on one GPU)")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**TINY)
        args = parser.parse_args(argv)
    return args


def run_shape(args) -> dict:
    """The model and run settings a result records (and ``compare`` matches runs on)."""
    return {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq",
                                          "batch", "warmup", "steps", "dtype")}


def run_worker(cmd: list, provider: str, timeout: float) -> dict:
    """Run one provider's process: its ``RESULT <json>`` line, else its error (the output's tail or the timeout)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"provider": provider, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"provider": provider, "error": (proc.stderr or proc.stdout)[-2000:]}


def run_all(args) -> dict:
    device_type = resolve_device(args.device)
    shape = run_shape(args)
    env = environment(device_type, args.nproc)
    out = args.out or (args.out_dir and os.path.join(args.out_dir, result_name("e2e", env["device"], args.nproc,
                                                                                 env["date"])))
    results = {"model": f"LlamaForCausalLM, {args.dtype} weights and activations, AdamW(fused), sdpa attention",
               "shape": shape, "environment": env, "providers": []}
    if args.nproc > 1:
        results["parallel"] = (f"FSDP2 over {args.nproc} processes: fully_shard on every decoder layer and the "
                               f"root, default policy; global batch {args.batch}, {args.batch // args.nproc} rows "
                               f"per process")
        results["fsdp2"] = fsdp2_options(args)
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()] + [
        f"--device={device_type}", f"--reshard-after-forward={args.reshard_after_forward}",
        f"--prefetch={args.prefetch}", f"--shard-head={args.shard_head}"]
    launcher = [sys.executable] if args.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    for provider in args.providers.split(","):
        cmd = [*launcher, os.path.abspath(__file__), "--provider", provider, *passthrough]
        entry = run_worker(cmd, provider, args.timeout)
        results["providers"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "losses"})[:600], flush=True)
        if out:  # written after every provider, so a later failure keeps the earlier results
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    if out:
        print(f"wrote {out}")
    return results


def print_table(results: dict):
    base = next((r for r in results["providers"] if r["provider"] == "hf" and "error" not in r), None)
    print(f"\n{'provider':<12}{'tokens/s':>10}{'step ms':>9}{'peak GiB':>10}{'vs hf':>8}{'max |dloss|':>13}")
    for r in results["providers"]:
        if "error" in r:
            print(f"{r['provider']:<12} error: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        dloss = f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.4f}" if base else "-"
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        print(f"{r['provider']:<12}{r['tokens_per_s']:>10.0f}{r['step_ms']:>9.1f}{peak:>10}{speed:>8}{dloss:>13}")


def main():
    args = parse_args()
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
            if not {"shape", "environment", "providers"} <= runs[-1].keys():
                raise SystemExit(f"--compare: {path} is not a result of this script")
        summary = compare(runs, args.loss_tol)
        print_compare(summary)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(summary, files=[os.path.basename(p) for p in args.compare]), f, indent=1)
        sys.exit(0 if summary["passed"] else 1)
    if args.provider:
        rank, world, device = init_distributed(resolve_device(args.device))
        try:
            result = run_provider(args, rank, world, device)
        except Exception:  # the worker's own error, not torchrun's summary of it, goes into the JSON
            print("RESULT " + json.dumps({"provider": args.provider, "error": traceback.format_exc()[-2000:]}),
                  flush=True)
            os._exit(1)  # no barrier: the other ranks may never reach it; torchrun ends them
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        exit_distributed()
        return
    print_table(run_all(args))


if __name__ == "__main__":
    main()
