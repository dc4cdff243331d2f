"""The host-path benchmark (benchmarks/bench_host.py): it runs the runtime's real host work end to end and
reports every row against the measured bandwidth bound; the sizing rule is the stall-free inequality.

Checks the harness, never a speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_host.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_host_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_reports_every_row(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    results = [r for r in report["results"] if r["status"] == "ok"]
    assert {(r["grad_dtype"], r["requested_params"]) for r in results} == {(d, 1_000_000) for d in ("bf16", "fp32")}
    places = {p["name"]: p for p in report["places"]}
    assert "all cores" in places and all(p["threads"] >= 1 and p["cores"] for p in places.values())
    expected_rows = {"accumulate", "adamw", "update", "torch_fused"} | ({"ds_cpu_adam"} if report["deepspeed"]["used"]
                                                                     else set())
    if not report["deepspeed"]["used"]:
        assert report["deepspeed"]["reason"]  # why DeepSpeedCPUAdam was left out
    for r in results:
        assert r["place"] in places and 0.9 * r["requested_params"] <= r["num_params"] <= 1.1 * r["requested_params"]
        assert set(r["rows"]) == expected_rows
        bw = r["bandwidth"]
        assert bw["bound_gbps"] == max(bw[f"{k}_gbps"] for k in ("copy", "add", "add_inplace", "scale_inplace",
                                                            "addcmul_inplace")) > 0
        for name, row in r["rows"].items():
            assert row["seconds"] > 0 and row["gparams_per_s"] > 0
            assert row["fraction_of_bound"] == pytest.approx(row["gparams_per_s"] / row["bound_gparams_per_s"])
        assert r["rows"]["accumulate"]["bytes_per_param"] == (10 if r["grad_dtype"] == "bf16" else 12)
        assert {"adamw_fraction_of_bound", "accumulate_fraction_of_bound"} <= set(r["targets"])
        assert r["interval"]["seconds"] == pytest.approx(
            r["interval"]["steps"] * r["rows"]["accumulate"]["seconds"] + r["rows"]["update"]["seconds"])
    for place, sizing in report["sizing"].items():
        assert place in places
        assert list(sizing["table"]) == ["0.5B", "1B", "2B", "4B", "8B"]
        assert all(list(row) == ["50ms", "100ms", "200ms", "500ms", "1000ms"] for row in sizing["table"].values())
    assert "Smallest stall-free update_interval" in proc.stdout and "Gparam/s" in proc.stdout


def test_smallest_interval_is_the_stall_free_bound():
    bench = _load_bench()
    # 1B params, r = 0 (all host): t_acc = 0.1 s, t_upd = 0.5 s per interval; T = 0.2 s -> S >= 0.5 / 0.1 = 5
    assert bench.smallest_interval(1e9, 0.2, 0.0, acc_rate=1e10, update_rate=2e9) == 5
    # S = 5 fits (5 * 0.1 + 0.5 <= 5 * 0.2), S = 4 does not (0.4 + 0.5 > 0.8)
    assert bench.smallest_interval(1e9, 0.1, 0.0, acc_rate=1e10, update_rate=2e9) is None  # t_acc == T
    assert bench.smallest_interval(1e9, 1.0, 0.0, acc_rate=1e10, update_rate=2e9) == 1
    assert bench.smallest_interval(1e9, 0.2, 0.5, acc_rate=1e10, update_rate=2e9) == 2  # half the host work
    assert bench.smallest_interval(1e9, 0.101, 0.0, acc_rate=1e10, update_rate=2e9) is None  # needs S > 64


def test_parse_size():
    bench = _load_bench()
    assert [bench.parse_size(s) for s in ("10M", "0.5B", "2000", "1k")] == [10_000_000, 500_000_000, 2000, 1000]
    with pytest.raises(Exception, match="bad size"):
        bench.parse_size("ten")
