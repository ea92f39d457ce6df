"""Scaling-law experiments (llmkernels.scaling): the model on both backends, the plan, the design and
its GPU-time estimate, the data, training and resuming, and the whole pipeline at tiny sizes: in
one process and over several training processes, cut short and resumed from its archive, the
published CPU recipe at a smaller size (CPU; the kernels through the interpreter). The fits, the
gate and the report: test_scaling_fits.py."""
import dataclasses
import email
import json
import math
import os
import shlex
import subprocess
import sys
import tarfile
import threading
import time
import types

import numpy as np
import pytest
import torch

from llmkernels import cli
from llmkernels.scaling import data as data_mod
from llmkernels.scaling import design as design_mod
from llmkernels.scaling import fit, plan, report, runner, store, sweep
from llmkernels.scaling import model as model_mod
from llmkernels.scaling import train as train_mod
from llmkernels.scaling.model import GPT, ops_run
from llmkernels.scaling.plan import ModelConfig
from llmkernels.scaling.train import TimeUp, TrainConfig, eval_windows, lr_at, train_run
from tests.helpers import benchmark_script

# A tiny design: the standard library's email package (~0.4 MB of documents), 32-token sequences,
# widths 16-48 in heads of 16, four budgets (two lower, two upper), batch 4 then 8; on the CPU, so
# that the pipeline's tests (time limits, several training processes) are the same on a GPU machine.
EMAIL = os.path.dirname(email.__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--data", EMAIL, "--max-bytes", "200000", "--seq-len", "32", "--head-dim", "16", "--ladder",
        "1x16,1x32,2x32,2x48,3x48", "--budgets", "1.5e9,6e9,4", "--lower-budgets", "2", "--sizes-per-budget", "3",
        "--span", "2", "--min-tokens-per-param", "0", "--batch-rule", "3e9:4,8", "--eval-tokens", "1024",
        "--curve-points", "3", "--curve-eval-tokens", "256", "--bootstrap", "4", "--no-progress", "--device", "cpu"]
