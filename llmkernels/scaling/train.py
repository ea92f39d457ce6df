"""Training one run: AdamW, linear warm-up then cosine decay, held-out evaluations along the way,
checkpoints from which an interrupted run resumes exactly.

On a GPU the whole step is one CUDA graph: the batch is gathered on the device from start offsets
drawn up front, the learning rate is read from a device-side schedule, then forward, backward,
gradient clipping and the fused AdamW step (its learning rate a device tensor) follow, and a step
counter advances. Replaying the graph costs one launch a step, so that small models are bound by
the GPU and not by the host's kernel launches. Everything it touches keeps its address from the
capture on: a checkpoint is restored by copying into those tensors. Elsewhere (CPU) the same step
runs eagerly.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import zlib
from dataclasses import asdict, dataclass

import torch

from .model import GPT, ops_run
from .plan import HParams, ModelConfig, peak_flops

def set_deterministic(on: bool):
    """Bitwise-reproducible training on GPU (``--deterministic``): PyTorch's deterministic kernels
    (among them FlashAttention's backward without atomic adds) and cuBLAS with a fixed workspace.
    Call before the first matrix product: cuBLAS reads its variable when its handle is made."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    # filling every new tensor with NaN (the default in this mode) would add a kernel per allocation to each step
    torch.utils.deterministic.fill_uninitialized_memory = False


class TimeUp(Exception):
    """The run hit the caller's deadline; its checkpoint holds where it stopped."""


@dataclass(frozen=True)
class TrainConfig:
    """How one run trains (see ``plan.HParams`` for where the values come from).

    Attributes:
        steps, batch_size: optimizer steps and sequences per step.
        lr, warmup_steps, min_lr_ratio: peak learning rate, linear warm-up from 0, cosine floor.
        weight_decay, beta1, beta2, grad_clip: AdamW's (decoupled decay on matrices and the
            embedding) and the global gradient-norm clip (0: none).
        seed: model initialisation and data order.
        eval_tokens: held-out tokens of the final loss; curve_points evaluations of
            curve_eval_tokens each along training, spaced evenly in log(step).
        log_every: steps between reads of the training loss (each read waits for the GPU).
    """

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 0
    min_lr_ratio: float = HParams.min_lr_ratio
    weight_decay: float = HParams.weight_decay
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = HParams.grad_clip
    seed: int = 0
    eval_tokens: int = 1 << 20
    curve_points: int = 10
    curve_eval_tokens: int = 1 << 16
    log_every: int = 100


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up over ``warmup_steps``, then a half
    cosine from ``lr`` to ``lr·min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def curve_steps(steps: int, points: int) -> list[int]:
    """Step counts after which the held-out curve is sampled: ``points`` values spaced evenly in
    log from ~2% of the run to its end."""
    if points <= 0:
        return []
    first = max(1, steps // 50)
    if points == 1 or first >= steps:
        return [steps]
    ratio = (steps / first) ** (1.0 / (points - 1))
    return sorted({min(steps, round(first * ratio**i)) for i in range(points)})


def run_seed(seed: int, name: str, stream: str) -> int:
    """A per-size seed of one random ``stream`` (``"init"``: the initial weights, ``"data"``: the
    batches' start offsets), stable across processes, devices and backends; distinct streams and
    seeds draw from unrelated generators."""
    return zlib.crc32(f"{stream}:{seed}:{name}".encode()) % (2**31)


def autocast_for(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on GPU; its weight-cast cache off, so that a captured step recasts each replay."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype, cache_enabled=False)
    return contextlib.nullcontext()


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """``[n, seq_len + 1]`` non-overlapping windows of the held-out tokens, ``max_tokens // seq_len``
    of them spread evenly over the whole split (all of them when fewer fit)."""
    total = (tokens.numel() - 1) // seq_len
    if total < 1:
        raise ValueError(f"held-out split has {tokens.numel()} tokens: fewer than one window of {seq_len + 1}")
    n = min(total, max(1, max_tokens // seq_len))
    starts = (torch.arange(n, device=tokens.device) * total // n) * seq_len
    return tokens[starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)].long()


@torch.no_grad()
def evaluate(model: GPT, windows: torch.Tensor, batch_size: int, amp) -> float:
    """Mean next-token loss (nats) over ``windows``, per-token losses summed in float64."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=windows.device)
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i: i + batch_size]
        with amp:
            total += model(w[:, :-1], w[:, 1:], reduction="none").double().sum()
    model.train(was_training)
    return float(total / (windows.shape[0] * (windows.shape[1] - 1)))


# A replay checks that the device's generator is not capturing, and every graph of the process shares
# that generator: one thread's replay beside another's capture fails, so the two take turns.
_GRAPH_LOCK = threading.Lock()


class Stepper:
    """One run's training step and the state it mutates, captured in a CUDA graph on GPU."""

    def __init__(self, model: GPT, cfg: TrainConfig, train_tokens: torch.Tensor, *, device: torch.device,
                 amp, capture: bool, beside_others: bool = False):
        self.model, self.cfg, self.amp, self.device = model, cfg, amp, device
        seq = model.cfg.seq_len
        if train_tokens.numel() <= seq + 1:
            raise ValueError(f"train split has {train_tokens.numel()} tokens: fewer than one window of {seq + 1}")
        self.tokens = train_tokens
        gen = torch.Generator().manual_seed(run_seed(cfg.seed, model.cfg.name, "data"))
        self.starts = torch.randint(0, train_tokens.numel() - seq - 1, (cfg.steps, cfg.batch_size),
                                    generator=gen).to(device)
        self.offsets = torch.arange(seq + 1, device=device)
        self.lrs = torch.tensor([lr_at(s, cfg) for s in range(cfg.steps)], dtype=torch.float32, device=device)
        self.lr = torch.tensor(cfg.lr, dtype=torch.float32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.params = list(model.parameters())
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        # fused: one kernel for every parameter; capturable keeps its step count on the device
        self.opt = torch.optim.AdamW(groups, lr=self.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True,
                                     capturable=device.type == "cuda")
        self.graph = None
        self._warm_up()
        if capture and device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            # Beside other threads' runs: a capture stream of its own (the default one is shared by
            # every capture of the process), and their launches meanwhile are no error of this one.
            alone = {} if not beside_others else {"stream": torch.cuda.Stream(device),
                                                   "capture_error_mode": "thread_local"}
            with _GRAPH_LOCK, torch.cuda.graph(self.graph, **alone):
                self._step()

    def _step(self):
        i = self.step.view(1)
        window = self.tokens[self.starts.index_select(0, i).view(-1, 1) + self.offsets].long()
        self.lr.copy_(self.lrs.index_select(0, i).view(()))
        for p in self.params:
            p.grad = None
        with self.amp:
            loss = self.model(window[:, :-1], window[:, 1:])
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        self.opt.step()
        self.loss_sum.add_(loss.detach())
        self.step.add_(1)

    def _warm_up(self):
        """Run steps once (compiling the kernels, creating the optimizer state; on a side stream
        before a capture), then put back the initial parameters and a fresh optimizer state."""
        initial = [p.detach().clone() for p in self.params]
        stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(3 if stream is not None else 1):
                self._step()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        self.load({"step": 0, "params": initial,
                   "optimizer": [[torch.zeros_like(v) for v in self.opt.state[p].values()] for p in self.params]})

    def advance(self, n: int):
        for _ in range(n):
            if self.graph is not None:
                with _GRAPH_LOCK:
                    self.graph.replay()
            else:
                self._step()

    def take_loss(self, n: int) -> float:
        """Mean training loss of the last ``n`` steps (waits for them)."""
        loss = float(self.loss_sum) / n
        self.loss_sum.zero_()
        return loss

    def state(self) -> dict:
        return {"step": int(self.step), "params": [p.detach().cpu() for p in self.params],
                "optimizer": [[v.detach().cpu() for v in self.opt.state[p].values()] for p in self.params]}

    @torch.no_grad()
    def load(self, state: dict):
        """Copy a ``state()`` into the step's own tensors (their addresses are in the graph)."""
        for p, v in zip(self.params, state["params"]):
            p.copy_(v)
        for p, saved in zip(self.params, state["optimizer"]):
            for v, s in zip(self.opt.state[p].values(), saved):
                v.copy_(s)
        self.step.fill_(state["step"])
        self.loss_sum.zero_()


_SETUP_LOCK = threading.Lock()


def _save(obj, path: str):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_run(mcfg: ModelConfig, cfg: TrainConfig, train_tokens: torch.Tensor, val_windows: dict, *,
              backend: str, device: torch.device, dtype: torch.dtype, key: dict, capture: bool = True,
              beside_others: bool = False, ckpt_path: str | None = None, ckpt_interval: float = 300.0,
              deadline: float | None = None, progress: bool = True, position: int = 0, desc: str = "",
              log=print) -> dict:
    """Train one model from scratch, or from its checkpoint when one with the same ``key`` exists,
    and return its results. ``val_windows``: ``{"final": [n, T+1], "curve": [m, T+1]}`` held-out
    windows on ``device``. ``deadline`` (``time.perf_counter()`` value): past it, checkpoint and
    raise ``TimeUp``. ``beside_others``: other threads of this process train runs at the same time."""
    wall0 = time.perf_counter()
    amp = autocast_for(device, dtype)
    # One run's set-up at a time in a process: its initialisation draws from the global generator,
    # and a CUDA-graph capture fails when another thread's capture set-up synchronises the device.
    with _SETUP_LOCK:
        torch.manual_seed(run_seed(cfg.seed, mcfg.name, "init"))
        model = GPT(mcfg, backend=backend, compute_dtype=dtype if device.type == "cuda" else torch.float32).to(device)
        stepper = Stepper(model, cfg, train_tokens, device=device, amp=amp, capture=capture,
                          beside_others=beside_others)
    setup_seconds = time.perf_counter() - wall0

    start, history, curve, train_seconds = 0, [], [], 0.0
    if ckpt_path and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt.get("key") == key:
            stepper.load(ckpt["state"])
            start, history, curve, train_seconds = ckpt["step"], ckpt["history"], ckpt["curve"], ckpt["train_seconds"]
            log(f"{desc or mcfg.name}: resuming at step {start}/{cfg.steps}")

    def checkpoint(step):
        if ckpt_path:
            _save({"key": key, "step": step, "state": stepper.state(), "history": history, "curve": curve,
                   "train_seconds": train_seconds}, ckpt_path)

    tokens_per_step = cfg.batch_size * mcfg.seq_len
    at_curve = set(curve_steps(cfg.steps, cfg.curve_points))
    bounds = sorted(at_curve | set(range(cfg.log_every, cfg.steps, cfg.log_every)) | {cfg.steps})
    eval_batch = max(32, min(256, (1 << 17) // mcfg.seq_len))
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.steps, initial=start, desc=desc or mcfg.name, position=position, leave=False,
                       unit="step", dynamic_ncols=True, mininterval=1.0 if os.isatty(2) else 30.0)
        except ImportError:  # progress bars are optional
            bar = None
    model.train()
    done, last_ckpt = start, time.perf_counter()
    try:
        for b in bounds:
            if b <= done:
                continue
            t0 = time.perf_counter()
            stepper.advance(b - done)
            loss = stepper.take_loss(b - done)
            train_seconds += time.perf_counter() - t0
            done = b
            if not math.isfinite(loss):
                raise FloatingPointError(f"{desc or mcfg.name}: training loss is {loss} at step {done}")
            history.append([done, round(train_seconds, 4), loss, lr_at(done - 1, cfg)])
            if done in at_curve:
                curve.append({"step": done, "tokens": done * tokens_per_step,
                              "compute": float(done * tokens_per_step * mcfg.flops_per_token()),
                              "val_loss": evaluate(model, val_windows["curve"], eval_batch, amp)})
            if bar is not None:
                bar.update(done - bar.n)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            now = time.perf_counter()
            if done < cfg.steps and deadline is not None and now > deadline:
                checkpoint(done)
                raise TimeUp(f"{desc or mcfg.name}: stopped at step {done}/{cfg.steps} (time limit)")
            if done < cfg.steps and ckpt_path and now - last_ckpt > ckpt_interval:
                checkpoint(done)
                last_ckpt = now
    finally:
        if bar is not None:
            bar.close()

    val_loss = evaluate(model, val_windows["final"], eval_batch, amp)
    if ckpt_path and os.path.exists(ckpt_path):
        os.remove(ckpt_path)  # finished: the result JSON is what is kept
    tokens = cfg.steps * tokens_per_step
    tokens_per_s = tokens / max(1e-9, train_seconds)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(device_name)
    flops_per_s = tokens_per_s * mcfg.flops_per_token()
    return {
        "name": mcfg.name, "backend": backend, "ops": ops_run(backend, device), "captured": stepper.graph is not None,
        "device": device_name, "dtype": str(dtype).replace("torch.", ""), "model": mcfg.to_dict(),
        "train": asdict(cfg), "params": mcfg.total_params(), "non_embedding_params": mcfg.non_embedding_params(),
        "embedding_params": mcfg.embedding_params(), "flops_per_token": mcfg.flops_per_token(),
        "steps": cfg.steps, "tokens": tokens, "compute": float(tokens * mcfg.flops_per_token()),
        "epochs": tokens / train_tokens.numel(), "val_loss": val_loss,
        "train_loss": history[-1][2], "first_train_loss": history[0][2], "curve": curve, "history": history,
        "train_seconds": train_seconds, "setup_seconds": setup_seconds, "tokens_per_s": tokens_per_s,
        "tflops": flops_per_s / 1e12, "peak_flops": peak, "mfu": None if peak is None else flops_per_s / peak,
        "wall_seconds": time.perf_counter() - wall0, "resumed_from_step": start,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
