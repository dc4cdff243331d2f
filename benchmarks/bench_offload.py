"""Benchmark compiled ZenFlow against its anchors, side by side, on one model, batch and sequence length.

    python benchmarks/bench_offload.py --model 1b --batch 8 --seq 1024 --steps 30 --warmup 5 --out results.json
    python benchmarks/bench_offload.py --smoke --out smoke.json          # tiny model, CPU: checks the harness

Systems (each in its own fresh subprocess: clean memory, clean Dynamo state; see systems.py):
  adamw       the speed limit: torch.compile (Inductor) + GPU-resident torch.optim.AdamW(fused=True)
  zenflow     this project: torch.compile(backend="zenflow") + ZenFlowAdamW, for every --zenflow-settings
              entry, overlap on and off (--overlap); with the overlap on, a reselecting boundary waits for its
              CPU update or keeps it in flight (--overlap-reselect wait | incoming | both)
  ds_offload  synchronous offload: DeepSpeed ZeRO-Offload (stage 2, offload_optimizer cpu, DeepSpeedCPUAdam)
  ds_zenflow  the peer: DeepSpeed's own eager ZenFlow (zero_optimization.zenflow), same settings

Per system: median (and mean) step time, ratio to the speed limit, GPU idle (stall) fraction, peak GPU
memory, host<->device bytes per step as a multiple of the model size, CPU update time. A system that fails,
crashes or times out is a row with its reason, never a crash of the benchmark. Output: a table on stdout,
JSON (--out) and a PNG chart (--chart; needs matplotlib, skipped with a message otherwise).

Fair by construction: one system at a time (--jobs N runs N at once, CPU only, each on its own disjoint set
of cores), every system pinned to its cores with a stated number of intra-op threads (table and JSON), the
fused AdamW kernel for the baseline wherever torch has it (CUDA and CPU), the measured window made of whole
update intervals and closed only after the last in-flight CPU update is applied, and a PASS/FAIL verdict
against the design targets only on a GPU (they are GPU targets; a CPU run prints its figures, labelled CPU):
within 1.25x of the speed limit's step, >= 3x faster than ZeRO-Offload, faster than DeepSpeed's ZenFlow,
GPU stall < 5%, host<->device traffic <= (1 + 1/S) x the model per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
SYSTEMS_SCRIPT = HERE / "systems.py"
KINDS = ("adamw", "zenflow", "ds_offload", "ds_zenflow")

# The design targets (compiled ZenFlow, same GPU; see the module docstring).
TARGET_RATIO_TO_ADAMW = 1.25
TARGET_SPEEDUP_OVER_ZERO_OFFLOAD = 3.0
TARGET_STALL_FRACTION = 0.05

SMOKE_DEFAULTS = dict(model="smoke", batch=2, seq=64, steps=4, warmup=2, zenflow_settings="0.1:2", overlap="on",
                      jobs=1, system_timeout=90.0, time_budget=150.0)
FULL_DEFAULTS = dict(model="1b", batch=8, seq=1024, steps=30, warmup=5, zenflow_settings="0.05:4,0.1:4,0.05:8",
                     overlap="both", jobs=1, system_timeout=1800.0, time_budget=0.0)


# ------------------------------------------------------------------------------------------------ options
def parse_settings(text: str) -> list[tuple[float, Any]]:
    """'0.05:4,0.1:auto' -> [(0.05, 4), (0.1, 'auto')]"""
    settings = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            ratio, interval = item.split(":")
            ratio = float(ratio)
            interval = interval.strip()
            interval = interval if interval == "auto" else int(interval)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad --zenflow-settings entry {item!r}: expected topk_ratio:update_interval, e.g. 0.05:4 or 0.1:auto")
        settings.append((ratio, interval))
    if not settings:
        raise argparse.ArgumentTypeError("--zenflow-settings is empty")
    return settings


def _lag(text: str):
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--landing-lag {text}: expected an int >= 1 or none")
    return value


def _int_or_auto(text: str):
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, few steps, all systems one at a time: checks the harness on a CPU (about a "
                        "minute once Inductor's cache is warm; DeepSpeed rows fail fast until its ops are built)")
    p.add_argument("--model", choices=["smoke", "125m", "350m", "1b", "3b"], help="model preset (default 1b)")
    p.add_argument("--batch", type=int, help="micro-batch size (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default 1024)")
    p.add_argument("--steps", type=int, help="measured steps per system (default 30)")
    p.add_argument("--warmup", type=int, help="unmeasured steps first: compilation, JIT builds (default 5)")
    p.add_argument("--zenflow-settings", help="topk_ratio:update_interval list (default 0.05:4,0.1:4,0.05:8)")
    p.add_argument("--overlap", choices=["both", "on", "off"],
                   help="compiled ZenFlow with overlap_step on, off or both (default both; --smoke: on)")
    p.add_argument("--overlap-reselect", choices=["wait", "incoming", "both"], default="wait",
                   help="compiled ZenFlow with the overlap on: the overlap_reselect key (default wait; incoming: a "
                        "reselecting boundary keeps its CPU update in flight too)")
    p.add_argument("--accumulate-on", choices=["auto", "device", "host", "both"], default="auto",
                   help="compiled ZenFlow: where the unselected columns' gradients are summed, the accumulate_on key "
                        "(default auto; both: a device row and a host row per setting)")
    p.add_argument("--landing-lag", type=_lag, default=None,
                   help="compiled ZenFlow with the overlap on (and --simulated-device): the landing_lag key, the "
                        "steps after its boundary at whose end a CPU update lands (default none: the next boundary)")
    p.add_argument("--stagger", choices=["off", "on", "both"], default="off",
                   help="compiled ZenFlow with an int interval (and --simulated-device): the stagger_boundaries key, "
                        "the boundaries staggered over S phases (default off; both: a row of each)")
    p.add_argument("--trace-dir", help="save a torch.profiler trace (Chrome JSON) of one update interval per "
                                       "compiled ZenFlow row here, after its measured steps")
    p.add_argument("--ds-zenflow-overlap", choices=["on", "off", "both"], default="on",
                   help="DeepSpeed ZenFlow overlap_step (default on, as in the DeepSpeed tutorial config)")
    p.add_argument("--select-strategy", default="auto", choices=["auto", "step", "epoch"])
    p.add_argument("--select-interval", type=_int_or_auto, default="auto")
    p.add_argument("--full-warm-up-rounds", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--systems", default=",".join(KINDS),
                   help=f"comma-separated subset of {','.join(KINDS)} (default all)")
    p.add_argument("--jobs", type=int,
                   help="systems run at once (default 1). >1 only without CUDA: each concurrent lane gets its own "
                        "disjoint share of the cores")
    p.add_argument("--threads", type=int,
                   help="intra-op threads per system (default: the number of cores of its share)")
    p.add_argument("--system-timeout", type=float,
                   help="seconds before a system is killed and recorded as timed out (default 1800; --smoke: 90)")
    p.add_argument("--time-budget", type=float,
                   help="seconds for all systems together: a system is not started after it is spent and a "
                        "running one is stopped at it (default 0 = none; --smoke: 150)")
    p.add_argument("--build-deepspeed-ops", action="store_true",
                   help="JIT-build DeepSpeed's cpu_adam (and on CPU shm_comm) op once, then exit; --smoke never "
                        "builds them (a system whose op is not built fails fast with that reason)")
    p.add_argument("--out", default="bench_offload.json", help="JSON results (default bench_offload.json)")
    p.add_argument("--simulated-device", action="store_true",
                   help="no GPU: ZenFlow's schedule and fused AdamW's on a simulated device, the host's work real "
                        "(benchmarks/simulated_device.py: the scaled H100 regime)")
    p.add_argument("--sim-time-scale", type=float, default=10.0,
                   help="--simulated-device: simulated seconds per second here (default 10)")
    p.add_argument("--sim-reselect", nargs="+", choices=["none", "wait", "incoming"], default=["none"],
                   help="--simulated-device: rows with a reselection every --select-interval steps (an int; "
                        "default: the project's defaults' select_interval), made as overlap_reselect 'wait' or "
                        "'incoming' makes it (default none: no reselection)")
    p.add_argument("--sim-churn", type=float, default=0.25,
                   help="--simulated-device: share of the selected columns a reselection moves (default 0.25)")
    p.add_argument("--sim-steps", type=int, default=24, help="--simulated-device: measured steps (default 24)")
    p.add_argument("--chart", help="PNG chart path (default: --out with .png)")
    p.add_argument("--log-dir", help="per-system stdout/stderr logs (default: a temporary directory)")
    return p


def resolve_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.settings = parse_settings(args.zenflow_settings)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    args.kinds = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown --systems {unknown}: expected a subset of {list(KINDS)}")
    if args.steps < 1 or args.warmup < 0 or args.jobs < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--steps must be >= 1, --warmup >= 0, --jobs >= 1, --threads >= 1")
    args.requested_steps, args.requested_warmup = args.steps, args.warmup
    args.warmup, args.steps = whole_intervals(args)
    if args.chart is None:
        args.chart = str(Path(args.out).with_suffix(".png"))
    return args


# --------------------------------------------------------------------------------------------- the plan
def _overlaps(choice: str) -> list[bool]:
    return {"both": [True, False], "on": [True], "off": [False]}[choice]


def _staggers(choice: str) -> tuple[bool, ...]:
    return {"off": (False,), "on": (True,), "both": (False, True)}[choice]


def _fmt_interval(interval) -> str:
    return str(interval)


def whole_intervals(args) -> tuple[int, int]:
    """(warmup, steps) so that the measured window is whole update intervals for every int interval planned:
    it opens right after an update boundary (warm-up ends on one) and closes on one. Only grows the counts."""
    period = 1
    if any(k in args.kinds for k in ("zenflow", "ds_zenflow")):
        for _, interval in args.settings:
            if isinstance(interval, int):
                period = math.lcm(period, interval)
    first = args.full_warm_up_rounds  # boundaries fall after steps W + S - 1, W + 2S - 1, ...
    warmup = max(args.warmup, first)
    warmup = first + math.ceil((warmup - first) / period) * period
    steps = math.ceil(args.steps / period) * period
    return warmup, steps


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_shares(cores: list[int], jobs: int) -> list[list[int]]:
    """Disjoint, contiguous, near-equal shares of `cores`, one per concurrent lane."""
    if jobs > len(cores):
        raise ValueError(f"--jobs {jobs} needs at least {jobs} cores (one per concurrent system); this process may "
                         f"use {len(cores)}: {cores}. Use --jobs {len(cores)} or fewer.")
    size, extra = divmod(len(cores), jobs)
    shares, start = [], 0
    for lane in range(jobs):
        end = start + size + (lane < extra)
        shares.append(cores[start:end])
        start = end
    return shares


def plan_systems(args) -> list[dict]:
    """One spec per row, in run order: the speed limit first (it also warms Inductor's kernel cache for the
    compiled ZenFlow runs), then compiled ZenFlow, then the DeepSpeed systems."""
    common = dict(model=args.model, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
                  lr=args.lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=args.weight_decay, seed=0,
                  require_built_ds_ops=bool(args.smoke), cores=None, threads=args.threads)

    def zenflow_block(ratio, interval, overlap, reselect="wait", accumulate_on="auto", stagger=False):
        return dict(topk_ratio=ratio, update_interval=interval, overlap_step=overlap,
                    select_strategy=args.select_strategy, select_interval=args.select_interval,
                    full_warm_up_rounds=args.full_warm_up_rounds, overlap_reselect=reselect,
                    accumulate_on=accumulate_on, landing_lag=args.landing_lag if overlap else None,
                    stagger_boundaries=stagger)

    reselects = ["wait", "incoming"] if args.overlap_reselect == "both" else [args.overlap_reselect]
    placements = ["device", "host"] if args.accumulate_on == "both" else [args.accumulate_on]

    specs = []
    if "adamw" in args.kinds:
        specs.append(dict(common, kind="adamw", name="adamw (speed limit)", lane="compile"))
    if "zenflow" in args.kinds:
        for ratio, interval in args.settings:
            staggers = _staggers(args.stagger) if isinstance(interval, int) else (False,)
            for overlap, stagger in ((o, g) for o in _overlaps(args.overlap) for g in staggers):
                for reselect in reselects if overlap else ["wait"]:
                    for placement in placements:
                        specs.append(dict(common, kind="zenflow", lane="compile",
                                          name=f"zenflow r={ratio:g} S={_fmt_interval(interval)} "
                                               f"{'overlap' if overlap else 'sync'}"
                                               f"{f' lag {args.landing_lag}' if overlap and args.landing_lag else ''}"
                                               f"{' staggered' if stagger else ''}"
                                               f"{' reselect in flight' if reselect == 'incoming' else ''}"
                                               f"{'' if placement == 'auto' else f' sum on {placement}'}",
                                          zenflow=zenflow_block(ratio, interval, overlap, reselect, placement,
                                                                stagger)))
    if args.trace_dir:
        for spec in specs:
            if spec["kind"] == "zenflow":
                spec["trace"] = str(Path(args.trace_dir).resolve() / f"{file_stem(spec['name'])}.trace.json")
    if "ds_offload" in args.kinds:
        specs.append(dict(common, kind="ds_offload", name="ds zero-offload", lane="deepspeed"))
    if "ds_zenflow" in args.kinds:
        for ratio, interval in args.settings:
            for overlap in _overlaps(args.ds_zenflow_overlap):
                specs.append(dict(common, kind="ds_zenflow", lane="deepspeed",
                                  name=f"ds zenflow r={ratio:g} S={_fmt_interval(interval)} "
                                       f"{'overlap' if overlap else 'sync'}",
                                  zenflow=zenflow_block(ratio, interval, overlap)))
    return specs


# ----------------------------------------------------------------------------------------------- running
def _tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


def _last_error_line(log_text: str) -> str:
    lines = [l.strip() for l in log_text.splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else ""


def file_stem(name: str) -> str:
    """A row's name as a file name."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_system(spec: dict, log_dir: Path, timeout: float, limit: str = "--system-timeout") -> dict:
    """Run one system in a fresh process; always return a row (status ok or failed, with a reason)."""
    safe = file_stem(spec["name"])
    log_path = log_dir / f"{safe}.log"
    result_path = log_dir / f"{safe}.result.json"
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, str(SYSTEMS_SCRIPT), "--spec", json.dumps(spec), "--result", str(result_path)]
    result_path.unlink(missing_ok=True)  # never read a previous run's result
    started = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        # Own session: the system's helpers (compile workers, DeepSpeed ZenFlow's optimizer process) are
        # killed with it, by process group, whatever state it ends in.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    wall = time.perf_counter() - started
    row = dict(name=spec["name"], kind=spec["kind"], settings=spec.get("zenflow"), log=str(log_path),
               threads=spec.get("threads"), cores=spec.get("cores"))
    if result_path.exists():
        try:
            row.update(json.loads(result_path.read_text()))
        except json.JSONDecodeError as error:
            row.update(status="failed", error=f"unreadable result file: {error}")
    elif timed_out:
        hint = ""
        if spec["kind"].startswith("ds_"):
            hint = (" (if DeepSpeed's ops were not built yet: it JIT-builds cpu_adam, and on CPU shm_comm, on "
                    "first use, minutes on a small machine; --build-deepspeed-ops builds them once)")
        elif spec["kind"] in ("adamw", "zenflow"):
            hint = " (a cold Inductor cache makes the first compile slow; a rerun uses the warm cache)"
        row.update(status="failed", error=f"timed out after {timeout:.0f} s ({limit}){hint}; last log line: "
                                          f"{_last_error_line(_tail(log_path)) or '-'}")
    else:
        row.update(status="failed", error=f"process exited with code {returncode} before writing a result: "
                                          f"{_last_error_line(_tail(log_path)) or '(no output)'}")
    row["wall_s"] = wall
    return row


