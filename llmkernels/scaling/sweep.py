"""``llmkernels scaling``: train a sweep of model sizes at a fixed tokens-per-parameter ratio, fit
``L(N) = E + A·N^(-alpha)`` and the loss-vs-compute frontier, write JSON + PNG.

Output directory layout (``--out``, default ``scaling-runs``)::

    data/<fingerprint>/          tokenizer.json, train.npy, val.npy, meta.json (shared by backends)
    <backend>/sizes/<name>.json  one finished size: a rerun with the same settings skips it
    <backend>/checkpoints/<name>.pt  periodic (resumable) and final checkpoints
    <backend>/scaling.json, scaling.png   the fits, the frontier and every size's results
    compare.json                 kernels vs reference on the sizes both have finished

Several processes (``torchrun --nproc_per_node=K -m llmkernels.scaling``) split the sizes between
them: each rank trains whole sizes on its own GPU, largest first onto the least-loaded rank, and
rank 0 gathers the results and fits. The models are small (a few million parameters): one of them
does not fill an H100, so data-parallel training of one size would spend its time in gradient
all-reduces and launch overhead, while independent sizes scale perfectly.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import data as data_mod
from .fit import compute_frontier, fit_power_law, plot
from .model import BACKENDS, ModelConfig
from .train import TrainConfig, train_size

# (layers, width, heads): 55K .. 2.4M non-embedding parameters (44x), head size 24-32. Bounded
# by the data: the stdlib+torch corpus holds ~12-20M BPE tokens (by Python and torch version),
# and the largest size at 20 tokens/parameter sees it 2.5-4 times.
PRESETS = {
    "default": [(2, 48, 2), (2, 64, 2), (2, 96, 3), (3, 96, 3), (3, 128, 4), (4, 160, 5), (4, 224, 7)],
    "tiny": [(1, 16, 2), (1, 32, 2), (2, 32, 2), (2, 64, 2)],
}


def parse_sizes(spec: str) -> list[tuple[int, int, int]]:
    """A preset name or a comma-separated list of ``LAYERSxWIDTHxHEADS`` (e.g. ``2x64x2,4x128x4``)."""
    if spec in PRESETS:
        return list(PRESETS[spec])
    sizes = []
    for item in spec.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--sizes: {item!r} is not LAYERSxWIDTHxHEADS (or one of {sorted(PRESETS)})")
        sizes.append(tuple(int(p) for p in parts))
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmkernels scaling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="scaling-runs", help="output directory (data cache, results, checkpoints)")
    p.add_argument("--backend", choices=BACKENDS, default="kernels",
                   help="kernels: llmkernels' Triton ops; reference: plain PyTorch")
    p.add_argument("--sizes", default="default", help=f"preset ({', '.join(PRESETS)}) or LxWxH,LxWxH,...")
    p.add_argument("--limit", type=int, default=None, help="train only the K smallest sizes")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="training tokens per non-embedding parameter")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per step (default: about --target-steps steps, within --min/max-batch)")
    p.add_argument("--target-steps", type=int, default=800)
    p.add_argument("--min-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate at width 256")
    p.add_argument("--lr-exponent", type=float, default=0.5, help="peak lr scales as (256/width)^exponent")
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-tokens", type=int, default=1 << 19, help="held-out tokens for the final loss")
    p.add_argument("--curve-points", type=int, default=10, help="held-out evaluations along each run")
    p.add_argument("--curve-eval-tokens", type=int, default=1 << 15, help="held-out tokens per curve evaluation")
    p.add_argument("--corpus", choices=data_mod.CORPORA, default="stdlib+torch",
                   help="stdlib: the interpreter's standard library; +torch: and torch's Python sources")
    p.add_argument("--tokenizer", choices=("auto",) + data_mod.TOKENIZERS, default="auto",
                   help="auto: bpe when `tokenizers` is installed, else byte")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (end-of-text token included)")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--max-bytes", type=int, default=None, help="use a seeded subset of the stdlib (tests)")
    p.add_argument("--data-root", default=None, help="read *.py files here instead of the stdlib")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--data-seed", type=int, default=0, help="the held-out split (and --max-bytes subset)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 autocast on GPU")
    p.add_argument("--ckpt-interval", type=float, default=120.0, help="seconds between resumable checkpoints")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--fit-only", action="store_true", help="refit and replot the finished sizes; train nothing")
    return p


def auto_batch(tokens: float, seq_len: int, target_steps: int, lo: int, hi: int) -> int:
    """Power-of-two sequences per step giving about ``target_steps`` steps, within [lo, hi]."""
    want = max(1.0, tokens / (seq_len * target_steps))
    b = 1 << max(0, round(math.log2(want)))
    return int(min(hi, max(lo, b)))


def make_plan(args, vocab_size: int) -> list[tuple[ModelConfig, TrainConfig]]:
    sizes = [ModelConfig(vocab_size=vocab_size, n_layers=l, width=w, n_heads=h, seq_len=args.seq_len)
             for (l, w, h) in parse_sizes(args.sizes)]
    sizes.sort(key=ModelConfig.non_embedding_params)
    if args.limit is not None:
        sizes = sizes[: args.limit]
    plan = []
    for m in sizes:
        tokens = args.tokens_per_param * m.non_embedding_params()
        batch = args.batch_size or auto_batch(tokens, m.seq_len, args.target_steps, args.min_batch, args.max_batch)
        t = TrainConfig(tokens=int(tokens), batch_size=batch, lr=args.lr * (256 / m.width) ** args.lr_exponent,
                        warmup_frac=args.warmup_frac, min_lr_ratio=args.min_lr_ratio,
                        weight_decay=args.weight_decay, seed=args.seed, eval_tokens=args.eval_tokens,
                        curve_points=args.curve_points, curve_eval_tokens=args.curve_eval_tokens)
        plan.append((m, t))
    return plan


def assign(plan, world: int) -> list[list[int]]:
    """Sizes per rank: longest (training FLOPs) first onto the least-loaded rank."""
    cost = [t.steps(m.seq_len) * t.batch_size * m.seq_len * m.flops_per_token() for m, t in plan]
    ranks, load = [[] for _ in range(world)], [0.0] * world
    for i in sorted(range(len(plan)), key=lambda i: -cost[i]):
        r = min(range(world), key=lambda r: load[r])
        ranks[r].append(i)
        load[r] += cost[i]
    return [sorted(r) for r in ranks]


def run_key(m: ModelConfig, t: TrainConfig, backend: str, dtype: str, fingerprint: str) -> dict:
    """What a finished size's result must match to be reused."""
    return {"model": m.to_dict(), "train": asdict(t), "backend": backend, "dtype": dtype, "data": fingerprint}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj):
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def compare_backends(out: Path) -> dict | None:
    """Held-out loss and training time, kernels vs reference, for the sizes both backends have
    finished with the same settings."""
    rows = []
    for kpath in sorted((out / "kernels" / "sizes").glob("*.json")):
        k, r = _read_json(kpath), _read_json(out / "reference" / "sizes" / kpath.name)
        if not (k and r) or {**k["key"], "backend": None} != {**r["key"], "backend": None}:
            continue
        rows.append({"name": k["name"], "params": k["params"], "tokens": k["tokens"],
                     "val_loss_kernels": k["val_loss"], "val_loss_reference": r["val_loss"],
                     "val_loss_diff": k["val_loss"] - r["val_loss"],
                     "train_seconds_kernels": k["train_seconds"], "train_seconds_reference": r["train_seconds"],
                     "speedup": r["train_seconds"] / k["train_seconds"],
                     "steady_speedup": k["steady_tokens_per_s"] / r["steady_tokens_per_s"],
                     "device": k["device"]})
    if not rows:
        return None
    rows.sort(key=lambda row: row["params"])
    tk = sum(row["train_seconds_kernels"] for row in rows)
    tr = sum(row["train_seconds_reference"] for row in rows)
    return {"sizes": rows, "train_seconds_kernels": tk, "train_seconds_reference": tr, "speedup": tr / tk,
            "max_abs_val_loss_diff": max(abs(row["val_loss_diff"]) for row in rows)}


