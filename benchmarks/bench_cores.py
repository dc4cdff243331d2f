"""Core reservation: the training loop's speed while a CPU update runs, with and without
`pt_reserved_cores_perc`, and the update's own slowdown.

    python benchmarks/bench_cores.py --out cores.json                 # 50M-param update, both training loops
    python benchmarks/bench_cores.py --params 100M --seconds 4 --repeats 3
    python benchmarks/bench_cores.py --smoke --out smoke.json         # tiny, seconds: checks the harness

The CPU update is the runtime's real host work for one interval, looped in a real `CpuWorker` (the thread the
runtime runs it on): `--interval` accumulations + one boundary update (bench_host.HostWork: the runtime's slabs and
runtime.kernels.cpu_adamw_) over `--params` parameters (bf16 gradients, fp32 state). The training loop runs
on the main thread with the process's default torch threads, as a user's loop would:
  compute      forward + backward + fused AdamW of an MLP (1024 -> 4096 -> 1024, batch 64): all-thread matmuls
  host-bound   forward + backward + fused AdamW of 200 tiny Linear(8, 8) layers on 1 thread: Python and
               dispatch bound, like a GPU training thread launching kernels
Scenarios, per training loop:
  alone                      the training loop, nothing else running
  + update, no reservation   the worker unpinned, default thread count (pt_reserved_cores_perc=None: what
                             this runtime did before the reservation; DeepSpeed's 0 and 1 are the same)
  + update, reserved         the worker pinned to the cores left after the reserve (default 0.5), that many
                             threads; the training thread untouched (the runtime's behaviour)
  + update, reserved, training pinned   as above, and the training thread also confined to its reserved
                             cores with as many threads (what DeepSpeed does to its training process;
                             here the user's choice)
and the update alone on each placement, for its slowdown. Figures: median training step time and median
interval time over the measured window, medians over --repeats passes (scenarios interleaved per pass).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_host import HostWork, build_states, parse_size  # noqa: E402

from zenflow_compile.runtime import cpu_affinity  # noqa: E402
from zenflow_compile.runtime.worker import CpuWorker  # noqa: E402


# ------------------------------------------------------------------------------------------- training
class TrainingLoop:
    def __init__(self, kind: str, smoke: bool):
        torch.manual_seed(0)
        self.kind = kind
        if kind == "compute":
            width, hidden, batch = (64, 256, 8) if smoke else (1024, 4096, 64)
            self.model = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            self.x = torch.randn(batch, width)
        else:
            layers = 20 if smoke else 200
            self.model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(8, 8), nn.Tanh())])
            self.x = torch.randn(4, 8)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.threads = None  # host-bound: 1 thread; compute: the process default

    def step(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def run(self, seconds: float) -> list[float]:
        previous = torch.get_num_threads()
        if self.kind == "host-bound":
            torch.set_num_threads(1)
        try:
            for _ in range(3):
                self.step()
            times, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end:
                start = time.perf_counter()
                self.step()
                times.append(time.perf_counter() - start)
            return times
        finally:
            torch.set_num_threads(previous)


# -------------------------------------------------------------------------------------------- the update
class BackgroundUpdate:
    """The runtime's interval work looped on a CpuWorker until stopped; records each interval's time."""

    def __init__(self, work: HostWork, interval: int, worker: CpuWorker):
        self.work, self.interval, self.worker = work, interval, worker
        self._stop = threading.Event()
        self.times: list[float] = []
        self._future = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            for _ in range(self.interval):
                self.work.accumulate()
            self.work.update()
            self.times.append(time.perf_counter() - start)

    def start(self) -> None:
        self._stop.clear()
        self.times = []
        self._future = self.worker.submit(self._loop)
        while not self.times and not self._future.done():  # one full interval first: caches, thread team
            time.sleep(0.01)

    def stop(self) -> list[float]:
        self._stop.set()
        self._future.result()
        return self.times[1:]  # the first ran before the training window opened

    def alone(self, seconds: float) -> list[float]:
        self.start()
        time.sleep(seconds)
        return self.stop()


def placement_of(worker: CpuWorker) -> dict:
    cores, threads = worker.submit(lambda: (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                            else None, torch.get_num_threads())).result()
    return dict(cores=cores, threads=threads)


class PinnedTrainingThread:
    """Confine the calling (training) thread to the reserved cores, that many threads; restore on exit."""

    def __init__(self, cores):
        self.cores = list(cores)

    def __enter__(self):
        self.saved = (os.sched_getaffinity(0), torch.get_num_threads())
        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(len(self.cores))
        return self

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.saved[0])
        torch.set_num_threads(self.saved[1])


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--params", default="50M", help="parameters the CPU update covers (default 50M)")
    p.add_argument("--interval", type=int, default=4, help="accumulations per update (default 4)")
    p.add_argument("--reserve", type=float, default=0.5, help="pt_reserved_cores_perc (default 0.5)")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per scenario (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="passes over all scenarios (default 2)")
    p.add_argument("--loops", default="compute,host-bound", help="training loops (default compute,host-bound)")
    p.add_argument("--smoke", action="store_true", help="1M params, 0.3 s per scenario, 1 pass")
    p.add_argument("--out", default="bench_cores.json")
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows in logs as it happens
    if args.smoke:
        args.params, args.seconds, args.repeats = "1M", 0.3, 1
    loops = [k.strip() for k in args.loops.split(",") if k.strip()]
    if set(loops) - {"compute", "host-bound"} or args.repeats < 1:
        p.error("--loops is a subset of compute,host-bound; --repeats >= 1")
    num_params = parse_size(args.params)
    cores = list(cpu_affinity.available_cores())
    split = cpu_affinity.split_cores(cores, args.reserve)
    if not split.isolated:
        print(f"pt_reserved_cores_perc={args.reserve} on cores {cores} isolates nothing (the split is "
              f"{split}); nothing to measure")
        return 2
    started = time.perf_counter()
    work = HostWork(build_states(num_params, torch.bfloat16), args.interval)
    workers = {"no reservation": CpuWorker("update-unreserved", pt_reserved_cores_perc=None),
               "reserved": CpuWorker("update-reserved", pt_reserved_cores_perc=args.reserve)}
    placements = {name: placement_of(w) for name, w in workers.items()}
    updates = {name: BackgroundUpdate(work, args.interval, w) for name, w in workers.items()}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"
    print(f"bench_cores: {machine}; torch {torch.__version__}; update of {work.num_params / 1e6:.0f}M params "
          f"({args.interval} accumulations + 1 AdamW per interval); training threads {torch.get_num_threads()} "
          f"on cores {cores}; reserve {args.reserve:g}: training {list(split.training)}, workers "
          f"{list(split.workers)}; update placements: "
          + "; ".join(f"{k}: {v['threads']} threads on {v['cores']}" for k, v in placements.items()))

    trainings = {kind: TrainingLoop(kind, args.smoke) for kind in loops}
    samples: dict[str, list[float]] = {}

    def record(key: str, times: list[float]) -> None:
        if times:
            samples.setdefault(key, []).append(statistics.median(times))

    for _ in range(args.repeats):
        for name, update in updates.items():
            record(f"update alone | {name}", update.alone(args.seconds))
        for kind, loop in trainings.items():
            record(f"{kind} | alone", loop.run(args.seconds))
            for name, update in updates.items():
                update.start()
                record(f"{kind} | + update, {name}", loop.run(args.seconds))
                record(f"update | with {kind} | {name}", update.stop())
            with PinnedTrainingThread(split.training):
                record(f"{kind} | alone, training pinned", loop.run(args.seconds))
                update = updates["reserved"]
                update.start()
                record(f"{kind} | + update, reserved, training pinned", loop.run(args.seconds))
                record(f"update | with {kind} | reserved, training pinned", update.stop())
        gc.collect()
    for worker in workers.values():
        worker.shutdown()

    medians = {k: statistics.median(v) for k, v in samples.items()}
    rows = []
    for kind in loops:
        alone = medians[f"{kind} | alone"]
        for scenario in ("alone", "+ update, no reservation", "+ update, reserved", "alone, training pinned",
                         "+ update, reserved, training pinned"):
            key = f"{kind} | {scenario}"
            if key not in medians:
                continue
            row = dict(training=kind, scenario=scenario, step_ms=1e3 * medians[key],
                       step_vs_alone=medians[key] / alone, samples_ms=[1e3 * s for s in samples[key]])
            placement = scenario.split(", ", 1)[1] if scenario.startswith("+ update") else None
            if placement:
                upd_key = f"update | with {kind} | {placement}"
                base = medians[f"update alone | {'no reservation' if placement == 'no reservation' else 'reserved'}"]
                row.update(update_interval_ms=1e3 * medians[upd_key], update_slowdown=medians[upd_key] / base)
            rows.append(row)
    update_alone = {name: 1e3 * medians[f"update alone | {name}"] for name in updates if
                    f"update alone | {name}" in medians}
    print(format_rows(rows, update_alone, work.num_params))
    report = dict(benchmark="bench_cores", smoke=args.smoke, machine=machine, torch=torch.__version__,
                  cores=cores, reserve=args.reserve, split=dict(training=list(split.training),
                                                                workers=list(split.workers)),
                  update_params=work.num_params, interval=args.interval, update_placements=placements,
                  training_threads=torch.get_num_threads(), seconds=args.seconds, repeats=args.repeats,
                  update_alone_ms=update_alone, rows=rows, samples=samples,
                  total_wall_s=time.perf_counter() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"JSON: {args.out}  total: {report['total_wall_s']:.1f} s")
    return 0


def format_rows(rows: list[dict], update_alone: dict, num_params: int) -> str:
    lines = [f"update alone ({num_params / 1e6:.0f}M params, one interval): "
             + "; ".join(f"{k}: {v:.1f} ms" for k, v in update_alone.items()),
             f"{'training':<11} {'scenario':<38} {'step ms':>9} {'x alone':>8} {'update ms':>10} {'upd x alone':>12}"]
    for r in rows:
        upd = f"{r['update_interval_ms']:.1f}" if "update_interval_ms" in r else "-"
        slow = f"{r['update_slowdown']:.2f}" if "update_slowdown" in r else "-"
        lines.append(f"{r['training']:<11} {r['scenario']:<38} {r['step_ms']:9.2f} {r['step_vs_alone']:8.2f} "
                     f"{upd:>10} {slow:>12}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