def run_all(specs: list[dict], args, log_dir: Path, progress) -> list[dict]:
    """Run the specs; with jobs > 1, lanes (compiled systems, DeepSpeed systems) run concurrently, each lane
    in order (so the compiled systems still share one warm Inductor cache). With a time budget, a system is
    not started once it is spent and a running one gets at most what is left."""
    results: dict[int, dict] = {}
    deadline = time.perf_counter() + args.time_budget if args.time_budget and args.time_budget > 0 else None

    def run_one(i: int) -> dict:
        timeout, limit = args.system_timeout, "--system-timeout"
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left < 5.0:
                return dict(name=specs[i]["name"], kind=specs[i]["kind"], settings=specs[i].get("zenflow"),
                            status="failed", wall_s=0.0,
                            error=f"not run: the --time-budget of {args.time_budget:.0f} s was spent")
            if left < timeout:
                timeout, limit = left, "what was left of --time-budget"
        return run_system(specs[i], log_dir, timeout, limit)

    if args.jobs <= 1:
        for i in range(len(specs)):
            results[i] = run_one(i)
            progress(results[i])
        return [results[i] for i in range(len(specs))]

    lock = threading.Lock()

    def work(indices):
        for i in indices:
            row = run_one(i)
            with lock:
                results[i] = row
                progress(row)

    groups = lane_groups(specs, args.jobs)
    threads = [threading.Thread(target=work, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(specs))]


