"""The benchmark CLI: ``llmkernels bench`` (also ``python -m llmkernels.bench``).

For every op, shape, dtype and mode (fwd, bwd, fwd+bwd) it checks each provider's outputs and
gradients against the op's float64 reference, then times it: GB/s from the op's minimum bytes,
% of the device-to-device copy bandwidth measured first in the same process, and the speedup of
llmkernels over the best peer. Decode shapes (M <= 256) are reported as latency in µs, and a
training micro-batch (M = 4096) as µs per plain call (eager).
Each run writes a new folder (default ``./llmkernels-bench/<device>-<date>-<time>/``, or
``--out``; never one that already holds results) with ``results.json``, ``results.md`` and one
PNG per op x mode x dtype, and ends with one summary line. Without a GPU it says so and runs
only the check, at small sizes, through Triton's interpreter; its PNG (one per dtype) shows each
provider's error beside the tolerance.

Layout:
  registry.py   ``BenchOp`` and ``Provider`` (what an op declares), ``register``, ``ops()``
  ops_*.py      one module per op family, registering its ops (``ops_norm.py``: rmsnorm,
                layernorm, add_rmsnorm; ``ops_linear_losses.py``: the losses with the LM head)
  runner.py     copy ceiling, float64 check, timing, one record per (case, provider, mode)
  report.py     speedups, console/Markdown tables, JSON, plots

Adding an op (or a family) is one new file, ``llmkernels/bench/ops_<family>.py``; ``ops()``
imports every ``ops_*`` module, so no other file changes. In it, for each op, call
``register(BenchOp(...))`` with (see ``registry.BenchOp`` for each field, ``ops_norm.py`` for a full example):
  - ``name``, the swept dimension ``axis`` with default ``sizes`` / ``quick_sizes``, and
    ``shape(size, rows) -> {"M": ..., "N": ...}``; ``decode_shapes``; ``small_shapes`` (no GPU);
  - ``make_inputs(shape, dtype, device) -> {name: tensor}`` (random), ``grad_inputs`` (the inputs
    that get gradients) and ``outputs`` (names, in the order providers return them);
  - ``reference(**inputs)``: the definition, run on float64 copies of the inputs;
  - ``min_bytes(shape, dtype, mode)``: bytes each tensor read or written once;
  - ``providers``: ``{"llmkernels": Provider(factory), "torch": ..., ...}`` where ``factory()``
    returns ``fwd(**inputs)`` or raises ``Unavailable("<package> is not installed")``. The
    backward is run for every provider by ``torch.autograd.grad`` over ``grad_inputs``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import time

from . import report
from .registry import MODES, BenchOp, Provider, Unavailable, ops, register

__all__ = ["main", "BenchOp", "Provider", "Unavailable", "ops", "register"]

NO_GPU = ("No CUDA GPU found: nothing will be timed. Checking every provider's outputs and gradients "
          "against the float64 reference at small sizes instead, through Triton's interpreter "
          "(TRITON_INTERPRET=1, CPU tensors).")

METHOD = (
    "Method: inputs are random, each provider's outputs (fwd) or outputs and all gradients (bwd, fwd+bwd) "
    "are checked against the op's float64 reference before timing (rel err = ||out - ref|| / ||ref||, worst "
    "over outputs and gradients; over the dtype's tolerance: FAILED, not timed). GB/s = minimum bytes "
    "(each input read once, each output written once) / median time of `triton.testing.do_bench` (L2 "
    "flushed before each call) replaying a CUDA graph of one call: the GPU's time, not the host's (a "
    "provider that breaks capture is timed as plain calls, noted in its record). bwd times the backward "
    "alone (`torch.autograd.grad` of a retained graph, every gradient); fwd+bwd the forward and the backward. % of copy: of the device-to-device copy "
    "bandwidth measured in the same process (256 MiB, bytes read + written). Decode, two ways: µs per plain "
    "call in a loop of back-to-back calls (CUDA events, median of 10 loops of 100 calls), so Python, "
    "autograd and launch overhead count as an eager user sees them (they depend on the host CPU); and µs "
    "per call of 20 calls captured in one CUDA graph (median of 10 replays): the GPU time alone, as a "
    "graph-captured decode step pays it. Eager: a training micro-batch (M = 4096) timed as plain calls, fwd and "
    "fwd+bwd (median of 5 loops of 20 calls): host and GPU as an eager training step pays them. "
    "llmkernels vs best peer: the fastest other provider's time over llmkernels' time.")


def _parser(registry: dict) -> argparse.ArgumentParser:
    providers = list(dict.fromkeys(p for op in registry.values() for p in op.providers))
    p = argparse.ArgumentParser(
        prog="llmkernels bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check every op against its float64 reference, then time it beside every installed peer: "
                    "GB/s and % of the GPU's copy bandwidth (fwd, bwd, fwd+bwd) and decode latency.\n"
                    "Each run writes results.json, results.md and PNG plots to a new folder and ends with one "
                    "summary line.\nWithout a GPU: the check only, at small sizes, through Triton's interpreter.",
        epilog="examples:\n  llmkernels bench --quick\n  llmkernels bench --op rmsnorm --n 4096 8192 --mode fwd bwd\n"
               "  llmkernels bench --op cross_entropy --dtype bf16 fp32 --out ce-run")
    p.add_argument("--op", nargs="+", choices=list(registry), default=list(registry), metavar="OP",
                   help=f"ops to run (default: all): {', '.join(registry)}")
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp16", "fp32"], default=["bf16"],
                   help="dtypes of the inputs: bf16, fp16, fp32 (default: bf16); each is checked at its own tolerance")
    p.add_argument("--n", nargs="+", type=int, metavar="N",
                   help="sizes of the swept dimension (norms: the row length N; RoPE: the sequence length; "
                        "GLU: the intermediate size; cross-entropy: the vocabulary V); default: each op's sweep")
    p.add_argument("--m", type=int, metavar="M",
                   help="rows (default: 256 MiB per bf16 tensor; cross_entropy: 2^30 logits)")
    p.add_argument("--mode", nargs="+", choices=list(MODES), default=list(MODES),
                   help="what is checked and timed: fwd (the forward; for norms the inference forward, no "
                        "statistics saved), bwd (the backward alone: every gradient from a retained graph), "
                        "fwd+bwd (both, as a training step runs them); default: all three")
    p.add_argument("--providers", nargs="+", choices=providers, metavar="P",
                   help=f"providers (default: every one that imports): {', '.join(providers)}")
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="also time decode sizes (M in 1..256, N=4096) as µs per call: plain calls and in a CUDA "
                        "graph (default: on)")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a training micro-batch (M=4096) as µs per plain call, fwd and fwd+bwd "
                        "(default: on)")
    p.add_argument("--quick", action="store_true", help="fewer sizes (3 N, 3 decode M)")
    p.add_argument("--out", metavar="DIR",
                   help="output folder, which must not hold an earlier run "
                        "(default: ./llmkernels-bench/<device>-<date>-<time>)")
    return p


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class _SimpleBar:
    """A text progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total: int):
        self.total, self.done = max(total, 1), 0

    def _draw(self):
        filled = 30 * self.done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
        sys.stderr.flush()

    def update(self, n: int):
        self.done += n
        self._draw()

    def write(self, line: str):
        sys.stderr.write("\r" + " " * 50 + "\r")
        print(line, flush=True)
        self._draw()

    def close(self):
        sys.stderr.write("\n")


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total)
    return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _new_out_dir(device_name: str) -> str:
    """A new folder for this run under ./llmkernels-bench, named by device, date and time."""
    base = os.path.join("llmkernels-bench", f"{_slug(device_name)}-{time.strftime('%Y-%m-%d-%H%M%S')}")
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    registry = ops()
    parser = _parser(registry)
    args = parser.parse_args(argv)
    if args.out and os.path.exists(os.path.join(args.out, report.RESULTS_JSON)):
        parser.error(f"--out {args.out} already holds a run ({report.RESULTS_JSON}); give a new folder")

    from ..interpreter import kernels_or_rerun, quiet_interpreter

    rerun = kernels_or_rerun("llmkernels.bench", argv)
    if rerun is not None:
        return rerun

    import torch

    from .runner import Runner, Settings

    gpu = torch.cuda.is_available()
    if not gpu:
        print(NO_GPU)
        quiet_interpreter()

    settings = Settings(ops=args.op, dtypes=args.dtype, sizes=args.n, rows=args.m, modes=tuple(args.mode),
                        providers=args.providers, decode=args.decode, eager=args.eager, quick=args.quick)
    device = torch.device("cuda" if gpu else "cpu")
    runner = Runner(settings, device, log=print)
    out = args.out or _new_out_dir(runner.env["device"] if gpu else "cpu-interpreter")
    os.makedirs(out, exist_ok=True)  # taken now: a run started meanwhile picks another name
    bar = _bar(runner.total())
    runner.log, runner.progress = bar.write, bar.update
    # Ctrl-C or a SIGTERM (a `timeout`) stops the sweep; what was measured is still written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    complete = False
    try:
        runner.run()
        complete = True
    except KeyboardInterrupt:
        print("\ninterrupted: writing the cases measured so far")
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous)

    meta = dict(runner.env, copy_gbps=runner.copy_gbps, command="llmkernels bench " + shlex.join(argv),
                complete=complete)
    records = runner.records
    skipped = [{"op": op, "provider": p, "reason": reason} for (op, p), reason in runner.skipped.items()]
    report.add_speedups(records)
    report.write_json(os.path.join(out, report.RESULTS_JSON), meta, records, skipped)
    with open(os.path.join(out, report.RESULTS_MD), "w") as f:
        f.write(report.markdown(meta, records, skipped, METHOD if gpu else NO_GPU) + "\n")
    for line in runner.notes():
        print(line)
    print(report.console(records))
    try:
        pngs = report.plot(records, out) if gpu else report.plot_checks(records, out)
        print(f"\n{len(pngs)} plots written")
    except ImportError:
        print("\nmatplotlib is not installed: no plots (pip install matplotlib)")
    print(f"results: {out}/{report.RESULTS_JSON}, {report.RESULTS_MD}")
    ours_bad = [r for r in records if r["provider"] == report.OURS and r["status"] in ("failed", "error")]
    if ours_bad:
        print(f"{len(ours_bad)} llmkernels case(s) failed their check or raised: see the tables above")
    print(report.summary(records, complete))
    return 1 if ours_bad or not complete else 0
