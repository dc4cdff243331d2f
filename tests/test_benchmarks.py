"""The benchmark harness (benchmarks/bench_offload.py): it runs end to end and reports every system.

Checks the harness, not speed: the --smoke run exits 0 and its JSON has a row per system with the required
fields, numeric step times for the compiled ZenFlow rows, and a reason for every system that could not run
(e.g. DeepSpeed's JIT ops not built yet). Plus fast unit checks of the option parsing and target logic.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_offload.py"

REQUIRED_FIELDS = ("name", "kind", "status", "error", "median_step_s", "mean_step_s", "ratio_to_speed_limit",
                   "stall_fraction", "peak_gpu_mem_gb", "traffic_multiple", "cpu_update_s_per_step", "notes")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_offload_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_reports_every_system(tmp_path):
    out = tmp_path / "tmp.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())

    assert report["smoke"] is True
    assert report["device"]
    for package in ("torch", "triton", "deepspeed"):
        assert package in report["versions"]
    rows = report["systems"]
    kinds = [r["kind"] for r in rows]
    # smoke plan: the speed limit, compiled ZenFlow overlap on and off, ZeRO-Offload, DeepSpeed ZenFlow
    assert kinds.count("adamw") == 1 and kinds.count("ds_offload") == 1 and kinds.count("ds_zenflow") == 1
    zen = [r for r in rows if r["kind"] == "zenflow"]
    assert sorted(r["settings"]["overlap_step"] for r in zen) == [False, True]
    assert len({r["name"] for r in rows}) == len(rows)

    for row in rows:
        missing = [f for f in REQUIRED_FIELDS if f not in row]
        assert not missing, f"{row['name']}: missing {missing}"
        assert row["status"] in ("ok", "failed")
        if row["status"] == "failed":
            assert isinstance(row["error"], str) and row["error"].strip(), row
        else:
            assert row["error"] is None
            assert row["median_step_s"] > 0 and row["mean_step_s"] > 0
    for row in zen:
        assert row["status"] == "ok", f"compiled ZenFlow must run on CPU: {row.get('error')}\n{row.get('log_tail', '')}"
        assert isinstance(row["median_step_s"], float) and row["median_step_s"] > 0
        assert 0.0 <= row["stall_fraction"] < 1.0
        assert row["traffic_multiple"] > 0
        assert set(row["targets"]) == {"within_1.25x_of_adamw", ">=3x_faster_than_zero_offload",
                                       "faster_than_ds_zenflow", "stall_below_5pct", "traffic_within_bound"}
    limit = rows[kinds.index("adamw")]
    if limit["status"] == "ok":
        assert limit["ratio_to_speed_limit"] == pytest.approx(1.0)

    assert "system" in proc.stdout and "Targets" in proc.stdout
    for row in rows:
        assert row["name"] in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "chart: skipped" in proc.stdout
    else:
        assert out.with_suffix(".png").stat().st_size > 0


def test_parse_settings():
    bench = _load_bench()
    assert bench.parse_settings("0.05:4,0.1:4, 0.05:8") == [(0.05, 4), (0.1, 4), (0.05, 8)]
    assert bench.parse_settings("0.1:auto") == [(0.1, "auto")]
    with pytest.raises(Exception, match="topk_ratio:update_interval"):
        bench.parse_settings("0.05")


def test_plan_and_targets_without_running():
    bench = _load_bench()
    args = bench.resolve_args(["--model", "1b", "--zenflow-settings", "0.05:4,0.1:8", "--out", "x.json"])
    specs = bench.plan_systems(args)
    names = [s["name"] for s in specs]
    assert names[0] == "adamw (speed limit)"
    assert sum(s["kind"] == "zenflow" for s in specs) == 4  # 2 settings x overlap on/off
    assert sum(s["kind"] == "ds_zenflow" for s in specs) == 2
    assert len(set(names)) == len(names)

    def row(name, kind, mean, settings=None, **extra):
        return dict(name=name, kind=kind, status="ok", error=None, settings=settings, median_step_s=mean,
                    mean_step_s=mean, **extra)

    zf = dict(topk_ratio=0.05, update_interval=4, overlap_step=True)
    rows = [row("adamw", "adamw", 1.0),
            row("zf", "zenflow", 1.2, zf, stall_fraction=0.01, traffic_steady_multiple=1.2, traffic_multiple=1.2),
            row("zf-bad", "zenflow", 2.0, zf, stall_fraction=0.2, traffic_steady_multiple=1.3, traffic_multiple=1.3),
            row("off", "ds_offload", 4.0),
            row("dszf", "ds_zenflow", 1.8, dict(zf)),
            dict(name="broken", kind="ds_zenflow", status="failed", error="boom", settings=zf)]
    bench.analyse(rows)
    good, bad = rows[1]["targets"], rows[2]["targets"]
    assert all(t["passed"] for t in good.values()), good
    assert [k for k, t in bad.items() if not t["passed"]] == [
        "within_1.25x_of_adamw", ">=3x_faster_than_zero_offload", "faster_than_ds_zenflow", "stall_below_5pct",
        "traffic_within_bound"]
    assert rows[0]["ratio_to_speed_limit"] == 1.0 and rows[5]["ratio_to_speed_limit"] is None
    table = bench.format_table(rows)
    assert "FAILED broken: boom" in table
    assert "PASS" in bench.format_targets(rows) and "FAIL" in bench.format_targets(rows)
