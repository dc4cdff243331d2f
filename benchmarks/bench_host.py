"""The host path against its limits: how fast is the runtime's CPU work per update interval?

    python benchmarks/bench_host.py --out host.json                       # 10M..200M params, bf16 and fp32 grads
    python benchmarks/bench_host.py --sizes 50M --grad-dtypes bf16 --repeats 7
    python benchmarks/bench_host.py --smoke --out smoke.json              # tiny sizes, seconds: checks the harness

What is measured (on the host, no GPU needed; the GPU's part of the offload is DMA into pinned memory):
  accumulate   the runtime's per-step host work: `AccumulateBatch.run` (acc += coef * offloaded grad) over
               every matrix, once per step of the interval (bf16/fp16 gradients converted chunk by chunk)
  adamw        the CPU AdamW kernel alone on the host rows: `kernels.cpu_adamw_` (Inductor's kernel of the
               runtime's row AdamW), the accumulator as the gradient, no cast
  update       the runtime's whole boundary update, the calls of its update task in order
               (`update.update_host_columns`: the AdamW of the mean gradient with the cast for the upload in one
               pass, then zeroing the accumulator)
  update_apart the same with half of the host rows at other update counts, at random places (as reselections
               made in flight leave them): the kernel takes each row's count, so the rate should not move
  ds_cpu_adam  DeepSpeed's DeepSpeedCPUAdam.step() on the same master and gradient tensors (its own moments);
               the op is built once, outside any timing (a --smoke run never builds it)
  torch_fused  torch.optim.AdamW(fused=True).step() on the same tensors (its own moments), called directly
  bandwidth    plain large-tensor copy, add, and in-place add, scale and addcmul, measured in the same run, same
               threads: the machine's memory bandwidth (the best of the five), which bounds every row: bound =
               bandwidth / the bytes per param the row must at least move (its minimal reads + writes)

Matrices are [1024, 2048] (Llama-like rows) with every column unselected (host-resident), fp32 masters and
moments, gradients in the parameter dtype (bf16, fp16 or fp32). Each round measures every row once, in turn; the
reported time is the median over --repeats rounds (ratios come from the same run). Two placements: all of
this process's cores, and the worker share the runtime pins its host workers to by default
(pt_reserved_cores_perc=0.5, runtime/cpu_affinity.py), measured inside a real pinned CpuWorker.

Then: the smallest update_interval S that keeps a GPU of step time T stall-free, for model sizes 0.5-8B
(top-k ratio r: the (1 - r) unselected share is the host's work). With overlap the host must, per interval,
accumulate S steps' gradients and run one update, on the worker cores, within the interval's S * T of GPU
time: S * t_acc + t_upd <= S * T, i.e. S >= t_upd / (T - t_acc) (none exists when t_acc >= T).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from zenflow_compile.runtime import cpu_affinity, kernels
from zenflow_compile.runtime.state import intake, update as slab_update
from zenflow_compile.runtime.state.members import Member, MemberState, slab_key
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import Transfers
from zenflow_compile.runtime.worker import CpuWorker

HERE = Path(__file__).resolve().parent
MATRIX_SHAPE = (1024, 2048)  # [R, C]: rows of the host buffers are columns of the parameter
HYPER = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
DEFAULT_INTERVAL = 4  # steps per interval for the per-interval figures (the sizing table solves for S itself)
TARGET_FRACTION_OF_BOUND = 0.8
SIZING_MODEL_SIZES = (0.5e9, 1e9, 2e9, 4e9, 8e9)
SIZING_STEP_TIMES = (0.05, 0.1, 0.2, 0.5, 1.0)
ROWS = ("accumulate", "adamw", "update", "update_apart", "ds_cpu_adam", "torch_fused")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def min_bytes_per_param(row: str, grad_bytes: int) -> int:
    """The reads + writes per parameter a row cannot avoid (its memory-bandwidth cost)."""
    return {
        "accumulate": grad_bytes + 4 + 4,  # read grad, read + write the fp32 accumulator
        "adamw": 16 + 12,  # read master, grad, m, v; write master, m, v (all fp32)
        "ds_cpu_adam": 16 + 12,
        "torch_fused": 16 + 12,
        # one fused pass could: read acc, master, m, v; write master, m, v, zeroed acc, the cast weights
        "update": 16 + 12 + 4 + grad_bytes,
        "update_apart": 16 + 12 + 4 + grad_bytes,
    }[row]


# ------------------------------------------------------------------------------------------------ setup
def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:], None)
    try:
        return int(float(text[:-1]) * scale) if scale else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected a parameter count like 10M, 0.5B or 2000000")


def build_states(num_params: int, grad_dtype: torch.dtype) -> list[Slab]:
    """Real runtime state: slabs over CPU parameters (one each, as the runtime lays out large matrices), no
    column selected (all host-resident)."""
    rows, cols = MATRIX_SHAPE
    if num_params < rows * cols:
        rows = max(1, num_params // cols)
    count = max(1, round(num_params / (rows * cols)))
    transfers = Transfers(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    slabs = []
    for i in range(count):
        param = (torch.randn(rows, cols, generator=generator) * 0.02).to(grad_dtype)
        member = Member(param, pid=i, group_index=0, owner=0, owns_host=True)
        slab = Slab(slab_key(member, 0), [member], [MemberState.fresh(param)], transfers, accumulate_squares=False)
        for buffer in slab.host_grads:
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 1e-3)
        slabs.append(slab)
    return slabs


def bytes_needed(num_params: int, grad_bytes: int) -> int:
    # A slab's host part: master, m, v, 2 accumulators (fp32) + 2 grads + 2 weights (grad dtype);
    # DeepSpeed's and torch's moments (fp32 x 2 each); the parameter itself
    return num_params * (5 * 4 + 4 * grad_bytes + 4 * 4 + grad_bytes)


def mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------------ the work
class HostWork:
    """Every measured operation over one set of states; each is a zero-argument callable."""

    def __init__(self, states: list[Slab], interval: int, ds_optimizer_class=None):
        self.states, self.interval = states, interval
        self.num_params = sum(s.n * s.u * s.R for s in states)
        self.step = 0
        # (a) and (b) work on the same tensors as the runtime: the host masters, the accumulator as gradient
        self.params = []
        for s in states:
            p = torch.nn.Parameter(s.host_master, requires_grad=False)  # shares the master's storage
            p.grad = s.accumulators[0]
            self.params.append(p)
        hyper = dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                     weight_decay=HYPER["weight_decay"])
        self.torch_fused = torch.optim.AdamW(self.params, fused=True, **hyper)
        self.ds = ds_optimizer_class(self.params, adamw_mode=True, **hyper) if ds_optimizer_class else None
        generator = torch.Generator().manual_seed(1)
        self.counts_apart = []
        for s in states:
            counts = s.host_counts.clone()
            apart = torch.rand(counts.shape, generator=generator) < 0.5
            counts[apart] += torch.randint(1, 9, counts.shape, generator=generator).float()[apart]
            self.counts_apart.append(counts)

    def accumulate(self) -> None:
        """One step's host accumulation (the accumulate worker's task)."""
        for s in self.states:  # (the device is the host: no copies to wait for)
            intake.accumulate(s, None, self.step % 2, 0, 1.0)
        self.step += 1

    def adamw(self) -> None:
        """The CPU AdamW kernel over every slab's host rows (accumulator as the gradient, no division, no cast)."""
        for s in self.states:
            rows = lambda t: t.view(-1, s.R)
            ones = torch.ones(s.n * s.u)
            kernels.cpu_adamw_(rows(s.host_master), rows(s.accumulators[0]), rows(s.host_exp_avg),
                               rows(s.host_exp_avg_sq), s.host_counts.view(-1), lr_scale=ones, divisor=ones, **HYPER)

    def update(self) -> None:
        """The runtime's boundary update task, call for call (`update.update_host_columns`, as
        `HostWork.launch_update` in runtime/host_work.py calls it)."""
        for s in self.states:
            slab_update.update_host_columns(s, {1: [(i, self.interval) for i in range(s.n)]}, 0, HYPER)

    def update_apart(self) -> None:
        """`update` with half of the host rows at 8 other update counts, at random places."""
        self._swap_counts()
        try:
            self.update()
        finally:
            self._swap_counts()

    def _swap_counts(self) -> None:
        for i, s in enumerate(self.states):
            s.host_counts, self.counts_apart[i] = self.counts_apart[i], s.host_counts

    def ds_cpu_adam(self) -> None:
        self.ds.step()

    def torch_fused_step(self) -> None:
        self.torch_fused.step()


