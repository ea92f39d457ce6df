"""A differential fuzzer over every public op: random shapes (M = 0, width 1, V = 1, odd widths),
dtypes, layouts (transposed, sliced, strided, expanded), options, upstream gradients of random
scale and execution contexts (a default device elsewhere, a ``torch.device`` block, autocast,
no_grad, inference_mode, partial ``requires_grad``, torch.compile), each case against the float64
reference, forward and every gradient, with bitwise determinism, untouched inputs, NaN kept in
its row and bad arguments refused by name (``check.py``).

``python -m llmkernels.fuzz --cases N --seed S`` (or ``llmkernels fuzz``) writes a JSON summary;
a failing case prints the command that reruns it alone. The tests run a seeded subset on CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from typing import Optional, Sequence

import torch

from ..interpreter import kernels_or_rerun, quiet_interpreter
from ..ops._launch import INTERPRET
from .check import Mismatch, run_case
from .specs import BUILDERS

__all__ = ["fuzz", "merge", "main", "Mismatch", "BUILDERS"]


def fuzz(cases: int, seed: int = 0, *, start: int = 0, ops: Optional[Sequence[str]] = None,
         device: Optional[str] = None, budget_s: Optional[float] = None, context: Optional[str] = None,
         progress: bool = False) -> dict:
    """Run cases ``start .. start + cases - 1`` round-robin over ``ops`` (default: all); returns
    the summary: per op the cases, contexts and checks run and the failures (each with its rerun
    command). Disjoint ``start`` ranges split a long run over processes (``merge``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ops = list(ops or BUILDERS)
    per_op = {op: {"cases": 0, "failures": 0, "contexts": {}, "checks": {}} for op in ops}
    failures = []
    began = time.monotonic()
    done = 0
    for index in range(start, start + cases):
        if budget_s is not None and time.monotonic() - began > budget_s:
            break
        op = ops[index % len(ops)]
        stats = per_op[op]
        try:
            ran = run_case(BUILDERS[op], seed, index, device, context=context)
            stats["contexts"][ran["context"]] = stats["contexts"].get(ran["context"], 0) + 1
            for check in ran["checks"]:
                stats["checks"][check] = stats["checks"].get(check, 0) + 1
        except Exception as e:  # noqa: BLE001  (a crash is a finding like a mismatch)
            stats["failures"] += 1
            detail = str(e) if isinstance(e, Mismatch) else "".join(traceback.format_exception_only(e)).strip()
            failures.append({"op": op, "index": index, "error": detail,
                             "rerun": f"python -m llmkernels.fuzz --seed {seed} --ops {op} --case {index}"})
            if progress:
                print(f"  FAIL {op} case {index}: {detail[-300:]}", flush=True)
        stats["cases"] += 1
        done += 1
        if progress and done % 50 == 0:
            print(f"  {done} cases, {len(failures)} failures, {time.monotonic() - began:.0f} s", flush=True)
    return {"date": datetime.date.today().isoformat(), "device": _device_name(device), "seed": seed,
            "start": start, "cases": done, "failures": len(failures), "seconds": round(time.monotonic() - began, 1),
            "torch": torch.__version__, "triton": _triton_version(), "per_op": per_op, "failed": failures}


def merge(summaries: Sequence[dict]) -> dict:
    """One summary of runs over disjoint case ranges of one seed."""
    out = {**summaries[0], "start": min(s["start"] for s in summaries), "parts": len(summaries),
           "seconds": max(s["seconds"] for s in summaries), "failed": [f for s in summaries for f in s["failed"]]}
    for key in ("cases", "failures"):
        out[key] = sum(s[key] for s in summaries)
    out["per_op"] = {}
    for s in summaries:
        for op, stats in s["per_op"].items():
            into = out["per_op"].setdefault(op, {"cases": 0, "failures": 0, "contexts": {}, "checks": {}})
            into["cases"] += stats["cases"]
            into["failures"] += stats["failures"]
            for group in ("contexts", "checks"):
                for name, n in stats[group].items():
                    into[group][name] = into[group].get(name, 0) + n
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)" if INTERPRET else "cpu (plain PyTorch: TRITON_INTERPRET unset)"


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


DESCRIPTION = """\
Check every public op against its float64 reference on random cases: shapes (empty, width 1,
odd widths), dtypes, layouts (transposed, sliced, strided, expanded), options, upstream gradients
of random scale and the caller's execution context; forward and every gradient, bitwise
determinism, inputs left untouched, NaN kept in its row, bad arguments refused by name. A
failing case prints the command that reruns it alone. Without a GPU the kernels run through
Triton's interpreter on the CPU."""

CONTEXT_HELP = {
    "plain": "as called",
    "default_device": "torch.set_default_device set to another device",
    "device_block": "inside a `with torch.device(...)` block of another device",
    "autocast": "torch.autocast to bf16",
    "no_grad": "torch.no_grad",
    "inference_mode": "torch.inference_mode",
    "compile": "torch.compile(fullgraph=True)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkernels fuzz", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000, help="cases to run, round-robin over the ops (default 1000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed: the same seed and case index give the same case (default 0)")
    parser.add_argument("--start", type=int, default=0, help="first case index (split a run over processes)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="merge the summaries of runs over disjoint ranges into --out, and report them")
    parser.add_argument("--ops", default=None, help=f"comma-separated subset of: {', '.join(BUILDERS)}")
    parser.add_argument("--case", type=int, default=None, help="run this one case index alone (a rerun)")
    parser.add_argument("--context", default=None, choices=list(CONTEXT_HELP), metavar="CONTEXT",
                        help="run every case in one execution context (default: drawn per case): " +
                             "; ".join(f"{name}: {what}" for name, what in CONTEXT_HELP.items()))
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="stop after this many seconds")
    parser.add_argument("--out", default=None, metavar="JSON", help="write the JSON summary here")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    ops = args.ops.split(",") if args.ops else None
    unknown = sorted(set(ops or ()) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(BUILDERS)}")
    rerun = kernels_or_rerun("llmkernels.fuzz", argv)
    if rerun is not None:
        return rerun
    quiet_interpreter()
    if args.case is not None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(run_case(BUILDERS[(ops or [None])[0]], args.seed, args.case, device, context=args.context))
        return 0
    if args.merge:
        summaries = []
        for path in args.merge:
            with open(path) as f:
                summaries.append(json.load(f))
        summary = merge(summaries)
    else:
        summary = fuzz(args.cases, args.seed, start=args.start, ops=ops, budget_s=args.budget, context=args.context,
                       progress=True)
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for failure in summary["failed"][:20]:
        print(f"FAIL {failure['op']} case {failure['index']}: {failure['error']}\n  rerun: {failure['rerun']}")
    print(f"{summary['cases']} cases on {summary['device']} in {summary['seconds']} s: "
          f"{summary['failures']} failures")
    return 1 if summary["failures"] else 0
