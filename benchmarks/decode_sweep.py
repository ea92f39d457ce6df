"""Launch configurations of the norm kernels at decode sizes (M = 1..256 rows, N = 4096, bf16),
timed as calls replayed from a CUDA graph (the GPU time alone, as ``llmkernels.bench``'s
``decode_graph`` timing). Forward with the statistics stored (as in training), backward with
every gradient (dW/dB as the launcher writes them). Used to choose the decode rows of the tables
in ``llmkernels/ops/norm/tables.py``: each candidate is passed to the launchers as ``config=``.

    python benchmarks/decode_sweep.py [--which fwd,bwd] [--ms 1,8,32]   # writes $OUT/decode_sweep.json (or ./)
    python benchmarks/decode_sweep.py --tiny --ms 2 --ops rms           # CPU, Triton's interpreter: checks the script
"""
import argparse
import itertools
import json
import os
import time

import torch

N = 4096
OPS = {"rms": (True, False), "ln": (False, False), "add_rms": (True, True)}  # (RMSNorm?, residual?)


def graph_us(fn) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph, timed as the bench's decode cells are."""
    from llmkernels.bench.runner import graph_latency_ms

    return 1e3 * graph_latency_ms(lambda: fn)


def wall_us(fn) -> float:
    """The CPU's stand-in (``--tiny``): wall clock of one call, after one."""
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def fwd_candidates(m, n, norm):
    """Forward configurations: rows a program, warps, the weight loaded with the row or not."""
    return [norm.FwdConfig(bm, n, nw, early_w=early)
            for bm, nw, early in itertools.product([1, 2, 4], [2, 4, 8, 16], [False, True]) if bm <= m]


def bwd_candidates(m, n, is_rms, norm):
    """Backward configurations: each program takes ``block_m`` rows a tile, at most ``max_programs``
    of them (each also summing dW / dB of its columns; one: no partials to sum), no prefetch."""
    max_tile = 16384 if is_rms else 8192
    cands = []
    for bm, nw, progs in itertools.product([1, 2, 4, 8, 16], [4, 8, 16], [1, 2, 4, 8, 16, 32, 64]):
        tiles = -(-m // bm)
        if bm <= 1 << max(0, m - 1).bit_length() and bm * n <= max_tile and progs <= tiles and nw * 32 * 4 <= bm * n:
            cands.append(norm.BwdConfig(bm, n, nw, max_programs=progs))
    return cands


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--ms", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--ops", default="rms,ln,add_rms")
    ap.add_argument("--tiny", action="store_true", help="CPU under Triton's interpreter, N = 512: checks the script")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # (read when llmkernels defines its kernels: before its import)
    from llmkernels.ops import norm

    device, n, time_us = ("cpu", 512, wall_us) if args.tiny else ("cuda", N, graph_us)
    records = []
    for op, m in itertools.product(args.ops.split(","), [int(v) for v in args.ms.split(",")]):
        is_rms, residual = OPS[op]
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        r = torch.randn_like(x) if residual else None
        w = torch.randn(n, device=device, dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(n, device=device, dtype=torch.bfloat16)

        res = None if r is None else x.dtype
        options = norm.NormOptions(is_rms, is_rms, 1, 1e-6, 0.0, x.dtype, res, x.dtype, res,
                                   None if b is None else b.dtype)

        def fwd(config=None):
            return norm.norm_fwd(x, w, b, r, options, store_stats=True, config=config)

        y, h, mean, rstd = fwd()
        dy = torch.randn_like(y)
        dh = None if h is None else torch.randn_like(h)

        def bwd(config=None):
            return norm.norm_bwd(dy, dh, x if h is None else h, w, mean, rstd, options, share_dres=True, config=config)

        base = {"op": op, "n": n, "m": m}
        for which, fn, cands in (("fwd", fwd, fwd_candidates(m, n, norm)),
                                 ("bwd", bwd, bwd_candidates(m, n, is_rms, norm))):
            if which not in args.which:
                continue
            mine = [dict(base, which=which, cfg="default", us=time_us(fn))]
            for cfg in cands:
                mine.append(dict(base, which=which, cfg=repr(cfg), us=time_us(lambda c=cfg: fn(c))))
            mine.append(dict(base, which=which, cfg="default again", us=time_us(fn)))
            best = sorted(mine, key=lambda rec: rec["us"])[:3]
            print(f"{op} {which} M={m}: default {mine[0]['us']:.2f} / {mine[-1]['us']:.2f} us, best "
                  + ", ".join(f"{rec['us']:.2f} {rec['cfg']}" for rec in best), flush=True)
            records += mine
    out = os.path.join(os.environ.get("OUT", "."), "decode_sweep.json")
    with open(out, "w") as f:
        json.dump({"device": "CPU (Triton's interpreter)" if args.tiny else torch.cuda.get_device_name(),
                   "records": records}, f, indent=0)


if __name__ == "__main__":
    main()
