"""One command for a GPU machine: the device suite, the compiled Triton kernels, the overlap tests and the
offload benchmark, in bounded time, into one report.

    python -m zenflow_compile.check                         # everything; under 20 minutes on one GPU
    python -m zenflow_compile.check --parts kernels,bench   # some parts only
    python -m zenflow_compile.check --pytest-args="-k stacked" --out-dir /tmp/check
    python -m zenflow_compile.check --emulated-suite        # on a CPU: also the suite on the emulated device

Parts, each a subprocess with its own time limit, in this order:
  kernels  the Triton kernels compiled (TRITON_INTERPRET unset) against their torch twins, CUDA cases (GPU only)
  overlap  the async-overlap tests (`-m overlap`) with real streams and events (GPU only)
  host     benchmarks/bench_host.py: the host's accumulation and CPU AdamW throughput and memory bandwidth, on
           all cores and on the worker share (what bounds an offloading step on this machine); on a CPU its
           --smoke run
  bench    benchmarks/bench_offload.py: on a GPU the 1B model in bf16, compiled ZenFlow vs compiled fused AdamW
           (and DeepSpeed's rows when deepspeed is installed); on a CPU its --smoke run (compiled systems on a
           0.1M-parameter model: it shows that the pipeline runs, not how fast, so no speed ratio is reported)
  tests    on a GPU the suite's CUDA tests (`-m cuda`: the `cuda` device's cases), without what `kernels` and
           `overlap` ran, over pytest-xdist workers when it is installed; on a CPU the whole suite on the
           `emulated` device (over 5 minutes), only with --emulated-suite or when --parts names it. Never the
           `slow` tests.
On a CPU the check is therefore quick by default: the two smoke runs, a few minutes at most.
The bounded parts run first; the suite, whose length grows with the project, takes the time they leave.
Each part's limit is its weight's share of what --time-budget (1140 s) has left (weights: kernels 90, overlap
90, host 60, bench 540, tests 420), so time a part leaves unused goes to the parts after it. A part that
fails or runs past its limit is a row with its reason; the command still writes the report, then exits 1.

Output: zenflow_check.md and zenflow_check.json in --out-dir (default: the current directory): per part its
status, test counts (from pytest's junit xml) and duration; the GPU, torch, triton and CUDA versions; the
benchmark's figures (step time ratio to fused AdamW, speed-up over ZeRO-Offload, stall fraction, peak memory,
bytes per step) with the targets of benchmarks/bench_offload.py, PASS/FAIL on a GPU only (a CPU smoke run
reports step times, no ratios). Logs, junit files and the benchmark's own JSON go to
<out-dir>/zenflow_check_files/.

It runs from a source checkout: tests/ and benchmarks/ must sit beside the package (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Optional

import torch

from zenflow_compile.check_report import (NO_GPU_STATEMENT, benchmark_figures, host_figures, load_bench_module,
                                          performance_targets, read_bench_json, write_report)
from zenflow_compile.config import ZenFlowConfig

PART_NAMES = ("kernels", "overlap", "host", "bench", "tests")
DEFAULT_TIME_BUDGET_S = 1140.0  # 19 minutes: the 20, less start-up and the report
# Interrupted parts get this long to write what they have (pytest its junit xml, the benchmark its JSON).
INTERRUPT_GRACE_S = 20.0
EMULATED_SUITE_OFF = ("on a CPU only with --emulated-suite (the whole suite on the emulated device: over 5 "
                      "minutes)")


@dataclasses.dataclass
class Part:
    """One step of the check: a command, its environment and where its results land."""

    name: str
    title: str
    weight_s: float  # its share of the default time budget
    command: list[str] = dataclasses.field(default_factory=list)
    extra_args: list[str] = dataclasses.field(default_factory=list)  # --pytest-args / --bench-args
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # set on top of this process's environment
    junit: Optional[Path] = None
    bench_json: Optional[Path] = None
    host_json: Optional[Path] = None
    not_run_reason: Optional[str] = None


@dataclasses.dataclass
class PartResult:
    name: str
    title: str
    status: str  # passed, failed, timed out, not run
    reason: str = ""
    duration_s: float = 0.0
    limit_s: Optional[float] = None
    command: str = ""
    counts: Optional[dict[str, int]] = None
    log: Optional[str] = None


# ------------------------------------------------------------------------------------------------- options
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zenflow_compile.check", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=None,
                        help=f"comma-separated subset of {','.join(PART_NAMES)} (default all, but on a CPU the "
                             "tests part only with --emulated-suite; run in that order)")
    parser.add_argument("--emulated-suite", action="store_true",
                        help="on a CPU, also run the whole suite on the emulated device (the tests part: over 5 "
                             "minutes); a GPU runs its CUDA tests anyway")
    parser.add_argument("--pytest-args", default="",
                        help="extra pytest arguments for every pytest part, one shell-quoted string, e.g. "
                             "--pytest-args=\"-k stacked -x\" (a -m here replaces the part's own)")
    parser.add_argument("--bench-args", default="",
                        help="extra bench_offload.py arguments, e.g. --bench-args=\"--model 350m\" (later options win)")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S,
                        help=f"seconds for all parts together (default {DEFAULT_TIME_BUDGET_S:.0f})")
    parser.add_argument("--out-dir", default=".", help="where the report goes (default: the current directory)")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.parts_named = args.parts is not None  # (--parts tests on a CPU is a request for the emulated suite)
    args.parts = [name.strip() for name in (args.parts or ",".join(PART_NAMES)).split(",") if name.strip()]
    unknown = sorted(set(args.parts) - set(PART_NAMES))
    if unknown or not args.parts:
        parser.error(f"--parts {unknown or 'is empty'}: expected a subset of {','.join(PART_NAMES)}")
    if args.time_budget <= 0:
        parser.error("--time-budget must be > 0")
    return args


# ------------------------------------------------------------------------------------------ the machine
def find_checkout(package_dir: Path) -> Path:
    """The source checkout around the package: the check runs its tests and benchmarks from there."""
    root = package_dir.resolve().parent
    needed = [root / "tests" / "test_triton_kernels.py", root / "benchmarks" / "bench_offload.py"]
    missing = [str(path) for path in needed if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"zenflow_compile.check runs from a source checkout: it needs tests/ and benchmarks/ beside the "
            f"package, and {', '.join(missing)} is missing. Clone the repository, `pip install -e \".[test]\"` "
            f"in the clone and run `python -m zenflow_compile.check` there.")
    return root


def package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    has_gpu = torch.cuda.is_available()
    gpu_name = None
    if has_gpu:
        # Asked in a throwaway process, so this one holds no CUDA context while the parts use the GPU.
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                               capture_output=True, text=True, timeout=120)
        gpu_name = probe.stdout.strip() or "CUDA device (name unavailable)"
    return dict(gpu=has_gpu, gpu_name=gpu_name, torch=torch.__version__, cuda=torch.version.cuda,
                triton=package_version("triton"), deepspeed=package_version("deepspeed"),
                python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count())


# --------------------------------------------------------------------------------------------- the plan
def xdist_workers(cpu_count: Optional[int]) -> list[str]:
    """pytest-xdist's `-n` for the GPU suite: a worker per two cores, at most 8 (each holds a CUDA context
    and compiles its own graphs); none without xdist."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(8, (cpu_count or 2) // 2)))]


