"""GPU throughput of the scaling sweep's training step: kernels vs reference backend, captured vs eager.

For each model shape and batch: the sweep's own step (``llmkernels.scaling.train.Stepper``: batch
gather, forward, backward, clip, fused AdamW, one CUDA graph) on random tokens, timed over
``--steps`` replays after its warm-up; milliseconds a step, tokens/s, model TFLOP/s (total
parameters, head and attention included: ``plan.ModelConfig.flops_per_token``) and MFU against the
bf16 dense peak. Then, from one initialisation, one bf16 step's loss and gradients on both backends
(relative differences). Prints a table; writes ``$OUT/scaling_check.json`` when OUT is set.

``--at-once 1,3,6``: the sweep's own regime instead (``--runs-per-device``): K runs of a shape, each
its own model, graph and CUDA stream, their steps replayed side by side; the tokens/s of all K
together (wall time over the replays, the GPU synchronised at both ends) and per run, so that the
gain of running several at once is measured per shape rather than assumed.

``--attention cudnn`` (or ``flash``, ``efficient``): every run held to that backend of
``F.scaled_dot_product_attention`` instead of PyTorch's choice (the sweep's), so that the step's
MFU can be compared across attention kernels; a backend that cannot take the model's inputs fails
loudly.

``--fused-qk-rope``: the model with its QK-norm and rotation in one kernel (``qk_norm_rope``);
``--bf16-residual``: its residual stream in bfloat16; each to compare its step with the sweep's.

``--profile``: where a step's GPU time goes instead, for each shape and batch: the kernels of a few
eager steps of the kernels backend (the same kernels the graph replays) under ``torch.profiler``,
summed by family (matrix products, attention, norms, RoPE, SwiGLU, head + loss, optimizer and
clip, casts and copies, the rest) and the ten costliest kernels; ``$OUT/scaling_profile.json``.

    python benchmarks/scaling_check.py                          # the default shapes and batches
    python benchmarks/scaling_check.py --shapes 8x512 --batches 256 --vocab 8192 --seq-len 256
    python benchmarks/scaling_check.py --profile --shapes 4x256,6x384 --batches 64,256
    python benchmarks/scaling_check.py --at-once 1,3,6 --shapes 7x128,5x192,10x384 --batches 64
    python benchmarks/scaling_check.py --shapes 8x320,10x384 --batches 64 --eager "" --attention cudnn
    python benchmarks/scaling_check.py --shapes 10x384 --batches 64 --eager "" --fused-qk-rope
    python benchmarks/scaling_check.py --shapes 10x384 --batches 64 --eager "" --bf16-residual
"""
import argparse
import contextlib
import json
import os
import re
import time

import torch

from llmkernels.scaling.design import add_model_switches, model_switches
from llmkernels.scaling.model import GPT
from llmkernels.scaling.plan import BYTE_VOCAB, SEQ_LEN, ModelConfig, parse_ladder, peak_flops
from llmkernels.scaling.train import Stepper, TrainConfig, autocast_for, set_deterministic

# --attention: the SDPBackend each name holds the runs to (None: PyTorch's own choice)
ATTENTION = {"default": None, "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION"}


def attention_backend(name: str):
    """A context that holds ``F.scaled_dot_product_attention`` to the backend ``name`` (of ``ATTENTION``)."""
    if ATTENTION[name] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, ATTENTION[name])])


def _header(args, name: str) -> dict:
    """What every JSON this script writes says of the run: card, torch, the model's and kernels' switches."""
    return {"device": name, "torch": torch.__version__, **model_switches(args),
            "deterministic": not args.nondeterministic, "attention": args.attention}


def model_config(args, layers: int, width: int) -> ModelConfig:
    """The shape ``layers x width`` with the command line's vocabulary, sequence and model switches."""
    return ModelConfig(args.vocab, layers, width, seq_len=args.seq_len, **model_switches(args))


def make_stepper(cfg: ModelConfig, batch: int, steps: int, tokens: torch.Tensor, *, backend: str = "kernels",
                 capture: bool = True, seed: int = 0, beside_others: bool = False) -> Stepper:
    """The sweep's training step for ``steps`` steps of a fresh ``cfg`` (initialised from ``seed``), in bf16."""
    torch.manual_seed(seed)
    model = GPT(cfg, backend, compute_dtype=torch.bfloat16).cuda()
    dev = torch.device("cuda")
    return Stepper(model, TrainConfig(steps=steps, batch_size=batch, lr=1e-3, warmup_steps=1, seed=seed), tokens,
                   device=dev, amp=autocast_for(dev, torch.bfloat16), capture=capture, beside_others=beside_others)


