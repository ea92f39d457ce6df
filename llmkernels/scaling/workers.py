"""The training processes of a sweep: one process per GPU (or several on a CPU), each taking the
next run of a stage as it comes free. The runs are independent: where a run trains does not change
it (deterministic kernels), only when the stage ends. The parent process keeps the plan, the fits
and the archive; with one process the parent trains the runs itself (``Local``).

A run's result is written (``runs/<id>.json``) by the process that trained it, before the parent
hears of it, so that a parent killed at any moment loses only the runs in flight.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
import traceback
from collections import defaultdict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .plan import Run
from .store import write_json
from .train import TimeUp, TrainConfig, eval_windows, set_deterministic, train_run

POLL_SECONDS = 2.0  # how often the parent looks for a training process that died
CLOSE_SECONDS = 30.0  # how long a training process may take to exit when the sweep ends
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Setup:
    """What every training process needs besides its device and the data: the held-out windows'
    sizes and how to train."""

    seq_len: int
    eval_tokens: int
    curve_eval_tokens: int
    dtype: str
    deterministic: bool
    capture: bool
    ckpt_interval: float
    progress: bool
    threads: int | None = None  # CPU threads of each process (None: torch's default)
    runs_per_device: int = 1  # runs a process trains at once, each in a thread with its own CUDA stream


@dataclass(frozen=True)
class Task:
    """One run to train: its plan record, training configuration, result key and the tags its
    record carries, the tokens' folder (``data/<fingerprint>/``); ``start_by`` (``time.time()``) and
    ``predicted`` seconds (of the steps left) decide whether it starts, ``deadline`` when it stops."""

    run: Run
    train: TrainConfig
    key: dict
    tags: dict
    data_dir: str
    runs_dir: str
    ckpt_path: str
    deadline: float | None = None
    start_by: float | None = None
    predicted: float | None = None


def start_device(setup: Setup, device: str) -> dict:
    """The process's device (its CUDA context made now, while the parent may still build the data)
    and deterministic mode; the data comes with the first task (``with_data``)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif setup.threads:
        torch.set_num_threads(setup.threads)
    set_deterministic(setup.deterministic and dev.type == "cuda")  # before the first matrix product
    torch.zeros(1, device=dev)
    return {"setup": setup, "device": dev, "dtype": getattr(torch, setup.dtype), "data_dir": None,
            "data_lock": threading.Lock()}


def with_data(state: dict, data_dir: str) -> dict:
    """``state`` with the tokens of ``data_dir`` and the held-out windows on its device (loaded once)."""
    if state["data_dir"] != data_dir:
        setup, dev, data = state["setup"], state["device"], Path(data_dir)
        val = torch.from_numpy(np.load(data / "val.npy")).to(dev)
        state.update(data_dir=data_dir, train=torch.from_numpy(np.load(data / "train.npy")).to(dev),
                     windows={"final": eval_windows(val, setup.seq_len, setup.eval_tokens),
                              "curve": eval_windows(val, setup.seq_len, setup.curve_eval_tokens)})
    return state


def diverged_record(run: Run, tcfg: TrainConfig, exc, device, train_tokens: int) -> dict:
    """The record of a run whose loss went non-finite: a result (no loss) so that it is not retried;
    the learning-rate sweep counts it as the worst rate, the fits leave it out."""
    m = run.model
    return {"name": m.name, "backend": run.backend, "model": m.to_dict(), "train": asdict(tcfg),
            "params": m.total_params(), "non_embedding_params": m.non_embedding_params(), "steps": run.steps,
            "tokens": run.tokens, "compute": run.compute, "val_loss": None, "diverged": f"{exc}", "curve": [],
            "train_seconds": 0.0, "wall_seconds": 0.0, "epochs": run.tokens / max(1, train_tokens),
            "device": str(device), "captured": False, "ops": {}, "tokens_per_s": 0.0, "mfu": None}


