"""Compute-optimal scaling laws on llmkernels: IsoFLOP sweeps of small Llama-style models and the
Chinchilla fits (approaches 1, 2 and 3), with bootstrap and profile-likelihood intervals, a quality
gate, an extrapolation check, a learning-rate rule fitted from its own sweep, a second seed and a
batch check at the smallest budget of each batch.

Stages, each resumable (a finished run is read back, never retrained; an interrupted one resumes
from its checkpoint):
  1. data: the Python installation's sources (or --data), deduplicated, split by document, tokenized.
  2. lr: a learning-rate sweep at the smallest budget (extended where the best rate is an edge of
     those tried); the learning-rate rule is fitted from it.
  3. lower: the lower budgets at sizes around the prior optimum, a second seed at the smallest and
     half the batch at three sizes of it (and of the smallest budget of each other batch).
  4. upper: the other budgets at sizes centred on N_opt(C) fitted to the lower ones.
  5. report: report.md, report.json and the figures in the output folder (also from an unfinished
     sweep: whatever its runs allow).

Output folder: data/<fingerprint>/ (tokens), runs/<run>.json (one per finished run), checkpoints/,
lr_rule.json, centres.json, report.md, report.json, *.png.

Exit status: 0 every run finished and the report is written; 1 a failure (data, device, or an
output folder whose runs were all trained on another corpus than this machine's); 2 a usage error
or a missing `scaling` extra (checked before any data or training); 3 runs not finished (a time
limit, a failed run): the report covers those that are, and the same command resumes.

Several GPUs: one training process per GPU (--workers, default every visible GPU; on a CPU one
process, or --workers N) takes the next run of a stage as it comes free; a stage ends when its last
run does, so the plan and every result are those of one GPU. --runs-per-device K trains K runs at
once in each process (threads, each on its own CUDA stream), so that small models' kernels
overlap (a modest gain: measure it on the machine); each run's result is still its own alone.
--archive packs the output's small files after every finished run, so that a call killed at its
time limit loses only the runs in flight; --restore in the next call (a fresh machine) resumes
from there. Checkpoints stay on the machine: calls chained on one machine pass their runs in flight
on with a --horizon past each call's --time-limit, and the last call on it keeps its horizon at its
limit, starting only runs that the runs measured so far on that device say will finish even at
the slow end of their spread (the 90th percentile of their width's).

A replicate: the same command with another --seed (initialisation and data order of every run),
then --compare A B sets the two sweeps' exponents side by side.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
from collections import Counter
from pathlib import Path

from . import compare as compare_mod
from . import data as data_mod
from .design import SEED_CHECK_OFFSET, Design, add_model_switches, design_from, estimate, models_from
from .plan import BYTE_VOCAB, SEQ_LEN, Estimator, HParams, LRRule
from .store import read_centres, read_json, read_rule, read_spans, restore

EXIT_USAGE = 2
DEFAULT_OUT = "scaling-runs"
EXTRAS = ("scipy", "matplotlib", "tqdm")
INSTALL = 'pip install "llmkernels[scaling]"'


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="llmkernels scaling", description="\n\n".join(doc[:2]), epilog="\n\n".join(doc[3:]),
                                formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100))
    d, hp = Design(), HParams()
    g = p.add_argument_group("output and control")
    g.add_argument("--out", metavar="DIR", default=None, help=f"output folder (default: {DEFAULT_OUT}; with --compare: "
                   "where comparison.md and comparison.json go, default none)")
    g.add_argument("--list", action="store_true",
                   help="print the plan (runs, sizes, tokens, steps) and exit, without building data or training")
    g.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="compare two finished sweeps' exponents (output folders, report.json files or --archive files) "
                        "and exit")
    g.add_argument("--fit-only", action="store_true", help="train nothing: refit and rewrite the report from the "
                   "finished runs")
    g.add_argument("--fit-from", type=float, default=None, metavar="FLOPS",
                   help="fit only the budgets from this one up; the IsoFLOP runs below are trained and listed, not "
                        "fitted (with --fit-only: a second look at a finished sweep, never its design)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop after about this long: no run is started that is predicted to end later, a run "
                        "still going at the limit is checkpointed; rerun the same command to go on (exit status 3)")
    g.add_argument("--horizon", type=float, default=None, metavar="SECONDS",
                   help="start no run predicted to end later than this (default: the time limit). On a machine "
                        "kept between calls, a horizon past the call's limit lets runs longer than a call start, "
                        "checkpoint at the limit and finish in the next call; a session's last call leaves it at "
                        "its limit, so that no run is left half-trained when the machine goes")
    g.add_argument("--ckpt-interval", type=float, default=300.0, metavar="SECONDS",
                   help="seconds between checkpoints of a running run (default: %(default)s)")
    g.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples of the runs for the intervals (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (one line per finished run stays)")
    g.add_argument("--restore", metavar="ARCHIVE", default=None,
                   help="first extract an --archive of an earlier invocation into --out (nothing when the file "
                        "is absent), so that a sweep cut into calls on fresh machines resumes from one file; "
                        "a report.json restores that sweep's runs, rule and window centres instead (a lost archive's sweep "
                        "resumes or grows from its committed report)")
    g.add_argument("--archive", metavar="ARCHIVE", default=None,
                   help="pack --out's small files (runs, fits, report, figures; not the token arrays or "
                        "checkpoints) into this .tar.gz after every finished run and last (also when cut short)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a text file, a folder of text files, or JSON lines with a 'text' field (default: every "
                        "Python source and text file of this Python installation, so that a sweep resumed on "
                        "another machine needs the same Python and packages there; a folder pins the corpus)")
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
    g.add_argument("--lower-budgets", metavar="N", type=int, default=d.lower_budgets,
                   help="the N smallest budgets train first, around the prior optimum; the others are centred on "
                        "N_opt(C) fitted to them (default: %(default)s)")
    g.add_argument("--sizes-per-budget", metavar="N", type=int, default=d.sizes_per_budget,
                   help="model sizes per budget (default: %(default)s)")
    g.add_argument("--span", metavar="X", type=float, default=d.span,
                   help="the sizes run from N_opt/SPAN to N_opt*SPAN around the window's centre (default: %(default)s)")
    g.add_argument("--tokens-per-param", metavar="X", type=float, default=d.tokens_per_param,
                   help="the lower budgets' prior optimum: D = this x N, with C = 6ND (default: %(default)s, Chinchilla's)")
    g.add_argument("--min-tokens-per-param", metavar="X", type=float, default=d.min_tokens_per_param,
                   help="skip sizes that would see fewer tokens a parameter (default: %(default)s)")
    g.add_argument("--ladder", default=None, metavar="LxW,...",
                   help="model shapes to choose from, LAYERSxWIDTH (default: 22 shapes from 3x128 to 10x384, width / layers 16-48)")
    g.add_argument("--seq-len", metavar="N", type=int, default=SEQ_LEN, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--head-dim", metavar="N", type=int, default=64, help="attention head size (default: %(default)s)")
    g.add_argument("--backend", choices=("kernels", "reference"), default="kernels",
                   help="kernels: llmkernels' Triton ops; reference: plain PyTorch (default: %(default)s)")
    add_model_switches(g)
    g.add_argument("--seed", metavar="N", type=int, default=0, help="model initialisation and data order of every run; "
                   "another value gives an independent replicate (default: %(default)s)")
    g.add_argument("--seed-budgets", default=",".join(map(str, d.seed_budgets)), metavar="I,I",
                   help=f"budgets (0 = smallest) rerun with seed + {SEED_CHECK_OFFSET}; empty: none (default: %(default)s)")
    g.add_argument("--batch-check", metavar="N", type=int, default=d.batch_check_sizes,
                   help="sizes of each --batch-budgets budget rerun at half its batch; 0: none (default: %(default)s)")
    g.add_argument("--batch-budgets", metavar="I,I", default=None,
                   help="budgets of the batch check (0 = smallest, -1 = largest) (default: the smallest budget of "
                        "each batch the rule gives)")
    g.add_argument("--backend-check", metavar="INDEX", type=int, default=None,
                   help="rerun this budget (0 = smallest) on the other backend (default: none)")
    g = p.add_argument_group("hyperparameters")
    g.add_argument("--batch-rule", default=",".join(f"{c:g}:{b}" if math.isfinite(c) else str(b) for c, b in hp.batch_rule),
                   metavar="C:B,...,B", help="sequences a step: B up to each budget C, the last above them all "
                   "(default: %(default)s)")
    g.add_argument("--lr", metavar="LR", type=float, default=None,
                   help="skip the learning-rate sweep: lr = LR * (N/1e6)^-gamma * (batch tokens/2^15)^0.5")
    g.add_argument("--lr-gamma", metavar="GAMMA", type=float, default=LRRule().gamma, help="gamma with --lr (default: %(default)s)")
    g.add_argument("--lr-budgets", metavar="I,I", default=None,
                   help="budgets (0 = smallest, among the lower ones) of the learning-rate sweep (default: the smallest "
                        "and the smallest with the lower budgets' largest batch)")
    g.add_argument("--lr-sizes", metavar="N", type=int, default=d.lr_sizes,
                   help="... at this many sizes of each (default: %(default)s)")
    g.add_argument("--lr-mults", default=",".join(f"{m:g}" for m in d.lr_mults), metavar="M,M,...",
                   help="... at these multiples of the prior rule's rate (default: %(default)s)")
    g.add_argument("--lr-rounds", metavar="N", type=int, default=d.lr_rounds,
                   help="times a size whose best rate is an edge of those tried gets one more rate (default: %(default)s)")
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
    g.add_argument("--workers", metavar="N", type=int, default=None,
                   help="training processes, each taking the next run as it comes free: on CUDA one per GPU, the "
                        "first N visible (default: every visible GPU); on a CPU N processes (default: 1)")
    g.add_argument("--runs-per-device", metavar="K", type=int, default=1,
                   help="runs each training process trains at once, each in its own thread and CUDA stream, so that "
                        "small models' kernels overlap (the gain is modest: measure it on the machine); every run's "
                        "result is the one it gets alone (deterministic kernels) (default: %(default)s)")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 autocast on GPU, fp32 on CPU (default: %(default)s)")
    g.add_argument("--no-graph", action="store_true", help="run the step eagerly instead of as one CUDA graph")
    g.add_argument("--nondeterministic", action="store_true",
                   help="PyTorch's default kernels on GPU: about 9%% faster steps, but the embedding's gradient "
                        "sums in a varying order and the same run differs from call to call (default: deterministic)")
    return p


def missing_extras(args) -> list[str]:
    """The `scaling` extras this command would import and cannot (found without importing them)."""
    wanted = EXTRAS + (("tokenizers",) if args.tokenizer == "bpe" else ())
    return [m for m in wanted if importlib.util.find_spec(m) is None]


def print_plan(args, out=print) -> int:
    """``--list``: the plan from the file sizes alone (no data built, no torch). The upper budgets'
    windows are those of ``centres.json`` when the lower budgets have been fitted, else the prior's."""
    design, hp, ladder = design_from(args)
    dcfg = data_mod.DataConfig(path=args.data, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                               heldout_frac=args.heldout_frac, max_bytes=args.max_bytes, seed=args.data_seed)
    files, n_bytes = data_mod.estimate_bytes(dcfg)
    vocab = BYTE_VOCAB if args.tokenizer == "byte" else args.vocab_size
    train_tokens = n_bytes * (1 - args.heldout_frac) / (1.0 if args.tokenizer == "byte" else 3.2)
    models = models_from(args, vocab, ladder)
    rule = read_rule(Path(args.out)) or (LRRule(c=args.lr, gamma=args.lr_gamma, source="--lr") if args.lr else LRRule())
    centres = read_centres(Path(args.out))
    lr_runs = [] if args.lr else design.lr_sweep(models, hp)
    runs = design.lower(models, rule, hp) + design.upper(models, rule, hp, centres, read_spans(Path(args.out)))
    lower_budgets = set(design.budgets()[: design.lower_budgets])
    out(f"data: {files:,} files, {n_bytes / 1e6:,.0f} MB before deduplication: about {train_tokens / 1e6:,.0f}M train "
        f"tokens ({args.tokenizer}); epochs below are estimates from that")
    out(f"learning rates: {rule.source} (c = {rule.c:.3g}, gamma = {rule.gamma:.3f}, kappa = {rule.kappa}); upper "
        f"windows: {'fitted centres' if centres else 'the prior centre until the lower budgets are fitted'}")
    out(f"{'run':<44}{'N total':>12}{'N non-emb':>12}{'tokens':>9}{'epochs':>8}{'batch':>6}{'steps':>7}{'lr':>10}"
        f"{'PFLOP':>9}{'H100 s':>8}")
    for r in lr_runs + runs:
        out(f"{r.id:<44}{r.model.total_params():>12,}{r.model.non_embedding_params():>12,}{r.tokens / 1e6:>8.1f}M"
            f"{r.tokens / max(1.0, train_tokens):>8.2f}{r.batch_size:>6}{r.steps:>7}{r.lr:>10.2e}{r.compute / 1e15:>9.2f}"
            f"{estimate([[r]], pieces=0):>8.1f}")
    total = sum(r.compute for r in lr_runs + runs)
    stages = [lr_runs, [r for r in runs if r.budget in lower_budgets], [r for r in runs if r.budget not in lower_budgets]]
    gpus = args.workers or 4
    out(f"{len(lr_runs)} learning-rate runs (before extensions), {sum(r.stage == 'sweep' for r in runs)} IsoFLOP runs over "
        f"{design.n_budgets} budgets, {sum(r.stage != 'sweep' for r in runs)} check runs: {total:.3g} FLOPs, about "
        f"{estimate(stages) / 60:.1f} min on one H100, {estimate(stages, workers=gpus) / 60:.1f} min on {gpus} "
        f"(design.estimate)")
    print_left(lr_runs + runs, Path(args.out), args.runs_per_device, out)
    return 0