TINY_LR = ["--lr-budgets", "0", "--lr-sizes", "1", "--lr-mults", "0.5,1,2", "--lr-rounds", "1", "--seed-budgets", "0",
           "--batch-check", "1"]


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one CPU thread beats several, which spin against each other (and
    against other processes on a 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seed():
    """Fresh noise each run: a new seed, named in the failure messages."""
    return int(np.random.SeedSequence().entropy % 2**32)


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


def test_fused_qk_rope_model_computes_the_same_function(device, monkeypatch):
    """``fused_qk_rope`` (QK-norm and rotation in one op) leaves the decoder's function as it is:
    in fp32, from one initialisation, the loss and every gradient equal the two-op model's on both
    backends, the fused op called once a block. The switch stays out of a run's record while off,
    so that the runs recorded before it keep their keys."""
    base = ModelConfig(vocab_size=64, n_layers=2, width=32, seq_len=16, head_dim=16, qk_norm=True)
    fused = dataclasses.replace(base, fused_qk_rope=True)
    idx = torch.randint(0, 64, (3, 17), device=device)
    for backend in ("kernels", "reference"):
        calls = []
        op = model_mod.BACKEND_OPS[backend]["qkv_norm_rope"]
        monkeypatch.setitem(model_mod.BACKEND_OPS[backend], "qkv_norm_rope", lambda *a, **k: calls.append(1) or op(*a, **k))
        runs = []
        for cfg in (base, fused):
            torch.manual_seed(0)
            m = GPT(cfg, backend=backend).to(device)
            loss = m(idx[:, :-1], idx[:, 1:])
            loss.backward()
            runs.append((loss.item(), dict((n, p.grad) for n, p in m.named_parameters())))
        assert len(calls) == base.n_layers, backend
        assert abs(runs[0][0] - runs[1][0]) < 1e-5, backend
        for name, g in runs[0][1].items():
            f = runs[1][1][name]
            assert f is not None and f.norm() > 0, (backend, name)
            assert ((f - g).norm() / g.norm()).item() < 1e-4, (backend, name)
    assert "fused_qk_rope" not in base.to_dict() and fused.to_dict()["fused_qk_rope"] is True
    with pytest.raises(ValueError, match="qk_norm=True"):
        dataclasses.replace(base, qk_norm=False, fused_qk_rope=True)
    assert all(m.fused_qk_rope for m in plan.ladder_models(64, 16, 16, [(2, 32)], qk_norm=True, fused_qk_rope=True))
    with pytest.raises(SystemExit, match="--no-qk-norm"):
        sweep.main(["--list", "--no-qk-norm", "--fused-qk-rope"])


def test_bf16_residual_keeps_the_stream_in_the_products_dtype(device):
    """``bf16_residual``: every norm's residual stream in the compute dtype (bfloat16 here, where
    it is float32 without the switch), the loss and every gradient of the kernels backend that of
    the reference within bfloat16's rounding; the switch stays out of a run's record while off and
    reaches the models from both command lines."""
    cfg = ModelConfig(vocab_size=64, n_layers=2, width=32, seq_len=16, head_dim=16, qk_norm=True)
    idx = torch.randint(0, 64, (3, 17), device=device)
    results = {}
    for bf16 in (False, True):
        for backend in ("kernels", "reference"):
            torch.manual_seed(0)
            m = GPT(dataclasses.replace(cfg, bf16_residual=bf16), backend=backend,
                    compute_dtype=torch.bfloat16).to(device)
            streams = []
            for norm in (m.blocks[0].attn_norm, m.blocks[1].mlp_norm, m.norm):
                norm.register_forward_hook(lambda mod, args, out: streams.append(out[1].dtype))
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):  # as the sweep trains
                loss = m(idx[:, :-1], idx[:, 1:])
            loss.backward()
            assert set(streams) == {torch.bfloat16 if bf16 else torch.float32}, (bf16, backend, streams)
            results[bf16, backend] = loss.item(), {n: p.grad.float() for n, p in m.named_parameters()}
    for bf16 in (False, True):
        (lk, gk), (lr, gr) = results[bf16, "kernels"], results[bf16, "reference"]
        assert abs(lk - lr) < 2e-2, bf16
        for name, g in gr.items():
            assert g.norm() > 0 and ((gk[name] - g).norm() / g.norm()).item() < 5e-2, (bf16, name)
    assert results[True, "reference"][0] != results[False, "reference"][0]  # the rounding is another model's
    assert "bf16_residual" not in cfg.to_dict()
    assert dataclasses.replace(cfg, bf16_residual=True).to_dict()["bf16_residual"] is True
    args = sweep.build_parser().parse_args(["--bf16-residual"])
    assert all(m.bf16_residual for m in design_mod.models_from(args, 64, [(2, 64)]))
    assert not any(m.bf16_residual for m in design_mod.models_from(sweep.build_parser().parse_args([]), 64, [(2, 64)]))
    switches = dict(qk_norm=True, fused_qk_rope=False, bf16_residual=True)
    assert benchmark_script("scaling_check").model_config(
        types.SimpleNamespace(vocab=64, seq_len=16, **switches), 2, 64).bf16_residual


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
    """Total parameters and FLOPs count the head and attention. The default design: >= 5 budgets over
    6x, all above the loss's early plateau and its seed-dependent drop (>= 1e15 FLOPs); one shape family (depth >= 3, width /
    layers 16-48); >= 7 sizes each about 1.3x apart reaching 2x each side of the window's centre
    (below it as far as the ladder goes, above it as far as 2 tokens a parameter allows: none under); one batch for every budget; the
    learning-rate sweep at 3 sizes of the smallest budget; a second seed there and half the batch at
    three of its sizes; and the whole plan estimated at <= 6.5 minutes on four H100s in one call with
    a time limit (the runs in that order), <= 25 minutes on one in three pieces."""
    m = ModelConfig(vocab_size=320, n_layers=8, width=512)
    assert m.n_heads == 8 and m.mlp_hidden == 1344
    assert m.non_embedding_params() == 8 * (4 * 512**2 + 3 * 512 * 1344 + 2 * 512) + 512
    assert m.total_params() == m.non_embedding_params() + 320 * 512
    assert m.flops_per_token() == 6 * m.total_params() + 6 * 8 * 512 * 512
    assert all(layers >= 3 and 16 <= width / layers <= 48 for layers, width in plan.LADDER)
    d, hp = design_mod.Design(), plan.HParams()
    cs = d.budgets()
    assert len(cs) >= 5 and cs[-1] / cs[0] >= 6 and cs[0] >= 1e15
    models = plan.ladder_models(plan.BYTE_VOCAB)
    lr_runs = d.lr_sweep(models, hp)
    lower = d.lower(models, plan.LRRule(), hp)
    centres = {c: plan.prior_optimal_params(c, 50.0) for c in cs[d.lower_budgets:]}  # a fitted optimum off the prior
    upper = d.upper(models, plan.LRRule(), hp, centres)
    grid = [r for r in lower + upper if r.stage == "sweep"]
    for c in cs:
        rs = [r for r in grid if r.budget == c]
        n = sorted(r.model.total_params() for r in rs)
        centre = centres.get(c, plan.prior_optimal_params(c, d.tokens_per_param))
        smallest = min(x.total_params() for x in models)
        assert len(n) >= 7 and min(n) <= max(centre / 2.0, smallest) and max(n) >= min(centre * 2.0, max(
            x.total_params() for x in models if c / x.flops_per_token() >= 2 * x.total_params())), (c, n)
        ratios = [b / a for a, b in zip(n, n[1:])]  # the ladder's shapes are discrete: about 1.3x, not exactly
        assert all(1.1 <= r <= 2.0 for r in ratios) and math.prod(ratios) ** (1 / len(ratios)) <= 1.45, (c, ratios)
        assert all(r.tokens >= 2 * r.model.total_params() * 0.99 for r in rs)
        assert {r.batch_size for r in rs} == {64} and all(abs(r.compute / c - 1) < 0.05 for r in rs)
    assert {r.budget for r in lr_runs} == {cs[0]} and len({r.model.name for r in lr_runs}) == 3
    assert {r.budget for r in lower + upper if r.stage == "seed"} == {cs[0]}
    assert {r.seed for r in lower + upper if r.stage == "seed"} == {design_mod.SEED_CHECK_OFFSET}
    batch = [r for r in lower + upper if r.stage == "batch"]
    assert len(batch) == 3 and all(r.budget == cs[0] and r.batch_size == 32 for r in batch)
    assert all(r.beta2 == 0.99 and 0.02 <= r.warmup_steps / r.steps <= 0.05 for r in lr_runs + lower + upper)
    stages = [lr_runs, lower, upper]
    assert design_mod.estimate(stages, pieces=3) <= 25 * 60  # one GPU
    assert design_mod.estimate(stages, pieces=1, workers=4) <= 6.5 * 60  # four GPUs, one call
    assert len({r.id for r in lr_runs + lower + upper}) == len(lr_runs + lower + upper)


def test_window_batch_rule_and_lr_schedule():
    assert plan.budgets(1e14, 1e16, 3) == [1e14, 1e15, 1e16]
    with pytest.raises(ValueError):
        plan.budgets(1e16, 1e14, 3)
    models = plan.ladder_models(320)
    w = plan.window(models, 1e15, 2e6, 5, 4.0)
    assert len(w) == 5 and [m.total_params() for m in w] == sorted(m.total_params() for m in w)
    # sizes that would see under 2 tokens a parameter are no candidates: the window reaches lower instead
    tight = plan.window(models, 1e15, 8e6, 9, 3.0, min_tokens_per_param=2.0)
    assert len(tight) == 9 and all(1e15 / m.flops_per_token() >= 2 * m.total_params() for m in tight)
    assert max(m.total_params() for m in tight) < 8e6 * 3.0
    assert plan.parse_batch_rule("1e14:16,5e14:32,64") == ((1e14, 16), (5e14, 32), (math.inf, 64))
    for bad in ("16,1e14:32", "1e14:16,1e13:32,64", "1e14:0,8", "x"):
        with pytest.raises(ValueError, match="batch-rule"):
            plan.parse_batch_rule(bad)
    cfg = TrainConfig(steps=100, batch_size=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1)


