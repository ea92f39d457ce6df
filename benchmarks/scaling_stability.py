"""Run-to-run reproducibility and early-training stability of the scaling sweep's training, on one GPU.

1. Per op: the backward of each piece of the sweep's model run twice on the same inputs, bitwise
   compared, with PyTorch's deterministic algorithms off and on (FlashAttention through SDPA, the
   embedding, llmkernels' fused head + loss, one whole model step).
2. Whole runs twice (the sweep's ``train_run`` on its byte corpus, cut to ``--max-bytes``), off and
   on: the final held-out losses and the training seconds (the speed cost of determinism).
3. The learning-rate sweep's group that diverged on the H200 (L6-W256 at 4.17e14 FLOPs, batch 64)
   and its neighbour L4-W192 at several multiples of the prior rule's rate, without and with
   QK-norm (``ModelConfig.qk_norm``).

Writes ``$OUT/scaling_stability.json`` when OUT is set.

    python benchmarks/scaling_stability.py --max-bytes 100000000
"""
import argparse
import json
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts, for the "on" half

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmkernels.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from llmkernels.scaling import data as data_mod  # noqa: E402
from llmkernels.scaling.model import GPT  # noqa: E402
from llmkernels.scaling.plan import BYTE_VOCAB, HParams, LRRule, ModelConfig, make_run  # noqa: E402
from llmkernels.scaling.train import TrainConfig, autocast_for, eval_windows, set_deterministic, train_run  # noqa: E402

CUDA = torch.device("cuda")


def grads_twice(fn, inputs) -> bool:
    """Whether two backward passes of ``fn`` over the same inputs give bitwise equal gradients."""
    out = []
    for _ in range(2):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        fn(*xs).float().square().mean().backward()
        out.append([x.grad.clone() for x in xs if x.grad is not None])
    return all(torch.equal(a, b) for a, b in zip(*out))


def op_checks() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(64, 4, 512, 64, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(3))
    idx = torch.randint(0, BYTE_VOCAB, (64, 512), device=CUDA, generator=g)
    emb = torch.randn(BYTE_VOCAB, 256, device=CUDA, generator=g)
    h = torch.randn(64 * 512, 256, device=CUDA, dtype=torch.bfloat16, generator=g)
    cfg = ModelConfig(BYTE_VOCAB, 4, 256)
    torch.manual_seed(0)
    model = GPT(cfg, "kernels", compute_dtype=torch.bfloat16).to(CUDA)
    amp = autocast_for(CUDA, torch.bfloat16)

    def model_step(dummy):
        with amp:
            return model(idx[:, :-1], idx[:, 1:]) + 0 * dummy.sum()

    def model_grads_twice() -> bool:
        out = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model_step(torch.zeros(1, device=CUDA)).backward()
            out.append([p.grad.clone() for p in model.parameters()])
        return all(torch.equal(a, b) for a, b in zip(*out))

    checks = {
        "sdpa_causal_bf16": lambda: grads_twice(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), [q, k, v]),
        "embedding_32k_ids": lambda: grads_twice(lambda w: F.embedding(idx, w), [emb]),
        "linear_cross_entropy": lambda: grads_twice(lambda a, w: linear_cross_entropy(a, w, idx.view(-1), check_targets=False),
                                                    [h, emb.to(torch.bfloat16)]),
        "model_step_L4_W256": model_grads_twice,
    }
    out = {}
    for mode in (False, True):
        set_deterministic(mode)
        for name, check in checks.items():
            try:
                out[f"{name}/deterministic={mode}"] = check()
            except RuntimeError as exc:  # an op with no deterministic implementation says so
                out[f"{name}/deterministic={mode}"] = f"error: {exc}"[:300]
    set_deterministic(False)
    return out


def train(model, run, corpus, val_windows, deterministic: bool) -> dict:
    set_deterministic(deterministic)
    tcfg = TrainConfig(steps=run.steps, batch_size=run.batch_size, lr=run.lr, warmup_steps=run.warmup_steps,
                       beta2=run.beta2, seed=run.seed)
    r = train_run(model, tcfg, corpus, val_windows, backend="kernels", device=CUDA, dtype=torch.bfloat16, key={},
                  progress=False)
    set_deterministic(False)
    row = {"model": model.name, "qk_norm": model.qk_norm, "budget": run.budget, "lr_mult": run.lr_mult, "lr": run.lr,
           "steps": run.steps, "deterministic": deterministic, "val_loss": r["val_loss"],
           "train_seconds": r["train_seconds"], "curve": [round(c["val_loss"], 4) for c in r["curve"]]}
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-bytes", type=int, default=100_000_000, help="bytes of documents (default: %(default)s)")
    p.add_argument("--data-dir", default=".scaling-stability-data")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ops": op_checks()}
    print(json.dumps(result["ops"], indent=1), flush=True)
    corpus = data_mod.prepare(data_mod.DataConfig(max_bytes=args.max_bytes), args.data_dir)
    train_tokens = torch.from_numpy(corpus.train).to(CUDA)
    val = torch.from_numpy(corpus.val).to(CUDA)
    val_windows = {"final": eval_windows(val, 512, 1 << 20), "curve": eval_windows(val, 512, 1 << 16)}
    hp, rule, rows = HParams(), LRRule(), []

    def go(layers, width, budget, mult, qk_norm, deterministic):
        m = ModelConfig(64 * ((corpus.vocab_size + 63) // 64), layers, width, qk_norm=qk_norm)
        rows.append(train(m, make_run("lr", budget, m, rule, hp, lr_mult=mult), train_tokens, val_windows, deterministic))

    for deterministic in (False, True):  # the same run twice each way
        for _ in range(2):
            go(4, 192, 4.17e14, 2.0, False, deterministic)
    for qk_norm in (False, True):
        for layers, width, mults in ((6, 256, (0.5, 1.0, 2.0, 4.0)), (4, 192, (1.0, 2.0, 4.0))):
            for mult in mults:
                go(layers, width, 4.17e14, mult, qk_norm, True)
    result["runs"] = rows
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "scaling_stability.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