def lane_groups(specs: list[dict], jobs: int) -> list[list[int]]:
    """Spec indices per concurrent lane: lanes (compiled systems, DeepSpeed systems) stay in order (the compiled
    systems share one warm Inductor cache); at most `jobs` groups, extra lanes appended to the shortest."""
    lanes: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        lanes.setdefault(spec["lane"], []).append(i)
    groups = [[] for _ in range(min(jobs, len(lanes)))]
    for queue in sorted(lanes.values(), key=len, reverse=True):
        min(groups, key=len).extend(queue)
    return groups


def assign_cores(specs: list[dict], args, cores: list[int]) -> None:
    """Pin every system: one at a time, each gets every core; with --jobs N, each concurrent lane gets its own
    disjoint share. Threads per system: --threads, else the size of its share."""
    groups = lane_groups(specs, args.jobs) if args.jobs > 1 else [list(range(len(specs)))]
    for group, share in zip(groups, core_shares(cores, len(groups))):
        for i in group:
            specs[i]["cores"] = share
            specs[i]["threads"] = args.threads or len(share)


# ------------------------------------------------------------------------------------------ environment
def environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for package in ("torch", "triton", "deepspeed", "transformers", "zenflow-compile"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        # Asked in a throwaway process, so this driver holds no CUDA context while the systems run.
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                               capture_output=True, text=True, timeout=120)
        device = probe.stdout.strip() or "CUDA device (name unavailable)"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores), no CUDA"
    return dict(device=device, cuda=cuda, cuda_version=torch.version.cuda, python=platform.python_version(),
                versions=versions, hostname=platform.node(), cpu_count=os.cpu_count(),
                usable_cores=available_cores())


