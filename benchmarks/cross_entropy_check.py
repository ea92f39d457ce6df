"""Cross-entropy and fused linear cross-entropy on a GPU, in one run: correctness at the
benchmark sizes, a sweep of launch configurations, and the peers.

    python benchmarks/cross_entropy_check.py --out results.json [--sweep]

cross_entropy, bf16 logits [M, V] (8192 x 32000, 8192 x 128256, 4096 x 262144):
  fwd       logits without grad: GB/s counts the logits read once;
  fwd+bwd   loss, then torch.autograd.grad(loss, logits) (upstream gradient 1): GB/s counts the
            logits read once and the gradient written once.
  providers llmkernels (default: separate backward), llmkernels_inplace (inplace_backward=True:
            the gradient formed in the forward), torch (F.cross_entropy), torch_compile
            (torch.compile of F.cross_entropy), liger (LigerCrossEntropyFunction, which also
            writes the gradient over the logits in the forward). Quack is not run: its
            nvidia-cutlass-dsl wheel is larger than what can be carried to the GPU machine.
linear_cross_entropy, M = 16384, H = 4096, V = 128256 bf16, forward + backward (gradients of
  hidden and weight): time, and the peak memory above what was allocated before the call
  (torch.cuda.max_memory_allocated), for the unfused ``F.cross_entropy(hidden @ weight.T)``,
  llmkernels (fp32 weight-gradient accumulator, and accum_dtype=None) and Liger's
  LigerFusedLinearCrossEntropyFunction.
Timing: triton.testing.do_bench medians (it flushes L2 before each call); device-to-device copy
bandwidth measured first, in the same process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import llmkernels
from llmkernels.bench.runner import copy_bandwidth
from llmkernels.ops.configs.cross_entropy import DEFAULT_CONFIG, SplitInplace

CE_SHAPES = [(8192, 32000), (8192, 128256), (4096, 262144)]
LCE_SHAPE = (16384, 4096, 128256)
DTYPE = torch.bfloat16


def median_ms(fn, rep=200):
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------------------------
# cross_entropy providers: (logits, target) -> loss
# --------------------------------------------------------------------------------------------
def _liger_ce():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    return lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean", None, False, False,
                                                        False)[0]


def ce_providers():
    torch._dynamo.reset()
    provs = {
        "llmkernels": lambda x, t: llmkernels.cross_entropy(x, t),
        "llmkernels_inplace": lambda x, t: llmkernels.cross_entropy(x, t, inplace_backward=True),
        "torch": lambda x, t: F.cross_entropy(x, t),
        "torch_compile": torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False),
    }
    try:
        provs["liger"] = _liger_ce()
    except ImportError as exc:
        print(f"liger: not available ({exc})")
    return provs


def time_ce(fn, x, t, mode):
    if mode == "fwd":
        x.requires_grad_(False)
        return median_ms(lambda: fn(x, t))
    x.requires_grad_(True)
    return median_ms(lambda: torch.autograd.grad(fn(x, t), x))


def check_ce_big(x, t):
    """llmkernels vs F.cross_entropy in fp32 on the benchmark logits: loss and gradient."""
    ref_x = x.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_x, t)
    (ref_g,) = torch.autograd.grad(ref, ref_x)
    out = {}
    leaf = x.detach().clone().requires_grad_()
    loss = llmkernels.cross_entropy(leaf, t)
    (g,) = torch.autograd.grad(loss, leaf)
    out["default"] = (rel(loss.float(), ref), rel(g, ref_g))
    leaf = x.detach().clone().requires_grad_()
    loss = llmkernels.cross_entropy(leaf, t, inplace_backward=True)
    (g,) = torch.autograd.grad(loss, leaf)
    out["inplace"] = (rel(loss.float(), ref), rel(g, ref_g))
    return out


# Launch configurations tried by --sweep (the in-place fwd+bwd of each): the split in-place pass
# at other slice widths and warps, and the pass that reads each row twice in one program.
SWEEP = {
    **{f"split-{block_v // 1024}k-w{warps}": dataclasses.replace(
        DEFAULT_CONFIG, split_inplace=SplitInplace(block_v, warps, results="--sweep"))
       for block_v, warps in ((16384, 8), (16384, 16), (32768, 16), (32768, 32))},
    "two-pass": dataclasses.replace(DEFAULT_CONFIG, split_inplace=None),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="also time the launch configurations in SWEEP")
    parser.add_argument("--skip-linear", action="store_true")
    args = parser.parse_args()
    dev = torch.cuda.get_device_name()
    copy = copy_bandwidth(torch.device("cuda"))
    print(f"{dev}: copy {copy:.0f} GB/s, torch {torch.__version__}", flush=True)
    records = []

    def record(**kw):
        kw.update(device=dev, dtype="bfloat16", copy_gbps=round(copy, 1))
        records.append(kw)
        gb = f"{kw['gbps']:7.0f} GB/s ({kw['gbps'] / copy:4.2f} x copy)" if kw.get("gbps") else ""
        mem = f" peak {kw['peak_mem'] / 2**30:6.2f} GiB" if kw.get("peak_mem") is not None else ""
        print(f"{kw['op']:22s} {kw['mode']:8s} {kw['provider']:26s} M={kw['M']:6d} V={kw['V']:6d} "
              f"{kw['ms']:8.3f} ms {gb}{mem}", flush=True)

    provs = ce_providers()
    for m, v in CE_SHAPES:
        torch.manual_seed(0)
        x = (torch.randn(m, v, device="cuda") * 2).to(DTYPE)
        t = torch.randint(0, v, (m,), device="cuda")
        t[::97] = -100
        errs = check_ce_big(x, t)
        print(f"check {m}x{v}: " + ", ".join(f"{k}: loss {a:.1e} grad {b:.1e}" for k, (a, b) in errs.items()),
              flush=True)
        for k, (a, b) in errs.items():
            records.append(dict(op="cross_entropy", mode="check", provider=f"llmkernels_{k}", M=m, V=v,
                                loss_rel_err=a, grad_rel_err=b, device=dev))
        nbytes = {"fwd": m * v * 2, "fwd+bwd": 2 * m * v * 2}
        for mode in ("fwd", "fwd+bwd"):
            for name, fn in provs.items():
                xi = x.clone()
                try:
                    ms = time_ce(fn, xi, t, mode)
                except Exception as exc:  # a peer that cannot run this size
                    print(f"{name} {mode} {m}x{v}: failed: {str(exc)[:200]}")
                    continue
                record(op="cross_entropy", mode=mode, provider=name, M=m, V=v, ms=ms,
                       gbps=nbytes[mode] / ms / 1e6)
                del xi
            if args.sweep and mode == "fwd+bwd":  # the swept settings are those of the in-place pass
                for cfg, config in SWEEP.items():
                    ms = time_ce(lambda x, t: llmkernels.cross_entropy(x, t, inplace_backward=True, config=config),
                                 x.clone(), t, mode)
                    record(op="cross_entropy", mode=mode, provider=f"llmkernels_inplace[{cfg}]", M=m, V=v, ms=ms,
                           gbps=nbytes[mode] / ms / 1e6)
        del x
        torch.cuda.empty_cache()

    if not args.skip_linear:
        linear(record)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    summary(records, copy)


def summary(records, copy):
    print("\nsummary (GB/s as a fraction of copy; fwd+bwd of llmkernels_inplace is the fused path)")
    timed = [r for r in records if r.get("gbps") and "[" not in r["provider"]]
    for m, v in CE_SHAPES:
        for mode in ("fwd", "fwd+bwd"):
            row = {r["provider"]: r["gbps"] / copy for r in timed if (r["M"], r["V"], r["mode"]) == (m, v, mode)}
            print(f"  {m}x{v} {mode:8s} " + "  ".join(f"{k} {x:.2f}" for k, x in row.items()))
    lin = {r["provider"]: r for r in records if r["op"] == "linear_cross_entropy"}
    if "unfused" in lin:
        base = lin["unfused"]
        for name, r in lin.items():
            print(f"  linear {name:24s} {r['ms']:8.1f} ms ({r['ms'] / base['ms']:.3f} x unfused)  peak "
                  f"{r['peak_mem'] / 2**30:6.2f} GiB ({r['peak_mem'] / base['peak_mem']:.3f} x unfused)")


# --------------------------------------------------------------------------------------------
# linear_cross_entropy
# --------------------------------------------------------------------------------------------
def linear(record):
    m, h, v = LCE_SHAPE
    torch.manual_seed(0)
    hidden = torch.randn(m, h, device="cuda", dtype=DTYPE)
    weight = (torch.randn(v, h, device="cuda") / h ** 0.5).to(DTYPE)
    target = torch.randint(0, v, (m,), device="cuda")
    target[::50] = -100
    provs = {
        "unfused": lambda a, w: F.cross_entropy(a @ w.t(), target),
        "llmkernels": lambda a, w: llmkernels.linear_cross_entropy(a, w, target),
        "llmkernels_accum_bf16": lambda a, w: llmkernels.linear_cross_entropy(a, w, target, accum_dtype=None),
    }
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        provs["liger"] = lambda a, w: LigerFusedLinearCrossEntropyFunction.apply(a, w, target)[0]
    except ImportError as exc:
        print(f"liger: not available ({exc})")
    results = {}
    for name, fn in provs.items():
        a, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step():
            loss = fn(a, w)
            return loss, torch.autograd.grad(loss, (a, w))

        try:
            results[name] = step()  # warm up, and the outputs for the check below
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = float(do_bench(step, warmup=200, rep=1500, return_mode="median"))
        except Exception as exc:
            print(f"linear {name}: failed: {str(exc)[:300]}")
            continue
        record(op="linear_cross_entropy", mode="fwd+bwd", provider=name, M=m, V=v, H=h, ms=ms, gbps=None,
               peak_mem=peak)
        del a, w
        torch.cuda.empty_cache()
    if "unfused" in results:
        ref_loss, (ref_gh, ref_gw) = results["unfused"]
        for name, (loss, (gh, gw)) in results.items():
            if name != "unfused":
                print(f"check linear {name} vs unfused: loss {rel(loss.float(), ref_loss.float()):.1e} "
                      f"dhidden {rel(gh, ref_gh):.1e} dweight {rel(gw, ref_gw):.1e}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
