"""Host µs per call of the paths llmkernels takes instead of public ones: what each private API
or hand-made path saves, measured (ARCHITECTURE.md, "Private PyTorch and Triton APIs").

    python benchmarks/host_paths.py                 # CPU rows (any machine); GPU rows where CUDA is
    python benchmarks/host_paths.py --out FILE.json

Rows (the best of 30 loops of 200 calls each, a tiny tensor, so that only the host path counts):

  - registration: an op registered with ``torch.library.custom_op`` + ``register_autograd`` beside
    the same op as an ``ops._register.Op``, called eagerly without and with a gradient;
  - autograd's C++ apply (``torch._C._are_functorch_transforms_active`` guards it) beside
    ``Function.apply``;
  - GPU only: the current stream's raw handle (``torch._C._cuda_getCurrentRawStream``) beside
    ``torch.cuda.current_stream(device).cuda_stream``, and a launch through ``Launcher`` (a
    compiled kernel's own launcher, Triton's internal argument order) beside ``kernel[grid]``.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import NamedTuple

import torch

from llmkernels.ops import _launch
from llmkernels.ops._register import Op


class Scale(NamedTuple):
    factor: float


def _scale(x: torch.Tensor, options: Scale) -> torch.Tensor:
    return x.mul(options.factor)


def _scale_backward(ctx, bwd, dy):
    return (bwd(dy, ctx.options),)


OURS = Op("host_paths_scale", forward=_scale, backward=_scale_backward, grad_inputs=(0,),
          fake=lambda x, options: torch.empty_like(x))


@torch.library.custom_op("host_paths::scale", mutates_args=())
def theirs(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x.mul(factor)


theirs.register_fake(lambda x, factor: torch.empty_like(x))
theirs.register_autograd(lambda ctx, dy: (theirs(dy, ctx.factor), None),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]))


def best_us(call, calls: int = 200, loops: int = 30) -> float:
    for _ in range(50):
        call()
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def cpu_rows() -> dict:
    x, xg, options = torch.randn(4), torch.randn(4, requires_grad=True), Scale(2.0)
    rows = {"custom_op, no gradient": lambda: theirs(x, 2.0), "Op, no gradient": lambda: OURS(x, options),
            "custom_op, with a gradient": lambda: theirs(xg, 2.0), "Op, with a gradient": lambda: OURS(xg, options)}
    out = {name: best_us(call) for name, call in rows.items()}
    c_apply, OURS._c_apply = OURS._c_apply, None
    out["Op, with a gradient, Function.apply"] = best_us(lambda: OURS(xg, options))
    OURS._c_apply = c_apply
    return out


def gpu_rows() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(16, device="cuda")
    handle = _launch.launcher_of(add_one, BLOCK=16, num_warps=1)
    handle((1,), x, 16)
    out = {"stream: torch.cuda.current_stream().cuda_stream": best_us(lambda: torch.cuda.current_stream(0).cuda_stream),
           "stream: torch._C._cuda_getCurrentRawStream": best_us(lambda: torch._C._cuda_getCurrentRawStream(0)),
           "launch: kernel[grid]": best_us(lambda: add_one[(1,)](x, 16, BLOCK=16, num_warps=1)),
           "launch: Launcher (direct)": best_us(lambda: handle((1,), x, 16))}
    torch.cuda.synchronize()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = cpu_rows()
    if torch.cuda.is_available() and not _launch.INTERPRET:
        rows.update(gpu_rows())
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{where}; torch {torch.__version__}; host µs per call (best of 30 loops of 200 calls)")
    for name, us in rows.items():
        print(f"  {name:55s} {us:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "us": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
