"""Training one model size: AdamW, linear warm-up then cosine decay, bf16 autocast on GPU,
held-out evaluation along the way (the loss-vs-compute curve) and at the end, periodic checkpoints
from which an interrupted run resumes bit-for-bit in its data order."""
from __future__ import annotations

import contextlib
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass

import torch

from .data import Corpus
from .model import GPT, ModelConfig, backend_ops

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional
    tqdm = None


@dataclass(frozen=True)
class TrainConfig:
    """How one size is trained.

    Attributes:
        tokens: training tokens (rounded up to whole steps).
        batch_size: sequences per step.
        lr: peak learning rate.
        warmup_frac: share of the steps spent warming up linearly from 0.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        weight_decay: AdamW's, on matrices and the embedding (not on norm weights).
        beta1, beta2, grad_clip: AdamW's betas and the global gradient-norm clip.
        seed: model initialisation and data order (the same for every backend).
        eval_tokens: held-out tokens for the final loss (at most the whole held-out split).
        curve_points: held-out evaluations along training, spaced evenly in log(tokens).
        curve_eval_tokens: held-out tokens per curve evaluation.
        log_every: steps between reads of the training loss (each read synchronises the GPU).
    """

    tokens: int
    batch_size: int
    lr: float
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_tokens: int = 1 << 19
    curve_points: int = 10
    curve_eval_tokens: int = 1 << 15
    log_every: int = 20

    def steps(self, seq_len: int) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * seq_len)))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Learning rate before update ``step`` (0-based) of ``total``: linear warm-up to ``cfg.lr`` over
    ``warmup_frac·total`` steps (at least one), then a half cosine down to ``lr·min_lr_ratio``."""
    warmup = max(1, round(cfg.warmup_frac * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def size_seed(seed: int, name: str) -> int:
    """A per-size seed, stable across processes and backends."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31)


