"""DDP and FSDP2 training of a patched model (the FSDP2 head a group of its own, whose sharded
weight the fused loss gathers; activation checkpointing), the FSDP2 path of the end-to-end
benchmark, and a sequence-parallel DTensor RMSNorm, on 2 CPU processes with gloo
(benchmarks/distributed_train.py --check): same losses, parameters and gradients as one process.
The benchmark's --compare (scaling efficiency, loss agreement) on made-up results; the
vocabulary-parallel and FSDP2-scaling benchmarks on CPU (slow)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import benchmark_script

pytest.importorskip("transformers")
ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "distributed_train.py")


def _script_env():
    """The benchmark scripts' environment: the interpreter, one thread a process, this checkout first."""
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs use torchrun on the multi-GPU machine")
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("trained", [
    ("ddp", "fsdp2", "fsdp2_ckpt"),  # fsdp2_ckpt: the head its own FSDP2 group and checkpointed layers
    pytest.param(("fsdp2_head", "ddp_ckpt"), marks=pytest.mark.slow)], ids=["default", "more"])
def test_ddp_fsdp2_e2e_and_sequence_parallel_norm_match_one_process(trained):
    # PYTHONPATH: the scripts import this checkout's llmkernels, whichever one is installed
    proc = subprocess.run([sys.executable, SCRIPT, "--check", "--steps", "3", "--seq", "16",
                           f"--trained={','.join(trained)}"], env=_script_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for check in (*(f"{mode} {kind}" for mode in trained for kind in ("losses", "params", "grads")),
                  "e2e fsdp2 losses", "sp_norm"):
        assert re.search(rf"^ *{check}: max rel diff .* ok$", proc.stdout, re.M), proc.stdout


def _run(world, batch, tokens_per_s, losses, device="GPU X"):
    shape = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512, "seq": 16,
             "batch": batch, "warmup": 1, "steps": 2, "dtype": "bf16"}
    entry = {"provider": "hf", "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world,
             "rows_per_gpu": batch // world, "peak_mem_gib": 8.0 / world, "losses": losses}
    return {"shape": shape, "environment": {"device": device, "world_size": world}, "providers": [entry]}


def test_e2e_compare_scaling_efficiency_and_loss_agreement():
    compare = benchmark_script("e2e_train").compare
    one = _run(1, 8, 1000.0, [5.0, 4.9, 4.8])
    rows = {(r["world_size"], r["batch"], r["device"]): r for r in compare([
        _run(1, 8, 3000.0, [5.0, 4.8, 4.7], device="GPU Y"),   # another device: never the baseline of X
        one,
        _run(2, 8, 1800.0, [5.0, 4.901, 4.799]),   # same global batch: strong scaling, losses compared
        _run(2, 16, 1900.0, [5.1, 5.0, 4.9]),      # 8 rows per GPU as at K = 1: weak scaling, speed only
    ], loss_tol=5e-3)["rows"]}
    rows = {key[:2]: r for key, r in rows.items() if key[2] == "GPU X"}
    assert rows[2, 8]["scaling"] == "strong" and rows[2, 8]["efficiency"] == pytest.approx(0.9)
    assert rows[2, 8]["max_abs_dloss_vs_1"] == pytest.approx(1e-3) and rows[2, 8]["losses_agree"]
    assert rows[2, 16]["scaling"] == "weak" and rows[2, 16]["efficiency"] == pytest.approx(0.95)
    assert "losses_agree" not in rows[2, 16]
    bad = compare([one, _run(4, 8, 3600.0, [5.0, 4.91, 4.8])], loss_tol=5e-3)
    assert not bad["passed"] and bad["rows"][1]["max_abs_dloss_vs_1"] == pytest.approx(0.01)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the benchmark itself")
def test_vocab_parallel_benchmark_runs_every_provider_on_two_cpu_ranks(tmp_path):
    import json
    out = tmp_path / "vp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           os.path.join(ROOT, "benchmarks", "vocab_parallel.py"), "--tokens=32", "--vocab=301",
                           "--hidden=16", "--iters=1", "--warmup=0", f"--out={out}"],
                          env=_script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["device"] == "cpu"
    for entry in result["providers"]:
        assert "error" not in entry, entry
        assert entry["loss_rel_err"] < 1e-2 and entry["grad_rel_err"] < 2e-2, entry  # bf16 logits


def test_fsdp2_scaling_plan_runs_one_gpu_first_then_the_largest_k():
    module = benchmark_script("fsdp2_scaling")
    assert module.plan([1, 2, 4], 4, 4) == [(1, [("one", 4)]), (4, [("weak", 16), ("strong", 4)]),
                                            (2, [("weak", 8), ("strong", 4)])]
    assert module.plan([1, 2], 2, 4)[0] == (1, [("one", 2), ("one-strong", 4)])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the benchmark itself")
def test_fsdp2_scaling_runs_weak_and_strong_and_resumes(tmp_path):
    import json
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fsdp2_scaling.py"), "--tiny", "--gpus=1,2",
           "--providers=hf,llmkernels", "--prefetch=1", f"--out-dir={tmp_path}"]
    proc = subprocess.run(cmd, env=_script_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(next(tmp_path.glob("fsdp2-scaling-*.json")).read_text())
    assert summary["world_size"] == 2 and summary["fsdp2"]["prefetch"] == 1
    assert sorted((r["world_size"], r["mode"]) for r in summary["runs"]) == [(1, "one"), (2, "strong"), (2, "weak")]
    scaling = {(r["provider"], r["world_size"], r.get("scaling")) for r in summary["scaling"]["rows"]}
    assert {("llmkernels", 2, "weak"), ("llmkernels", 2, "strong")} <= scaling and summary["scaling"]["passed"]
    again = subprocess.run(cmd, env=_script_env(), capture_output=True, text=True, timeout=120)  # nothing left
    assert again.returncode == 0 and "K=" not in again.stdout, again.stdout[-2000:]
