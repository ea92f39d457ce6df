"""Scaling-law experiments (llmkernels.scaling): the model on both backends, the plan and its
counts, the data, the fits on synthetic data of known exponents, resuming, and the whole pipeline
at tiny sizes, in one process and over two gloo ranks (CPU; the kernels through the interpreter)."""
import email
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmkernels import cli
from llmkernels.scaling import data as data_mod
from llmkernels.scaling import fit, plan, sweep
from llmkernels.scaling.model import GPT, ops_run
from llmkernels.scaling.plan import ModelConfig
from llmkernels.scaling.train import TimeUp, TrainConfig, eval_windows, lr_at, train_run

# A tiny design: the standard library's email package (~0.4 MB of documents), 32-token sequences,
# widths 16-48 in heads of 16.
EMAIL = os.path.dirname(email.__file__)
TINY = ["--data", EMAIL, "--max-bytes", "200000", "--seq-len", "32", "--head-dim", "16", "--ladder", "1x16,1x32,2x32,2x48,3x48",
        "--budgets", "1.5e9,6e9,3", "--sizes-per-budget", "3", "--span", "2", "--target-steps", "20",
        "--min-batch", "4", "--max-batch", "8", "--eval-tokens", "1024", "--curve-points", "3",
        "--curve-eval-tokens", "256", "--bootstrap", "30", "--no-progress"]
