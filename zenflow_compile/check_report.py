"""The report of `python -m zenflow_compile.check`: the figures read from the benchmarks' JSON, the targets of
benchmarks/bench_offload.py, and zenflow_check.md / zenflow_check.json written from the parts' results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

NO_GPU_STATEMENT = ("No GPU: torch sees no CUDA device on this machine. This is the CPU part only (the benchmarks' "
                    "smoke runs, which show that the pipeline runs, not its speed; the suite on the emulated device "
                    "with --emulated-suite); the GPU parts are marked \"not run: no GPU\" and no performance "
                    "target is judged.")


# ---------------------------------------------------------------------------------------- the benchmarks
def read_bench_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_bench_module(checkout: Path) -> ModuleType:
    """benchmarks/bench_offload.py, for its TARGET_* constants (the benchmark and this report share them)."""
    spec = importlib.util.spec_from_file_location("bench_offload", checkout / "benchmarks" / "bench_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def performance_targets(bench: ModuleType) -> dict[str, Any]:
    return dict(ratio_to_fused_adamw_max=bench.TARGET_RATIO_TO_ADAMW,
                speedup_over_zero_offload_min=bench.TARGET_SPEEDUP_OVER_ZERO_OFFLOAD,
                stall_fraction_max=bench.TARGET_STALL_FRACTION,
                bytes_per_step_max="(1 + 1/update_interval) x model bytes",
                faster_than_deepspeed_zenflow=True, judged_on="mean step time")


def benchmark_figures(bench_json: Path) -> Optional[dict[str, Any]]:
    """Per system the figures the targets need, and per compiled ZenFlow row the benchmark's verdicts. A smoke
    run (on a CPU) gets no speed ratio and no target values: its 0.1M-parameter model shows that the pipeline
    runs, and a ratio of its step times would read as a speed result."""
    bench = read_bench_json(bench_json)
    if bench is None:
        return None
    smoke = bool(bench["smoke"])
    offload = next((r for r in bench["systems"] if r["kind"] == "ds_offload" and r["status"] == "ok"), None)
    systems, verdicts = [], []
    for row in bench["systems"]:
        ok = row["status"] == "ok"
        traffic, model_bytes = row.get("traffic_multiple"), row.get("model_bytes")
        speedup = None
        if ok and offload is not None and row["kind"] == "zenflow" and not smoke:
            speedup = offload["mean_step_s"] / row["mean_step_s"]
        systems.append(dict(
            system=row["name"], kind=row["kind"], status=row["status"], error=row.get("error"),
            mean_step_s=row.get("mean_step_s"), median_step_s=row.get("median_step_s"),
            ratio_to_fused_adamw=None if smoke else row.get("ratio_to_speed_limit_mean"),
            speedup_over_zero_offload=speedup,
            stall_fraction=row.get("stall_fraction"), peak_gpu_mem_gb=row.get("peak_gpu_mem_gb"),
            peak_host_rss_gb=row.get("peak_host_rss_gb"), traffic_multiple=traffic,
            bytes_per_step=traffic * model_bytes if traffic is not None and model_bytes else None))
        for target, verdict in (row.get("targets") or {}).items():
            if not verdict["judged"]:
                outcome = "not judged: no GPU"
            else:
                outcome = {True: "PASS", False: "FAIL", None: "n/a"}[verdict["passed"]]
            verdicts.append(dict(system=row["name"], target=target, value=None if smoke else verdict["value"],
                                 verdict=outcome, criterion=verdict["detail"]))
    return dict(title=bench["title"], device=bench["device"], smoke=bench["smoke"], judged=bench["judged"],
                json=str(bench_json), systems=systems, targets=verdicts)


def host_figures(host_json: Path) -> Optional[dict[str, Any]]:
    """Per placement (all cores, the worker share) the host's throughputs and bandwidth at the largest size."""
    host = read_bench_json(host_json)
    if host is None:
        return None
    places = []
    for place in host["places"]:
        rows = [r for r in host["results"] if r["place"] == place["name"] and r["status"] == "ok"]
        if not rows:
            continue
        row = max(rows, key=lambda r: r["num_params"])
        figures = row["rows"]
        places.append(dict(
            place=place["name"], threads=row["threads"], params=row["num_params"], grad_dtype=row["grad_dtype"],
            accumulate_gparams_per_s=figures["accumulate"]["gparams_per_s"],
            accumulate_fraction_of_bound=figures["accumulate"]["fraction_of_bound"],
            update_gparams_per_s=figures["update"]["gparams_per_s"],
            bandwidth_gbps=row["bandwidth"]["bound_gbps"]))
    return dict(json=str(host_json), smoke=host["smoke"], places=places)


