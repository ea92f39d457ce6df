"""Scaling-law experiments (llmkernels.scaling): the model on both backends, data, schedule, fits,
and the whole pipeline on tiny sizes (CPU; the kernels backend through Triton's interpreter)."""
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
from llmkernels.scaling import fit as fit_mod
from llmkernels.scaling import main
from llmkernels.scaling import train as train_mod
from llmkernels.scaling.model import GPT, ModelConfig
from llmkernels.scaling.train import TrainConfig, lr_at, train_size

from .conftest import DEVICE

# A tiny sweep: a ~120 KB slice of the stdlib, sequences of 32 tokens, 4 per step.
TINY = ["--max-bytes", "120000", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
        "--eval-tokens", "1024", "--curve-points", "3", "--curve-eval-tokens", "256", "--no-progress",
        "--tokens-per-param", "0.4", "--sizes", "1x16x2,1x32x2,2x32x2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one CPU thread beats several, which spin against each other (and
    against other processes on a 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_model_backends_agree_and_count_params(device):
    """Same init, fp32: the kernels backend (norms, RoPE, fused linear CE) gives the reference's
    loss and every parameter gradient."""
    cfg = ModelConfig(vocab_size=300, n_layers=2, width=32, n_heads=2, seq_len=16)
    models = {}
    for backend in ("kernels", "reference"):
        torch.manual_seed(0)
        models[backend] = GPT(cfg, backend=backend).to(device)
    assert models["kernels"].non_embedding_params() == cfg.non_embedding_params()
    idx = torch.randint(0, 300, (3, 17), device=device)
    losses = {}
    for backend, m in models.items():
        losses[backend] = m(idx[:, :-1], idx[:, 1:])
        losses[backend].backward()
    assert abs(losses["kernels"].item() - losses["reference"].item()) < 1e-5
    assert abs(losses["reference"].item() - math.log(300)) < 0.5  # near-uniform at init
    for (name, pk), (_, pr) in zip(models["kernels"].named_parameters(), models["reference"].named_parameters()):
        assert pr.grad is not None and pr.grad.norm() > 0, name
        assert ((pk.grad - pr.grad).norm() / pr.grad.norm()).item() < 1e-4, name
    per_token = models["kernels"](idx[:, :-1], idx[:, 1:], reduction="none")
    assert per_token.shape == (3 * 16,)
    assert abs(per_token.double().mean().item() - losses["reference"].item()) < 1e-5


def test_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(vocab_size=10, n_layers=1, width=30, n_heads=4, seq_len=8)
    with pytest.raises(ValueError, match="width"):
        ModelConfig(vocab_size=10, n_layers=1, width=0, n_heads=1, seq_len=8)
    cfg = ModelConfig(vocab_size=10, n_layers=1, width=16, n_heads=2, seq_len=8)
    with pytest.raises(ValueError, match="backend"):
        GPT(cfg, backend="fast")
    m = GPT(cfg, backend="reference")
    with pytest.raises(ValueError, match="longer than seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="idx"):
        m(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long))


def test_lr_schedule():
    cfg = TrainConfig(tokens=1, batch_size=1, lr=1.0, warmup_frac=0.1, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # 10 warm-up steps
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:]))  # cosine: strictly decreasing
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and min(lrs) >= 0.1


def test_fit_recovers_power_law(monkeypatch):
    rng = np.random.default_rng(0)
    n = np.logspace(4, 7, 8)
    y = 1.7 + 40.0 * n ** -0.35 + rng.normal(0, 1e-3, n.size)
    f = fit_mod.fit_power_law(n, y)
    assert f["ok"] and f["method"] == "curve_fit"
    assert f["alpha"] == pytest.approx(0.35, rel=0.05) and f["E"] == pytest.approx(1.7, abs=0.02)
    assert f["r2"] > 0.999 and len(f["residuals"]) == 8
    assert np.allclose(fit_mod.predict(f, n), f["predicted"])
    assert not fit_mod.fit_power_law(n[:2], y[:2])["ok"]  # 3 parameters need 3 points

    import scipy.optimize

    def broken(*args, **kwargs):
        raise RuntimeError("Optimal parameters not found")
    monkeypatch.setattr(scipy.optimize, "curve_fit", broken)
    g = fit_mod.fit_power_law(n, 5.0 * n ** -0.2)
    assert g["ok"] and "E=0" in g["method"] and "Optimal parameters" in g["error"]
    assert g["alpha"] == pytest.approx(0.2, rel=1e-6) and g["E"] == 0.0


