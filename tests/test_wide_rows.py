"""benchmarks/wide_rows.py --tiny on CPU: every wide-row strategy passes the bench's float64 check,
and the JSON and markdown it writes name them; --skip / --only choose strategies by words of their
names; a spent time budget starts no width."""
import json
import sys

import pytest

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
        assert set(records) == set(wide_row_candidates(n, backward)) | set(wide_rows.EXPERIMENTS.get(part, ()))
        assert all(r["status"] == "ok" and r["n"] == n for r in records.values()), records
    assert found["layernorm-bwd"]["split 8192x8 s3"]["config"].startswith("SplitBwdConfig(")
    assert found["layernorm-fwd"]["cluster 8192"]["config"] == "ClusterRows(cols_per_cta=8192, num_warps=8)"
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
    monkeypatch.setattr(wide_rows, "TINY_SHAPES", ({"M": 3, "N": 1000}, {"M": 3, "N": 2000}))
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
