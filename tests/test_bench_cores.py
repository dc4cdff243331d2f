"""The core-reservation benchmark (benchmarks/bench_cores.py) measures every scenario it names, with the
worker placements it claims. Checks the harness, never a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_cores.py"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="a reservation needs Linux thread affinity and at least 2 usable cores")
@pytest.mark.slow
def test_smoke_run_reports_every_scenario(tmp_path):
    out = tmp_path / "cores.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--loops", "host-bound", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    split = report["split"]
    assert sorted(split["training"] + split["workers"]) == report["cores"]
    assert report["update_placements"]["reserved"] == dict(cores=split["workers"], threads=len(split["workers"]))
    assert report["update_placements"]["no reservation"]["cores"] == report["cores"]
    scenarios = [r["scenario"] for r in report["rows"]]
    assert scenarios == ["alone", "+ update, no reservation", "+ update, reserved", "alone, training pinned",
                         "+ update, reserved, training pinned"]
    for row in report["rows"]:
        assert row["step_ms"] > 0 and row["step_vs_alone"] > 0
        if row["scenario"].startswith("+ update"):
            assert row["update_interval_ms"] > 0 and row["update_slowdown"] > 0
    assert report["rows"][0]["step_vs_alone"] == 1.0
    assert set(report["update_alone_ms"]) == {"no reservation", "reserved"}
