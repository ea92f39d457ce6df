"""Host cost of eager calls: µs per call of every public op beside the PyTorch eager op(s) it
replaces (and Liger's, where installed), forward alone and forward + backward, at decode rows
(M = 1) and a training micro-batch (M = 4096).

Each cell times loops of back-to-back calls (the warm-up loop excluded) and reports the median
loop's µs per call two ways: ``us``, between CUDA events around the loop (what an eager user
waits: the larger of the host's and the GPU's time), and ``host_us``, the host's time from the
loop's start until its last call returns, without waiting for the GPU (the Python and launch
path, plus any wait inside a call). bf16; forward without autograd (``torch.no_grad``), forward
+ backward as ``torch.autograd.grad(outputs, inputs, grad_outputs)``.

    python benchmarks/profile_overhead.py [--rows 1 4096] [--out overhead.json] [--profile rms_norm]
    python benchmarks/profile_overhead.py --tiny     # CPU, Triton's interpreter, tiny shapes (a test runs it)
    python benchmarks/profile_overhead.py --stub     # CPU, kernel launches stubbed out (see below)

No cell starts after ``--budget`` seconds (default 45: benchmarks/gpu_check.sh allows 60); the
JSON, written after every cell, holds what ran. A first run on a fresh machine also compiles
every kernel (each cell's warm-up call): if it stops short, run it again from Triton's cache.

``--stub`` measures the host path alone on a machine without a GPU: CPU tensors, every Triton
kernel replaced by a compiled kernel whose launch returns at once, the launch path otherwise the
one a GPU takes (cached handles, direct launches). It times the ops' Python; the torch column
then computes on the CPU and is context, not a target. Linear cross-entropy's matmuls are real
there, so it runs at a small hidden size and vocabulary.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import statistics
import sys
import time

# The interpreter must be chosen before triton is imported.
if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import llmkernels as lk  # noqa: E402
from llmkernels import reference  # noqa: E402
from llmkernels.bench.registry import Unavailable, liger_function  # noqa: E402

# (N, I, heads q/k and head dim, V, LM-head hidden size and vocabulary, MoE experts: E, top-k, H, I
# and LoRA rank) of the full run and of --tiny. The full MoE is moe_lora_bench.py's layer; the stub's
# has its routing at that size and small weights (their size does not change the host path).
FULL = dict(n=4096, i=14336, hq=32, hk=8, d=128, v=32000, lce_h=4096, lce_v=32000, moe=(64, 8, 1024, 512, 16))
TINY = dict(n=64, i=96, hq=4, hk=2, d=16, v=100, lce_h=32, lce_v=100, moe=(4, 2, 32, 16, 4))
STUB = dict(FULL, lce_h=64, lce_v=256, moe=(64, 8, 64, 32, 16))
LOOP_SECONDS = 0.02  # each timed loop is about this long (at least 3 calls, 1 with --tiny; at most 200)
LOOPS = 5


# --------------------------------------------------------------------------------------------
# the cases: inputs, the inputs that take gradients, and the providers of each op
# --------------------------------------------------------------------------------------------
def _liger(module: str, name: str, call):
    """``call(apply)`` with ``apply = liger_kernel.ops.<module>.<name>.apply``, or None where
    liger-kernel (or that function) is missing."""
    try:
        return call(liger_function(module, name))
    except Unavailable:
        return None


def _liger_rope():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def _liger_lce(target):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda h, weight: loss(weight, h, target)


def _hf_rms(x, w):
    """Hugging Face's ``LlamaRMSNorm.forward``, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def _moe_lora_inputs(m: int, dims: dict, randn, device: str) -> dict:
    """One MoE layer's experts with LoRA (r on gate/up and down, fp32 adapters as PEFT keeps
    them, the experts frozen): x, the routing and the weights."""
    e, k, h, i, r = dims["moe"]
    weights, index = torch.rand(m, e, device=device).softmax(-1).topk(k, -1)
    return dict(x=randn(m, h), index=index, routing=weights.to(torch.bfloat16),
                gate_up=randn(e, 2 * i, h, scale=h ** -0.5), down=randn(e, h, i, scale=i ** -0.5),
                gate_up_a=torch.randn(e, r, h, device=device) * h ** -0.5,
                gate_up_b=torch.randn(e, 2 * i, r, device=device),
                down_a=torch.randn(e, r, i, device=device) * i ** -0.5, down_b=torch.randn(e, h, r, device=device))