def run_task(state: dict, task: Task, position: int = 0, log=print) -> dict:
    """Train ``task``'s run unless its predicted end is past its ``start_by``; the outcome's ``status``:
    done (with ``result``), diverged, failed (``error``), timeup (checkpointed) or skipped."""
    run, setup, out = task.run, state["setup"], {"id": task.run.id, "run": task.run}
    if task.start_by is not None and task.predicted is not None and time.time() + task.predicted > task.start_by:
        return {**out, "status": "skipped"}
    with state["data_lock"]:  # (the runs trained at once in a process load the tokens once)
        state = with_data(state, task.data_dir)
    path = Path(task.runs_dir) / f"{run.id}.json"
    deadline = None if task.deadline is None else time.perf_counter() + (task.deadline - time.time())
    try:
        result = train_run(run.model, task.train, state["train"], state["windows"], backend=run.backend,
                           device=state["device"], dtype=state["dtype"], key=task.key, capture=setup.capture,
                           beside_others=setup.runs_per_device > 1,
                           ckpt_path=task.ckpt_path, ckpt_interval=setup.ckpt_interval, deadline=deadline,
                           progress=setup.progress, position=position, desc=run.id, log=log)
    except TimeUp as exc:
        return {**out, "status": "timeup", "error": str(exc)}
    except FloatingPointError as exc:
        write_json(path, {**diverged_record(run, task.train, exc, state["device"], state["train"].numel()), **task.tags})
        return {**out, "status": "diverged", "error": str(exc)}
    except (RuntimeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        write_json(Path(task.runs_dir) / f"{run.id}.failed.json", {"run": run.id, "error": error})
        return {**out, "status": "failed", "error": error}
    # (written before the parent hears of it)
    write_json(path, {**result, **task.tags, "process": os.getpid(), "slot": position})
    return {**out, "status": "done", "result": result}


class Local:
    """One training process: the parent itself, on ``device``, one run at a time."""

    workers = 1

    def __init__(self, setup: Setup, device: str, log=print):
        self.setup, self.device, self.log, self.state, self.pending = setup, device, log, None, deque()

    def run(self, items, make):
        """Outcomes of ``make(item)``'s tasks, in order; ``stop`` drops those not started."""
        if self.state is None:
            self.state = start_device(self.setup, self.device)
        self.pending = deque(items)
        while self.pending:
            yield run_task(self.state, make(self.pending.popleft()), log=self.log)

    def stop(self):
        self.pending.clear()

    def close(self, abort: bool = False):
        set_deterministic(False)


def _die_with_parent():
    """On Linux, end this process when its parent dies (a call killed at its time limit leaves no
    training process behind holding a GPU)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _serve(index: int, setup: Setup, device: str, tasks, results):
    """A training process: start ``device``, then train each task it is given, ``runs_per_device``
    at once (each in a thread of its own, on its own CUDA stream)."""
    _die_with_parent()
    try:
        state = start_device(setup, device)
    except Exception:  # noqa: BLE001 - any failure to start is reported, not raised in a child
        results.put(("dead", index, traceback.format_exc()))
        return
    if setup.runs_per_device == 1:
        _train_tasks(index, index, state, tasks, results)
        return
    slots = [threading.Thread(target=_train_tasks_on_a_stream, args=(index, index * setup.runs_per_device + slot,
                                                                      state, tasks, results), daemon=True)
             for slot in range(setup.runs_per_device)]
    for thread in slots:
        thread.start()
    for thread in slots:
        thread.join()


def _train_tasks(index: int, position: int, state: dict, tasks, results):
    """Train the tasks of the queue until its end marker, telling the parent each start and end."""
    device = state["device"]
    while (task := tasks.get()) is not None:
        results.put(("start", index, task.run.id))
        try:
            outcome = run_task(state, task, position=position, log=lambda msg: print(f"[{device}] {msg}", flush=True))
        except Exception:  # noqa: BLE001 - a run's crash fails that run, not the process
            outcome = {"id": task.run.id, "run": task.run, "status": "failed", "error": traceback.format_exc()}
        results.put(("done", index, outcome))


def _train_tasks_on_a_stream(index: int, position: int, state: dict, tasks, results):
    """``_train_tasks`` in a thread: the process's device (current per thread) and a CUDA stream of
    its own, so that its runs' kernels may overlap those of the process's other threads."""
    device = state["device"]
    if device.type != "cuda":
        _train_tasks(index, position, state, tasks, results)
        return
    torch.cuda.set_device(device)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        _train_tasks(index, position, state, tasks, results)


class Pool:
    """One spawned training process per entry of ``devices`` (``"cuda:0"``, ``"cpu"``, ...), each
    training ``runs_per_device`` runs at once; a run is handed out only when a process has room for
    it, so that ``stop`` drops exactly the runs not started."""

    def __init__(self, setup: Setup, devices: list[str], log=print):
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.tasks, self.results, self.log = ctx.Queue(), ctx.Queue(), log
        self.devices = list(devices)
        self.procs = [ctx.Process(target=_serve, args=(i, setup, d, self.tasks, self.results), daemon=True,
                                  name=f"llmkernels-scaling-{i}") for i, d in enumerate(self.devices)]
        for p in self.procs:
            p.start()
        self.at_once = setup.runs_per_device
        self.dead, self.holding, self.pending = set(), defaultdict(set), deque()

    @property
    def workers(self) -> int:
        """Runs the live processes can train at once."""
        return (len(self.procs) - len(self.dead)) * self.at_once

    def _next(self):
        while True:
            try:
                return self.results.get(timeout=POLL_SECONDS)
            except queue_mod.Empty:
                for i, p in enumerate(self.procs):
                    if i not in self.dead and not p.is_alive():
                        return "dead", i, f"exit code {p.exitcode}"

    def run(self, items, make):
        """Outcomes of ``make(item)``'s tasks as they finish (a task is made when it is handed out)."""
        self.pending, outstanding = deque(items), 0
        while self.pending or outstanding:
            while self.pending and outstanding < self.workers:
                self.tasks.put(make(self.pending.popleft()))
                outstanding += 1
            if not self.workers:
                return
            kind, index, payload = self._next()
            if kind == "start":
                self.holding[index].add(payload)
            elif kind == "done":
                self.holding[index].discard(payload["id"])
                outstanding -= 1
                yield payload
            else:
                self.dead.add(index)
                self.log(f"training process {index} ({self.devices[index]}) died: {payload}")
                for lost in sorted(self.holding.pop(index, ())):
                    outstanding -= 1
                    yield {"id": lost, "run": None, "status": "failed", "error": f"its process died: {payload}"}

    def stop(self):
        self.pending.clear()

    def close(self, abort: bool = False):
        """Let each process finish its run and exit (``abort``: end them now)."""
        for _ in range(len(self.procs) * self.at_once):  # an end marker for every thread
            self.tasks.put(None)
        for p in self.procs:
            if abort:
                p.terminate()
            p.join(timeout=CLOSE_SECONDS)
            if p.is_alive():
                p.kill()
