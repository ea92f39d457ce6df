"""Executing a sweep: the data, each stage's runs handed to the training processes (``workers``:
one per GPU, or the parent itself), skipped when finished, resumed from checkpoints, the
learning-rate rule, the windows of the upper budgets, the archive after every finished run, and
the report."""
from __future__ import annotations

import datetime as dt
import math
import pickle
import platform
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from . import data as data_mod
from . import fit, report, surface
from .design import centre_plan, design_from, models_from, run_order
from .plan import ADMIT_QUANTILE, Estimator, LRRule
from .store import pack, read_centres, read_json, read_rule, read_spans, restore, write_json
from .train import TrainConfig, set_deterministic
from .workers import Local, Pool, Setup, Task

EXIT_INCOMPLETE = 3


def _fmt_seconds(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def devices_for(args) -> tuple[bool, list[str]]:
    """(cuda, the training processes' devices): ``--workers`` GPUs (default every visible one), or
    ``--workers`` CPU processes (default one)."""
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is available")
    if args.workers is not None and args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    if args.runs_per_device < 1:
        raise SystemExit(f"--runs-per-device must be >= 1, got {args.runs_per_device}")
    if not cuda:
        return False, ["cpu"] * (args.workers or 1)
    count = torch.cuda.device_count()
    if (args.workers or count) > count:
        raise SystemExit(f"--workers {args.workers}: only {count} GPU(s) visible (one training process per GPU)")
    return True, [f"cuda:{i}" for i in range(args.workers or count)]


class Session:
    """One invocation of ``llmkernels scaling``."""

    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        self.cuda, self.devices = devices_for(args)
        self.dtype_name = "bfloat16" if (args.dtype == "bf16" or (args.dtype == "auto" and self.cuda)) else "float32"
        self.out = Path(args.out)
        self.runs_dir, self.ckpt_dir = self.out / "runs", self.out / "checkpoints"
        self.deadline = None if args.time_limit is None else time.time() + args.time_limit
        self.start_by = self.deadline if args.horizon is None else time.time() + args.horizon
        device_name = torch.cuda.get_device_name(self.devices[0]) if self.cuda else "cpu"
        self.estimator, self.timed = Estimator(self.cuda, device_name), set()
        self.t_start = time.time()
        self.trainer = None

    def log(self, msg=""):
        print(msg, flush=True)

    # ----------------------------------------------------------------------------------------
    def data_config(self) -> data_mod.DataConfig:
        a = self.args
        return data_mod.DataConfig(path=a.data, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                                   heldout_frac=a.heldout_frac, max_bytes=a.max_bytes, seed=a.data_seed)

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

    def start_trainer(self):
        """The training processes: the parent itself with one device and one run at a time, else
        one spawned per device (each starts its device now and loads the tokens with its first run)."""
        a = self.args
        many = len(self.devices) > 1 or a.runs_per_device > 1
        setup = Setup(seq_len=a.seq_len, eval_tokens=a.eval_tokens,
                      curve_eval_tokens=a.curve_eval_tokens, dtype=self.dtype_name,
                      deterministic=self.cuda and not a.nondeterministic, capture=not a.no_graph,
                      ckpt_interval=a.ckpt_interval, progress=not (a.no_progress or many),
                      threads=max(1, torch.get_num_threads() // len(self.devices)) if many else None,
                      runs_per_device=a.runs_per_device)
        self.trainer = Pool(setup, self.devices, self.log) if many else Local(setup, self.devices[0], self.log)
        at_once = f", {a.runs_per_device} runs at once in each" if a.runs_per_device > 1 else ""
        self.log(f"training on {', '.join(self.devices)}" + (f" (one process each{at_once})" if many else ""))

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

    def task(self, run) -> Task:
        tcfg = self.train_config(run)
        key = self.key(run, tcfg)
        return Task(run=run, train=tcfg, key=key, tags=self.tags(run, key), data_dir=str(self.out / "data" / self.fingerprint),
                    runs_dir=str(self.runs_dir),
                    ckpt_path=str(self.ckpt_dir / f"{run.id}.pt"), deadline=self.deadline, start_by=self.start_by,
                    predicted=self.estimator.seconds(run, self.checkpointed_step(run, key), q=ADMIT_QUANTILE))

    def checkpointed_step(self, run, key) -> int:
        """The step ``run``'s checkpoint holds (0 without one of this key): where it resumes."""
        path = self.ckpt_dir / f"{run.id}.pt"
        if not path.exists():
            return 0
        try:  # (mapped, not read: only its small fields are looked at)
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            return 0
        return ckpt["step"] if ckpt.get("key") == key else 0

    def execute(self, runs, title: str) -> tuple[list[dict], list[str]]:
        """Train the runs not finished yet (``run_order``), packing the archive after each that
        finishes. Returns every finished result of ``runs`` and the ids still missing."""
        before = {run.id: self.finished(run) for run in runs}
        for run in runs:  # what earlier invocations measured predicts this one's runs
            if before[run.id] and run.id not in self.timed:
                self.timed.add(run.id)
                self.estimator.add(run, before[run.id])
        todo = [] if self.args.fit_only else [r for r in run_order(runs) if not before[r.id]]
        done, unfinished = 0, {r.id: r for r in todo}
        for out in self.trainer.run(todo, self.task) if todo else ():
            status, run = out["status"], out["run"]
            if status in ("done", "diverged", "failed"):
                unfinished.pop(out["id"], None)
            if status == "done":
                done += 1
                self.timed.add(run.id)
                self.estimator.add(run, out["result"])
                self.log_result(title, done, len(todo), run, out["result"], list(unfinished.values()))
            elif status == "timeup":
                self.log(out["error"])
                self.trainer.stop()
            elif status in ("diverged", "failed"):
                self.log(f"{out['id']}: {status.upper()}: {out['error']}")
            if status in ("done", "diverged"):
                self.pack()
        after = {run.id: self.finished(run) for run in runs}
        return [r for r in after.values() if r], [run_id for run_id, r in after.items() if not r]

    @staticmethod
    def tags(run, key) -> dict:
        return {"key": key, "id": run.id, "stage": run.stage, "budget": run.budget, "seed": run.seed,
                "lr_mult": run.lr_mult, "batch": run.batch_size, "lr": run.lr}

    def log_result(self, title, done, total, run, result, left):
        """One finished run, and the time of the stage's ``left`` runs (those in progress counted
        whole; those a horizon will not start in this invocation too)."""
        eta = sum(self.estimator.seconds(r) or 0.0 for r in left)
        self.log(f"[{title} {done}/{total}] {run.id}: loss {result['val_loss']:.4f} "
                 f"({data_mod.bits_per_byte(result['val_loss'], self.meta['val_tokens_per_byte']):.3f} bits/byte) in "
                 f"{result['train_seconds']:.1f} s, {result['tokens_per_s']:,.0f} tok/s"
                 + (f", MFU {result['mfu']:.1%}" if result["mfu"] else "")
                 + (f"; about {_fmt_seconds(eta / self.trainer.workers)} left in this stage" if left and eta else ""))

    def pack(self):
        if self.args.archive:
            pack(self.out, Path(self.args.archive))

    # ----------------------------------------------------------------------------------------
    def fitted_once(self, name: str, ids: list[str], make) -> dict:
        """``name`` (a JSON in the output folder) made from ``make()`` unless it was already made
        from the same runs on the same data (so a resumed sweep keeps what its runs were planned with;
        a record restored from a report names no data: its runs' own)."""
        saved = read_json(self.out / name)
        if not (saved and saved.get("runs") == ids and saved.get("data", self.fingerprint) == self.fingerprint):
            write_json(self.out / name, {**make(), "runs": ids, "data": self.fingerprint})
        return read_json(self.out / name)

    def lr_stage(self, design, models) -> tuple[LRRule | None, dict, list[dict], list[str]]:
        """The learning-rate sweep, extended round by round where a best rate is an edge of those
        tried or the shared rule's optimum lies beyond them; the rule fitted from it (None while runs
        are missing)."""
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
            self.log(f"learning-rate sweep: {len(more)} size(s) best at an edge of the rates tried or with the shared "
                     "rule's optimum beyond them; one more rate each")
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
        """The sweep, restored first from ``--restore`` and packed into ``--archive`` after every
        finished run and last (also when cut short, failed or terminated: what finished is kept)."""
        a = self.args
        if a.restore:
            self.log(restore(a.restore, self.out))
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
        aborted = True
        try:
            code = self.sweep()
            aborted = False
            return code
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
            if self.trainer is not None:
                self.trainer.close(abort=aborted)
            set_deterministic(False)
            if a.archive:
                self.log(f"packed {pack(self.out, Path(a.archive))} files of {self.out} into {a.archive}")

    def sweep(self) -> int:
        a = self.args
        if a.fit_only:
            self.meta = self.saved_meta()
        else:
            for d in (self.runs_dir, self.ckpt_dir):
                d.mkdir(parents=True, exist_ok=True)
            self.start_trainer()  # the training processes start their devices while the data is built
            try:
                self.meta = data_mod.prepare(self.data_config(), self.out / "data", log=self.log).meta
            except (OSError, ValueError, ImportError) as exc:
                raise SystemExit(f"llmkernels scaling: data preparation failed: {type(exc).__name__}: {exc}") from None
        self.fingerprint = self.meta["fingerprint"]
        if not a.fit_only:
            self.check_data()
        design, self.hp, ladder = design_from(a)
        vocab = 64 * math.ceil(self.meta["vocab_size"] / 64)  # padded for the tensor cores; the extra ids never occur
        models = models_from(a, vocab, ladder)
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
        if results:
            self.write_report(results, lr_fit, len(missing))
        self.log(f"total wall-clock {_fmt_seconds(time.time() - self.t_start)}")
        return EXIT_INCOMPLETE if missing else 0

    def check_data(self):
        """Stop before training when every finished run in the output folder was trained on another
        corpus (another machine's Python installation, another --data): the sweep would otherwise start
        over under the same name without a word."""
        prints = Counter(run["key"]["data"] for run in map(read_json, self.runs_dir.glob("*.json"))
                         if run and "key" in run)
        other = sum(n for fp, n in prints.items() if fp != self.fingerprint)
        if not other:
            return
        if self.fingerprint in prints:
            self.log(f"{other} finished run(s) of other data ignored")
            return
        saved_fp, runs = prints.most_common(1)[0]
        saved = read_json(self.out / "data" / saved_fp / "meta.json") or {}
        raise SystemExit(f"llmkernels scaling: the {runs} finished run(s) in {self.out} were trained on data {saved_fp}, "
                         f"but this machine's is {self.fingerprint}: {data_mod.difference(saved, self.meta)}. "
                         "Make the corpus the same (the same packages and Python, or the same --data) to resume, "
                         "or give a new --out to start another sweep.")

    def incomplete(self, missing: list[str]):
        failed = [m for m in missing if (self.runs_dir / f"{m}.failed.json").exists()]
        self.log(f"{len(missing)} run(s) of this stage not finished ({len(failed)} failed); "
                 + ("rerun the same command to resume" if not self.args.fit_only else "train them first"))

    def write_report(self, results: list[dict], lr_fit: dict, unfinished: int):
        device_name = ", ".join(sorted({r["device"] for r in results}))
        if self.args.fit_only:
            device_name += f" (fitted on {platform.processor() or platform.machine() or 'a CPU'})"
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        info = {"device": device_name, "date": dt.date.today().isoformat(),
                "command": "llmkernels scaling " + " ".join(sys.argv[1:] if self.argv is None else self.argv),
                "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
                "workers": len(self.devices), "runs_per_device": self.args.runs_per_device,
                "wall_seconds": time.time() - self.t_start,
                "captured": sorted({r["captured"] for r in results}),
                "deterministic": sorted({r.get("deterministic", False) for r in results}),
                "ops": sorted({str(r["ops"]) for r in results})}
        an = report.write(info, results, lr_fit, self.meta, self.out, self.args.bootstrap, self.args.fit_from,
                          centres=read_json(self.out / "centres.json"), unfinished=unfinished)
        ivals = an["intervals"] or {}

        def est(key):
            v = an["estimates"].get(key)
            iv = ivals.get(key)
            return "n/a" if v is None else f"{v:.3f}" + (f" [{iv['lo']:.3f}, {iv['hi']:.3f}]" if iv and iv["lo"] is not None else "")
        g = an["gate"]
        self.log(f"quality gate: {g['ok']}" + (f" (failed: {', '.join(g['failed'])})" if g["failed"] else "")
                 + (f" (not evaluated: {', '.join(g['not_evaluated'])})" if g["not_evaluated"] else ""))
        for k in ("1", "2", "3"):
            self.log(f"approach {k}: a = {est(f'a{k}_a')}, b = {est(f'a{k}_b')}")
        self.log(surface.describe_e(an["e_profile"]))
        ex = an["extrapolation"]
        if ex.get("approach3_error") is not None:
            self.log(f"extrapolation to {ex['budget']:.3g} FLOPs: optimal loss error {ex['approach3_error']:+.4f} nats/token")
        self.log(f"wrote {self.out / 'report.md'}, report.json and {len(an['figures'])} figures"
                 + (f" ({len(an['figures_skipped'])} not drawn: see report.md)" if an["figures_skipped"] else ""))


def _terminate(signum, frame):
    """SIGTERM (a time limit's kill): leave through ``finally``, so that the archive is packed."""
    raise SystemExit(128 + signum)