class Bandwidth:
    """Plain large-tensor copy and adds: the memory bandwidth the rows are bounded by.

    Counted bytes are the tensors' reads + writes. A write to a line not yet in cache also reads it first
    (write-allocate), which in-place ops (c += a; c *= s; c += a * b) do not pay, like the optimizer's in-place
    updates. One core's bandwidth grows with the number of streams it reads at once (AdamW reads four), hence
    the 3-read in-place addcmul. The bound is the best of the five.
    """

    def __init__(self, numel: int = 64 << 20):  # 3 x 256 MB fp32: far beyond any cache
        self.a, self.b, self.c = (torch.ones(numel) for _ in range(3))

    def copy(self) -> None:
        self.c.copy_(self.a)

    def add(self) -> None:
        torch.add(self.a, self.b, out=self.c)

    def add_inplace(self) -> None:
        self.c.add_(self.a)

    def scale_inplace(self) -> None:
        self.c.mul_(1.0)

    def addcmul_inplace(self) -> None:
        self.c.addcmul_(self.a, self.b, value=0.0)

    def gbps(self, timings: dict) -> dict:
        nbytes = self.a.numel() * 4
        counted = dict(copy=2, add=3, add_inplace=3, scale_inplace=2, addcmul_inplace=4)  # tensors read + written
        out = {f"{name}_gbps": k * nbytes / timings[name]["median_s"] / 1e9 for name, k in counted.items()}
        out["bound_gbps"] = max(out.values())
        return out