# ------------------------------------------------------------------------------------------ analysis
def _num(row: dict, key: str) -> Optional[float]:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def analyse(rows: list[dict], on_gpu: bool) -> None:
    """Ratios to the speed limit and the design targets, per ZenFlow row (in place). The targets are GPU
    targets: on a CPU run their values are still computed, but not judged (passed is None, judged False)."""
    limit = next((r for r in rows if r["kind"] == "adamw" and r["status"] == "ok"), None)
    offload = next((r for r in rows if r["kind"] == "ds_offload" and r["status"] == "ok"), None)
    for row in rows:
        for key in ("median_step_s", "mean_step_s", "stall_fraction", "peak_gpu_mem_gb", "traffic_multiple",
                    "cpu_update_s_per_step", "cpu_update_steps"):
            row.setdefault(key, None)
        row.setdefault("notes", {})
        if row["status"] != "ok" or limit is None:
            row["ratio_to_speed_limit"] = row["ratio_to_speed_limit_mean"] = None
            if row["status"] == "ok":
                row["notes"]["ratio_to_speed_limit"] = "the speed-limit (adamw) row did not run"
        else:
            row["ratio_to_speed_limit"] = row["median_step_s"] / limit["median_step_s"]
            row["ratio_to_speed_limit_mean"] = row["mean_step_s"] / limit["mean_step_s"]
        if row["kind"] != "zenflow":
            continue
        row["targets"] = targets = {}
        ok = row["status"] == "ok"

        def check(name, value, passed, detail):
            if not on_gpu:
                passed, detail = None, f"not judged: CPU run (a GPU target). {detail}"
            targets[name] = dict(value=value, passed=passed, detail=detail, judged=on_gpu)

        settings = row.get("settings") or {}
        # Step-time targets are judged on the MEAN step time: it amortises the update-boundary steps, which
        # a median of mostly non-boundary steps would hide.
        ratio = row.get("ratio_to_speed_limit_mean") if ok else None
        check("within_1.25x_of_adamw", ratio, None if ratio is None else ratio <= TARGET_RATIO_TO_ADAMW,
              "mean step / adamw mean step <= 1.25" if limit else "adamw row missing or failed")
        speedup = offload["mean_step_s"] / row["mean_step_s"] if ok and offload else None
        check(">=3x_faster_than_zero_offload", speedup,
              None if speedup is None else speedup >= TARGET_SPEEDUP_OVER_ZERO_OFFLOAD,
              "zero-offload mean step / zenflow mean step >= 3" if offload else "ds zero-offload row missing or failed")
        peers = [r for r in rows if r["kind"] == "ds_zenflow" and r["status"] == "ok"
                 and (r.get("settings") or {}).get("topk_ratio") == settings.get("topk_ratio")
                 and (r.get("settings") or {}).get("update_interval") == settings.get("update_interval")]
        peer = min(peers, key=lambda r: r["mean_step_s"]) if peers else None
        faster = peer["mean_step_s"] / row["mean_step_s"] if ok and peer else None
        check("faster_than_ds_zenflow", faster, None if faster is None else faster > 1.0,
              f"vs {peer['name']}: its mean step / ours > 1" if peer
              else "no DeepSpeed ZenFlow row with the same (topk_ratio, update_interval) ran")
        stall = row.get("stall_fraction") if ok else None
        check("stall_below_5pct", stall, None if stall is None else stall < TARGET_STALL_FRACTION,
              "stats()['stall_seconds'] / measured time < 0.05")
        interval = settings.get("update_interval")
        if isinstance(interval, int):
            bound = 1.0 + 1.0 / interval
            traffic = row.get("traffic_steady_multiple") if ok else None
            detail = f"steady-state bytes per step / model bytes <= 1 + 1/{interval} = {bound:.3f}"
        else:
            eff = row.get("effective_update_interval") if ok else None
            bound = 1.0 + 1.0 / eff if eff else None
            traffic = row.get("traffic_multiple") if ok else None
            detail = (f"measured bytes per step / model bytes <= 1 + 1/(measured interval {eff:.2f})" if eff
                      else "no update boundary in the measured window")
        check("traffic_within_bound", traffic,
              None if traffic is None or bound is None else traffic <= bound + 1e-9, detail)


