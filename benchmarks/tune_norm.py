"""Sweep the norm kernels' launch configurations on a GPU, and check the chosen defaults.

Times the launchers directly (no autograd; ``llmkernels.ops.norm.norm_fwd`` / ``norm_bwd`` with
``config=``), M = 2^27 / N rows (256 MiB per bf16 tensor), against the device-to-device copy
measured in the same run. Used to choose the tables of ``llmkernels/ops/norm/tables.py``;
results go to ``$OUT/tune_norm_<what>_<op>.json`` (or ``--out``).

    python benchmarks/tune_norm.py sweep [--ns 1024,4096] [--which fwd,bwd] [--dtypes bf16,fp32]
    python benchmarks/tune_norm.py split [--ns 32768,65536]  # wide-row backward: row-split configs vs blocked
    python benchmarks/tune_norm.py split-fwd [--ns 65536,131072] [--split-widths 8192,16384]  # wide-row forward
    python benchmarks/tune_norm.py split-fwd --split-configs 4096:4:4:0,4096:4:4:3  # named forward splits
    python benchmarks/tune_norm.py defaults [--ns ...] [--which bwd]  # every dtype and op with the defaults
    python benchmarks/tune_norm.py sweep --tiny --ns 256 --out /tmp  # CPU, Triton's interpreter: checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time
import timeit

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fwd_candidates(n, norm):
    """Forward configurations to sweep: whole rows a program, or a row in chunks."""
    cands = []
    bn = next_pow2(n)
    if n <= 32768:
        cands += [norm.FwdConfig(bm, bn, nw) for bm, nw in itertools.product([1, 2, 4, 8, 16], [4, 8, 16, 32])
                  if 1024 <= bm * bn <= 32768 and nw * 32 * 4 <= bm * bn and (bm == 1 or bn <= 4096)]
    cands += [norm.FwdConfig(1, c, nw, one_pass=False) for c, nw in itertools.product([8192, 16384], [16, 32])
              if c < n and n >= 32768]
    return cands


def bwd_candidates(n, norm):
    """Backward configurations to sweep: prefetch 0 none, 1 the next tile into registers, 3 / 4
    Triton's pipelining in that many stages (where the shared-memory buffers of bf16 x, dy and w,
    stages - 1 of each, fit the programs of an SM)."""
    cands = []
    bn = next_pow2(n)
    if n <= 16384:
        cands += [norm.BwdConfig(bm, bn, nw, per_sm=ps, prefetch=pf) for bm, nw, ps, pf in
                  itertools.product([1, 2, 4, 8], [4, 8, 16, 32], [1, 2, 4], [0, 1, 3, 4])
                  if 1024 <= bm * bn <= 16384 and nw * 32 * 4 <= bm * bn
                  and (pf < 2 or ps * (pf - 1) * (4 * bm * bn + 2 * bn) <= 227 * 1024)]
    cands += [norm.BwdConfig(bm, c, nw, one_pass=False, per_sm=ps)
              for bm, c, nw, ps in itertools.product([2, 4], [1024, 2048], [4, 8], [2, 4]) if c < n and n >= 8192]
    return cands


class Bench:
    """Inputs, timing and the copy ceiling: on the GPU (256 MiB tensors, ``do_bench``) or, with
    ``tiny``, on CPU under Triton's interpreter (4 rows, wall clock: checks the script only)."""

    def __init__(self, tiny: bool, norm):
        self.tiny, self.norm = tiny, norm
        self.device = torch.device("cpu" if tiny else "cuda")
        if tiny:
            self.sms, self.ceiling, self.name = 0, self.copy_bandwidth_cpu(), "CPU (Triton's interpreter)"
        else:
            from llmkernels.bench.runner import copy_bandwidth

            self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.ceiling, self.name = copy_bandwidth(self.device), torch.cuda.get_device_name()

    def ms(self, fn) -> float:
        if not self.tiny:
            from triton.testing import do_bench

            return do_bench(fn, warmup=10, rep=60, return_mode="median")
        return 1e3 * statistics.median(timeit.repeat(fn, number=1, repeat=3))

    def copy_bandwidth_cpu(self) -> float:
        src = torch.empty(1 << 20, dtype=torch.uint8)
        return 2 * src.numel() / self.ms(src.clone) / 1e6

    def rows(self, n: int) -> int:
        return 4 if self.tiny else 2**27 // n

    def inputs(self, n, dtype, is_rms, residual):
        m = self.rows(n)
        x = torch.randn(m, n, device=self.device, dtype=dtype)
        w = torch.randn(n, device=self.device, dtype=dtype)
        b = None if is_rms else torch.randn(n, device=self.device, dtype=dtype)
        r = torch.randn(m, n, device=self.device, dtype=dtype) if residual else None
        return x, w, b, r

    def without_split(self, n, dtype, is_rms, residual):
        """The tables' configurations where the row may not split (the blocked loops)."""
        key = self.norm.NormKey(is_rms, dtype, residual, n, self.rows(n), self.sms, split=False)
        return self.norm.forward_config(key), self.norm.backward_config(key)


