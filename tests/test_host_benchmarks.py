"""The host-cost benchmarks run end to end at tiny sizes on CPU, through Triton's interpreter
(``--tiny``): benchmarks/profile_overhead.py (µs per call of every op beside torch's) and
benchmarks/generate_bench.py (generate() of a patched Llama against the unpatched one). Their
figures mean nothing here; what is checked is that every cell runs and the JSON says so."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("rms_norm", "layer_norm", "add_rms_norm", "rope", "glu", "cross_entropy", "linear_cross_entropy",
       "moe_experts_lora")


def _run(script: str, *args):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}  # this checkout's llmkernels
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_profile_overhead_times_every_op_and_mode(tmp_path):
    out = tmp_path / "host.json"
    printed = _run("profile_overhead.py", "--rows", "2", "--loops", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["complete"] and data["meta"]["device"] == "cpu, Triton interpreter"
    cells = {(r["op"], r["mode"], r["provider"]) for r in data["records"]}
    assert cells >= {(op, mode, p) for op in OPS for mode in ("fwd", "fwd+bwd") for p in ("llmkernels", "torch")}
    assert all(r["us"] > 0 and r["host_us"] > 0 and r["M"] == 2 for r in data["records"])
    ours = [r for r in data["records"] if r["provider"] == "llmkernels"]
    assert all(r["host_vs_torch"] > 0 for r in ours)
    assert "llmkernels above torch's host time in" in printed


def test_generate_bench_compares_patched_and_unpatched(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "generate.json"
    _run("generate_bench.py", "--out", str(out))
    data = json.loads(out.read_text())
    assert set(data["tokens_per_s"]) == {"unpatched", "patched"} and min(data["tokens_per_s"].values()) > 0
    assert data["new_tokens"] == 4 and len(data["seconds"]["patched"]) == data["rounds"] == 1
    assert any("apply_rope" in p for p in data["patched"]) and any("rms_norm" in p for p in data["patched"])
    assert isinstance(data["tokens_identical"], bool)