# ------------------------------------------------------------------------------------------- reporting
def _f(value, spec: str, missing: str = "-") -> str:
    if value is None:
        return missing
    return format(value, spec)


def _ms(value) -> str:
    return _f(None if value is None else value * 1e3, ".1f")


def _analytic(row: dict) -> bool:
    return row.get("traffic_multiple") is not None and str(row.get("traffic_method", "")).startswith("analytic")


def _threads(row: dict) -> str:
    """'2@0-1': intra-op threads @ the cores the system was pinned to."""
    cores = row.get("cores") or []
    if not cores:
        return _f(row.get("threads"), "d")
    span = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1 \
        else ",".join(map(str, cores))
    return f"{_f(row.get('threads'), 'd')}@{span}"


def format_table(rows: list[dict], on_gpu: bool = True) -> str:
    header = ["system", "status", "threads", "median ms", "mean ms", "x limit", "stall %", "peak GB", "traffic x",
              "cpu upd ms/step", "upd steps"]
    lines = []
    for r in rows:
        ok = r["status"] == "ok"
        lines.append([
            r["name"], "ok" if ok else "FAILED", _threads(r),
            _ms(r.get("median_step_s")), _ms(r.get("mean_step_s")), _f(r.get("ratio_to_speed_limit"), ".2f"),
            _f(None if r.get("stall_fraction") is None else 100 * r["stall_fraction"], ".1f"),
            _f(r.get("peak_gpu_mem_gb"), ".2f"),
            _f(r.get("traffic_multiple"), ".3f") + ("a" if _analytic(r) else ""),
            _ms(r.get("cpu_update_s_per_step")), _f(r.get("cpu_update_steps"), ".1f"),
        ])
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for l in lines:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(l, widths))))
    failures = [r for r in rows if r["status"] != "ok"]
    notes = ["x limit: median step / speed-limit median step.  mean: whole measured window (incl. the final "
             "in-flight CPU update) / steps.  traffic x: host<->device bytes per step / model bytes ('a' = "
             "analytic, else measured).  threads: intra-op threads @ pinned cores.",
             "stall %: GPU idle share of step time; '-' = not applicable or not observable (see the JSON notes).",
             "upd steps: an overlapped CPU update's length in training steps (opt.stats()['cpu_update_steps']); "
             "a landing_lag at least this long never waits for it."]
    for r in failures:
        notes.append(f"FAILED {r['name']}: {r.get('error')}")
    title = [] if on_gpu else ["CPU figures (no GPU): every time below is a CPU measurement, not a GPU result.", ""]
    return "\n".join(title + out + [""] + notes)


