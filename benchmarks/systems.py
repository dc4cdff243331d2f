"""One function per benchmarked system; each runs in its own fresh process, driven by bench_offload.py.

    python benchmarks/systems.py --spec '<json>' --result result.json

The spec names the system (`kind`: adamw | zenflow | ds_offload | ds_zenflow), the model preset, batch,
sequence length, steps, warm-up steps and the optimizer/ZenFlow settings. The result file receives one JSON
object: status "ok" with the measurements, or status "failed" with the error and the traceback tail. The
driver turns a crash or a timeout (no result file) into a failed row itself.

Every system trains the same model (same preset, dtype, init seed) on the same synthetic batches with the
same loop: forward -> backward -> optimizer step -> zero_grad, then a device synchronisation; a step's time
is the wall time of that, and the first `warmup` steps (compilation, JIT builds, first selection) are not
measured.

Fairness: the process pins itself to the spec's `cores` and `threads` before torch is imported (every thread
it starts inherits the mask; torch's intra-op count is set once), and reports what it ran with. The measured
window holds whole CPU work: asynchronous optimizer work still running from the warm-up is finished before
the window opens, and the window closes only after the last in-flight update has been applied
(`opt.synchronize()` for ZenFlow), so the mean step time includes every CPU update launched in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

_PROCESS_START = time.perf_counter()

# Not imported at module level: torch, transformers, deepspeed, zenflow_compile (the module is re-imported by
# DeepSpeed ZenFlow's spawned optimizer process, which must not initialise anything).


# ------------------------------------------------------------------------------------------------ helpers
def pin_process(spec: dict) -> None:
    """Bind this process to spec['cores'] and its OpenMP/MKL pools to spec['threads'], before torch loads."""
    cores, threads = spec.get("cores"), spec.get("threads")
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    if threads:
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[key] = str(threads)


def placement(spec: dict) -> dict:
    """The threads and cores this process actually runs torch with (reported in every row)."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return dict(threads=torch.get_num_threads(), cores=cores, num_cores=len(cores) if cores else os.cpu_count())


def _device_and_dtype(spec: dict):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", 0), torch.bfloat16
    return torch.device("cpu"), getattr(torch, spec.get("cpu_dtype", "float32"))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores)"


def _progress(what: str) -> None:
    """A timestamped line in the system's log: where a timed-out system spent its time."""
    print(f"[{time.perf_counter() - _PROCESS_START:7.1f} s] {what}", flush=True)


def _setup(spec: dict):
    """Model, batches and common facts, on the device, seeded identically for every system."""
    import torch

    from model import build_model, model_stats, synthetic_batches

    device, dtype = _device_and_dtype(spec)
    if device.type == "cuda":
        torch.ones(1, device=device)  # the caching allocator exists from the first allocation on: before, the
        torch.cuda.reset_peak_memory_stats(device)  # reset fails ("Invalid device argument")
    model = build_model(spec["model"], spec["seq"], device, dtype, seed=spec.get("seed", 0))
    batches = synthetic_batches(model.config.vocab_size, spec["batch"], spec["seq"], device)
    facts = dict(device=_device_name(device), device_type=device.type, **model_stats(model))
    _progress(f"model and batches built on {device}")
    return model, batches, device, facts


