"""One GPU, one process: how close to its copy bandwidth each family runs, with the tuned cache and
with the derived heuristic alone, beside every installed peer.

Through ``llmkernels.bench`` (its ops, inputs, float64 checks, CUDA-graph timing under
``triton.testing.do_bench``, minimum bytes, and its peers' wrappers), bf16, 256 MiB tensors:
RMSNorm, LayerNorm and add + RMSNorm forward and backward at 11 widths (ragged ones included),
cross-entropy's forward and its forward + backward in place at V = 32000 / 128256 / 262144, RoPE
forward and backward. llmkernels runs twice: with its configuration source as installed (a
tuned cache where there is one: ``config_source`` "cache", else "heuristic"), then inside
``_device.heuristic_only()`` ("heuristic": no cache, no measured copy, as on an unknown GPU).
Each op's copy bandwidth is measured right before it (``bench.Runner``).

Writes ``benchmarks/results/portable/<gpu>-<date>.json`` (or ``--out``): ``{"header": {command,
date, device, versions, copy_gbps of each op}, "records": [{"op", "n", "dtype", "provider",
"fwd_pct", "bwd_pct", "config_source"}, ...]}`` (cross_entropy's ``bwd_pct``: forward +
backward in place). A run adds to the file of the same name, replacing its own records, so that
``--ops norm`` and ``--ops ce,rope`` make one summary in two calls.

    python benchmarks/portable.py --ops norm          # ~4-5 min on an H100 (peers' compiles included)
    python benchmarks/portable.py --ops ce,rope
    python benchmarks/portable.py --ops norm --widths 32768,131072 --providers llmkernels,quack
    TRITON_INTERPRET=1 python benchmarks/portable.py --tiny --out /tmp/p.json   # CPU: checks only
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import sys

from llmkernels.bench.registry import Provider, need_module, ops
from llmkernels.bench.runner import OpRunner, Settings, environment, script_device
from llmkernels.ops import _device

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORM_WIDTHS = (1024, 2304, 4096, 5120, 8192, 14336, 18432, 32768, 53248, 65536, 131072)
VOCABS = (32000, 128256, 262144)
ROPE_SEQ = (4096,)
PEERS = ("torch", "torch_fused", "torch_compile", "liger", "quack")
# family -> (bench op, its llmkernels provider, the modes of fwd_pct and bwd_pct)
FAMILIES = {
    "norm": [("rmsnorm", "llmkernels", ("fwd", "bwd")), ("layernorm", "llmkernels", ("fwd", "bwd")),
             ("add_rmsnorm", "llmkernels", ("fwd", "bwd"))],
    "ce": [("cross_entropy", "llmkernels_inplace", ("fwd", "fwd+bwd"))],
    "rope": [("rope", "llmkernels", ("fwd", "bwd"))],
}
FAMILY_OF = {name: family for family, entries in FAMILIES.items() for name, _, _ in entries}


def _quack_ce():
    ce = need_module("quack.cross_entropy", "quack-kernels (quack)").cross_entropy
    return lambda logits, target: ce(logits, target, inplace_backward=True)


def portable_op(name: str, ours: str, heuristic: bool, wanted):
    """The bench op ``name`` with llmkernels (its provider ``ours``, as "llmkernels") and, unless
    ``heuristic`` (llmkernels alone), the installed peers among ``wanted``."""
    op = ops()[name]
    providers = {"llmkernels": op.providers[ours]}
    if not heuristic:
        peers = dict(op.providers)
        if name == "cross_entropy":  # the bench times Quack's norms; its cross-entropy is added here
            peers["quack"] = Provider(_quack_ce, gpu_only=True, mutates=True)
        providers.update((p, peers[p]) for p in PEERS if p in peers)
    return dataclasses.replace(op, providers={p: v for p, v in providers.items() if wanted is None or p in wanted})


def run(families, widths, providers, device, log) -> tuple:
    """Records of every family under each configuration source (the installed one with the
    peers, then the heuristic alone where a cache is installed), and each op's copy GB/s."""
    sizes = {"norm": widths, "ce": VOCABS, "rope": ROPE_SEQ}
    sources = [("heuristic", contextlib.nullcontext)]
    if _device.tuned_of(device).path is not None:
        sources = [("cache", contextlib.nullcontext), ("heuristic", _device.heuristic_only)]
    records, copies = [], {}
    for source, context in sources:
        alone = context is _device.heuristic_only
        for name, ours, modes in (entry for family in families for entry in FAMILIES[family]):
            settings = Settings(ops=[name], dtypes=["bf16"], sizes=list(sizes[FAMILY_OF[name]]), modes=modes,
                                decode=False, eager=False)
            runner = OpRunner(portable_op(name, ours, alone, providers), settings, device, log)
            with context():
                found = runner.run()
            copies[f"{name} ({source})"] = runner.copy_gbps
            records += summarise(found, modes, source)
    return records, copies