def _moe_lora(x, index, routing, gate_up, down, gate_up_a, gate_up_b, down_a, down_b):
    return lk.moe_experts(x, index, routing, gate_up, down, lora=lk.ExpertLora((gate_up_a, gate_up_b),
                                                                               (down_a, down_b), 2.0))


def _torch_moe_lora(x, index, routing, gate_up, down, gate_up_a, gate_up_b, down_a, down_b):
    """The per-expert loop of PyTorch ops (llmkernels' float reference, in fp32)."""
    from llmkernels import reference_moe
    return reference_moe.experts(x, index, routing, gate_up, down, lora=reference_moe.Lora(
        (gate_up_a, gate_up_b), (down_a, down_b), 2.0))


def cases(m: int, dims: dict, device: str, gpu: bool) -> dict:
    """name -> (inputs, names of the inputs that take gradients, {provider: fn(**inputs)}); the
    ``torch`` provider is what the op replaces in a model (Liger's only on a GPU)."""
    dt = torch.bfloat16
    n, i, hq, hk, d, v, lh, lv = (dims[k] for k in ("n", "i", "hq", "hk", "d", "v", "lce_h", "lce_v"))

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, device=device) * scale + shift).to(dt)

    x, r = randn(m, n), randn(m, n)
    w, b = randn(n, scale=0.5, shift=1.0), randn(n, scale=0.5)
    angles = torch.rand(1, m, d, device=device) * 6.3
    rope_in = dict(q=randn(1, hq, m, d), k=randn(1, hk, m, d), cos=angles.cos().to(dt), sin=angles.sin().to(dt))
    target = torch.randint(0, v, (m,), device=device)
    lce_target = torch.randint(0, lv, (m,), device=device)
    liger = gpu and importlib.util.find_spec("liger_kernel") is not None
    table = {
        "rms_norm": (dict(x=x, w=w), ("x", "w"), dict(
            llmkernels=lambda x, w: lk.rms_norm(x, w, eps=1e-6),
            torch=lambda x, w: F.rms_norm(x, (n,), w, 1e-6),
            hf_eager=_hf_rms,
            liger=liger and _liger("rms_norm", "LigerRMSNormFunction",
                                   lambda f: lambda x, w: f(x, w, 1e-6, 0.0, "llama", False)))),
        "layer_norm": (dict(x=x, w=w, b=b), ("x", "w", "b"), dict(
            llmkernels=lambda x, w, b: lk.layer_norm(x, w, b),
            torch=lambda x, w, b: F.layer_norm(x, (n,), w, b),
            liger=liger and _liger("layer_norm", "LigerLayerNormFunction", lambda f: lambda x, w, b: f(x, w, b, 1e-5)))),
        "add_rms_norm": (dict(x=x, r=r, w=w), ("x", "r", "w"), dict(
            llmkernels=lambda x, r, w: lk.rms_norm(x, w, residual=r, prenorm=True, eps=1e-6),
            torch=lambda x, r, w: (F.rms_norm(x + r, (n,), w, 1e-6), x + r),
            liger=liger and _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction",
                                   lambda f: lambda x, r, w: f(x, r, w, 1e-6, 0.0, "llama", False)))),
        "rope": (rope_in, ("q", "k"), dict(
            llmkernels=lambda q, k, cos, sin: lk.apply_rope(q, k, cos, sin),
            torch=reference.hf_apply_rotary_pos_emb,  # Hugging Face's Llama formula
            liger=liger and _liger_rope())),
        "glu": (dict(gate=randn(m, i), up=randn(m, i)), ("gate", "up"), dict(
            llmkernels=lambda gate, up: lk.glu(gate, up),
            torch=lambda gate, up: F.silu(gate) * up,
            liger=liger and _liger("swiglu", "LigerSiLUMulFunction", lambda f: lambda gate, up: f(gate, up)))),
        "cross_entropy": (dict(logits=randn(m, v, scale=2.0)), ("logits",), dict(
            llmkernels=lambda logits: lk.cross_entropy(logits, target),
            llmkernels_unchecked=lambda logits: lk.cross_entropy(logits, target, check_targets=False),
            torch=lambda logits: F.cross_entropy(logits, target),
            liger=liger and _liger("cross_entropy", "LigerCrossEntropyFunction", lambda f: lambda logits: f(
                logits, target, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]))),
        "linear_cross_entropy": (dict(h=randn(m, lh), weight=randn(lv, lh, scale=lh ** -0.5)), ("h", "weight"), dict(
            llmkernels=lambda h, weight: lk.linear_cross_entropy(h, weight, lce_target),
            torch=lambda h, weight: F.cross_entropy(F.linear(h, weight), lce_target),
            liger=liger and _liger_lce(lce_target))),
        "moe_experts_lora": (_moe_lora_inputs(m, dims, randn, device),
                             ("x", "routing", "gate_up_a", "gate_up_b", "down_a", "down_b"),
                             dict(llmkernels=_moe_lora, torch=_torch_moe_lora)),
    }
    return {name: (inputs, grads, {p: f for p, f in providers.items() if f})
            for name, (inputs, grads, providers) in table.items()}


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def timed_call(fn, inputs: dict, grads: tuple, mode: str):
    """The callable a loop repeats: the forward (``per_call_us`` runs it without autograd), or
    forward + backward."""
    if mode == "fwd":
        return lambda: fn(**inputs)
    leaves = {k: t.detach().clone().requires_grad_(k in grads) for k, t in inputs.items()}
    params = [leaves[k] for k in grads]
    outs = _as_tuple(fn(**leaves))
    grad_outputs = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]

    def step():
        torch.autograd.grad(_as_tuple(fn(**leaves)), params, grad_outputs)
    return step


