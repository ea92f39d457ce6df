"""Expert LoRA (r = 16 on every expert's gate/up and down projections, base weights frozen) on a
small random-init Qwen3-MoE, 20 AdamW steps in bf16, in one process on one GPU: transformers +
PEFT (``LoraConfig(target_parameters=[...experts...])``, transformers' default grouped-mm
experts) against llmkernels (``patch`` + ``add_expert_lora``, the adapters in the grouped
kernels), from the same weights and the same adapters (PEFT's initialisation, loaded into ours
through PEFT's format). Reports tokens/s (steps after the first three), the peak memory of the
training loop and the losses of every step.

    python benchmarks/moe_lora_bench.py            # GPU
    python benchmarks/moe_lora_bench.py --compile  # GPU, also both under torch.compile (an error is a row)
    python benchmarks/moe_lora_bench.py --tiny     # CPU (Triton's interpreter): a tiny model, 3 steps

Writes ``moe_lora_bench.json`` and ``.md`` under ``--out`` (default ``$OUT``, else
``./moe-lora-bench``). Without PEFT installed its run is recorded as unavailable.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import date

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import llmkernels  # noqa: E402
from e2e_train import training_step  # noqa: E402
from profiling import write_profile  # noqa: E402

RANK, ALPHA, TARGETS = 16, 32, ["experts.gate_up_proj", "experts.down_proj"]
# About 0.9B parameters (0.8B in the experts): 8 layers of 64 experts, top-8, H 1024, I 512.
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
             num_experts_per_tok=8, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001,
             max_position_embeddings=4096)
TINY = dict(MODEL, vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)
WARMUP = 3
PROFILE_STEPS = 3


def batches(steps: int, batch: int, seq: int, vocab: int, device) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(steps)]


def profile(model, data: list, device, path: str) -> None:
    """A few more steps' profile (``profiling.write_profile``) with an optimizer of its own."""
    step = training_step(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    write_profile(lambda: [step(ids) for ids in data[:PROFILE_STEPS]], device, path)


def train(model, data: list, device) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    losses, host, start = [], [], None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for step, ids in enumerate(data):
        if step == WARMUP:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        queued = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host.append(time.perf_counter() - queued)  # the host's time to queue the step, before .item() waits
        losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = len(data) - WARMUP
    seconds = time.perf_counter() - start if start is not None else float("nan")
    record = {"losses": losses, "trainable_params": sum(p.numel() for p in params),
              "tokens_per_s": timed * data[0].numel() / seconds if timed > 0 else None,
              "step_ms": 1e3 * seconds / timed if timed > 0 else None,
              "host_ms": 1e3 * statistics.median(host[WARMUP:]) if timed > 0 else None}
    if device.type == "cuda":
        record["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return record


def compiled_run(model, data: list, device) -> dict:
    """``train`` of ``torch.compile(model)``, or the error that stopped it (recorded, not raised:
    the eager runs beside it stand)."""
    try:
        return {"status": "ok", **train(torch.compile(model), data, device)}
    except Exception as e:  # noqa: BLE001 - a peer that does not compile is a row of the table
        return {"status": f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default=os.environ.get("OUT") or "moe-lora-bench")
    parser.add_argument("--profile", action="store_true",
                        help="after each run, profile a few more steps into moe_lora_profile_<run>.txt")
    parser.add_argument("--compile", action="store_true",
                        help="also run transformers + PEFT and llmkernels under torch.compile (GPU; the first "
                             "steps, compilation included, are not timed)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    tiny = device.type == "cpu"
    steps = args.steps or (WARMUP + 1 if tiny else 20)
    batch, seq = (2, 16) if tiny else (args.batch, args.seq)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**(TINY if tiny else MODEL))
    base = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16)
    data = batches(steps, batch, seq, config.vocab_size, device)
    result = {"meta": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                       "date": date.today().isoformat(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "model": TINY if tiny else MODEL,
                       "batch": batch, "seq": seq, "steps": steps, "rank": RANK, "alpha": ALPHA}, "runs": {}}
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as adapter:
        try:
            import peft
        except ImportError as e:
            result["runs"]["transformers+peft"] = {"status": f"unavailable: {e}"}
            seed_model = copy.deepcopy(base)
            llmkernels.add_expert_lora(seed_model, RANK, ALPHA)
            llmkernels.save_expert_lora(seed_model, adapter)  # the same adapters for both of ours
            del seed_model
        else:
            result["meta"]["peft"] = peft.__version__
            model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=TARGETS))
            model.save_pretrained(adapter)  # PEFT's initialisation, loaded into ours below
            result["runs"]["transformers+peft"] = {"status": "ok", **train(model, data, device)}
            if args.profile:
                profile(model, data, device, os.path.join(args.out, "moe_lora_profile_peft.txt"))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.compile and not tiny:
                model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter, is_trainable=True)
                result["runs"]["transformers+peft, torch.compile"] = compiled_run(model, data, device)
                del model
                torch.cuda.empty_cache()
        runs = [("llmkernels", {}, False),
                ("llmkernels (experts only)", dict(rms_norm=False, rope=False, cross_entropy=False, mlp=False), False)]
        for name, switches, compiled in runs + ([("llmkernels, torch.compile", {}, True)] if args.compile and not tiny
                                                else []):
            model = copy.deepcopy(base)
            llmkernels.patch(model, **switches)
            llmkernels.load_expert_lora(model, adapter)
            result["runs"][name] = (compiled_run(model, data, device) if compiled
                                    else {"status": "ok", **train(model, data, device)})
            if args.profile and not compiled:
                slug = re.sub(r"\W+", "_", name).strip("_")
                profile(model, data, device, os.path.join(args.out, f"moe_lora_profile_{slug}.txt"))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            llmkernels.unpatch_all()
    with open(os.path.join(args.out, "moe_lora_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Expert LoRA r={RANK}, random-init Qwen3-MoE ({result['meta']['device']}, {result['meta']['date']})",
             "", f"{steps} AdamW steps of {batch} x {seq} tokens, bf16; tokens/s after {WARMUP} steps; host ms: the "
             "median time to queue a step (forward, backward, optimizer) before waiting for its loss: near the step's "
             "time, the host sets the pace", "",
             "| run | tokens/s | ms a step | host ms | peak GiB | first loss | last loss | status |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result["runs"].items():
        if r["status"] != "ok":
            lines.append(f"| {name} | - | - | - | - | - | - | {r['status']} |")
            continue
        tps, step, host = (f"{r[k]:.{p}f}" if r.get(k) else "-" for k, p in
                           (("tokens_per_s", 0), ("step_ms", 1), ("host_ms", 1)))
        lines.append(f"| {name} | {tps} | {step} | {host} | {r.get('peak_gib', float('nan')):.2f} | {r['losses'][0]:.4f} | "
                     f"{r['losses'][-1]:.4f} | ok |")
    with open(os.path.join(args.out, "moe_lora_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
