"""Which launch tiles close ``moe_experts``' gap to ``F.grouped_mm`` at Mixtral's shape: one GPU,
one process.

For each case (Mixtral's layer, then Qwen3-30B-A3B's, at 8K tokens: ``moe_bench.py``'s cases,
inputs and timing), the routed experts forward and forward + backward with the default
``moe_config`` choice, with each of ``CANDIDATES`` (the default with one GEMM's tiles replaced, so
that a gain names its GEMM, and all of them together), and, the reference row,
``torch_grouped_mm`` (``F.grouped_mm`` with PyTorch's permutation). Candidates may also move the
weight gradients to torch's grouped GEMM (``MoeConfig.weight_grad_backend``). Every configuration is also
timed kernel by kernel: its launches of one forward + backward are recorded and each replayed
alone under the same timer, beside the bare ``F.grouped_mm`` GEMM of the same step, which tells
which GEMM is behind (a weight gradient formed by torch's grouped GEMM is one step too: its rows'
gather and scale and torch's launches, replayed together and marked ``*``). Last,
``best-per-gemm``: each GEMM's fastest tiles of those breakdowns put together (the weight
gradients' backend with their tiles), measured like the others.

A candidate's output and gradients must match the default's (relative norm at most ``TOLERANCE``,
bf16) before it is timed; one that does not compile (shared memory, registers) records its error
and the run goes on.

    python benchmarks/moe_tiles.py --out $OUT      # GPU: mixtral-8k then qwen3-8k, about 6 minutes
    python benchmarks/moe_tiles.py --tiny          # CPU (Triton's interpreter): tiny shapes, three candidates

Writes ``moe_tiles.json`` and ``moe_tiles.md`` under ``--out`` (default ``$OUT``, else
``./moe-tiles``) after every configuration. ``--budget`` counts from the process's start; each
case may use an equal share of what is left when it starts (what it leaves goes to the next), and
no configuration starts past its case's share: leave a configuration's time (about half a minute
with its compilation) between the budget and any outside limit.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from typing import NamedTuple, Optional

START = time.time()  # the budget counts from here, imports included, as an outside timeout would

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_bench  # noqa: E402

import llmkernels  # noqa: E402
from llmkernels.bench import ops_moe  # noqa: E402
from llmkernels.bench.report import write_texts  # noqa: E402
from llmkernels.ops._device import as_record  # noqa: E402
from llmkernels.ops.moe import experts as launchers  # noqa: E402
from llmkernels.ops.moe import wgrad  # noqa: E402
from llmkernels.ops.moe.configs import GemmTiles, MoeConfig, _staged, moe_config  # noqa: E402

CASES = ("mixtral-8k", "qwen3-8k")
TOLERANCE = 1e-2  # a candidate's largest relative error against the default's output and gradients (bf16)
FIELDS = ("gate_up", "down", "down_bwd", "weight_grad")  # the MoeConfig fields of the GEMMs a candidate varies


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration to try: the default's launches with the named GEMMs' tiles in their place
    (None: the default's), stages lowered to what the card's shared memory holds, every GEMM's
    row tiles in groups of ``group_m`` (``GemmTiles.group_m``; None: each GEMM's default), and the
    weight gradients' ``weight_grad_backend`` (None: the default's)."""

    name: str
    why: str
    gate_up: Optional[GemmTiles] = None
    down: Optional[GemmTiles] = None
    down_bwd: Optional[GemmTiles] = None
    weight_grad: Optional[GemmTiles] = None
    group_m: Optional[int] = 1
    weight_grad_backend: Optional[str] = None


def vary(field: str, m: int, n: int, k: int, warps: int, stages: int, why: str) -> Candidate:
    """The candidate that changes one GEMM's tiles, named after them."""
    return Candidate(f"{field}-{m}x{n}x{k}-w{warps}-s{stages}", why, **{field: GemmTiles(m, n, k, warps, stages)})