TINY_LR = ["--lr-budgets", "1", "--lr-sizes", "1", "--lr-mults", "0.5,1,2,4", "--check-budget", "0"]


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one CPU thread beats several, which spin against each other (and
    against other processes on a 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_model_backends_agree_and_counts_match(device):
    """Same init, fp32: the kernels backend (norms, RoPE, SwiGLU, fused linear CE) gives the
    reference's loss and every gradient; the plan's parameter counts are the module's."""
    cfg = ModelConfig(vocab_size=64, n_layers=2, width=32, seq_len=16, head_dim=16)
    models = {}
    for backend in ("kernels", "reference"):
        torch.manual_seed(0)
        models[backend] = GPT(cfg, backend=backend).to(device)
    params = dict(models["kernels"].named_parameters())
    assert sum(p.numel() for p in params.values()) == cfg.total_params()
    assert sum(p.numel() for n, p in params.items() if not n.startswith("wte.")) == cfg.non_embedding_params()
    idx = torch.randint(0, 64, (3, 17), device=device)
    losses = {}
    for backend, m in models.items():
        losses[backend] = m(idx[:, :-1], idx[:, 1:])
        losses[backend].backward()
    assert abs(losses["kernels"].item() - losses["reference"].item()) < 1e-5
    assert abs(losses["reference"].item() - math.log(64)) < 0.5  # near-uniform at init
    for (name, pk), (_, pr) in zip(models["kernels"].named_parameters(), models["reference"].named_parameters()):
        assert pr.grad is not None and pr.grad.norm() > 0, name
        assert ((pk.grad - pr.grad).norm() / pr.grad.norm()).item() < 1e-4, name
    per_token = models["kernels"](idx[:, :-1], idx[:, 1:], reduction="none")
    assert per_token.shape == (3 * 16,)
    assert abs(per_token.double().mean().item() - losses["reference"].item()) < 1e-5
    # what ran is recorded: the kernels under the interpreter or on a GPU, else the fallback
    assert set(ops_run("reference", torch.device(device)).values()) == {"reference"}
    assert set(ops_run("kernels", torch.device(device)).values()) == {"kernels"}


def test_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(vocab_size=10, n_layers=1, width=30, seq_len=8, head_dim=16)
    with pytest.raises(ValueError, match="width"):
        ModelConfig(vocab_size=10, n_layers=1, width=0, seq_len=8)
    cfg = ModelConfig(vocab_size=10, n_layers=1, width=16, seq_len=8, head_dim=8)
    with pytest.raises(ValueError, match="backend"):
        GPT(cfg, backend="fast")
    m = GPT(cfg, backend="reference")
    with pytest.raises(ValueError, match="longer than seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="idx"):
        m(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long))


def test_counts_and_default_design_meet_the_issue():
    """Total parameters and FLOPs count the head and attention; the default design has >= 5
    budgets over >= 100x, >= 6 sizes each around the prior optimum, >= 40 runs, 1M..40M total
    parameters, >= 4 learning rates, a second seed and the other backend."""
    m = ModelConfig(vocab_size=320, n_layers=8, width=512)
    assert m.n_heads == 8 and m.mlp_hidden == 1344
    assert m.non_embedding_params() == 8 * (4 * 512**2 + 3 * 512 * 1344 + 2 * 512) + 512
    assert m.total_params() == m.non_embedding_params() + 320 * 512
    assert m.flops_per_token() == 6 * m.total_params() + 6 * 8 * 512 * 512
    design, hp = plan.Design(), plan.HParams()
    cs = design.budgets()
    assert len(cs) >= 5 and cs[-1] / cs[0] >= 100
    models = plan.ladder_models(plan.BYTE_VOCAB)
    runs = design.main_runs(models, plan.LRRule(), hp)
    grid = [r for r in runs if r.stage == "sweep"]
    assert len(grid) >= 40
    for c in cs:
        sizes = [r.model.total_params() for r in grid if r.budget == c]
        centre = plan.prior_optimal_params(c, design.tokens_per_param)
        assert len(set(sizes)) >= 6 and min(sizes) <= centre / 3.5 and max(sizes) >= centre * 3.5
        assert all(abs(r.compute / c - 1) < 0.05 for r in grid if r.budget == c)  # steps round the tokens
    assert min(r.model.total_params() for r in grid) <= 1e6 and max(r.model.total_params() for r in grid) >= 40e6
    assert {r.stage for r in runs} == {"sweep", "seed", "backend"}
    assert {r.backend for r in runs if r.stage == "backend"} == {"reference"}
    assert len(set(design.lr_mults)) >= 4 and design.lr_sweep(models, plan.LRRule(), hp)
    assert all(r.beta2 == 0.99 for r in runs) and all(16 <= r.batch_size <= 256 for r in runs)


def test_window_and_budgets_and_lr_schedule():
    assert plan.budgets(1e14, 1e16, 3) == [1e14, 1e15, 1e16]
    with pytest.raises(ValueError):
        plan.budgets(1e16, 1e14, 3)
    models = plan.ladder_models(320)
    w = plan.window(models, 1e15, 20.0, 5, 4.0)
    assert len(w) == 5 and [m.total_params() for m in w] == sorted(m.total_params() for m in w)
    cfg = TrainConfig(steps=100, batch_size=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------
# fits on synthetic data of known exponents
# --------------------------------------------------------------------------------------------
TRUTH = {"E": 1.0, "A": 400.0, "B": 2000.0, "alpha": 0.34, "beta": 0.36}


def synthetic_runs(noise: float, seed: int = 0) -> list[dict]:
    """IsoFLOP runs drawn from ``L = E + A/N^alpha + B/D^beta`` (C = 6ND), with log-normal noise,
    each with a held-out curve (the same law at fractions of D, a little higher: not annealed)."""
    rng = np.random.default_rng(seed)
    e, a, b, al, be = (TRUTH[k] for k in ("E", "A", "B", "alpha", "beta"))
    g = (al * a / (be * b)) ** (1 / (al + be))
    runs = []
    for c in np.logspace(14, 16, 6):
        n_opt = g * (c / 6) ** (be / (al + be))
        for k in np.linspace(-1, 1, 7):
            n = n_opt * 4.0**k
            d = c / (6 * n)
            loss = (e + a * n**-al + b * d**-be) * math.exp(rng.normal(0, noise))
            curve = [{"compute": c * f, "tokens": d * f, "val_loss": e + a * n**-al + b * (d * f) ** -be + 0.01}
                     for f in (0.1, 0.3, 0.6)]
            runs.append({"budget": float(c), "params": n, "non_embedding_params": 0.9 * n, "tokens": d,
                         "compute": float(c), "val_loss": loss, "name": f"N{n:.4g}", "curve": curve})
    return runs


def test_fits_recover_known_exponents_and_intervals_cover_them():
    a_true = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])
    runs = synthetic_runs(noise=0.002)
    a2 = fit.approach2(runs)
    assert a2["budgets_used"] == 6 and a2["a"] == pytest.approx(a_true, abs=0.02)
    assert a2["b"] == pytest.approx(1 - a_true, abs=0.02)
    a3 = fit.approach3([r["params"] for r in runs], [r["tokens"] for r in runs], [r["val_loss"] for r in runs])
    assert a3["ok"] and a3["alpha"] == pytest.approx(TRUTH["alpha"], abs=0.03)
    assert a3["beta"] == pytest.approx(TRUTH["beta"], abs=0.03) and a3["E"] == pytest.approx(TRUTH["E"], abs=0.15)
    assert a3["a"] == pytest.approx(a_true, abs=0.02) and a3["r2"] > 0.999
    a1 = fit.approach1(runs)
    assert a1["sizes_on_envelope"] >= 3 and a1["a"] == pytest.approx(a_true, abs=0.1)
    boot = fit.bootstrap(runs, n=40, approach3_fit=a3)
    for key, true in (("a2_a", a_true), ("a3_a", a_true), ("a3_alpha", TRUTH["alpha"]), ("a3_beta", TRUTH["beta"])):
        assert boot[key]["lo"] - 0.01 <= true <= boot[key]["hi"] + 0.01, (key, boot[key])
    ex = fit.extrapolation(runs, starts=[a3["theta"]])
    assert ex["ok"] and abs(ex["approach3_error"]) < 0.02 and abs(ex["loss_law_error"]) < 0.05
    front = fit.frontier(runs)
    assert all(p["best"] <= q["best"] for p, q in zip(front[1:], front))  # monotone


