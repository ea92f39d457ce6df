"""Sweep the norm kernels' launch configurations on a GPU, and check the chosen defaults.

Times the launchers directly (no autograd), M = 2^27 / N rows (256 MiB per bf16 tensor),
against the device-to-device copy measured in the same run. Used to choose the tables in
``llmkernels/ops/norm.py``; results go to ``$OUT/tune_norm.json`` (or ``--out``).

    python benchmarks/tune_norm.py sweep [--ns 1024,4096] [--which fwd,bwd] [--dtypes bf16,fp32]
    python benchmarks/tune_norm.py split [--ns 32768,65536]  # wide-row backward: row-split configs vs blocked
    python benchmarks/tune_norm.py split-fwd [--ns 65536,131072] [--split-widths 8192,16384]  # wide-row forward
    python benchmarks/tune_norm.py defaults [--ns ...] [--which bwd]  # every dtype and op with the defaults
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

from llmkernels.bench.runner import copy_bandwidth
from llmkernels.ops import _rowsplit as _common
from llmkernels.ops.norm import launchers as N_

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_ms(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def fwd_candidates(n):
    """(BLOCK_M, BLOCK_N, warps, one_pass)."""
    cands = []
    bn = triton.next_power_of_2(n)
    if n <= 32768:
        cands += [(bm, bn, nw, True) for bm, nw in itertools.product([1, 2, 4, 8, 16], [4, 8, 16, 32])
                  if 1024 <= bm * bn <= 32768 and nw * 32 * 4 <= bm * bn and (bm == 1 or bn <= 4096)]
    cands += [(1, c, nw, False) for c, nw in itertools.product([8192, 16384], [16, 32]) if c < n and n >= 32768]
    return cands


def bwd_candidates(n):
    """(BLOCK_M, BLOCK_N, warps, one_pass, programs/SM, prefetch): prefetch 0 none, 1 the next
    tile into registers, 3 / 4 Triton's pipelining in that many stages (where the shared-memory
    buffers of bf16 x, dy and w, stages - 1 of each, fit the programs of an SM)."""
    cands = []
    bn = triton.next_power_of_2(n)
    if n <= 16384:
        cands += [(bm, bn, nw, True, ps, pf) for bm, nw, ps, pf in
                  itertools.product([1, 2, 4, 8], [4, 8, 16, 32], [1, 2, 4], [0, 1, 3, 4])
                  if 1024 <= bm * bn <= 16384 and nw * 32 * 4 <= bm * bn
                  and (pf < 2 or ps * (pf - 1) * (4 * bm * bn + 2 * bn) <= 227 * 1024)]
    cands += [(bm, c, nw, False, ps, 0) for bm, c, nw, ps in itertools.product([2, 4], [1024, 2048], [4, 8], [2, 4])
              if c < n and n >= 8192]
    return cands


def make_inputs(n, dtype, is_rms, residual):
    m = 2**27 // n
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    b = None if is_rms else torch.randn(n, device="cuda", dtype=dtype)
    r = torch.randn(m, n, device="cuda", dtype=dtype) if residual else None
    return x, w, b, r


def run_fwd(x, w, b, r, is_rms):
    return N_._norm_fwd(x, w, b, r, 1, 1e-6, 0.0, is_rms, is_rms, x.dtype, None if r is None else x.dtype, True)


def time_case(n, dtype, is_rms, residual, mode, records, ceiling, tag, cfg=None):
    x, w, b, r = make_inputs(n, dtype, is_rms, residual)
    esize, units_fwd, units_bwd = x.element_size(), (4 if residual else 2), (4 if residual else 3)
    if mode == "fwd":
        fn, units = (lambda: run_fwd(x, w, b, r, is_rms)), units_fwd
    else:
        y, h, mean, rstd = run_fwd(x, w, b, r, is_rms)
        xin = x if h is None else h
        dy = torch.randn_like(y)
        dh = torch.randn_like(h) if residual else None
        fn = lambda: N_._norm_bwd(dy, dh, xin, w, None if b is None else b.dtype, mean, rstd, 1, 0.0, is_rms,
                                  is_rms, x.dtype, None if r is None else x.dtype, True)
        units = units_bwd
    try:
        fn()
        ms = bench_ms(fn)
    except Exception as e:  # a config that does not compile (registers, shared memory) is skipped
        print(f"  {tag} n={n} {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return None
    gbps = units * x.numel() * esize / ms / 1e6
    rec = dict(tag=tag, mode=mode, n=n, m=x.shape[0], dtype=str(dtype).split(".")[1], is_rms=is_rms,
               residual=residual, cfg=cfg, ms=ms, gbps=gbps, pct=gbps / ceiling)
    records.append(rec)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sweep", "split", "split-fwd", "defaults"])
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--op", choices=["rms", "ln"], default="rms")
    ap.add_argument("--split-widths", default="4096,8192", help="split: columns per program to try")
    ap.add_argument("--dtypes", default="bf16", help="sweep, split, split-fwd: input dtypes to try")
    ap.add_argument("--residual", action="store_true", help="split-fwd: with the fused residual add")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ceiling = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}  copy {ceiling:.0f} GB/s", flush=True)
    records = []
    ns = [int(v) for v in args.ns.split(",")]
    if args.what == "sweep":
        orig_fwd, orig_bwd = N_._fwd_config, N_._bwd_config
        for n, dname in itertools.product(ns, args.dtypes.split(",")):
            for mode in args.which.split(","):
                best = None
                for cfg in (fwd_candidates(n) if mode == "fwd" else bwd_candidates(n)):
                    # early weight load (fwd) and the program cap (bwd) stay off at these sizes
                    if mode == "fwd":
                        N_._fwd_config = lambda *_, cfg=cfg: cfg + (False, 0)
                    else:
                        N_._bwd_config = lambda *_, cfg=cfg: cfg[:5] + (0, cfg[5], 0)
                    rec = time_case(n, DTYPES[dname], args.op == "rms", False, mode, records, ceiling, "sweep", cfg)
                    if rec and (best is None or rec["gbps"] > best["gbps"]):
                        best = rec
                    torch.cuda.empty_cache()
                N_._fwd_config, N_._bwd_config = orig_fwd, orig_bwd
                print(f"{mode} {dname} n={n:6d} best {best['cfg']} {best['gbps']:.0f} GB/s ({best['pct']:.1%})", flush=True)
    elif args.what == "split":
        # (columns per program, num_warps, stages: 0 in step, >= 2 a row ahead, pipelined, weight kept
        # packed); None = blocked
        widths = [int(v) for v in args.split_widths.split(",")]
        cands = [None] + list(itertools.product(widths, [8, 16], [0, 3, 4], [False, True]))
        saved = N_._split_config, _common.ROW_SPLIT
        for n, dname, cfg in itertools.product(ns, args.dtypes.split(","), cands):
            _common.ROW_SPLIT = cfg is not None
            N_._split_config = (lambda *_, cfg=cfg: cfg) if cfg else saved[0]
            rec = time_case(n, DTYPES[dname], args.op == "rms", False, "bwd", records, ceiling, "split", cfg)
            if rec:
                print(f"{args.op} bwd {dname} n={n:6d} {str(cfg):22s} {rec['gbps']:5.0f} GB/s ({rec['pct']:.1%})",
                      flush=True)
            torch.cuda.empty_cache()
        N_._split_config, _common.ROW_SPLIT = saved
    elif args.what == "split-fwd":
        # (columns per program, num_warps, programs per SM); None = the blocked loop
        widths = [int(v) for v in args.split_widths.split(",")]
        cands = [None] + [(c, nw, per_sm) for c, nw, per_sm in itertools.product(widths, [4, 8, 16], [1, 2, 4])
                          if per_sm * nw <= 16]
        saved = N_._fwd_split_config, _common.ROW_SPLIT
        for n, dname, cfg in itertools.product(ns, args.dtypes.split(","), cands):
            _common.ROW_SPLIT = cfg is not None
            N_._fwd_split_config = (lambda *_, cfg=cfg: cfg) if cfg else saved[0]
            rec = time_case(n, DTYPES[dname], args.op == "rms", args.residual, "fwd", records, ceiling, "split-fwd",
                            cfg)
            if rec:
                print(f"{args.op}{' +res' if args.residual else ''} fwd {dname} n={n:6d} {str(cfg):21s} "
                      f"{rec['gbps']:5.0f} GB/s ({rec['pct']:.1%})", flush=True)
            torch.cuda.empty_cache()
        N_._fwd_split_config, _common.ROW_SPLIT = saved
    else:
        print(f"{'op':10s} {'dtype':5s} {'N':>7s}  fwd GB/s (%copy)   bwd GB/s (%copy)")
        for (op, is_rms, residual), (dname, dtype), n in itertools.product(
                [("rmsnorm", True, False), ("layernorm", False, False), ("add_rms", True, True)], DTYPES.items(), ns):
            if dtype == torch.float32 and n > 65536:
                continue
            recs = [time_case(n, dtype, is_rms, residual, mode, records, ceiling, op) if mode in args.which else None
                    for mode in ("fwd", "bwd")]
            cells = "   ".join(f"{r['gbps']:5.0f} ({r['pct']:5.1%})" if r else "  -           " for r in recs)
            print(f"{op:10s} {dname:5s} {n:7d}  {cells}", flush=True)
            torch.cuda.empty_cache()
    name = f"tune_norm_{args.what}_{args.op}{'_res' if args.residual else ''}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_gbps=ceiling,
                       records=records), f, indent=1)


if __name__ == "__main__":
    main()
