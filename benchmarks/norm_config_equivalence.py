"""Check that the norm's launch configurations as data (``llmkernels/ops/norm/configs.py``) choose
exactly what the functions they replaced chose, and that the launchers launch the same kernels
with the same constexprs, launch options, grids and arguments. On CPU, no kernel runs.

1. Selection: the old functions (``_fwd_config``, ``_fwd_split_config``, ``_bwd_config``,
   ``_split_config`` of commit ``--old``, as its launchers combined them) against
   ``forward_config`` / ``backward_config`` (with the launchers' fallback where a split grid
   cannot run), for every norm kind, dtype, residual add, one weight row or several, row split
   possible or not, SM count (0: unknown, 4: the interpreter's, 132: H100), rows M (decode,
   small, large) and row widths N: every N from 1 to 262144 for the main keys (``--full``: for
   every key), else every N to 2048, every multiple of p / 32 +-1 between p / 2 and p for each
   power of two p (every edge of every rule is one), every multiple of 8192 +-1 and 2000 random
   widths.
2. Launches: the old and the new launchers (``_norm_fwd`` / ``_norm_bwd`` against ``norm_fwd`` /
   ``norm_bwd``), each in its own process on its own tree, on meta tensors with the device
   queries of a 132-SM H100 stood in and every kernel launch recorded instead of run; the
   records compared one by one (weight, bias, residual, per-head weights, statistics, Llama
   rounding, dresidual shared or not, the row split on or off).

    python benchmarks/norm_config_equivalence.py [--old 95a6505] [--full]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDEST = 262144
DTYPES = ("float32", "bfloat16", "float16")
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 100, 131, 132, 133, 200, 255, 256, 257, 264, 265, 300, 528,
        1000, 4096, 65536)
SMS = (0, 4, 132)


def dense_widths(full: bool) -> list[int]:
    if full:
        return list(range(1, WIDEST + 1))
    widths = set(range(1, 2049)) | set(random.Random(0).sample(range(1, WIDEST + 1), 2000))
    for p in (2**k for k in range(12, 19)):
        widths |= {v for j in range(16, 33) for v in (j * p // 32 - 1, j * p // 32, j * p // 32 + 1)}
    widths |= {v for k in range(1, WIDEST // 8192 + 1) for v in (8192 * k - 1, 8192 * k, 8192 * k + 1)}
    return sorted(v for v in widths if 1 <= v <= WIDEST)


def load_old(rev: str) -> dict:
    """The old configs module of ``rev``, run with the two helpers it imports."""
    source = subprocess.run(["git", "-C", REPO, "show", f"{rev}:llmkernels/ops/norm/configs.py"], check=True,
                            capture_output=True, text=True).stdout
    from llmkernels.ops._args import cdiv, next_pow2

    source = re.sub(r"from \.\._\w+ import cdiv, next_pow2\n", "", source)
    namespace = {"cdiv": cdiv, "next_pow2": next_pow2, "__name__": "old_norm_configs"}
    exec(compile(source, f"{rev}:llmkernels/ops/norm/configs.py", "exec"), namespace)
    return namespace


def typed(values) -> tuple:
    """Values with their types: a constexpr of 1 and one of True are not the same kernel."""
    return tuple((type(v).__name__, v) for v in values)


def compare_selection(rev: str, full: bool) -> int:
    import torch

    from llmkernels.ops import norm as new

    old = load_old(rev)
    dense = dense_widths(True)
    sparse = dense_widths(full)
    checked = mismatches = 0
    start = time.time()
    for is_rms, dname, residual, heads1, sms, m in itertools.product((True, False), DTYPES, (False, True),
                                                                     (True, False), SMS, ROWS):
        dtype = getattr(torch, dname)
        es = dtype.itemsize
        main_key = heads1 and sms == 132 and m in (8, 4096)
        for grid_ok in ((True, False) if heads1 else (False,)):
            for n in (dense if main_key else sparse):
                # forward: the old launcher took the split where FWD_SPLIT had the case and its grid could run
                split = old["_fwd_split_config"](is_rms, es, residual, n) if heads1 else None
                old_fwd = ("split",) + typed(split) if split is not None and grid_ok else (
                    ("rows",) + typed(old["_fwd_config"](n, m, is_rms, sms, es, residual)))
                key = new.NormKey(is_rms, dtype, residual, n, m, sms, heads1)
                cfg = new.forward_config(key)
                if isinstance(cfg, new.SplitFwdConfig) and not grid_ok:
                    cfg = new.forward_config(key._replace(split=False))
                new_fwd = (("split",) + typed((cfg.block_n, cfg.num_warps, cfg.per_sm))
                           if isinstance(cfg, new.SplitFwdConfig) else
                           ("rows",) + typed((cfg.block_m, cfg.block_n, cfg.num_warps, cfg.one_pass, cfg.early_w,
                                              cfg.tail_n)))
                # backward: the decode rule with one weight row only; the split for what was not one pass
                rows = old["_bwd_config"](n, m, is_rms, sms if heads1 else 0, es)
                old_bwd = (("split",) + typed(old["_split_config"](is_rms, dtype)) if not rows[3] and heads1 and grid_ok
                           else ("rows",) + typed(rows))
                key = new.NormKey(is_rms, dtype, residual, n, m, sms if heads1 else 0, heads1)
                cfg = new.backward_config(key)
                if isinstance(cfg, new.SplitBwdConfig) and not grid_ok:
                    cfg = new.backward_config(key._replace(split=False))
                new_bwd = (("split",) + typed((cfg.block_n, cfg.num_warps, cfg.stages, cfg.w_packed))
                           if isinstance(cfg, new.SplitBwdConfig) else
                           ("rows",) + typed((cfg.block_m, cfg.block_n, cfg.num_warps, cfg.one_pass, cfg.per_sm,
                                              cfg.max_programs, cfg.prefetch, cfg.tail_n)))
                checked += 1
                if old_fwd != new_fwd or old_bwd != new_bwd:
                    mismatches += 1
                    if mismatches <= 20:
                        print(f"MISMATCH rms={is_rms} {dname} res={residual} heads1={heads1} sms={sms} m={m} n={n} "
                              f"grid_ok={grid_ok}\n  fwd old {old_fwd}\n      new {new_fwd}\n"
                              f"  bwd old {old_bwd}\n      new {new_bwd}", flush=True)
    print(f"selection: {checked} keys (each forward and backward), {mismatches} differ "
          f"({time.time() - start:.0f} s)", flush=True)
    return mismatches


# --------------------------------------------------------------------------------------------
# launches, recorded in a process per tree
# --------------------------------------------------------------------------------------------
H100_SMS, H100_SHARED = 132, 232448
LAUNCH_WIDTHS = sorted({v for p in range(4, 19) for v in (2**p - 1, 2**p, 2**p + 1)}
                       | {100, 2304, 2560, 3584, 4353, 4608, 5120, 6144, 6145, 8705, 9216, 10240, 12288, 12289, 16385,
                          20480, 24576, 28672, 36864, 40960, 40961, 45056, 49152, 49153, 65537, 70000, 100000, 131073})
LAUNCH_ROWS = (1, 5, 8, 16, 100, 256, 300, 4096)


def _with_options(launchers, fwd, bwd):
    """``fwd`` and ``bwd`` that take one ``NormOptions`` record, called with the older positional
    arguments."""
    def options(x_dtype, bias_dtype, res_dtype, heads, eps, offset, is_rms, round_x_hat, out_dtype, h_dtype):
        return launchers.NormOptions(is_rms, round_x_hat, heads, eps, offset, out_dtype, h_dtype, x_dtype, res_dtype,
                                     bias_dtype)

    def positional_fwd(x, w, b, r, *args):
        *rest, store_stats = args
        return fwd(x, w, b, r, options(x.dtype, None if b is None else b.dtype, None if r is None else r.dtype, *rest),
                   store_stats=store_stats)

    def positional_bwd(dy, dh, xin, w, bias_dtype, mean, rstd, heads, offset, is_rms, round_x_hat, x_dtype, res_dtype,
                       share_dres=False):
        return bwd(dy, dh, xin, w, mean, rstd,
                   options(x_dtype, bias_dtype, res_dtype, heads, 0.0, offset, is_rms, round_x_hat, x_dtype, res_dtype),
                   share_dres=share_dres)
    return positional_fwd, positional_bwd


def record(tree: str, out: str) -> None:
    """Run every case through the launchers of ``tree``, recording each launch instead of running it."""
    sys.path.insert(0, tree)
    import torch

    from llmkernels.ops import _launch, _rowsplit
    from llmkernels.ops.norm import launchers

    assert launchers.__file__.startswith(tree), launchers.__file__
    fwd = getattr(launchers, "norm_fwd", None) or launchers._norm_fwd
    bwd = getattr(launchers, "norm_bwd", None) or launchers._norm_bwd
    if hasattr(launchers, "NormOptions"):  # a tree whose launchers take one options record: called as the older ones
        fwd, bwd = _with_options(launchers, fwd, bwd)
    launches = []

    def recorded(self, grid, *args):
        launches.append([self.kernel.fn.__name__, list(grid), sorted((k, repr(v)) for k, v in self.options.items()),
                         [[str(a.dtype), list(a.shape)] if isinstance(a, torch.Tensor) else repr(a) for a in args]])

    def programs(device, per_sm):
        return H100_SMS * per_sm

    def stages_that_fit(stages, stage_bytes, device):  # fit_stages on an H100
        if stages < 2:
            return stages
        fit = 1 + (H100_SHARED - 8192) // stage_bytes
        return min(stages, fit) if fit >= 2 else 0

    _launch.Launcher.__call__ = recorded
    for module in (_launch, _rowsplit, launchers):
        module.persistent_programs = programs
    launchers.fit_stages = stages_that_fit
    _rowsplit.INTERPRET = False
    meta = torch.device("meta")
    cases = {}
    for (is_rms, dname, n, m, inputs, split) in itertools.product(
            (True, False), DTYPES, LAUNCH_WIDTHS, LAUNCH_ROWS, ("w", "none", "wb", "w32-res", "res32", "heads"),
            (True, False)):
        dtype = getattr(torch, dname)
        heads = 4 if inputs == "heads" else 1
        if inputs == "heads" and (m % heads or n > 4096):
            continue
        _rowsplit.ROW_SPLIT = split
        for plans in (getattr(launchers, "FWD_PLANS", None), getattr(launchers, "BWD_PLANS", None)):
            if plans is not None:  # (plans cached per key do not follow ROW_SPLIT: each case makes its own)
                plans.clear()
        x = torch.empty((m, n), dtype=dtype, device=meta)
        w_dtype = torch.float32 if inputs == "w32-res" else dtype
        w = None if inputs in ("none", "res32") else torch.empty((heads, n) if heads > 1 else (n,), dtype=w_dtype,
                                                                 device=meta)
        b = torch.empty(n, dtype=dtype, device=meta) if inputs == "wb" and not is_rms else None
        res_dtype = torch.float32 if inputs == "res32" else dtype
        r = torch.empty((m, n), dtype=res_dtype, device=meta) if inputs in ("w32-res", "res32") else None
        h_dtype = torch.float32 if r is not None and (res_dtype == torch.float32) else (None if r is None else dtype)
        for store_stats, round_x_hat in ((True, is_rms), (False, not is_rms)):
            del launches[:]
            y, h, mean, rstd = fwd(x, w, b, r, heads, 1e-6, 0.0, is_rms, round_x_hat, dtype, h_dtype, store_stats)
            outputs = [[str(t.dtype), list(t.shape)] if t is not None else None for t in (y, h, mean, rstd)]
            key = f"fwd rms={is_rms} {dname} n={n} m={m} {inputs} split={split} stats={store_stats} q={round_x_hat}"
            cases[key] = [outputs, list(launches)]
        _, h, mean, rstd = fwd(x, w, b, r, heads, 1e-6, 0.0, is_rms, is_rms, dtype, h_dtype, True)
        xin = x if h is None else h
        dh = None if h is None else torch.empty_like(h)
        for share in (False, True):
            del launches[:]
            grads = bwd(torch.empty_like(x), dh, xin, w, None if b is None else b.dtype, mean, rstd, heads, 0.0, is_rms,
                        is_rms, dtype, None if r is None else res_dtype, share_dres=share)
            outputs = [[str(t.dtype), list(t.shape)] if t is not None else None for t in grads]
            cases[f"bwd rms={is_rms} {dname} n={n} m={m} {inputs} split={split} share={share}"] = [outputs,
                                                                                                 list(launches)]
    with open(out, "w") as f:
        json.dump(cases, f)


def compare_launches(rev: str) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = os.path.join(scratch, "old")
        os.makedirs(old_tree)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev, "llmkernels"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", old_tree], input=archive.stdout, check=True)
        recorded = {}
        for name, tree in (("old", old_tree), ("new", REPO)):
            out = os.path.join(scratch, f"{name}.json")
            env = dict(os.environ, PYTHONPATH=tree)
            env.pop("TRITON_INTERPRET", None)
            subprocess.run([sys.executable, __file__, "--record", tree, out], check=True, env=env, cwd=scratch)
            with open(out) as f:
                recorded[name] = json.load(f)
    old, new = recorded["old"], recorded["new"]
    assert old.keys() == new.keys()
    differ = [key for key in old if old[key] != new[key]]
    for key in differ[:10]:
        print(f"MISMATCH {key}\n  old {old[key]}\n  new {new[key]}", flush=True)
    kernels = sorted({launch[0] for case in old.values() for launch in case[1]})
    n_launches = sum(len(case[1]) for case in old.values())
    print(f"launches: {len(old)} calls, {n_launches} kernel launches ({', '.join(kernels)}), {len(differ)} differ",
          flush=True)
    return len(differ)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="95a6505", help="the commit whose selection functions are compared")
    ap.add_argument("--full", action="store_true", help="every width 1..262144 for every key (hours)")
    ap.add_argument("--record", nargs=2, metavar=("TREE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        record(*args.record)
        return
    sys.path.insert(0, REPO)
    differ = compare_launches(args.old) + compare_selection(args.old, args.full)
    print("same" if differ == 0 else f"{differ} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