def _adamw_hyper(spec: dict) -> dict:
    return dict(lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"], weight_decay=spec["weight_decay"])


def _timed_loop(step_fn: Callable[[int], Any], spec: dict, device,
                on_measure_start: Optional[Callable[[], None]] = None,
                finish: Optional[Callable[[], None]] = None) -> dict:
    """Run warmup + steps steps; return per-step times of the measured ones, the measured window and losses.

    `on_measure_start` runs before the window opens (outside it); `finish` runs inside it, after the last
    step (it completes asynchronous work the measured steps launched), so window_s / steps is the true cost
    of a step including its share of every CPU update.
    """
    warmup, steps = spec["warmup"], spec["steps"]
    times, losses, warmup_times = [], [], []
    loop_start = time.perf_counter()
    window_start = None
    for i in range(warmup + steps):
        if i == warmup:
            if on_measure_start is not None:
                on_measure_start()
            _sync(device)
            window_start = time.perf_counter()
        start = time.perf_counter()
        loss = step_fn(i)
        _sync(device)
        elapsed = time.perf_counter() - start
        (times if i >= warmup else warmup_times).append(elapsed)
        if i < warmup:
            _progress(f"warm-up step {i + 1}/{warmup}: {elapsed:.2f} s")
        if i in (0, warmup + steps - 1):
            losses.append(float(loss))
    start = time.perf_counter()
    if finish is not None:
        finish()
    _sync(device)
    end = time.perf_counter()
    return dict(step_times_s=times, warmup_step_times_s=warmup_times, first_loss=losses[0], last_loss=losses[-1],
                loop_start=loop_start, finish_s=end - start, window_s=end - window_start)


def _quiet_compile_workers() -> None:
    """After warm-up: stop Inductor's compile-worker processes (a later recompile restarts them) so that
    workers still starting up or idling do not share the CPU with the measured steps (and ZenFlow's CPU
    worker). Best effort: a private torch API."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    except Exception:  # noqa: BLE001 - purely an optimisation of the measurement
        pass


def _compile_counts() -> dict:
    """Dynamo graphs and Inductor graph compilations so far (to spot recompiles in the measured steps)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return dict(dynamo_graphs=int(counters["stats"]["unique_graphs"]),
                inductor_graphs=int(sum(inductor[k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit",
                                                               "fxgraph_cache_bypass"))))


def _compiles_since(start: dict) -> dict:
    end = _compile_counts()
    return {k: end[k] - start[k] for k in start}


def _summary(loop: dict, facts: dict, device) -> dict:
    import torch

    times = loop["step_times_s"]
    out = dict(facts)
    # mean = the whole window (steps + the in-flight work finished after them) / steps
    out.update(median_step_s=statistics.median(times), mean_step_s=loop["window_s"] / len(times),
               min_step_s=min(times), max_step_s=max(times), total_measured_s=loop["window_s"],
               finish_s=loop["finish_s"], measured_steps=len(times), step_times_s=times,
               warmup_step_times_s=loop["warmup_step_times_s"],
               setup_s=loop["loop_start"] - _PROCESS_START,
               first_loss=loop["first_loss"], last_loss=loop["last_loss"],
               peak_host_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if device.type == "cuda":
        out["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        out["peak_gpu_mem_gb"] = None
        out.setdefault("notes", {})["peak_gpu_mem_gb"] = "no CUDA device"
    return out


def _note(result: dict, key: str, text: str) -> None:
    result.setdefault("notes", {})[key] = text


# ------------------------------------------------------------------------------------------- the systems
def run_adamw(spec: dict) -> dict:
    """The speed limit: model compiled with Inductor, device-resident torch.optim.AdamW, fused wherever torch
    has the fused kernel for the device (CUDA and CPU), single-tensor otherwise."""
    import torch

    model, batches, device, facts = _setup(spec)
    fused = device.type in ("cuda", "cpu")  # torch's fused AdamW: CUDA, and CPU since torch 2.4
    opt = torch.optim.AdamW(model.parameters(), **_adamw_hyper(spec), fused=fused)
    compiled = torch.compile(model)

    def step(i):
        tokens = batches[i % len(batches)]
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    marks = {}

    def start_measuring():
        _quiet_compile_workers()
        marks["compiles"] = _compile_counts()

    loop = _timed_loop(step, spec, device, on_measure_start=start_measuring)
    result = _summary(loop, facts, device)
    result["compiles_during_measurement"] = _compiles_since(marks["compiles"])
    result.update(optimizer=f"torch.optim.AdamW(fused={fused})", stall_fraction=None, traffic_multiple=0.0,
                  traffic_method="none: optimizer state and update stay on the device",
                  cpu_update_s_per_step=None)
    _note(result, "stall_fraction", "no offload: nothing on the host blocks the GPU (optimizer runs on the device)")
    _note(result, "cpu_update_s_per_step", "no CPU optimizer")
    return result


def run_zenflow(spec: dict) -> dict:
    """This project: torch.compile(model, backend="zenflow") + zenflow_compile.ZenFlowAdamW."""
    import torch

    import zenflow_compile

    model, batches, device, facts = _setup(spec)
    zf = spec["zenflow"]
    opt = zenflow_compile.ZenFlowAdamW(
        model.parameters(), **_adamw_hyper(spec), max_grad_norm=spec.get("max_grad_norm"),
        topk_ratio=zf["topk_ratio"], update_interval=zf["update_interval"], overlap_step=zf["overlap_step"],
        select_strategy=zf["select_strategy"], select_interval=zf["select_interval"],
        full_warm_up_rounds=zf["full_warm_up_rounds"], overlap_reselect=zf.get("overlap_reselect", "wait"),
        accumulate_on=zf.get("accumulate_on", "auto"), landing_lag=zf.get("landing_lag"),
        stagger_boundaries=zf.get("stagger_boundaries", False))
    _progress("optimizer built")
    compiled = torch.compile(model, backend="zenflow")

    def step(i):
        tokens = batches[i % len(batches)]
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if i < spec["warmup"]:  # where a warm-up step's time goes (the first: compile vs state allocation)
            _sync(device)
            started = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if i < spec["warmup"]:
            _sync(device)
            _progress(f"warm-up step {i + 1}: opt.step() {time.perf_counter() - started:.2f} s")
        return loss.detach()

    marks = {}

    def start_measuring():
        _quiet_compile_workers()
        opt.synchronize()  # the warm-up's in-flight update lands outside the window
        _sync(device)
        marks["start"] = opt.stats()
        marks["compiles"] = _compile_counts()

    # The window ends after the last in-flight CPU update is applied (opt.synchronize(), timed).
    loop = _timed_loop(step, spec, device, on_measure_start=start_measuring, finish=opt.synchronize)
    end = opt.stats()
    if spec.get("trace"):  # after the window: one update interval under the profiler
        interval = zf["update_interval"] if isinstance(zf["update_interval"], int) else 4
        Path(spec["trace"]).parent.mkdir(parents=True, exist_ok=True)
        _trace_steps(step, range(spec["warmup"] + spec["steps"], spec["warmup"] + spec["steps"] + interval),
                     device, spec["trace"])
    compiles = _compiles_since(marks["compiles"])
    start = marks["start"]
    needed = ("stall_seconds", "cpu_update_seconds", "accumulate_seconds", "accumulate_copy_wait_seconds",
              "bytes_device_to_host",
              "bytes_host_to_device", "cpu_updates", "reselections", "skipped_steps", "selection_seconds")
    missing = [k for k in needed if k not in end]
    if missing:
        raise KeyError(f"ZenFlowAdamW.stats() lacks {missing} (has {sorted(end)})")
    delta = {k: end[k] - start[k] for k in needed}
    result = _summary(loop, facts, device)
    steps, model_bytes = result["measured_steps"], result["model_bytes"]
    d2h = delta["bytes_device_to_host"] / steps / model_bytes
    h2d = delta["bytes_host_to_device"] / steps / model_bytes
    interval = zf["update_interval"]
    if isinstance(interval, int) and delta["cpu_updates"] > 0:
        # Steady state: every step's offload plus one interval's share of an upload. The measured window
        # may hold one boundary more or less than steps / interval; this removes that edge effect.
        steady = d2h + delta["bytes_host_to_device"] / delta["cpu_updates"] / interval / model_bytes
    else:
        steady = d2h + h2d
    result.update(
        optimizer="zenflow_compile.ZenFlowAdamW + backend='zenflow'",
        stall_fraction=delta["stall_seconds"] / result["total_measured_s"],
        stall_method="opt.stats()['stall_seconds'] over the measured steps / their total time",
        traffic_multiple=d2h + h2d, traffic_d2h_multiple=d2h, traffic_h2d_multiple=h2d,
        traffic_steady_multiple=steady,
        traffic_method="measured: opt.stats() bytes_device_to_host + bytes_host_to_device per step / model bytes",
        cpu_update_s_per_step=delta["cpu_update_seconds"] / steps,
        accumulate_s_per_step=delta["accumulate_seconds"] / steps,
        accumulate_copy_wait_s_per_step=delta["accumulate_copy_wait_seconds"] / steps,
        cpu_updates=delta["cpu_updates"], reselections=delta["reselections"], accumulate_on=end["accumulate_on"],
        selection_s_per_step=delta["selection_seconds"] / steps,
        cpu_update_steps=end.get("cpu_update_steps"),  # an overlapped update's length in training steps
        skipped_steps=delta["skipped_steps"],
        effective_update_interval=(steps / delta["cpu_updates"]) if delta["cpu_updates"] else None,
        zenflow_stats=end, compiles_during_measurement=compiles, trace=spec.get("trace"),
        zenflow_workers=_zenflow_worker_placement(opt))
    return result


def _trace_steps(step_fn: Callable[[int], Any], steps: range, device, path: str) -> None:
    """Run `steps` under torch.profiler, every thread included (ZenFlow's workers are threads of their own),
    and save a Chrome trace (Perfetto, TensorBoard): the runtime's work shows as `zenflow::` ranges."""
    import torch
    from torch._C._profiler import _ExperimentalConfig

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities,
                                experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        for i in steps:
            step_fn(i)
        _sync(device)
    prof.export_chrome_trace(path)
    _progress(f"trace of {len(steps)} steps: {path}")


def _zenflow_worker_placement(opt) -> dict:
    """Cores and intra-op threads ZenFlow's host workers run with (core reservation: pt_reserved_cores_perc),
    asked on the worker threads themselves."""
    import torch

    def where():
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return dict(cores=cores, threads=torch.get_num_threads())

    runtime = opt._runtime
    out = dict(pt_reserved_cores_perc=runtime.config.pt_reserved_cores_perc)
    for worker in runtime.host_work.workers:
        out[getattr(worker, "name", "worker")] = worker.submit(where).result()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_ops_status() -> dict:
    """{op name: "installed" | "jit-built" | "missing" | "locked ..." | "built by another installation ..."} for
    the C++ ops a single-process ZeRO-Offload
    run loads: cpu_adam (DeepSpeedCPUAdam, ZenFlow's CPU Adam) and, where the accelerator has it, shm_comm
    (built by deepspeed.init_distributed on the CPU accelerator)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    status = {}
    for builder_name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        try:
            builder = get_accelerator().create_op_builder(builder_name)
        except Exception:  # noqa: BLE001 - an accelerator without this op
            builder = None
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        if installed_ops.get(builder.name, False):
            status[builder.name] = "installed"
            continue
        build_dir = _get_build_directory(builder.name, False)
        if os.path.exists(os.path.join(build_dir, "lock")):
            status[builder.name] = f"locked ({build_dir}/lock: a build is running, or a killed one left it)"
        elif os.path.exists(os.path.join(build_dir, f"{builder.name}.so")):
            status[builder.name] = ("jit-built" if _built_from_here(build_dir) else
                                    f"built by another installation ({build_dir}): loading JIT-rebuilds it")
        else:
            status[builder.name] = "missing"
    return status


def _built_from_here(build_dir: str) -> bool:
    """Whether the cached op was built from this DeepSpeed's sources (torch's extension cache is shared by
    every environment of the user: an op built by another venv is rebuilt, for minutes, when loaded here)."""
    import deepspeed

    ninja = os.path.join(build_dir, "build.ninja")
    if not os.path.exists(ninja):
        return True  # nothing to compare with: as before
    with open(ninja) as f:
        return os.path.dirname(os.path.abspath(deepspeed.__file__)) in f.read()


def build_deepspeed_ops() -> dict:
    """JIT-build (or load) the DeepSpeed ops the DeepSpeed systems need."""
    from deepspeed.accelerator import get_accelerator

    for builder_name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(builder_name)
        status = deepspeed_ops_status()
        if builder is not None and builder.name in status and status[builder.name] != "installed":
            print(f"building / loading DeepSpeed op {builder.name} ...", flush=True)
            builder.load(verbose=True)
    return deepspeed_ops_status()


def _deepspeed_engine(spec: dict, zenflow: Optional[dict]):
    """deepspeed.initialize on a single process (env rendezvous), ZeRO-2 with the optimizer offloaded."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    import deepspeed

    if spec.get("require_built_ds_ops"):
        not_ready = {name: state for name, state in deepspeed_ops_status().items()
                     if state not in ("installed", "jit-built")}
        if not_ready:
            raise RuntimeError(
                f"DeepSpeed ops not built: {not_ready}. DeepSpeed JIT-compiles them on first use (minutes on a "
                "small machine), too slow for --smoke; build them once with "
                "`python benchmarks/bench_offload.py --build-deepspeed-ops` (cached in ~/.cache/torch_extensions)")
    deepspeed.init_distributed()
    model, batches, device, facts = _setup(spec)
    cuda = device.type == "cuda"
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}  # else DeepSpeed defaults
    if zenflow is not None:
        zero["zenflow"] = {k: zenflow[k] for k in ("topk_ratio", "select_strategy", "select_interval",
                                                   "update_interval", "full_warm_up_rounds", "overlap_step")}
    config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": list(spec["betas"]),
                                                  "eps": spec["eps"], "weight_decay": spec["weight_decay"]}},
        "zero_optimization": zero,
        "gradient_clipping": spec.get("max_grad_norm") or 0.0,
        "bf16": {"enabled": cuda},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config)
    facts["ds_config"] = config
    facts["ds_optimizer"] = f"{type(optimizer).__name__} over {type(optimizer.optimizer).__name__}"
    return engine, optimizer, batches, device, facts


