"""The MoE GPU scripts run end to end on CPU at tiny size (``--tiny``, Triton's interpreter), so
that their first GPU call works: every provider that can run here checked against the float32
reference, the JSON and markdown written."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import llmkernels
from llmkernels.ops.moe.configs import INTERPRETER, GemmTiles
from tests.helpers import benchmark_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", "--out", out, *args],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.removesuffix(".py")
    assert os.path.getsize(os.path.join(out, f"{name}.md")) > 0
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_moe_bench_tiny(tmp_path):
    result = _run("moe_bench.py", str(tmp_path))
    for case in result["cases"].values():
        for provider in ("llmkernels", "hf_eager", "hf_grouped_mm", "torch_grouped_mm"):
            record = case["providers"][provider]
            assert record["status"] == "ok", record
            assert max(record["errors"].values()) < 3e-2  # bf16


def test_moe_bench_spent_budget_skips_whole_cases(tmp_path):
    """Past the budget a case costs nothing: no reference, no GEMM calibration, every provider skipped."""
    result = _run("moe_bench.py", str(tmp_path), "--budget", "0")
    assert result["cases"]
    for case in result["cases"].values():
        assert "gemm_ceiling_tflops" not in case
        assert {r["status"] for r in case["providers"].values()} == {"skipped: the run's time budget is spent"}


@pytest.mark.slow
def test_moe_lora_bench_tiny(tmp_path):
    result = _run("moe_lora_bench.py", str(tmp_path))
    ours = result["runs"]["llmkernels"]
    assert ours["status"] == "ok" and len(ours["losses"]) == result["meta"]["steps"]
    peft = result["runs"]["transformers+peft"]
    if peft["status"] == "ok":  # the same weights and adapters: the same losses, to bf16's tolerance
        assert max(abs(a - b) / b for a, b in zip(ours["losses"], peft["losses"])) < 2e-2


def test_moe_tiles_tiny(tmp_path):
    """One tiny case, two candidates: every row measured, each kernel of the default and of the
    candidates timed alone under its step's name (the weight gradients by torch's grouped GEMM
    too, marked), PyTorch's bare GEMMs beside them."""
    result = _run("moe_tiles.py", str(tmp_path), "--cases", "tiny-mixtral", "--candidates",
                  "gate_up-128x128x64-w8-s3,wgrad-grouped_mm")
    case = result["cases"]["tiny-mixtral"]
    rows = case["rows"]
    for name in ("default", "torch_grouped_mm", "gate_up-128x128x64-w8-s3"):
        assert rows[name]["status"] == "ok", rows[name]
    assert max(rows["gate_up-128x128x64-w8-s3"]["errors"].values()) <= 1e-2
    assert rows["gate_up-128x128x64-w8-s3"]["config"]["gate_up"]["block_n"] == 128
    assert rows["best-per-gemm"]["status"] == "ok" or rows["best-per-gemm"]["status"].startswith("skipped: the same")
    steps = {"fwd gate_up", "fwd down", "fwd combine", "bwd dh", "bwd d down_proj", "bwd dx", "bwd dx combine",
             "bwd d gate_up_proj"}
    assert set(rows["default"]["steps"]) == set(rows["gate_up-128x128x64-w8-s3"]["steps"]) == steps
    assert set(case["torch_steps"]["steps"]) == steps - {"fwd combine", "bwd dx combine"}
    by_torch = rows["wgrad-grouped_mm"]
    if by_torch["status"] == "ok":  # (this torch's grouped GEMM runs on CPU)
        assert by_torch["config"]["weight_grad_backend"] == "grouped_mm" and set(by_torch["steps"]) == steps
        assert {name for name, s in by_torch["steps"].items() if s.get("by_torch")} == {
            "bwd d down_proj", "bwd d gate_up_proj"}
        assert max(by_torch["errors"].values()) <= 1e-2
    else:
        assert "grouped" in by_torch["status"], by_torch["status"]


def _reads_a_scalar(x):
    return (x * 2).sum().item()


