"""The benchmark harness (benchmarks/bench_offload.py): it runs end to end and reports every system.

Checks the harness, not speed: the --smoke run exits 0 and its JSON has a row per system with the required
fields, numeric step times for the compiled ZenFlow rows, and a reason for every system that could not run
(e.g. DeepSpeed's JIT ops not built yet); every system was pinned to stated cores and threads, the baseline
is the fused AdamW, the window is whole update intervals, and a CPU run judges no GPU target. Plus fast unit
checks of the option parsing, the core split, the window alignment and the target logic.
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
                   "stall_fraction", "peak_gpu_mem_gb", "traffic_multiple", "cpu_update_s_per_step", "notes",
                   "threads", "cores")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_offload_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_reports_every_system(tmp_path):
    out = tmp_path / "tmp.json"
    # --jobs 2 (two lanes at once, one core each on a 2-core machine) keeps the test short and checks the split
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--jobs", "2", "--out", str(out),
                           "--trace-dir", str(tmp_path / "traces")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())

    assert report["smoke"] is True
    assert report["device"]
    for package in ("torch", "triton", "deepspeed"):
        assert package in report["versions"]
    rows = report["systems"]
    kinds = [r["kind"] for r in rows]
    # smoke plan: the speed limit, compiled ZenFlow (overlap), ZeRO-Offload, DeepSpeed ZenFlow
    assert kinds.count("adamw") == 1 and kinds.count("ds_offload") == 1 and kinds.count("ds_zenflow") == 1
    zen = [r for r in rows if r["kind"] == "zenflow"]
    assert [r["settings"]["overlap_step"] for r in zen] == [True]
    for row in zen:  # one update interval's trace, the runtime's work named on its threads
        if row["status"] == "ok":
            trace = Path(row["trace"]).read_text()
            assert '"zenflow::cpu_adamw"' in trace and '"zenflow::apply_update"' in trace
    assert len({r["name"] for r in rows}) == len(rows)

    cpu = not report["environment"]["cuda"]
    usable = report["environment"]["usable_cores"]
    lanes = {}
    for row in rows:
        missing = [f for f in REQUIRED_FIELDS if f not in row]
        assert not missing, f"{row['name']}: missing {missing}"
        assert row["status"] in ("ok", "failed")
        # pinned, and the table says how: intra-op threads @ cores
        assert row["cores"] and set(row["cores"]) <= set(usable) and row["threads"] == len(row["cores"])
        lanes.setdefault("compile" if row["kind"] in ("adamw", "zenflow") else "deepspeed", set()).add(
            tuple(row["cores"]))
        if row["status"] == "ok":
            assert row["num_cores"] == len(row["cores"]), row  # what the system process itself saw
        if row["status"] == "failed":
            assert isinstance(row["error"], str) and row["error"].strip(), row
        else:
            assert row["error"] is None
            assert row["median_step_s"] > 0 and row["mean_step_s"] > 0
            # the window is whole update intervals, and its final in-flight work was timed inside it
            assert row["measured_steps"] % 2 == 0 and row["finish_s"] >= 0
            assert row["mean_step_s"] * row["measured_steps"] >= sum(row["step_times_s"])
    if len(usable) >= 2:  # two lanes at once: disjoint cores
        (compile_cores,), (ds_cores,) = lanes["compile"], lanes["deepspeed"]
        assert not set(compile_cores) & set(ds_cores)
    for row in zen:
        assert row["status"] == "ok", f"compiled ZenFlow must run on CPU: {row.get('error')}\n{row.get('log_tail', '')}"
        assert isinstance(row["median_step_s"], float) and row["median_step_s"] > 0
        assert 0.0 <= row["stall_fraction"] < 1.0
        assert row["traffic_multiple"] > 0
        assert set(row["targets"]) == {"within_1.25x_of_adamw", ">=3x_faster_than_zero_offload",
                                       "faster_than_ds_zenflow", "stall_below_5pct", "traffic_within_bound"}
        if cpu:  # GPU targets: never judged on a CPU
            assert all(t["passed"] is None and t["judged"] is False for t in row["targets"].values())
        workers = row["zenflow_workers"]
        assert workers["pt_reserved_cores_perc"] == 0.5
        for name in ("accumulate", "update"):  # inside the system's cores, at most as many threads
            assert set(workers[name]["cores"]) <= set(row["cores"]) and 1 <= workers[name]["threads"] <= row["threads"]
    limit = rows[kinds.index("adamw")]
    if limit["status"] == "ok":
        assert limit["ratio_to_speed_limit"] == pytest.approx(1.0)
        assert limit["optimizer"] == "torch.optim.AdamW(fused=True)"

    assert "system" in proc.stdout and "Targets" in proc.stdout
    if cpu:
        assert "CPU figures" in proc.stdout and "PASS" not in proc.stdout and "FAIL " not in proc.stdout
        assert report["judged"] is False
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
    assert {s["zenflow"]["overlap_reselect"] for s in specs if s["kind"] == "zenflow"} == {"wait"}
    # --overlap-reselect both: a reselection in flight beside each overlapped row (the synchronous rows wait)
    args = bench.resolve_args(["--zenflow-settings", "0.05:4", "--overlap-reselect", "both", "--systems", "zenflow",
                               "--out", "x.json"])
    assert [(s["name"], s["zenflow"]["overlap_step"], s["zenflow"]["overlap_reselect"])
            for s in bench.plan_systems(args)] == [
        ("zenflow r=0.05 S=4 overlap", True, "wait"),
        ("zenflow r=0.05 S=4 overlap reselect in flight", True, "incoming"),
        ("zenflow r=0.05 S=4 sync", False, "wait")]
    # --accumulate-on both: a row summing on the device beside one summing on the host
    args = bench.resolve_args(["--zenflow-settings", "0.05:4", "--overlap", "on", "--accumulate-on", "both",
                               "--systems", "zenflow", "--out", "x.json"])
    assert [(s["name"], s["zenflow"]["accumulate_on"]) for s in bench.plan_systems(args)] == [
        ("zenflow r=0.05 S=4 overlap sum on device", "device"), ("zenflow r=0.05 S=4 overlap sum on host", "host")]

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
    cpu_rows = [dict(r, targets=None) for r in rows]
    bench.analyse(rows, on_gpu=True)
    good, bad = rows[1]["targets"], rows[2]["targets"]
    assert all(t["passed"] for t in good.values()), good
    assert [k for k, t in bad.items() if not t["passed"]] == [
        "within_1.25x_of_adamw", ">=3x_faster_than_zero_offload", "faster_than_ds_zenflow", "stall_below_5pct",
        "traffic_within_bound"]
    assert rows[0]["ratio_to_speed_limit"] == 1.0 and rows[5]["ratio_to_speed_limit"] is None
    table = bench.format_table(rows)
    assert "FAILED broken: boom" in table
    assert "PASS" in bench.format_targets(rows) and "FAIL" in bench.format_targets(rows)

    # the same figures from a CPU run: values kept, nothing judged, the table says CPU
    bench.analyse(cpu_rows, on_gpu=False)
    for row in cpu_rows[1:3]:
        assert {k: (t["passed"], t["judged"]) for k, t in row["targets"].items()} == {
            k: (None, False) for k in good}
    assert cpu_rows[1]["targets"]["within_1.25x_of_adamw"]["value"] == pytest.approx(1.2)
    text = bench.format_targets(cpu_rows, on_gpu=False)
    assert "not judged" in text and "PASS" not in text and "FAIL" not in text
    assert bench.format_table(cpu_rows, on_gpu=False).startswith("CPU figures")


def test_window_is_whole_update_intervals():
    bench = _load_bench()
    args = bench.resolve_args(["--zenflow-settings", "0.05:4,0.1:6", "--steps", "30", "--warmup", "5",
                               "--full-warm-up-rounds", "2", "--out", "x.json"])
    # boundaries after steps W + k*S - 1: warm-up ends on one for S = lcm(4, 6) = 12, steps a multiple of it
    assert (args.warmup, args.steps) == (14, 36)
    assert (args.requested_warmup, args.requested_steps) == (5, 30)
    args = bench.resolve_args(["--zenflow-settings", "0.1:auto", "--steps", "7", "--warmup", "3", "--out", "x.json"])
    assert (args.warmup, args.steps) == (3, 7)  # Zen-auto: no fixed boundary to align on
    args = bench.resolve_args(["--systems", "adamw,ds_offload", "--steps", "7", "--warmup", "3", "--out", "x.json"])
    assert (args.warmup, args.steps) == (3, 7)


def test_cores_are_split_per_concurrent_lane():
    bench = _load_bench()
    assert bench.core_shares([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert bench.core_shares([5, 7], 1) == [[5, 7]]
    with pytest.raises(ValueError, match="--jobs 3 needs at least 3 cores"):
        bench.core_shares([0, 1], 3)

    args = bench.resolve_args(["--smoke", "--jobs", "2", "--out", "x.json"])
    specs = bench.plan_systems(args)
    bench.assign_cores(specs, args, [0, 1, 2, 3])
    by_lane = {}
    for spec in specs:
        by_lane.setdefault(spec["lane"], set()).add((tuple(spec["cores"]), spec["threads"]))
    assert by_lane == {"compile": {((0, 1), 2)}, "deepspeed": {((2, 3), 2)}}

    args = bench.resolve_args(["--smoke", "--threads", "1", "--out", "x.json"])  # one at a time: all cores
    specs = bench.plan_systems(args)
    bench.assign_cores(specs, args, [0, 1, 2, 3])
    assert {(tuple(s["cores"]), s["threads"]) for s in specs} == {((0, 1, 2, 3), 1)}


def test_the_simulated_device_measures_the_schedule(tmp_path):
    """The simulated device's rows: bytes device -> host per step as the schedule sends them (the interval's
    fp32 sums once per S steps, or every step's unselected gradient), and a host too slow for the interval
    shows as stall (the device idles through the wait for the CPU update)."""
    sys.path.insert(0, str(BENCH.parent))
    import simulated_device

    regime = simulated_device.Regime(params=2e8, step_ms=20.0, update_interval=2, time_scale=10.0, steps=6,
                                     warmup=2)
    host = simulated_device.HostWork(regime, update_rate_here=1e7, accumulate_rate_here=1e7)  # (~0.1M: quick)
    try:
        device = simulated_device.simulate_zenflow(regime, host, "device")
        on_host = simulated_device.simulate_zenflow(regime, host, "host")
    finally:
        host.close()
    unselected = (1 - regime.topk_ratio) * regime.params
    assert device["bytes_device_to_host_per_step"] == pytest.approx(unselected * 4 / regime.update_interval)
    assert on_host["bytes_device_to_host_per_step"] == pytest.approx(unselected * regime.param_bytes)
    # A host this machine stands in for with a 20M-parameter CPU AdamW per 4 ms interval (2 ms steps here):
    # each update takes several intervals, and the device waits for it.
    host = simulated_device.HostWork(regime, update_rate_here=2.3e9, accumulate_rate_here=1e7)
    assert host.update_numel > 19_000_000
    try:
        baseline = simulated_device.simulate_adamw(regime)
        stalled = simulated_device.simulate_zenflow(regime, host, "device")
    finally:
        host.close()
    assert stalled["idle_s"] - baseline["idle_s"] > 0.5 * stalled["window_s"]


def _simulated_device():
    sys.path.insert(0, str(BENCH.parent))
    import simulated_device

    return simulated_device


def _sums_on_the_device(regime) -> dict:
    """ZenFlow on the simulated device, summing on the device, with host work of ~0.1M parameters (quick)."""
    simulated_device = _simulated_device()
    host = simulated_device.HostWork(regime, update_rate_here=1e7, accumulate_rate_here=1e7)
    try:
        return simulated_device.simulate_zenflow(regime, host, "device")
    finally:
        host.close()


@pytest.mark.parametrize("lag,landings", [(None, [7, 11]), (1, [4, 8]), (3, [6, 10])])
def test_the_simulated_device_lands_each_update_at_its_lag(lag, landings):
    """Boundaries at steps 3, 7, 11 (S 4): an update lands at the next boundary, or at the end of step b + L."""
    simulated_device = _simulated_device()
    regime = simulated_device.Regime(params=2e8, step_ms=20.0, update_interval=4, landing_lag=lag,
                                     time_scale=10.0, steps=8, warmup=4)
    assert _sums_on_the_device(regime)["landing_steps"] == landings


@pytest.mark.parametrize("reselect,select_interval,landings,reselections", [
    ("wait", 4, [3, 7, 11], 2), ("incoming", 4, [7, 11], 2), ("wait", 8, [7, 7], 1), ("incoming", 8, [7, 11], 1)])
def test_the_simulated_device_makes_reselections_as_the_runtime(reselect, select_interval, landings,
                                                                reselections):
    """Boundaries at steps 3, 7, 11 (S 4), the window from step 4; a reselection at every boundary
    (select_interval 4) or at the first boundary 8 steps after the last (step 7). Either way the columns'
    state moves on the copy streams (sums on the device), the compute stream moving nothing itself but
    waiting for the arriving rows' upload; "wait" then lands the boundary's own update at once (at step 7 both
    the previous boundary's and its own), once the departing rows are down, "incoming" keeps it in flight (a
    slow link here: each boundary's moves take at least 50 ms of sleep each way, against 2 ms steps)."""
    simulated_device = _simulated_device()
    regime = simulated_device.Regime(params=2e8, step_ms=20.0, topk_ratio=0.2, update_interval=4,
                                     overlap_reselect=reselect, select_interval=select_interval,
                                     selection_churn=1.0, link_bandwidth=7e8, time_scale=10.0, steps=8, warmup=4)
    down_s = regime.seconds(regime.topk_ratio * regime.params * (3 * 4 + 2) / regime.link_bandwidth)
    upload_s = regime.seconds(regime.topk_ratio * regime.params * (3 * 4 + 4) / regime.link_bandwidth)
    assert down_s > 0.05
    result = _sums_on_the_device(regime)
    assert result["landing_steps"] == landings
    # Beside 8 steps' forward and backward (every operation sleeps at least its time): the compute stream
    # moves nothing itself, nor does a boundary that keeps its selection move anything...
    forward_backward_s = 8 * regime.seconds(regime.forward_backward_s)
    assert result["window_s"] - result["idle_s"] < reselections * down_s + forward_backward_s
    # ...but the training thread waits for the arriving rows' upload, and with "wait" for the departing rows'
    # copy down (it starts once the compute stream has the arriving ones).
    waited_s = upload_s + (down_s if reselect == "wait" else 0.0)
    assert result["window_s"] >= reselections * waited_s + forward_backward_s
