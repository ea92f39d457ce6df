"""GPU time of the main kernels at the benchmark sizes, to compare two versions of llmkernels.

Only public entry points (``llmkernels.rms_norm``, ``layer_norm``, ``cross_entropy``,
``apply_rope``, ``glu``), so the same file runs against an older commit (``PYTHONPATH`` at its
checkout) and the current code. Each case is one call captured in a CUDA graph and replayed
under ``triton.testing.do_bench`` (median; L2 flushed before each replay): the GPU's time, not
the host's. Modes: ``fwd`` (inputs without gradients), ``bwd`` (the backward of a retained
graph), ``fwd+bwd``. bf16, sizes as the benchmark CLI's:

  norm            rms_norm, layer_norm, rms_norm(residual=..., prenorm=True): [2^27 / N, N],
                  N = 1024 ... 131072 (256 MiB a tensor)
  cross_entropy   default and inplace_backward (fwd+bwd only: its gradient is formed in the
                  forward): 2^30 logits at V = 32000 / 128256 / 262144
  apply_rope      q [8, 32, 4096, 128], k [8, 8, 4096, 128]
  glu             [2^27 / I, I] for I = 4096 and 14336

    python benchmarks/speed_compare.py --out new.json          # {case: ms}
    python benchmarks/speed_compare.py --compare old1.json new1.json old2.json new2.json
    python benchmarks/speed_compare.py --tiny --out tiny.json   # CPU, Triton's interpreter

``--compare`` takes the files of alternate runs, old first (old, new, old, new, ...): per case
the new/old ratio of the medians, and the spread (max / min - 1) between runs of the same code.
``--tiny`` runs tiny shapes once each (wall clock) to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

DTYPE_NAME = "bfloat16"
NORM_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
VOCABS = (32000, 128256, 262144)
GLU_WIDTHS = (4096, 14336)
WARMUP_MS, REP_MS = 10, 40
MODES = ("fwd", "bwd", "fwd+bwd")


class Case(NamedTuple):
    make_inputs: Callable  # (device, dtype) -> {name: tensor}
    call: Callable  # the public function, called with the inputs by name
    grad_inputs: tuple  # the inputs that take gradients
    is_loss: bool = False  # upstream gradient 1 (else random)
    modes: tuple = MODES
    from_graph: bool = False  # gradient-taking inputs given as views (out of earlier ops), as the bench CLI does


def cases(tiny: bool) -> dict:
    """name -> Case, at the benchmark CLI's shapes or tiny ones."""
    import torch

    import llmkernels as lk

    def randn(shape, device, dtype, scale=1.0, shift=0.0):
        return (torch.randn(shape, device=device) * scale + shift).to(dtype)

    out = {}
    widths = (64, 200) if tiny else NORM_WIDTHS
    for n in widths:
        m = 4 if tiny else 2**27 // n

        def norm_inputs(device, dtype, m=m, n=n, residual=False, bias=False):
            inputs = {"x": randn((m, n), device, dtype), "weight": randn((n,), device, dtype, 0.5, 1.0)}
            if residual:
                inputs["residual"] = randn((m, n), device, dtype)
            if bias:
                inputs["bias"] = randn((n,), device, dtype, 0.5)
            return inputs

        out[f"rms_norm N={n}"] = Case(norm_inputs, lambda x, weight: lk.rms_norm(x, weight), ("x", "weight"))
        out[f"layer_norm N={n}"] = Case(lambda d, t, f=norm_inputs: f(d, t, bias=True),
                                        lambda x, weight, bias: lk.layer_norm(x, weight, bias),
                                        ("x", "weight", "bias"))
        out[f"add_rms_norm N={n}"] = Case(lambda d, t, f=norm_inputs: f(d, t, residual=True),
                                          lambda x, weight, residual: lk.rms_norm(x, weight, residual=residual,
                                                                                  prenorm=True),
                                          ("x", "residual", "weight"), from_graph=True)
    for v in ((300, 9000) if tiny else VOCABS):
        m = 2 if tiny else 1 << ((2**30 // v).bit_length() - 1)

        def ce_inputs(device, dtype, m=m, v=v):
            target = torch.randint(0, v, (m,), device=device)
            target[1::97] = -100
            return {"logits": randn((m, v), device, dtype, 2.0), "target": target}

        out[f"cross_entropy V={v}"] = Case(ce_inputs, lambda logits, target: lk.cross_entropy(logits, target),
                                           ("logits",), is_loss=True)
        out[f"cross_entropy_inplace V={v}"] = Case(
            ce_inputs, lambda logits, target: lk.cross_entropy(logits, target, inplace_backward=True), ("logits",),
            is_loss=True, modes=("fwd+bwd",))
    b, hq, hk, s, d = (1, 2, 1, 8, 16) if tiny else (8, 32, 8, 4096, 128)

    def rope_inputs(device, dtype):
        angles = torch.arange(s, device=device, dtype=torch.float32)[:, None] * torch.rand(d // 2, device=device)
        angles = torch.cat((angles, angles), dim=-1)[None]
        return {"q": randn((b, hq, s, d), device, dtype), "k": randn((b, hk, s, d), device, dtype),
                "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}

    out[f"apply_rope q=[{b},{hq},{s},{d}] k=[{b},{hk},{s},{d}]"] = Case(
        rope_inputs, lambda q, k, cos, sin: lk.apply_rope(q, k, cos, sin), ("q", "k"))
    for i in ((64,) if tiny else GLU_WIDTHS):
        m = 4 if tiny else 2**27 // i
        out[f"glu I={i}"] = Case(lambda device, dtype, m=m, i=i: {"gate": randn((m, i), device, dtype),
                                                                "up": randn((m, i), device, dtype)},
                                 lambda gate, up: lk.glu(gate, up), ("gate", "up"))
    return out


def timed_call(case: Case, mode: str, device, dtype):
    """The callable that ``mode`` times (its closure keeps the inputs alive)."""
    import torch

    grads = mode != "fwd"
    leaves = {k: v.requires_grad_(grads and k in case.grad_inputs) for k, v in case.make_inputs(device, dtype).items()}
    params = [leaves[k] for k in case.grad_inputs]

    def forward():
        args = {k: v.view_as(v) if case.from_graph and v.requires_grad else v for k, v in leaves.items()}
        out = case.call(**args)
        return out if isinstance(out, tuple) else (out,)

    if mode == "fwd":
        return forward
    outs = forward()
    grad_outputs = [torch.ones_like(o) if case.is_loss else torch.randn_like(o) for o in outs]
    if mode == "bwd":
        return lambda: torch.autograd.grad(outs, params, grad_outputs, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), params, grad_outputs)


def gpu_ms(make_timed) -> float:
    """do_bench median of one call replayed from a CUDA graph (captured on a side stream, so a
    backward's forward runs on the capturing stream too)."""
    import torch
    from triton.testing import do_bench

    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn = make_timed()
        fn(), fn(), fn()  # warm-up: compilation, allocations
        with torch.cuda.graph(graph, stream=side):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    ms = float(do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
    del graph, fn
    return ms


def cpu_ms(make_timed) -> float:
    fn = make_timed()
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(args) -> dict:
    import torch

    if args.tiny and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # (read when llmkernels defines its kernels: before its import)

    import llmkernels

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, DTYPE_NAME)
    where = torch.cuda.get_device_name() if gpu else "CPU (Triton's interpreter)"
    print(f"{where}; llmkernels {os.path.dirname(llmkernels.__file__)}; torch {torch.__version__}", flush=True)
    results = {}
    start = time.perf_counter()
    for name, case in cases(args.tiny).items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        for mode in case.modes:
            torch.manual_seed(0)
            label = f"{name} {mode}"
            ms = (gpu_ms if gpu else cpu_ms)(lambda: timed_call(case, mode, device, dtype))
            results[label] = round(ms, 5)
            print(f"{label:52s} {ms:9.4f} ms", flush=True)
            if gpu:
                torch.cuda.empty_cache()
    print(f"{len(results)} cases in {time.perf_counter() - start:.0f} s", flush=True)
    return results


def _percent(spread: float) -> str:
    return f"{spread * 100:9.1f}%" if spread == spread else f"{'-':>10s}"  # (one run: no spread)


def compare(paths: list) -> None:
    """Old runs at even positions, new runs at odd ones: per case the new/old ratio of the
    medians and each side's spread between its runs."""
    runs = [json.load(open(p)) for p in paths]
    old, new = runs[0::2], runs[1::2]
    if not new:
        sys.exit("--compare needs at least one old and one new file (old first)")

    def spread(values):
        return max(values) / min(values) - 1 if len(values) > 1 else float("nan")

    print(f"{'case':52s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'old spread':>10s} {'new spread':>10s}")
    ratios, spreads = [], []
    for case in old[0]:
        a = [r[case] for r in old if case in r]
        b = [r[case] for r in new if case in r]
        if not b:
            continue
        ratio = statistics.median(b) / statistics.median(a)
        sa, sb = spread(a), spread(b)
        ratios.append(ratio)
        spreads += [s for s in (sa, sb) if s == s]
        noise = max((s for s in (sa, sb) if s == s), default=float("nan"))
        flag = " *" if noise == noise and abs(ratio - 1) > noise else ""
        print(f"{case:52s} {statistics.median(a):9.4f} {statistics.median(b):9.4f} {ratio:8.3f} "
              f"{_percent(sa)} {_percent(sb)}{flag}")
    if ratios:
        print(f"\nnew/old over {len(ratios)} cases: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    if spreads:
        print(f"run-to-run spread of the same code: median {statistics.median(spreads) * 100:.1f}%, "
              f"max {max(spreads) * 100:.1f}%  (* : new/old further from 1 than the spread of either side)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write {case: ms} here")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="old, new[, old, new ...] result files")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU under Triton's interpreter)")
    parser.add_argument("--only", nargs="+", metavar="PREFIX", help="cases whose names start so")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare)
        return
    results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