def test_wait_sources_name_the_python_line_that_waited():
    """The profile's third table groups a host wait by the Python frames that made it (here the
    CPU's scalar read, which on a GPU is a copy and a wait)."""
    from torch.profiler import ProfilerActivity, profile

    wait_sources = benchmark_script("profiling").wait_sources
    x = torch.randn(64)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            _reads_a_scalar(x)
        x.sum()
    rows = wait_sources(prof.events(), names=("aten::_local_scalar_dense",))
    assert len(rows) == 1, rows
    name, frames, calls, us = rows[0]
    assert name == "aten::_local_scalar_dense" and calls == 3 and us > 0
    assert "_reads_a_scalar" in frames[0], frames


def test_wait_sources_place_a_runtime_event_without_parent_by_its_time():
    """A CUDA runtime copy recorded without a parent op (on another thread id) is named by the
    traced Python calls whose time spans it, innermost first."""
    from types import SimpleNamespace

    profiling = benchmark_script("profiling")

    def event(name, start, end, parent=None, cpu_us=0.0):
        return SimpleNamespace(name=name, stack=[], cpu_parent=parent, self_cpu_time_total=cpu_us,
                               time_range=SimpleNamespace(start=start, end=end))

    outer = event("train.py(40): step", 0, 100)
    inner = event("moe.py(12): route", 10, 30, parent=outer)
    later = event("moe.py(50): combine", 40, 60, parent=outer)
    orphan = event("cudaMemcpyAsync", 20, 21, cpu_us=7.0)
    rows = profiling.wait_sources([outer, inner, later, orphan, event("cudaMemcpyAsync", 45, 46, cpu_us=2.0)])
    assert rows == [("cudaMemcpyAsync", ("moe.py(12): route", "train.py(40): step"), 1, 7.0),
                    ("cudaMemcpyAsync", ("moe.py(50): combine", "train.py(40): step"), 1, 2.0)], rows
    lost = event("cudaMemcpyAsync", 200, 201, cpu_us=1.0)
    assert profiling.wait_sources([outer, lost])[0][1] == ("(no Python frame)",)


def test_moe_tiles_records_mismatch_and_compile_error():
    """A candidate whose results differ from the default's is not timed; one that does not
    compile records its error; neither raises."""
    tiles = benchmark_script("moe_tiles")
    import moe_bench

    device = torch.device("cpu")
    shape = moe_bench.TINY["tiny-mixtral"]
    bench = tiles.Bench(shape, *moe_bench.case_inputs(shape, device), device, moe_bench.timer(device))
    out = llmkernels.moe_experts(**bench.inputs, config=INTERPRETER)
    grads = torch.autograd.grad(out, list(bench.leaves.values()), bench.d_out)
    expected = {"out": out.detach() * 1.02, **{f"d{k}": g for k, g in zip(bench.leaves, grads)}}
    record = tiles.run_config(INTERPRETER, bench, expected)
    assert record["status"].startswith("mismatch") and "fwd_ms" not in record
    assert 1e-2 < record["errors"]["out"] < 3e-2 and max(v for k, v in record["errors"].items() if k != "out") == 0
    broken = dataclasses.replace(INTERPRETER, down=GemmTiles(48, 64, 64, 4, 1))  # a row tile of 48: no power of 2
    record = tiles.run_config(broken, bench, expected)
    assert record["status"].startswith("error:") and "power of 2" in record["status"]