def autocast_for(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, max_tokens: int, batch_size: int, amp) -> float:
    """Mean next-token loss over non-overlapping windows of ``tokens`` (on the model's device), up
    to ``max_tokens`` predicted tokens: every window when they fit, else ``max_tokens // seq_len``
    windows spread evenly over the whole split (its first files alone would be a biased sample)."""
    seq = model.cfg.seq_len
    total_windows = (tokens.numel() - 1) // seq
    if total_windows < 1:
        raise ValueError(f"held-out split has {tokens.numel()} tokens: fewer than one window of {seq + 1}")
    n = min(total_windows, max(1, max_tokens // seq))
    starts = (torch.arange(n, device=tokens.device) * total_windows // n) * seq
    idx = starts[:, None] + torch.arange(seq + 1, device=tokens.device)
    windows = tokens[idx]
    x, y = windows[:, :-1], windows[:, 1:]
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for i in range(0, n, batch_size):
        with amp:  # per-token losses, summed in float64 (a bf16 mean would round to ~0.01)
            losses = model(x[i: i + batch_size].long(), y[i: i + batch_size].long(), reduction="none")
        total += losses.double().sum()
    model.train(was_training)
    return float(total / (n * seq))


def _param_groups(model: GPT, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _curve_steps(steps: int, points: int) -> list[int]:
    """Steps (1-based counts of updates) after which the held-out curve is sampled: ``points``
    values spaced evenly in log between ~1% of training and the end."""
    if points <= 0:
        return []
    first = max(1, steps // 100)
    if points == 1 or first >= steps:
        return [steps]
    ratio = (steps / first) ** (1.0 / (points - 1))
    return sorted({min(steps, round(first * ratio**i)) for i in range(points)})


def _save(obj, path: str):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_size(mcfg: ModelConfig, tcfg: TrainConfig, corpus: Corpus, *, backend: str, device: torch.device,
               dtype: torch.dtype, key: dict, ckpt_path: str | None = None, ckpt_interval: float = 120.0,
               progress: bool = True, position: int = 0, log=print) -> dict:
    """Train one model from scratch (or from its checkpoint when one with the same ``key`` exists)
    and return its results: held-out loss, the loss curve, throughput and what was run."""
    seq = mcfg.seq_len
    steps = tcfg.steps(seq)
    tokens_per_step = tcfg.batch_size * seq
    n_params = mcfg.non_embedding_params()

    torch.manual_seed(size_seed(tcfg.seed, mcfg.name))
    model = GPT(mcfg, backend=backend, compute_dtype=dtype if device.type == "cuda" else torch.float32)
    model.to(device)
    opt_kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(_param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2),
                            **opt_kwargs)
    gen = torch.Generator().manual_seed(size_seed(tcfg.seed + 1, mcfg.name))
    train_tok = corpus.train.to(device)
    val_tok = corpus.val.to(device)
    if train_tok.numel() <= seq + 1:
        raise ValueError(f"train split has {train_tok.numel()} tokens: fewer than one window of {seq + 1}")
    amp = autocast_for(device, dtype)
    eval_batch = max(64, tcfg.batch_size)
    offsets = torch.arange(seq + 1, device=device)

    start, history, curve, train_seconds = 0, [], [], 0.0
    if ckpt_path and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        if ckpt.get("key") == key and "optimizer" in ckpt:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            gen.set_state(ckpt["generator"])
            start, history, curve, train_seconds = ckpt["step"], ckpt["history"], ckpt["curve"], ckpt["train_seconds"]
            log(f"{mcfg.name}: resuming at step {start}/{steps}")

    def checkpoint(step, final=False):
        if not ckpt_path:
            return
        state = {"key": key, "model": model.state_dict(), "step": step, "history": history, "curve": curve,
                 "train_seconds": train_seconds}
        if not final:
            state.update(optimizer=opt.state_dict(), generator=gen.get_state())
        _save(state, ckpt_path)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    curve_at = set(_curve_steps(steps, tcfg.curve_points))
    bar = None
    if progress and tqdm is not None:
        bar = tqdm(total=steps, initial=start, desc=f"{mcfg.name} [{backend}]", position=position, leave=True,
                   unit="step", dynamic_ncols=True, mininterval=1.0 if os.isatty(2) else 15.0)
    model.train()
    loss_sum = torch.zeros((), device=device)
    loss_count = 0
    wall0 = time.perf_counter()
    sync()
    t0, last_ckpt = time.perf_counter(), time.perf_counter()
    for step in range(start, steps):
        lr = lr_at(step, steps, tcfg)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_tok.numel() - seq - 1, (tcfg.batch_size,), generator=gen)
        window = train_tok[starts.to(device)[:, None] + offsets].long()
        with amp:
            loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        loss_count += 1
        done = step + 1
        if done % tcfg.log_every == 0 or done == steps or done in curve_at:
            train_loss = float(loss_sum) / loss_count  # synchronises
            train_seconds += time.perf_counter() - t0
            loss_sum.zero_()
            loss_count = 0
            if not math.isfinite(train_loss):
                raise FloatingPointError(f"{mcfg.name}: training loss is {train_loss} at step {done}")
            history.append([done, round(train_seconds, 4), train_loss, lr])
            if done in curve_at:
                val = evaluate(model, val_tok, tcfg.curve_eval_tokens, eval_batch, amp)
                curve.append({"step": done, "tokens": done * tokens_per_step,
                              "compute": 6.0 * n_params * done * tokens_per_step, "val_loss": val})
            if bar is not None:
                bar.update(done - bar.n)
                bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", refresh=False)
            if ckpt_path and time.perf_counter() - last_ckpt > ckpt_interval and done < steps:
                checkpoint(done)
                last_ckpt = time.perf_counter()
            sync()
            t0 = time.perf_counter()
    if bar is not None:
        bar.close()

    val_loss = evaluate(model, val_tok, tcfg.eval_tokens, eval_batch, amp)
    checkpoint(steps, final=True)
    tokens = steps * tokens_per_step
    # Steady-state throughput: from the first log point past 20% of the steps to the end, which
    # leaves out the first steps' kernel compilation and warm-up.
    anchor = next((h for h in history if 0.2 * steps <= h[0] < steps), None)
    s0, t_s0 = (anchor[0], anchor[1]) if anchor else (0, 0.0)
    steady = (steps - s0) * tokens_per_step / max(1e-9, history[-1][1] - t_s0)
    return {
        "name": mcfg.name, "backend": backend, "ops": backend_ops(backend),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "model": mcfg.to_dict(), "train": asdict(tcfg),
        "params": n_params, "embedding_params": mcfg.embedding_params(), "steps": steps,
        "tokens": tokens, "epochs": tokens / corpus.train.numel(), "compute": 6.0 * n_params * tokens,
        "flops_per_token": mcfg.flops_per_token(), "val_loss": val_loss,
        "train_loss": history[-1][2], "first_train_loss": history[0][2], "curve": curve, "history": history,
        "train_seconds": train_seconds, "tokens_per_s": tokens / max(1e-9, train_seconds),
        "steady_tokens_per_s": steady, "steady_tflops": steady * mcfg.flops_per_token() / 1e12,
        "wall_seconds": time.perf_counter() - wall0, "resumed_from_step": start,
    }
