"""One GPU, one process: the norms' strategies for wide rows side by side, against the copy
ceiling and Quack; and cross-entropy with its gradient written over the logits at large
vocabularies, against the library's own in-place path and Liger.

Every named strategy of ``llmkernels.tune.spaces.wide_row_candidates`` (the tables' choice, today's
paths, and the candidates: the pipelined split reading x through TMA, ``tma``, and writing y two
rows behind the row it loads, ``lag``) is a provider of the bench's op, and so is each of the
benchmark's own candidates (``EXPERIMENTS``: the norms and cross-entropy a row a thread-block
cluster, ``cluster_rows.py``, which needs Triton 3.7 or newer), beside the peers where they are
installed, at rows of 32K-128K columns and ragged ones (both norms' forward and backward) and at
vocabularies of 32K-256K (cross-entropy's forward and backward in one pass,
``cross-entropy-inplace``). Through ``llmkernels.bench`` (bf16, 256 MiB a tensor, 2 GiB of logits,
the float64 check of every provider, GPU time from CUDA-graph replay under
``triton.testing.do_bench``, the copy bandwidth measured before each part). A strategy that fails to
compile, launch or check is a record with its error, not the end of the run; one that kills the CUDA
context ends the process, so ``--skip`` / ``--only`` choose strategies by words of their names (the
providers a part names beside them always run) and the records are written after each width.

Writes ``<out>/wide_rows.json`` (``{"header": {device, date, versions, command, copy_gbps of
each part}, "records": [{"part", "n", "provider", "config", "pct_copy", "us", "status", "note"},
...]}``) and ``<out>/wide_rows.md`` (% of copy, a table a part), again after each part, so that
a run cut short keeps what it measured; past ``--budget-s`` no new width starts.

    python benchmarks/wide_rows.py --parts rmsnorm-fwd --out $OUT                  # one 10-minute call
    python benchmarks/wide_rows.py --parts rmsnorm-bwd,layernorm-bwd --out $OUT    # another
    python benchmarks/wide_rows.py --widths 32768,131072 --out $OUT                # every part, two widths
    python benchmarks/wide_rows.py --parts rmsnorm-fwd --skip tma --out $OUT       # all but the TMA candidates
    python benchmarks/wide_rows.py --parts rmsnorm-fwd --only tma,table --out $OUT # those and the tables' choice
    python benchmarks/wide_rows.py --parts cross-entropy-inplace --out $OUT        # its vocabularies
    TRITON_INTERPRET=1 python benchmarks/wide_rows.py --tiny --out /tmp/wide   # CPU: the checks only
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
import time
from typing import Callable, NamedTuple

import llmkernels
from llmkernels.bench.ops_norm import LN_EPS, RMS_EPS
from llmkernels.bench.registry import Provider, Unavailable, ops
from llmkernels.bench.report import write_texts
from llmkernels.bench.runner import OpRunner, Settings, environment, script_device
from llmkernels.ops import _device
from llmkernels.ops.norm import NormConfig
from llmkernels.tune.spaces import wide_row_candidates

from cluster_rows import (ClusterRows, cross_entropy_inplace_cluster, layer_norm_cluster, rms_norm_cluster,
                          why_not_here)

WIDTHS = (32768, 53248, 65536, 100000, 131072)
VOCABS = (32000, 128256, 262144)
TINY_SHAPES = ({"M": 3, "N": 1000},)


class Part(NamedTuple):
    """What a part measures: the bench op and mode at its default widths, beside the op's providers
    named in ``beside`` (the peers, and the library's own path where it has no strategies here);
    ``library``: the library's wide-row strategies are providers (the norms)."""

    op: str
    mode: str
    widths: tuple = WIDTHS
    beside: tuple = ("quack",)
    library: bool = True
    tiny: tuple = TINY_SHAPES


PARTS = {"rmsnorm-fwd": Part("rmsnorm", "fwd"), "rmsnorm-bwd": Part("rmsnorm", "bwd"),
         "layernorm-fwd": Part("layernorm", "fwd"), "layernorm-bwd": Part("layernorm", "bwd"),
         "cross-entropy-inplace": Part("cross_entropy", "fwd+bwd", VOCABS, ("llmkernels_inplace_unchecked", "liger"),
                                       library=False, tiny=({"M": 3, "V": 1000},))}


class Experiment(NamedTuple):
    """A candidate that is not (yet) a strategy of the library: ``call(*inputs, config=...)``
    under each of ``configs`` (by name); ``backward``: its backward is measured; ``in_place``: it
    forms the gradient in the forward, over its input."""

    call: Callable
    configs: dict
    backward: bool = False
    in_place: bool = False

    def provider(self, config) -> Provider:
        return Provider(functools.partial(_experiment, self.call, config), backward=self.backward or self.in_place,
                        mutates=self.in_place)


def _rms_cluster(x, weight, *, config):
    return rms_norm_cluster(x, weight, RMS_EPS, config)


def _ln_cluster(x, weight, bias, *, config):
    return layer_norm_cluster(x, weight, bias, LN_EPS, config)


CLUSTERS = {"cluster 16384": ClusterRows(16384), "cluster 8192": ClusterRows(8192)}
# (the backward holds x, dy, w and the dW / dB sums: 8192 columns a CTA of 8 warps is the most
# without spilling on sm_90, 173 registers for RMSNorm and 243 for LayerNorm, 233 and 249 with the
# next row's loads in flight; 4096 of 4 warps, as many registers a thread, leaves room for two
# CTAs an SM, up to 64K columns in a cluster of 16)
BWD_CLUSTERS = {"cluster 8192": ClusterRows(8192), "cluster 8192 prefetch": ClusterRows(8192, prefetch=True),
                "cluster 4096 prefetch": ClusterRows(4096, 4, per_sm=2, prefetch=True)}
EXPERIMENTS = {
    "rmsnorm-fwd": Experiment(_rms_cluster, CLUSTERS),
    "layernorm-fwd": Experiment(_ln_cluster, CLUSTERS),
    "rmsnorm-bwd": Experiment(_rms_cluster, BWD_CLUSTERS, backward=True),
    "layernorm-bwd": Experiment(_ln_cluster, BWD_CLUSTERS, backward=True),
    # (a 256K row over 8 CTAs of 16 warps, or over 16 CTAs, past the 8 a cluster is guaranteed)
    "cross-entropy-inplace": Experiment(cross_entropy_inplace_cluster,
                                        {"cluster 16384": ClusterRows(16384), "cluster 32768": ClusterRows(32768, 16)},
                                        in_place=True),
}


def experiments(part: str) -> dict:
    """The benchmark's own candidates of ``part``: {name: configuration}."""
    return EXPERIMENTS[part].configs if part in EXPERIMENTS else {}


def strategies(part: str, n: int) -> dict:
    """The strategies of ``part`` at rows of ``n``: the library's candidates, then the benchmark's own."""
    library = wide_row_candidates(n, PARTS[part].mode == "bwd") if PARTS[part].library else {}
    return {**library, **experiments(part)}


class Choice(NamedTuple):
    """The strategies a run measures, by the words of their names: those with a word of ``only``
    (empty: every one), less those with a word of ``skip``."""

    only: tuple = ()
    skip: tuple = ()

    def __call__(self, name: str) -> bool:
        return ((not self.only or any(w in name for w in self.only))
                and not any(w in name for w in self.skip))


def _strategy(is_rms: bool, backward: bool, name: str):
    """A provider's function: the public norm with the strategy ``name`` for the row's width as
    the configuration of its forward (``backward``: of its backward)."""
    public = (functools.partial(llmkernels.rms_norm, eps=RMS_EPS) if is_rms
              else functools.partial(llmkernels.layer_norm, eps=LN_EPS))
    direction = "backward" if backward else "forward"

    def call(x, weight, bias=None):
        config = wide_row_candidates(x.shape[-1], backward)[name]
        return public(x, weight, bias, config=NormConfig(**{direction: config}))
    return call


def _experiment(call: Callable, config: ClusterRows):
    """A provider's function: ``call`` under ``config``, a row a cluster (``cluster_rows.py``)."""
    reason = why_not_here()
    if reason:
        raise Unavailable(reason)
    return functools.partial(call, config=config)


def part_op(part: str, tiny: bool, choice: Choice = Choice()):
    """The bench op of ``part`` with a provider a strategy of ``choice`` (and the installed peers)."""
    spec = PARTS[part]
    op = ops()[spec.op]
    backward = spec.mode == "bwd"
    chosen = {s: None for n in WIDTHS for s in wide_row_candidates(n, backward) if choice(s)} if spec.library else {}
    providers = {s: Provider(functools.partial(_strategy, spec.op == "rmsnorm", backward, s)) for s in chosen}
    if part in EXPERIMENTS:
        exp = EXPERIMENTS[part]
        providers.update((s, exp.provider(config)) for s, config in exp.configs.items() if choice(s))
    providers.update((p, op.providers[p]) for p in spec.beside if p in op.providers)
    return dataclasses.replace(op, providers=providers, small_shapes=spec.tiny if tiny else op.small_shapes)


class BudgetRunner(OpRunner):
    """The runner of one part: at each width the strategies that apply to it (and the peers);
    no width starts past the time ``deadline`` (time.monotonic); ``done(records)`` after each
    width, with the records so far."""

    def __init__(self, op, settings: Settings, device, log, deadline: float, part: str):
        super().__init__(op, settings, device, log)
        self.deadline, self.part, self.cut, self.n = deadline, part, [], None
        self.done = lambda records: None

    def providers(self, op) -> list:
        names = super().providers(op)
        if self.n is None:
            return names
        here = strategies(self.part, self.n)
        return [p for p in names if p in here or p in PARTS[self.part].beside]

    def _run_case(self, op, dtype, kind, shape):
        if time.monotonic() > self.deadline:
            self.cut.append(shape[op.axis])
            return
        self.n = shape[op.axis]
        super()._run_case(op, dtype, kind, shape)
        self.done(self.records)


def summarise(part: str, records: list) -> list:
    """One record per (width, provider) of ``part``: % of copy, GPU µs, the strategy's
    configuration (at that width), status and note."""
    rows = []
    for r in records:
        here = strategies(part, r["size"])
        rows.append({"part": part, "n": r["size"], "rows": r["shape"]["M"], "provider": r["provider"],
                     "config": repr(here[r["provider"]]) if r["provider"] in here else None,
                     "pct_copy": None if r["pct_copy"] is None else round(r["pct_copy"], 1),
                     "us": None if r["us"] is None else round(r["us"], 1), "rel_err": r["rel_err"],
                     "status": r["status"], "note": r["note"]})
    return rows


def markdown(header: dict, records: list) -> str:
    """% of copy, a table a part: a row a provider, a column a width."""
    lines = [f"# Wide rows: % of copy, {header['device']}, {header['date']}", "",
             f"torch {header['torch']}, triton {header['triton']}, llmkernels {header['llmkernels']}, "
             f"quack-kernels {header['quack_kernels']}; configuration source {header['config_source']}; copy GB/s: "
             + (", ".join(f"{k} {v:.0f}" for k, v in header["copy_gbps"].items() if v) or "not measured"), "",
             f"`{header['command']}`", ""]
    for part in dict.fromkeys(r["part"] for r in records):
        mine = [r for r in records if r["part"] == part]
        widths = sorted({r["n"] for r in mine})
        lines += [f"## {part}", "", "| provider | " + " | ".join(map(str, widths)) + " |",
                  "|---|" + "---:|" * len(widths)]
        for provider in dict.fromkeys(r["provider"] for r in mine):
            cells = {r["n"]: (f"{r['pct_copy']:.1f}" if r["pct_copy"] is not None else r["status"] or "-")
                     for r in mine if r["provider"] == provider}
            lines.append(f"| {provider} | " + " | ".join(cells.get(n, "") for n in widths) + " |")
        lines.append("")
    return "\n".join(lines)


def write(out: str, header: dict, records: list) -> None:
    write_texts(out, {"wide_rows.json": json.dumps({"header": header, "records": records}, indent=1) + "\n",
                      "wide_rows.md": markdown(header, records)})


def _parts(text: str) -> list:
    parts = text.split(",")
    if set(parts) - set(PARTS):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PARTS)}")
    return parts


