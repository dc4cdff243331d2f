"""The setup benchmark (benchmarks/bench_first_step.py) runs and reports every step's time and peak memory.
Checks the harness, never a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_first_step.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak resident set is read from /proc")
@pytest.mark.parametrize("device", ["emulated", "cpu"])
def test_smoke_run_reports_every_step(tmp_path, device):
    out = tmp_path / "first_step.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--device", device, "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["params"] == 4 * 64 * 64 and report["device"] == device and report["smoke"]
    assert len(report["steps"]) == 2 and all(step["seconds"] > 0 for step in report["steps"])
    assert report["host_state_bytes_per_param"] > 0