# ------------------------------------------------------------------------------------------------ report
def fmt(value: Any, spec: str = ".3g", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value * scale if scale != 1.0 else value, spec)
    return str(value)


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |"


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = ["# zenflow_compile.check", ""]
    if not machine["gpu"]:
        lines += [f"**{NO_GPU_STATEMENT}**", ""]
    if report["passed"]:
        verdict = "PASS: every part that ran passed"
    else:
        verdict = "FAIL: " + ", ".join(f"{p['name']} ({p['status']})" for p in report["parts"]
                                       if p["status"] in ("failed", "timed out"))
    lines += [f"**{verdict}** ({report['total_s']:.0f} s of a {report['time_budget_s']:.0f} s budget)", "",
              "| machine | |", "| --- | --- |",
              f"| GPU | {machine['gpu_name'] or 'none'} |", f"| torch | {machine['torch']} |",
              f"| CUDA | {machine['cuda'] or 'none'} |", f"| triton | {machine['triton'] or 'not installed'} |",
              f"| deepspeed | {machine['deepspeed'] or 'not installed'} |", f"| python | {machine['python']} |",
              f"| platform | {machine['platform']}, {machine['cpu_count']} cores |", "",
              "## Parts", "",
              "| part | what | status | passed | failed | errors | skipped | seconds | limit s | reason |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for part in report["parts"]:
        counts = part["counts"] or {}
        ran = part["status"] != "not run"
        status = part["status"] if ran else f"not run: {part['reason']}"
        reason = part["reason"] if ran else ""
        seconds = fmt(part["duration_s"], ".1f") if ran else "-"
        lines.append(table_row([part["name"], part["title"], status, fmt(counts.get("passed"), "d"),
                                fmt(counts.get("failures"), "d"), fmt(counts.get("errors"), "d"),
                                fmt(counts.get("skipped"), "d"), seconds, fmt(part["limit_s"], ".0f"), reason]))
    lines += ["", "(bench counts systems, not tests.)", "", "## Benchmark", ""]
    bench = report["benchmark"]
    if bench is None:
        lines.append("Not run, or it wrote no JSON (see the bench part).")
    else:
        smoke = bench["smoke"]
        if smoke:
            lines += ["Smoke run: a 0.1M-parameter model on the CPU shows that every system's pipeline runs, not "
                      "how fast it is, so no speed ratio is reported (step times: the benchmark's JSON).", ""]
        elif not bench["judged"]:
            lines += ["CPU figures: they show that the harness measures; they are not GPU results.", ""]
        # (A smoke run's step times side by side would invite the same reading as their ratio: JSON only.)
        speed = [] if smoke else ["mean step ms", "x fused AdamW", "x faster than ZeRO-Offload"]
        header = ["system", "status", *speed, "stall %", "peak GPU GB", "peak host GB", "bytes/step MB",
                  "x model bytes"]
        lines += [f"{bench['title']}. Its JSON: `{bench['json']}`.", "", table_row(header),
                  table_row(["---", "---"] + ["---:"] * (len(header) - 2))]
        for row in bench["systems"]:
            status = "ok" if row["status"] == "ok" else f"FAILED: {str(row['error'])[:120]}"
            speed_cells = [] if smoke else [fmt(row["mean_step_s"], ".1f", 1e3),
                                            fmt(row["ratio_to_fused_adamw"], ".2f"),
                                            fmt(row["speedup_over_zero_offload"], ".2f")]
            cells = [row["system"], status, *speed_cells,
                     fmt(row["stall_fraction"], ".1f", 100),
                     fmt(row["peak_gpu_mem_gb"], ".2f"), fmt(row["peak_host_rss_gb"], ".2f"),
                     fmt(row["bytes_per_step"], ".1f", 1e-6), fmt(row["traffic_multiple"], ".3f")]
            lines.append(table_row(cells))
    lines += ["", "## Host", ""]
    host = report.get("host")
    if host is None:
        lines.append("Not run, or it wrote no JSON (see the host part).")
    else:
        if host["smoke"]:
            lines += ["Smoke sizes (caches, not memory): they show that the harness measures, not this host's "
                      "throughput.", ""]
        lines += ["benchmarks/bench_host.py: the runtime's host work on this machine's CPU (the offloaded share of "
                  "a model accumulates once per step; an update runs once per interval). Its JSON: "
                  f"`{host['json']}`.", "",
                  "| place | threads | params | accumulate Gparam/s | of bandwidth bound | update Gparam/s "
                  "| bandwidth GB/s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [table_row([p["place"], fmt(p["threads"], "d"), fmt(p["params"], ".3g"),
                             fmt(p["accumulate_gparams_per_s"], ".2f"), fmt(p["accumulate_fraction_of_bound"], ".2f"),
                             fmt(p["update_gparams_per_s"], ".2f"), fmt(p["bandwidth_gbps"], ".1f")])
                  for p in host["places"]]
    targets = report["targets"]
    lines += ["", "## Targets", "",
              f"From benchmarks/bench_offload.py, judged on {targets['judged_on']}, on a GPU only: mean step <= "
              f"{targets['ratio_to_fused_adamw_max']}x fused AdamW, >= {targets['speedup_over_zero_offload_min']}x "
              f"faster than ZeRO-Offload, stall fraction < {targets['stall_fraction_max']}, bytes per step <= "
              f"{targets['bytes_per_step_max']}, faster than DeepSpeed's ZenFlow.", ""]
    if bench is not None and bench["targets"] and not bench["smoke"]:
        lines += ["| system | target | value | verdict | criterion |", "| --- | --- | ---: | --- | --- |"]
        lines += [table_row([t["system"], t["target"], fmt(t["value"]), t["verdict"], t["criterion"]])
                  for t in bench["targets"]]
    elif bench is not None and bench["smoke"]:
        lines.append("Not judged: a smoke run measures no speed.")
    lines += ["", "## Commands", "", "Run from the checkout; logs and junit files: "
              f"`{report['files_dir']}`.", "", "```"]
    lines += [f"{part['command']}" for part in report["parts"] if part["command"]]
    lines += ["```", ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> str:
    """zenflow_check.json and zenflow_check.md in `out_dir`; the markdown, for the terminal too."""
    markdown = render_markdown(report)
    (out_dir / "zenflow_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "zenflow_check.md").write_text(markdown)
    return markdown
