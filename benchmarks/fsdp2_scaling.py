"""Weak and strong scaling of the 1.28B Llama under FSDP2 (benchmarks/e2e_train.py) at K = 1, 2, 4
GPUs: every provider (llmkernels, hf, liger if installed, compile) in one machine session.

  weak    ``--rows-per-gpu`` rows on every GPU: global batch rows-per-gpu * K (speed only: the
          batches differ).
  strong  ``--global-batch`` rows over the K GPUs (the losses must agree with one GPU's).
At K = 1 one run serves both when rows-per-gpu equals the global batch (the default, 4 rows).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    python benchmarks/fsdp2_scaling.py --out-dir $OUT                    # K = 1, 2, 4 as the GPUs allow
    python benchmarks/fsdp2_scaling.py --out-dir $OUT --prefetch 2 --reshard-after-forward 0
    TRITON_INTERPRET=1 python benchmarks/fsdp2_scaling.py --tiny --gpus 1,2 --providers hf,llmkernels --out-dir /tmp/s

Each run is one ``e2e_train.py`` call (each provider its own process or torchrun), in the order
K = 1, then weak from the largest K, then strong, and writes
``e2e-<mode>-<device>-<K>gpu-<date>.json`` (mode ``one`` at K = 1). After every run the summary
``fsdp2-scaling-<device>-<date>.json`` (``--out-dir``) is rewritten: the runs so far (world_size,
mode, batch, FSDP2 settings, card) and ``e2e_train.compare``'s efficiencies (tokens/s per GPU over
the one-GPU run's) with peak memory per GPU. Runs already in the folder are not run again: past
``--time-limit`` the script stops between runs with exit status 3, and the same command resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_train  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def plan(gpus: list[int], rows_per_gpu: int, global_batch: int) -> list[tuple[int, str, int]]:
    """(K, mode, global batch) of every run, in the order to run them (the most telling first)."""
    runs = [(1, "one", rows_per_gpu)]
    if global_batch != rows_per_gpu:
        runs.append((1, "one-strong", global_batch))
    many = sorted((k for k in gpus if k > 1), reverse=True)
    for mode in ("weak", "strong"):
        for k in many:
            batch = rows_per_gpu * k if mode == "weak" else global_batch
            if batch % k:
                raise SystemExit(f"--global-batch {global_batch} does not divide into {k} GPUs")
            runs.append((k, mode, batch))
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2,4", help="process counts K (those above the GPUs present are skipped)")
    p.add_argument("--providers", default="llmkernels,hf,liger,compile",
                   help="liger is skipped when liger_kernel is not installed")
    p.add_argument("--rows-per-gpu", type=int, default=4, help="weak scaling: rows (of --seq tokens) per GPU")
    p.add_argument("--global-batch", type=int, default=4, help="strong scaling: rows over all GPUs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1)
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--shard-head", type=int, choices=(0, 1), default=0)
    p.add_argument("--tiny", action="store_true", help="e2e_train's tiny fp32 model (CPU check)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per provider")
    p.add_argument("--time-limit", type=float, default=460, help="start no run after this many seconds; exit 3 "
                   "if runs remain (run the same command again to resume)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()

    import torch
    cuda = torch.cuda.is_available()
    present = torch.cuda.device_count() if cuda else max(int(k) for k in args.gpus.split(","))
    gpus = [int(k) for k in args.gpus.split(",") if int(k) <= present]
    providers = [pr for pr in args.providers.split(",") if pr != "liger" or _has("liger_kernel")]
    device = e2e_train.device_name("cuda" if cuda else "cpu")
    date = time.strftime("%Y-%m-%d")
    os.makedirs(args.out_dir, exist_ok=True)
    fsdp2 = [f"--reshard-after-forward={args.reshard_after_forward}", f"--prefetch={args.prefetch}",
             f"--shard-head={args.shard_head}"]
    summary_path = os.path.join(args.out_dir, e2e_train.result_name("fsdp2-scaling", device, max(gpus), date))
    t0 = time.perf_counter()
    runs, left = [], []
    for k, mode, batch in plan(gpus, args.rows_per_gpu, args.global_batch):
        path = os.path.join(args.out_dir, e2e_train.result_name(f"e2e-{mode}", device, k, date))
        if not os.path.exists(path):
            if time.perf_counter() - t0 > args.time_limit:
                left.append(f"K={k} {mode}")
                continue
            cmd = [sys.executable, os.path.join(HERE, "e2e_train.py"), f"--nproc={k}", f"--batch={batch}",
                   f"--providers={','.join(providers)}", f"--warmup={args.warmup}", f"--steps={args.steps}",
                   f"--timeout={args.timeout}", f"--out={path}", *fsdp2, *(["--tiny"] if args.tiny else [])]
            print(f"[{time.perf_counter() - t0:5.0f} s] K={k} {mode}: global batch {batch}", flush=True)
            subprocess.run(cmd, check=False)
        if os.path.exists(path):
            with open(path) as f:
                run = json.load(f)
            run["environment"]["mode"] = mode
            runs.append(run)
            _write_summary(summary_path, runs, args, device, date, left)
    summary = _write_summary(summary_path, runs, args, device, date, left)
    e2e_train.print_compare(summary["scaling"])
    print(f"wrote {summary_path}; {time.perf_counter() - t0:.0f} s" + (f"; left: {', '.join(left)}" if left else ""))
    sys.exit(3 if left else 0)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _write_summary(path, runs, args, device, date, left) -> dict:
    scaling = e2e_train.compare(runs, loss_tol=5e-3) if runs else {"rows": [], "passed": True, "loss_tol": 5e-3}
    summary = {"benchmark": "FSDP2 weak and strong scaling, e2e_train.py", "device": device, "date": date,
               "world_size": max([r["environment"].get("world_size", 1) for r in runs] or [1]),
               "rows_per_gpu_weak": args.rows_per_gpu, "global_batch_strong": args.global_batch,
               "fsdp2": {"reshard_after_forward": bool(args.reshard_after_forward), "prefetch": args.prefetch,
                         "shard_head": bool(args.shard_head)},
               "runs": [{"world_size": r["environment"].get("world_size", 1), "mode": r["environment"]["mode"],
                         "batch": r["shape"]["batch"], "environment": r["environment"],
                         "providers": r["providers"]} for r in runs],
               "scaling": scaling, "not_run": left}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
