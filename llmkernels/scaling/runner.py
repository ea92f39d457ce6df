"""Executing a sweep: device and ranks, the data, each stage's runs (claimed one at a time by the
ranks, skipped when finished, resumed from checkpoints), the learning-rate rule and the report."""
from __future__ import annotations

import datetime as dt
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import data as data_mod
from . import fit, report
from .plan import LRRule, ladder_models
from .sweep import EXIT_INCOMPLETE, _read_json, _read_rule, _write_json, design_from
from .train import TimeUp, TrainConfig, eval_windows, train_run


class Estimator:
    """Predicted seconds of a run from the runs finished in this process: seconds a step scale
    with FLOPs a step to the 0.8 from the nearest finished run (small steps are launch- and
    latency-bound), plus a few seconds of set-up and evaluation. None: no guess (CPU, nothing yet)."""

    def __init__(self, cuda: bool):
        self.seen: list[tuple[float, float]] = []
        self.cuda = cuda

    def add(self, result: dict):
        fps = result["flops_per_token"] * result["train"]["batch_size"] * result["model"]["seq_len"]
        self.seen.append((fps, result["train_seconds"] / result["steps"]))

    def seconds(self, run) -> float | None:
        fps = run.model.flops_per_token() * run.batch_size * run.model.seq_len
        if self.seen:
            f0, s0 = min(self.seen, key=lambda t: abs(math.log(t[0] / fps)))
            per_step = s0 * (fps / f0) ** 0.8
        elif self.cuda:
            per_step = 2e-3 + fps / 150e12
        else:
            return None
        return 1.15 * run.steps * per_step + 5.0


