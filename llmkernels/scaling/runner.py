"""Executing a sweep: device and ranks, the data, each stage's runs (claimed one at a time by the
ranks, skipped when finished, resumed from checkpoints), the learning-rate rule, the windows of the
upper budgets and the report."""
from __future__ import annotations

import datetime as dt
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import data as data_mod
from . import fit, report, surface
from .design import centre_plan, design_from
from .plan import H100, LRRule, ladder_models
from .store import pack, read_centres, read_json, read_rule, read_spans, unpack, write_json
from .train import TimeUp, TrainConfig, eval_windows, set_deterministic, train_run

EXIT_INCOMPLETE = 3
STAGE_ORDER = {"lr": 0, "sweep": 1, "seed": 2, "batch": 3, "backend": 4}


class Estimator:
    """Predicted seconds of a run: ``plan.StepCost`` (an H100's) scaled by the median ratio of
    measured to predicted seconds of the runs finished in this process. None: no guess (CPU
    before its first run)."""

    def __init__(self, cuda: bool):
        self.ratios: list[float] = []
        self.cuda = cuda

    def add(self, run, result: dict):
        self.ratios.append(result["wall_seconds"] / H100.run_seconds(run))

    def seconds(self, run) -> float | None:
        if not self.ratios and not self.cuda:
            return None
        return H100.run_seconds(run) * (statistics.median(self.ratios) if self.ratios else 1.0)


