"""A simulated GPU: ZenFlow's step schedule against fused AdamW's, with the host's work done for real.

    python benchmarks/bench_offload.py --simulated-device --out sim.json     # the scaled H100 regime
    python benchmarks/bench_offload.py --simulated-device --sim-step-ms 124 --sim-time-scale 1 ...

What is simulated and what is real:
- the device is three streams of its own (compute, copies down, copies up), each a thread that runs its queue
  in order and spends each operation's time asleep: the step's forward and backward (the measured time of
  fused AdamW's step less its AdamW), each of the runtime's device kernels (its bytes over the device's
  memory bandwidth), each copy (its bytes over the link's bandwidth). Events order the streams as the runtime
  orders them. The training thread only queues work and waits where the runtime waits;
- the host's CPU AdamW is real: the runtime's own kernel (`kernels.cpu_adamw_`) on one of its CPU workers,
  over fp32 state sized so that this machine's throughput stands for the target host's (below); with the
  accumulation on the host, each step's accumulation is real too (`kernels.accumulate_scaled_many_`).

Scaling the H100 regime to this machine: one measured second here is `time_scale` simulated ones (every
device time is divided by it), and the host work is sized so that it takes, on this machine's worker core,
the time the target host would take: (1 - r) x params x (this core's measured throughput / the target host's
throughput) / time_scale parameters. The defaults are the H100 run's: a 1.1B bf16 model, fused AdamW's step
124 ms, r 0.05, S 4, 3.35 TB/s device memory, 25 GB/s each way over PCIe, a target host at 2.2 Gparam/s
of CPU AdamW (what a 1B update needs to fit 4 steps) and the H100 host's measured 1.8 Gparam/s of bf16
accumulation (8 threads).

The schedule, per step (ZenFlow, overlap on, as `runtime/engine.py` runs it):
1. compute: forward + backward; the training thread waits for it (the step's one host read: the norm);
2. compute: the selected columns' AdamW, and with device accumulation the unselected gradient's gather and
   add into the fp32 sums; with host accumulation, the gather and its copy down, then a worker adds it;
3. at a boundary (or, with a landing lag L, at the end of step b + L): the previous boundary's CPU update is
   waited for (counted as stall: device idle) and its columns, which the update worker queued for upload as
   it finished each slab, merged once they have landed;
   the interval's sums go down slab by slab (device accumulation) and the CPU AdamW of each slab starts on the
   update worker once its sums have landed.
4. a reselecting boundary (`Regime.overlap_reselect`: the first boundary at least `Regime.select_interval`
   steps after the last reselection, as select_strategy "step" makes it; churn c of the k selected columns
   change sides), as `ZenFlowRuntime._reselect` makes it on the training thread: the arriving columns' step
   is made before the update is launched: where the device sums, their host rows go up on the H2D stream and
   the step runs on the device; else their sums are read from the host's once the step's accumulation ended
   and their CPU AdamW runs (real work, c x r of the parameters). Then the moves (`columns.reselect_in_flight`),
   while the update runs on: where the host sums, the arriving columns' state (fp32 master and moments) up on
   the H2D stream, the compute stream waiting for it (where the device sums, already up); the departing
   columns' down on the D2H stream; the move's indices up in one small pinned copy (not modelled).
   "incoming" lets the update land as at any boundary (nothing waits for the departing columns until it has
   finished); "wait" lands it right after the moves, once the departing columns are down.
5. staggered boundaries (`Regime.stagger`, stagger_boundaries=True): steps 3 and 4 per phase, for 1/S of the
   unselected columns each (its own slabs): phase q's boundary at the steps with (t + 1 + q) % S == 0, one
   phase's each step, its update queued behind the previous phase's on the one update worker.
Fused AdamW: forward + backward + its AdamW, with the same one wait per step. Stall = the device's idle time
beyond fused AdamW's, measured on the simulated compute stream. The measured window is whole intervals in the
steady state: it starts and ends with a CPU update in flight (bench_offload's GPU rows instead start with none
and close with `opt.synchronize()`, which charges one update that nothing overlaps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from zenflow_compile.runtime import cpu_affinity, kernels
from zenflow_compile.runtime.worker import CpuWorker


@dataclasses.dataclass
class Regime:
    params: float = 1.1e9  # model parameters (matrices: all but a negligible share)
    param_bytes: int = 2  # bf16
    step_ms: float = 124.0  # fused AdamW's whole step, measured (the H100 run)
    topk_ratio: float = 0.05
    update_interval: int = 4
    landing_lag: Optional[int] = None  # a boundary's update lands at the end of step b + L (None: the next boundary)
    # Reselections every `select_interval` steps (at the first boundary that many steps after the last; the
    # project's defaults: 8), "wait" or "incoming" as the runtime makes them (None: no reselection), moving
    # `selection_churn` of each matrix's selected columns.
    overlap_reselect: Optional[str] = None
    select_interval: int = 8
    selection_churn: float = 0.25
    # stagger_boundaries: the matrices in S phases of equal size, phase q's boundaries at the steps with
    # (t + 1 + q) % S == 0, each phase with its own sums, CPU update (1/S of the whole, its slabs queued on the
    # one update worker), landing at b + L and reselections.
    stagger: bool = False
    device_bandwidth: float = 3.35e12  # bytes/s
    link_bandwidth: float = 25e9  # bytes/s, each way
    host_update_rate: float = 2.2e9  # target host: CPU AdamW, params/s
    host_accumulate_rate: float = 1.8e9  # the H100 host's bf16 accumulation, measured (8 threads), params/s
    slabs: int = 7  # the matrices' slabs (q, k, v, o, gate, up, down: every layer's stacked): the CPU update,
    # its sums' copy and its upload go slab by slab, as the runtime's do
    time_scale: float = 10.0  # simulated seconds per second here
    steps: int = 24  # measured steps (whole intervals)
    warmup: int = 4  # unmeasured steps first (whole intervals)

    def seconds(self, simulated_s: float) -> float:
        return simulated_s / self.time_scale

    @property
    def adamw_s(self) -> float:
        """Fused AdamW on the device: param, grad, and fp32 moments read and written (the baseline's share)."""
        return self.params * (2 * self.param_bytes + 2 * 8 + self.param_bytes) / self.device_bandwidth

    @property
    def forward_backward_s(self) -> float:
        return self.step_ms / 1e3 - self.adamw_s


class Stream:
    """A simulated device stream: one thread running its operations in order, each operation's time asleep."""

    def __init__(self, name: str, busy: Optional[list] = None):
        self.name = name
        self.busy = busy  # (start, end) of each operation, where kept
        self._queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sim-{name}")

    def run(self, seconds: float) -> None:
        def operation():
            start = time.perf_counter()
            time.sleep(seconds)
            if self.busy is not None:
                self.busy.append((start, time.perf_counter()))
        self._queue.submit(operation)

    def record(self) -> threading.Event:
        done = threading.Event()
        self._queue.submit(done.set)
        return done

    def wait_event(self, event: threading.Event) -> None:
        self._queue.submit(event.wait)

    def synchronize(self) -> None:
        self.record().wait()

    def close(self) -> None:
        self._queue.shutdown(wait=True)


def _idle_seconds(busy: list, start: float, end: float) -> float:
    return (end - start) - sum(min(b, end) - max(a, start) for a, b in busy if b > start and a < end)


def measure_host_rates(numel: int = 32_000_000, repeats: int = 5) -> tuple[float, float]:
    """This machine's CPU AdamW and bf16 accumulation throughput (params/s) on one thread, the runtime's
    kernels, over state the size of the work it stands for (past the caches; the median of `repeats`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = HostRows(numel)
        grad = torch.zeros(state.master.numel(), dtype=torch.bfloat16)
        state.update()  # (the kernels are compiled once, outside the timing)
        kernels.accumulate_scaled_many_([state.grad.view(-1)], [grad], 1.0)
        update, accumulate = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            state.update()
            update.append(time.perf_counter() - started)
            started = time.perf_counter()
            kernels.accumulate_scaled_many_([state.grad.view(-1)], [grad], 1.0)
            accumulate.append(time.perf_counter() - started)
        return state.master.numel() / statistics.median(update), state.master.numel() / statistics.median(accumulate)
    finally:
        torch.set_num_threads(previous)


class HostRows:
    """Host rows as the runtime keeps them (fp32 master, gradient sums and moments [rows, ROW], bf16 upload
    buffer, a count per row), for the runtime's CPU AdamW (`kernels.cpu_adamw_`)."""

    ROW = 1024

    def __init__(self, numel: int):
        rows = max(1, -(-numel // self.ROW))
        self.master, self.grad, self.exp_avg, self.exp_avg_sq = (torch.zeros(rows, self.ROW) for _ in range(4))
        self.weights = torch.zeros(rows, self.ROW, dtype=torch.bfloat16)
        self.counts = torch.zeros(rows)
        self.ones = torch.ones(rows)

    def update(self, start: int = 0, stop: Optional[int] = None) -> None:
        """The CPU AdamW of rows start:stop, with the cast for the upload."""
        part = slice(start, stop)
        kernels.cpu_adamw_(self.master[part], self.grad[part], self.exp_avg[part], self.exp_avg_sq[part],
                           self.counts[part], lr_scale=self.ones[part], divisor=self.ones[part],
                           weights=self.weights[part], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                           compiled=True)  # (each part stands for a slab of real size, which takes the compiled kernel)


class HostWork:
    """The host's real work, sized for the regime: the CPU AdamW of the unselected columns and (host
    accumulation) each step's add, on the runtime's CPU workers with one thread each."""

    def __init__(self, regime: Regime, update_rate_here: float, accumulate_rate_here: float):
        unselected = (1 - regime.topk_ratio) * regime.params / regime.time_scale
        self.update_numel = max(1, int(unselected * update_rate_here / regime.host_update_rate))
        self.accumulate_numel = max(1, int(unselected * accumulate_rate_here / regime.host_accumulate_rate))
        self.rows = HostRows(self.update_numel)
        self.acc = torch.zeros(self.accumulate_numel)
        self.grad = torch.zeros(self.accumulate_numel, dtype=torch.bfloat16)
        # The workers on the cores the runtime gives them (pt_reserved_cores_perc 0.5, its default), the
        # simulated device's threads on the training cores (`on_training_cores`).
        self.update_worker = CpuWorker("sim-update", pt_reserved_cores_perc=0.5)
        self.accumulate_worker = CpuWorker("sim-accumulate", pt_reserved_cores_perc=0.5)
        self.training_cores = cpu_affinity.worker_split(0.5).training
        for worker in (self.update_worker, self.accumulate_worker):
            worker.submit(lambda: torch.set_num_threads(1)).result()

    def cpu_adamw(self, part: int = 0, parts: int = 1) -> None:
        """The CPU AdamW of share `part` of `parts` (a slab's rows) of the host state."""
        size = -(-len(self.rows.counts) // parts)
        self.rows.update(part * size, (part + 1) * size)

    def cpu_adamw_share(self, share: float) -> None:
        """The CPU AdamW of `share` of the unselected columns' parameters (a reselection's arriving columns)."""
        self.rows.update(0, max(1, int(share * len(self.rows.counts))))

    def accumulate(self) -> None:
        kernels.accumulate_scaled_many_([self.acc], [self.grad], 1.0)

    def close(self) -> None:
        self.update_worker.shutdown()
        self.accumulate_worker.shutdown()


def _run_loop(regime: Regime, step: Callable[[int], None], compute: Stream, finish: Callable[[], None],
              on_window_start: Callable[[], None] = lambda: None) -> dict:
    """Warm-up, then the measured steps. The window runs from the end of one interval to the end of another, a
    CPU update in flight at each end as in the steady state (the update in flight at its start is waited for
    inside it, the one at its end after it): whole intervals, each paying for one update."""
    for i in range(regime.warmup):
        step(i)
    compute.synchronize()
    compute.busy.clear()
    on_window_start()
    start = time.perf_counter()
    for i in range(regime.warmup, regime.warmup + regime.steps):
        step(i)
    compute.synchronize()
    end = time.perf_counter()
    finish()
    compute.synchronize()
    return dict(window_s=end - start, idle_s=_idle_seconds(compute.busy, start, end), steps=regime.steps)


def simulate_adamw(regime: Regime) -> dict:
    compute = Stream("compute", busy=[])

    def step(i):
        compute.run(regime.seconds(regime.forward_backward_s))
        compute.synchronize()  # (the one host read a training loop makes: the loss)
        compute.run(regime.seconds(regime.adamw_s))

    try:
        result = _run_loop(regime, step, compute, finish=lambda: None)
    finally:
        compute.close()
    return dict(result, bytes_device_to_host_per_step=0.0)


@contextlib.contextmanager
def on_training_cores(cores):
    """The calling thread, and the simulated device's threads it starts, on the training cores (where the
    runtime leaves the device's launches), so that the workers' real work does not delay them."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def simulate_zenflow(regime: Regime, host: HostWork, accumulate_on: str) -> dict:
    """ZenFlow's schedule with the overlap on (see the module docstring)."""
    with on_training_cores(host.training_cores):
        return _simulate_zenflow(regime, host, accumulate_on)


def _simulate_zenflow(regime: Regime, host: HostWork, accumulate_on: str) -> dict:
    compute, down, up = Stream("compute", busy=[]), Stream("d2h"), Stream("h2d")
    r, P, S = regime.topk_ratio, regime.params, regime.update_interval
    unselected = (1 - r) * P
    bandwidth = regime.device_bandwidth
    device_update_s = r * P * (2 * regime.param_bytes + 2 * 8 + 4 + regime.param_bytes) / bandwidth
    gather_s = unselected * 2 * regime.param_bytes / bandwidth  # read the gradient, write its unselected part
    add_s = unselected * (regime.param_bytes + 2 * 4) / bandwidth  # read it, read and write the fp32 sums
    merge_s = unselected * 2 * regime.param_bytes / bandwidth
    sums_down_s = unselected * 4 / regime.link_bandwidth
    grads_down_s = unselected * regime.param_bytes / regime.link_bandwidth
    upload_s = unselected * regime.param_bytes / regime.link_bandwidth
    moved = regime.selection_churn * r * P  # parameters in the columns a reselection moves, each way
    move_s = moved * (3 * 4 + regime.param_bytes) / regime.link_bandwidth  # fp32 master, moments; the param
    phases = S if regime.stagger else 1
    pending = [dict(update=None, land_at=None) for _ in range(phases)]  # per phase: its update in flight
    landing_steps: list[int] = []  # the steps at whose end an update landed
    sent = dict(bytes=0.0)
    accumulations: list[Future] = []

    slabs = regime.slabs  # per phase
    # A reselecting boundary every this many steps: the first boundary select_interval steps after the last one.
    reselect_period = S * -(-regime.select_interval // S)
    # What one phase's boundary moves and computes (all of it unstaggered)
    sums_down_s, upload_s, merge_s, moved, move_s = (x / phases for x in (sums_down_s, upload_s, merge_s, moved,
                                                                          move_s))

    def apply_previous(i: Optional[int] = None, phase: int = 0):
        update = pending[phase]["update"]
        if update is None:
            return
        if i is not None:
            landing_steps.append(i)
        uploads = update.result()  # the documented wait: the device idles through it, measured on its stream
        for uploaded in uploads:  # (queued by the update worker slab by slab: landed by now, mostly)
            compute.wait_event(uploaded)
            compute.run(regime.seconds(merge_s / slabs))
        pending[phase]["update"] = pending[phase]["land_at"] = None

    def apply_all():
        for phase in range(phases):
            apply_previous(phase=phase)

    def land_due(i):
        for phase in range(phases):
            if i == pending[phase]["land_at"]:
                apply_previous(i, phase)

    def step(i):
        compute.run(regime.seconds(regime.forward_backward_s))
        compute.synchronize()  # the step's one host read (the global norm)
        compute.run(regime.seconds(device_update_s + gather_s))
        if accumulate_on == "device":
            compute.run(regime.seconds(add_s))
        else:
            if len(accumulations) >= 2:  # the step's pinned gradient buffer: the add of two steps ago read it
                accumulations[-2].result()
            down.wait_event(compute.record())
            down.run(regime.seconds(grads_down_s))
            landed = down.record()
            sent["bytes"] += unselected * regime.param_bytes

            def add(landed=landed):
                landed.wait()
                host.accumulate()

            accumulations.append(host.accumulate_worker.submit(add))
        phase = next((p for p in range(phases) if (i + 1 + p) % S == 0), None)
        if phase is None:
            land_due(i)
            return
        apply_previous(i, phase)
        reselect = regime.overlap_reselect if (i + 1 + phase) % reselect_period == 0 else None
        if accumulate_on == "device":  # each slab's sums down, in slab order
            down.wait_event(compute.record())
            ready = []
            for _ in range(slabs):
                down.run(regime.seconds(sums_down_s / slabs))
                ready.append(down.record().wait)
            sent["bytes"] += unselected * 4 / phases
        else:
            ready = [accumulations[-1].result] * slabs

        def cpu_update(ready=ready):
            uploads = []
            for part, landed in enumerate(ready):
                landed()
                host.cpu_adamw(phase * slabs + part, phases * slabs)
                up.run(regime.seconds(upload_s / slabs))  # the slab's new columns go up at once
                uploads.append(up.record())
            return uploads

        if reselect is not None:  # the arriving columns' share of the update, first
            if accumulate_on == "device":  # their rows up on the H2D stream, their AdamW on the device
                up.run(regime.seconds(moved * (3 * 4 + 4) / regime.link_bandwidth))
                compute.wait_event(up.record())
                compute.run(regime.seconds(moved * (4 * 4 + 3 * 4) / bandwidth))
            else:  # the host's sums, once the step's accumulation ended, and their CPU AdamW
                ready[-1]()
                host.cpu_adamw_share(regime.selection_churn * r / (1 - r) / phases)
        pending[phase]["update"] = host.update_worker.submit(cpu_update)
        pending[phase]["land_at"] = None if regime.landing_lag is None else i + regime.landing_lag
        if reselect is not None:  # the moves, while the update runs on; their indices up in one pinned copy
            if accumulate_on != "device":  # the arriving columns' state up, the compute stream waiting for it
                up.run(regime.seconds(move_s))
                compute.wait_event(up.record())
            down.wait_event(compute.record())  # the departing columns' state down, on the D2H stream
            down.run(regime.seconds(move_s))
            departed = down.record()
            if reselect == "wait":  # the update lands right after the moves, the departing rows settled first
                departed.wait()
                apply_previous(i, phase)
        land_due(i)  # (staggered: an earlier phase's update due at the end of this step)

    try:
        result = _run_loop(regime, step, compute, finish=apply_all,
                           on_window_start=lambda: sent.update(bytes=0.0))
    finally:
        for stream in (compute, down, up):
            stream.close()
    return dict(result, bytes_device_to_host_per_step=sent["bytes"] / regime.steps, landing_steps=landing_steps)


def run(regime: Regime, accumulate_on: tuple[str, ...] = ("device", "host"),
        settings: Optional[list[tuple[float, int]]] = None, reselects: tuple = (None,),
        staggers: tuple = (False,)) -> dict:
    """Rows for fused AdamW and ZenFlow (each (topk_ratio, update_interval) of `settings`, default the regime's,
    each reselection mode of `reselects` (None: none), each of `staggers`, each placement), side by side in one
    run, with the method."""
    update_rate, accumulate_rate = measure_host_rates()
    results, sizes = {"fused AdamW (simulated device)": simulate_adamw(regime)}, {}
    for ratio, interval in settings or [(regime.topk_ratio, regime.update_interval)]:
        # (warm-up and window in whole intervals: the window holds steps / S boundaries)
        setting = dataclasses.replace(regime, topk_ratio=ratio, update_interval=interval, warmup=interval,
                                      steps=interval * max(1, round(regime.steps / interval)))
        host = HostWork(setting, update_rate, accumulate_rate)
        try:
            for stagger, reselect, placement in ((g, m, p) for g in staggers for m in reselects
                                                 for p in accumulate_on):
                lag = "" if regime.landing_lag is None else f" lag {regime.landing_lag}"
                lag += " staggered" if stagger else ""
                moves = f" reselect {reselect} every {regime.select_interval} steps" if reselect else ""
                name = (f"zenflow r={ratio:g} S={interval} overlap{lag}{moves} sum on {placement} "
                        "(simulated device)")
                results[name] = simulate_zenflow(
                    dataclasses.replace(setting, overlap_reselect=reselect, stagger=stagger), host, placement)
                sizes[name] = dict(update_numel=host.update_numel, accumulate_numel=host.accumulate_numel)
        finally:
            host.close()
    baseline = results["fused AdamW (simulated device)"]
    baseline_step_s = baseline["window_s"] / baseline["steps"]
    rows = []
    for system, result in results.items():
        step_s = result["window_s"] / result["steps"]  # (seconds here)
        # The device's idle time beyond what fused AdamW's loop leaves (its one wait per step), per step.
        stall_s = max(0.0, result["idle_s"] / result["steps"] - baseline["idle_s"] / baseline["steps"])
        rows.append(dict(system=system, mean_step_ms=step_s * regime.time_scale * 1e3,
                         ratio_to_adamw=step_s / baseline_step_s, stall_fraction=stall_s / step_s,
                         bytes_device_to_host_per_step=result["bytes_device_to_host_per_step"],
                         host_work=sizes.get(system)))
    return dict(regime=dataclasses.asdict(regime),
                host=dict(update_params_per_s=update_rate, accumulate_params_per_s=accumulate_rate, threads=1),
                rows=rows, method=__doc__)


def format_rows(report: dict) -> str:
    width = max(len(row["system"]) for row in report["rows"])
    lines = [f"{'system':{width}s} {'mean step ms':>12s} {'x adamw':>8s} {'stall %':>8s} {'D2H GB/step':>11s}"]
    for row in report["rows"]:
        lines.append(f"{row['system']:{width}s} {row['mean_step_ms']:12.1f} {row['ratio_to_adamw']:8.3f} "
                     f"{100 * row['stall_fraction']:8.1f} {row['bytes_device_to_host_per_step'] / 1e9:11.3f}")
    return "\n".join(lines)


__all__ = ["Regime", "run", "format_rows", "measure_host_rates"]