# Larger tiles for many rows an expert (Mixtral's 2,000 on average at 8K tokens; the default's
# 128-row tiles were chosen for Qwen3's hundreds). gate_up's block_n counts gate's columns and
# up's alike (two accumulators: 128 is a 128 x 256 output); 128 x 256 of each would be 256 fp32
# registers a thread at 8 warps, a certain spill, so it is not tried. weight_grad's block_k is
# rows a step.
CANDIDATES = (
    vary("gate_up", 128, 128, 64, 8, 3, "twice the columns a program: half the re-reads of x's rows"),
    vary("gate_up", 128, 128, 64, 8, 4, "the same with one more stage of loads in flight"),
    vary("gate_up", 256, 64, 64, 8, 3, "twice the rows a program: half the re-reads of the weights"),
    vary("gate_up", 128, 64, 128, 8, 3, "deeper k steps: half the loop iterations"),
    vary("down", 128, 256, 64, 8, 3, "forward down and backward dx: twice the columns a program"),
    vary("down", 128, 256, 64, 8, 4, "the same with one more stage"),
    vary("down", 256, 128, 64, 8, 3, "twice the rows a program"),
    vary("down", 128, 128, 128, 8, 3, "deeper k steps"),
    vary("down_bwd", 128, 128, 64, 8, 4, "dy @ down and dSwiGLU: twice the columns a program"),
    vary("down_bwd", 128, 256, 64, 8, 3, "four times the columns (a large epilogue: it may spill)"),
    vary("weight_grad", 128, 128, 64, 8, 3, "twice the rows a step"),
    vary("weight_grad", 128, 128, 64, 8, 4, "the same with one more stage"),
    vary("weight_grad", 128, 256, 64, 8, 3, "twice the columns a program"),
    vary("weight_grad", 256, 128, 64, 8, 3, "twice the weight rows a program"),
    Candidate("large", "each GEMM's larger tiles together", gate_up=GemmTiles(128, 128, 64, 8, 3),
              down=GemmTiles(128, 256, 64, 8, 3), down_bwd=GemmTiles(128, 128, 64, 8, 4),
              weight_grad=GemmTiles(128, 256, 64, 8, 3)),
    # Programs run row tile by row tile by default, so at Mixtral's sizes (an expert's weight far
    # larger than L2) each running program streams its own weight tile from HBM; in groups, the
    # programs running together share one.
    Candidate("grouped-4", "the default's tiles, row tiles in groups of 4", group_m=4),
    Candidate("grouped-8", "the default's tiles, row tiles in groups of 8", group_m=8),
    Candidate("grouped-16", "the default's tiles, row tiles in groups of 16", group_m=16),
    Candidate("large-grouped-8", "each GEMM's larger tiles together, row tiles in groups of 8",
              gate_up=GemmTiles(128, 128, 64, 8, 3), down=GemmTiles(128, 256, 64, 8, 3),
              down_bwd=GemmTiles(128, 128, 64, 8, 4), weight_grad=GemmTiles(128, 256, 64, 8, 3), group_m=8),
    # The weight gradients were the GEMMs furthest from torch's grouped GEMM: each backend with
    # the default's tiles, whichever backend the default chose.
    Candidate("wgrad-triton", "the default's tiles, weight gradients by weight_grad_kernel", group_m=None,
              weight_grad_backend="triton"),
    Candidate("wgrad-grouped_mm", "the default's tiles, weight gradients by torch's grouped GEMM", group_m=None,
              weight_grad_backend="grouped_mm"),
)
BY_NAME = {c.name: c for c in CANDIDATES}
# Under the interpreter a forward + backward of large tiles takes seconds: --tiny tries three.
TINY_CANDIDATES = ("gate_up-128x128x64-w8-s3", "weight_grad-128x128x64-w8-s3", "grouped-4", "wgrad-grouped_mm")
BEST = "best-per-gemm"


def candidate_config(candidate: Candidate, default: MoeConfig, device: torch.device) -> MoeConfig:
    """The default with ``candidate``'s tiles, each with the stages ``device`` holds
    (configs._staged), every GEMM's row tiles in groups of ``candidate.group_m``, and its weight
    gradients' backend."""
    def tiles_of(field: str) -> GemmTiles:
        tiles, group_m = getattr(candidate, field), candidate.group_m or getattr(default, field).group_m
        if tiles is None:
            return dataclasses.replace(getattr(default, field), group_m=group_m)
        return dataclasses.replace(_staged(tiles, device, operands=3 if field == "gate_up" else 2), group_m=group_m)
    backend = candidate.weight_grad_backend or default.weight_grad_backend
    return dataclasses.replace(default, **{field: tiles_of(field) for field in FIELDS}, weight_grad_backend=backend)