def options_of(norm, x, b, r, is_rms):
    """The options of an RMSNorm (Llama's casting) or LayerNorm call on these inputs."""
    res = None if r is None else x.dtype
    return norm.NormOptions(is_rms, is_rms, 1, 1e-6, 0.0, x.dtype, res, x.dtype, res, None if b is None else b.dtype)


def run_fwd(norm, x, w, b, r, is_rms, config=None):
    return norm.norm_fwd(x, w, b, r, options_of(norm, x, b, r, is_rms), store_stats=True, config=config)


def time_case(bench, n, dtype, is_rms, residual, mode, records, tag, cfg=None):
    """Time the launcher of ``mode`` with the launch configuration ``cfg`` (None: the tables')."""
    norm = bench.norm
    x, w, b, r = bench.inputs(n, dtype, is_rms, residual)
    esize, units_fwd, units_bwd = x.element_size(), (4 if residual else 2), (4 if residual else 3)
    if mode == "fwd":
        fn, units = (lambda: run_fwd(norm, x, w, b, r, is_rms, cfg)), units_fwd
    else:
        y, h, mean, rstd = run_fwd(norm, x, w, b, r, is_rms)
        xin = x if h is None else h
        dy = torch.randn_like(y)
        dh = torch.randn_like(h) if residual else None
        options = options_of(norm, x, b, r, is_rms)
        fn = lambda: norm.norm_bwd(dy, dh, xin, w, mean, rstd, options, share_dres=True, config=cfg)
        units = units_bwd
    try:
        fn()
        ms = bench.ms(fn)
    except Exception as e:  # a config that does not compile (registers, shared memory) is skipped
        print(f"  {tag} n={n} {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return None
    gbps = units * x.numel() * esize / ms / 1e6
    rec = dict(tag=tag, mode=mode, n=n, m=x.shape[0], dtype=str(dtype).split(".")[1], is_rms=is_rms,
               residual=residual, cfg=None if cfg is None else {type(cfg).__name__: dataclasses.asdict(cfg)},
               ms=ms, gbps=gbps, pct=gbps / bench.ceiling)
    records.append(rec)
    return rec


def free(bench):
    if not bench.tiny:
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sweep", "split", "split-fwd", "defaults"])
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--op", choices=["rms", "ln"], default="rms")
    ap.add_argument("--split-widths", default="4096,8192", help="split: columns per program to try")
    ap.add_argument("--split-configs", default="",
                    help="split-fwd: block_n:warps:per_sm[:stages],... to try instead of the widths' grid")
    ap.add_argument("--dtypes", default="bf16", help="sweep, split, split-fwd: input dtypes to try")
    ap.add_argument("--residual", action="store_true", help="split-fwd: with the fused residual add")
    ap.add_argument("--tiny", action="store_true", help="CPU under Triton's interpreter, 4 rows: checks the script")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # (read when llmkernels defines its kernels: before its import)
    from llmkernels.ops import norm

    bench = Bench(args.tiny, norm)
    print(f"{bench.name}  copy {bench.ceiling:.0f} GB/s", flush=True)
    records = []
    ns = [int(v) for v in args.ns.split(",")]
    is_rms = args.op == "rms"
    if args.what == "sweep":
        for n, dname in itertools.product(ns, args.dtypes.split(",")):
            for mode in args.which.split(","):
                best = None
                # the weight loaded early (fwd) and the program cap (bwd) stay off at these sizes
                for cfg in (fwd_candidates(n, norm) if mode == "fwd" else bwd_candidates(n, norm)):
                    rec = time_case(bench, n, DTYPES[dname], is_rms, False, mode, records, "sweep", cfg)
                    if rec and (best is None or rec["gbps"] > best["gbps"]):
                        best = rec
                    free(bench)
                if best:
                    print(f"{mode} {dname} n={n:6d} best {best['cfg']} {best['gbps']:.0f} GB/s ({best['pct']:.1%})",
                          flush=True)
    elif args.what == "split":
        # (columns per program, num_warps, stages: 0 in step, >= 2 a row ahead, pipelined, weight kept
        # packed); None = blocked
        widths = [int(v) for v in args.split_widths.split(",")]
        cands = [None] + [norm.SplitBwdConfig(*c) for c in itertools.product(widths, [8, 16], [0, 3, 4], [False, True])]
        for n, dname, cfg in itertools.product(ns, args.dtypes.split(","), cands):
            config = cfg or bench.without_split(n, DTYPES[dname], is_rms, False)[1]
            rec = time_case(bench, n, DTYPES[dname], is_rms, False, "bwd", records, "split", config)
            if rec:
                print(f"{args.op} bwd {dname} n={n:6d} {str(cfg):60s} {rec['gbps']:5.0f} GB/s ({rec['pct']:.1%})",
                      flush=True)
            free(bench)
    elif args.what == "split-fwd":
        # (columns per program, num_warps, programs per SM[, stages]); None = the blocked loop
        if args.split_configs:
            cands = [None] + [norm.SplitFwdConfig(*(int(v) for v in c.split(":")))
                              for c in args.split_configs.split(",")]
        else:
            widths = [int(v) for v in args.split_widths.split(",")]
            cands = [None] + [norm.SplitFwdConfig(c, nw, per_sm) for c, nw, per_sm in
                              itertools.product(widths, [4, 8, 16], [1, 2, 4]) if per_sm * nw <= 16]
        for n, dname, cfg in itertools.product(ns, args.dtypes.split(","), cands):
            config = cfg or bench.without_split(n, DTYPES[dname], is_rms, args.residual)[0]
            rec = time_case(bench, n, DTYPES[dname], is_rms, args.residual, "fwd", records, "split-fwd", config)
            if rec:
                print(f"{args.op}{' +res' if args.residual else ''} fwd {dname} n={n:6d} {str(cfg):50s} "
                      f"{rec['gbps']:5.0f} GB/s ({rec['pct']:.1%})", flush=True)
            free(bench)
    else:
        print(f"{'op':10s} {'dtype':5s} {'N':>7s}  fwd GB/s (%copy)   bwd GB/s (%copy)")
        for (op, op_rms, residual), (dname, dtype), n in itertools.product(
                [("rmsnorm", True, False), ("layernorm", False, False), ("add_rms", True, True)], DTYPES.items(), ns):
            if dtype == torch.float32 and n > 65536:
                continue
            recs = [time_case(bench, n, dtype, op_rms, residual, mode, records, op) if mode in args.which else None
                    for mode in ("fwd", "bwd")]
            cells = "   ".join(f"{r['gbps']:5.0f} ({r['pct']:5.1%})" if r else "  -           " for r in recs)
            print(f"{op:10s} {dname:5s} {n:7d}  {cells}", flush=True)
            free(bench)
    name = f"tune_norm_{args.what}_{args.op}{'_res' if args.residual else ''}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(device=bench.name, date=time.strftime("%Y-%m-%d"), copy_gbps=bench.ceiling,
                       records=records), f, indent=1)


if __name__ == "__main__":
    main()