def test_fit_quality_warns_when_exactly_determined():
    line = fit.power_law([1.0, 2.0], [3.0, 4.0])
    assert line["dof"] == 0 and line["r2"] is None and "exactly determined" in line["warning"]
    par = fit.parabola_min([0.0, 1.0, 2.0], [2.0, 1.0, 2.0])
    assert par["ok"] and par["x_min"] == pytest.approx(1.0) and par["r2"] is None and par["warning"]
    assert not fit.parabola_min([0.0, 1.0, 2.0], [1.0, 2.0, 1.0])["ok"]  # no minimum
    good = fit.power_law([1.0, 2.0, 4.0, 8.0], [2.0, 4.0, 8.0, 16.5])
    assert good["dof"] == 2 and good["r2"] > 0.99 and good["warning"] is None


def test_fit_lr_rule_recovers_the_rule():
    """Losses parabolic in log lr around ``c·(N/1e6)^-gamma·(B/2^15)^0.5``: the rule comes back."""
    c, gamma = 3e-3, 0.3
    runs = []
    for n, batch in ((2e5, 64), (1e6, 16), (5e6, 8)):
        best = c * (n / 1e6) ** -gamma * (batch * 32 / 2**15) ** 0.5
        for mult in (0.25, 0.5, 1.0, 2.0, 4.0):
            lr = best * 1.3 * mult
            runs.append({"budget": 1e14, "name": f"N{n:g}", "params": n, "val_loss": 2.0 + 0.1 * math.log(lr / best) ** 2,
                         "train": {"lr": lr, "batch_size": batch}, "model": {"seq_len": 32}})
    rule = fit.fit_lr_rule(runs, kappa=0.5)
    assert rule["c"] == pytest.approx(c, rel=1e-3) and rule["gamma"] == pytest.approx(gamma, abs=1e-3)
    assert rule["edges"] == 0 and len(rule["groups"]) == 3


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def test_data_dedup_split_formats_and_baselines(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "x", "y", "+", "(", ")", ":", "\n"]
    for i in range(30):
        (src / f"f{i}.py").write_text(" ".join(rng.choice(words, 300)))
    (src / "copy.py").write_bytes((src / "f3.py").read_bytes())  # a duplicate
    (src / "blob.txt").write_bytes(b"\x00\x01binary")  # not text
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(5)))
    cfg = data_mod.DataConfig(path=str(src), heldout_frac=0.2)
    a = data_mod.prepare(cfg, tmp_path / "cache", log=lambda *_: None)
    b = data_mod.prepare(cfg, tmp_path / "cache", log=lambda *_: None)  # from the cache
    assert np.array_equal(a.train, b.train) and a.meta == b.meta
    m = a.meta
    assert m["duplicates_dropped"] == 1 and m["skipped_not_text"] == 1
    assert m["train_documents"] + m["val_documents"] == 35 and m["val_documents"] >= 1
    assert a.vocab_size == 257 and a.train.min() >= 0 and a.train.max() <= 256
    assert (a.train == 256).sum() == m["train_documents"] and (a.val == 256).sum() == m["val_documents"]
    assert m["train_tokens"] == m["train_bytes"] + m["train_documents"]  # bytes + one end-of-text each
    base = m["baselines"]
    assert 0 < base["bigram"] < base["unigram"] < math.log(257)
    with pytest.raises(ValueError, match="heldout_frac"):
        data_mod.DataConfig(heldout_frac=1.5)
    with pytest.raises(FileNotFoundError):
        data_mod.list_sources(data_mod.DataConfig(path=str(tmp_path / "missing")))


