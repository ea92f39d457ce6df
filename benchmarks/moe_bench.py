"""One MoE layer's routed experts, forward + backward, every provider in one process on one GPU:
llmkernels' ``moe_experts`` beside transformers' eager loop and grouped-mm backend, ``grouped_mm``
with PyTorch's permutation, Liger 0.8.5's fused MoE and SonicMoE (where they import). bf16,
routing given. For each provider: the error of its output and gradients against a float32
reference, the median time of forward and of forward + backward (``triton.testing.do_bench``),
TFLOP/s of the routed FLOPs and the peak memory a forward + backward adds; the dense bf16 GEMM of
the card measured in the same run as the ceiling.

    python benchmarks/moe_bench.py                 # GPU: Qwen3-30B-A3B at 8K and 32K tokens, Mixtral at 8K
    python benchmarks/moe_bench.py --tiny          # CPU (Triton's interpreter): tiny shapes, a dry run

Writes ``moe_bench.json`` and ``moe_bench.md`` under ``--out`` (default ``$OUT``, else
``./moe-bench``) after every provider, so a run killed from outside keeps what it measured. A
provider that fails records its error and the run goes on. ``--budget`` counts from the process's
start (imports, references, compilation included); past it no case and no provider starts, so
leave the slowest provider's time (about a minute) between it and any outside limit.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from datetime import date

START = time.time()  # the budget counts from here, imports included, as an outside timeout would

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import llmkernels  # noqa: E402
from llmkernels import reference_moe  # noqa: E402
from llmkernels.bench import ops_moe  # noqa: E402
from llmkernels.bench.registry import Unavailable  # noqa: E402
from llmkernels.bench.report import write_texts  # noqa: E402

CASES = {"qwen3-8k": {"M": 8192, **ops_moe.QWEN3}, "qwen3-32k": {"M": 32768, **ops_moe.QWEN3},
         "mixtral-8k": {"M": 8192, **ops_moe.MIXTRAL}}
TINY = {"tiny-qwen": {"M": 32, "E": 4, "K": 2, "H": 32, "I": 16}, "tiny-mixtral": {"M": 16, "E": 2, "K": 2, "H": 48,
                                                                                  "I": 32}}
# The eager loop over 128 experts takes about 0.3 s a call on an H100: a few calls are its timing.
SLOW = {"hf_eager"}


def versions() -> dict:
    import importlib.metadata

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in ("torch", "triton", "transformers", "liger-kernel", "sonic-moe",
                                             "quack-kernels", "nvidia-cutlass-dsl")} | {
        "llmkernels": llmkernels.__version__, "python": platform.python_version()}


def meta(device: torch.device) -> dict:
    """The run's card, date, versions and command line."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
            "date": date.today().isoformat(), "versions": versions(), "command": " ".join(sys.argv)}


def timer(device: torch.device):
    """``ms(fn, slow)``: the median time of ``fn`` (do_bench on a GPU, a loop on the CPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        # rep in ms: a call of 0.3 s gets about three timed calls, not a single one
        return lambda fn, slow: do_bench(fn, warmup=1 if slow else 25, rep=1000 if slow else 200, return_mode="median")

    def loop(fn, slow):
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e3
    return loop


def gemm_ceiling(device: torch.device, shape: dict, ms) -> dict:
    """TFLOP/s of bf16 ``torch.mm``: 8192^3, and the layer's gate/up GEMM as one dense GEMM
    (``[T k, H] @ [H, 2I]``: what a grouped GEMM of equal groups could reach)."""
    def tflops(m, k, n):
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        return 2 * m * k * n / ms(lambda: torch.mm(a, b), False) / 1e9
    square = 8192 if device.type == "cuda" else 64
    return {"square": tflops(square, square, square),
            "layer": tflops(shape["M"] * shape["K"], shape["H"], 2 * shape["I"])}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


SPENT = "skipped: the run's time budget is spent"


def case_inputs(shape: dict, device: torch.device) -> tuple[dict, dict, torch.Tensor]:
    """``(inputs, leaves, d_out)`` of a case, the same in every script: ``ops_moe.make_inputs`` in
    bf16 from seed 0, those of them that take gradients (now requiring them), the upstream gradient."""
    torch.manual_seed(0)
    inputs = ops_moe.make_inputs(shape, torch.bfloat16, device)
    d_out = torch.randn(shape["M"], shape["H"], device=device, dtype=torch.bfloat16)
    return inputs, {k: v.requires_grad_() for k, v in inputs.items() if k in ops_moe.GRAD_INPUTS}, d_out


def run_case(name: str, shape: dict, providers: list, device: torch.device, ms, deadline: float, save) -> dict:
    """One shape, every provider; ``save()`` after the calibration and after every provider."""
    if time.time() > deadline:  # a skipped case pays for neither the float32 reference nor the calibration
        return {"shape": shape, "providers": {p: {"status": SPENT} for p in providers}}
    inputs, leaves, d_out = case_inputs(shape, device)
    refs = {k: v.detach().float().requires_grad_() if k in leaves else v for k, v in inputs.items()}
    ref = reference_moe.experts(**refs, model_dtype=torch.bfloat16, compute_dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref, [refs[k] for k in leaves], d_out.float())
    expected = {"out": ref.detach(), **{f"d{k}": g for k, g in zip(leaves, ref_grads)}}
    del refs, ref, ref_grads
    case = {"shape": shape, "routed_tflop_fwd_bwd": ops_moe.routed_flops(shape, "fwd+bwd") / 1e12,
            "gemm_ceiling_tflops": gemm_ceiling(device, shape, ms), "providers": {}}
    save(name, case)
    for provider in providers:
        record = case["providers"][provider] = {}
        if time.time() > deadline:
            record["status"] = SPENT
            continue
        start = time.time()
        spec = ops_moe.PROVIDERS[provider]
        if spec.gpu_only and device.type != "cuda":
            record["status"] = "skipped: needs a GPU"
            continue
        try:
            fn = spec.factory()
        except Unavailable as e:
            record["status"] = f"unavailable: {e}"
            continue
        try:
            record.update(measure(fn, inputs, leaves, d_out, expected, shape, device, ms, provider in SLOW))
            record["status"] = "ok"
        except Exception as e:  # noqa: BLE001  (a peer that fails is a result: recorded, the run goes on)
            record["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
            record["traceback"] = traceback.format_exc()[-2000:]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        record["wall_s"] = time.time() - start  # compilation and checks included: what the budget pays
        print(f"{name:12s} {provider:18s} {summary(record)}", flush=True)
        save(name, case)
    return case


def measure(fn, inputs, leaves, d_out, expected, shape, device, ms, slow) -> dict:
    """``fn``'s errors against ``expected``, then its ``timings``."""
    forward_backward = forward_backward_of(fn, inputs, leaves, d_out)
    return {"errors": errors_of(forward_backward, leaves, expected),
            **timings(fn, forward_backward, inputs, shape, device, ms, slow)}