def finalize(results: list[dict], args, out: Path, corpus_meta: dict, device_name: str, log) -> dict:
    """Fit, plot and write ``<backend>/scaling.json`` / ``.png``; print the summary."""
    results = sorted(results, key=lambda r: r["params"])
    fit_n = fit_power_law([r["params"] for r in results], [r["val_loss"] for r in results])
    fit_c = fit_power_law([r["compute"] for r in results], [r["val_loss"] for r in results])
    frontier = compute_frontier(results)
    bdir = out / args.backend
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    summary = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "llmkernels scaling " + " ".join(sys.argv[1:] if args.argv is None else args.argv),
        "backend": args.backend, "device": device_name, "torch": torch.__version__, "triton": triton_version,
        "python": platform.python_version(), "world_size": args.world,
        "data": {k: v for k, v in corpus_meta.items() if k != "val_files"},
        "settings": {k: v for k, v in vars(args).items() if k not in ("argv", "world")},
        "fit_loss_vs_params": fit_n, "fit_loss_vs_compute": fit_c, "frontier": frontier,
        "total_train_seconds": sum(r["train_seconds"] for r in results),
        "sizes": [{k: v for k, v in r.items() if k not in ("history", "key")} for r in results],
    }
    title = (f"{args.backend} backend, {device_name}: {corpus_meta['config']['corpus']} sources, "
             f"{corpus_meta['config']['tokenizer']} "
             f"(vocab {corpus_meta['vocab_size']}), {args.tokens_per_param:g} tokens/param")
    png = bdir / "scaling.png"
    summary["png"] = png.name if plot(results, fit_n, fit_c, frontier, str(png), title) else None
    _write_json(bdir / "scaling.json", summary)
    log(f"\n{'size':<14}{'N':>11}{'tokens':>13}{'epochs':>8}{'steps':>7}{'batch':>6}{'val loss':>10}"
        f"{'train s':>9}{'tok/s':>12}")
    for r in results:
        log(f"{r['name']:<14}{r['params']:>11,}{r['tokens']:>13,}{r['epochs']:>8.2f}{r['steps']:>7}"
            f"{r['train']['batch_size']:>6}{r['val_loss']:>10.4f}{r['train_seconds']:>9.1f}{r['tokens_per_s']:>12,.0f}")
    if fit_n["ok"]:
        log(f"fit L(N) = E + A*N^-alpha [{fit_n['method']}]: alpha = {fit_n['alpha']:.4f}, E = {fit_n['E']:.4f}, "
            f"A = {fit_n['A']:.4g}, R^2 = {fit_n['r2']:.5f} ({fit_n['n_points']} sizes)")
    else:
        log(f"fit L(N) failed: {fit_n['error']}")
    if fit_c["ok"]:
        log(f"fit L(C) = E + B*C^-beta: beta = {fit_c['alpha']:.4f}, E = {fit_c['E']:.4f}, R^2 = {fit_c['r2']:.5f}")
    log(f"wrote {bdir / 'scaling.json'}" + (f" and {png}" if summary["png"] else " (no matplotlib: no PNG)"))
    cmp = compare_backends(out)
    if cmp:
        _write_json(out / "compare.json", cmp)
        log(f"\n{'size':<14}{'loss kernels':>13}{'loss ref':>10}{'diff':>9}{'s kernels':>10}{'s ref':>8}"
            f"{'speedup':>9}{'steady':>8}")
        for row in cmp["sizes"]:
            log(f"{row['name']:<14}{row['val_loss_kernels']:>13.4f}{row['val_loss_reference']:>10.4f}"
                f"{row['val_loss_diff']:>+9.4f}{row['train_seconds_kernels']:>10.1f}{row['train_seconds_reference']:>8.1f}"
                f"{row['speedup']:>8.2f}x{row['steady_speedup']:>7.2f}x")
        log(f"kernels vs reference on {len(cmp['sizes'])} sizes: {cmp['speedup']:.2f}x training wall-clock, "
            f"max |loss diff| {cmp['max_abs_val_loss_diff']:.4f} -> {out / 'compare.json'}")
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    args.world = world
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is available")
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if (args.dtype == "bf16" or (args.dtype == "auto" and use_cuda)) else torch.float32
    dist = None
    if world > 1:
        import torch.distributed as dist
        # Only small Python objects travel between ranks (the data-ready flag, the results). NCCL
        # needs one GPU per rank: ranks sharing a GPU use gloo.
        nccl = use_cuda and world <= torch.cuda.device_count()
        dist.init_process_group("nccl" if nccl else "gloo", timeout=_dt.timedelta(hours=12))

    def log(msg=""):
        print(msg if world == 1 else f"[rank {rank}] {msg}", flush=True)

    out = Path(args.out)
    tokenizer = args.tokenizer
    if tokenizer == "auto":
        tokenizer = "bpe" if data_mod.bpe_available() else "byte"
    dcfg = data_mod.DataConfig(corpus=args.corpus, tokenizer=tokenizer, vocab_size=args.vocab_size, heldout_frac=args.heldout_frac,
                               max_bytes=args.max_bytes, seed=args.data_seed, root=args.data_root)
    t_start = time.perf_counter()
    # Rank 0 builds the data cache; the others wait, then load it.
    error = None
    if rank == 0:
        try:
            corpus = data_mod.prepare(dcfg, out / "data", log=log)
        except Exception as exc:  # tell the other ranks before raising
            error = f"{type(exc).__name__}: {exc}"
    if dist is not None:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        if dist is not None:
            dist.destroy_process_group()
        raise SystemExit(f"llmkernels scaling: data preparation failed: {error}")
    if rank != 0:
        corpus = data_mod.prepare(dcfg, out / "data", log=lambda *_: None)

    plan = make_plan(args, corpus.vocab_size)
    if args.list:
        if rank == 0:
            log(f"{'size':<14}{'N':>11}{'tokens':>13}{'epochs':>8}{'batch':>6}{'steps':>7}{'lr':>9}{'PFLOP':>8}")
            for m, t in plan:
                log(f"{m.name:<14}{m.non_embedding_params():>11,}{t.tokens:>13,}{t.tokens / corpus.train.numel():>8.2f}"
                    f"{t.batch_size:>6}{t.steps(m.seq_len):>7}{t.lr:>9.2e}"
                    f"{t.steps(m.seq_len) * t.batch_size * m.seq_len * m.flops_per_token() / 1e15:>8.3f}")
        if dist is not None:
            dist.destroy_process_group()
        return 0

    dtype_name = str(dtype).replace("torch.", "")
    fp = corpus.meta["fingerprint"]
    sizes_dir, ckpt_dir = out / args.backend / "sizes", out / args.backend / "checkpoints"
    sizes_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    mine = assign(plan, world)[rank]
    if world > 1:
        log(f"training {', '.join(plan[i][0].name for i in mine) or 'nothing'} on {device}")
    results, failures = [], []
    for i in mine:
        m, t = plan[i]
        key = run_key(m, t, args.backend, dtype_name, fp)
        path = sizes_dir / f"{m.name}.json"
        done = _read_json(path)
        if done is not None and done.get("key") == key:
            if not args.fit_only:
                log(f"{m.name}: finished earlier (val loss {done['val_loss']:.4f}), not retrained")
            results.append(done)
            continue
        if args.fit_only:
            continue
        try:
            r = train_size(m, t, corpus, backend=args.backend, device=device, dtype=dtype, key=key,
                           ckpt_path=str(ckpt_dir / f"{m.name}.pt"), ckpt_interval=args.ckpt_interval,
                           progress=not args.no_progress, position=rank if world > 1 else 0, log=log)
        except (FloatingPointError, RuntimeError, ValueError) as exc:
            log(f"{m.name}: FAILED: {type(exc).__name__}: {exc}")
            failures.append({"name": m.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        r["key"] = key
        _write_json(path, r)
        log(f"{m.name}: N={r['params']:,} val loss {r['val_loss']:.4f} (train {r['first_train_loss']:.3f} -> "
            f"{r['train_loss']:.3f}) in {r['train_seconds']:.1f}s, {r['tokens_per_s']:,.0f} tok/s")
        results.append(r)

    if dist is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, (results, failures))
        results = [r for rs, _ in gathered for r in rs]
        failures = [f for _, fs in gathered for f in fs]
    status = 0
    if rank == 0:
        if failures:
            log(f"{len(failures)} size(s) failed: " + "; ".join(f"{f['name']}: {f['error']}" for f in failures))
            status = 1
        if results:
            device_name = torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu"
            finalize(results, args, out, corpus.meta, device_name, log)
        else:
            log("no finished sizes to fit")
            status = 1
        log(f"total wall-clock {time.perf_counter() - t_start:.1f}s")
    if dist is not None:
        dist.barrier()  # tear down together: a gloo rank leaving while rank 0 still fits can abort
        dist.destroy_process_group()
    return status
