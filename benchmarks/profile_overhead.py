"""Where the host time of one small norm call goes (decode sizes), on a GPU.

Prints µs per call (CPU-bound loops of back-to-back calls, synchronized once at the end) for
the bare kernel launch, the launcher, the public function with and without autograd, the
backward, and torch's F.rms_norm; then a cProfile of the public call.

    python benchmarks/profile_overhead.py
"""
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import llmkernels as lk
from llmkernels.ops import norm as N_
from llmkernels.ops._common import launch


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    dev = "cuda"
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(1, device=dev)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    out = lk.rms_norm(xg, wg)
    _, _, mean, rstd_s = N_._norm_fwd(x, w, None, None, 1, 1e-6, 0.0, True, True, torch.bfloat16, None, True)

    def bare():
        N_._norm_fwd_kernel[(1,)](x, x, w, x, y, y, y, rstd, 1, 4096, 1, 4096, 0, 4096, 0, 1e-6, 0.0,
                                  IS_RMS=True, HAS_RES=False, HAS_W=True, HAS_B=False, PER_HEAD=False,
                                  QUANTIZE=True, STORE_STATS=False, BLOCK_M=1, BLOCK_N=4096, ONE_PASS=True,
                                  num_warps=8)

    def cached():
        launch(N_._norm_fwd_kernel, (1,), x, x, w, x, y, y, y, rstd, 1, 4096, 1, 4096, 0, 4096, 0, 1e-6, 0.0,
               IS_RMS=True, HAS_RES=False, HAS_W=True, HAS_B=False, PER_HEAD=False,
               QUANTIZE=True, STORE_STATS=False, BLOCK_M=1, BLOCK_N=4096, ONE_PASS=True, num_warps=8)

    rows = [
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("cached launch (ops._common.launch)", cached),
        ("F.rms_norm", lambda: F.rms_norm(x, (4096,), w, 1e-6)),
        ("bare kernel launch", bare),
        ("_norm_fwd launcher", lambda: N_._norm_fwd(x, w, None, None, 1, 1e-6, 0.0, True, True, torch.bfloat16,
                                                    None, False)),
        ("lk.rms_norm no grad", lambda: lk.rms_norm(x, w)),
        ("lk.rms_norm grad-enabled inputs", lambda: lk.rms_norm(xg, wg)),
        ("_norm_bwd launcher", lambda: N_._norm_bwd(dy, None, x, w, None, None, rstd_s, 1, 0.0, True, True,
                                                    torch.bfloat16, None)),
        ("autograd.grad of lk.rms_norm", lambda: torch.autograd.grad(out, (xg, wg), dy, retain_graph=True)),
    ]
    for name, fn in rows:
        print(f"{name:36s} {per_call_us(fn):8.1f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        lk.rms_norm(xg, wg)
        N_._norm_bwd(dy, None, x, w, None, None, rstd_s, 1, 0.0, True, True, torch.bfloat16, None)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