def print_left(runs, folder: Path, runs_per_device: int, out=print):
    """What of ``runs`` the output folder has not finished, and its time: on one H100 one at a time
    (``design.estimate``), and scaled as the finished runs measured on their device ran (``Estimator``)."""
    done = {r.id: rec for r in runs if (rec := read_json(folder / "runs" / f"{r.id}.json"))}  # diverged ones too
    if not done:
        return
    left = [r for r in runs if r.id not in done]
    line = (f"finished in {folder}: {len(done)} of {len(runs)} runs; left: {len(left)} runs, "
            f"{sum(r.compute for r in left):.3g} FLOPs, about {estimate([left], pieces=0) / 60:.1f} min on one H100")
    device = Counter(rec.get("device") for rec in done.values()).most_common(1)[0][0]
    est = Estimator(cuda=True, device=device)
    for r in runs:
        if r.id in done:
            est.add(r, done[r.id])
    if est.count() and left:
        # the runs share the slots, but no run is faster than alone: the longest bounds the time below
        seconds = {r.id: est.seconds(r) for r in left}
        longest = max(seconds, key=seconds.get)
        minutes = max(sum(seconds.values()) / runs_per_device, seconds[longest]) / 60
        line += (f"; the {est.count()} finished on {device} took {est.ratio():.2f}x that estimate (median; by shape, else "
                 f"width, where two or more), so about {minutes:.1f} min of one {device} with --runs-per-device "
                 f"{runs_per_device} (the ratio holds for the concurrency they ran at), not less than its longest "
                 f"run, {longest}, takes: {seconds[longest] / 60:.1f} min, on one machine kept between calls")
    out(line)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.fit_from is not None and not args.fit_from > 0:
        raise SystemExit(f"--fit-from must be a budget > 0 FLOPs, got {args.fit_from}")
    for name in ("time_limit", "horizon"):
        if getattr(args, name) is not None and not getattr(args, name) >= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0 seconds, got {getattr(args, name)}")
    if args.fused_qk_rope and not args.qk_norm:
        raise SystemExit("--fused-qk-rope fuses the QK-norm into the rotation: it cannot go with --no-qk-norm")
    if args.compare:
        return compare_mod.main(args.compare, args.out)
    args.out = args.out or DEFAULT_OUT
    if args.list:
        if args.restore:
            print(restore(args.restore, Path(args.out)))
        return print_plan(args)
    missing = missing_extras(args)
    if missing:
        print(f"llmkernels scaling: missing {', '.join(missing)} (the `scaling` extra): {INSTALL}")
        return EXIT_USAGE
    from .runner import Session
    return Session(args, argv).main()
