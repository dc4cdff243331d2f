"""The step-overhead benchmark (benchmarks/bench_step_overhead.py) runs and reports host cost per tensor for
every system it planned. Checks the harness, never a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_step_overhead.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode, clock", [("eager", "wall"), ("compiled", "thread")])
def test_smoke_run_reports_host_cost(tmp_path, mode, clock):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--mode", mode, "--clock", clock, "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    suffix = " compiled" if mode == "compiled" else ""
    assert set(rows) == {f"adamw{suffix}", f"zenflow{suffix} S=auto sel=auto", f"zenflow{suffix} S=4 sel=step"}
    assert report["threads"] == 1 and report["clock"] == clock and f"clock: {clock}" in proc.stdout
    for r in rows.values():
        assert r["tensors"] == 40 and r["rounds"] == 2
        assert all(r[f"{phase}_s"] > 0 for phase in ("forward", "backward", "step", "zero_grad"))
        assert r["host_us_per_tensor"] == pytest.approx(r["host_s"] / 40 * 1e6)
    assert rows[f"adamw{suffix}"]["host_ratio_to_adamw"] == pytest.approx(1.0)
    for r in rows.values():
        if r["kind"] == "zenflow":
            assert r["host_s"] == pytest.approx(r["step_s"] + r["zero_grad_s"] + r["handoff_s"])
            assert r["zenflow_stats"]["steps"] > 0
    fixed = rows[f"zenflow{suffix} S=4 sel=step"]
    assert fixed["zenflow_stats"]["cpu_updates"] == fixed["zenflow_stats"]["steps"] // 4  # whole intervals
