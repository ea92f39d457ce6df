"""benchmarks/portable.py --tiny on CPU: the checks of both configuration sources (the installed
cache, then the heuristic alone) and the summary file, which later runs extend."""
import json

import pytest

from llmkernels.ops import _device
from tests.conftest import INTERPRETED
from tests.helpers import benchmark_script

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--tiny is the CPU check")


def test_both_sources_and_the_summary_grows(tmp_path, monkeypatch):
    """With a cache installed, llmkernels is checked with it and then alone under
    ``heuristic_only`` (which hides the cache meanwhile); a second run for another family adds
    its records to the same file and keeps the first run's."""
    seen = []

    def tuned_of(device):
        seen.append(_device.tuned_caches_off())
        return _device.NONE if _device.tuned_caches_off() else _device.Tuned("installed.json")
    monkeypatch.setattr(_device, "tuned_of", tuned_of)
    portable, out = benchmark_script("portable"), tmp_path / "summary.json"
    assert portable.main(["--tiny", "--ops", "norm", "--providers", "llmkernels,torch", "--out", str(out)]) == 0
    assert portable.main(["--tiny", "--ops", "rope", "--providers", "llmkernels", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    records = summary["records"]
    assert {r["op"] for r in records} == {"rmsnorm", "layernorm", "add_rmsnorm", "rope"}
    ours = {(r["op"], r["n"], r["config_source"]) for r in records if r["provider"] == "llmkernels"}
    assert {source for _, _, source in ours} == {"cache", "heuristic"}
    assert all((op, n, "heuristic") in ours for op, n, _ in ours)
    assert all(r["config_source"] is None for r in records if r["provider"] != "llmkernels")
    assert all(set(r) >= {"op", "n", "dtype", "provider", "fwd_pct", "bwd_pct", "config_source"} and "notes" not in r
               for r in records)
    assert len(summary["header"]["commands"]) == 2 and "device" in summary["header"]
    assert True in seen and not _device.tuned_caches_off()
