"""The benchmark CLI (llmkernels.bench): op registry, byte counts, the float64 check of every
provider, the CLI end to end, and its no-GPU path. Small sizes: CPU + Triton's interpreter."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from llmkernels.bench import main, ops
from llmkernels.bench import registry, report
from llmkernels.bench.registry import MODES, Provider, Unavailable
from llmkernels.bench.runner import TOL, Case, Runner, Settings

NORM_OPS = ("rmsnorm", "layernorm", "add_rmsnorm")
GLU_OPS = ("swiglu", "geglu")
LINEAR_LOSS_OPS = ("linear_cross_entropy", "linear_log_probs", "linear_distill")
PEERS = ("llmkernels", "torch", "torch_fused", "hf_eager", "torch_compile", "liger", "quack")


def test_registry_declares_the_norm_ops():
    registered = ops()
    assert set(NORM_OPS) <= set(registered)
    for name in NORM_OPS:
        op = registered[name]
        assert list(op.providers)[0] == "llmkernels"
        assert set(op.providers) <= set(PEERS)
        assert op.shape(1024, None) == {"M": 131072, "N": 1024}  # 256 MiB per bf16 tensor
        assert op.shape(4096, 8) == {"M": 8, "N": 4096}
        assert [s["M"] for s in op.decode_shapes] == [1, 8, 32, 128, 256]
        assert all(s["N"] == 4096 for s in op.decode_shapes)
    assert set(registered["add_rmsnorm"].grad_inputs) == {"x", "residual", "weight"}
    assert set(registered["layernorm"].grad_inputs) == {"x", "weight", "bias"}


def test_add_rmsnorm_inputs_come_out_of_a_graph(device):
    """add_rmsnorm's inputs reach providers as non-leaf views (as from earlier layers), so
    llmkernels writes one gradient for x and residual; both still reach the leaves, correct."""
    op = ops()["add_rmsnorm"]
    assert op.inputs_from_graph and not ops()["rmsnorm"].inputs_from_graph
    case = Case(op, {"M": 6, "N": 64}, torch.bfloat16, torch.device(device), grads=True)
    fn = op.providers["llmkernels"].factory()
    leaves = case.leaves(True)
    inputs = case.call_inputs(leaves)
    assert not any(inputs[k].is_leaf for k in op.grad_inputs) and inputs["x"].data_ptr() == leaves["x"].data_ptr()
    dx, dres, _ = torch.autograd.grad(*case.backward_args(case.forward(fn, leaves), leaves, False))
    assert dx.data_ptr() == dres.data_ptr()
    errors = case.check(fn, grads=True)
    assert set(errors) == {"y", "h", "dx", "dresidual", "dweight"}
    assert max(errors.values()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("name,mode,tensors,vectors", [
    ("rmsnorm", "fwd", 2, 1), ("rmsnorm", "bwd", 3, 2),          # x->y | x,dy->dx; w | w->dw
    ("layernorm", "fwd", 2, 2), ("layernorm", "bwd", 3, 3),      # + bias | + db
    ("add_rmsnorm", "fwd", 4, 1), ("add_rmsnorm", "bwd", 4, 2),  # x,res->y,h | h,dy,dh->dx
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_min_bytes(name, mode, tensors, vectors, dtype):
    op = ops()[name]
    m, n, e = 96, 1000, dtype.itemsize
    assert op.min_bytes({"M": m, "N": n}, dtype, mode) == (tensors * m * n + vectors * n) * e
    both = op.min_bytes({"M": m, "N": n}, dtype, "fwd") + op.min_bytes({"M": m, "N": n}, dtype, "bwd")
    assert op.min_bytes({"M": m, "N": n}, dtype, "fwd+bwd") == both


@pytest.mark.parametrize("name", GLU_OPS)
def test_glu_ops(name):
    """gate, up [M, I]: fwd reads 2 and writes 1, bwd reads 3 (gate, up, dy) and writes 2."""
    op = ops()[name]
    assert list(op.providers)[0] == "llmkernels" and set(op.providers) <= set(PEERS)
    assert op.shape(14336, None) == {"M": 9362, "I": 14336}  # 256 MiB per bf16 tensor
    assert set(op.grad_inputs) == {"gate", "up"}
    shape, e = {"M": 96, "I": 1000}, torch.bfloat16.itemsize
    assert [op.min_bytes(shape, torch.bfloat16, m) for m in MODES] == [k * 96 * 1000 * e for k in (3, 5, 8)]


def test_every_op_family_is_registered():
    """One bench module per family of llmkernels' public ops, each op checked on CPU too."""
    assert set(ops()) == {*NORM_OPS, *GLU_OPS, "rope", "rope_bshd", "qk_norm_rope", "cross_entropy", *LINEAR_LOSS_OPS,
                          "moe_experts"}
    assert all(op.small_shapes and list(op.providers)[0] == "llmkernels" for op in ops().values())


