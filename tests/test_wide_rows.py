"""benchmarks/wide_rows.py --tiny on CPU: every wide-row strategy passes the bench's float64 check,
and the JSON and markdown it writes name them; --skip / --only choose strategies by words of their
names; a spent time budget starts no width. The cluster candidates of the norms' backward and of
cross-entropy against float64 references."""
import functools
import json
import sys

import pytest
import torch
import torch.nn.functional as F

import llmkernels.reference
from llmkernels.tune.spaces import wide_row_candidates
from tests.conftest import INTERPRETED
from tests.helpers import benchmark_script

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--tiny is the CPU check")


def test_every_strategy_is_checked_and_written(tmp_path):
    wide_rows = benchmark_script("wide_rows")
    assert wide_rows.main(["--tiny", "--parts", "rmsnorm-fwd,layernorm-fwd,layernorm-bwd", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "wide_rows.json").read_text())
    n = wide_rows.TINY_SHAPES[0]["N"]
    found = {}
    for part, backward in (("rmsnorm-fwd", False), ("layernorm-fwd", False), ("layernorm-bwd", True)):
        found[part] = records = {r["provider"]: r for r in summary["records"] if r["part"] == part}
        assert set(records) == set(wide_row_candidates(n, backward)) | set(wide_rows.experiments(part))
        assert all(r["status"] == "ok" and r["n"] == n for r in records.values()), records
    assert found["layernorm-bwd"]["split 8192x8 s3"]["config"].startswith("SplitBwdConfig(")
    assert found["layernorm-fwd"]["cluster 8192"]["config"] == "ClusterRows(cols_per_cta=8192, num_warps=8, per_sm=1, prefetch=False)"
    table = (tmp_path / "wide_rows.md").read_text()
    assert "## layernorm-fwd" in table and "| split 4096x4 s3 tma lag2 | ok |" in table and "| cluster 16384 | ok |" in table


def test_a_spent_budget_starts_no_width(tmp_path):
    assert benchmark_script("wide_rows").main(["--tiny", "--parts", "rmsnorm-bwd", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "wide_rows.json").read_text())
    assert summary["records"] == [] and summary["header"]["cut_by_budget"] == {"rmsnorm-bwd": [1000]}