def test_batch_check_at_the_smallest_budget_of_each_batch():
    """With a rule that grows the batch with the budget, the batch check halves the batch at the
    smallest budget of each batch (where that batch's runs take the fewest steps), not only at the
    smallest budget; ``batch_budgets`` overrides the choice, and an index past the budgets is refused."""
    hp = plan.HParams(batch_rule=plan.parse_batch_rule("3.2e14:16,9e14:32,64"))
    d = design_mod.Design(budget_lo=2.2360679775e14, budget_hi=2e16, n_budgets=14)
    assert d.batch_budget_indices(hp) == (0, 2, 5)
    assert [hp.batch(c) for c in d.budgets()][:6] == [16, 16, 32, 32, 32, 64]
    models = plan.ladder_models(plan.BYTE_VOCAB)
    runs = d.lower(models, plan.LRRule(), hp) + d.upper(models, plan.LRRule(), hp, None)
    checks = [r for r in runs if r.stage == "batch"]
    cs = d.budgets()
    assert sorted({(r.budget, r.batch_size) for r in checks}) == [(cs[0], 8), (cs[2], 16), (cs[5], 32)]
    assert len(checks) == 3 * d.batch_check_sizes
    assert design_mod.Design().batch_budget_indices(plan.HParams()) == (0,)  # one batch: the smallest alone
    assert design_mod.Design(batch_budgets=(-1,)).batch_budget_indices(hp) == (4,)
    with pytest.raises(ValueError, match="batch check's budgets"):
        design_mod.Design(batch_budgets=(5,))


def test_step_cost_matches_the_committed_h100_runs():
    """The GPU-time model behind the default design predicts the step times of the committed 4 x H100
    sweep's runs at the default batch (64 sequences) within 10% each (it was scaled to them)."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "scaling-h100x4-2026-11-27", "seed0",
                        "report.json")
    runs = [r for r in json.load(open(path))["runs"] if r["backend"] == "kernels" and r["train"]["batch_size"] == 64]
    assert len(runs) > 40 and {plan.HParams().batch(c) for c in (1e13, 1e15, 1e17)} == {64}
    for r in runs:
        m = ModelConfig(**r["model"])
        ratio = plan.H100.step_seconds(m, r["train"]["batch_size"]) / (r["train_seconds"] / r["steps"])
        assert 0.9 < ratio < 1.1, (r["id"], ratio)


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


def test_corpus_record_names_the_folders_two_machines_differ_by(tmp_path):
    """meta.json counts the files and bytes under each first folder, so that a corpus that changed
    (a package installed on one machine and not the other) is named, not only counted."""
    rng = np.random.default_rng(1)
    src = tmp_path / "src"
    for pkg in ("alpha", "beta"):
        (src / pkg / "sub").mkdir(parents=True)
        for i in range(4):
            (src / pkg / "sub" / f"m{i}.py").write_text(" ".join(rng.choice(["a", "b", "c", "\n"], 200 + i)))
    (src / "top.md").write_text("a readme " * 30)
    log = lambda *_: None  # noqa: E731
    before = data_mod.prepare(data_mod.DataConfig(path=str(src)), tmp_path / "cache", log=log).meta
    assert before["folders"] == {"*": [1, 270], "alpha/sub": [4, before["folders"]["alpha/sub"][1]],
                                 "beta/sub": [4, before["folders"]["beta/sub"][1]]}
    assert sum(n for _, n in before["folders"].values()) == before["train_bytes"] + before["val_bytes"]
    (src / "gamma" / "x").mkdir(parents=True)
    (src / "gamma" / "x" / "new.py").write_text("print(1)\n" * 9)
    (src / "alpha" / "sub" / "m0.py").unlink()
    after = data_mod.prepare(data_mod.DataConfig(path=str(src)), tmp_path / "cache", log=log).meta
    assert after["fingerprint"] != before["fingerprint"]
    said = data_mod.difference(before, after)
    assert "gamma/x only here (1 files)" in said and "alpha/sub differs (4 files" in said and "beta" not in said
    # a record without folders (an older meta.json): the counts
    legacy = {k: v for k, v in before.items() if k != "folders"}
    assert data_mod.difference(legacy, after).endswith(f"({after['documents'] - before['documents']:+,} documents, "
                                                     f"{data_mod._bytes(after) - data_mod._bytes(before):+,} bytes)")


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
    """The whole pipeline at tiny sizes: a learning-rate sweep (extended where its best rate is an edge),
    two lower budgets, then two upper budgets centred on their fit, a second seed, the batch check;
    every fit written, no empty file left (the batch check at the smallest budget of each of the two
    batches). Stopped by its time limit it resumes from the checkpoint,
    a third invocation retrains nothing, and with a run missing the report still comes, exit 3."""
    args = ["--out", str(tmp_path), *TINY, *TINY_LR, "--backend", "reference"]
    assert sweep.main([*args, "--time-limit", "0"]) == runner.EXIT_INCOMPLETE
    assert list((tmp_path / "checkpoints").glob("*.pt"))
    capsys.readouterr()
    assert sweep.main(args) == 0
    out = capsys.readouterr().out
    assert "resuming at step" in out and "upper budgets' windows:" in out
    rep = json.loads((tmp_path / "report.json").read_text())
    an, runs = rep["analysis"], rep["runs"]
    stages = [r["stage"] for r in runs]
    assert stages.count("sweep") == 12 and stages.count("seed") == 3 and stages.count("batch") == 2
    assert stages.count("lr") >= 3 and len({r["budget"] for r in runs if r["stage"] == "sweep"}) == 4
    assert all(set(report.RUN_FIELDS) <= set(r) for r in runs)
    assert {r["batch"] for r in runs if r["stage"] == "sweep"} == {4, 8}
    for key in ("approach1", "approach2", "approach3", "e_profile", "gate", "intervals", "extrapolation", "lr_rule"):
        assert key in an and an[key] is not None, key
    assert an["gate"]["ok"] in (True, False) and an["seed_spread"]["n"] == 3 and an["batch_check"]["n"] == 2
    assert json.loads((tmp_path / "centres.json").read_text())["runs"]
    md = (tmp_path / "report.md").read_text()
    assert "## Quality gate:" in md and "Porian" in md and "Besiroglu" in md and "bits/byte" in md
    assert set(an["figures"]) | set(an["figures_skipped"]) == {"isoflop.png", "optimal.png", "lnd_fit.png",
                                                               "curves.png", "lr_sweep.png"}
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size == 0]
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")}
    archive = tmp_path.parent / f"{tmp_path.name}-state.tar.gz"
    assert sweep.main([*args, "--bootstrap", "0", "--archive", str(archive)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*.json")} == stamps
    # a fresh machine: the archive alone (no token arrays, no checkpoints) refits the same runs
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "centres.json" in names and not [n for n in names if n.endswith(".npy") or n.startswith("checkpoints")]
    fresh = tmp_path.parent / f"{tmp_path.name}-fresh"
    assert sweep.main(["--out", str(fresh), *TINY, *TINY_LR, "--backend", "reference", "--bootstrap", "0",
                       "--restore", str(archive), "--fit-only"]) == 0
    assert len(json.loads((fresh / "report.json").read_text())["runs"]) == len(runs)
    # the committed report alone (an archive lost) restores every run, the rule and the windows
    from_report = tmp_path.parent / f"{tmp_path.name}-from-report"
    assert sweep.main(["--out", str(from_report), *TINY, *TINY_LR, "--backend", "reference", "--bootstrap", "0",
                       "--restore", str(tmp_path / "report.json"), "--fit-only"]) == 0
    assert len(json.loads((from_report / "report.json").read_text())["runs"]) == len(runs)
    for name in ("centres.json", "lr_rule.json"):
        assert json.loads((from_report / name).read_text()) == json.loads((tmp_path / name).read_text()), name
    # the report restored where the corpus differs (here a smaller --max-bytes) stops before any training
    other = tmp_path.parent / f"{tmp_path.name}-other-data"
    with pytest.raises(SystemExit, match=rf"{len(runs)} finished run\(s\) .* trained on data {rep['data']['fingerprint']}, "
                                         r"but this machine's is \w+: .* documents"):
        sweep.main(["--out", str(other), *TINY, *TINY_LR, "--backend", "reference", "--max-bytes", "150000",
                    "--restore", str(tmp_path / "report.json")])
    assert not list((other / "checkpoints").glob("*")) and len(list((other / "runs").glob("*.json"))) == len(runs)
    (tmp_path.parent / "not-a-report.json").write_text('{"runs": []}')
    with pytest.raises(ValueError, match="not a report.json"):
        sweep.main(["--out", str(from_report), *TINY, "--restore", str(tmp_path.parent / "not-a-report.json")])
    next((tmp_path / "runs").glob("sweep-C6e09-*.json")).unlink()
    assert sweep.main([*args, "--bootstrap", "0", "--fit-only"]) == runner.EXIT_INCOMPLETE
    assert len(json.loads((tmp_path / "report.json").read_text())["runs"]) == len(runs) - 1


def test_rule_and_windows_are_refitted_when_their_runs_data_changes(tmp_path):
    """A record fitted from runs of one corpus is not reused for runs of the same names on another;
    a record restored from a report (which names no data) is its runs' own."""
    session = runner.Session(sweep.build_parser().parse_args(["--out", str(tmp_path), "--device", "cpu"]), [])
    session.fingerprint = "corpus-a"
    assert session.fitted_once("x.json", ["r1"], lambda: {"v": 1})["v"] == 1
    assert session.fitted_once("x.json", ["r1"], lambda: {"v": 2})["v"] == 1
    session.fingerprint = "corpus-b"
    assert session.fitted_once("x.json", ["r1"], lambda: {"v": 3}) == {"v": 3, "runs": ["r1"], "data": "corpus-b"}
    store.write_json(tmp_path / "y.json", {"v": 4, "runs": ["r1"]})
    assert session.fitted_once("y.json", ["r1"], lambda: {"v": 5})["v"] == 4