def _time_calls(obj, attr: str, totals: dict, key: str) -> None:
    """Wrap obj.attr (an instance attribute afterwards) to add its wall time to totals[key]."""
    original = getattr(obj, attr)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, attr, timed)


def _run_deepspeed(spec: dict, zenflow: Optional[dict]) -> dict:
    engine, optimizer, batches, device, facts = _deepspeed_engine(spec, zenflow)
    totals = dict(step=0.0, cpu_adam=0.0)
    measuring = {"on": False}
    overlap = bool(zenflow and zenflow["overlap_step"])
    # The host optimizer (DeepSpeedCPUAdam / ZenFlowCPUAdam); with ZenFlow's overlap it runs in a separate
    # process, so its time cannot be observed here.
    if not overlap:
        _time_calls(optimizer.optimizer, "step", totals, "cpu_adam")

    def step(i):
        tokens = batches[i % len(batches)]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        if measuring["on"]:
            totals["step"] += time.perf_counter() - start
        return loss.detach()

    def start_measuring():
        measuring["on"] = True
        totals["cpu_adam"] = 0.0

    finished = {"how": "nothing in flight (synchronous optimizer)"}

    def finish():
        # DeepSpeed ZenFlow with overlap: the update submitted at the last step runs in its optimizer
        # process; wait for it inside the window (end of the run: its weights are not copied back).
        if overlap and getattr(optimizer, "process_optimizer_established", False):
            optimizer._wait_for_optimizer_process()
            finished["how"] = "waited for DeepSpeed ZenFlow's optimizer process (its last submitted update)"
        elif overlap:
            finished["how"] = "DeepSpeed ZenFlow's optimizer process never started: nothing in flight"

    loop = _timed_loop(step, spec, device, on_measure_start=start_measuring, finish=finish)
    result = _summary(loop, facts, device)
    steps = result["measured_steps"]
    result.update(
        finish=finished["how"],
        optimizer=facts["ds_optimizer"],
        stall_fraction=totals["step"] / result["total_measured_s"],
        stall_method="host-blocking time in engine.step() (device synchronised before and after) / total time; "
                     "approximate: it includes device work engine.step() launches (DeepSpeed ZenFlow's selective "
                     "GPU update) and misses GPU idle time inside backward (gradient copies to the host)",
        cpu_update_s_per_step=None if overlap else totals["cpu_adam"] / steps)
    if overlap:
        _note(result, "cpu_update_s_per_step", "DeepSpeed ZenFlow overlap runs CPU Adam in a separate optimizer "
              "process; its time is not observable from the training process")
    if zenflow is None:
        result.update(traffic_multiple=2.0, traffic_method="analytic: gradients down + parameters up every step "
                      "= 2 x model size (bf16 on CUDA)")
    else:
        interval = zenflow["update_interval"]
        if isinstance(interval, int):
            result.update(traffic_multiple=1.0 + 1.0 / interval,
                          traffic_method="analytic: the full gradient partition goes to the host every micro-step "
                          "(ZeRO-Offload accumulation) + the whole partition comes back at each update boundary "
                          f"= (1 + 1/{interval}) x model size (a lower bound)")
        else:
            result.update(traffic_multiple=None, traffic_method="analytic bound needs an int update_interval")
    return result