def _fmt_seconds(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def claim_order(runs, timed: bool) -> list:
    """The order every rank walks the runs in, claiming each unclaimed one: longest first (the ranks
    end together), or under a time limit smallest budget first (each piece completes whole budgets)."""
    if timed:
        return sorted(runs, key=lambda r: (r.budget, STAGE_ORDER[r.stage], -r.compute))
    return sorted(runs, key=lambda r: -H100.run_seconds(r))


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
        corpus, failed = None, self.out / "data-error.txt"
        if self.rank == 0:
            for d in (self.runs_dir, self.ckpt_dir, self.claims):
                d.mkdir(parents=True, exist_ok=True)
            for stale in [*self.claims.iterdir(), failed]:  # left by a killed or failed earlier invocation
                stale.unlink(missing_ok=True)
            try:
                corpus = data_mod.prepare(dcfg, self.out / "data", log=self.log)
            except (OSError, ValueError, ImportError) as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
        self.barrier()
        if failed.exists():
            raise SystemExit(f"llmkernels scaling: data preparation failed: {failed.read_text()}")
        return corpus or data_mod.prepare(dcfg, self.out / "data", log=lambda *_: None)

    def saved_meta(self) -> dict:
        """``--fit-only``: the data description (and dtype) the finished runs were trained with, read
        from their keys, so that runs made on another machine are fitted here as they are."""
        for path in sorted(self.runs_dir.glob("*.json")):
            run = read_json(path)
            meta = run and "key" in run and read_json(self.out / "data" / run["key"]["data"] / "meta.json")
            if meta:
                self.dtype_name = run["key"]["dtype"]
                return meta
        raise SystemExit(f"--fit-only: no finished run with its data/<fingerprint>/meta.json under {self.out}")

    def claim(self, run_id: str) -> bool:
        """Take ``run_id`` for this rank (a file made exclusively, holding the rank), False if taken."""
        try:
            fd = os.open(self.claims / run_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"rank {self.rank}\n".encode())
        os.close(fd)
        return True

    def train_config(self, run) -> TrainConfig:
        a, hp = self.args, self.hp
        return TrainConfig(steps=run.steps, batch_size=run.batch_size, lr=run.lr, warmup_steps=run.warmup_steps,
                           min_lr_ratio=hp.min_lr_ratio, weight_decay=hp.weight_decay, beta2=run.beta2,
                           grad_clip=hp.grad_clip, seed=run.seed, eval_tokens=a.eval_tokens,
                           curve_points=a.curve_points, curve_eval_tokens=a.curve_eval_tokens)

    def key(self, run, tcfg) -> dict:
        return {"run": run.id, "model": run.model.to_dict(), "train": asdict(tcfg), "backend": run.backend,
                "dtype": self.dtype_name, "data": self.fingerprint}

    def finished(self, run) -> dict | None:
        prev = read_json(self.runs_dir / f"{run.id}.json")
        return prev if prev and prev.get("key") == self.key(run, self.train_config(run)) else None

    def diverged(self, run, tcfg, exc) -> dict:
        """The record of a run whose loss went non-finite: a result (no loss) so that it is not retried;
        the learning-rate sweep counts it as the worst rate, the fits leave it out."""
        m = run.model
        return {"name": m.name, "backend": run.backend, "model": m.to_dict(), "train": asdict(tcfg),
                "params": m.total_params(), "non_embedding_params": m.non_embedding_params(), "steps": run.steps,
                "tokens": run.tokens, "compute": run.compute, "val_loss": None, "diverged": f"{exc}", "curve": [],
                "train_seconds": 0.0, "wall_seconds": 0.0, "epochs": run.tokens / max(1, self.meta["train_tokens"]),
                "device": str(self.device), "captured": False, "ops": {}, "tokens_per_s": 0.0, "mfu": None}

    def execute(self, runs, title: str) -> tuple[list[dict], list[str]]:
        """Train the runs not finished yet, each claimed by one rank (``claim_order``). Returns every
        finished result of ``runs`` and the ids still missing."""
        a = self.args
        todo = claim_order(runs, self.deadline is not None)
        stop = False
        for i, run in enumerate(todo):
            tcfg = self.train_config(run)
            key = self.key(run, tcfg)
            if a.fit_only or stop or self.finished(run) or not self.claim(run.id):
                continue
            path = self.runs_dir / f"{run.id}.json"
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
            except FloatingPointError as exc:
                self.log(f"{run.id}: DIVERGED: {exc}")
                write_json(path, {**self.diverged(run, tcfg, exc), **self.tags(run, key)})
            except (RuntimeError, ValueError) as exc:
                self.log(f"{run.id}: FAILED: {type(exc).__name__}: {exc}")
                write_json(self.runs_dir / f"{run.id}.failed.json", {"run": run.id, "error": f"{type(exc).__name__}: {exc}"})
            else:
                write_json(path, {**result, **self.tags(run, key)})  # before the claim goes: no rank retrains it
                self.estimator.add(run, result)
                self.log_result(title, i, todo, run, result)
            finally:
                (self.claims / run.id).unlink(missing_ok=True)
        self.barrier()
        results = [r for r in map(self.finished, runs) if r]
        return results, [run.id for run in runs if not self.finished(run)]

    @staticmethod
    def tags(run, key) -> dict:
        return {"key": key, "id": run.id, "stage": run.stage, "budget": run.budget, "seed": run.seed,
                "lr_mult": run.lr_mult, "batch": run.batch_size, "lr": run.lr}

    def log_result(self, title, i, todo, run, result):
        left = [r for r in todo[i + 1:] if not (self.runs_dir / f"{r.id}.json").exists()]
        eta = sum(self.estimator.seconds(r) or 0.0 for r in left) / self.world
        self.log(f"[{title} {i + 1}/{len(todo)}] {run.id}: loss {result['val_loss']:.4f} "
                 f"({data_mod.bits_per_byte(result['val_loss'], self.meta['val_tokens_per_byte']):.3f} bits/byte) in "
                 f"{result['train_seconds']:.1f} s, {result['tokens_per_s']:,.0f} tok/s"
                 + (f", MFU {result['mfu']:.1%}" if result["mfu"] else "")
                 + (f"; about {_fmt_seconds(eta)} left in this stage" if left and self.estimator.cuda else ""))

    # ----------------------------------------------------------------------------------------
    def fitted_once(self, name: str, ids: list[str], make) -> dict:
        """``name`` (a JSON in the output folder) made by rank 0 from ``make()`` unless it was already
        made from the same runs (so a resumed sweep keeps what its runs were planned with)."""
        saved = read_json(self.out / name)
        if self.rank == 0 and not (saved and saved.get("runs") == ids):
            write_json(self.out / name, {**make(), "runs": ids})
        self.barrier()
        return read_json(self.out / name)

    def lr_stage(self, design, models) -> tuple[LRRule | None, dict, list[dict], list[str]]:
        """The learning-rate sweep, extended round by round where a best rate is an edge of those
        tried; the rule fitted from it (None while runs are missing)."""
        kappa = LRRule().kappa
        runs = design.lr_sweep(models, self.hp)
        for round_ in range(design.lr_rounds + 1):
            results, missing = self.execute(runs, "lr")
            if missing:
                return None, {"ok": False, "groups": []}, results, missing
            groups = fit.fit_lr_rule(results, kappa)["groups"]
            more = [r for r in design.lr_extension(groups, runs, self.hp) if r.id not in {x.id for x in runs}]
            if not more or round_ == design.lr_rounds:
                break
            self.log(f"learning-rate sweep: {len(more)} size(s) best at an edge of the rates tried; one more rate each")
            runs += more
        ids = sorted(r["id"] for r in results)
        lr_fit = self.fitted_once("lr_rule.json", ids, lambda: fit.fit_lr_rule(results, kappa))
        rule = read_rule(self.out) or LRRule()
        lr_fit["source"] = rule.source
        self.log(f"learning-rate rule: c = {rule.c:.3g}, gamma = {rule.gamma:.3f} ({rule.source})")
        return rule, lr_fit, results, []

    def centres(self, design, lower_results: list[dict]) -> tuple[dict | None, dict]:
        """The upper budgets' window centres and spans (``design.centre_plan``) from the lower budgets'
        IsoFLOP runs, saved in ``centres.json``."""
        upper = design.budgets()[design.lower_budgets:]
        sweep = [r for r in lower_results if r["stage"] == "sweep" and r["val_loss"] is not None]

        def make():
            a2 = fit.approach2(sweep)
            plan = centre_plan(sweep, a2["fit_n"], a2["optima"], upper, design.span)
            return {**plan, "fit_n": a2["fit_n"], "centres": {f"{k:g}": v for k, v in plan["centres"].items()},
                    "spans": {f"{k:g}": v for k, v in plan["spans"].items()}}
        saved = self.fitted_once("centres.json", sorted(r["id"] for r in sweep), make)
        self.log(f"upper budgets' windows: {saved['source']}")
        return read_centres(self.out), read_spans(self.out)

    def main(self) -> int:
        """The sweep, restored first from ``--restore`` and packed last into ``--archive`` (also when
        cut short or failed: what finished is kept); deterministic kernels on GPU unless
        ``--nondeterministic``."""
        a = self.args
        if a.restore and self.rank == 0:
            if Path(a.restore).is_file():
                self.log(f"restored {unpack(Path(a.restore), self.out)} files from {a.restore} into {self.out}")
            else:
                self.log(f"--restore: no archive at {a.restore}: starting from what {self.out} holds")
        self.barrier()
        deterministic = self.device.type == "cuda" and not a.nondeterministic
        set_deterministic(deterministic)
        try:
            return self.sweep()
        finally:
            set_deterministic(False)
            if a.archive and self.rank == 0:
                self.log(f"packed {pack(self.out, Path(a.archive))} files of {self.out} into {a.archive}")

    def sweep(self) -> int:
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
        models = ladder_models(vocab, a.seq_len, a.head_dim, ladder, qk_norm=a.qk_norm)
        if corpus is not None:
            self.train_tokens = torch.from_numpy(corpus.train).to(self.device)
            val = torch.from_numpy(corpus.val).to(self.device)
            self.val_windows = {"final": eval_windows(val, a.seq_len, a.eval_tokens),
                                "curve": eval_windows(val, a.seq_len, a.curve_eval_tokens)}
        results, missing = [], []
        if a.lr is not None:
            rule = LRRule(c=a.lr, gamma=a.lr_gamma, source="--lr")
            lr_fit = {"ok": True, "c": rule.c, "gamma": rule.gamma, "kappa": rule.kappa, "groups": [], "source": "--lr"}
        else:
            rule, lr_fit, results, missing = self.lr_stage(design, models)
        if rule is not None:
            lower, missing = self.execute(design.lower(models, rule, self.hp), "lower")
            results += lower
            if not missing:
                upper, missing = self.execute(design.upper(models, rule, self.hp, *self.centres(design, lower)), "upper")
                results += upper
        if missing:
            self.incomplete(missing)
        if self.rank == 0 and results:
            self.write_report(results, lr_fit)
        self.log(f"total wall-clock {_fmt_seconds(time.perf_counter() - self.t_start)}")
        self.barrier()
        if self.rank == 0 and self.claims.is_dir() and not any(self.claims.iterdir()):
            self.claims.rmdir()
        if self.dist is not None:
            self.dist.destroy_process_group()
        return EXIT_INCOMPLETE if missing else 0

    def incomplete(self, missing: list[str]):
        failed = [m for m in missing if (self.runs_dir / f"{m}.failed.json").exists()]
        self.log(f"{len(missing)} run(s) of this stage not finished ({len(failed)} failed); "
                 + ("rerun the same command to resume" if not self.args.fit_only else "train them first"))

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
                "deterministic": sorted({r.get("deterministic", False) for r in results}),
                "ops": sorted({str(r["ops"]) for r in results})}
        an = report.write(info, results, lr_fit, self.meta, self.out, self.args.bootstrap)
        boot = an["bootstrap"] or {}

        def est(key, fit_, name):
            v = fit_.get(name)
            return "n/a" if v is None else f"{v:.3f}" + (f" [{boot[key]['lo']:.3f}, {boot[key]['hi']:.3f}]" if key in boot else "")
        self.log(f"quality gate: {an['gate']['ok']}: {an['gate']['reason']}")
        for k, name in (("1", "approach1"), ("2", "approach2"), ("3", "approach3")):
            self.log(f"approach {k}: a = {est(f'a{k}_a', an[name], 'a')}, b = {est(f'a{k}_b', an[name], 'b')}")
        self.log(surface.describe_e(an["e_profile"]))
        ex = an["extrapolation"]
        if ex.get("approach3_error") is not None:
            self.log(f"extrapolation to {ex['budget']:.3g} FLOPs: optimal loss error {ex['approach3_error']:+.4f} nats/token")
        self.log(f"wrote {self.out / 'report.md'}, report.json and {len(an['figures'])} figures"
                 + (f" ({len(an['figures_skipped'])} not drawn: see report.md)" if an["figures_skipped"] else ""))