def _fmt_seconds(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


class Session:
    """One invocation of ``llmkernels scaling`` (one rank of it under torchrun)."""

    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU is available")
        self.device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.dtype = torch.bfloat16 if (args.dtype == "bf16" or (args.dtype == "auto" and cuda)) else torch.float32
        self.dtype_name = str(self.dtype).replace("torch.", "")
        self.dist = None
        if self.world > 1:
            import torch.distributed as dist
            # Ranks exchange no tensors, only barriers: gloo works whether or not they share a GPU.
            dist.init_process_group("gloo", timeout=dt.timedelta(hours=24))
            self.dist = dist
        self.out = Path(args.out)
        self.runs_dir, self.ckpt_dir, self.claims = self.out / "runs", self.out / "checkpoints", self.out / "claims"
        self.deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
        self.estimator = Estimator(cuda)
        self.t_start = time.perf_counter()

    def log(self, msg=""):
        print(msg if self.world == 1 else f"[rank {self.rank}] {msg}", flush=True)

    def barrier(self):
        if self.dist is not None:
            self.dist.barrier()

    # ----------------------------------------------------------------------------------------
    def prepare_data(self):
        a = self.args
        dcfg = data_mod.DataConfig(path=a.data, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                                   heldout_frac=a.heldout_frac, max_bytes=a.max_bytes, seed=a.data_seed)
        corpus, error = None, None
        if self.rank == 0:
            for d in (self.runs_dir, self.ckpt_dir, self.claims):
                d.mkdir(parents=True, exist_ok=True)
            for stale in self.claims.iterdir():  # left by a killed earlier invocation
                stale.unlink()
            try:
                corpus = data_mod.prepare(dcfg, self.out / "data", log=self.log)
            except (OSError, ValueError, ImportError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            (self.out / "data-error.txt").write_text(error or "")
        self.barrier()
        error = (self.out / "data-error.txt").read_text() or None
        if error:
            raise SystemExit(f"llmkernels scaling: data preparation failed: {error}")
        return corpus or data_mod.prepare(dcfg, self.out / "data", log=lambda *_: None)

    def saved_meta(self) -> dict:
        """``--fit-only``: the data description (and dtype) the finished runs were trained with, read
        from their keys, so that runs made on another machine are fitted here as they are."""
        for path in sorted(self.runs_dir.glob("*.json")):
            run = _read_json(path)
            meta = run and "key" in run and _read_json(self.out / "data" / run["key"]["data"] / "meta.json")
            if meta:
                self.dtype_name = run["key"]["dtype"]
                return meta
        raise SystemExit(f"--fit-only: no finished run with its data/<fingerprint>/meta.json under {self.out}")

    def claim(self, run_id: str) -> bool:
        try:
            os.close(os.open(self.claims / run_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def train_config(self, run) -> TrainConfig:
        a, hp = self.args, self.hp
        return TrainConfig(steps=run.steps, batch_size=run.batch_size, lr=run.lr, warmup_steps=run.warmup_steps,
                           min_lr_ratio=hp.min_lr_ratio, weight_decay=hp.weight_decay, beta2=run.beta2,
                           grad_clip=hp.grad_clip, seed=run.seed, eval_tokens=a.eval_tokens,
                           curve_points=a.curve_points, curve_eval_tokens=a.curve_eval_tokens)

    def key(self, run, tcfg) -> dict:
        return {"run": run.id, "model": run.model.to_dict(), "train": asdict(tcfg), "backend": run.backend,
                "dtype": self.dtype_name, "data": self.fingerprint}

    def execute(self, runs, title: str) -> tuple[list[dict], list[str]]:
        """Train the runs not finished yet, each claimed by one rank: longest first (the ranks end
        together), or under a time limit smallest budget first (each piece completes whole
        budgets). Returns every finished result of ``runs`` and the ids still missing."""
        a = self.args
        stages = {"lr": 0, "sweep": 1, "seed": 2, "backend": 3}
        todo = sorted(runs, key=(lambda r: (r.budget, stages[r.stage], -r.compute)) if self.deadline is not None
                      else (lambda r: -r.compute))
        finished, stop = 0, False
        for i, run in enumerate(todo):
            tcfg = self.train_config(run)
            key = self.key(run, tcfg)
            path = self.runs_dir / f"{run.id}.json"
            prev = _read_json(path)
            if (prev and prev.get("key") == key) or a.fit_only or stop or not self.claim(run.id):
                continue
            try:
                est = self.estimator.seconds(run)
                if self.deadline is not None and est is not None and time.perf_counter() + est > self.deadline:
                    continue
                result = train_run(run.model, tcfg, self.train_tokens, self.val_windows, backend=run.backend,
                                   device=self.device, dtype=self.dtype, key=key, capture=not a.no_graph,
                                   ckpt_path=str(self.ckpt_dir / f"{run.id}.pt"), ckpt_interval=a.ckpt_interval,
                                   deadline=self.deadline, progress=not a.no_progress,
                                   position=self.rank if self.world > 1 else 0, desc=run.id, log=self.log)
            except TimeUp as exc:
                self.log(str(exc))
                stop = True
                continue
            except (FloatingPointError, RuntimeError, ValueError) as exc:
                self.log(f"{run.id}: FAILED: {type(exc).__name__}: {exc}")
                _write_json(self.runs_dir / f"{run.id}.failed.json", {"run": run.id, "error": f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                (self.claims / run.id).unlink(missing_ok=True)
            result.update(key=key, id=run.id, stage=run.stage, budget=run.budget, seed=run.seed, lr_mult=run.lr_mult)
            _write_json(path, result)
            self.estimator.add(result)
            finished += 1
            left = [r for r in todo[i + 1:] if not (self.runs_dir / f"{r.id}.json").exists()]
            eta = sum(self.estimator.seconds(r) or 0.0 for r in left) / self.world
            self.log(f"[{title} {i + 1}/{len(todo)}] {run.id}: loss {result['val_loss']:.4f} "
                     f"({data_mod.bits_per_byte(result['val_loss'], self.meta['val_tokens_per_byte']):.3f} bits/byte) in "
                     f"{result['train_seconds']:.1f} s, {result['tokens_per_s']:,.0f} tok/s"
                     + (f", MFU {result['mfu']:.1%}" if result["mfu"] else "")
                     + (f"; about {_fmt_seconds(eta)} left" if left and self.estimator.cuda else ""))
        self.barrier()
        results, missing = [], []
        for run in runs:
            prev = _read_json(self.runs_dir / f"{run.id}.json")
            if prev and prev.get("key") == self.key(run, self.train_config(run)):
                results.append(prev)
            else:
                missing.append(run.id)
        return results, missing

    # ----------------------------------------------------------------------------------------
    def main(self) -> int:
        a = self.args
        if a.fit_only:
            corpus = None
            self.meta = self.saved_meta()
        else:
            corpus = self.prepare_data()
            self.meta = corpus.meta
        self.fingerprint = self.meta["fingerprint"]
        design, self.hp, ladder = design_from(a)
        vocab = 64 * math.ceil(self.meta["vocab_size"] / 64)  # padded for the tensor cores; the extra ids never occur
        models = ladder_models(vocab, a.seq_len, a.head_dim, ladder)
        if corpus is not None:
            self.train_tokens = torch.from_numpy(corpus.train).to(self.device)
            val = torch.from_numpy(corpus.val).to(self.device)
            self.val_windows = {"final": eval_windows(val, a.seq_len, a.eval_tokens),
                                "curve": eval_windows(val, a.seq_len, a.curve_eval_tokens)}

        lr_runs, lr_results = [], []
        if a.lr is not None:
            rule = LRRule(c=a.lr, gamma=a.lr_gamma, source="--lr")
            lr_fit = {"ok": True, "c": rule.c, "gamma": rule.gamma, "kappa": rule.kappa, "groups": [], "source": "--lr"}
        else:
            lr_runs = design.lr_sweep(models, LRRule(), self.hp)
            lr_results, missing = self.execute(lr_runs, "lr")
            if missing:
                return self.incomplete(missing)
            saved = _read_json(self.out / "lr_rule.json")
            ids = sorted(r["id"] for r in lr_results)
            if self.rank == 0 and not (saved and saved.get("runs") == ids):  # fitted once, then reused as is
                _write_json(self.out / "lr_rule.json", {**fit.fit_lr_rule(lr_results, LRRule().kappa), "runs": ids})
            self.barrier()
            lr_fit = _read_json(self.out / "lr_rule.json")
            rule = _read_rule(self.out) or LRRule()
            lr_fit["source"] = rule.source
            self.log(f"learning-rate rule: c = {rule.c:.3g}, gamma = {rule.gamma:.3f} ({rule.source})")
        runs = design.main_runs(models, rule, self.hp)
        results, missing = self.execute(runs, "sweep")
        status = 0
        if missing:
            status = self.incomplete(missing)
        if self.rank == 0 and sum(r["stage"] == "sweep" for r in results) >= 3:
            self.write_report(results, lr_fit)
        self.log(f"total wall-clock {_fmt_seconds(time.perf_counter() - self.t_start)}")
        self.barrier()
        if self.dist is not None:
            self.dist.destroy_process_group()
        return status

    def incomplete(self, missing: list[str]) -> int:
        failed = [m for m in missing if (self.runs_dir / f"{m}.failed.json").exists()]
        self.log(f"{len(missing)} run(s) not finished ({len(failed)} failed); "
                 + ("rerun the same command to resume" if not self.args.fit_only else "train them first"))
        return EXIT_INCOMPLETE

    def write_report(self, results: list[dict], lr_fit: dict):
        here = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else (platform.processor() or "cpu")
        device_name = ", ".join(sorted({r["device"] for r in results})) + ("" if not self.args.fit_only else
                                                                        f" (fitted on {here})")
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        info = {"device": device_name, "date": dt.date.today().isoformat(),
                "command": "llmkernels scaling " + " ".join(sys.argv[1:] if self.argv is None else self.argv),
                "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
                "world_size": self.world, "captured": sorted({r["captured"] for r in results}),
                "ops": sorted({str(r["ops"]) for r in results})}
        an = report.write(info, results, lr_fit, self.meta, self.out, self.args.bootstrap)
        boot = an["bootstrap"] or {}

        def ci(k):
            return f" [{boot[k]['lo']:.3f}, {boot[k]['hi']:.3f}]" if k in boot else ""
        a1, a2, a3 = an["approach1"], an["approach2"], an["approach3"]
        self.log(f"approach 1: a = {a1['a'] if a1['a'] is None else round(a1['a'], 3)}{ci('a1_a')}")
        self.log(f"approach 2: a = {a2['a'] if a2['a'] is None else round(a2['a'], 3)}{ci('a2_a')}, "
                 f"b = {a2['b'] if a2['b'] is None else round(a2['b'], 3)}{ci('a2_b')} ({a2['budgets_used']} budgets)")
        if a3.get("ok"):
            self.log(f"approach 3: E = {a3['E']:.3f}{ci('a3_E')}, alpha = {a3['alpha']:.3f}{ci('a3_alpha')}, "
                     f"beta = {a3['beta']:.3f}{ci('a3_beta')}, a = {a3['a'] if a3['a'] is None else round(a3['a'], 3)}"
                     f"{ci('a3_a')}")
        ex = an["extrapolation"]
        if ex.get("approach3_error") is not None:
            law = ex.get("loss_law_error")
            self.log(f"extrapolation to {ex['budget']:.3g} FLOPs: optimal loss error {ex['approach3_error']:+.4f} "
                     f"nats/token (approach 3), {'n/a' if law is None else format(law, '+.4f')} (L_opt(C) law)")
        self.log(f"wrote {self.out / 'report.md'}, report.json and {len(an['figures'])} figures")