def test_default_corpus_is_the_python_installation():
    names = [n for n, _ in data_mod.list_sources(data_mod.DataConfig())]
    labels = {n.split("/", 1)[0] for n in names}
    assert "stdlib" in labels and "site-packages" in labels and names == sorted(names)
    assert not any("__pycache__" in n for n in names)
    assert not any("site-packages" in n for n in names if n.startswith("stdlib/"))


@pytest.mark.skipif(not data_mod.bpe_available(), reason="tokenizers is not installed")
def test_bpe_tokenizer_round_trips():
    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20, "ünïcode = 'é'\n"]
    tok = data_mod._train_bpe(texts, 300)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(data_mod.EOT) is not None
    for t in texts:
        assert tok.decode(tok.encode(t).ids) == t
    assert len(tok.encode(texts[0]).ids) < len(texts[0].encode()) / 2  # merges learned


# --------------------------------------------------------------------------------------------
# training, resuming, the pipeline
# --------------------------------------------------------------------------------------------
def test_interrupted_run_resumes_exactly(tmp_path):
    """A run stopped by its deadline resumes from the checkpoint and ends where an uninterrupted
    run ends (same losses, bit for bit on CPU)."""
    corpus = data_mod.prepare(data_mod.DataConfig(path=EMAIL, max_bytes=60000), tmp_path / "data", log=lambda *_: None)
    m = ModelConfig(vocab_size=320, n_layers=1, width=16, seq_len=32, head_dim=16)
    t = TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup_steps=4, eval_tokens=512, curve_points=2,
                    curve_eval_tokens=128, log_every=5)
    train, val = torch.from_numpy(corpus.train), torch.from_numpy(corpus.val)
    windows = {"final": eval_windows(val, 32, 512), "curve": eval_windows(val, 32, 128)}
    kw = dict(backend="reference", device=torch.device("cpu"), dtype=torch.float32, key={"k": 1}, progress=False,
              log=lambda *_: None)
    whole = train_run(m, t, train, windows, **kw)
    ckpt = str(tmp_path / "run.pt")
    with pytest.raises(TimeUp):
        train_run(m, t, train, windows, ckpt_path=ckpt, deadline=0.0, **kw)
    assert os.path.exists(ckpt)
    resumed = train_run(m, t, train, windows, ckpt_path=ckpt, **kw)
    assert resumed["resumed_from_step"] == 1 and not os.path.exists(ckpt)
    assert resumed["val_loss"] == whole["val_loss"]
    assert [h[2] for h in resumed["history"]] == [h[2] for h in whole["history"]]


