"""End-to-end training of a random-init Qwen3-MoE of about 2.7B parameters on one GPU: tokens/s,
step time, peak memory and every step's loss, each provider in its own process (so that patches
and allocator state don't leak):
  hf_eager       transformers' loop over the experts (``experts_implementation="eager"``)
  hf_grouped_mm  transformers' grouped-mm experts (``experts_implementation="grouped_mm"``)
  liger          ``liger_kernel.transformers.apply_liger_kernel_to_qwen3_moe()`` before the model is
                 built (its defaults: RMSNorm, RoPE, its fused MoE experts, fused linear
                 cross-entropy); recorded as skipped where ``liger_kernel`` does not import
  llmkernels     ``llmkernels.patch(model)`` (its report recorded): the experts on ``moe_experts``,
                 RMSNorm, RoPE, fused linear cross-entropy
  compile        ``torch.compile(model)`` of transformers' default (grouped-mm) model

The model (defaults): hidden 2048, 8 layers of 64 experts, top-8, expert intermediate 768 (the
layer of Qwen3-30B-A3B with half its experts), attention 32 heads x 128 over 4 KV heads, vocab
32000, untied head: 2.70B parameters (2.42B in the experts, 0.15B attention, routers and norms,
0.13B embedding and head), 0.59B active a token. In bf16 with AdamW (fused, its state in bf16 like
the weights) that is 8 bytes a parameter, 22 GB; 4 x 2048 tokens a step add an estimated 1 GB of
activations a layer and 2 GB of fp32 logits and their gradient: within one 80 GB GPU for every
provider (the run measures the peak). The router's auxiliary loss is part of the loss.

Every provider builds the model with the same weights (a seeded normal(0, 0.02) fill of every
matrix, norms at one, whatever classes its patch installs), trains with AdamW (fused) on the same
random batches (``e2e_train.train_steps``: ``--warmup`` steps, then ``--steps`` timed), and reports
tokens/s, step time, the peak memory of the timed steps (weights, gradients, optimizer state and
activations) and every step's loss, which is checked against hf_eager's (hf_grouped_mm's where
hf_eager did not run) over the steps both ran. The eager loop is slow: it times ``--slow-steps``
steps after one warm-up. ``--budget`` counts from this process's start: a provider gets what is
left of it as its timeout, and none starts with less than ``--min-left`` seconds left (recorded as
skipped). The summary gives llmkernels' tokens/s over the best of hf_eager, hf_grouped_mm and liger.

    python benchmarks/moe_train.py --out $OUT          # GPU, about 4-6 minutes
    python benchmarks/moe_train.py --tiny --out /tmp/x  # CPU (Triton's interpreter): a tiny fp32 model
    python benchmarks/moe_train.py --providers llmkernels,liger --profile --out $OUT  # where each step goes

Writes ``moe_train.json`` and ``moe_train.md`` under ``--out`` (default ``$OUT``, else
``./moe-train``) after every provider.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

START = time.time()  # the budget counts from here, imports included, as an outside timeout would

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from e2e_train import DTYPES, _dist_version, resolve_device, run_worker, train_steps, training_step  # noqa: E402
from profiling import write_profile  # noqa: E402
from moe_bench import meta  # noqa: E402

from llmkernels.bench.report import write_texts  # noqa: E402

PROVIDERS = ("hf_grouped_mm", "llmkernels", "liger", "hf_eager", "compile")
PEERS = ("hf_eager", "hf_grouped_mm", "liger")  # the bar: llmkernels against the best of these
SLOW = {"hf_eager"}  # timed for --slow-steps after one warm-up step
TARGET = 1.3
MODEL = dict(hidden=2048, layers=8, experts=64, top_k=8, moe_intermediate=768, heads=32, kv_heads=4, head_dim=128,
             vocab=32000, seq=2048, batch=4, warmup=3, steps=10, slow_steps=4, dtype="bf16")
# --tiny: a model the Triton interpreter trains in seconds, in fp32 where the providers agree to 1e-5.
TINY = dict(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=16, heads=2, kv_heads=1, head_dim=16, vocab=256,
            seq=16, batch=2, warmup=1, steps=2, slow_steps=2, dtype="fp32",
            providers="hf_eager,hf_grouped_mm,llmkernels,liger")
SHAPE = tuple(MODEL)
PROFILE_STEPS = 3  # --profile: steps profiled after the timed ones
SPENT = "skipped: the run's time budget is spent"


# -- one provider, in this process ---------------------------------------------------------------
def build_model(args, device, experts_implementation: str | None):
    """The Qwen3-MoE of ``args`` on ``device``, with the same weights whatever classes a patch
    installed before it (``experts_implementation``: None for transformers' default)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.seq, norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=0.001, tie_word_embeddings=False)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                              dtype=getattr(torch, DTYPES[args.dtype]))
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # in name order, so every provider's parameters get the same values
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def run_provider(args) -> dict:
    import torch

    device = torch.device(resolve_device(args.device))
    result = {"provider": args.provider}
    if args.provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
        apply_liger_kernel_to_qwen3_moe()
        result["liger_version"] = _dist_version("liger_kernel")
    implementation = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm"}.get(args.provider)
    model = build_model(args, device, implementation)
    model.train()
    result["experts_implementation"] = model.config._experts_implementation
    result["params"] = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    result["active_params"] = result["params"] - experts + experts * args.top_k // args.experts
    if args.provider == "llmkernels":
        import llmkernels
        report = llmkernels.patch(model)
        print(report, flush=True)
        result["patched"], result["not_patched"] = report.patched, report.not_patched
    step_model = torch.compile(model) if args.provider == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
               for _ in range(args.warmup + args.steps)]
    timed = train_steps(step_model, opt, batches, args.warmup, device)
    result.update(warmup=args.warmup, steps=args.steps, first_step_s=timed["first_step_s"],
                  step_ms=1e3 * timed["elapsed_s"] / args.steps,
                  tokens_per_s=args.batch * args.seq * args.steps / timed["elapsed_s"],
                  peak_mem_gib=timed["peak_gib"], losses=timed["losses"].tolist())
    if args.profile:
        step = training_step(step_model, opt)
        write_profile(lambda: [step(ids) for ids in batches[-PROFILE_STEPS:]], device,
                      os.path.join(args.out, f"moe_train_profile_{args.provider}.txt"))
    return result