# ------------------------------------------------------------------------------------------ measuring
class Place:
    """Where the work runs: the calling thread on all cores, or a real pinned CpuWorker (the worker share)."""

    def __init__(self, name: str, worker: Optional[CpuWorker], threads: int, cores: list[int]):
        self.name, self.worker, self.threads, self.cores = name, worker, threads, cores

    def time(self, fn: Callable[[], None]) -> float:
        def timed():
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return self.worker.submit(timed).result() if self.worker else timed()


def make_places(threads: Optional[int], reserve: float) -> list[Place]:
    cores = list(cpu_affinity.available_cores())
    torch.set_num_threads(threads or len(cores))
    places = [Place("all cores", None, torch.get_num_threads(), cores)]
    split = cpu_affinity.split_cores(cores, reserve)
    if split.isolated:
        worker = CpuWorker("bench", pt_reserved_cores_perc=reserve)
        seen = worker.submit(lambda: (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else list(split.workers), torch.get_num_threads())).result()
        places.append(Place(f"worker share (pt_reserved_cores_perc={reserve:g})", worker, seen[1], seen[0]))
    return places


def measure(work: HostWork, bandwidth: Bandwidth, place: Place, repeats: int) -> dict:
    """Median seconds per row over `repeats` rounds; each round runs every row once, in turn."""
    ops = {"accumulate": work.accumulate, "adamw": work.adamw, "update": work.update,
           "update_apart": work.update_apart,
           "torch_fused": work.torch_fused_step, "copy": bandwidth.copy, "add": bandwidth.add,
           "add_inplace": bandwidth.add_inplace, "scale_inplace": bandwidth.scale_inplace,
           "addcmul_inplace": bandwidth.addcmul_inplace}
    if work.ds is not None:
        ops["ds_cpu_adam"] = work.ds_cpu_adam
    for fn in ops.values():  # warm-up: first-touch of optimizer state, thread pools
        place.time(fn)
    times = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            times[name].append(place.time(fn))
    return {name: dict(median_s=statistics.median(t), min_s=min(t), max_s=max(t), times_s=t)
            for name, t in times.items()}


