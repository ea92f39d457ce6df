"""benchmarks/wide_rows.py --tiny on CPU: every wide-row strategy passes the bench's float64 check,
and the JSON and markdown it writes name them; a spent time budget starts no width."""
import json

import pytest

from llmkernels.tune.spaces import wide_row_candidates
from tests.conftest import INTERPRETED
from tests.helpers import benchmark_script

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--tiny is the CPU check")


def test_every_strategy_is_checked_and_written(tmp_path):
    wide_rows = benchmark_script("wide_rows")
    assert wide_rows.main(["--tiny", "--parts", "rmsnorm-fwd,layernorm-bwd", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "wide_rows.json").read_text())
    n = wide_rows.TINY_SHAPES[0]["N"]
    for part, backward in (("rmsnorm-fwd", False), ("layernorm-bwd", True)):
        records = {r["provider"]: r for r in summary["records"] if r["part"] == part}
        assert set(records) == set(wide_row_candidates(n, backward))
        assert all(r["status"] == "ok" and r["n"] == n for r in records.values()), records
    assert records["split 8192x8 s3"]["config"].startswith("SplitBwdConfig(")
    table = (tmp_path / "wide_rows.md").read_text()
    assert "## rmsnorm-fwd" in table and "| split 4096x4 s3 tma lag2 | ok |" in table


def test_a_spent_budget_starts_no_width(tmp_path):
    assert benchmark_script("wide_rows").main(["--tiny", "--parts", "rmsnorm-bwd", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "wide_rows.json").read_text())
    assert summary["records"] == [] and summary["header"]["cut_by_budget"] == {"rmsnorm-bwd": [1000]}