def test_qk_norm_rope_op():
    """q [B, S, 32, 128] and k [B, S, 8, 128] (256 MiB of q in bf16): fwd reads both and writes both,
    bwd reads the outputs' gradients and the inputs and writes the inputs' gradients."""
    op = ops()["qk_norm_rope"]
    assert op.shape(4096, None) == {"B": 8, "Hq": 32, "Hk": 8, "S": 4096, "D": 128}
    shape, e = {"B": 3, "Hq": 4, "Hk": 2, "S": 10, "D": 64}, torch.bfloat16.itemsize
    one = 3 * 10 * 6 * 64 * e
    assert [op.min_bytes(shape, torch.bfloat16, m) for m in MODES] == [2 * one, 3 * one, 5 * one]
    assert set(op.grad_inputs) == {"q", "k", "q_weight", "k_weight"}


@pytest.mark.parametrize("name,heads", [("linear_cross_entropy", 1), ("linear_log_probs", 1), ("linear_distill", 2)])
def test_linear_loss_ops(name, heads):
    """hidden [M, H], weight [V, H] (distillation: the teacher's too) read once; the backward also
    writes the student's two gradients; the [M, V] logits are never counted."""
    op = ops()[name]
    assert op.shape(128256, None) == {"M": 16384, "H": 4096, "V": 128256} and op.shape(32000, 8)["M"] == 8
    shape, e = {"M": 96, "H": 64, "V": 1000}, torch.bfloat16.itemsize
    pair = (96 + 1000) * 64 * e
    assert [op.min_bytes(shape, torch.bfloat16, m) for m in MODES] == [heads * pair] + [(heads + 1) * pair] * 2
    assert op.grad_inputs[-1].endswith("weight") and op.is_loss == (name != "linear_log_probs")


# Every provider of every op; torch.compile (inductor builds C++ on CPU: seconds a graph) in the slow run.
PAIRS = [pytest.param(op, p, id=f"{op}-{p}", marks=[pytest.mark.slow] if p == "torch_compile" else [])
         for op in ops() for p in ops()[op].providers]


@pytest.mark.parametrize("op_name,provider", PAIRS)
def test_every_importable_provider_passes_the_check(op_name, provider, device):
    op = ops()[op_name]
    spec = op.providers[provider]
    try:
        fn = spec.factory()
    except Unavailable as exc:
        pytest.skip(str(exc))
    if spec.gpu_only and device == "cpu":
        pytest.skip("needs a GPU")
    if provider == "torch_compile" and device == "cpu" and op_name != "rmsnorm":
        pytest.skip("inductor's CPU compile takes seconds per graph; rmsnorm covers the provider")
    dtypes = [torch.bfloat16] if provider == "torch_compile" else [torch.bfloat16, torch.float32]
    for dtype in dtypes:
        for shape in op.small_shapes:
            case = Case(op, shape, dtype, torch.device(device), grads=True)
            for grads in (False, True):
                errors = case.check(fn, grads, spec.mutates)
                expected = set(op.outputs) | ({f"d{k}" for k in op.grad_inputs} if grads else set())
                assert set(errors) == expected
                bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
                assert not bad, f"{provider} {dtype} {shape} grads={grads}: {bad}"
            for mode in MODES if spec.repeats_backward else ("fwd", "fwd+bwd"):  # what gets timed runs
                timed = case.timed(fn, mode, spec.mutates)                      # repeatedly (bwd: one graph)
                timed()
                timed()