def analyse(work: HostWork, grad_bytes: int, timings: dict, bandwidth: Bandwidth) -> dict:
    bw = bandwidth.gbps(timings)
    rows = {}
    for name in ROWS:
        if name not in timings:
            continue
        seconds = timings[name]["median_s"]
        per_param = min_bytes_per_param(name, grad_bytes)
        bound = bw["bound_gbps"] * 1e9 / per_param  # params/s at full memory bandwidth
        rate = work.num_params / seconds
        rows[name] = dict(seconds=seconds, gparams_per_s=rate / 1e9, bytes_per_param=per_param,
                          bound_gparams_per_s=bound / 1e9, fraction_of_bound=rate / bound,
                          spread=(timings[name]["max_s"] - timings[name]["min_s"]) / seconds)
    targets = {}
    if "ds_cpu_adam" in rows:
        value = rows["adamw"]["gparams_per_s"] / rows["ds_cpu_adam"]["gparams_per_s"]
        best = timings["ds_cpu_adam"]["min_s"] / timings["adamw"]["min_s"]  # noise only ever adds time
        targets["adamw_vs_ds_cpu_adam"] = dict(value=value, best_of_rounds=best, passed=value >= 1.0,
                                               detail=f"runtime AdamW / DeepSpeed >= 1 (medians; best of rounds: "
                                                      f"{best:.2f})")
    for name in ("adamw", "accumulate"):
        value = rows[name]["fraction_of_bound"]
        targets[f"{name}_fraction_of_bound"] = dict(value=value, passed=value >= TARGET_FRACTION_OF_BOUND,
                                                    detail=f">= {TARGET_FRACTION_OF_BOUND:.0%} of the bandwidth bound")
    return dict(bandwidth=bw, rows=rows, targets=targets)


# --------------------------------------------------------------------------------------------- sizing
def smallest_interval(model_params: float, step_s: float, topk_ratio: float, acc_rate: float,
                      update_rate: float, max_interval: int = 64) -> Optional[int]:
    """Smallest S with S * t_acc + t_upd <= S * T for the unselected share; None if none up to max_interval."""
    host = (1.0 - topk_ratio) * model_params
    t_acc, t_upd = host / acc_rate, host / update_rate
    if t_acc >= step_s:
        return None
    interval = max(1, math.ceil(t_upd / (step_s - t_acc) - 1e-12))
    return interval if interval <= max_interval else None


def sizing_table(acc_rate: float, update_rate: float, topk_ratio: float) -> dict:
    table = {}
    for size in SIZING_MODEL_SIZES:
        table[f"{size / 1e9:g}B"] = {f"{int(t * 1000)}ms": smallest_interval(size, t, topk_ratio, acc_rate, update_rate)
                                     for t in SIZING_STEP_TIMES}
    return table


def format_sizing(table: dict, basis: str) -> str:
    steps = list(next(iter(table.values())))
    lines = [f"Smallest stall-free update_interval ({basis}); '-' = none up to 64 (the host cannot keep up):",
             "  model  " + "".join(f"{s:>8}" for s in steps)]
    for size, row in table.items():
        lines.append(f"  {size:>5}  " + "".join(f"{('-' if v is None else v):>8}" for v in row.values()))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- main