def test_moe_tiles_best_per_gemm_takes_each_gemms_fastest_tiles():
    tiles = benchmark_script("moe_tiles")
    cpu = torch.device("cpu")
    fast_gate_up = tiles.candidate_config(tiles.BY_NAME["gate_up-128x128x64-w8-s3"], INTERPRETER, cpu)
    fast_weight_grad = tiles.candidate_config(tiles.BY_NAME["weight_grad-128x128x64-w8-s3"], INTERPRETER, cpu)

    def record(**ms):  # every step 1 ms but those of the fields named
        return {"status": "ok", "steps": {s.name: {"ms": ms.get(s.field, 1.0), "field": s.field}
                                          for s in tiles.STEPS.values()}}
    measured = {"default": (INTERPRETER, record()), "a": (fast_gate_up, record(gate_up=0.5, weight_grad=2.0)),
                "b": (fast_weight_grad, record(weight_grad=0.5, down=3.0)),
                "failed": (INTERPRETER, {"status": "error: ..."})}
    best = tiles.best_per_gemm(measured, INTERPRETER)
    assert best.gate_up == fast_gate_up.gate_up == GemmTiles(128, 128, 64, 8, 3)
    assert best.weight_grad == fast_weight_grad.weight_grad == GemmTiles(128, 128, 64, 8, 3)
    assert (best.down, best.down_bwd, best.combine) == (INTERPRETER.down, INTERPRETER.down_bwd, INTERPRETER.combine)
    assert best.weight_grad_backend == "triton"
    by_torch = tiles.candidate_config(tiles.BY_NAME["wgrad-grouped_mm"], INTERPRETER, cpu)
    assert by_torch == dataclasses.replace(INTERPRETER, weight_grad_backend="grouped_mm")
    measured["c"] = (by_torch, record(weight_grad=0.25))
    best = tiles.best_per_gemm(measured, INTERPRETER)  # the weight gradients' backend comes with them
    assert best.weight_grad_backend == "grouped_mm" and best.weight_grad == INTERPRETER.weight_grad


def test_moe_train_tiny(tmp_path):
    """End to end, each provider in its own process: transformers' eager loop and llmkernels train
    the same tiny fp32 Qwen3-MoE from the same weights on the same batches, with the same losses;
    the JSON has every step's loss, the speed and the speedup over the peers that ran; ``--profile``
    writes each provider's profile of the steps after them."""
    result = _run("moe_train.py", str(tmp_path), "--providers", "hf_eager,llmkernels,liger", "--profile")
    shape, providers, summary = result["shape"], result["providers"], result["summary"]
    assert list(providers) == ["hf_eager", "llmkernels", "liger"]
    for name in ("hf_eager", "llmkernels"):
        record = providers[name]
        assert record["status"] == "ok", record
        assert len(record["losses"]) == shape["warmup"] + shape["steps"]
        assert record["tokens_per_s"] > 0 and record["step_ms"] > 0 and record["params"] > record["active_params"]
    assert providers["hf_eager"]["experts_implementation"] == "eager"
    for name in ("hf_eager", "llmkernels"):  # the host-time table (a CPU run has no device table)
        with open(tmp_path / f"moe_train_profile_{name}.txt") as f:
            text = f.read()
            assert "Self CPU" in text and "Host copies and waits" in text
    assert any(p.startswith("Qwen3MoeExperts.forward -> llmkernels.moe_experts") for p in
               providers["llmkernels"]["patched"]), providers["llmkernels"]["patched"]
    liger = providers["liger"]
    assert liger["status"] == "ok" or liger["status"] == "skipped: liger_kernel is not importable here", liger
    losses = providers["hf_eager"]["losses"]
    assert len(set(losses)) == len(losses)  # a new batch and new weights each step
    check = summary["loss_checks"]["llmkernels"]
    assert summary["loss_reference"] == "hf_eager" and check["steps"] == len(losses)
    assert check["max_rel_dloss"] < 1e-4 and check["agree"] and summary["losses_agree"]
    assert summary["best_peer"] in ("hf_eager", "liger") and summary["speedup_vs_best_peer"] > 0
    assert summary["speedup_vs"]["hf_eager"] == pytest.approx(
        providers["llmkernels"]["tokens_per_s"] / providers["hf_eager"]["tokens_per_s"])


def test_moe_train_spent_budget_skips_every_provider(tmp_path):
    result = _run("moe_train.py", str(tmp_path), "--budget", "0", "--providers", "hf_eager,llmkernels")
    assert {name: r["status"] for name, r in result["providers"].items()} == {
        "hf_eager": "skipped: the run's time budget is spent", "llmkernels": "skipped: the run's time budget is spent"}
    assert result["summary"]["loss_reference"] is None and "speedup_vs_best_peer" not in result["summary"]