def test_missing_extras_stop_before_any_data(tmp_path, monkeypatch, capsys):
    real = sweep.importlib.util.find_spec
    monkeypatch.setattr(sweep.importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    assert sweep.main(["--out", str(tmp_path / "out"), *TINY]) == sweep.EXIT_USAGE
    assert 'pip install "llmkernels[scaling]"' in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_run_order():
    """Runs are handed out longest first, with or without a time limit: the processes end together,
    and a call cut by its limit has started its longest runs first."""
    d, hp = design_mod.Design(), plan.HParams()
    runs = d.lower(plan.ladder_models(320), plan.LRRule(), hp) + d.upper(plan.ladder_models(320), plan.LRRule(), hp, None)
    order = runner.run_order(runs)
    assert sorted(map(id, order)) == sorted(map(id, runs))
    assert [plan.H100.run_seconds(r) for r in order] == sorted((plan.H100.run_seconds(r) for r in runs), reverse=True)
    assert order[0].budget == max(r.budget for r in runs)  # the largest budget's longest run leads


def test_cli_help_and_list_build_nothing(tmp_path, capsys):
    parser = sweep.build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text and "Exit status" in text
    out_dir = tmp_path / "out"
    assert cli.main(["scaling", "--out", str(out_dir), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not out_dir.exists()  # no data, no tokenizer, nothing written
    rows = [ln for ln in lines if ln.startswith(("lr-", "sweep-", "seed-", "batch-", "backend-"))]
    assert sum(r.startswith("sweep-") for r in rows) >= 35 and sum(r.startswith("lr-") for r in rows) >= 12
    assert "IsoFLOP runs" in lines[-1] and "min on one H100" in lines[-1]
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(out_dir), "--list", "--batch-rule", "16,1e14:32"])


def _lower_runs(rng, exponent: float, noise: float, budgets=(3e13, 5.8e13, 1.1e14, 2.2e14, 4.2e14)) -> list[dict]:
    """IsoFLOP runs whose loss is a parabola in log N around ``N_opt = 0.1·C^exponent`` (7 sizes 1.3x apart)."""
    runs = []
    for c in budgets:
        n_opt = 0.1 * c**exponent
        for k in range(-3, 4):
            n = n_opt * 1.3**k * rng.uniform(0.9, 1.1)
            runs.append({"budget": c, "name": f"n{k}", "params": n, "non_embedding_params": 0.8 * n,
                         "tokens": c / (6 * n), "val_loss": 1.0 + 0.2 * math.log(n / n_opt) ** 2 + rng.normal(0, noise),
                         "stage": "sweep"})
    return runs


def test_centre_plan_uses_a_good_fit_and_shrinks_a_poor_one_toward_the_prior(seed):
    """The upper windows' centres, from synthetic lower budgets (no training): a clean 5-budget fit is
    used as it is; a noisy 3-budget one (call 2 on the H200: r2 0.01, exponent 0.05 ± 0.37) is shrunk
    toward a = 0.5 through the budgets' own optima, and its windows widen; none without results."""
    rng = np.random.default_rng(seed)
    upper = [8e14, 1.6e15, 3e15]
    clean = _lower_runs(rng, 0.45, noise=0.002)
    a2 = fit.approach2(clean)
    good = design_mod.centre_plan(clean, a2["fit_n"], a2["optima"], upper, 3.0)
    assert good["good_fit"] and good["exponent"] == pytest.approx(0.45, abs=0.05), seed
    assert all(good["centres"][c] == pytest.approx(0.1 * c**0.45, rel=0.25) for c in upper), seed
    poor_fit = {"ok": True, "exponent": 0.054, "exponent_se": 0.374, "coef": 5.5e4, "r2": 0.012, "n_points": 3}
    few = [r for r in clean if r["budget"] <= 1.1e14]
    poor = design_mod.centre_plan(few, poor_fit, fit.approach2(few)["optima"], upper, 3.0)
    assert not poor["good_fit"] and 0.45 < poor["exponent"] < 0.5 and "blended" in poor["source"]
    assert all(poor["centres"][c] == pytest.approx(0.1 * c**0.45, rel=0.6) for c in upper), seed
    assert all(3.0 < poor["spans"][c] <= 3.0 * design_mod.MAX_SPAN_GROWTH for c in upper)
    assert poor["spans"][3e15] > poor["spans"][8e14]
    assert design_mod.centre_plan([], None, [], upper, 3.0)["centres"] == {}
    # the wider span reaches further along the ladder than the design's
    models, d = plan.ladder_models(320), design_mod.Design()
    wide, base = (d.sizes(models, 3e15, poor["centres"][3e15], span) for span in (poor["spans"][3e15], None))
    assert wide[-1].total_params() / wide[0].total_params() > base[-1].total_params() / base[0].total_params()


def test_qk_norm_model_counts_and_old_keys(device):
    """QK-norm adds two head-size norms a block (counted), trains on both backends alike, and leaves the
    record of a model without it unchanged (runs recorded before the option keep their keys)."""
    off = ModelConfig(vocab_size=64, n_layers=2, width=32, seq_len=16, head_dim=16)
    on = ModelConfig(vocab_size=64, n_layers=2, width=32, seq_len=16, head_dim=16, qk_norm=True)
    assert "qk_norm" not in off.to_dict() and on.to_dict()["qk_norm"] is True
    assert on.total_params() - off.total_params() == 2 * 2 * 16
    x = torch.randint(0, 64, (2, 17), device=device)
    losses = {}
    for backend in ("kernels", "reference"):
        torch.manual_seed(0)
        model = GPT(on, backend=backend).to(device)
        assert sum(p.numel() for p in model.parameters()) == on.total_params()
        losses[backend] = model(x[:, :-1], x[:, 1:])
        losses[backend].backward()
    assert losses["kernels"].item() == pytest.approx(losses["reference"].item(), rel=1e-4)


# --------------------------------------------------------------------------------------------
# several training processes, archives, replicates, the README's recipe
# --------------------------------------------------------------------------------------------
# Two budgets of two sizes, a second seed at the first, half the batch at one size of the first: seven
# runs, too few for the slow fits (scheduling, archives and seeds only).
MINI = ["--data", EMAIL, "--max-bytes", "200000", "--seq-len", "32", "--head-dim", "16", "--ladder", "1x16,1x32,2x32",
        "--budgets", "5e8,1e9,2", "--sizes-per-budget", "2", "--span", "2", "--min-tokens-per-param", "0",
        "--batch-rule", "4", "--eval-tokens", "1024", "--curve-points", "2", "--curve-eval-tokens", "256",
        "--bootstrap", "0", "--no-progress", "--lr", "3e-3", "--seed-budgets", "0", "--batch-check", "1",
        "--backend", "reference", "--device", "cpu"]
MINI_RUNS = 7


def _runs(report_dir) -> dict:
    return {r["id"]: r for r in json.loads((report_dir / "report.json").read_text())["runs"]}


def test_workers_share_the_runs_and_give_one_process_results(tmp_path):
    """Three CPU training processes take the runs of each stage between them; the plan (every run id)
    and every loss, bit for bit, are those of one process."""
    assert sweep.main(["--out", str(tmp_path / "one"), *MINI]) == 0
    assert sweep.main(["--out", str(tmp_path / "three"), "--workers", "3", *MINI]) == 0
    one, three = _runs(tmp_path / "one"), _runs(tmp_path / "three")
    assert one.keys() == three.keys() and len(one) == MINI_RUNS
    assert [one[k]["val_loss"] for k in one] == [three[k]["val_loss"] for k in one]
    assert len({r["process"] for r in three.values()}) >= 2 and len({r["process"] for r in one.values()}) == 1
    rep = json.loads((tmp_path / "three" / "report.json").read_text())
    assert rep["info"]["workers"] == 3 and "3 training process(es)" in (tmp_path / "three" / "report.md").read_text()


def test_runs_at_once_in_a_process_give_one_run_at_a_time_results(tmp_path):
    """Two runs at once in one training process (threads; on a GPU each on its own stream): the
    same plan and every loss, bit for bit, as one run at a time; both threads trained."""
    assert sweep.main(["--out", str(tmp_path / "one"), *MINI]) == 0
    assert sweep.main(["--out", str(tmp_path / "two"), "--runs-per-device", "2", *MINI]) == 0
    one, two = _runs(tmp_path / "one"), _runs(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == MINI_RUNS
    assert [one[k]["val_loss"] for k in one] == [two[k]["val_loss"] for k in one]
    assert len({r["process"] for r in two.values()}) == 1 and len({r["slot"] for r in two.values()}) == 2
    rep = json.loads((tmp_path / "two" / "report.json").read_text())
    assert rep["info"]["runs_per_device"] == 2 and "2 runs at once in each" in (tmp_path / "two" / "report.md").read_text()
    with pytest.raises(SystemExit, match="--runs-per-device must be >= 1"):
        sweep.main(["--out", str(tmp_path / "bad"), "--runs-per-device", "0", *MINI])


def test_runs_at_once_set_up_one_at_a_time(tmp_path, monkeypatch):
    """Runs trained at once in a process (threads) build their steps (warm-up and, on a GPU, the
    CUDA-graph capture) one at a time: a capture fails when another thread's capture set-up
    synchronises the device."""
    corpus = data_mod.prepare(data_mod.DataConfig(path=EMAIL, max_bytes=60000), tmp_path / "data", log=lambda *_: None)
    train, val = torch.from_numpy(corpus.train), torch.from_numpy(corpus.val)
    windows = {"final": eval_windows(val, 32, 256), "curve": eval_windows(val, 32, 128)}
    t = TrainConfig(steps=4, batch_size=2, lr=3e-3, warmup_steps=1, eval_tokens=256, curve_points=1,
                    curve_eval_tokens=128, log_every=2)
    lock, building, most = threading.Lock(), [0], [0]
    real = train_mod.Stepper.__init__

    def spy(self, *args, **kwargs):
        with lock:
            building[0] += 1
            most[0] = max(most[0], building[0])
        time.sleep(0.3)  # long enough for the other thread to arrive
        try:
            real(self, *args, **kwargs)
        finally:
            with lock:
                building[0] -= 1
    monkeypatch.setattr(train_mod.Stepper, "__init__", spy)

    losses = []

    def one(width):
        losses.append(train_run(ModelConfig(vocab_size=320, n_layers=1, width=width, seq_len=32, head_dim=16), t, train, windows,
                  backend="reference", device=torch.device("cpu"), dtype=torch.float32, key={}, beside_others=True,
                  progress=False, log=lambda *_: None)["val_loss"])
    threads = [threading.Thread(target=one, args=(width,)) for width in (16, 32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(losses) == 2 and most[0] == 1 and building[0] == 0


def test_archive_is_packed_after_every_finished_run(tmp_path, monkeypatch):
    """--archive is rewritten after each run that finishes, so a call killed at any moment (SIGKILL:
    no ``finally``) loses only the runs in flight."""
    counts = []
    real = runner.pack

    def spy(out, archive):
        n = real(out, archive)
        with tarfile.open(archive) as tar:
            counts.append(sum(m.startswith("runs/") for m in tar.getnames()))
        return n
    monkeypatch.setattr(runner, "pack", spy)
    archive = tmp_path / "state.tar.gz"
    assert sweep.main(["--out", str(tmp_path / "out"), *MINI, "--archive", str(archive)]) == 0
    total = len(list((tmp_path / "out" / "runs").glob("*.json")))
    assert counts[:total] == list(range(1, total + 1)) and counts[-1] == total


@pytest.mark.slow
def test_terminated_call_keeps_its_runs_and_a_fresh_machine_resumes(tmp_path):
    """A call on two training processes stopped by SIGTERM packs what finished (exit 143); a call on a
    fresh folder restores the archive and trains only the runs that were missing."""
    archive = tmp_path / "state.tar.gz"
    env = {k: v for k, v in os.environ.items()} | {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "llmkernels.scaling", "--out", str(tmp_path / "a"), "--workers", "2", *MINI,
           "--archive", str(archive)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None and not (archive.exists() and _archived(archive)):
            proc.stdout.readline()  # the call's log; each finished run packs the archive
        proc.terminate()
        log = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15, log
    kept = _archived(archive)
    assert kept and kept == {p.name for p in (tmp_path / "a" / "runs").glob("*.json")}, log
    out = tmp_path / "b"
    assert sweep.main(["--out", str(out), *MINI, "--restore", str(archive)]) == 0
    runs = _runs(out)
    assert len(runs) == MINI_RUNS and {f"{k}.json" for k in runs} >= kept
    assert sum(r["process"] == os.getpid() for r in runs.values()) == MINI_RUNS - len(kept)  # trained here


def test_horizon_and_the_runs_measured_before_decide_what_starts(tmp_path, capsys):
    """The runs an earlier call measured on this device predict a missing run's seconds: with no time
    to its horizon it does not start (exit 3); with a horizon past it, it does."""
    out = tmp_path / "out"
    assert sweep.main(["--out", str(out), *MINI]) == 0
    missing = next(out.glob("runs/sweep-*.json"))
    missing.unlink()
    capsys.readouterr()
    assert sweep.main(["--out", str(out), *MINI, "--list", "--runs-per-device", "2"]) == 0
    left = capsys.readouterr().out.splitlines()[-1]
    assert left.startswith(f"finished in {out}: {MINI_RUNS - 1} of {MINI_RUNS} runs; left: 1 runs") and "finished on cpu" in left
    assert "with --runs-per-device 2" in left and f"not less than its longest run, {missing.stem}, takes" in left
    assert sweep.main(["--out", str(out), *MINI, "--time-limit", "600", "--horizon", "0"]) == runner.EXIT_INCOMPLETE
    assert not missing.exists() and "1 run(s) of this stage not finished" in capsys.readouterr().out
    assert sweep.main(["--out", str(out), *MINI, "--time-limit", "0", "--horizon", "600"]) == runner.EXIT_INCOMPLETE
    assert not missing.exists() and (out / "checkpoints" / missing.name.replace(".json", ".pt")).exists()
    assert sweep.main(["--out", str(out), *MINI, "--horizon", "600"]) == 0
    assert json.loads(missing.read_text())["resumed_from_step"] > 0
    with pytest.raises(SystemExit, match="--horizon must be >= 0 seconds"):
        sweep.main(["--out", str(out), *MINI, "--horizon", "-1"])


def test_estimate_covers_the_steps_left():
    """A resumed run's seconds measured the steps it had left; a checkpoint's step shortens a prediction;
    another card's runs measure nothing here."""
    run = next(r for r in _mini_plan() if r.stage == "sweep")
    est = plan.Estimator(cuda=False, device="GPU X")
    assert est.seconds(run) is None
    full = plan.H100.run_seconds(run)
    half = run.steps // 2
    est.add(run, {"wall_seconds": 3.0 * plan.H100.run_seconds(run, run.steps - half), "resumed_from_step": half,
                  "device": "GPU X"})
    assert est.seconds(run) == pytest.approx(3.0 * full)
    assert est.seconds(run, done=run.steps // 4) == pytest.approx(3.0 * plan.H100.run_seconds(run, run.steps - run.steps // 4))
    est.add(run, {"wall_seconds": 0.0, "resumed_from_step": 0, "device": "GPU X"})  # a diverged record: nothing measured
    assert est.count() == 1
    # two runs of one width: their own median; a width with fewer: every run's
    other = next(r for r in _mini_plan() if r.model.width != run.model.width)
    est.add(run, {"wall_seconds": 5.0 * full, "resumed_from_step": 0, "device": "GPU X"})
    est.add(run, {"wall_seconds": 50.0 * full, "resumed_from_step": 0, "device": "GPU Y"})  # another card
    est.add(other, {"wall_seconds": 10.0 * plan.H100.run_seconds(other), "resumed_from_step": 0, "device": "GPU X"})
    assert est.seconds(run) == pytest.approx(4.0 * full)
    assert est.seconds(run, q=0.9) == pytest.approx(4.8 * full)  # between the two, near the slower
    assert est.seconds(other) == pytest.approx(5.0 * plan.H100.run_seconds(other))


def test_estimate_pools_a_shape_before_its_width():
    """Two runs of one shape: their own median; a shape with fewer but a width with two or more:
    the width's; so a shallow model's fixed costs are not hidden in a deeper one's ratio."""
    shallow = next(r for r in _mini_plan() if r.stage == "sweep")
    deep = dataclasses.replace(shallow, model=dataclasses.replace(shallow.model, n_layers=shallow.model.n_layers + 2))
    est = plan.Estimator(cuda=True, device="GPU X")
    for run, ratio in ((shallow, 6.0), (shallow, 8.0), (deep, 2.0)):
        est.add(run, {"wall_seconds": ratio * plan.H100.run_seconds(run), "device": "GPU X"})
    assert est.seconds(shallow) == pytest.approx(7.0 * plan.H100.run_seconds(shallow))
    assert est.seconds(deep) == pytest.approx(6.0 * plan.H100.run_seconds(deep))  # the width's three
    assert est.ratio() == pytest.approx(6.0)


def test_a_run_starts_under_a_horizon_by_the_slow_end_of_its_widths_ratios(tmp_path):
    """The runs of one width measured 2x, 3x and 10x their H100 estimate (how many shared the GPU
    differs): a run is started only if it ends in time at the slow end, where the median would
    have cut it short."""
    args = sweep.build_parser().parse_args(["--out", str(tmp_path), "--device", "cpu", *MINI])
    session = runner.Session(args, [])
    session.hp, session.fingerprint = design_mod.design_from(args)[1], "f" * 16
    run = next(r for r in _mini_plan() if r.stage == "sweep")
    for ratio in (2.0, 3.0, 10.0):
        session.estimator.add(run, {"wall_seconds": ratio * plan.H100.run_seconds(run), "device": "cpu"})
    task = session.task(run)
    assert task.predicted == pytest.approx(np.quantile([2.0, 3.0, 10.0], plan.ADMIT_QUANTILE) * plan.H100.run_seconds(run))
    assert task.predicted > 3.0 * plan.H100.run_seconds(run)
    # the stage's time left counts every run not finished (a horizon's skipped ones too), at the median
    lines, (other,) = [], [r for r in _mini_plan() if r.stage == "sweep" and r.id != run.id][:1]
    session.log, session.meta = lines.append, {"val_tokens_per_byte": 1.0}
    session.trainer = type("Trainer", (), {"workers": 2})()
    result = {"val_loss": 1.0, "train_seconds": 1.0, "tokens_per_s": 1.0, "mfu": None}
    session.log_result("upper", 1, 3, run, result, [run, other])
    eta = sum(session.estimator.seconds(r) for r in (run, other)) / 2
    assert lines[-1].endswith(f"; about {runner._fmt_seconds(eta)} left in this stage"), lines


def test_checkpointed_step_reads_only_its_own_runs_checkpoint(tmp_path):
    session = runner.Session(sweep.build_parser().parse_args(["--out", str(tmp_path), "--device", "cpu"]), [])
    session.ckpt_dir.mkdir(parents=True)
    run = next(r for r in _mini_plan() if r.stage == "sweep")
    assert session.checkpointed_step(run, {"k": 1}) == 0
    torch.save({"key": {"k": 1}, "step": 17, "state": {"w": torch.randn(3)}}, session.ckpt_dir / f"{run.id}.pt")
    assert session.checkpointed_step(run, {"k": 1}) == 17
    assert session.checkpointed_step(run, {"k": 2}) == 0
    (session.ckpt_dir / f"{run.id}.pt").write_bytes(b"torn")
    assert session.checkpointed_step(run, {"k": 1}) == 0


def _mini_plan():
    args = sweep.build_parser().parse_args(MINI)
    design, hp, ladder = design_mod.design_from(args)
    models = plan.ladder_models(plan.BYTE_VOCAB, args.seq_len, args.head_dim, ladder)
    return design.lower(models, plan.LRRule(c=args.lr, source="--lr"), hp)


def _archived(archive) -> set:
    try:
        with tarfile.open(archive) as tar:
            return {m.split("/", 1)[1] for m in tar.getnames() if m.startswith("runs/") and m.endswith(".json")}
    except (OSError, tarfile.TarError):
        return set()


def test_report_restores_a_diverged_run_with_the_sweeps_dtype(tmp_path):
    """A diverged run's record (no loss, no dtype) comes back from a report with the key the sweep
    gave it, so that it is not trained again."""
    model, train = {"n_layers": 1, "width": 16}, {"steps": 5, "lr": 0.01}
    runs = [{"id": "a", "model": model, "train": train, "backend": "kernels", "dtype": "bfloat16", "val_loss": 1.0},
            {"id": "b", "model": model, "train": train, "backend": "kernels", "val_loss": None, "diverged": "nan"}]
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"data": {"fingerprint": "f"}, "analysis": {"lr_rule": None}, "runs": runs}))
    assert store.unpack_report(path, tmp_path / "out") == 2
    for run in runs:
        back = json.loads((tmp_path / "out" / "runs" / f"{run['id']}.json").read_text())
        assert back["key"] == {"run": run["id"], "model": model, "train": train, "backend": "kernels",
                               "dtype": "bfloat16", "data": "f"}
    assert json.loads((tmp_path / "out" / "data" / "f" / "meta.json").read_text()) == {"fingerprint": "f"}
    assert not (tmp_path / "out" / "lr_rule.json").exists() and not (tmp_path / "out" / "centres.json").exists()


def test_seed_gives_an_independent_replicate():
    """--seed changes every run's initialisation and data order (unrelated streams), and a replicate
    with a nearby seed shares no run with the first sweep or its seed check."""
    names = ["L3-W64", "L8-W512"]
    seeds = {(s, n, k): train_mod.run_seed(s, n, k) for s in (0, 1, 2) for n in names for k in ("init", "data")}
    assert len(set(seeds.values())) == len(seeds)
    models, hp, rule = plan.ladder_models(320), plan.HParams(), plan.LRRule()
    ids = {}
    for s in (0, 1):
        d = design_mod.Design(seed=s)
        ids[s] = {r.id for r in d.lr_sweep(models, hp) + d.lower(models, rule, hp) + d.upper(models, rule, hp, None)}
    assert not ids[0] & ids[1]
    cfg = ModelConfig(vocab_size=64, n_layers=1, width=16, seq_len=8, head_dim=8)
    tokens = torch.randint(0, 64, (4096,))
    starts = [train_mod.Stepper(GPT(cfg, "reference"), TrainConfig(steps=3, batch_size=2, lr=1e-3, seed=s), tokens,
                                device=torch.device("cpu"), amp=train_mod.autocast_for(torch.device("cpu"), torch.float32),
                                capture=False).starts for s in (0, 1)]
    assert not torch.equal(*starts)


def _cpu_recipe() -> list[str]:
    """The published CPU recipe (README.md, or benchmarks/RESULTS.md where the README links it): the
    arguments of its ``llmkernels scaling --device cpu ...`` command."""
    for doc in ("README.md", os.path.join("benchmarks", "RESULTS.md")):
        text = open(os.path.join(ROOT, doc)).read()
        if "llmkernels scaling --device cpu" in text:
            start = text.index("llmkernels scaling --device cpu")
            return shlex.split(text[start:text.index("```", start)].replace("\\\n", " "))[2:]
    raise AssertionError("no CPU recipe (llmkernels scaling --device cpu ...) in README.md or benchmarks/RESULTS.md")


def _set(args: list[str], flag: str, value: str) -> list[str]:
    if flag in args:
        i = args.index(flag)
        return args[:i + 1] + [value] + args[i + 2:]
    return [*args, flag, value]


@pytest.mark.slow
def test_cpu_recipe_runs_at_a_smaller_size(tmp_path):
    """The published CPU recipe as written, on fewer bytes of text (the email package), budgets ten
    times smaller, fewer held-out tokens and resamples: it completes and writes the whole report."""
    args = _cpu_recipe()
    assert args[:2] == ["--device", "cpu"] and "--out" in args, args
    lo, hi, count = args[args.index("--budgets") + 1].split(",")
    for flag, value in (("--out", str(tmp_path)), ("--data", EMAIL), ("--max-bytes", "300000"),
                        ("--budgets", f"{float(lo) / 10:g},{float(hi) / 10:g},{count}"), ("--eval-tokens", "4096"),
                        ("--curve-eval-tokens", "1024"), ("--bootstrap", "10")):
        args = _set(args, flag, value)
    assert sweep.main([*args, "--no-progress", "--backend", "reference"]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Result" in md and "## Quality gate:" in md and "## Against the literature" in md


def test_step_profile_sorts_kernels_into_families():
    """benchmarks/scaling_check.py --profile sums a step's kernels by family, by their names."""
    check = benchmark_script("scaling_check")
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
             "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul", "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
             "cutlass::bfloat16_t, Flash_kernel_traits": "attention",
             "norm_fwd_kernel": "norm", "norm_bwd_split_kernel": "norm", "_rope_kernel": "rope", "_glu_bwd_kernel": "glu",
             "_qk_norm_rope_bwd": "qk-norm + rope",
             "ce_fused_split_kernel": "head + loss", "void at::native::reduce_kernel<512, 1>": "optimizer + clip",
             "void at::native::(anonymous namespace)::fused_adamw_kernel": "optimizer + clip",
             "embedding_backward_feature_kernel": "embedding",
             "void at::native::vectorized_elementwise_kernel<4, CopyFunctor>": "elementwise (copies, casts, fills)",
             "some_new_kernel": "other"}
    assert {k: check.family(k) for k in names} == names


def test_attention_is_held_to_the_backend_asked():
    """--attention holds F.scaled_dot_product_attention to one backend (here on a CPU, where
    cuDNN's cannot run, so the call fails instead of taking another); default leaves PyTorch's choice."""
    check = benchmark_script("scaling_check")
    q = torch.randn(1, 2, 4, 8)
    with check.attention_backend("default"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with check.attention_backend("cudnn"), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # (the hold ends with the context)