class Step(NamedTuple):
    """A kernel launch of one forward + backward: its name in the tables, the MoeConfig field
    whose tiles it runs with, its GEMM's FLOPs in units of ``2 S H I`` (0: no GEMM)."""

    name: str
    field: str
    gemm: int


TORCH_WGRAD = "grouped_weight_grad"  # wgrad.py's call: a weight gradient by torch's grouped GEMM
# (phase, kernel, its n-th launch in the phase) -> Step: experts.py's launch order without adapters.
STEPS = {("fwd", "gate_up_kernel", 0): Step("fwd gate_up", "gate_up", 2),
         ("fwd", "grouped_mm_kernel", 0): Step("fwd down", "down", 1),
         ("fwd", "combine_kernel", 0): Step("fwd combine", "combine", 0),
         ("bwd", "down_bwd_kernel", 0): Step("bwd dh", "down_bwd", 1),
         ("bwd", "weight_grad_kernel", 0): Step("bwd d down_proj", "weight_grad", 1),
         ("bwd", "grouped_mm_kernel", 0): Step("bwd dx", "down", 2),
         ("bwd", "combine_kernel", 0): Step("bwd dx combine", "combine", 0),
         ("bwd", "weight_grad_kernel", 1): Step("bwd d gate_up_proj", "weight_grad", 2),
         ("bwd", TORCH_WGRAD, 0): Step("bwd d down_proj", "weight_grad", 1),
         ("bwd", TORCH_WGRAD, 1): Step("bwd d gate_up_proj", "weight_grad", 2)}


class Bench(NamedTuple):
    """What every measurement of a case shares (``moe_bench.case_inputs`` and its timer)."""

    shape: dict
    inputs: dict
    leaves: dict
    d_out: torch.Tensor
    device: torch.device
    ms: object


class LaunchLog:
    """The kernel launches ``moe_experts`` makes within ``phase(name)`` blocks, each kept with its
    launcher and arguments to be replayed alone. ``experts.launcher_of`` and
    ``wgrad.grouped_weight_grad`` (torch's launches of a weight gradient, one step) are wrapped
    for the block: a benchmark's look at the private launches, which the public call does not
    expose."""

    def __init__(self):
        self.launches = []

    @contextlib.contextmanager
    def phase(self, name: str):
        original, torch_wgrad = launchers.launcher_of, wgrad.grouped_weight_grad

        def recording(kernel, **options):
            launcher = original(kernel, **options)

            def launch(grid, *args):
                self.launches.append((name, getattr(kernel, "fn", kernel).__name__, functools.partial(
                    launcher, grid, *args)))
                launcher(grid, *args)
            return launch

        def recording_wgrad(*args, **kwargs):
            self.launches.append((name, TORCH_WGRAD, functools.partial(torch_wgrad, *args, **kwargs)))
            return torch_wgrad(*args, **kwargs)
        launchers.launcher_of, wgrad.grouped_weight_grad = recording, recording_wgrad
        try:
            yield
        finally:
            launchers.launcher_of, wgrad.grouped_weight_grad = original, torch_wgrad


def _step_record(bench: Bench, call, gemm: int, field: Optional[str] = None, by_torch: bool = False) -> dict:
    """The time of ``call`` and the TFLOP/s of its GEMM (``gemm`` units of ``2 S H I``);
    ``by_torch``: a weight gradient by torch's grouped GEMM."""
    s = bench.shape
    ms = bench.ms(call, False)
    flops = gemm * 2 * s["M"] * s["K"] * s["H"] * s["I"]
    return {"ms": ms, "field": field, **({"tflops": flops / ms / 1e9} if gemm else {}),
            **({"by_torch": True} if by_torch else {})}


def kernel_steps(fn, bench: Bench) -> dict:
    """Each launch of one forward + backward of ``fn`` replayed alone: ``{step: {ms, field, tflops}}``."""
    log = LaunchLog()
    with log.phase("fwd"):
        out = fn(**bench.inputs)
    with log.phase("bwd"):
        torch.autograd.grad(out, list(bench.leaves.values()), bench.d_out)
    seen, steps = collections.Counter(), {}
    for phase, kernel, call in log.launches:
        key = (phase, kernel, seen[phase, kernel])
        seen[phase, kernel] += 1
        step = STEPS.get(key) or Step(" ".join(map(str, key)), None, 0)
        steps[step.name] = _step_record(bench, call, step.gemm, step.field, kernel == TORCH_WGRAD)
    return steps


