"""``llmkernels tune``: search each family's launch configurations on this GPU and write its cache.

For every task (``spaces.py``: the norms' forward and backward at each width, cross-entropy's
in-place pass and forward at each vocabulary, RoPE, QK-norm + RoPE's forward and backward at
the benchmark's heads and the scaling decoder's) each candidate is checked against the
op's float64 reference (``bench.runner.Case``), then timed as the benchmark times: CUDA-graph
replay under ``triton.testing.do_bench``. The fastest becomes the key's configuration where it
beats the derived heuristic by more than ``MIN_GAIN`` (else the heuristic's stays: noise must
not move a configuration). After every task the cache is written (``_device.user_cache_path``,
or ``--out``, or with ``--ship`` the package's ``ops/tuned/<device>.json``), so a run stopped by
``--budget`` or killed resumes where it stopped; it also holds the copy bandwidth measured first,
which the device model reads, and every candidate's time (the evidence). ``--tiny``: a few tiny
tasks through Triton's interpreter on CPU (TRITON_INTERPRET=1), timed by the clock: checks the
command, not the GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import time

MIN_GAIN = 0.02  # a candidate replaces the heuristic's configuration only this much faster
FAMILIES = ("norm", "ce", "rope", "qk_norm_rope")
TINY = dict(widths=(256, 1000), vocabs=(9000,), seq=8, norm_rows=5, ce_rows=3, rope_rows=1, limit=2,
            qk_heads=((3, 2, 64, 8, 1),))


NO_GPU = """\
llmkernels tune: needs a CUDA GPU, and none is here.
On a GPU it measures that GPU's launch configurations and writes them to
  {cache}/<device>-triton<version>-llmkernels<version>.json
