"""Host time of eager calls on a GPU: µs per call of each public op beside torch's own, then a
cProfile of one of them (where the host time goes).

Each figure is a CPU-bound loop of back-to-back calls, synchronized once at the end, so at
these sizes it is the Python and launch path (the GPU time is a few µs). bf16, rows of 4096.

    python benchmarks/profile_overhead.py [--rows 1 4096] [--profile rms_norm]
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import llmkernels as lk


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def cases(m: int):
    """name -> (inputs that take a gradient, llmkernels call, torch eager call)."""
    dev, dt, n = "cuda", torch.bfloat16, 4096
    x, r = torch.randn(m, n, device=dev, dtype=dt), torch.randn(m, n, device=dev, dtype=dt)
    w, b = torch.randn(n, device=dev, dtype=dt), torch.randn(n, device=dev, dtype=dt)
    gate, up = torch.randn(m, 14336, device=dev, dtype=dt), torch.randn(m, 14336, device=dev, dtype=dt)
    q, k = torch.randn(1, 32, m, 128, device=dev, dtype=dt), torch.randn(1, 8, m, 128, device=dev, dtype=dt)
    cos, sin = torch.randn(1, m, 128, device=dev, dtype=dt), torch.randn(1, m, 128, device=dev, dtype=dt)
    logits, target = torch.randn(max(m, 8), 32000, device=dev, dtype=dt), torch.randint(0, 32000, (max(m, 8),),
                                                                                         device=dev)

    def rope_eager(q, k):
        def rot(t):
            return torch.cat((-t[..., 64:], t[..., :64]), dim=-1)
        return q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]

    return {
        "rms_norm": ((x, w), lambda x, w: lk.rms_norm(x, w), lambda x, w: F.rms_norm(x, (n,), w, 1e-6)),
        "layer_norm": ((x, w, b), lambda x, w, b: lk.layer_norm(x, w, b),
                       lambda x, w, b: F.layer_norm(x, (n,), w, b)),
        "add_rms_norm": ((x, r, w), lambda x, r, w: lk.rms_norm(x, w, residual=r, prenorm=True),
                         lambda x, r, w: (F.rms_norm(x + r, (n,), w, 1e-6), x + r)),
        "apply_rope": ((q, k), lambda q, k: lk.apply_rope(q, k, cos, sin), rope_eager),
        "glu": ((gate, up), lambda g, u: lk.glu(g, u), lambda g, u: F.silu(g) * u),
        "cross_entropy": ((logits,), lambda z: lk.cross_entropy(z, target), lambda z: F.cross_entropy(z, target)),
    }


def fwd_bwd(fn, leaves):
    def step():
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(sum(o.float().sum() for o in outs), leaves)
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--profile", default="rms_norm", help="the op whose forward + backward is profiled")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call (host-bound loops)")
    print(f"{'op':14s} {'rows':>5s} {'mode':8s} {'llmkernels':>11s} {'torch':>8s}")
    for m in args.rows:
        for name, (inputs, ours, theirs) in cases(m).items():
            leaves = [t.clone().requires_grad_() for t in inputs]
            with torch.no_grad():
                fwd = [per_call_us(lambda f=f: f(*inputs)) for f in (ours, theirs)]
            both = [per_call_us(fwd_bwd(f, leaves), n=500) for f in (ours, theirs)]
            print(f"{name:14s} {m:5d} {'fwd':8s} {fwd[0]:11.1f} {fwd[1]:8.1f}")
            print(f"{name:14s} {m:5d} {'fwd+bwd':8s} {both[0]:11.1f} {both[1]:8.1f}", flush=True)
    inputs, ours, _ = cases(args.rows[0])[args.profile]
    step = fwd_bwd(ours, [t.clone().requires_grad_() for t in inputs])
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