# -- the runs and their summary ------------------------------------------------------------------
def loss_check(record: dict, ref_name: str, ref: dict, rtol: float) -> dict:
    """``record``'s losses against ``ref``'s over the steps both ran."""
    pairs = list(zip(record["losses"], ref["losses"]))
    dloss = max(abs(a - b) for a, b in pairs)
    rel = max(abs(a - b) / abs(b) for a, b in pairs)
    return {"against": ref_name, "steps": len(pairs), "max_abs_dloss": dloss, "max_rel_dloss": rel,
            "agree": rel <= rtol}


def summarize(result: dict, rtol: float) -> dict:
    """Every provider's losses against the reference's, and llmkernels' speedup over its peers."""
    ok = {name: r for name, r in result["providers"].items() if r["status"] == "ok"}
    ref_name = next((name for name in ("hf_eager", "hf_grouped_mm") if name in ok), None)
    checks = {name: loss_check(r, ref_name, ok[ref_name], rtol) for name, r in ok.items()
              if ref_name and name != ref_name}
    summary = {"loss_reference": ref_name, "loss_rtol": rtol, "loss_checks": checks,
               "losses_agree": all(c["agree"] for c in checks.values()) if checks else None, "target": TARGET}
    peers = {name: ok[name]["tokens_per_s"] for name in PEERS if name in ok}
    if "llmkernels" in ok and peers:
        best = max(peers, key=peers.get)
        ours = ok["llmkernels"]["tokens_per_s"]
        summary.update(best_peer=best, speedup_vs_best_peer=ours / peers[best],
                       speedup_vs={name: ours / r["tokens_per_s"] for name, r in ok.items() if name != "llmkernels"},
                       peers_missing=[name for name in PEERS if name not in ok])
        summary["meets_target"] = summary["speedup_vs_best_peer"] >= TARGET and bool(summary["losses_agree"])
    return summary


def markdown(result: dict) -> str:
    m, s, shape = result["meta"], result["summary"], result["shape"]
    lines = [f"# End-to-end MoE training, {m['device']}, {m['date']}", "", result["model"], "",
             f"{shape['batch']} x {shape['seq']} tokens a step, {shape['warmup']} warm-up steps then {shape['steps']} "
             f"timed ({shape['slow_steps']} after one for the eager loop); losses against "
             f"{s['loss_reference'] or '(no reference ran)'} (relative tolerance {s['loss_rtol']})", "",
             "| provider | tokens/s | step ms | peak GiB | first step s | max rel dloss | llmkernels over it | "
             "wall s | status |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["providers"].items():
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
        if r["status"] != "ok":
            lines.append(f"| {name} | - | - | - | - | - | - | {wall} | {r['status'][:120]} |")
            continue
        check = s["loss_checks"].get(name)
        dloss = f"{check['max_rel_dloss']:.1e}{'' if check['agree'] else ' MISMATCH'}" if check else "(reference)"
        over = s.get("speedup_vs", {}).get(name)
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {peak} | {r['first_step_s']:.1f} | "
                     f"{dloss} | {f'{over:.2f}x' if over else '-'} | {wall} | ok |")
    if "speedup_vs_best_peer" in s:
        lines += ["", f"llmkernels: {s['speedup_vs_best_peer']:.2f}x the tokens/s of the best peer ({s['best_peer']}; "
                      f"peers missing: {', '.join(s['peers_missing']) or 'none'}); target {TARGET}x with the losses "
                      f"in agreement: {'met' if s['meets_target'] else 'NOT met'}"]
    return "\n".join(lines) + "\n"