which llmkernels reads on that GPU from then on ({variable}=DIR moves it).
To check this command on the CPU (tiny tasks through Triton's interpreter, under two minutes):
  llmkernels tune --tiny --out llmkernels-tune-check.json"""


def _parser() -> argparse.ArgumentParser:
    from ..ops import _device
    from . import spaces

    def listed(values) -> str:
        return ",".join(map(str, values))

    cache = os.path.join(_device.cache_dir(), "<device>-triton<version>-llmkernels<version>.json")
    p = argparse.ArgumentParser(
        prog="llmkernels tune",
        description="Search the launch configurations of each kernel family on this GPU (bf16, checked against the "
                    "float64 reference, timed by CUDA-graph replay) and write the per-device cache that llmkernels "
                    f"reads when it makes a launch plan on this GPU: {cache} (move it with "
                    f"{_device.CACHE_DIR_VARIABLE}=DIR). Resumable: run the same command again to go on. Without a "
                    "GPU, --tiny checks the command on the CPU.")
    p.add_argument("--ops", default=listed(FAMILIES), metavar="FAMILY,...",
                   help=f"kernel families, comma-separated (default {listed(FAMILIES)})")
    p.add_argument("--widths", metavar="N,...",
                   help=f"norm row widths, comma-separated (default: {listed(spaces.NORM_WIDTHS)})")
    p.add_argument("--vocabs", metavar="V,...",
                   help=f"cross-entropy vocabularies, comma-separated (default: {listed(spaces.VOCABS)})")
    p.add_argument("--norm-ops", metavar="NORM,...",
                   help=f"norms to tune, comma-separated (default: {listed(spaces.NORM_OPS)})")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="candidates a task at most (0: all)")
    p.add_argument("--budget", type=float, default=0, metavar="SECONDS",
                   help="start no task that would end after this many seconds (0: no limit)")
    p.add_argument("--out", metavar="FILE",
                   help="the cache file to write (default: the user's cache for this GPU and these Triton and "
                        "llmkernels versions, above)")
    p.add_argument("--ship", action="store_true",
                   help="write the cache shipped with the package (llmkernels/ops/tuned/), for a GPU the project "
                        "has measured")
    p.add_argument("--fresh", action="store_true", help="search every task again (default: skip those done)")
    p.add_argument("--tiny", action="store_true",
                   help="a check of this command on the CPU: a few tiny tasks through Triton's interpreter, timed "
                        "by the clock (their times mean nothing)")
    return p


def _ints(text):
    return None if text is None else tuple(int(v) for v in text.split(","))


def tasks_of(args, model) -> list:
    """The tasks the arguments select, most wanted first: cross-entropy's in-place pass, the
    norms from the widest rows (backward first), RoPE, QK-norm + RoPE, cross-entropy's forward."""
    from . import spaces

    tiny = TINY if args.tiny else {}
    families = args.ops.split(",")
    limit = args.limit or tiny.get("limit", 0)
    ce = spaces.ce_tasks(model, _ints(args.vocabs) or tiny.get("vocabs", spaces.VOCABS), tiny.get("ce_rows"), limit) \
        if "ce" in families else []
    widths = sorted(_ints(args.widths) or tiny.get("widths", spaces.NORM_WIDTHS), reverse=True)
    norm_ops = tuple(args.norm_ops.split(",")) if args.norm_ops else tuple(spaces.NORM_OPS)
    norm = spaces.norm_tasks(model, widths, norm_ops, rows=tiny.get("norm_rows"), limit=limit, tma=spaces.tma_here()) \
        if "norm" in families else []
    rope = spaces.rope_tasks(tiny.get("seq", spaces.ROPE_SEQ), tiny.get("rope_rows"), limit) \
        if "rope" in families else []
    qk = spaces.qk_norm_rope_tasks(tiny.get("qk_heads", spaces.QK_HEADS), limit) if "qk_norm_rope" in families else []
    return ([t for t in ce if t.part == "split_inplace"] + norm + rope + qk + [t for t in ce if t.part != "split_inplace"])


def _state(path: str, model, fresh: bool) -> dict:
    """The cache at ``path`` to go on with (same format and device, unless ``fresh``), or a new one."""
    from ..ops import _device

    state = None
    if not fresh and os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        if state.get("format") != _device.FORMAT or state.get("device") != model.name:
            state = None
    return state or {"format": _device.FORMAT, "device": model.name, "entries": {}, "searches": {}}


def _write(path: str, state: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _clock_ms(fn) -> float:
    """The interpreter's time of one call (``--tiny``: no GPU timing there)."""
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def search(task, device, copy_gbps: float, log) -> dict:
    """Every candidate of ``task`` checked then timed: the search's record, with the chosen
    configuration (``chosen``: a JSON record)."""
    import torch

    from ..bench.registry import ops
    from ..bench.runner import TOL, Case, graph_bench_ms, free_memory
    from ..ops import _device

    op = ops()[task.op]
    dtype = torch.bfloat16
    shape = task.shape or op.shape(task.size, task.rows)
    case = Case(op, shape, dtype, device, grads=task.mode != "fwd")
    size = op.min_bytes(shape, dtype, task.mode)
    tried = []
    for j, config in enumerate(task.candidates, 1):
        fn = task.call(config)
        result = {"config": _device.as_record(config)}
        try:
            errors = case.check(fn, task.mode != "fwd", task.mutates)
            result["rel_err"] = worst = max(errors.values())
            if worst <= TOL[dtype]:
                timed = lambda: case.timed(fn, task.mode, task.mutates)  # noqa: E731
                result["ms"] = graph_bench_ms(timed) if device.type == "cuda" else _clock_ms(timed())
                result["pct_copy"] = 100 * size / result["ms"] / 1e6 / copy_gbps
            else:
                result["failed"] = f"rel err {worst:.2e} > {TOL[dtype]:.0e}"
        except Exception as exc:  # a candidate that cannot run here is reported, not fatal
            result["failed"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            free_memory()
        tried.append(result)
        shown = config if task.part is None else getattr(config, task.part)
        log(f"  {j}/{len(task.candidates)} {shown}: " + (
            result["failed"] if "failed" in result else f"{1e3 * result['ms']:.1f} us" + (
                f", {result['pct_copy']:.1f}% of copy" if device.type == "cuda" else " (interpreter)")))
    del case
    free_memory()
    timed_ok = [r for r in tried if "ms" in r]
    if not timed_ok:
        raise RuntimeError(f"{task.name}: no candidate passed its check")
    best, first = min(timed_ok, key=lambda r: r["ms"]), tried[0]
    keep = "ms" in first and best["ms"] > first["ms"] * (1 - MIN_GAIN)
    return {"op": task.op, "size": task.size, "rows": task.rows, "mode": task.mode, "part": task.part,
            "heuristic": first, "chosen": (first if keep else best)["config"], "candidates": tried}


def _entry(key: str, tasks: list, searches: dict) -> dict:
    """A key's cache entry from its searches: the record searched whole, or the heuristic with
    each searched part's chosen field."""
    from ..ops import _device

    done = [t for t in tasks if t.key == key and t.name in searches]
    whole = [t for t in done if t.part is None]
    if whole:
        return {"config": searches[whole[0].name]["chosen"]}
    record = _device.as_record(done[0].heuristic)
    for task in done:
        record[task.part] = searches[task.name]["chosen"][task.part]
    return {"config": record, "parts": sorted(t.part for t in done)}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    unknown = set(args.ops.split(",")) - set(FAMILIES)
    if unknown:
        print(f"llmkernels tune: unknown --ops {sorted(unknown)}; choose from {','.join(FAMILIES)}", file=sys.stderr)
        return 2
    import torch

    from .. import __version__
    from ..bench.runner import copy_bandwidth, free_memory
    from ..interpreter import kernels_or_rerun, quiet_interpreter
    from ..ops import _device

    if not torch.cuda.is_available():
        if not args.tiny:
            print(NO_GPU.format(cache=_device.cache_dir(), variable=_device.CACHE_DIR_VARIABLE), file=sys.stderr)
            return 2
        rerun = kernels_or_rerun("llmkernels.cli", ["tune", *(sys.argv[1:] if argv is None else argv)])
        if rerun is not None:
            return rerun
        quiet_interpreter()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = _device.model_of(device)
    path = args.out or (_device.shipped_cache_path(model.name) if args.ship else _device.user_cache_path(model.name))
    state = _state(path, model, args.fresh)
    if device.type == "cuda":
        state["copy_gbps"] = copy_bandwidth(device)
        free_memory()
    else:
        state["copy_gbps"] = model.copy_gbps
    state.update(_device.versions(), torch=torch.__version__, sms=model.sms, date=datetime.date.today().isoformat(),
                 command="llmkernels tune " + shlex.join(argv if argv is not None else sys.argv[1:]))
    _write(path, state)
    _device.forget()  # the device model reads the copy just measured (where ``path`` is the user's cache)
    model = dataclasses.replace(model, copy_gbps=state["copy_gbps"], copy_source="measured")
    state["depth"] = model.depth
    tasks = tasks_of(args, model)
    todo = [t for t in tasks if t.name not in state["searches"]]
    print(f"llmkernels tune {__version__}: {model.name}, copy {state['copy_gbps']:.0f} GB/s, depth {model.depth}; "
          f"{len(todo)} of {len(tasks)} tasks to search; writing {path}", flush=True)
    start, spent = time.time(), []
    for i, task in enumerate(todo, 1):
        if args.budget and spent and time.time() - start + sum(spent) / len(spent) > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(todo) - i + 1} tasks left; run the same command "
                  "again to go on", flush=True)
            break
        began = time.time()
        print(f"[{i}/{len(todo)}] {task.name} ({task.op} {task.mode}, size {task.size}, {task.rows} rows)", flush=True)
        state["searches"][task.name] = search(task, device, state["copy_gbps"],
                                              lambda line: print(line, flush=True))
        state["entries"][task.key] = _entry(task.key, tasks, state["searches"])
        _write(path, state)
        spent.append(time.time() - began)
    else:
        print(f"done: {len(state['entries'])} keys in {path}", flush=True)
    _device.forget()
    return 0