def ds_cpu_adam_class():
    """DeepSpeedCPUAdam with its op loaded (built now if needed, outside any timing); else (None, reason)."""
    try:
        sys.path.insert(0, str(HERE))
        from systems import deepspeed_ops_status

        state = deepspeed_ops_status().get("cpu_adam", "missing")
        if state.startswith("locked"):  # loading would wait on the lock file, forever if its builder died
            return None, f"DeepSpeed's cpu_adam op is {state}; remove a stale lock and rerun"
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # loads (or JIT-builds) the op, untimed
        return DeepSpeedCPUAdam, None
    except Exception as error:  # noqa: BLE001 - reported as the row's reason
        return None, f"DeepSpeedCPUAdam unavailable: {type(error).__name__}: {error}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", default="10M,50M,100M,200M", help="parameter counts (default 10M,50M,100M,200M)")
    p.add_argument("--grad-dtypes", default="bf16,fp32", help="gradient dtypes (default bf16,fp32)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per size (default 5; median reported)")
    p.add_argument("--interval", type=int, default=DEFAULT_INTERVAL,
                   help=f"steps per interval for the per-interval figures (default {DEFAULT_INTERVAL})")
    p.add_argument("--threads", type=int, help="intra-op threads for the all-cores placement (default: all cores)")
    p.add_argument("--reserve", type=float, default=0.5,
                   help="pt_reserved_cores_perc for the worker-share placement (default 0.5, ZenFlow's default)")
    p.add_argument("--topk-ratio", type=float, default=0.05, help="for the sizing table (default 0.05)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    p.add_argument("--smoke", action="store_true", help="1M params, 2 rounds, no DeepSpeed")
    p.add_argument("--out", default="bench_host.json")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows in logs as it happens
    if args.smoke:
        args.sizes, args.repeats = "1M", 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.grad_dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or args.repeats < 1 or args.interval < 1:
        print(f"bad arguments: grad dtypes {unknown} (expected {list(DTYPES)}), --repeats and --interval >= 1")
        return 2
    started = time.perf_counter()
    if args.no_deepspeed:
        ds_class, ds_reason = None, "--no-deepspeed"
    elif args.smoke:  # loading a cached op built by another venv JIT-rebuilds it: minutes on 2 cores
        ds_class, ds_reason = None, "--smoke never loads DeepSpeed's cpu_adam op (loading may JIT-(re)build it)"
    else:
        ds_class, ds_reason = ds_cpu_adam_class()
    places = make_places(args.threads, args.reserve)
    bandwidth = Bandwidth((1 << 20) if args.smoke else (64 << 20))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"
    print(f"bench_host: {machine}; torch {torch.__version__}; places: "
          + "; ".join(f"{p.name}: {p.threads} threads on cores {p.cores}" for p in places))
    if ds_reason:
        print(f"  DeepSpeedCPUAdam: skipped ({ds_reason})")

    results = []
    for dtype_name in dtypes:
        grad_bytes = torch.finfo(DTYPES[dtype_name]).bits // 8
        for size in sizes:
            need, avail = bytes_needed(size, grad_bytes), mem_available()
            if avail is not None and need > 0.7 * avail:
                results.append(dict(grad_dtype=dtype_name, requested_params=size, status="skipped",
                                    reason=f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"))
                print(f"  {dtype_name} {size / 1e6:.0f}M: skipped ({results[-1]['reason']})")
                continue
            states = build_states(size, DTYPES[dtype_name])
            work = HostWork(states, args.interval, ds_class)
            for place in places:
                timings = measure(work, bandwidth, place, args.repeats)
                entry = dict(grad_dtype=dtype_name, requested_params=size, num_params=work.num_params,
                             matrices=len(states), place=place.name, threads=place.threads, cores=place.cores,
                             status="ok", timings=timings, **analyse(work, grad_bytes, timings, bandwidth))
                r = entry["rows"]
                entry["interval"] = dict(steps=args.interval, seconds=args.interval * r["accumulate"]["seconds"]
                                         + r["update"]["seconds"])
                results.append(entry)
                print(f"  {dtype_name} grads {work.num_params / 1e6:.0f}M params, {place.name}: "
                      f"bandwidth {entry['bandwidth']['bound_gbps']:.1f} GB/s; " + ", ".join(
                          f"{k} {v['gparams_per_s']:.2f} Gp/s ({v['fraction_of_bound']:.0%})" for k, v in r.items()))
            del work, states
            gc.collect()

    ok = [r for r in results if r["status"] == "ok"]
    print()
    print(format_results(ok))
    sizing = {}
    for place in places:
        largest = max((r for r in ok if r["place"] == place.name and r["grad_dtype"] == dtypes[0]),
                      key=lambda r: r["num_params"], default=None)
        if largest is None:
            continue
        acc = largest["rows"]["accumulate"]["gparams_per_s"] * 1e9
        upd = largest["rows"]["update"]["gparams_per_s"] * 1e9
        basis = (f"{place.name}: {place.threads} threads; {dtypes[0]} grads; measured at "
                 f"{largest['num_params'] / 1e6:.0f}M params: accumulate {acc / 1e9:.2f}, update {upd / 1e9:.2f} "
                 f"Gparam/s; top-k ratio {args.topk_ratio:g}")
        sizing[place.name] = dict(basis=basis, accumulate_gparams_per_s=acc / 1e9, update_gparams_per_s=upd / 1e9,
                                  topk_ratio=args.topk_ratio, table=sizing_table(acc, upd, args.topk_ratio))
        print()
        print(format_sizing(sizing[place.name]["table"], basis))
    report = dict(benchmark="bench_host", smoke=args.smoke, machine=machine, cpu_count=os.cpu_count(),
                  torch=torch.__version__, interval=args.interval, repeats=args.repeats,
                  places=[dict(name=p.name, threads=p.threads, cores=p.cores) for p in places],
                  deepspeed=dict(used=ds_class is not None, reason=ds_reason),
                  targets=dict(adamw_vs_ds_cpu_adam_min=1.0, fraction_of_bound_min=TARGET_FRACTION_OF_BOUND),
                  results=results, sizing=sizing, total_wall_s=time.perf_counter() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nJSON: {args.out}  total: {report['total_wall_s']:.1f} s")
    for place in places:
        if place.worker is not None:
            place.worker.shutdown()
    return 0


def format_results(results: list[dict]) -> str:
    header = f"{'grads':>5} {'params':>7}  {'place':<38} {'GB/s':>5}  " + "".join(
        f"{name:>17}" for name in ROWS)
    lines = ["Gparam/s (fraction of the memory-bandwidth bound for the bytes the row must move):", header]
    for r in results:
        cells = []
        for name in ROWS:
            row = r["rows"].get(name)
            cells.append(f"{row['gparams_per_s']:6.2f} ({row['fraction_of_bound']:4.0%})" if row else "-")
        place = f"{r['place']} [{r['threads']}t]"
        lines.append(f"{r['grad_dtype']:>5} {r['num_params'] / 1e6:6.0f}M  {place:<38} "
                     f"{r['bandwidth']['bound_gbps']:5.1f}  " + "".join(f"{c:>17}" for c in cells))
    verdicts = []
    for r in results:
        for name, t in r["targets"].items():
            verdicts.append(f"{r['grad_dtype']} {r['num_params'] / 1e6:.0f}M {r['place']}: {name} "
                            f"{t['value']:.2f} {'PASS' if t['passed'] else 'FAIL'} ({t['detail']})")
    return "\n".join(lines + ["", "Targets (this machine, CPU targets):"] + ["  " + v for v in verdicts])


if __name__ == "__main__":
    sys.exit(main())