def test_frontier_takes_the_lower_envelope():
    small = {"name": "s", "curve": [{"compute": c, "val_loss": l} for c, l in [(1e3, 5.0), (1e4, 3.0)]]}
    large = {"name": "l", "curve": [{"compute": c, "val_loss": l} for c, l in [(1e3, 6.0), (1e4, 4.0), (1e5, 2.0)]]}
    front = fit_mod.compute_frontier([small, large], points=5)
    assert [p["size"] for p in front] == ["s", "s", "s", "l", "l"]
    assert front[0]["val_loss"] == pytest.approx(5.0) and front[-1]["val_loss"] == pytest.approx(2.0)
    assert fit_mod.compute_frontier([small]) is None


def test_data_split_is_deterministic_and_cached(tmp_path):
    cfg = data_mod.DataConfig(corpus="stdlib", tokenizer="byte", max_bytes=60000, seed=3)
    a = data_mod.prepare(cfg, tmp_path / "a", log=lambda *_: None)
    b = data_mod.prepare(cfg, tmp_path / "b", log=lambda *_: None)  # rebuilt from scratch
    c = data_mod.prepare(cfg, tmp_path / "a", log=lambda *_: None)  # from the cache
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val) and torch.equal(a.train, c.train)
    assert a.vocab_size == 257 and int(a.train.max()) <= 256 and int(a.train.min()) >= 0
    assert a.meta["val_files"] and a.meta["files"]["train"] > 0
    # held out by whole files: the first held-out file's bytes open the held-out stream
    label, name = a.meta["val_files"][0].split("/", 1)
    assert label == "stdlib"
    first = (data_mod.stdlib_root() / name).read_bytes().decode("utf-8", errors="replace").encode("utf-8")
    assert bytes(a.val[: len(first)].tolist()) == first and int(a.val[len(first)]) == 256
    other = data_mod.prepare(data_mod.DataConfig(corpus="stdlib", tokenizer="byte", max_bytes=60000, seed=4),
                             tmp_path / "a",
                             log=lambda *_: None)
    assert other.meta["fingerprint"] != a.meta["fingerprint"] and other.meta["val_files"] != a.meta["val_files"]
    with pytest.raises(ValueError, match="heldout_frac"):
        data_mod.DataConfig(heldout_frac=1.5)
    with pytest.raises(ValueError, match="corpus"):
        data_mod.DataConfig(corpus="web")
    names = [name for name, _ in data_mod.list_files(data_mod.corpus_roots(data_mod.DataConfig()))]
    assert names == sorted(names) and any(n.startswith("torch/") for n in names)
    assert not any("site-packages" in n for n in names if n.startswith("stdlib/"))


@pytest.mark.skipif(not data_mod.bpe_available(), reason="tokenizers is not installed")
def test_bpe_tokenizer_round_trips():
    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20, "ünïcode = 'é'\n"]
    tok = data_mod.train_bpe(texts, 300)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(data_mod.EOT) is not None
    for t in texts:
        ids = tok.encode(t).ids
        assert tok.decode(ids) == t
    assert len(tok.encode(texts[0]).ids) < len(texts[0].encode()) / 2  # merges learned


def _run(capsys, out, *args):
    rc = main(["--out", str(out), *TINY, *args])
    return rc, capsys.readouterr().out