@pytest.mark.parametrize("flags,kept", [
    (["--skip", "tma"], lambda name: "tma" not in name),
    (["--only", "tma,table"], lambda name: "tma" in name or name == "table"),
    (["--only", "split", "--skip", "tma,lag"], lambda name: name in ("split 8192x8", "split 4096x4 s3")),
    (["--only", "cluster"], lambda name: name.startswith("cluster")),
])
def test_strategies_chosen_by_words_of_their_names(tmp_path, flags, kept):
    wide_rows = benchmark_script("wide_rows")
    assert wide_rows.main(["--tiny", "--parts", "rmsnorm-fwd", *flags, "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "wide_rows.json").read_text())["records"]
    names = wide_rows.strategies("rmsnorm-fwd", wide_rows.TINY_SHAPES[0]["N"])
    assert "cluster 8192" in names and sorted(r["provider"] for r in records) == sorted(filter(kept, names))
    assert all(r["status"] == "ok" for r in records), records


def test_each_width_is_written_as_it_ends(tmp_path, monkeypatch):
    """A strategy that ends the process (as one that kills the CUDA context does) leaves the
    widths measured before it written."""
    wide_rows = benchmark_script("wide_rows")
    monkeypatch.setitem(wide_rows.PARTS, "rmsnorm-fwd",
                        wide_rows.PARTS["rmsnorm-fwd"]._replace(tiny=({"M": 3, "N": 1000}, {"M": 3, "N": 2000})))
    run_case = wide_rows.BudgetRunner._run_case

    def ends_at_the_second_width(self, op, dtype, kind, shape):
        if shape["N"] == 2000:
            raise SystemExit("the CUDA context is lost")
        run_case(self, op, dtype, kind, shape)
    monkeypatch.setattr(wide_rows.BudgetRunner, "_run_case", ends_at_the_second_width)
    with pytest.raises(SystemExit):
        wide_rows.main(["--tiny", "--parts", "rmsnorm-fwd", "--only", "table", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "wide_rows.json").read_text())["records"]
    assert [(r["n"], r["provider"], r["status"]) for r in records] == [(1000, "table", "ok")]


def test_the_cluster_candidate_is_skipped_where_triton_cannot_build_it(tmp_path, monkeypatch):
    """Triton 3.6 refuses a reduction across a cluster's CTAs at compile time: the candidate is
    recorded as skipped, with the reason, and the rest of the run goes on."""
    wide_rows = benchmark_script("wide_rows")
    cluster_rows = sys.modules["cluster_rows"]
    monkeypatch.setattr(cluster_rows, "INTERPRET", False)
    monkeypatch.setattr(cluster_rows.triton, "__version__", "3.6.0")
    assert wide_rows.main(["--tiny", "--parts", "rmsnorm-fwd", "--only", "cluster,table", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "wide_rows.json").read_text())
    assert [(r["provider"], r["status"]) for r in summary["records"]] == [("table", "ok")], summary["records"]
    for name in ("cluster 16384", "cluster 8192"):
        assert any(line.startswith(f"skipped {name} ") and "Triton 3.6.0 cannot build" in line
                   for line in summary["header"]["skipped"]), summary["header"]["skipped"]


def test_cross_entropy_part_measures_its_candidates_beside_the_library(tmp_path):
    wide_rows = benchmark_script("wide_rows")
    assert wide_rows.main(["--tiny", "--parts", "cross-entropy-inplace", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "wide_rows.json").read_text())["records"]
    assert {r["provider"]: (r["n"], r["status"]) for r in records} == {
        "cluster 16384": (1000, "ok"), "cluster 32768": (1000, "ok"), "llmkernels_inplace_unchecked": (1000, "ok")}
    assert "| cluster 32768 | ok |" in (tmp_path / "wide_rows.md").read_text()


@pytest.mark.parametrize("m,v,cols_per_cta", [(5, 1000, 512), (4, 3001, 1024)])
def test_cluster_cross_entropy_matches_float64(m, v, cols_per_cta):
    """Loss and gradient (written over the logits, scaled by an upstream gradient that is not 1),
    ignored rows included, against float64 ``F.cross_entropy``; the interpreter runs the kernel's
    arithmetic (one program a row: it ignores ``num_ctas``)."""
    benchmark_script("wide_rows")
    cluster_rows = sys.modules["cluster_rows"]
    torch.manual_seed(m * v)
    logits = torch.randn(m, v, dtype=torch.float64) * 3
    target = torch.randint(0, v, (m,))
    target[1] = -100
    ref = logits.clone().requires_grad_()
    (F.cross_entropy(ref, target) * 0.7).backward()
    buffer = logits.float().requires_grad_()
    loss = cluster_rows.cross_entropy_inplace_cluster(buffer, target, cluster_rows.ClusterRows(cols_per_cta))
    (loss * 0.7).backward()
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits, target), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buffer.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)
    assert buffer.grad[1].abs().max() == 0


@pytest.mark.parametrize("is_rms,prefetch", [(True, False), (False, False), (True, True), (False, True)])
def test_cluster_norm_backward_matches_float64(is_rms, prefetch):
    """dx, dW (and dB) of rows sliced out of a wider buffer, more rows than the interpreter's two
    programs (each loops over its rows, with or without the next row's loads ahead, and sums its
    dW partials), upstream gradients not 1."""
    benchmark_script("wide_rows")
    cluster_rows = sys.modules["cluster_rows"]
    torch.manual_seed(7)
    m, n = 5, 1000
    wide = torch.randn(m, n + 24, dtype=torch.float64) * 2 + 0.5
    weight = torch.rand(n, dtype=torch.float64) + 0.5
    bias = None if is_rms else torch.randn(n, dtype=torch.float64)
    dy = torch.randn(m, n, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (wide[:, :n], weight, bias) if t is not None]
    reference = functools.partial(llmkernels.reference.rms_norm if is_rms else llmkernels.reference.layer_norm,
                                  eps=1e-6 if is_rms else 1e-5, compute_dtype=torch.float64)
    expected = torch.autograd.grad(reference(*inputs), inputs, dy)
    ours = [wide.float()[:, :n].requires_grad_(), *(t.detach().float().requires_grad_() for t in inputs[1:])]
    assert ours[0].stride() == (n + 24, 1)
    config = cluster_rows.ClusterRows(256, prefetch=prefetch)
    y = (cluster_rows.rms_norm_cluster(ours[0], ours[1], 1e-6, config) if is_rms
         else cluster_rows.layer_norm_cluster(*ours, 1e-5, config))
    torch.testing.assert_close(y.double(), reference(*inputs), rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(y, ours, dy.float()), expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