def format_targets(rows: list[dict], on_gpu: bool = True) -> str:
    names = [("within_1.25x_of_adamw", "<=1.25x adamw", ".2f"),
             (">=3x_faster_than_zero_offload", ">=3x zero-off", ".2f"),
             ("faster_than_ds_zenflow", "> ds zenflow", ".2f"), ("stall_below_5pct", "stall<5%", ".3f"),
             ("traffic_within_bound", "traffic<=1+1/S", ".3f")]
    zen = [r for r in rows if r["kind"] == "zenflow"]
    if not zen:
        return "targets: no compiled ZenFlow rows"
    if not on_gpu:
        return ("Targets: not judged. They are GPU targets (<=1.25x adamw, >=3x ZeRO-Offload, faster than DeepSpeed "
                "ZenFlow, stall < 5%, traffic <= 1 + 1/S) and this run had no GPU; the CPU values are in the JSON "
                "(targets.*.value, judged: false).")
    width = max(len(r["name"]) for r in zen)
    lines = ["Targets (step-time targets on mean step time, values: ratio / speed-up / fraction / multiple):",
             "  " + "system".ljust(width) + "".join(f"  {label:>18}" for _, label, _ in names)]
    for r in zen:
        cells = []
        for key, _, spec in names:
            t = r.get("targets", {}).get(key, {})
            verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t.get("passed")]
            cells.append(f"{verdict} ({_f(t.get('value'), spec)})")
        lines.append("  " + r["name"].ljust(width) + "".join(f"  {c:>18}" for c in cells))
    return "\n".join(lines)


