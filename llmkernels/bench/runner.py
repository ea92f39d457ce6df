"""Running the benchmark: the copy ceiling, the float64 check of every provider, the timings.

Bandwidth cases are timed with ``triton.testing.do_bench`` (median; it flushes L2 before each
call) replaying a CUDA graph of one call, so the time is the GPU's: the host's work for a plain
call (Python, autograd, launches) can take as long as a 0.3-0.5 ms call and varied between
processes. A provider that breaks capture is timed as plain calls, and its record says so.

Decode cases (small M) are timed twice. ``decode``: the latency an eager user sees, CUDA
events around a loop of ``DECODE_CALLS`` back-to-back plain calls, median of ``DECODE_REPEATS``
loops, so Python, autograd and launch overhead count. ``decode_graph``: the GPU time alone, as a
decode step captured in a CUDA graph pays it (vLLM, SGLang, ``torch.compile(mode="reduce-overhead")``):
``GRAPH_CALLS`` calls captured in one graph, replayed, median of ``DECODE_REPEATS`` replays.
``do_bench`` suits neither: the CPU launches the call while the GPU still flushes L2, so it
reports neither the GPU time nor the user's latency.

Eager cases (``BenchOp.eager_shapes``: a training micro-batch, M = 4096) are timed as the decode
ones' plain calls, forward and forward + backward (shorter loops: ``EAGER_CALLS``): what an
eager training step pays per call, host and GPU, beside the GPU time alone of the bandwidth
cases.
"""
from __future__ import annotations

import gc
import importlib.metadata
import math
import statistics
from dataclasses import dataclass
from datetime import date
from typing import Optional

import torch

import llmkernels
from ..testing import poisoned

from .registry import MODES, BenchOp, Unavailable, ops
from .report import NOT_TIMED_ALONE, NOT_TIMED_ALONE_WHY

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# ||out - ref|| / ||ref|| against the float64 reference, per benchmark dtype: a gate against wrong
# answers (a provider over it is reported as failed and not timed), not a precision ranking.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
WARMUP_MS, REP_MS = 10, 50
DECODE_CALLS, DECODE_REPEATS = 100, 10
EAGER_CALLS, EAGER_REPEATS = 20, 5
EAGER_MODES = ("fwd", "fwd+bwd")
GRAPH_CALLS = 20
COPY_BYTES = 2**28


@dataclass
class Settings:
    ops: list
    dtypes: list
    sizes: Optional[list] = None  # None: each op's default (or quick) sizes
    rows: Optional[int] = None
    modes: tuple = MODES
    providers: Optional[list] = None  # None: all
    decode: bool = True
    eager: bool = True
    quick: bool = False


def environment(device: torch.device) -> dict:
    """What every record carries: device, date and software versions."""
    import triton

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    return {"device": name, "date": date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "llmkernels": llmkernels.__version__,
            "liger_kernel": version("liger-kernel"), "quack_kernels": version("quack-kernels")}