def summarise(records: list, modes: tuple, source: str) -> list:
    """One record per (op, size, provider): % of copy of the two modes (None where not timed)."""
    rows: dict = {}
    for r in records:
        if r["mode"] not in modes:
            continue
        row = rows.setdefault((r["op"], r["size"], r["provider"]), {
            "op": r["op"], "n": r["size"], "dtype": r["dtype"], "provider": r["provider"], "fwd_pct": None,
            "bwd_pct": None, "config_source": source if r["provider"] == "llmkernels" else None})
        row["fwd_pct" if r["mode"] == modes[0] else "bwd_pct"] = (
            None if r["pct_copy"] is None else round(r["pct_copy"], 1))
        if r["status"] not in ("ok", None):
            row.setdefault("notes", []).append(f"{r['mode']}: {r['status']} {r.get('note') or ''}".strip())
    return list(rows.values())


def merge(path: str, header: dict, records: list) -> dict:
    """The summary at ``path`` with ``records`` in place of its records of the same op, size,
    provider and source, and this run's header (earlier runs' commands and copies kept)."""
    old = {"header": {}, "records": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    key = lambda r: (r["op"], r["n"], r["provider"], r["config_source"])  # noqa: E731
    new = {key(r) for r in records}
    kept = [r for r in old["records"] if key(r) not in new]
    commands = [*old["header"].get("commands", []), header["command"]]
    copies = {**old["header"].get("copy_gbps", {}), **header["copy_gbps"]}
    return {"header": {**old["header"], **header, "commands": commands, "copy_gbps": copies},
            "records": kept + records}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="norm,ce,rope", help="families, comma-separated: norm, ce, rope")
    p.add_argument("--widths", help="norm widths, comma-separated (default: 11 widths 1024-131072)")
    p.add_argument("--providers", help="llmkernels and peers to run, comma-separated (default: all installed)")
    p.add_argument("--out", help="the summary file (default benchmarks/results/portable/<gpu>-<date>.json)")
    p.add_argument("--tiny", action="store_true", help="CPU: the checks only, at the ops' small shapes")
    args = p.parse_args(argv)
    families = args.ops.split(",")
    if set(families) - set(FAMILIES):
        p.error(f"--ops: choose from {', '.join(FAMILIES)}")
    device = script_device(args.tiny, p.error)
    widths = tuple(int(n) for n in args.widths.split(",")) if args.widths else NORM_WIDTHS
    wanted = args.providers.split(",") if args.providers else None
    records, copies = run(families, widths, wanted, device, lambda line: print(line, file=sys.stderr, flush=True))
    env = environment(device)
    date = datetime.date.today().isoformat()
    path = args.out or os.path.join(REPO, "benchmarks", "results", "portable",
                                    f"{_device.slug(env['device'])}-{date}.json")
    header = {**env, "command": "python benchmarks/portable.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "copy_gbps": copies, "installed_config_source": _device.tuned_of(device).source,
              "modes": {"fwd_pct": "forward", "bwd_pct": "backward (cross_entropy: forward + backward in place)"}}
    summary = merge(path, header, records)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    for r in records:
        print(f"{r['op']:<14} {r['n']:>7} {r['provider']:<14} {r['config_source'] or '':<10} "
              f"fwd {r['fwd_pct']}  bwd {r['bwd_pct']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