def torch_steps(bench: Bench) -> dict:
    """The bare ``F.grouped_mm`` GEMM of each GEMM step, operands laid out as ``torch_grouped_mm``
    and autograd form them (random values): what PyTorch's grouped GEMM takes for the same work."""
    mm = ops_moe.grouped_mm()
    x, index, gate_up, down = (bench.inputs[n].detach() for n in ("x", "top_k_index", "gate_up_proj", "down_proj"))
    order, offsets = ops_moe._sorted_offsets(index, gate_up.shape[0])
    xs = x[order // index.shape[1]]
    h, dys, dgu = (torch.randn(xs.shape[0], n, device=x.device, dtype=x.dtype) for n in (
        bench.shape["I"], bench.shape["H"], 2 * bench.shape["I"]))
    gemms = {"fwd gate_up": (lambda: mm(xs, gate_up.transpose(1, 2), offs=offsets), 2),
             "fwd down": (lambda: mm(h, down.transpose(1, 2), offs=offsets), 1),
             "bwd dh": (lambda: mm(dys, down, offs=offsets), 1),
             "bwd d down_proj": (lambda: mm(h.t(), dys, offs=offsets), 1),
             "bwd dx": (lambda: mm(dgu, gate_up, offs=offsets), 2),
             "bwd d gate_up_proj": (lambda: mm(xs.t(), dgu, offs=offsets), 2)}
    return {name: _step_record(bench, call, gemm) for name, (call, gemm) in gemms.items()}


def _attempt(record: dict, bench: Bench, work) -> dict:
    """``work(record)`` with its failure recorded as the record's status (the run goes on), and
    the wall time it took, compilation and checks included."""
    start = time.time()
    try:
        work(record)
    except Exception as e:  # noqa: BLE001  (a configuration that fails is a result: recorded, the run goes on)
        record["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
        record["traceback"] = traceback.format_exc()[-2000:]
    finally:
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    record["wall_s"] = time.time() - start
    return record


def run_config(config: MoeConfig, bench: Bench, expected: Optional[dict]) -> dict:
    """``moe_experts`` with ``config``: checked against ``expected`` (the default's results; None
    for the default itself), then timed as ``moe_bench`` times a provider and kernel by kernel."""
    fn = functools.partial(llmkernels.moe_experts, config=config)

    def work(record):
        forward_backward = moe_bench.forward_backward_of(fn, bench.inputs, bench.leaves, bench.d_out)
        if expected is not None:
            record["errors"] = moe_bench.errors_of(forward_backward, bench.leaves, expected)
            worst = max(record["errors"].values())
            if not worst <= TOLERANCE:  # (NaN fails too)
                record["status"] = f"mismatch: max rel err {worst:.1e} against the default's, over {TOLERANCE}"
                return
        record.update(moe_bench.timings(fn, forward_backward, bench.inputs, bench.shape, bench.device, bench.ms,
                                        False))
        record["steps"] = kernel_steps(fn, bench)
        record["status"] = "ok"
    return _attempt({"config": as_record(config)}, bench, work)


def best_per_gemm(measured: dict, default: MoeConfig) -> MoeConfig:
    """The default with each GEMM's tiles from the measured configuration whose launches of that
    GEMM took least (the kernel breakdown's sum over the GEMM's steps), the weight gradients'
    backend with their tiles; ``measured``: name -> (config, record), the default's among them."""
    timed = [(config, record["steps"]) for config, record in measured.values() if record.get("status") == "ok"]
    if not timed:
        return default
    fastest = {field: min(timed, key=lambda item: sum(
        s["ms"] for s in item[1].values() if s["field"] == field))[0] for field in FIELDS}
    return dataclasses.replace(default, **{field: getattr(config, field) for field, config in fastest.items()},
                               weight_grad_backend=fastest["weight_grad"].weight_grad_backend)


def run_case(shape: dict, candidates: list, device: torch.device, ms, deadline: float, save) -> dict:
    """One shape: the default, the reference row, the candidates, the best per GEMM; ``save(case)``
    after each."""
    rows = {}
    case = {"shape": shape, "routed_tflop_fwd_bwd": ops_moe.routed_flops(shape, "fwd+bwd") / 1e12, "rows": rows}
    names = ["default", "torch_grouped_mm", *(c.name for c in candidates), BEST]
    if time.time() > deadline:
        rows.update({name: {"status": moe_bench.SPENT} for name in names})
        return case
    inputs, leaves, d_out = moe_bench.case_inputs(shape, device)
    bench = Bench(shape, inputs, leaves, d_out, device, ms)
    default = moe_config(shape["M"] * shape["K"], shape["E"], shape["H"], shape["I"], device)
    case["default_config"] = as_record(default)
    expected = {}

    def reference(record):  # the default's results: what every candidate must reproduce
        out, grads = moe_bench.forward_backward_of(functools.partial(llmkernels.moe_experts, config=default), inputs,
                                                   leaves, d_out)()
        expected.update({"out": out.detach(), **{f"d{k}": g for k, g in zip(leaves, grads)}})
    rows["default"] = _attempt({}, bench, reference)
    if not expected:
        rows.update({name: {"status": "skipped: the default failed"} for name in names[1:]})
        return case
    rows["default"] = run_config(default, bench, None)
    measured = {"default": (default, rows["default"])}
    report("default", rows, save, case)

    def peer(record):
        record.update(moe_bench.measure(ops_moe.torch_grouped_mm(), inputs, leaves, d_out, expected, shape, device, ms,
                                        False))
        record["status"] = "ok"
    rows["torch_grouped_mm"] = _attempt({}, bench, peer)
    case["torch_steps"] = _attempt({}, bench, lambda record: record.update(steps=torch_steps(bench)))
    report("torch_grouped_mm", rows, save, case)
    for candidate in candidates:
        if time.time() > deadline:
            rows[candidate.name] = {"status": moe_bench.SPENT}
            continue
        config = candidate_config(candidate, default, device)
        rows[candidate.name] = run_config(config, bench, expected)
        rows[candidate.name]["why"] = candidate.why
        measured[candidate.name] = (config, rows[candidate.name])
        report(candidate.name, rows, save, case)
    best = best_per_gemm(measured, default) if time.time() <= deadline else None
    same = [name for name, (config, _) in measured.items() if config == best]
    rows[BEST] = ({"status": moe_bench.SPENT} if best is None else {"status": f"skipped: the same as {same[0]}"}
                  if same else run_config(best, bench, expected))
    report(BEST, rows, save, case)
    return case


def report(name: str, rows: dict, save, case: dict):
    r = rows[name]
    text = (f"fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms ({r['tflops_fwd_bwd']:.0f} TFLOP/s)"
            if r.get("status") == "ok" else r.get("status"))
    print(f"{name:30s} {text}", flush=True)
    save(case)


# --------------------------------------------------------------------------------------------
# the markdown
# --------------------------------------------------------------------------------------------
def tiles_text(tiles: dict) -> str:
    group = f" g{tiles['group_m']}" if tiles.get("group_m", 1) > 1 else ""
    shape = f"{tiles['block_m']}x{tiles['block_n']}x{tiles['block_k']}"
    return f"{shape} w{tiles['num_warps']} s{tiles['num_stages']}{group}"


def changes(name: str, record: dict, default: dict) -> str:
    """What a row's configuration changes from the default's, in its actual (staged) tiles."""
    if name == "default":
        return "moe_config's choice"
    if name == "torch_grouped_mm":
        return "F.grouped_mm + PyTorch permutation"
    if "config" not in record:
        return BY_NAME[name].why if name in BY_NAME else ""
    changed = [f"{f} {tiles_text(record['config'][f])}" for f in FIELDS if record["config"][f] != default[f]]
    backend = record["config"].get("weight_grad_backend")
    if backend != default.get("weight_grad_backend"):
        changed.append(f"weight gradients by {backend}")
    return ", ".join(changed) or "none"


def _ratio(reference: dict, record: dict) -> str:
    ok = record.get("status") == "ok" and reference.get("status") == "ok"
    return f"{reference['fwd_bwd_ms'] / record['fwd_bwd_ms']:.2f}x" if ok else "-"


def case_markdown(name: str, case: dict) -> list:
    s, rows = case["shape"], case["rows"]
    lines = [f"## {name}: T {s['M']} tokens, E {s['E']}, top-{s['K']}, H {s['H']}, I {s['I']}", ""]
    default = case.get("default_config")
    if default:
        lines += ["Default (`moe_config`): " + ", ".join(f"{f} {tiles_text(default[f])}" for f in FIELDS)
                  + f"; weight gradients by {default.get('weight_grad_backend', 'triton')}.", ""]
    lines += ["| config | tiles changed | fwd ms | fwd+bwd ms | TFLOP/s | vs default | vs torch_grouped_mm | "
              "max rel err vs default | s | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row, r in rows.items():
        ok = r.get("status") == "ok"
        err = f"{max(r['errors'].values()):.1e}" if r.get("errors") else "-"
        cells = ([f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}", f"{r['tflops_fwd_bwd']:.0f}"] if ok else ["-"] * 3)
        cells += [_ratio(rows.get("default", {}), r), _ratio(rows.get("torch_grouped_mm", {}), r), err,
                  f"{r['wall_s']:.0f}" if "wall_s" in r else "-"]
        lines.append(f"| {row} | {changes(row, r, default) if default else ''} | " + " | ".join(cells)
                     + f" | {r.get('status', '')} |")
    lines += ["", "vs: the other's fwd+bwd time over this one's (above 1: this is faster). TFLOP/s of the routed "
              "FLOPs; max rel err: the output's and every gradient's against the default's (the reference row's "
              "too, not gating it).", ""]
    return lines + steps_markdown(case)


def steps_markdown(case: dict) -> list:
    """Each configuration's kernels, ms (TFLOP/s of its GEMM), beside PyTorch's bare GEMMs."""
    table = {"F.grouped_mm (GEMM alone)": case.get("torch_steps", {}).get("steps")}
    table.update({row: r.get("steps") for row, r in case["rows"].items()})
    table = {row: steps for row, steps in table.items() if steps}
    if not table:
        return []
    columns = list(dict.fromkeys([s.name for s in STEPS.values()] + [c for steps in table.values() for c in steps]))
    lines = ["Kernel by kernel: each launch of one forward + backward replayed alone, ms (TFLOP/s of its GEMM); "
             "the sum leaves out the routing's sort and the host. `*`: a weight gradient by torch's grouped GEMM "
             "(wgrad.py: its rows' gather and scale, a bias's sums and torch's GEMM, replayed together).", "",
             "| config | " + " | ".join(columns) + " | sum |", "|---" * (len(columns) + 2) + "|"]
    for row, steps in table.items():
        cells = [("-" if c not in steps else f"{steps[c]['ms']:.3f}" + (
            f" ({steps[c]['tflops']:.0f})" if "tflops" in steps[c] else "") + ("*" if steps[c].get("by_torch") else ""))
            for c in columns]
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {sum(v['ms'] for v in steps.values()):.3f} |")
    return lines + [""]


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# MoE experts: launch tiles against F.grouped_mm ({meta['device']}, {meta['date']})", "",
             f"bf16, routing given, `moe_bench.py`'s inputs and timing; command `{meta['command']}`; versions: "
             f"{meta['versions']}", ""]
    for name, case in result["cases"].items():
        lines += case_markdown(name, case)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = moe_bench.common_parser(__doc__, "moe-tiles", 420.0,
                                     "no configuration starts past its case's share of what is left")
    parser.add_argument("--candidates", default=None, help=f"comma-separated subset of {list(BY_NAME)}")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    table = moe_bench.TINY if device.type == "cpu" else moe_bench.CASES
    cases = args.cases.split(",") if args.cases else list(table) if device.type == "cpu" else list(CASES)
    names = args.candidates.split(",") if args.candidates else TINY_CANDIDATES if device.type == "cpu" else BY_NAME
    for option, chosen, known in (("--cases", cases, table), ("--candidates", names, BY_NAME)):
        unknown = [n for n in chosen if n not in known]
        if unknown:
            parser.error(f"{option}: unknown {unknown}; known: {list(known)}")
    ms = moe_bench.timer(device)
    result = {"meta": {**moe_bench.meta(device), "tolerance": TOLERANCE, "budget_s": args.budget}, "cases": {}}
    os.makedirs(args.out, exist_ok=True)
    deadline = START + args.budget
    for i, name in enumerate(cases):
        def save(case, name=name):
            result["cases"][name] = case
            write_texts(args.out, {"moe_tiles.json": json.dumps(result, indent=2),
                                       "moe_tiles.md": markdown(result)})
        now = time.time()  # this case's share of what is left
        save(run_case(table[name], [BY_NAME[n] for n in names], device, ms,
                      now + max(0.0, deadline - now) / (len(cases) - i), save))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
