"""GPU check of the scaling-experiment model: kernels vs reference backend on CUDA.

For a few sizes of the default sweep: loss and gradients of one bf16-autocast step from the same
init (relative differences), then milliseconds per training step (AdamW, clip, random tokens) for
each backend after warm-up. Prints a table; writes JSON to ``$OUT/scaling_check.json`` when OUT is
set. ``--profile``: also the top CUDA kernels of three steps of the largest size, per backend.
``python benchmarks/scaling_check.py [--profile]``.
"""
import json
import os
import sys
import time

import torch
import triton

from llmkernels.scaling.model import GPT, ModelConfig, backend_ops

SIZES = [(2, 48, 2, 16), (3, 128, 4, 64), (4, 224, 7, 256)]  # layers, width, heads, batch (default plan)
VOCAB, SEQ = 8192, 256


def step_fn(model, opt):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def main():
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} ops {backend_ops('kernels')}")
    rows = []
    for layers, width, heads, batch in SIZES:
        cfg = ModelConfig(vocab_size=VOCAB, n_layers=layers, width=width, n_heads=heads, seq_len=SEQ)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g).to(dev)
        models, losses = {}, {}
        for backend in ("kernels", "reference"):
            torch.manual_seed(0)
            models[backend] = GPT(cfg, backend, compute_dtype=torch.bfloat16).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses[backend] = models[backend](x[:, :-1], x[:, 1:])
            losses[backend].float().backward()
        grad_err = max(((pk.grad - pr.grad).norm() / pr.grad.norm()).item()
                       for pk, pr in zip(models["kernels"].parameters(), models["reference"].parameters()))
        row = {"size": cfg.name, "params": cfg.non_embedding_params(), "batch": batch,
               "loss_kernels": losses["kernels"].item(), "loss_reference": losses["reference"].item(),
               "max_grad_rel_err": grad_err}
        for backend, model in models.items():
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            step = step_fn(model, opt)
            for _ in range(5):
                step(x[:, :-1], x[:, 1:])
            torch.cuda.synchronize()
            t = time.perf_counter()
            n = 30
            for _ in range(n):
                loss = step(x[:, :-1], x[:, 1:])
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / n * 1e3
            row[f"ms_{backend}"] = ms
            row[f"tok_s_{backend}"] = batch * SEQ / ms * 1e3
            assert torch.isfinite(loss), (cfg.name, backend)
        row["speedup"] = row["ms_reference"] / row["ms_kernels"]
        rows.append(row)
        if "--profile" in sys.argv and (layers, width, heads, batch) == SIZES[-1]:
            for backend, model in models.items():
                step = step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step(x[:, :-1], x[:, 1:])
                    torch.cuda.synchronize()
                print(f"--- {cfg.name} {backend}: 3 steps")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(f"{'size':<12}{'N':>10}{'batch':>6}{'loss k':>9}{'loss r':>9}{'grad err':>10}{'ms k':>8}{'ms r':>8}{'speedup':>9}")
    for r in rows:
        print(f"{r['size']:<12}{r['params']:>10,}{r['batch']:>6}{r['loss_kernels']:>9.4f}{r['loss_reference']:>9.4f}"
              f"{r['max_grad_rel_err']:>10.2e}{r['ms_kernels']:>8.2f}{r['ms_reference']:>8.2f}{r['speedup']:>8.2f}x")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_check.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