def test_pipeline_fit_resume_and_backends_match(tmp_path, capsys):
    """The whole sweep on tiny sizes (reference backend): losses fall, fit JSON + PNG written; a
    rerun trains nothing; the kernels backend on the smallest size gives the same held-out loss."""
    rc, out = _run(capsys, tmp_path, "--backend", "reference")
    assert rc == 0, out
    summary = json.loads((tmp_path / "reference" / "scaling.json").read_text())
    sizes = summary["sizes"]
    assert [s["name"] for s in sizes] == ["L1-W16-H2", "L1-W32-H2", "L2-W32-H2"]
    vocab = summary["data"]["vocab_size"]
    for s in sizes:
        assert s["train_loss"] < s["first_train_loss"] - 0.1, s["name"]
        assert s["val_loss"] < math.log(vocab) - 0.1, s["name"]
        assert s["steps"] >= 8 and len(s["curve"]) >= 2
    fit = summary["fit_loss_vs_params"]
    assert fit["ok"] and math.isfinite(fit["alpha"]) and math.isfinite(fit["r2"]) and fit["n_points"] == 3
    assert "alpha =" in out and "R^2 =" in out
    try:
        import matplotlib  # noqa: F401
        assert summary["png"] == "scaling.png" and (tmp_path / "reference" / "scaling.png").stat().st_size > 10000
    except ImportError:
        assert summary["png"] is None

    rc, out = _run(capsys, tmp_path, "--backend", "reference")
    assert rc == 0 and out.count("not retrained") == 3
    assert json.loads((tmp_path / "reference" / "scaling.json").read_text())["sizes"] == sizes

    rc, out = _run(capsys, tmp_path, "--backend", "kernels", "--limit", "1")
    assert rc == 0, out
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert [row["name"] for row in cmp["sizes"]] == ["L1-W16-H2"]
    if DEVICE == "cpu":  # float32 on CPU: the two backends compute the same function
        assert abs(cmp["sizes"][0]["val_loss_diff"]) < 1e-4


def test_training_resumes_from_checkpoint(tmp_path, monkeypatch):
    """An interrupted size resumes from its checkpoint and ends where an uninterrupted run ends."""
    corpus = data_mod.prepare(data_mod.DataConfig(tokenizer="byte", max_bytes=60000), tmp_path / "data",
                              log=lambda *_: None)
    m = ModelConfig(vocab_size=corpus.vocab_size, n_layers=1, width=16, n_heads=2, seq_len=32)
    t = TrainConfig(tokens=40 * 4 * 32, batch_size=4, lr=3e-3, log_every=5, eval_tokens=512, curve_points=2,
                    curve_eval_tokens=128)
    kw = dict(backend="reference", device=torch.device("cpu"), dtype=torch.float32, key={"k": 1}, progress=False,
              log=lambda *_: None)
    whole = train_size(m, t, corpus, **kw)

    real_lr = train_mod.lr_at

    def interrupt(step, total, cfg):
        if step == 23:
            raise KeyboardInterrupt
        return real_lr(step, total, cfg)
    ckpt = str(tmp_path / "size.pt")
    monkeypatch.setattr(train_mod, "lr_at", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train_size(m, t, corpus, ckpt_path=ckpt, ckpt_interval=0.0, **kw)
    monkeypatch.setattr(train_mod, "lr_at", real_lr)
    resumed = train_size(m, t, corpus, ckpt_path=ckpt, ckpt_interval=0.0, **kw)
    assert resumed["resumed_from_step"] == 20
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    assert [h[2] for h in resumed["history"]] == pytest.approx([h[2] for h in whole["history"]], abs=1e-6)


def test_cli_lists_the_default_plan(tmp_path, capsys):
    assert cli.main(["scaling", "--out", str(tmp_path), "--tokenizer", "byte", "--max-bytes", "30000", "--list"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("L")]
    params = [int(r[1].replace(",", "")) for r in rows]
    assert len(rows) >= 6 and params == sorted(params) and params[-1] >= 30 * params[0]


def test_torchrun_splits_sizes_across_ranks(tmp_path):
    """Two gloo processes on CPU train different sizes; rank 0 gathers them and fits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "llmkernels.scaling", "--out", str(tmp_path), "--backend", "reference", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 0] training" in proc.stdout and "[rank 1] training" in proc.stdout
    summary = json.loads((tmp_path / "reference" / "scaling.json").read_text())
    assert summary["world_size"] == 2 and len(summary["sizes"]) == 3 and summary["fit_loss_vs_params"]["ok"]