def write_chart(rows: list[dict], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"chart: skipped ({path} not written): matplotlib is not installed "
              "(pip install -r benchmarks/requirements.txt)")
        return None
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        print("chart: skipped, no system ran")
        return None
    colors = {"adamw": "#4c72b0", "zenflow": "#55a868", "ds_offload": "#c44e52", "ds_zenflow": "#8172b2"}
    names = [r["name"] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, max(3.5, 0.45 * len(ok) + 1.5)), sharey=True)
    panels = [("median step (ms)", [1e3 * r["median_step_s"] for r in ok]),
              ("stall fraction (%)", [100 * r["stall_fraction"] if r.get("stall_fraction") is not None else 0.0
                                      for r in ok]),
              ("peak GPU memory (GB)", [r["peak_gpu_mem_gb"] or 0.0 for r in ok])]
    if all(r.get("peak_gpu_mem_gb") is None for r in ok):  # no GPU: host memory is the interesting one
        panels[2] = ("peak host RSS (GB, no GPU)", [r.get("peak_host_rss_gb") or 0.0 for r in ok])
    for ax, (label, values) in zip(axes, panels):
        ax.barh(range(len(ok)), values, color=[colors[r["kind"]] for r in ok])
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    for i, r in enumerate(ok):
        if r.get("ratio_to_speed_limit") is not None:
            axes[0].text(1e3 * r["median_step_s"], i, f" {r['ratio_to_speed_limit']:.2f}x", va="center", fontsize=8)
        if r.get("stall_fraction") is None:
            axes[1].text(0, i, " n/a", va="center", fontsize=8)
        if r.get("peak_gpu_mem_gb") is None and not panels[2][0].startswith("peak host"):
            axes[2].text(0, i, " n/a", va="center", fontsize=8)
    axes[0].set_yticks(range(len(ok)))
    axes[0].set_yticklabels(names)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ main
def build_ds_ops() -> int:
    print("JIT-building DeepSpeed's ops for the DeepSpeed systems (minutes; cached in ~/.cache/torch_extensions)")
    sys.stdout.flush()
    return subprocess.run([sys.executable, str(SYSTEMS_SCRIPT), "--build-deepspeed-ops"]).returncode


def run_simulated(args) -> int:
    sys.path.insert(0, str(HERE))
    import simulated_device

    from zenflow_compile import ZenFlowConfig

    regime = simulated_device.Regime(time_scale=args.sim_time_scale, steps=args.sim_steps,
                                     landing_lag=args.landing_lag, selection_churn=args.sim_churn,
                                     select_interval=(args.select_interval if isinstance(args.select_interval, int)
                                                      else ZenFlowConfig().select_interval))
    placements = ("device", "host") if args.accumulate_on in ("both", "auto") else (args.accumulate_on,)
    print(f"bench_offload --simulated-device: the H100 regime (1.1B bf16, fused AdamW step {regime.step_ms:g} ms) "
          f"at 1/{regime.time_scale:g} time, --zenflow-settings {args.zenflow_settings}; host work real")
    sys.stdout.flush()
    reselects = tuple(None if mode == "none" else mode for mode in args.sim_reselect)
    report = simulated_device.run(regime, placements, [(r, S) for r, S in args.settings if isinstance(S, int)],
                                  reselects, _staggers(args.stagger))
    report.update(environment=environment(), simulated_device=True)
    print(simulated_device.format_rows(report))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"JSON: {args.out}")
    return 0


