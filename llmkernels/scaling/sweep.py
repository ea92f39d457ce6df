"""Compute-optimal scaling laws on llmkernels: IsoFLOP sweeps of small Llama-style models and the
Chinchilla fits (approaches 1, 2 and 3), with bootstrap intervals, an extrapolation check, a
learning-rate rule fitted from its own sweep, and a second seed and the other backend at one budget.

Stages, each resumable (a finished run is read back, never retrained; an interrupted one resumes
from its checkpoint):
  1. data: the Python installation's sources (or --data), deduplicated, split by document, tokenized.
  2. lr: a learning-rate sweep at the smallest budgets; the learning-rate rule is fitted from it.
  3. sweep: every budget at sizes around its predicted optimum, then the checks (second seed, other
     backend) at one budget.
  4. report: report.md, report.json and the figures in the output folder.

Output folder: data/<fingerprint>/ (tokens), runs/<run>.json (one per finished run), checkpoints/,
lr_rule.json, report.md, report.json, *.png.

Several processes (torchrun --nproc_per_node=K -m llmkernels.scaling) share the runs: each claims
whole runs in turn (a claim is a file), several processes may share a GPU, and rank 0 writes the
report. Small models do not fill a GPU; independent runs scale without any communication.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from . import data as data_mod
from .plan import BYTE_VOCAB, LADDER, SEQ_LEN, Design, HParams, LRRule, ladder_models, parse_ladder

EXIT_INCOMPLETE = 3


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="llmkernels scaling", description="\n\n".join(doc[:2]), epilog=doc[3],
                                formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100))
    d, hp = Design(), HParams()
    g = p.add_argument_group("output and control")
    g.add_argument("--out", metavar="DIR", default="scaling-runs", help="output folder (default: %(default)s)")
    g.add_argument("--list", action="store_true",
                   help="print the plan (runs, sizes, tokens, steps) and exit, without building data or training")
    g.add_argument("--fit-only", action="store_true", help="train nothing: refit and rewrite the report from the "
                   "finished runs")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop after about this long: no run is started that is predicted to end later, a run "
                        "still going at the limit is checkpointed; rerun the same command to go on (exit status 3)")
    g.add_argument("--ckpt-interval", type=float, default=300.0, metavar="SECONDS",
                   help="seconds between checkpoints of a running run (default: %(default)s)")
    g.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples of the runs for the intervals (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (one line per finished run stays)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a text file, a folder of text files, or JSON lines with a 'text' field (default: every "
                        "Python source and text file of this Python installation)")
    g.add_argument("--tokenizer", choices=data_mod.TOKENIZERS, default="byte",
                   help="byte: UTF-8 bytes; bpe: a byte-level BPE trained on the train split (needs tokenizers) "
                        "(default: %(default)s)")
    g.add_argument("--vocab-size", metavar="N", type=int, default=4096, help="BPE vocabulary (default: %(default)s)")
    g.add_argument("--heldout-frac", metavar="FRAC", type=float, default=0.02, help="share of documents held out (default: %(default)s)")
    g.add_argument("--max-bytes", metavar="N", type=int, default=None, help="use only this many bytes of documents (quick looks, tests)")
    g.add_argument("--data-seed", metavar="N", type=int, default=0, help="salt of the document split (default: %(default)s)")
    g = p.add_argument_group("design")
    g.add_argument("--budgets", default=f"{d.budget_lo:g},{d.budget_hi:g},{d.n_budgets}", metavar="LO,HI,COUNT",
                   help="COUNT compute budgets (FLOPs) spaced evenly in log from LO to HI (default: %(default)s)")
    g.add_argument("--sizes-per-budget", metavar="N", type=int, default=d.sizes_per_budget,
                   help="model sizes per budget (default: %(default)s)")
    g.add_argument("--span", metavar="X", type=float, default=d.span,
                   help="the sizes run from N_opt/SPAN to N_opt*SPAN around the predicted optimum (default: %(default)s)")
    g.add_argument("--tokens-per-param", metavar="X", type=float, default=d.tokens_per_param,
                   help="the prior optimum: D = this x N, with C = 6ND (default: %(default)s, Chinchilla's)")
    g.add_argument("--ladder", default=None, metavar="LxW,...",
                   help="model shapes to choose from, LAYERSxWIDTH (default: 23 shapes from 3x64 to 9x640)")
    g.add_argument("--seq-len", metavar="N", type=int, default=SEQ_LEN, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--head-dim", metavar="N", type=int, default=64, help="attention head size (default: %(default)s)")
    g.add_argument("--backend", choices=("kernels", "reference"), default="kernels",
                   help="kernels: llmkernels' Triton ops; reference: plain PyTorch (default: %(default)s)")
    g.add_argument("--seed", metavar="N", type=int, default=0, help="model initialisation and data order (default: %(default)s)")
    g.add_argument("--no-checks", action="store_true",
                   help="skip the second seed and the other backend at the check budget")
    g.add_argument("--check-budget", type=int, default=d.check_budget, metavar="INDEX",
                   help="which budget (0 = smallest) the checks rerun (default: %(default)s)")
    g = p.add_argument_group("hyperparameters")
    g.add_argument("--lr", metavar="LR", type=float, default=None,
                   help="skip the learning-rate sweep: lr = LR * (N/1e6)^-gamma * (batch tokens/2^15)^0.5")
    g.add_argument("--lr-gamma", metavar="GAMMA", type=float, default=LRRule().gamma, help="gamma with --lr (default: %(default)s)")
    g.add_argument("--lr-budgets", metavar="N", type=int, default=d.lr_budgets,
                   help="the learning-rate sweep runs at this many of the smallest budgets (default: %(default)s)")
    g.add_argument("--lr-sizes", metavar="N", type=int, default=d.lr_sizes,
                   help="... at this many sizes of each (default: %(default)s)")
    g.add_argument("--lr-mults", default=",".join(f"{m:g}" for m in d.lr_mults), metavar="M,M,...",
                   help="... at these multiples of the prior rule's rate (default: %(default)s)")
    g.add_argument("--target-steps", metavar="N", type=int, default=hp.target_steps,
                   help="the batch is chosen to give about this many steps (default: %(default)s)")
    g.add_argument("--min-batch", metavar="N", type=int, default=hp.min_batch, help="fewest sequences a step (default: %(default)s)")
    g.add_argument("--max-batch", metavar="N", type=int, default=hp.max_batch, help="most sequences a step (default: %(default)s)")
    g.add_argument("--warmup-frac", metavar="FRAC", type=float, default=hp.warmup_frac,
                   help="share of the steps warming up (default: %(default)s)")
    g.add_argument("--weight-decay", metavar="WD", type=float, default=hp.weight_decay, help="AdamW's (default: %(default)s)")
    g.add_argument("--eval-tokens", metavar="N", type=int, default=1 << 20,
                   help="held-out tokens of each final loss (default: %(default)s)")
    g.add_argument("--curve-points", metavar="N", type=int, default=10,
                   help="held-out evaluations along each run (default: %(default)s)")
    g.add_argument("--curve-eval-tokens", metavar="N", type=int, default=1 << 16,
                   help="held-out tokens of each of those (default: %(default)s)")
    g = p.add_argument_group("device")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="(default: %(default)s)")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 autocast on GPU, fp32 on CPU (default: %(default)s)")
    g.add_argument("--no-graph", action="store_true", help="run the step eagerly instead of as one CUDA graph")
    return p


def design_from(args) -> tuple[Design, HParams, list]:
    lo, hi, count = _floats(args.budgets) if args.budgets.count(",") == 2 else (None, None, None)
    if count is None or count != int(count) or count < 1:
        raise SystemExit(f"--budgets: expected LO,HI,COUNT, got {args.budgets!r}")
    design = Design(budget_lo=lo, budget_hi=hi, n_budgets=int(count), sizes_per_budget=args.sizes_per_budget,
                    span=args.span, tokens_per_param=args.tokens_per_param, lr_budgets=args.lr_budgets,
                    lr_sizes=args.lr_sizes, lr_mults=_floats(args.lr_mults), check_budget=args.check_budget,
                    backend=args.backend, check_backend="reference" if args.backend == "kernels" else "kernels",
                    seed=args.seed, checks=not args.no_checks)
    hp = HParams(target_steps=args.target_steps, min_batch=args.min_batch, max_batch=args.max_batch,
                 warmup_frac=args.warmup_frac, weight_decay=args.weight_decay)
    return design, hp, (parse_ladder(args.ladder) if args.ladder else LADDER)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj):
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    os.replace(tmp, path)


def print_plan(args, out=print) -> int:
    """``--list``: the plan from the file sizes alone (no data built, no torch)."""
    design, hp, ladder = design_from(args)
    dcfg = data_mod.DataConfig(path=args.data, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                               heldout_frac=args.heldout_frac, max_bytes=args.max_bytes, seed=args.data_seed)
    files, n_bytes = data_mod.estimate_bytes(dcfg)
    vocab = BYTE_VOCAB if args.tokenizer == "byte" else args.vocab_size
    train_tokens = n_bytes * (1 - args.heldout_frac) / (1.0 if args.tokenizer == "byte" else 3.2)
    models = ladder_models(vocab, args.seq_len, args.head_dim, ladder)
    rule = _read_rule(Path(args.out)) or (LRRule(c=args.lr, gamma=args.lr_gamma, source="--lr") if args.lr else LRRule())
    lr_runs = [] if args.lr else design.lr_sweep(models, LRRule(), hp)
    runs = design.main_runs(models, rule, hp)
    out(f"data: {files:,} files, {n_bytes / 1e6:,.0f} MB before deduplication: about {train_tokens / 1e6:,.0f}M train "
        f"tokens ({args.tokenizer}); epochs below are estimates from that")
    out(f"learning rates: {rule.source} (c = {rule.c:.3g}, gamma = {rule.gamma:.3f}, kappa = {rule.kappa})")
    out(f"{'run':<44}{'N total':>12}{'N non-emb':>12}{'tokens':>9}{'epochs':>8}{'batch':>6}{'steps':>7}{'lr':>10}"
        f"{'PFLOP':>9}")
    for r in lr_runs + runs:
        out(f"{r.id:<44}{r.model.total_params():>12,}{r.model.non_embedding_params():>12,}{r.tokens / 1e6:>8.1f}M"
            f"{r.tokens / max(1.0, train_tokens):>8.2f}{r.batch_size:>6}{r.steps:>7}{r.lr:>10.2e}{r.compute / 1e15:>9.2f}")
    total = sum(r.compute for r in lr_runs + runs)
    out(f"{len(lr_runs)} learning-rate runs, {sum(r.stage == 'sweep' for r in runs)} IsoFLOP runs over "
        f"{design.n_budgets} budgets, {sum(r.stage != 'sweep' for r in runs)} check runs: {total:.3g} FLOPs")
    return 0


def _read_rule(out: Path) -> LRRule | None:
    saved = _read_json(out / "lr_rule.json")
    if not saved or not saved.get("ok"):
        return None
    return LRRule(c=saved["c"], gamma=saved["gamma"] if saved["gamma"] is not None else LRRule().gamma,
                  kappa=saved["kappa"], source=f"fitted from {len(saved['groups'])} learning-rate sweep groups")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        return print_plan(args)
    from .runner import Session
    return Session(args, argv).main()
