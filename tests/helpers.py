"""Helpers shared by the test modules: comparisons, peak memory, bad-input tests, a runner of
several ranks."""
import importlib
import os
import sys

import pytest
import torch

# ||out - ref|| / ||ref|| bounds per dtype of the tensor under test (outputs and gradients).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor): ``floor`` keeps a reference that is zero up to
    rounding (e.g. dx of a 1-element RMSNorm) from turning noise into a large relative error."""
    out, ref = out.double().cpu(), ref.double().cpu()
    denom = max(ref.norm().item(), floor)
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str, scale: float = 1.0,
                 floor: float = 0.0):
    """Relative-norm check at the tolerance of ``dtype`` (times ``scale``), plus NaN/inf and
    shape checks; max-abs error is reported on failure."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values (an unwritten or poisoned output?)"
    err = rel_err(out, ref, floor)
    tol = REL_TOL[dtype] * scale
    max_abs = (out.double().cpu() - ref.double().cpu()).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.1e} (max abs {max_abs:.3e})"


def exception_chain(error: BaseException) -> str:
    """The messages of an exception and of those it was raised from or during: on the GPU, Triton's
    compiler reports a ``static_assert`` in the error of the call that led to it, not at the top."""
    messages = []
    while error is not None and len(messages) < 16:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(messages)


def cuda_peak_bytes(run, leaves=()) -> int:
    """Peak bytes that ``run()`` allocates above what was allocated before it, measured on a
    second call (the first compiles kernels and sets up cuBLAS's workspace); the gradients of
    ``leaves`` are cleared in between."""
    run()
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bad_input_test(cases):
    """The test that each of ``cases()``, ``(message, error, call)``, raises ``error`` matching
    ``message`` (one case a test; ``cases`` is called at collection and again in the test, so that
    each test makes fresh inputs)."""
    @pytest.mark.parametrize("case", range(len(cases())))
    def test_bad_input(case):
        match, exc, call = cases()[case]
        with pytest.raises(exc, match=match):
            call()
    return test_bad_input


RANKS = int(os.environ.get("LLMKERNELS_TEST_RANKS", "2"))  # 4: the several-process tests on 4 GPUs


def run_ranks(fn, *args, world: int = RANKS):
    """``fn(rank, world, device, *args)`` in ``world`` processes joined by the default process
    group: NCCL over GPUs where there are ``world`` of them, else gloo on the CPU. ``fn`` must be
    a module-level function; an exception in a rank fails the caller with that rank's traceback."""
    import tempfile
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "rendezvous"), fn, args), nprocs=world)


def _rank_main(rank: int, world: int, path: str, fn, args):
    import torch.distributed as dist

    cuda = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # two ranks on a shared CPU
    torch.manual_seed(1234)  # every rank the same modules, as the tests' own seed
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fn(rank, world, device, *args)
    dist.barrier()
    # Tearing gloo down intermittently aborts a rank after its work is done (as in
    # benchmarks/e2e_train.exit_distributed): a rank that passed leaves at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def benchmark_script(name: str):
    """The module of ``benchmarks/<name>.py`` (the scripts are no package), with ``benchmarks/``
    on the path as when a script runs, so that it imports its siblings."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)