def forward_backward_of(fn, inputs, leaves, d_out):
    """``fn``'s output and the gradients of ``leaves`` from ``d_out``, as one call."""
    def forward_backward():
        out = fn(**inputs)
        return out, torch.autograd.grad(out, list(leaves.values()), d_out)
    return forward_backward


def errors_of(forward_backward, leaves, expected) -> dict:
    """The relative error of the output and of each gradient against ``expected``."""
    out, grads = forward_backward()
    return {"out": rel_err(out, expected["out"]),
            **{f"d{k}": rel_err(g, expected[f"d{k}"]) for k, g in zip(leaves, grads)}}


def timings(fn, forward_backward, inputs, shape, device, ms, slow) -> dict:
    """The peak memory a forward + backward adds (GPU), the times of the forward and of the
    forward + backward, and the TFLOP/s of the latter."""
    record = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        record["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    with torch.no_grad():
        record["fwd_ms"] = ms(lambda: fn(**inputs), slow)
    record["fwd_bwd_ms"] = ms(forward_backward, slow)
    record["tflops_fwd_bwd"] = ops_moe.routed_flops(shape, "fwd+bwd") / record["fwd_bwd_ms"] / 1e9
    return record


def summary(record: dict) -> str:
    if record.get("status") != "ok":
        return record.get("status", "")
    peak = f", peak {record['peak_gib']:.2f} GiB" if "peak_gib" in record else ""
    return (f"fwd {record['fwd_ms']:.2f} ms, fwd+bwd {record['fwd_bwd_ms']:.2f} ms "
            f"({record['tflops_fwd_bwd']:.0f} TFLOP/s{peak}), max rel err {max(record['errors'].values()):.1e}")


def markdown(result: dict) -> str:
    lines = [f"# MoE experts, forward + backward ({result['meta']['device']}, {result['meta']['date']})", "",
             f"bf16, routing given; TFLOP/s of the routed FLOPs; versions: {result['meta']['versions']}", ""]
    for name, case in result["cases"].items():
        s, ceiling = case["shape"], case.get("gemm_ceiling_tflops")
        calibration = "Not measured: the budget was spent." if not ceiling else (
            f"Dense bf16 GEMM in this run: {ceiling['square']:.0f} TFLOP/s (8192^3), {ceiling['layer']:.0f} "
            "TFLOP/s (the gate/up GEMM as one dense GEMM).")
        lines += [f"## {name}: T {s['M']} tokens, E {s['E']}, top-{s['K']}, H {s['H']}, I {s['I']}", "",
                  calibration, "",
                  "| provider | fwd ms | fwd+bwd ms | TFLOP/s | peak GiB | max rel err | s | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for provider, r in case["providers"].items():
            ok = r.get("status") == "ok"
            cells = [f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}", f"{r['tflops_fwd_bwd']:.0f}",
                     f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-",
                     f"{max(r['errors'].values()):.1e}"] if ok else ["-"] * 5
            cells.append(f"{r['wall_s']:.0f}" if "wall_s" in r else "-")
            lines.append(f"| {provider} | " + " | ".join(cells) + f" | {r.get('status', '')} |")
        lines.append("")
    return "\n".join(lines)


def common_parser(doc: str, out: str, budget: float, past_budget: str) -> argparse.ArgumentParser:
    """The options of the MoE scripts: --tiny, --cases, --out (``$OUT``, else ``out``), --budget."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--out", default=os.environ.get("OUT") or out)
    parser.add_argument("--budget", type=float, default=budget, help=f"seconds from the process's start; {past_budget}")
    return parser


def main(argv=None) -> int:
    parser = common_parser(__doc__, "moe-bench", 540.0, "no case or provider starts past it")
    parser.add_argument("--providers", default=None, help=f"comma-separated subset of {list(ops_moe.PROVIDERS)}")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    table = TINY if device.type == "cpu" else CASES
    cases = args.cases.split(",") if args.cases else list(table)
    providers = args.providers.split(",") if args.providers else list(ops_moe.PROVIDERS)
    deadline = START + args.budget
    ms = timer(device)
    result = {"meta": meta(device), "cases": {}}
    os.makedirs(args.out, exist_ok=True)

    def save(name: str, case: dict):
        result["cases"][name] = case
        write_texts(args.out, {"moe_bench.json": json.dumps(result, indent=2), "moe_bench.md": markdown(result)})

    for name in cases:
        save(name, run_case(name, table[name], providers, device, ms, deadline, save))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