def test_a_wrong_or_unwritten_output_fails_and_is_not_timed(monkeypatch, device):
    op = ops()["rmsnorm"]
    exact = op.providers["hf_eager"].factory()
    bad = dataclasses.replace(op, providers={
        "hf_eager": op.providers["hf_eager"],
        "scaled": Provider(lambda: lambda x, weight: exact(x, weight) * 1.1),
        "unwritten": Provider(lambda: lambda x, weight: torch.empty_like(x), backward=False),
        "missing": Provider(lambda: (_ for _ in ()).throw(Unavailable("demo is not installed"))),
    })
    monkeypatch.setitem(registry._OPS, "rmsnorm", bad)
    lines = []
    runner = Runner(Settings(ops=["rmsnorm"], dtypes=["bf16"], sizes=[512], rows=16, modes=("fwd", "bwd"),
                             decode=False), torch.device(device), log=lines.append)
    records = runner.run()
    status = {(r["provider"], r["mode"], r["N"]): r["status"] for r in records}
    assert {s for (p, _, _), s in status.items() if p == "hf_eager"} == {"ok"}
    assert {s for (p, _, _), s in status.items() if p != "hf_eager"} == {"failed"}
    assert {(p, m) for (p, m, _) in status if p == "unwritten"} == {("unwritten", "fwd")}  # fwd-only
    assert all(r["ms"] is None for r in records if r["status"] == "failed")
    assert runner.skipped == {("rmsnorm", "missing"): "demo is not installed"}
    assert any("FAILED" in line and "unwritten" in line for line in lines)


def _cli_flags(device):
    # On a GPU the CLI times; keep it tiny there too. Without one it uses each op's small shapes.
    return ["--n", "512", "--m", "64", "--no-decode", "--no-eager"] if device == "cuda" else []


def test_cli_end_to_end(tmp_path, capsys, device):
    out = str(tmp_path / "run")
    rc = main(["--op", "rmsnorm", "add_rmsnorm", "--providers", "llmkernels", "torch", "hf_eager",
               "--out", out, *_cli_flags(device)])
    assert rc == 0
    printed = capsys.readouterr().out
    if device == "cpu":
        assert "No CUDA GPU found" in printed
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    records = data["records"]
    assert {(r["op"], r["provider"]) for r in records} == {
        (o, p) for o in ("rmsnorm", "add_rmsnorm") for p in ("llmkernels", "torch", "hf_eager")}
    assert {r["status"] for r in records} == {"ok"}
    required = {"op", "mode", "provider", "dtype", "M", "N", "ms", "gbps", "pct_copy", "copy_gbps", "rel_err",
                "device", "date", "torch", "triton"}
    assert all(required <= set(r) for r in records)
    assert all(0 <= r["rel_err"] <= TOL[torch.bfloat16] for r in records)
    if device == "cuda":
        assert all(r["gbps"] > 0 and r["copy_gbps"] > 0 for r in records)
    md = open(os.path.join(out, "results.md")).read()
    assert "## rmsnorm fwd bf16" in md and "## add_rmsnorm bwd bf16" in md

    assert printed.rstrip().splitlines()[-1].startswith("summary: llmkernels passed ")

    # Runs never merge: a folder that holds a run is refused before anything runs.
    with pytest.raises(SystemExit) as exc:
        main(["--op", "layernorm", "--providers", "llmkernels", "--mode", "fwd", "--out", out, *_cli_flags(device)])
    assert exc.value.code == 2 and "already holds a run" in capsys.readouterr().err
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["records"] == records