def run_all(args) -> dict:
    import torch

    device_type = resolve_device(args.device)
    shape = {k: getattr(args, k) for k in SHAPE}
    result = {"meta": meta(torch.device(device_type)),
              "model": (f"Qwen3MoeForCausalLM, {args.dtype}, AdamW(fused), sdpa attention: hidden {args.hidden}, "
                        f"{args.layers} layers of {args.experts} experts, top-{args.top_k}, expert intermediate "
                        f"{args.moe_intermediate}, {args.heads} heads x {args.head_dim} over {args.kv_heads} KV heads, "
                        f"vocab {args.vocab}, router aux loss 0.001"),
              "shape": shape, "budget_s": args.budget, "providers": {}}
    os.makedirs(args.out, exist_ok=True)

    def save():
        result["summary"] = summarize(result, args.loss_rtol)
        write_texts(args.out, {"moe_train.json": json.dumps(result, indent=1), "moe_train.md": markdown(result)})

    for provider in args.providers.split(","):
        left = START + args.budget - time.time()
        if provider == "liger" and importlib.util.find_spec("liger_kernel") is None:
            record = {"status": "skipped: liger_kernel is not importable here"}
        elif left < args.min_left:
            record = {"status": SPENT}
        else:
            steps = dict(shape, warmup=1, steps=args.slow_steps) if provider in SLOW else shape
            cmd = [sys.executable, os.path.abspath(__file__), "--provider", provider, f"--device={device_type}",
                   f"--out={args.out}", *(["--profile"] if args.profile else []),
                   *(f"--{k.replace('_', '-')}={v}" for k, v in steps.items())]
            start = time.time()
            record = run_worker(cmd, provider, min(left, args.timeout))
            record["wall_s"] = time.time() - start
            record["status"] = "ok" if "error" not in record else (
                "error: " + (record["error"].strip().splitlines() or ["?"])[-1][:300])
        result["providers"][provider] = record
        print(f"{provider}: " + json.dumps({k: v for k, v in record.items() if k not in ("losses", "error")})[:600],
              flush=True)
        save()
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", choices=PROVIDERS, help="run one provider in this process (a worker)")
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated, run in this order")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU through Triton's interpreter")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    for key, value in MODEL.items():
        kwargs = {"choices": tuple(DTYPES)} if key == "dtype" else {"type": type(value)}
        p.add_argument(f"--{key.replace('_', '-')}", default=value, **kwargs)
    p.add_argument("--budget", type=float, default=450.0, help="seconds from this process's start (default "
                   "%(default)s); no provider starts with less than --min-left of it left")
    p.add_argument("--min-left", type=float, default=45.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per provider at most")
    p.add_argument("--loss-rtol", type=float, default=2e-2, help="largest relative loss difference from the "
                   "reference at any step (default %(default)s: bf16, where routing may flip on near ties)")
    p.add_argument("--profile", action="store_true", help=f"after each provider's timed steps, profile "
                   f"{PROFILE_STEPS} more into moe_train_profile_<provider>.txt (device time, then host time)")
    p.add_argument("--out", default=os.environ.get("OUT") or "moe-train")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:  # the tiny model's values, then whatever the command line gives beside --tiny
        parser.set_defaults(**TINY, device="cpu", loss_rtol=1e-4)
        args = parser.parse_args(argv)
    unknown = [name for name in args.providers.split(",") if name not in PROVIDERS]
    if unknown:
        parser.error(f"--providers: unknown {', '.join(unknown)}; choose from {', '.join(PROVIDERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.provider:
        try:
            print("RESULT " + json.dumps(run_provider(args)), flush=True)
        except Exception:  # the worker's own error goes into the JSON
            print("RESULT " + json.dumps({"provider": args.provider, "error": traceback.format_exc()[-2000:]}),
                  flush=True)
            return 1
        return 0
    result = run_all(args)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