def plan_parts(args: argparse.Namespace, machine: dict[str, Any], files_dir: Path) -> list[Part]:
    """Every part, in run order; those that will not run say why."""
    has_gpu = machine["gpu"]
    pytest = [sys.executable, "-m", "pytest", "-q"]
    device = "cuda" if has_gpu else "emulated"

    kernels = Part("kernels", "Triton kernels compiled vs their torch twins", weight_s=90)
    overlap = Part("overlap", "async-overlap tests with real streams", weight_s=90)
    if has_gpu:
        # `-k cuda`: the CUDA cases only; the file's CPU cases run the Triton interpreter.
        kernels.command = pytest + ["tests/test_triton_kernels.py", "-k", "cuda",
                                    f"--junitxml={files_dir / 'kernels.xml'}"]
        kernels.env = dict(ZENFLOW_TEST_DEVICE="cuda")
        kernels.junit = files_dir / "kernels.xml"
        overlap.command = pytest + ["tests", "-m", "overlap", f"--junitxml={files_dir / 'overlap.xml'}"]
        overlap.env = dict(ZENFLOW_TEST_DEVICE="cuda")
        overlap.junit = files_dir / "overlap.xml"
    else:
        kernels.not_run_reason = overlap.not_run_reason = "no GPU"

    host = Part("host", "bench_host.py, host throughput and bandwidth" if has_gpu else "bench_host.py --smoke (CPU)",
                weight_s=60, host_json=files_dir / "bench_host.json")
    # One size past the caches, bf16 gradients as the benchmark's model has, no DeepSpeed (its op's build).
    host_plan = ["--sizes", "100M", "--grad-dtypes", "bf16", "--repeats", "3"] if has_gpu else ["--smoke"]
    host.command = [sys.executable, "benchmarks/bench_host.py", *host_plan, "--no-deepspeed",
                    "--out", str(host.host_json)]

    bench = Part("bench", "bench_offload.py, 1B model in bf16" if has_gpu else "bench_offload.py --smoke (CPU)",
                 weight_s=540, bench_json=files_dir / "bench_offload.json")
    if has_gpu:
        systems = ["adamw", "zenflow"]
        if importlib.util.find_spec("deepspeed") is not None:
            systems += ["ds_offload", "ds_zenflow"]
        # One ZenFlow setting, the defaults' schedule at top-k 0.05, summing on the device and on the host, 16
        # measured steps (4 update intervals): the targets' figures in minutes; the full grid takes an hour.
        defaults = ZenFlowConfig()
        bench_plan = ["--model", "1b", "--batch", "8", "--seq", "1024", "--steps", "16", "--warmup", "4",
                      "--zenflow-settings", f"0.05:{defaults.update_interval}", "--overlap", "on",
                      "--select-strategy", defaults.select_strategy, "--select-interval",
                      str(defaults.select_interval), "--overlap-reselect", defaults.overlap_reselect,
                      "--landing-lag", str(defaults.landing_lag).lower(), "--accumulate-on", "both",
                      "--systems", ",".join(systems)]
    else:
        # DeepSpeed's rows need its ops JIT-built first (minutes): beyond a bounded CPU check.
        bench_plan = ["--smoke", "--systems", "adamw,zenflow"]
    bench.command = [sys.executable, "benchmarks/bench_offload.py", *bench_plan,
                     "--out", str(bench.bench_json), "--chart", str(files_dir / "bench_offload.png"),
                     "--log-dir", str(files_dir / "bench_logs"), "--trace-dir", str(files_dir / "traces")]
    bench.extra_args = shlex.split(args.bench_args)

    tests = Part("tests", f"test suite on the {device} device", weight_s=420, junit=files_dir / "tests.xml",
                 env=dict(ZENFLOW_TEST_DEVICE=device))
    # Not the check's own tests: they would run the check again.
    selection = ["--ignore=tests/test_check.py"]
    if has_gpu:
        # The tests that put tensors on the GPU (the `cuda` marker: the device fixture's cuda leg and the
        # CUDA-only tests); the rest run on the CPU whatever the machine, as in CI. Kernels and overlap ran
        # their own. Spread over xdist workers when it is installed: they are independent small models.
        tests.title = "the suite's CUDA tests"
        selection += ["-m", "cuda and not slow and not overlap", "--ignore=tests/test_triton_kernels.py"]
        selection += xdist_workers(machine["cpu_count"])
        tests.env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # one compile process per worker, not one per core
    else:
        selection += ["-m", "not slow"]
        if not (args.emulated_suite or args.parts_named):
            tests.not_run_reason = EMULATED_SUITE_OFF
    tests.command = pytest + ["tests", *selection, f"--junitxml={tests.junit}"]

    parts = [kernels, overlap, host, bench, tests]
    for part in parts:
        if part.junit is not None:
            part.extra_args = shlex.split(args.pytest_args)
        if part.name not in args.parts and part.not_run_reason is None:
            part.not_run_reason = "not selected (--parts)"
    return parts