def main(argv=None) -> int:
    args = resolve_args(argv)
    if args.build_deepspeed_ops:
        return build_ds_ops()
    if args.simulated_device:
        return run_simulated(args)
    started = time.perf_counter()
    env = environment()
    if env["cuda"] and args.jobs > 1:
        print(f"--jobs {args.jobs} would share one GPU between systems and distort step times and peak memory; "
              "using --jobs 1")
        args.jobs = 1
    specs = plan_systems(args)
    if not specs:
        print("nothing to run (--systems selected no system)")
        return 2
    try:
        assign_cores(specs, args, available_cores())
    except ValueError as error:
        print(error)
        return 2
    v = env["versions"]
    sys.path.insert(0, str(HERE))
    from model import analytic_num_params

    num_params = analytic_num_params(args.model)
    title = (f"model {args.model} ({num_params / 1e6:.1f}M params), batch {args.batch}, seq {args.seq}, "
             f"{args.steps} steps (+{args.warmup} warm-up) on {env['device']}")
    print(f"bench_offload: {title}")
    print(f"  torch {v['torch']} (CUDA {env['cuda_version']}), triton {v['triton']}, deepspeed {v['deepspeed']}, "
          f"transformers {v['transformers']}, python {env['python']}")
    shares = sorted({(tuple(s["cores"]), s["threads"]) for s in specs})
    print("  pinned: " + "; ".join(f"{t} threads on cores {list(c)}" for c, t in shares)
          + (f"  (measured window: whole update intervals; warm-up {args.requested_warmup} -> {args.warmup}, "
             f"steps {args.requested_steps} -> {args.steps})"
             if (args.warmup, args.steps) != (args.requested_warmup, args.requested_steps) else ""))
    print(f"  {len(specs)} systems, {args.jobs} at a time, timeout {args.system_timeout:.0f} s each"
          + (f", {args.time_budget:.0f} s in all" if args.time_budget else "")
          + ("  [smoke: checks the harness; timings are not meaningful]" if args.smoke else ""))
    sys.stdout.flush()

    tmp = None
    if args.log_dir:
        log_dir = Path(args.log_dir).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_offload_")
        log_dir = Path(tmp.name)

    def progress(row):
        state = (f"ok  median {1e3 * row['median_step_s']:.1f} ms" if row["status"] == "ok"
                 else f"FAILED: {str(row.get('error'))[:160]}")
        print(f"  [{row['wall_s']:6.1f} s] {row['name']}: {state}")
        sys.stdout.flush()

    rows = run_all(specs, args, log_dir, progress)
    on_gpu = bool(env["cuda"])
    analyse(rows, on_gpu)
    if tmp is not None:  # logs go away with the temporary directory: keep the failing ones' tails in the JSON
        for row in rows:
            log = row.pop("log", None)
            if row["status"] != "ok" and log:
                row["log_tail"] = _tail(Path(log), 3000)
        tmp.cleanup()

    total = time.perf_counter() - started
    print()
    print(format_table(rows, on_gpu))
    print()
    print(format_targets(rows, on_gpu))
    if args.smoke:
        print("  (smoke run: timings and verdicts only show that the harness measures; they are not results)")
    report = dict(
        benchmark="bench_offload", title=title, smoke=args.smoke,
        config=dict(model=args.model, model_num_params=num_params, batch=args.batch, seq=args.seq,
                    steps=args.steps, warmup=args.warmup,
                    zenflow_settings=[dict(topk_ratio=r, update_interval=s) for r, s in args.settings],
                    overlap=args.overlap, overlap_reselect=args.overlap_reselect, landing_lag=args.landing_lag,
                    stagger=args.stagger,
                    ds_zenflow_overlap=args.ds_zenflow_overlap,
                    select_strategy=args.select_strategy, select_interval=args.select_interval,
                    full_warm_up_rounds=args.full_warm_up_rounds, lr=args.lr, weight_decay=args.weight_decay,
                    jobs=args.jobs, threads=args.threads, requested_steps=args.requested_steps,
                    requested_warmup=args.requested_warmup, system_timeout_s=args.system_timeout,
                    time_budget_s=args.time_budget),
        fairness=dict(
            one_at_a_time=args.jobs == 1,
            pinning="each system process pinned (sched_setaffinity before torch loads) to its cores, with "
                    "OMP/MKL and torch intra-op threads set; per row: threads, cores",
            baseline_optimizer="torch.optim.AdamW(fused=True) on CUDA and CPU",
            measured_window="whole update intervals: warm-up ends on an update boundary, steps are a multiple of "
                            "every int update_interval, in-flight CPU work of the warm-up is finished before the "
                            "window and the last update is applied inside it (mean = window / steps)",
            verdict="PASS/FAIL only on a GPU" + ("" if on_gpu else "; this run: CPU, not judged")),
        environment=env, device=env["device"], versions=env["versions"],
        judged=on_gpu,
        targets=dict(ratio_to_adamw_max=TARGET_RATIO_TO_ADAMW,
                     speedup_over_zero_offload_min=TARGET_SPEEDUP_OVER_ZERO_OFFLOAD,
                     stall_fraction_max=TARGET_STALL_FRACTION,
                     traffic_multiple_max="1 + 1/update_interval",
                     judged_on="mean step time (amortises update-boundary steps)"),
        systems=rows, total_wall_s=total)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nJSON: {args.out}")
    chart = write_chart(rows, args.chart, f"bench_offload{'' if on_gpu else ' (CPU figures)'}: {title}")
    if chart:
        print(f"chart: {chart}")
    print(f"total: {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