def test_pipeline_smoke_resume_and_report(tmp_path, capsys):
    """The whole pipeline at tiny sizes: a learning-rate sweep at 4 rates, 3 budgets x 3 sizes,
    every fit and figure written; stopped by its time limit it resumes from the checkpoint, and a
    third invocation retrains nothing. (The checks' runs: the torchrun test below.)"""
    args = ["--out", str(tmp_path), *TINY, *TINY_LR, "--backend", "reference", "--no-checks"]
    assert sweep.main([*args, "--time-limit", "0"]) == sweep.EXIT_INCOMPLETE
    assert list((tmp_path / "checkpoints").glob("*.pt"))
    capsys.readouterr()
    assert sweep.main(args) == 0
    assert "resuming at step" in capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    an, runs = report["analysis"], report["runs"]
    assert sorted(r["stage"] for r in runs) == ["sweep"] * 9 and len({r["budget"] for r in runs}) == 3
    for key in ("approach1", "approach2", "approach3", "bootstrap", "extrapolation", "lr_rule", "frontier"):
        assert key in an and an[key] is not None, key
    assert an["approach3"]["ok"] and an["lr_rule"]["ok"] and len(an["lr_rule"]["groups"]) == 1
    assert len(an["lr_rule"]["groups"][0]["lrs"]) == 4 and an["bootstrap"]["resamples"] == 30
    md = (tmp_path / "report.md").read_text()
    assert "| 2: IsoFLOP parabolas" in md and "Besiroglu" in md and "bits/byte" in md
    try:
        import matplotlib  # noqa: F401
        assert {"isoflop.png", "optimal.png", "curves.png", "lr_sweep.png"} <= set(an["figures"])
    except ImportError:
        assert an["figures"] == []
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")}
    assert sweep.main([*args, "--bootstrap", "0"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")} == stamps


def test_cli_help_and_list_build_nothing(tmp_path, capsys):
    parser = sweep.build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text
    out_dir = tmp_path / "out"
    assert cli.main(["scaling", "--out", str(out_dir), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not out_dir.exists()  # no data, no tokenizer, nothing written
    rows = [ln for ln in lines if ln.startswith(("lr-", "sweep-", "seed-", "backend-"))]
    assert sum(r.startswith("sweep-") for r in rows) >= 40 and sum(r.startswith("lr-") for r in rows) >= 4
    assert "IsoFLOP runs" in lines[-1]


def test_torchrun_spreads_runs_over_gloo_ranks(tmp_path):
    """Two gloo processes on CPU claim whole runs (the IsoFLOP grid, a second seed and the kernels
    backend at one budget); rank 0 merges them into one report. Without Triton's interpreter the
    kernels fall back to the reference ops, and the runs say so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "llmkernels.scaling", "--out", str(tmp_path), *TINY, "--lr", "3e-3", "--check-budget", "0",
           "--bootstrap", "0", "--backend", "reference"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = {rank: proc.stdout.count(f"[rank {rank}] [sweep") for rank in (0, 1)}
    assert trained[0] >= 1 and trained[1] >= 1 and sum(trained.values()) == 15, trained
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["info"]["world_size"] == 2 and len(report["runs"]) == 15
    fallback = [r["ops"]["linear_cross_entropy"] for r in report["runs"] if r["backend"] == "kernels"]
    assert len(fallback) == 3 and all(op.startswith("reference (kernels fall back") for op in fallback)
    an = report["analysis"]
    assert an["seed_spread"]["n"] == 3 and an["backend_check"]["n"] == 3
    assert an["backend_check"]["max_abs_diff"] < 0.01  # the same functions in fp32
