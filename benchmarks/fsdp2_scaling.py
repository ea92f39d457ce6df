"""Weak and strong scaling of the 1.28B Llama under FSDP2 at K = 1, 2, 4 GPUs: every provider
(llmkernels, hf, liger if installed, compile) of ``benchmarks/e2e_train.py`` in one machine session.

  weak    ``--rows-per-gpu`` rows on every GPU: global batch rows-per-gpu * K (speed only: the
          batches differ).
  strong  ``--global-batch`` rows over the K GPUs (every step's loss must agree with one GPU's).
At K = 1 one run serves both when rows-per-gpu equals the global batch (the default, 8 rows).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    python benchmarks/fsdp2_scaling.py --out-dir $OUT                    # K = 1, 2, 4 as the GPUs allow
    python benchmarks/fsdp2_scaling.py --out-dir $OUT --prefetch 2 --reshard-after-forward 0
    TRITON_INTERPRET=1 python benchmarks/fsdp2_scaling.py --tiny --gpus 1,2 --providers hf,llmkernels --out-dir /tmp/s

One process (K = 1) or one torchrun of K per provider and K, which trains the weak then the strong
configuration in turn (``e2e_train.run_provider``, a fresh model each), so that start-up, NCCL and
kernel compilation are paid once: K = 1 first, then the largest K, each K's providers in turn.
After every provider the results are written, in e2e_train's format (``e2e_train.py --compare``
reads them): ``e2e-<mode>-<device>-<K>gpu-<date>.json`` (mode ``one`` at K = 1), and the summary
``fsdp2-scaling-<device>-<K>gpu-<date>.json``: the runs (world_size, mode, batch, FSDP2 settings,
card) and ``e2e_train.compare``'s rows: tokens/s per GPU over the one-GPU run's (efficiency) and
peak memory per GPU. A provider already in the folder's files is not run again: past
``--time-limit`` no provider starts, the script exits with status 3 and the same command resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_train  # noqa: E402


def plan(gpus: list[int], rows_per_gpu: int, global_batch: int) -> list[tuple[int, list[tuple[str, int]]]]:
    """(K, [(mode, global batch), ...]) in the order to run them: K = 1, then the largest K."""
    runs = [(1, [("one", rows_per_gpu)] + ([("one-strong", global_batch)] if global_batch != rows_per_gpu else []))]
    for k in sorted((k for k in gpus if k > 1), reverse=True):
        if global_batch % k:
            raise SystemExit(f"--global-batch {global_batch} does not divide into {k} GPUs")
        runs.append((k, [("weak", rows_per_gpu * k), ("strong", global_batch)]))
    return runs


def e2e_argv(args, provider: str, batch: int) -> list[str]:
    """e2e_train's command line of one provider and global batch."""
    return ["--provider", provider, f"--batch={batch}", *_passed(args)]


def _passed(args) -> list[str]:
    """The options of this command line that a worker and e2e_train take alike."""
    return [f"--warmup={args.warmup}", f"--steps={args.steps}", f"--reshard-after-forward={args.reshard_after_forward}",
            f"--prefetch={args.prefetch}", f"--shard-head={args.shard_head}", *(["--tiny"] if args.tiny else [])]


def worker(args):
    """One provider at every batch of ``--batches``, one after another, in this torchrun's processes."""
    rank, world, device = e2e_train.init_distributed(e2e_train.resolve_device("auto"))
    for batch in map(int, args.batches.split(",")):
        try:
            result = e2e_train.run_provider(e2e_train.parse_args(e2e_argv(args, args.worker, batch)), rank, world,
                                            device)
        except Exception:  # recorded; no barrier: the other ranks may never reach it, torchrun ends them
            print("RESULT " + json.dumps({"batch": batch, "provider": args.worker,
                                          "error": traceback.format_exc()[-2000:]}), flush=True)
            os._exit(1)
        if result is not None:
            print("RESULT " + json.dumps(dict(result, batch=batch)), flush=True)
        import torch
        torch.compiler.reset()  # compiled code of the last model (and its memory) goes before the next model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    e2e_train.exit_distributed()