def _words(text: str) -> tuple:
    return tuple(w for w in text.split(",") if w)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=_parts, default=list(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--widths", type=lambda text: [int(n) for n in text.split(",")], default=None,
                   help="comma-separated, for every part (default: " + ",".join(map(str, WIDTHS))
                   + "; cross-entropy's vocabularies " + ",".join(map(str, VOCABS)) + ")")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of wide_rows.json / .md (default $OUT)")
    p.add_argument("--budget-s", type=float, default=450.0, help="start no width after this many seconds")
    p.add_argument("--only", type=_words, default=(), help="comma-separated: only strategies with one of "
                   "these words in their names (default: every one)")
    p.add_argument("--skip", type=_words, default=(), help="comma-separated: no strategy with one of these words "
                   "in its name, e.g. tma")
    p.add_argument("--tiny", action="store_true", help="CPU: the checks only, at a tiny shape")
    args = p.parse_args(argv)
    parts, device = args.parts, script_device(args.tiny, p.error)
    choice = Choice(args.only, args.skip)
    deadline = time.monotonic() + args.budget_s
    header = {**environment(device), "command": "python benchmarks/wide_rows.py " + shlex.join(
        sys.argv[1:] if argv is None else argv), "config_source": _device.tuned_of(device).source,
        "copy_gbps": {}, "cut_by_budget": {}}
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    records = []
    for part in parts:
        spec = PARTS[part]
        settings = Settings(ops=[spec.op], dtypes=["bf16"], sizes=args.widths or list(spec.widths), modes=(spec.mode,),
                            decode=False, eager=False)
        runner = BudgetRunner(part_op(part, args.tiny, choice), settings, device, log, deadline, part)
        # (each width written as it ends: a strategy that kills the CUDA context keeps the rest)
        runner.done = lambda mine, part=part, runner=runner: write(
            args.out, {**header, "copy_gbps": {**header["copy_gbps"], part: runner.copy_gbps}},
            records + summarise(part, mine))
        records += summarise(part, runner.run())
        header["copy_gbps"][part] = runner.copy_gbps
        if runner.cut:
            header["cut_by_budget"][part] = runner.cut
        header["skipped"] = list(dict.fromkeys([*header.get("skipped", []), *runner.notes()]))
        write(args.out, header, records)
        log(f"{part}: {len(records)} records so far")
    print(markdown(header, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
