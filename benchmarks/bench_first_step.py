"""Setup: the first `opt.step()` (where the optimizer's state is laid out) and the host memory it takes.

    OMP_NUM_THREADS=1 python benchmarks/bench_first_step.py --out first_step.json   # 134M params, ~1 min
    python benchmarks/bench_first_step.py --matrices 8 --rows 1024 --cols 1024 --warm-up 2
    python benchmarks/bench_first_step.py --smoke --out smoke.json                    # seconds: the harness

The model is `--matrices` bf16 parameters of [rows, cols] (default 32 x [2048, 2048], 134M parameters), each
with a random bf16 gradient in `.grad`, on the test suite's emulated asynchronous device
(`tests/emulated_device.py`: CPU tensors, copies on side-stream threads, pinned host buffers; "device" memory
is host memory here) or, with `--device cpu`, on the CPU (the device is the host). ZenFlowAdamW with
`topk_ratio` r (default 0.05) and `full_warm_up_rounds` W (default 0: every matrix is selected at the first
step). Measured, for `--steps` steps (default 3): each `opt.step()`'s wall time, and the peak resident memory
it adds over what the process held just before it (Linux: the peak is reset through /proc/self/clear_refs
and read from VmHWM), per parameter. The state itself is `stats()["host_state_bytes"]` (pinned and
pageable host buffers) and `["device_state_bytes"]` (on the emulated device, host memory too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM (the peak resident set) to the current resident set


def measure(matrices: int, rows: int, cols: int, ratio: float, warm_up: int, steps: int, device: str) -> dict:
    import zenflow_compile

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, cols).bfloat16()) for _ in range(matrices)]
    numel = matrices * rows * cols
    emulated = None
    if device == "emulated":
        sys.path.insert(0, str(ROOT / "tests"))
        from emulated_device import emulated_async_device
        emulated = emulated_async_device()
    figures = []
    with emulated if emulated is not None else nullcontext():
        opt = zenflow_compile.ZenFlowAdamW(params, lr=1e-3, topk_ratio=ratio, update_interval=4,
                                           full_warm_up_rounds=warm_up)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(rows, cols).bfloat16()
            resident = _status_kib("VmRSS")
            _reset_peak()
            started = time.perf_counter()
            opt.step()
            seconds = time.perf_counter() - started
            peak = _status_kib("VmHWM")
            figures.append(dict(seconds=seconds, peak_growth_bytes_per_param=(peak - resident) * 1024 / numel))
            opt.zero_grad()
        opt.synchronize()
        stats = opt.stats()
    return dict(matrices=matrices, rows=rows, cols=cols, params=numel, topk_ratio=ratio, full_warm_up_rounds=warm_up,
                device=device, steps=figures,
                host_state_bytes_per_param=stats["host_state_bytes"] / numel,
                device_state_bytes_per_param=stats["device_state_bytes"] / numel,
                accumulate_on=stats["accumulate_on"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--matrices", type=int, default=32)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.05, help="topk_ratio (default 0.05)")
    p.add_argument("--warm-up", type=int, default=0, help="full_warm_up_rounds (default 0)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["emulated", "cpu"], default="emulated")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--smoke", action="store_true", help="4 x [64, 64], 2 steps")
    p.add_argument("--out", default="bench_first_step.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.matrices, args.rows, args.cols, args.steps = 4, 64, 64, 2
    report = measure(args.matrices, args.rows, args.cols, args.ratio, args.warm_up, args.steps, args.device)
    report.update(threads=args.threads, torch=torch.__version__, machine=platform.machine(),
                  cpus=os.cpu_count(), smoke=args.smoke)
    print(f"{report['params'] / 1e6:.0f}M params ({args.matrices} x [{args.rows}, {args.cols}] bf16), r {args.ratio}, "
          f"W {args.warm_up}, {args.device} device, accumulate_on {report['accumulate_on']}, "
          f"{args.threads} thread(s)")
    for t, step in enumerate(report["steps"]):
        print(f"  step {t}: {step['seconds']:.2f} s, peak resident +{step['peak_growth_bytes_per_param']:.1f} B/param")
    print(f"  state: host {report['host_state_bytes_per_param']:.1f} B/param, "
          f"device {report['device_state_bytes_per_param']:.1f} B/param")
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