def time_step(cfg: ModelConfig, batch: int, backend: str, capture: bool, steps: int, tokens: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    stepper = make_stepper(cfg, batch, steps + 1, tokens, backend=backend, capture=capture)
    setup = time.perf_counter() - t0
    stepper.advance(1)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    stepper.advance(steps)
    end.record()
    end.synchronize()
    loss = stepper.take_loss(steps + 1)
    ms = start.elapsed_time(end) / steps
    tok_s = batch * cfg.seq_len / ms * 1e3
    flops = tok_s * cfg.flops_per_token()
    peak = peak_flops(torch.cuda.get_device_name())
    return {"shape": cfg.name, "vocab": cfg.vocab_size, "seq_len": cfg.seq_len, "params": cfg.total_params(),
            "non_embedding_params": cfg.non_embedding_params(), "batch": batch, "backend": backend,
            "captured": stepper.graph is not None, "ms_per_step": ms, "tokens_per_s": tok_s, "tflops": flops / 1e12,
            "mfu": None if peak is None else flops / peak, "setup_s": setup, "loss": loss}


def time_at_once(cfg: ModelConfig, batch: int, runs: int, steps: int, tokens: torch.Tensor) -> dict:
    """``runs`` captured runs of ``cfg`` on a stream each, their steps replayed side by side."""
    streams, steppers = [torch.cuda.Stream() for _ in range(runs)], []
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            steppers.append(make_stepper(cfg, batch, steps + 1, tokens, seed=i, beside_others=runs > 1))
            steppers[-1].advance(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        for stream, stepper in zip(streams, steppers):
            with torch.cuda.stream(stream):
                stepper.advance(1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tok_s = runs * steps * batch * cfg.seq_len / seconds
    peak = peak_flops(torch.cuda.get_device_name())
    return {"shape": cfg.name, "params": cfg.total_params(), "batch": batch, "at_once": runs,
            "ms_per_step_each": seconds / steps * 1e3, "tokens_per_s": tok_s, "tokens_per_s_each": tok_s / runs,
            "mfu": None if peak is None else tok_s * cfg.flops_per_token() / peak}


def at_once_main(args, name: str, tokens: torch.Tensor):
    rows = []
    for layers, width in parse_ladder(args.shapes):
        cfg = model_config(args, layers, width)
        for batch in (int(b) for b in args.batches.split(",")):
            for runs in (int(k) for k in args.at_once.split(",")):
                rows.append(time_at_once(cfg, batch, runs, args.steps, tokens))
                print(rows[-1], flush=True)
    print(f"\n{'shape':<9}{'N total':>12}{'batch':>6}{'at once':>8}{'ms/step each':>13}{'tok/s all':>13}"
          f"{'tok/s each':>12}{'MFU all':>8}{'vs one':>7}")
    alone = {(r["shape"], r["batch"]): r["tokens_per_s"] for r in rows if r["at_once"] == 1}
    for r in rows:
        gain = r["tokens_per_s"] / alone[(r["shape"], r["batch"])] if (r["shape"], r["batch"]) in alone else None
        print(f"{r['shape']:<9}{r['params']:>12,}{r['batch']:>6}{r['at_once']:>8}{r['ms_per_step_each']:>13.2f}"
              f"{r['tokens_per_s']:>13,.0f}{r['tokens_per_s_each']:>12,.0f}{(r['mfu'] or 0):>8.1%}"
              + (f"{gain:>6.2f}x" if gain else ""))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_at_once.json"), "w") as f:
            json.dump({**_header(args, name), "rows": rows}, f, indent=1)


# Kernel families by name (first match): FlashAttention (before the products: its names carry
# CUTLASS types), cuBLAS / CUTLASS products, llmkernels' Triton kernels by their function names,
# the fused AdamW and the clip's norms, elementwise copies and casts.
FAMILIES = (("attention", r"flash|fmha|attention"), ("matmul", r"gemm|cutlass|xmma|nvjet|sm\d+_.*(mma|tensorop)"),
            ("qk-norm + rope", r"qk_norm_rope"), ("norm", r"norm_(fwd|bwd)|sum_partials"), ("rope", r"rope"),
            ("glu", r"glu"),
            ("head + loss", r"(^|_)ce_|finish_kernel|scale_rows"), ("embedding", r"embedding|grad_weight|sort"),
            ("optimizer + clip", r"adam|multi_tensor|foreach|lpnorm|reduce_kernel"),
            ("elementwise (copies, casts, fills)", r"copy|cast|elementwise|vectorized|unrolled|index|gather|fill"))


def family(kernel: str) -> str:
    return next((name for name, pattern in FAMILIES if re.search(pattern, kernel, re.I)), "other")


def profile_step(cfg: ModelConfig, batch: int, steps: int, tokens: torch.Tensor) -> dict:
    """GPU time of ``steps`` eager steps of the kernels backend, by kernel family and by kernel."""
    from torch.profiler import ProfilerActivity, profile
    stepper = make_stepper(cfg, batch, steps + 2, tokens, capture=False)
    stepper.advance(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stepper.advance(steps)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3 / steps  # ms a step
    total = sum(kernels.values())
    by_family = {}
    for name, ms in kernels.items():
        by_family[family(name)] = by_family.get(family(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"shape": cfg.name, "params": cfg.total_params(), "batch": batch, "gpu_ms_per_step": total,
            "families": {k: {"ms": v, "share": v / total} for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:120], "ms": v, "share": v / total, "family": family(k)} for k, v in top]}


def agreement(cfg: ModelConfig, batch: int) -> dict:
    """One bf16 step from the same init on both backends: loss and the largest gradient difference."""
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device="cuda")
    losses, grads = {}, {}
    for backend in ("kernels", "reference"):
        torch.manual_seed(0)
        model = GPT(cfg, backend, compute_dtype=torch.bfloat16).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        losses[backend] = loss.item()
        grads[backend] = [p.grad.float() for p in model.parameters()]
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads["kernels"], grads["reference"]))
    return {"shape": cfg.name, "loss_kernels": losses["kernels"], "loss_reference": losses["reference"],
            "max_grad_rel_err": err}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4x128,4x256,6x384,8x512,9x640", help="LAYERSxWIDTH,... (default: %(default)s)")
    p.add_argument("--batches", default="64,256", help="sequences a step (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=BYTE_VOCAB, help="vocabulary (default: %(default)s, the byte sweep's)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (default: %(default)s)")
    p.add_argument("--eager", default="4x256,8x512", help="shapes also timed without the CUDA graph (kernels backend)")
    p.add_argument("--profile", action="store_true", help="the GPU time of a step by kernel family instead (see above)")
    p.add_argument("--at-once", metavar="K,...", default=None,
                   help="tokens/s of K runs of each shape side by side instead, each K listed (see above)")
    add_model_switches(p)  # the sweep's flags: its model unless told otherwise
    p.add_argument("--nondeterministic", action="store_true",
                   help="PyTorch's default kernels (the sweep trains with deterministic ones unless told otherwise)")
    p.add_argument("--attention", choices=list(ATTENTION), default="default",
                   help="hold attention to this SDPA backend (default: PyTorch's choice, as the sweep)")
    args = p.parse_args()
    with attention_backend(args.attention):
        return run(args)


def run(args):
    set_deterministic(not args.nondeterministic)
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}")
    tokens = torch.randint(0, min(args.vocab, 256), (1 << 24,), device="cuda", dtype=torch.int16)
    if args.profile:
        return profile_main(args, name, tokens)
    if args.at_once:
        return at_once_main(args, name, tokens)
    eager = set(parse_ladder(args.eager)) if args.eager else set()
    rows = []
    for layers, width in parse_ladder(args.shapes):
        cfg = model_config(args, layers, width)
        for batch in (int(b) for b in args.batches.split(",")):
            for backend in ("kernels", "reference"):
                rows.append(time_step(cfg, batch, backend, True, args.steps, tokens))
                print(rows[-1], flush=True)
            if (layers, width) in eager:
                rows.append(time_step(cfg, batch, "kernels", False, args.steps, tokens))
                print(rows[-1], flush=True)
    checks = [agreement(model_config(args, layers, width), 8)
              for layers, width in parse_ladder(args.shapes)[:2]]
    print(f"\n{'shape':<9}{'N total':>12}{'N non-emb':>12}{'batch':>6}{'backend':>10}{'graph':>6}{'ms/step':>9}"
          f"{'tok/s':>12}{'TFLOP/s':>9}{'MFU':>7}")
    for r in rows:
        print(f"{r['shape']:<9}{r['params']:>12,}{r['non_embedding_params']:>12,}{r['batch']:>6}{r['backend']:>10}"
              f"{'yes' if r['captured'] else 'no':>6}{r['ms_per_step']:>9.2f}{r['tokens_per_s']:>12,.0f}"
              f"{r['tflops']:>9.1f}{(r['mfu'] or 0):>7.1%}")
    speed = {}
    for r in rows:
        if r["captured"]:
            speed.setdefault((r["shape"], r["batch"]), {})[r["backend"]] = r["ms_per_step"]
    for (shape, batch), ms in speed.items():
        print(f"{shape} batch {batch}: kernels {ms['reference'] / ms['kernels']:.2f}x the reference under the graph")
    for c in checks:
        print(f"{c['shape']}: one bf16 step, loss {c['loss_kernels']:.5f} vs {c['loss_reference']:.5f}, "
              f"largest gradient difference {c['max_grad_rel_err']:.2e} (relative)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_check.json"), "w") as f:
            json.dump({**_header(args, name), "rows": rows, "agreement": checks}, f, indent=1)


def profile_main(args, name: str, tokens: torch.Tensor):
    rows = [profile_step(model_config(args, layers, width), int(batch),
                         min(args.steps, 10), tokens)
            for layers, width in parse_ladder(args.shapes) for batch in args.batches.split(",")]
    for r in rows:
        print(f"\n{r['shape']} ({r['params'] / 1e6:.1f}M), batch {r['batch']}: {r['gpu_ms_per_step']:.2f} ms of GPU a step")
        print("  " + ", ".join(f"{k} {v['share']:.0%}" for k, v in r["families"].items()))
        for k in r["top"]:
            print(f"  {k['ms']:8.3f} ms {k['share']:6.1%}  {k['family']:<16} {k['kernel']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_profile.json"), "w") as f:
            json.dump({**_header(args, name), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
