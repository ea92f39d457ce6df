"""Launch configurations of the norm kernels at decode sizes (M = 1..256 rows, N = 4096, bf16),
timed as calls replayed from a CUDA graph (the GPU time alone; ``llmkernels.bench``'s
``decode_graph`` timing). Forward with the statistics stored (as in training), backward with
every gradient (dW/dB as the launcher writes them). Used to choose the small-M rules of ``_fwd_config`` and
``_bwd_config`` in ``llmkernels/ops/norm.py`` (each sweep replaces them with a fixed configuration).

    python benchmarks/decode_sweep.py [--which fwd,bwd] [--ms 1,8,32]   # writes $OUT/decode_sweep.json (or ./)
"""
import argparse
import itertools
import json
import os

import torch
import triton

from llmkernels.bench.runner import _graph_latency_ms
from llmkernels.ops.norm import launchers as N_

N = 4096
OPS = {"rms": (True, False), "ln": (False, False), "add_rms": (True, True)}  # (RMSNorm?, residual?)


def time_us(fn) -> float:
    return 1e3 * _graph_latency_ms(lambda: fn)


def fwd_candidates(m):
    """(BLOCK_M, BLOCK_N, warps, one_pass, weight loaded with the row, no tail)."""
    return [(bm, N, nw, True, early, 0) for bm, nw, early in itertools.product([1, 2, 4], [2, 4, 8, 16], [False, True])
            if bm <= m]


def bwd_candidates(m, is_rms):
    """(BLOCK_M, BLOCK_N, warps, one_pass, programs per SM, most programs, prefetch, no tail): each program
    takes BLOCK_M rows a tile, at most ``most programs`` of them (one: no partials to sum, dW
    written directly), no prefetch."""
    max_tile = 16384 if is_rms else 8192
    cands = []
    for bm, nw, progs in itertools.product([1, 2, 4, 8, 16], [4, 8, 16], [1, 2, 4, 8, 16, 32, 64]):
        tiles = triton.cdiv(m, bm)
        if bm <= triton.next_power_of_2(m) and bm * N <= max_tile and progs <= tiles and nw * 32 * 4 <= bm * N:
            cands.append((bm, N, nw, True, 1, progs, 0, 0))
    return cands


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--ms", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--ops", default="rms,ln,add_rms")
    args = ap.parse_args()
    records = []
    default_fwd, default_bwd = N_._fwd_config, N_._bwd_config
    for op, m in itertools.product(args.ops.split(","), [int(v) for v in args.ms.split(",")]):
        is_rms, residual = OPS[op]
        x = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x) if residual else None
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)

        def fwd():
            return N_._norm_fwd(x, w, b, r, 1, 1e-6, 0.0, is_rms, is_rms, x.dtype, None if r is None else x.dtype,
                                True)

        y, h, mean, rstd = fwd()
        dy = torch.randn_like(y)
        dh = None if h is None else torch.randn_like(h)

        def bwd():
            return N_._norm_bwd(dy, dh, x if h is None else h, w, None if b is None else b.dtype, mean, rstd, 1, 0.0,
                                is_rms, is_rms, x.dtype, None if r is None else x.dtype, True)

        base = {"op": op, "n": N, "m": m}
        for which, fn, cands, attr, default in (("fwd", fwd, fwd_candidates(m), "_fwd_config", default_fwd),
                                                 ("bwd", bwd, bwd_candidates(m, is_rms), "_bwd_config", default_bwd)):
            if which not in args.which:
                continue
            mine = [dict(base, which=which, cfg="default", us=time_us(fn))]
            for cfg in cands:
                setattr(N_, attr, lambda *_, c=cfg: c)
                try:
                    mine.append(dict(base, which=which, cfg=list(cfg), us=time_us(fn)))
                finally:
                    setattr(N_, attr, default)
            mine.append(dict(base, which=which, cfg="default again", us=time_us(fn)))
            best = sorted(mine, key=lambda rec: rec["us"])[:3]
            print(f"{op} {which} M={m}: default {mine[0]['us']:.2f} / {mine[-1]['us']:.2f} us, best "
                  + ", ".join(f"{rec['us']:.2f} {rec['cfg']}" for rec in best), flush=True)
            records += mine
    out = os.path.join(os.environ.get("OUT", "."), "decode_sweep.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=0)


if __name__ == "__main__":
    main()