# ----------------------------------------------------------------------------------------------- running
def run_command(command: list[str], env: dict[str, str], cwd: Path, log_path: Path,
                timeout_s: float) -> tuple[Optional[int], bool]:
    """(exit code, timed out). Output goes to `log_path`. The command runs in its own process group, and the
    whole group goes at the end, so no compile worker or benchmark system outlives its part."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            # SIGINT first: pytest still writes its junit xml, the benchmark stops its systems.
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return process.returncode, timed_out


def part_environment(part: Part) -> dict[str, str]:
    env = dict(os.environ)
    # Compiled kernels are what users run; the kernel tests set the interpreter themselves for CPU tensors.
    env.pop("TRITON_INTERPRET", None)
    env.update(part.env)
    return env


def last_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def read_junit(path: Path) -> Optional[dict[str, Any]]:
    """Counts and the first failing tests from pytest's junit xml; None when pytest wrote none."""
    if not path.is_file():
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    counts["total"] = counts.pop("tests")
    counts["passed"] = counts["total"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failing = ["::".join(filter(None, (case.get("classname"), case.get("name")))) for case in root.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    return dict(counts=counts, failing=failing)


def pytest_outcome(result: PartResult, returncode: Optional[int], timed_out: bool, junit: Path,
                   log_path: Path) -> None:
    import pytest

    report = read_junit(junit)
    if report is not None:
        result.counts = report["counts"]
    if timed_out:
        ran = "" if report is None else f"; {report['counts']['total']} tests had run"
        result.status, result.reason = "timed out", f"ran past its {result.limit_s:.0f} s limit{ran}"
    elif returncode == pytest.ExitCode.OK:
        result.status = "passed"
    elif returncode == pytest.ExitCode.NO_TESTS_COLLECTED:
        result.status, result.reason = "failed", "no test was selected (pytest exit 5): it checked nothing"
    elif returncode == pytest.ExitCode.TESTS_FAILED and report is not None:
        counts = report["counts"]
        result.status = "failed"
        result.reason = (f"{counts['failures']} failed, {counts['errors']} errors: "
                         f"{', '.join(report['failing'][:5])}")
    else:
        result.status, result.reason = "failed", f"pytest exit {returncode}: {last_line(log_path)}"


def host_outcome(result: PartResult, returncode: Optional[int], timed_out: bool, host_json: Path,
                 log_path: Path) -> None:
    if timed_out:
        result.status, result.reason = "timed out", f"ran past its {result.limit_s:.0f} s limit"
    elif returncode != 0 or read_bench_json(host_json) is None:
        result.status, result.reason = "failed", f"exit code {returncode}; last log line: {last_line(log_path)}"
    else:
        result.status = "passed"


def bench_outcome(result: PartResult, returncode: Optional[int], timed_out: bool, bench_json: Path,
                  log_path: Path) -> None:
    """Passed when the compiled systems ran; a DeepSpeed row that failed is named in the reason only (it is
    the baseline's install, not this project, that failed)."""
    if timed_out:
        result.status, result.reason = "timed out", f"ran past its {result.limit_s:.0f} s limit"
        return
    if returncode != 0:
        result.status, result.reason = "failed", f"bench_offload.py exit {returncode}: {last_line(log_path)}"
        return
    bench = read_bench_json(bench_json)
    if bench is None:
        result.status, result.reason = "failed", f"bench_offload.py wrote no readable JSON: {last_line(log_path)}"
        return
    systems = bench["systems"]
    failed = [row for row in systems if row["status"] != "ok"]
    result.counts = dict(total=len(systems), passed=len(systems) - len(failed), failures=len(failed),
                         errors=0, skipped=0)
    ours = [row for row in failed if not row["kind"].startswith("ds_")]
    result.status = "failed" if ours else "passed"
    result.reason = "; ".join(f"{row['name']} failed: {str(row.get('error'))[:200]}" for row in failed)


def run_part(part: Part, limit_s: float, checkout: Path, files_dir: Path) -> PartResult:
    command = list(part.command)
    if part.bench_json is not None:
        # The benchmark stops its own systems a little before the part's limit, so its JSON is written.
        command += ["--time-budget", f"{0.9 * limit_s:.0f}"]
    command += part.extra_args
    log_path = files_dir / f"{part.name}.log"
    shown = " ".join([f"{key}={value}" for key, value in part.env.items()] + [shlex.quote(a) for a in command])
    result = PartResult(part.name, part.title, status="not run", limit_s=limit_s, command=shown, log=str(log_path))
    if part.junit is not None and importlib.util.find_spec("pytest") is None:
        result.status, result.reason = "failed", "pytest is not installed: pip install -e \".[test]\""
        return result
    started = time.perf_counter()
    returncode, timed_out = run_command(command, part_environment(part), checkout, log_path, limit_s)
    result.duration_s = time.perf_counter() - started
    if part.bench_json is not None:
        bench_outcome(result, returncode, timed_out, part.bench_json, log_path)
    elif part.host_json is not None:
        host_outcome(result, returncode, timed_out, part.host_json, log_path)
    else:
        pytest_outcome(result, returncode, timed_out, part.junit, log_path)
    return result


def run_parts(parts: list[Part], time_budget_s: float, checkout: Path, files_dir: Path) -> list[PartResult]:
    """Each part's limit: its weight's share of the time left, so time a part leaves unused goes to the ones
    after it."""
    deadline = time.perf_counter() + time_budget_s
    for part in parts:  # never report a previous run's results
        for stale in (part.junit, part.bench_json, part.host_json):
            if stale is not None:
                stale.unlink(missing_ok=True)
    results = []
    for index, part in enumerate(parts):
        if part.not_run_reason:
            results.append(PartResult(part.name, part.title, status="not run", reason=part.not_run_reason))
            print(f"[{part.name}] not run: {part.not_run_reason}", flush=True)
            continue
        weights_left = sum(p.weight_s for p in parts[index:] if not p.not_run_reason)
        limit_s = (deadline - time.perf_counter()) * part.weight_s / weights_left
        if limit_s < 5.0:
            results.append(PartResult(part.name, part.title, status="not run",
                                      reason=f"the --time-budget of {time_budget_s:.0f} s was spent"))
            print(f"[{part.name}] not run: {results[-1].reason}", flush=True)
            continue
        print(f"[{part.name}] {part.title} (limit {limit_s:.0f} s) ...", flush=True)
        try:
            row = run_part(part, limit_s, checkout, files_dir)
        except Exception as error:  # a row, not a crash: the report still gets written
            row = PartResult(part.name, part.title, status="failed", limit_s=limit_s,
                             reason=f"the check could not run or read this part: {error!r}")
        results.append(row)
        print(f"[{part.name}] {row.status} in {row.duration_s:.1f} s{': ' + row.reason if row.reason else ''}",
              flush=True)
    return results


# -------------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        checkout = find_checkout(Path(__file__).parent)
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir).resolve()
    files_dir = out_dir / "zenflow_check_files"
    files_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    machine = describe_machine()
    print(f"zenflow_compile.check: {machine['gpu_name'] or 'no GPU'}, torch {machine['torch']}, "
          f"CUDA {machine['cuda']}, triton {machine['triton']}; checkout {checkout}", flush=True)
    if not machine["gpu"]:
        print(NO_GPU_STATEMENT, flush=True)
    parts = plan_parts(args, machine, files_dir)
    results = run_parts(parts, args.time_budget, checkout, files_dir)
    bench_json = next(p.bench_json for p in parts if p.name == "bench")
    report = dict(
        passed=not any(r.status in ("failed", "timed out") for r in results),
        no_gpu=None if machine["gpu"] else NO_GPU_STATEMENT,
        machine=machine, argv=sys.argv[1:] if argv is None else argv, checkout=str(checkout),
        files_dir=str(files_dir), time_budget_s=args.time_budget, total_s=time.perf_counter() - started,
        parts=[dataclasses.asdict(r) for r in results],
        benchmark=benchmark_figures(bench_json) if "bench" in args.parts else None,
        host=host_figures(next(p.host_json for p in parts if p.name == "host")) if "host" in args.parts else None,
        targets=performance_targets(load_bench_module(checkout)))
    markdown = write_report(report, out_dir)
    print()
    print(markdown)
    print(f"report: {out_dir / 'zenflow_check.md'} and {out_dir / 'zenflow_check.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