def _sync(gpu: bool):
    if gpu:
        torch.cuda.synchronize()


def per_call_us(step, gpu: bool, grad: bool, loops: int = LOOPS, min_calls: int = 3) -> dict:
    """µs per call of ``step`` (with autograd when ``grad``) over ``loops`` loops of back-to-back
    calls after a warm-up loop: the median loop's ``us`` (CUDA events; the host clock on CPU)
    and ``host_us`` (the host's time until the loop's last call returned), and the fastest
    loop's ``host_us_min``."""
    with torch.set_grad_enabled(grad):
        step()  # compilation, caches, the allocator
        _sync(gpu)
        t = time.perf_counter()
        step()
        _sync(gpu)
        calls = int(min(200, max(min_calls, LOOP_SECONDS / max(time.perf_counter() - t, 1e-7))))
        us, host = [], []
        for i in range(loops + 1):
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            for _ in range(calls):
                step()
            host_s = time.perf_counter() - t
            if gpu:
                end.record()
                end.synchronize()
            if i:  # the first loop warms up
                host.append(host_s / calls * 1e6)
                us.append(start.elapsed_time(end) / calls * 1e3 if gpu else host[-1])
    return {"us": statistics.median(us), "host_us": statistics.median(host), "host_us_min": min(host),
            "calls": calls, "loops": loops}


# --------------------------------------------------------------------------------------------
# --stub: the launch path of a GPU, with every kernel launch a no-op, on CPU tensors
# --------------------------------------------------------------------------------------------
class _StubCompiled:
    """A compiled kernel whose launcher returns at once (the check kernel's flag reads "no bad
    target", as a real launch would write it)."""

    function, packed_metadata = "function", "packed"

    def __init__(self, name: str):
        self.run = _zero_flag if name == "_check_targets_kernel" else _no_launch


def _no_launch(*args):
    pass


def _zero_flag(*args):
    args[10].zero_()  # ERR, after the grid, stream, function, metadata and hook arguments


def install_stub() -> None:
    """Make every op take its GPU launch path on CPU tensors, with stubbed launches."""
    from triton.runtime.jit import JITFunction

    from llmkernels.ops import _launch

    def run(self, *args, grid, warmup, **options):
        compiled = _StubCompiled(self.__name__)
        compiled.run(*[None] * 9, *args)  # (the first call launches too)
        return compiled

    JITFunction.run = run
    _launch._current_device = lambda: 0
    _launch._current_stream = lambda device: 0
    _launch.direct = True
    kernels_here = lambda t: True  # noqa: E731
    for name, module in list(sys.modules.items()):
        if name.startswith("llmkernels.ops") and hasattr(module, "use_kernels"):
            module.use_kernels = kernels_here


