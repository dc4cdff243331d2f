"""`python -m zenflow_compile.check` on CPU: its report, its exit code, its limits.

The command runs as a subprocess with CUDA hidden, so these tests check its CPU part on any machine.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow_compile import check, check_report

CHECKOUT = Path(__file__).resolve().parents[1]


def run_check(out_dir: Path, *args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "zenflow_compile.check", "--out-dir", str(out_dir), *args],
                          cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout)
    report = json.loads((out_dir / "zenflow_check.json").read_text())
    markdown = (out_dir / "zenflow_check.md").read_text()
    return proc, report, markdown


def parts_by_name(report: dict) -> dict:
    return {part["name"]: part for part in report["parts"]}


def bench_targets() -> dict:
    spec = importlib.util.spec_from_file_location("bench_offload", CHECKOUT / "benchmarks" / "bench_offload.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return dict(ratio_to_fused_adamw_max=bench.TARGET_RATIO_TO_ADAMW,
                speedup_over_zero_offload_min=bench.TARGET_SPEEDUP_OVER_ZERO_OFFLOAD,
                stall_fraction_max=bench.TARGET_STALL_FRACTION)


@pytest.mark.slow
def test_cpu_run_by_default_is_quick_and_reports_no_speed_ratio(tmp_path):
    """`python -m zenflow_compile.check` on a CPU, as a user runs it: the smoke runs only (the emulated suite
    behind --emulated-suite), in minutes, and no ratio of the smoke model's step times anywhere."""
    proc, report, markdown = run_check(tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = parts_by_name(report)
    assert parts["tests"]["status"] == "not run" and "--emulated-suite" in parts["tests"]["reason"]
    assert parts["bench"]["status"] == parts["host"]["status"] == "passed"
    assert report["total_s"] < 300, report["total_s"]
    for row in report["benchmark"]["systems"]:
        assert row["ratio_to_fused_adamw"] is None and row["speedup_over_zero_offload"] is None, row
    assert all(t["value"] is None for t in report["benchmark"]["targets"])
    for text in (proc.stdout, markdown):
        assert "| x fused AdamW |" not in text and "x faster than ZeRO-Offload |" not in text
        assert "no speed ratio" in text


@pytest.mark.slow
def test_cpu_run_reports_every_part_and_the_benchmark_figures(tmp_path):
    proc, report, markdown = run_check(tmp_path, "--parts", "tests,bench", "--pytest-args", "-k test_worker")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert check_report.NO_GPU_STATEMENT in proc.stdout

    assert report["passed"] is True
    assert report["no_gpu"] == check_report.NO_GPU_STATEMENT
    machine = report["machine"]
    assert machine["gpu"] is False and machine["gpu_name"] is None
    assert {"torch", "triton", "cuda", "deepspeed", "python"} <= set(machine)

    parts = parts_by_name(report)
    assert list(parts) == ["kernels", "overlap", "host", "bench", "tests"]
    for name in ("kernels", "overlap"):
        assert (parts[name]["status"], parts[name]["reason"]) == ("not run", "no GPU")
    tests = parts["tests"]
    assert tests["status"] == "passed" and tests["counts"]["passed"] > 0 and tests["counts"]["failures"] == 0
    assert tests["duration_s"] > 0 and "ZENFLOW_TEST_DEVICE=emulated" in tests["command"]
    assert parts["bench"]["status"] == "passed" and "--smoke" in parts["bench"]["command"]

    bench = report["benchmark"]
    assert bench["smoke"] is True and bench["judged"] is False
    zenflow = next(row for row in bench["systems"] if row["kind"] == "zenflow")
    for figure in ("mean_step_s", "stall_fraction", "peak_host_rss_gb", "bytes_per_step"):
        assert zenflow[figure] is not None, figure
    assert {"speedup_over_zero_offload", "peak_gpu_mem_gb", "traffic_multiple"} <= set(zenflow)
    assert zenflow["ratio_to_fused_adamw"] is None  # (a smoke run measures no speed)
    assert bench["targets"] and all(t["verdict"] == "not judged: no GPU" for t in bench["targets"])
    assert bench_targets().items() <= report["targets"].items()

    assert check_report.NO_GPU_STATEMENT in markdown
    assert "not run: no GPU" in markdown
    for heading in ("## Parts", "## Benchmark", "## Targets", "## Commands"):
        assert heading in markdown


def _plan(tmp_path, argv: list[str], gpu: bool) -> dict:
    return {part.name: part for part in check.plan_parts(check.parse_args(argv), dict(gpu=gpu, cpu_count=16),
                                                         tmp_path)}


def test_on_a_cpu_the_emulated_suite_runs_only_when_asked(tmp_path):
    """The whole suite on the emulated device takes over 5 minutes: on a CPU the default plan leaves it out
    (saying how to ask for it), --emulated-suite or --parts naming it runs it; a GPU's plan is unchanged."""
    tests = _plan(tmp_path, [], gpu=False)["tests"]
    assert tests.not_run_reason == check.EMULATED_SUITE_OFF and "--emulated-suite" in tests.not_run_reason
    for argv in (["--emulated-suite"], ["--parts", "tests,bench"]):
        tests = _plan(tmp_path, argv, gpu=False)["tests"]
        assert tests.not_run_reason is None, argv
        assert tests.env["ZENFLOW_TEST_DEVICE"] == "emulated" and "not slow" in tests.command
    assert _plan(tmp_path, ["--parts", "bench"], gpu=False)["tests"].not_run_reason == "not selected (--parts)"
    for argv in ([], ["--emulated-suite"]):
        plan = _plan(tmp_path, argv, gpu=True)
        assert all(part.not_run_reason is None for part in plan.values()), argv
        assert plan["tests"].env["ZENFLOW_TEST_DEVICE"] == "cuda"


def _bench_json(path: Path, smoke: bool) -> Path:
    """A bench_offload.py JSON as a run writes it (the fields the check reads): fused AdamW and ZenFlow."""
    def row(name, kind, mean_s, ratio):
        targets = {} if kind != "zenflow" else {"within_1.25x_of_adamw": dict(
            value=ratio, passed=None if smoke else ratio <= 1.25, judged=not smoke, detail="mean step / adamw")}
        return dict(name=name, kind=kind, status="ok", mean_step_s=mean_s, median_step_s=mean_s,
                    ratio_to_speed_limit_mean=ratio, stall_fraction=0.01, peak_gpu_mem_gb=None,
                    peak_host_rss_gb=1.0, traffic_multiple=1.25, model_bytes=4e5, targets=targets)
    path.write_text(json.dumps(dict(title="bench", device="cpu", smoke=smoke, judged=not smoke, systems=[
        row("adamw", "adamw", 0.5, 1.0), row("zenflow", "zenflow", 0.13, 0.26)])))
    return path


@pytest.mark.parametrize("smoke", [True, False], ids=["cpu-smoke", "gpu"])
def test_a_smoke_run_reports_no_speed_ratio(tmp_path, smoke):
    """A CPU smoke run's 0.1M-parameter model shows that the pipeline runs; its step-time ratio (ZenFlow at
    "0.26 x fused AdamW") would read as a speed result: neither the JSON nor the report has one. A GPU run's
    report keeps its ratios and verdicts."""
    figures = check_report.benchmark_figures(_bench_json(tmp_path / "bench.json", smoke))
    zenflow = next(row for row in figures["systems"] if row["kind"] == "zenflow")
    assert zenflow["mean_step_s"] == 0.13
    assert (zenflow["ratio_to_fused_adamw"] is None) == smoke and (figures["targets"][0]["value"] is None) == smoke
    machine = dict(gpu=not smoke, gpu_name=None if smoke else "GPU", torch="2", cuda=None, triton=None,
                   deepspeed=None, python="3", platform="linux", cpu_count=2)
    report = dict(machine=machine, passed=True, total_s=1.0, time_budget_s=10.0, parts=[], benchmark=figures,
                  host=None, files_dir=str(tmp_path),
                  targets=dict(judged_on="mean step time", ratio_to_fused_adamw_max=1.25,
                               speedup_over_zero_offload_min=3, stall_fraction_max=0.05, bytes_per_step_max="x"))
    markdown = check_report.render_markdown(report)
    assert ("0.26" in markdown) != smoke and ("| x fused AdamW |" in markdown) != smoke
    assert ("130.0" in markdown) != smoke  # (nor its step times side by side)
    assert ("no speed ratio" in markdown) == smoke


@pytest.mark.slow
def test_a_failing_part_makes_a_nonzero_exit_and_still_a_report(tmp_path):
    proc, report, markdown = run_check(tmp_path, "--parts", "tests", "--pytest-args", "tests/does_not_exist.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    tests = parts_by_name(report)["tests"]
    assert tests["status"] == "failed" and "does_not_exist.py" in tests["reason"]
    assert report["passed"] is False and "FAIL: tests (failed)" in markdown
    assert parts_by_name(report)["bench"]["reason"] == "not selected (--parts)"


@pytest.mark.slow
def test_failing_tests_are_counted_and_named(tmp_path):
    injected = tmp_path / "test_injected.py"
    injected.write_text("def test_injected_failure():\n    assert False\n")
    proc, report, _ = run_check(tmp_path, "--parts", "tests", "--pytest-args", f"{injected} -k injected")
    assert proc.returncode == 1
    tests = parts_by_name(report)["tests"]
    assert tests["counts"]["failures"] == 1 and "test_injected_failure" in tests["reason"]


@pytest.mark.slow
def test_a_part_past_its_limit_is_stopped_and_reported(tmp_path):
    sleeper = tmp_path / "test_sleeper.py"
    sleeper.write_text("import time\n\ndef test_sleeps():\n    time.sleep(600)\n")
    proc, report, _ = run_check(tmp_path, "--parts", "tests", "--time-budget", "15",
                                "--pytest-args", f"{sleeper} -k sleeps")
    assert proc.returncode == 1
    tests = parts_by_name(report)["tests"]
    assert tests["status"] == "timed out" and tests["duration_s"] < 15 + check.INTERRUPT_GRACE_S + 10


def test_host_part_reports_the_host_throughput_per_placement(tmp_path):
    """The host part: bench_host.py's throughputs and bandwidth, on all cores and on the worker share, in the
    report (here its --smoke run: the figures are not judged, only that each is measured)."""
    proc, report, markdown = run_check(tmp_path, "--parts", "host")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    host = parts_by_name(report)["host"]
    assert host["status"] == "passed" and "bench_host.py --smoke" in host["command"]
    places = report["host"]["places"]
    assert [p["place"] for p in places] == ["all cores", "worker share (pt_reserved_cores_perc=0.5)"]
    for place in places:
        for figure in ("accumulate_gparams_per_s", "update_gparams_per_s", "bandwidth_gbps"):
            assert place[figure] > 0, (place["place"], figure)
    assert "## Host" in markdown and "worker share" in markdown and "Smoke sizes" in markdown


def test_on_a_gpu_the_host_part_measures_past_the_caches(tmp_path):
    host = {part.name: part for part in check.plan_parts(check.parse_args([]), dict(gpu=True, cpu_count=16),
                                                         tmp_path)}["host"]
    assert "--smoke" not in host.command and host.command[host.command.index("--sizes") + 1] == "100M"


@pytest.mark.project_defaults
def test_on_a_gpu_the_benchmark_runs_the_defaults_schedule_on_both_placements_and_saves_a_trace(tmp_path):
    bench = {part.name: part for part in check.plan_parts(check.parse_args([]), dict(gpu=True, cpu_count=16),
                                                          tmp_path)}["bench"]
    command = bench.command
    flag = lambda name: command[command.index(name) + 1]
    assert flag("--accumulate-on") == "both"
    assert flag("--trace-dir").endswith("traces")
    assert (flag("--zenflow-settings"), flag("--select-strategy"), flag("--select-interval"),
            flag("--overlap-reselect"), flag("--landing-lag")) == ("0.05:4", "step", "8", "incoming", "1")


def test_outside_a_checkout_it_says_to_run_from_a_clone(tmp_path):
    (tmp_path / "zenflow_compile").mkdir()
    with pytest.raises(FileNotFoundError, match="source checkout.*Clone the repository"):
        check.find_checkout(tmp_path / "zenflow_compile")
    assert check.find_checkout(CHECKOUT / "zenflow_compile") == CHECKOUT


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        check.parse_args(["--parts", "tests,gpu"])


@pytest.mark.parametrize("xdist", [True, False], ids=["xdist", "no-xdist"])
def test_on_a_gpu_the_tests_part_runs_the_cuda_tests(xdist, monkeypatch, tmp_path):
    """The GPU plan (not reachable on a CPU machine otherwise): the suite's CUDA cases, without what kernels
    and overlap run, over xdist workers where it is installed (a worker per two cores, at most 8)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(check.importlib.util, "find_spec",
                        lambda name, *a: (real_find_spec("pytest") if xdist else None) if name == "xdist"
                        else real_find_spec(name, *a))
    parts = {part.name: part for part in check.plan_parts(check.parse_args([]), dict(gpu=True, cpu_count=16),
                                                          tmp_path)}
    tests = parts["tests"]
    command = tests.command
    marker = len(command) - 1 - command[::-1].index("-m")  # (the last -m: the first is `python -m pytest`)
    assert command[marker + 1] == "cuda and not slow and not overlap"
    assert "--ignore=tests/test_triton_kernels.py" in command and "--ignore=tests/test_check.py" in command
    assert (command[command.index("-n") + 1] == "8") if xdist else ("-n" not in command)
    assert tests.env["ZENFLOW_TEST_DEVICE"] == "cuda"
    assert "-n" not in parts["overlap"].command  # (its stall figures need the GPU to itself)