def run_configs(args, k: int, configs: list, provider: str, timeout: float) -> dict:
    """{batch: result entry} of one provider at K processes (an error entry where it failed)."""
    launcher = [sys.executable] if k == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc-per-node={k}"]
    cmd = [*launcher, os.path.abspath(__file__), "--worker", provider,
           f"--batches={','.join(str(b) for _, b in configs)}", *_passed(args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout
        failure = (proc.stderr or proc.stdout)[-2000:]
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failure = f"timed out after {timeout:.0f} s"
    found = {}
    for line in output.splitlines():
        if line.startswith("RESULT "):
            entry = json.loads(line[7:])
            found[entry.pop("batch")] = entry
    return {b: found.get(b, {"provider": provider, "error": failure}) for _, b in configs}


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _load(path: str, args, k: int, mode: str, batch: int, device_type: str) -> dict:
    """The run file of (K, mode), or a new one in e2e_train's format."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    shape = e2e_train.run_shape(e2e_train.parse_args(e2e_argv(args, "hf", batch)))
    env = dict(e2e_train.environment(device_type, k), mode=mode)
    return {"model": "LlamaForCausalLM (benchmarks/e2e_train.py), FSDP2 at K > 1", "shape": shape,
            "environment": env, "fsdp2": {"reshard_after_forward": bool(args.reshard_after_forward),
                                          "prefetch": args.prefetch, "shard_head": bool(args.shard_head)},
            "providers": []}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2,4", help="process counts K (those above the GPUs present are skipped)")
    p.add_argument("--providers", default="llmkernels,hf,liger,compile",
                   help="liger is skipped when liger_kernel is not installed")
    p.add_argument("--rows-per-gpu", type=int, default=8, help="weak scaling: rows (of --seq tokens) per GPU")
    p.add_argument("--global-batch", type=int, default=8, help="strong scaling: rows over all GPUs (8: as the "
                   "two-GPU run of 2026-11-25)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1,
                   help="FSDP2: decoder layers free their gathered parameters after the forward (1) or not (0)")
    p.add_argument("--prefetch", type=int, default=0, help="FSDP2: layers each layer's all-gathers run ahead")
    p.add_argument("--shard-head", type=int, choices=(0, 1), default=0, help="FSDP2: the head a group of its own")
    p.add_argument("--tiny", action="store_true", help="e2e_train's tiny fp32 model (CPU check)")
    p.add_argument("--timeout", type=int, default=200, help="seconds per provider and configuration")
    p.add_argument("--time-limit", type=float, default=440, help="start no provider after this many seconds; "
                   "exit 3 if some are left (the same command resumes)")
    p.add_argument("--out-dir")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--batches", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.out_dir:
        p.error("--out-dir is required")

    import torch
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    present = torch.cuda.device_count() if device_type == "cuda" else max(int(k) for k in args.gpus.split(","))
    gpus = [int(k) for k in args.gpus.split(",") if int(k) <= present]
    providers = [pr for pr in args.providers.split(",") if pr != "liger" or _has("liger_kernel")]
    device, date = e2e_train.device_name(device_type), time.strftime("%Y-%m-%d")
    os.makedirs(args.out_dir, exist_ok=True)
    summary_path = os.path.join(args.out_dir, e2e_train.result_name("fsdp2-scaling", device, max(gpus), date))
    t0, left, runs = time.perf_counter(), [], {}
    for k, configs in plan(gpus, args.rows_per_gpu, args.global_batch):
        paths = {mode: os.path.join(args.out_dir, e2e_train.result_name(f"e2e-{mode}", device, k, date))
                 for mode, _ in configs}
        for mode, batch in configs:
            runs[k, mode] = _load(paths[mode], args, k, mode, batch, device_type)
        for provider in providers:
            if all(any(e["provider"] == provider for e in runs[k, mode]["providers"]) for mode, _ in configs):
                continue
            if time.perf_counter() - t0 > args.time_limit:
                left.append(f"{provider} at K={k}")
                continue
            print(f"[{time.perf_counter() - t0:4.0f} s] K={k} {provider}: global batch "
                  f"{', '.join(f'{b} ({m})' for m, b in configs)}", flush=True)
            entries = run_configs(args, k, configs, provider, args.timeout * len(configs) + 60)
            for mode, batch in configs:
                run = runs[k, mode]
                run["providers"] = [e for e in run["providers"] if e["provider"] != provider] + [entries[batch]]
                print(json.dumps({key: v for key, v in entries[batch].items() if key != "losses"})[:400], flush=True)
                with open(paths[mode], "w") as f:
                    json.dump(run, f, indent=1)
            _write_summary(summary_path, list(runs.values()), args, device, date, left)
    summary = _write_summary(summary_path, list(runs.values()), args, device, date, left)
    e2e_train.print_compare(summary["scaling"])
    print(f"wrote {summary_path}; {time.perf_counter() - t0:.0f} s" + (f"; left: {', '.join(left)}" if left else ""))
    sys.exit(3 if left else 0)


def _write_summary(path, runs, args, device, date, left) -> dict:
    runs = [r for r in runs if r["providers"]]
    scaling = e2e_train.compare(runs, loss_tol=5e-3) if runs else {"rows": [], "passed": True, "loss_tol": 5e-3}
    summary = {"benchmark": "FSDP2 weak and strong scaling (benchmarks/fsdp2_scaling.py)", "device": device,
               "date": date, "world_size": max([r["environment"]["world_size"] for r in runs] or [1]),
               "rows_per_gpu_weak": args.rows_per_gpu, "global_batch_strong": args.global_batch,
               "fsdp2": {"reshard_after_forward": bool(args.reshard_after_forward), "prefetch": args.prefetch,
                         "shard_head": bool(args.shard_head)},
               "runs": [{"world_size": r["environment"]["world_size"], "mode": r["environment"]["mode"],
                         "batch": r["shape"]["batch"], "environment": r["environment"], "providers": r["providers"]}
                        for r in runs],
               "scaling": scaling, "not_run": left}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