# --------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="M values (default 1 4096; --tiny 1 16)")
    parser.add_argument("--ops", nargs="+", default=None, help="ops to time (default all)")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--providers", nargs="+", default=None, help="providers to time (default all)")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--stub", action="store_true", help="CPU, kernel launches stubbed out (the host path)")
    parser.add_argument("--loops", type=int, default=LOOPS)
    parser.add_argument("--budget", type=float, default=45.0,
                        help="seconds: no cell starts after this (the JSON holds what ran)")
    parser.add_argument("--out", default=None, help="write the records as JSON here (after every cell)")
    parser.add_argument("--profile", default=None, help="cProfile this op's forward + backward at the first M")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not (args.tiny or args.stub)
    if not gpu and not (args.tiny or args.stub):
        parser.error("no GPU: pass --tiny (interpreter) or --stub (stubbed launches)")
    if args.stub:
        install_stub()
    dims = TINY if args.tiny else STUB if args.stub else FULL
    rows = args.rows or ([1, 16] if args.tiny else [1, 4096])
    device = "cuda" if gpu else "cpu"
    where = torch.cuda.get_device_name() if gpu else ("cpu, Triton interpreter" if args.tiny else "cpu, stubbed launches")
    meta = dict(device=where, torch=torch.__version__, triton=_triton_version(), dims=dims, loops=args.loops,
                date=time.strftime("%Y-%m-%d"), complete=False)
    print(f"{where}; torch {torch.__version__}; µs per call (median of {args.loops} loops); "
          "x torch: host_us over torch's")
    print(f"{'op':21s} {'M':>5s} {'mode':8s} {'provider':21s} {'us':>9s} {'host_us':>9s} {'x torch':>8s}")
    records, began = [], time.perf_counter()
    torch.manual_seed(0)
    for m in rows:
        table = cases(m, dims, device, gpu)
        for name in args.ops or table:
            inputs, grads, providers = table[name]
            for mode in args.modes:
                if time.perf_counter() - began > args.budget:
                    print(f"budget of {args.budget:.0f} s spent: {name} M={m} {mode} and later cells not run")
                    return _finish(args, meta, records)
                cell = {}
                for provider, fn in providers.items():
                    if (args.providers and provider not in args.providers) or (
                            args.stub and m > 64 and not provider.startswith("llmkernels")):
                        continue  # (--stub: torch's CPU ops at training sizes compute for seconds)
                    cell[provider] = per_call_us(timed_call(fn, inputs, grads, mode), gpu, mode != "fwd", args.loops,
                                                 min_calls=1 if args.tiny else 3)
                for provider, t in cell.items():
                    ratio = t["host_us"] / cell["torch"]["host_us"] if "torch" in cell else None
                    records.append(dict(op=name, M=m, mode=mode, provider=provider, **t, host_vs_torch=ratio))
                    print(f"{name:21s} {m:5d} {mode:8s} {provider:21s} {t['us']:9.1f} {t['host_us']:9.1f} "
                          f"{'' if ratio is None else f'{ratio:7.2f}x':>8s}", flush=True)
                _write(args.out, meta, records)
    meta["complete"] = True
    _finish(args, meta, records)
    if args.profile:
        inputs, grads, providers = cases(rows[0], dims, device, gpu)[args.profile]
        step = timed_call(providers["llmkernels"], inputs, grads, "fwd+bwd")
        step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return records


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def _write(path, meta: dict, records: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


def _finish(args, meta: dict, records: list) -> list:
    """Write the JSON and print the cells where llmkernels' host time is above torch's."""
    _write(args.out, meta, records)
    over = [r for r in records if r["provider"] == "llmkernels" and (r["host_vs_torch"] or 0) > 1.0]
    print(f"llmkernels above torch's host time in {len(over)} of "
          f"{sum(r['provider'] == 'llmkernels' and r['host_vs_torch'] is not None for r in records)} cells"
          + "".join(f"\n  {r['op']} M={r['M']} {r['mode']}: {r['host_vs_torch']:.2f}x" for r in over))
    return records


if __name__ == "__main__":
    main()