def _bench_ms(fn) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def _latency_ms(fn, calls: int = DECODE_CALLS, repeats: int = DECODE_REPEATS) -> float:
    """Per-call time of back-to-back plain calls (Python and launch overhead included): the
    median of ``repeats`` loops of ``calls`` calls, after one loop of warm-up."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(repeats + 1):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if i:  # the first loop warms up
            times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _release_rng_from_capture() -> None:
    """A capture that a provider broke (a host sync, say) leaves the device's default generator
    marked as capturing, and every later ``torch.randn`` on the device fails ("Offset increment
    outside graph capture"): give the generator a fresh copy of its state, which is not."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    if hasattr(gen, "graphsafe_set_state"):
        gen.graphsafe_set_state(gen.clone_state())


def _release_capture_pool(pool) -> None:
    """A capture that fails leaves the caching allocator sending the capturing stream's
    allocations to the graph's private pool, which is never released: later captures' warm-up
    calls allocate there too (on H100 one failed capture of Liger's cross-entropy at 2 GiB of
    logits left every later case out of memory). End the allocation to ``pool`` and release it
    (private torch entry points, where this torch has them)."""
    device = torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        release = getattr(torch._C, name, None)
        if release is not None:
            try:
                release(device, pool)
            except RuntimeError:  # already ended by the failed capture_end
                pass


def _capture(make_timed, calls: int):
    """A CUDA graph of ``calls`` calls of ``make_timed()``. The callable is made, warmed up and
    captured on a side stream, so that a backward's forward (which ``make_timed`` runs for the
    bwd mode) is on the capturing stream too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_timed()
        for _ in range(3):
            fn()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                for _ in range(calls):
                    fn()
        except Exception:
            _release_rng_from_capture()
            del graph, fn
            _release_capture_pool(pool)
            raise
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def graph_latency_ms(make_timed) -> float:
    """Per-call GPU time of ``GRAPH_CALLS`` calls of ``make_timed()`` captured in one CUDA graph."""
    graph = _capture(make_timed, GRAPH_CALLS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(DECODE_REPEATS + 1):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i:  # the first replay warms up
            times.append(start.elapsed_time(end) / GRAPH_CALLS)
    del graph
    return statistics.median(times)


def graph_bench_ms(make_timed) -> float:
    """``do_bench`` median of one call of ``make_timed()`` replayed from a CUDA graph (L2 flushed
    before each replay): the call's GPU time. Timed as plain calls, a bandwidth case's time also
    held whatever time the host took beyond the GPU's (Python, autograd, launches), which varied
    between processes: up to a third of some calls of 0.3-0.5 ms."""
    graph = _capture(make_timed, 1)
    ms = _bench_ms(graph.replay)
    del graph
    return ms


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of a 256 MiB tensor, GB/s counting bytes read plus written."""
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / ms / 1e6


def script_device(tiny: bool, error) -> torch.device:
    """A benchmark script's device: the GPU, or with ``tiny`` the CPU (the checks only, under
    Triton's interpreter); else ``error(message)`` (argparse's)."""
    if not torch.cuda.is_available() and not tiny:
        error("needs a CUDA GPU (--tiny: the checks only, on CPU with TRITON_INTERPRET=1)")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf on a shape mismatch, NaN on NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    diff = (out.detach().to(ref.device, torch.float64) - ref).norm()
    denom = ref.norm()
    return float(diff / denom if denom > 0 else diff)


class Case:
    """One op at one shape and dtype: random inputs and output gradients, and the float64
    reference outputs (and, when ``grads``, reference gradients ``d<input>``)."""

    def __init__(self, op: BenchOp, shape: dict, dtype: torch.dtype, device: torch.device, grads: bool):
        self.op, self.shape, self.dtype = op, shape, dtype
        torch.manual_seed(0)
        self.inputs = op.make_inputs(shape, dtype, device)
        ref_in = {k: v.detach().double().requires_grad_(grads and k in op.grad_inputs) if v.is_floating_point()
                  else v for k, v in self.inputs.items()}  # targets stay integers
        with torch.enable_grad():
            outs = _as_tuple(op.reference(**ref_in))
        self.grad_outputs = tuple((torch.ones(o.shape, device=device) if op.is_loss else
                                   torch.randn(o.shape, device=device)).to(dtype) for o in outs)
        self.ref = {name: o.detach() for name, o in zip(op.outputs, outs)}
        if grads:
            ref_grads = torch.autograd.grad(outs, [ref_in[k] for k in op.grad_inputs],
                                            [g.double() for g in self.grad_outputs])
            self.ref.update({f"d{k}": g for k, g in zip(op.grad_inputs, ref_grads)})

    def leaves(self, grads: bool, copy: bool = False) -> dict:
        """The inputs as fresh autograd leaves (same storage, or copies when ``copy``), requiring
        grad when ``grads``."""
        return {k: (v.detach().clone() if copy else v.detach()).requires_grad_(grads and k in self.op.grad_inputs)
                for k, v in self.inputs.items()}

    def call_inputs(self, leaves) -> dict:
        """What a provider is called with: the leaves, or views of those that need gradients
        where the op's inputs come out of earlier ops (``BenchOp.inputs_from_graph``)."""
        if not self.op.inputs_from_graph:
            return leaves
        return {k: v.view_as(v) if v.requires_grad else v for k, v in leaves.items()}

    def forward(self, fn, leaves) -> tuple:
        outs = _as_tuple(fn(**self.call_inputs(leaves)))
        if len(outs) != len(self.op.outputs):
            raise ValueError(f"returned {len(outs)} outputs, expected {len(self.op.outputs)} {self.op.outputs}")
        return outs

    def backward_args(self, outs, leaves, retain: bool):
        params = [leaves[k] for k in self.op.grad_inputs]
        grad_outputs = [g.to(o.dtype) for g, o in zip(self.grad_outputs, outs)]
        return outs, params, grad_outputs, retain

    def check(self, fn, grads: bool, mutates: bool = False) -> dict:
        """Relative error of every output (and every gradient when ``grads``) of ``fn``. A first
        call warms up (compilation, JIT); the checked call runs with poisoned allocations. With
        ``mutates`` each call gets its own copy of the inputs."""
        leaves = self.leaves(grads, copy=mutates)
        outs = self.forward(fn, leaves)
        if grads:
            torch.autograd.grad(*self.backward_args(outs, leaves, False))
        del outs
        if mutates:
            leaves = self.leaves(grads, copy=True)
        with poisoned():
            outs = self.forward(fn, leaves)
            got = dict(zip(self.op.outputs, outs))
            if grads:
                got.update(zip((f"d{k}" for k in self.op.grad_inputs),
                               torch.autograd.grad(*self.backward_args(outs, leaves, False))))
        return {name: rel_err(t, self.ref[name]) for name, t in got.items()}

    def timed(self, fn, mode: str, mutates: bool = False):
        """The callable to time for ``mode``: the forward, the backward alone (of a retained
        graph), or both. With ``mutates`` the calls share a copy of the inputs."""
        leaves = self.leaves(mode != "fwd", copy=mutates)
        inputs = self.call_inputs(leaves)
        if mode == "fwd":
            return lambda: fn(**inputs)
        outs = self.forward(fn, leaves)
        _, params, grad_outputs, _ = self.backward_args(outs, leaves, True)
        if mode == "bwd":
            return lambda: torch.autograd.grad(outs, params, grad_outputs, retain_graph=True)
        return lambda: torch.autograd.grad(_as_tuple(fn(**inputs)), params, grad_outputs)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class Runner:
    """Runs the cases of ``settings`` and collects one record per (case, provider, mode).

    ``log`` prints a line (above the progress bar); ``progress(n)`` advances the bar."""

    def __init__(self, settings: Settings, device: torch.device, log, progress=lambda n: None):
        self.settings, self.device, self.log, self.progress = settings, device, log, progress
        self.timing = device.type == "cuda"
        self.env = environment(device)
        self.copy_gbps = None
        self.records: list = []
        self.skipped: dict = {}  # (op, provider) -> reason
        self.uncapturable: dict = {}  # (op, provider) -> why its first bandwidth capture failed

    # -- what runs ------------------------------------------------------------------------------
    def selected_ops(self) -> list:
        registry = ops()
        return [registry[name] for name in self.settings.ops]

    def providers(self, op: BenchOp) -> list:
        wanted = self.settings.providers
        return [name for name in op.providers if wanted is None or name in wanted]

    def cases(self, op: BenchOp) -> list:
        """``(kind, shape)`` pairs: bandwidth sweep and decode sizes on a GPU, small shapes
        (checks only) without one."""
        s = self.settings
        if not self.timing:
            return [("check", shape) for shape in op.small_shapes]
        sizes = s.sizes or (op.quick_sizes if s.quick else op.sizes)
        cases = [("bandwidth", op.shape(n, s.rows)) for n in sizes]
        if s.decode:
            decode = op.decode_shapes[::2] if s.quick else op.decode_shapes
            cases += [("decode", shape) for shape in decode]
        if s.eager:
            cases += [("eager", shape) for shape in op.eager_shapes]
        return cases

    def total(self) -> int:
        return sum(len(self.cases(op)) * len(self.providers(op)) * len(self.settings.dtypes)
                   for op in self.selected_ops())

    # -- running --------------------------------------------------------------------------------
    def run(self) -> list:
        if self.timing:
            self.copy_gbps = copy_bandwidth(self.device)
            free_memory()
            self.log(f"device-to-device copy: {self.copy_gbps:.0f} GB/s (the ceiling)")
        for op in self.selected_ops():
            for dtype_name in self.settings.dtypes:
                for kind, shape in self.cases(op):
                    self._run_case(op, DTYPES[dtype_name], kind, shape)
        return self.records

    def _run_case(self, op: BenchOp, dtype: torch.dtype, kind: str, shape: dict):
        names = self.providers(op)
        modes = self.settings.modes
        label = f"{op.name} {dtype_name(dtype)} " + " ".join(f"{k}={v}" for k, v in shape.items())
        try:
            case = Case(op, shape, dtype, self.device, grads=any(m != "fwd" for m in modes))
        except torch.cuda.OutOfMemoryError:
            case = None
        if case is None:  # outside the except block, so its traceback no longer holds tensors
            free_memory()
            self.log(f"skipped {label}: out of GPU memory for the inputs and float64 reference")
            self.progress(len(names))
            return
        for name in names:
            self._run_provider(case, kind, name, label)
            self.progress(1)
        del case
        free_memory()

    def _run_provider(self, case: Case, kind: str, name: str, label: str):
        op = case.op
        provider = op.providers[name]
        key = (op.name, name)
        if key in self.skipped:
            return
        try:
            fn = provider.factory()
            if provider.gpu_only and not self.timing:
                raise Unavailable("needs a CUDA GPU (its kernels do not run under Triton's interpreter)")
        except Unavailable as exc:
            self.skipped[key] = str(exc)
            return
        checks = {}
        for mode in self.settings.modes:
            if mode != "fwd" and not provider.backward:
                continue
            if not self.timing and mode == "fwd+bwd" and "bwd" in self.settings.modes:
                continue  # without timing, fwd+bwd would repeat the bwd check
            if kind == "eager" and mode not in EAGER_MODES:
                continue
            if mode == "bwd" and not provider.repeats_backward and self.timing:
                # Its forward forms the gradient: the backward alone has nothing to time.
                self.records.append(dict(self._record(case, kind, name, mode), status=NOT_TIMED_ALONE))
                continue
            grads = mode != "fwd"
            record = self._record(case, kind, name, mode)
            try:
                if grads not in checks:
                    checks[grads] = case.check(fn, grads, provider.mutates)
                errors = checks[grads]
                worst = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
                record.update(errors={k: _finite(v) for k, v in errors.items()},
                              rel_err=_finite(errors[worst]), tol=TOL[case.dtype])
                if not errors[worst] <= TOL[case.dtype]:  # NaN fails too
                    record["status"] = "failed"
                    self.log(f"FAILED check: {name} {mode} {label}: {worst} rel err {errors[worst]:.2e} "
                             f"> {TOL[case.dtype]:.0e}; not timed")
                elif self.timing:
                    if kind in ("decode", "eager"):
                        timed = case.timed(fn, mode, provider.mutates)
                        self._timed(record, _latency_ms(timed) if kind == "decode" else
                                    _latency_ms(timed, EAGER_CALLS, EAGER_REPEATS))
                        del timed
                    else:
                        self._timed(record, self._bandwidth_ms(case, fn, mode, provider.mutates, record, label))
                    if kind == "decode":
                        graph_record = dict(record, kind="decode_graph")
                        self.records.append(graph_record)
                        try:
                            self._timed(graph_record, graph_latency_ms(lambda: case.timed(fn, mode, provider.mutates)))
                        except Exception as exc:  # a provider that cannot be captured is reported
                            graph_record.update(status="error", ms=None, us=None, gbps=None, pct_copy=None,
                                                note=f"CUDA graph capture: {_short(exc)}")
                            self.log(f"error: {name} {mode} {label} (CUDA graph): {graph_record['note']}")
                else:
                    record["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                record.update(status="oom", note="out of GPU memory")
            except Exception as exc:  # a provider that breaks is reported, not fatal
                record.update(status="error", note=_short(exc))
            if record["status"] in ("oom", "error"):
                self.log(f"{record['status']}: {name} {mode} {label}: {record['note']}")
                free_memory()
            self.records.append(record)

    def notes(self) -> list:
        """What did not run, one line a provider: those skipped here (not installed, no GPU), and
        those whose backward alone was not timed."""
        lines = []
        skipped = {}
        for (op, provider), reason in self.skipped.items():
            skipped.setdefault((provider, reason), []).append(op)
        for (provider, reason), op_names in skipped.items():
            lines.append(f"skipped {provider} ({', '.join(op_names)}): {reason}")
        alone = {}  # provider -> its ops, in order
        for r in self.records:
            if r["status"] == NOT_TIMED_ALONE:
                alone.setdefault(r["provider"], {})[r["op"]] = None
        for provider, op_names in alone.items():
            lines.append(f"bwd of {provider} ({', '.join(op_names)}) not timed alone: {NOT_TIMED_ALONE_WHY}")
        return lines

    def _bandwidth_ms(self, case: Case, fn, mode: str, mutates: bool, record: dict, label: str) -> float:
        """A bandwidth case's time: replayed from a CUDA graph, or as plain calls (noted) for a
        provider that cannot be captured (after its first failure, not tried again)."""
        key = (case.op.name, record["provider"])
        if key not in self.uncapturable:
            try:
                ms = graph_bench_ms(lambda: case.timed(fn, mode, mutates))
                record["timing"] = "cuda_graph"
                return ms
            except Exception as exc:
                self.uncapturable[key] = _short(exc)
                free_memory()
        record.update(timing="plain_calls", note=f"timed as plain calls: CUDA graph capture: {self.uncapturable[key]}")
        self.log(f"{record['provider']} {mode} {label}: {record['note']}")
        timed = case.timed(fn, mode, mutates)
        return _bench_ms(timed)

    def _timed(self, record: dict, ms: float) -> None:
        gbps = record["bytes"] / ms / 1e6
        record.update(status="ok", ms=ms, us=ms * 1e3, gbps=gbps, pct_copy=100 * gbps / self.copy_gbps)

    def _record(self, case: Case, kind: str, provider: str, mode: str) -> dict:
        return {"op": case.op.name, "kind": kind, "mode": mode, "provider": provider,
                "dtype": dtype_name(case.dtype), **case.shape, "shape": dict(case.shape),
                "size": case.shape[case.op.axis], "axis": case.op.axis,
                "bytes": case.op.min_bytes(case.shape, case.dtype, mode),
                "status": None, "timing": None, "ms": None, "us": None, "gbps": None, "pct_copy": None,
                "copy_gbps": self.copy_gbps, "rel_err": None, "errors": {}, "tol": None, "note": None,
                **self.env}


class OpRunner(Runner):
    """The runner over one op given here (not looked up by name): a script's own providers."""

    def __init__(self, op: BenchOp, settings: Settings, device: torch.device, log):
        super().__init__(settings, device, log)
        self.op = op

    def selected_ops(self) -> list:
        return [self.op]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _finite(x: float):
    """JSON has no NaN/inf: report them as strings."""
    return x if math.isfinite(x) else str(x)

