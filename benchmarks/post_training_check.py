"""The post-training targets on a GPU, every available peer in the same run: time and peak memory
of forward + backward, and a check of each provider against the others.

    python benchmarks/post_training_check.py --out post_training.json [--only log_probs,distill,lce]
    python benchmarks/post_training_check.py --out /tmp/tiny.json --tiny     # CPU, Triton's interpreter

Targets (bf16; ``--tiny`` shrinks the shapes and runs on the CPU, no memory figures):
  log_probs  M=16384, H=4096, V=151936: ``linear_log_probs`` (and with the entropy), by default
             (bf16 logits) and with ``logits_dtype=torch.float32`` (``*_fp32_logits``), against
             the unfused computation as RL code writes it: ``logits = hidden @ weight.T`` then
             ``log_softmax`` in fp32 and ``gather`` (``unfused_fp32``), TRL's
             ``selective_log_softmax`` for bf16 logits (a bf16 ``log_softmax`` per sequence of
             1024 tokens, ``unfused_trl``), and ``torch.compile`` of the first. Upstream: random
             per-token gradients of logp (and entropy). Floors: <= 0.8 x the unfused time,
             <= 1/10 of its peak memory.
  distill    M=8192, H=4096, V=128256, JSD beta=0.5, T=1: ``linear_distill_loss`` (default
             ``memory="low"``, and ``"fast"`` with fp32 and bf16 weight-gradient sums) against Liger's ``LigerFusedLinearJSD`` (same quantity: mean
             over the rows not ignored of beta KL(P||M) + (1-beta) KL(Q||M)) and the unfused
             loss. Floors: <= 0.8 x Liger's time, no more peak memory.
  lce        M=16384, H=4096, V=128256: ``linear_cross_entropy`` (default and ``memory="low"``)
             against the unfused ``F.cross_entropy(hidden @ weight.T)``, Liger's
             ``LigerFusedLinearCrossEntropyLoss`` and Cut Cross-Entropy. Floor: ``memory="low"``
             holds no more memory beyond the gradients than Liger.
Time: ``triton.testing.do_bench`` median (warm-up excluded; the calls are ~100 ms, so host time
does not count; Liger synchronises in its forward, so no CUDA graphs). Peak memory:
``torch.cuda.max_memory_allocated()`` after a reset, minus what was allocated before the call
(the inputs): it includes the gradients returned; ``beyond_grads`` subtracts them. Only public
entry points of llmkernels are used.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

SHAPES = {"log_probs": (16384, 4096, 151936), "distill": (8192, 4096, 128256), "lce": (16384, 4096, 128256)}
TINY_SHAPES = {"log_probs": (64, 32, 1000), "distill": (48, 32, 800), "lce": (64, 32, 1000)}
SEQ = 1024  # tokens per sequence of the TRL baseline's per-sequence loop
IGNORE = -100
GiB = 2 ** 30


def _inputs(torch, m, h, v, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(device, dtype)
    target = torch.randint(0, v, (m,), generator=g).to(device)
    target[::50] = IGNORE
    return hidden, weight, target


def _rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class Runner:
    """Times a provider and measures its peak memory; keeps the outputs for the checks."""

    def __init__(self, torch, device, rep_ms: int):
        self.torch, self.device, self.rep_ms = torch, device, rep_ms
        self.records = []

    def run(self, target: str, name: str, step, shape, grad_bytes: int):
        torch = self.torch
        try:
            outputs = step()  # warm-up (compilation, cuBLAS workspace) and the outputs to check
            peak = None
            if self.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                from triton.testing import do_bench
                ms = float(do_bench(step, warmup=max(100, self.rep_ms // 5), rep=self.rep_ms,
                                    return_mode="median"))
            else:
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                ms = statistics.median(times)
        except Exception as exc:  # a peer that fails (out of memory, an API change) is reported, not fatal
            print(f"{target} {name}: failed: {str(exc)[:300]}", flush=True)
            return None
        m, h, v = shape
        rec = dict(target=target, provider=name, M=m, H=h, V=v, ms=ms, peak_bytes=peak, grad_bytes=grad_bytes,
                   beyond_grads_bytes=None if peak is None else peak - grad_bytes)
        self.records.append(rec)
        print(f"{target:10s} {name:24s} {ms:9.2f} ms" + ("" if peak is None else
              f"   peak {peak / GiB:6.2f} GiB   beyond grads {(peak - grad_bytes) / GiB:6.2f} GiB"), flush=True)
        return outputs


def _check(target, outputs: dict, ref_name: str):
    """Relative error of every provider's outputs against ``ref_name``'s (same structure)."""
    ref = outputs.get(ref_name)
    if ref is None:
        return {}
    errors = {}
    for name, out in outputs.items():
        if name != ref_name and out is not None:
            errors[name] = [_rel(a, b) for a, b in zip(out, ref)]
            print(f"check {target} {name} vs {ref_name}: " + " ".join(f"{e:.1e}" for e in errors[name]), flush=True)
    return errors


def _run_losses(torch, runner, target, providers, hidden, weight, shape) -> dict:
    """Each provider ``fn(hidden, weight) -> loss`` through ``runner`` (forward + the gradients
    of hidden and weight); returns its outputs by name."""
    m, h, v = shape
    outputs = {}
    for name, fn in providers.items():
        a, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step(fn=fn, a=a, w=w):
            loss = fn(a, w)
            return (loss.float(), *torch.autograd.grad(loss, (a, w)))

        outputs[name] = runner.run(target, name, step, shape, (m + v) * h * hidden.element_size())
        del a, w
    return outputs


def bench_log_probs(torch, lk, runner, shape, device, dtype):
    import torch.nn.functional as F

    m, h, v = shape
    hidden, weight, target = _inputs(torch, m, h, v, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    g1 = torch.rand(m, generator=g).to(device)
    g2 = torch.randn(m, generator=g).to(device)
    valid = target != IGNORE
    index = target.clamp(min=0)[:, None]
    seqs = max(1, m // SEQ)

    def unfused_fp32(a, w, entropy=False):
        log_p = (a @ w.t()).float().log_softmax(-1)
        logp = torch.where(valid, log_p.gather(-1, index)[:, 0], 0.0)
        if not entropy:
            return logp
        return logp, torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)

    def unfused_trl(a, w):
        # TRL's selective_log_softmax for bf16 logits: a log_softmax per sequence, in the logits' dtype
        logits = (a @ w.t()).view(seqs, -1, v)
        rows = [F.log_softmax(row, dim=-1).gather(-1, idx) for row, idx in zip(logits, index.view(seqs, -1, 1))]
        return torch.where(valid, torch.stack(rows).view(-1).float(), 0.0)

    torch._dynamo.reset()
    compiled = torch.compile(unfused_fp32, dynamic=False) if device == "cuda" else None
    providers = {
        "llmkernels": (lambda a, w: lk.linear_log_probs(a, w, target), False),
        "llmkernels_fp32_logits": (lambda a, w: lk.linear_log_probs(a, w, target, logits_dtype=torch.float32), False),
        "unfused_fp32": (unfused_fp32, False),
        "unfused_trl": (unfused_trl, False),
        "torch_compile": (compiled, False),
        "llmkernels_entropy": (lambda a, w: lk.linear_log_probs(a, w, target, return_entropy=True), True),
        "llmkernels_entropy_fp32_logits": (lambda a, w: lk.linear_log_probs(a, w, target, return_entropy=True,
                                                                            logits_dtype=torch.float32), True),
        "unfused_fp32_entropy": (lambda a, w: unfused_fp32(a, w, entropy=True), True),
    }
    outputs = {}
    for name, (fn, entropy) in providers.items():
        if fn is None:
            continue
        a, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step(fn=fn, entropy=entropy, a=a, w=w):
            out = fn(a, w)
            loss = (out[0] * g1 + out[1] * g2).sum() if entropy else (out * g1).sum()
            return (*(out if entropy else (out,)), *torch.autograd.grad(loss, (a, w)))

        outputs[name] = runner.run("log_probs", name, step, shape, (m + v) * h * hidden.element_size())
        del a, w
    plain = {k: outputs.get(k) for k in ("llmkernels", "llmkernels_fp32_logits", "unfused_fp32", "unfused_trl",
                                         "torch_compile")}
    with_entropy = {k: outputs.get(k) for k in ("llmkernels_entropy", "llmkernels_entropy_fp32_logits",
                                                "unfused_fp32_entropy")}
    return {**_check("log_probs", plain, "unfused_fp32"), **_check("log_probs", with_entropy, "unfused_fp32_entropy")}


def bench_distill(torch, lk, runner, shape, device, dtype):
    from llmkernels import reference

    m, h, v = shape
    hidden, weight, target = _inputs(torch, m, h, v, device, dtype)
    t_hidden, t_weight, _ = _inputs(torch, m, h, v, device, dtype, seed=2)
    valid = (target != IGNORE).float()

    def unfused(a, w):
        log_q = (a @ w.t()).float().log_softmax(-1)
        log_p = (t_hidden @ t_weight.t()).float().log_softmax(-1)
        rows = reference.distill_divergence(log_q, log_p, kind="jsd", beta=0.5)
        return (rows * valid).sum() / valid.sum()

    providers = {
        "llmkernels": lambda a, w: lk.linear_distill_loss(a, w, t_hidden, t_weight, target, kind="jsd", beta=0.5,
                                                          memory="low"),
        "llmkernels_fast": lambda a, w: lk.linear_distill_loss(a, w, t_hidden, t_weight, target, beta=0.5,
                                                               memory="fast"),
        "llmkernels_fast_accum_bf16": lambda a, w: lk.linear_distill_loss(a, w, t_hidden, t_weight, target, beta=0.5,
                                                                          memory="fast", accum_dtype=None),
        "unfused": unfused,
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
        liger = LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=IGNORE, temperature=1.0)
        providers["liger"] = lambda a, w: liger(a, w, t_hidden, t_weight, target)
    except ImportError as exc:
        print(f"liger: not available ({exc})")
    return _check("distill", _run_losses(torch, runner, "distill", providers, hidden, weight, shape), "unfused")


def bench_lce(torch, lk, runner, shape, device, dtype):
    import torch.nn.functional as F

    m, h, v = shape
    hidden, weight, target = _inputs(torch, m, h, v, device, dtype)
    providers = {
        "unfused": lambda a, w: F.cross_entropy((a @ w.t()).float(), target),
        "llmkernels": lambda a, w: lk.linear_cross_entropy(a, w, target),
        "llmkernels_low": lambda a, w: lk.linear_cross_entropy(a, w, target, memory="low"),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        providers["liger"] = lambda a, w: liger(w, a, target)
    except ImportError as exc:
        print(f"liger: not available ({exc})")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        providers["cce"] = lambda a, w: cce(a, w, target)
    except ImportError as exc:
        print(f"cut_cross_entropy: not available ({exc})")
    return _check("lce", _run_losses(torch, runner, "lce", providers, hidden, weight, shape), "unfused")


def _ratio(records, target, name, base, key):
    get = {r["provider"]: r for r in records if r["target"] == target}
    if name not in get or base not in get or get[base][key] in (None, 0) or get[name][key] is None:
        return None
    return get[name][key] / get[base][key]


def evaluate(records):
    """The issue's floors, each as (measured ratio, floor, met)."""
    floors = [
        ("log_probs time vs unfused_fp32", "log_probs", "llmkernels", "unfused_fp32", "ms", 0.8),
        ("log_probs time vs unfused_trl", "log_probs", "llmkernels", "unfused_trl", "ms", 0.8),
        ("log_probs time vs torch_compile", "log_probs", "llmkernels", "torch_compile", "ms", 0.8),
        ("log_probs peak vs unfused_fp32", "log_probs", "llmkernels", "unfused_fp32", "peak_bytes", 0.1),
        ("log_probs peak vs unfused_trl", "log_probs", "llmkernels", "unfused_trl", "peak_bytes", 0.1),
        ("log_probs+entropy time vs unfused", "log_probs", "llmkernels_entropy", "unfused_fp32_entropy", "ms", 0.8),
        ("log_probs fp32 logits vs default", "log_probs", "llmkernels_fp32_logits", "llmkernels", "ms", None),
        ("log_probs+entropy fp32 vs default", "log_probs", "llmkernels_entropy_fp32_logits",
         "llmkernels_entropy", "ms", None),
        ("distill time vs liger", "distill", "llmkernels", "liger", "ms", 0.8),
        ("distill peak vs liger", "distill", "llmkernels", "liger", "peak_bytes", 1.0),
        ("distill fast time vs liger", "distill", "llmkernels_fast", "liger", "ms", None),
        ("distill fast peak vs liger", "distill", "llmkernels_fast", "liger", "peak_bytes", None),
        ("lce low beyond-grads vs liger", "lce", "llmkernels_low", "liger", "beyond_grads_bytes", 1.0),
        ("lce low peak vs liger", "lce", "llmkernels_low", "liger", "peak_bytes", 1.0),
        ("lce low time vs default", "lce", "llmkernels_low", "llmkernels", "ms", None),
    ]
    out = {}
    print("\nfloors:")
    for label, target, name, base, key, floor in floors:
        ratio = _ratio(records, target, name, base, key)
        if ratio is None:
            continue
        met = None if floor is None else ratio <= floor
        out[label] = dict(ratio=ratio, floor=floor, met=met)
        verdict = "" if floor is None else (f"  (floor {floor}: {'met' if met else 'NOT met'})")
        print(f"  {label:36s} {ratio:7.3f}{verdict}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    parser.add_argument("--only", default="log_probs,distill,lce", help="comma-separated targets")
    parser.add_argument("--rep-ms", type=int, default=2000, help="do_bench's measuring time per provider (ms)")
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    import triton

    import llmkernels as lk

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16  # (the interpreter's bf16 is slow and rounds down)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    runner = Runner(torch, device, args.rep_ms)
    benches = {"log_probs": bench_log_probs, "distill": bench_distill, "lce": bench_lce}
    checks = {}
    for target in args.only.split(","):
        checks[target] = benches[target](torch, lk, runner, shapes[target], device, dtype)
        if device == "cuda":
            torch.cuda.empty_cache()
    floors = evaluate(runner.records)

    def version(name):
        try:
            from importlib.metadata import version as v
            return v(name)
        except Exception:
            return None

    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, triton=triton.__version__, tiny=args.tiny, dtype=str(dtype),
               liger=version("liger-kernel"), cut_cross_entropy=version("cut-cross-entropy"),
               date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as f:
        json.dump(dict(env=env, records=runner.records, checks=checks, floors=floors), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