def run_ds_offload(spec: dict) -> dict:
    """Synchronous offload: DeepSpeed ZeRO-Offload (stage 2, offload_optimizer cpu, DeepSpeedCPUAdam)."""
    return _run_deepspeed(spec, None)


def run_ds_zenflow(spec: dict) -> dict:
    """The peer: DeepSpeed's own eager ZenFlow (zero_optimization.zenflow on ZeRO-2 offload)."""
    return _run_deepspeed(spec, spec["zenflow"])


SYSTEMS: dict[str, Callable[[dict], dict]] = {
    "adamw": run_adamw,
    "zenflow": run_zenflow,
    "ds_offload": run_ds_offload,
    "ds_zenflow": run_ds_zenflow,
}


# ------------------------------------------------------------------------------------------- the worker
def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for package in ("torch", "triton", "deepspeed", "transformers"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="system spec as JSON")
    parser.add_argument("--result", help="where to write the result JSON")
    parser.add_argument("--build-deepspeed-ops", action="store_true",
                        help="JIT-build the DeepSpeed C++ ops the DeepSpeed systems need, then exit")
    args = parser.parse_args(argv)
    if args.build_deepspeed_ops:
        print(json.dumps(build_deepspeed_ops()))
        return 0
    if not (args.spec and args.result):
        parser.error("--spec and --result are required")
    spec = json.loads(args.spec)
    pin_process(spec)  # before torch is imported: every thread inherits the mask
    started = time.perf_counter()
    try:
        where = placement(spec)
        result = dict(status="ok", error=None, **where, **SYSTEMS[spec["kind"]](spec))
    except BaseException as error:  # recorded, never raised: the driver reports it in the table
        tb = traceback.format_exc()
        result = dict(status="failed", error=f"{type(error).__name__}: {error}".strip()[:2000],
                      traceback=tb[-6000:])
        print(tb, file=sys.stderr)
    result["wall_s"] = time.perf_counter() - started
    result["versions"] = _versions()
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: DeepSpeed / worker threads / compile pools can hang or crash at exit.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