def test_without_gpu_it_says_so_and_checks_through_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a GPU machine
    out = str(tmp_path / "nogpu")
    proc = subprocess.run([sys.executable, "-m", "llmkernels.bench", "--op", "rmsnorm", "--providers",
                           "llmkernels", "--mode", "fwd", "--out", out],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No CUDA GPU found" in proc.stdout
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    assert data["meta"]["device"].startswith("cpu")
    assert [(r["kind"], r["status"]) for r in data["records"]] == [("check", "ok")] * len(
        ops()["rmsnorm"].small_shapes)
    assert os.path.getsize(os.path.join(out, "check-bf16.png")) > 0  # the errors beside the tolerance


def test_a_loss_is_differentiated_from_an_upstream_gradient_of_one():
    """cross_entropy's backward starts from 1, as ``loss.backward()`` does; other ops from random
    upstream gradients."""
    ce, norm = ops()["cross_entropy"], ops()["rmsnorm"]
    assert ce.is_loss and not norm.is_loss
    case = Case(ce, {"M": 3, "V": 100}, torch.float32, torch.device("cpu"), grads=True)
    assert all(torch.equal(g, torch.ones_like(g)) for g in case.grad_outputs)
    case = Case(norm, {"M": 3, "N": 64}, torch.float32, torch.device("cpu"), grads=True)
    assert not any(torch.equal(g, torch.ones_like(g)) for g in case.grad_outputs)


def test_a_provider_that_breaks_capture_is_reported_and_the_run_goes_on(device):
    """A provider that syncs with the host cannot be captured: its decode CUDA-graph records are
    errors, its bandwidth case is timed as plain calls (noted), and the next case still makes its
    random inputs on the GPU (a broken capture must not leave the generator unusable)."""
    if device == "cpu":
        pytest.skip("CUDA graphs need a GPU")
    base = ops()["rmsnorm"]
    plain = base.providers["torch"].factory()

    def syncing(**inputs):
        inputs["x"].sum().item()
        return plain(**inputs)

    op = dataclasses.replace(base, decode_shapes=({"M": 8, "N": 4096}, {"M": 16, "N": 4096}),
                             providers={"torch": base.providers["torch"], "syncs": Provider(lambda: syncing)})
    runner = Runner(Settings(ops=["rmsnorm"], dtypes=["bf16"], sizes=[512], rows=16, modes=["fwd"],
                             providers=["torch", "syncs"], eager=False), torch.device(device), log=print)
    runner.selected_ops = lambda: [op]
    records = runner.run()
    bandwidth = {r["provider"]: r for r in records if r["kind"] == "bandwidth"}
    assert bandwidth["torch"]["status"] == "ok" and bandwidth["torch"]["timing"] == "cuda_graph"
    assert bandwidth["syncs"]["status"] == "ok" and bandwidth["syncs"]["timing"] == "plain_calls"
    assert "CUDA graph capture" in bandwidth["syncs"]["note"]
    graph = {(r["provider"], r["shape"]["M"]): r for r in records if r["kind"] == "decode_graph"}
    assert set(graph) == {(p, m) for p in ("torch", "syncs") for m in (8, 16)}
    for m in (8, 16):
        assert graph[("torch", m)]["status"] == "ok"
        assert graph[("syncs", m)]["status"] == "error" and "CUDA graph capture" in graph[("syncs", m)]["note"]


def test_a_failed_capture_gives_its_memory_back(device):
    """A capture broken by a host sync must not keep its pool: the memory reserved after each
    failed capture stays where it was after the first."""
    if device == "cpu":
        pytest.skip("CUDA graphs need a GPU")
    from llmkernels.bench import runner as runner_mod
    x = torch.randn(2**25, device=device)  # 128 MiB

    def make():
        def fn():
            y = x * 2
            y.sum().item()
            return y
        return fn
    reserved = []
    for _ in range(3):
        with pytest.raises(Exception):
            runner_mod.graph_bench_ms(make)
        runner_mod.free_memory()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[2] <= reserved[0], reserved


def test_decode_is_timed_plain_and_in_a_cuda_graph(device):
    """Decode sizes give two records per provider and mode: plain calls and a CUDA graph (every
    mode captures, the bwd one with its forward on the capturing stream)."""
    if device == "cpu":
        pytest.skip("timing needs a GPU")
    op = dataclasses.replace(ops()["rmsnorm"], decode_shapes=({"M": 8, "N": 4096},))
    runner = Runner(Settings(ops=["rmsnorm"], dtypes=["bf16"], sizes=[512], rows=16,
                             providers=["llmkernels", "torch"], eager=False), torch.device(device), log=print)
    runner.selected_ops = lambda: [op]
    records = [r for r in runner.run() if r["kind"] != "bandwidth"]
    kinds = {(r["kind"], r["provider"], r["mode"]): r for r in records}
    assert set(kinds) == {(k, p, m) for k in ("decode", "decode_graph") for p in ("llmkernels", "torch")
                          for m in MODES}
    assert all(r["status"] == "ok" and r["us"] > 0 for r in records), [(r["kind"], r["note"]) for r in records]
    assert any(title.startswith("rmsnorm fwd bf16 decode — µs per call replayed from a CUDA graph")
               for title, *_ in report.tables(records))


def test_a_training_micro_batch_is_timed_as_plain_calls(monkeypatch, device):
    """Every op declares a training micro-batch (M = 4096) that a timing run times as µs per plain
    call, fwd and fwd+bwd, beside its other cases; its records get speedups and a table of their
    own. (On CPU the timer is the host clock and the shape tiny: the path, not the figures.)"""
    from llmkernels.bench import runner as runner_mod
    registered = ops()
    for op in registered.values():
        assert [shape.get("M") for shape in op.eager_shapes] == [4096], op.name
    op = dataclasses.replace(registered["rmsnorm"], eager_shapes=({"M": 8, "N": 64},))
    runner = Runner(Settings(ops=["rmsnorm"], dtypes=["bf16"], sizes=[64], rows=8, providers=["llmkernels", "torch"],
                             decode=False), torch.device(device), log=print)
    runner.selected_ops = lambda: [op]
    runner.timing, runner.copy_gbps = True, 1000.0
    assert runner.cases(op)[-1] == ("eager", {"M": 8, "N": 64})
    timed = []

    def host_clock(fn, calls=runner_mod.DECODE_CALLS, repeats=runner_mod.DECODE_REPEATS):
        timed.append((calls, repeats))
        fn()
        return 0.05
    monkeypatch.setattr(runner_mod, "_latency_ms", host_clock)
    for provider in ("llmkernels", "torch"):
        runner._run_provider(runner_mod.Case(op, {"M": 8, "N": 64}, torch.bfloat16, torch.device(device), grads=True),
                             "eager", provider, "rmsnorm eager")
    records = runner.records
    assert [(r["kind"], r["provider"], r["mode"], r["status"]) for r in records] == [
        ("eager", p, m, "ok") for p in ("llmkernels", "torch") for m in ("fwd", "fwd+bwd")]
    assert all(r["us"] == 50.0 for r in records)
    assert timed == [(runner_mod.EAGER_CALLS, runner_mod.EAGER_REPEATS)] * 4
    report.add_speedups(records)
    assert records[0]["speedup_vs_best_peer"] == 1.0 and records[0]["best_peer"] == "torch"
    titles = [title for title, *_ in report.tables(records)]
    assert titles == [f"rmsnorm {m} bf16 eager — µs per plain call at a training micro-batch (rel err); copy 1000 GB/s"
                      for m in ("fwd", "fwd+bwd")]
