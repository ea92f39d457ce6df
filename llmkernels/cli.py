"""The ``llmkernels`` command: ``env``, ``bench``, ``tune``, ``fuzz``, ``scaling``, ``--version``.

torch is imported by the commands that need it, not here: ``--help`` and ``--version`` answer at
once.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

from . import __version__

USAGE = """usage: llmkernels [-h] [--version] <command> [options]

Fused Triton kernels for training transformers.

commands:
  env       what llmkernels runs on: GPU and its memory bandwidth, CUDA, torch, triton,
            transformers, whether Triton's interpreter is on, which peers are installed.
  bench     check every op against its float64 reference, then time it (GB/s, % of the GPU's
            copy bandwidth, decode latency) beside every installed peer; writes JSON, Markdown
            and plots to a new folder per run. Without a GPU: the check only, through Triton's
            interpreter on the CPU.
  tune      measure this GPU's best launch configurations and write them to a per-user cache
            that llmkernels reads on this GPU (resumable; --tiny: a check on the CPU).
  fuzz      check every op against its float64 reference on random shapes, dtypes, layouts,
            options and execution contexts.
  scaling   compute-optimal scaling-law experiments trained with the kernels (extra `scaling`).

options:
  -h, --help  show this message and exit
  --version   print llmkernels' version and exit

`llmkernels <command> --help` lists each command's options."""

ENV_USAGE = """usage: llmkernels env [-h]

Print what llmkernels runs on: llmkernels, Python, torch and its CUDA, triton, whether Triton's
interpreter is active (TRITON_INTERPRET=1), each GPU with its memory bandwidth (theoretical,
from the memory clock and bus width, and a 256 MiB device-to-device copy timed on the spot) and
where its launch configurations come from (a tuned cache's path, or the derived heuristic),
transformers, and the peers the benchmark compares with (quack-kernels, liger-kernel,
cut-cross-entropy) with their versions."""

# Distributions reported by `llmkernels env`: the peers `llmkernels bench` times, then the
# integrations.
PEERS = ("quack-kernels", "liger-kernel", "cut-cross-entropy")
INTEGRATIONS = ("transformers", "trl", "kernels")


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_lines(torch) -> list:
    if not torch.cuda.is_available():
        return ["GPU           none (CPU tensors run through Triton's interpreter when TRITON_INTERPRET=1, "
                "else the plain-PyTorch reference)", "configs       heuristic (the interpreter's: the H100's tables)"]
    from .bench.runner import copy_bandwidth
    from .ops import _device

    lines = []
    for index in range(torch.cuda.device_count()):
        props = _device.properties(index)
        line = (f"GPU {index}         {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                f"{props.total_memory / 2**30:.1f} GiB")
        peak = _device.clock_gbps(index)
        try:
            copy = f"{copy_bandwidth(torch.device('cuda', index)):.0f} GB/s device-to-device copy"
        except Exception as exc:  # out of memory, a busy device: the rest of the report still helps
            copy = f"copy not measured ({type(exc).__name__})"
        line += f"\n              memory bandwidth: {f'{peak:.0f} GB/s theoretical, ' if peak else ''}{copy}"
        lines.append(line + "\n" + _configs_line(index))
    return lines


def _configs_line(index: int) -> str:
    """Where device ``index``'s launch configurations come from: a tuned cache or the heuristic
    derived from the device model (with its depth and the copy bandwidth it assumes)."""
    from .ops import _device

    model, tuned = _device.device_model(index), _device.tuned(index)
    hidden = " (tuned caches hidden: LLMKERNELS_TUNED=0)" if _device.tuned_caches_off() else ""
    return (f"              configs: {tuned.source}{hidden}; heuristic at depth {model.depth} "
            f"(copy {model.copy_gbps:.0f} GB/s, {model.copy_source}; {model.in_flight_per_sm} B in flight an SM)")


def _cache_line() -> str:
    from .ops import _device

    return (f"tuned cache   {_device.cache_dir()} (written by `llmkernels tune`; "
            f"{_device.CACHE_DIR_VARIABLE}=DIR moves it)")


def env() -> str:
    """The ``llmkernels env`` report."""
    import platform

    import torch

    triton = _version("triton")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    lines = [f"llmkernels    {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
             f"python        {platform.python_version()} ({platform.system()} {platform.machine()})",
             f"torch         {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}",
             f"triton        {triton or 'not installed: every op takes the plain-PyTorch path'}",
             f"interpreter   {'on' if interpret else 'off'} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')})",
             *_gpu_lines(torch), _cache_line()]
    for group, dists in (("integrations", INTEGRATIONS), ("peers", PEERS)):
        found = ", ".join(f"{d} {_version(d) or 'not installed'}" for d in dists)
        lines.append(f"{group:<13} {found}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command == "--version":
        print(f"llmkernels {__version__}")
        return 0
    if command == "env":
        if rest:
            print(ENV_USAGE, file=sys.stdout if rest[0] in ("-h", "--help") else sys.stderr)
            return 0 if rest[0] in ("-h", "--help") else 2
        print(env())
        return 0
    if command == "bench":
        from .bench import main as run
    elif command == "tune":
        from .tune import main as run
    elif command == "scaling":
        from .scaling import main as run
    elif command == "fuzz":
        from .fuzz import main as run
    else:
        print(f"llmkernels: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
