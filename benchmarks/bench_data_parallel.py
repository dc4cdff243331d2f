"""Data-parallel ZenFlow: host memory and CPU work per rank at world size 1 and 2.

    python benchmarks/bench_data_parallel.py                      # 24 matrices of 1024 x 1024, 12 steps
    python benchmarks/bench_data_parallel.py --matrices 8 --size 512 --steps 8 --out dp.json

For each world size (one system at a time), the script starts that many processes (gloo on CPU, one torch
thread each, stated in the table), trains the same model on the same global batch split across the ranks
(eager ZenFlowAdamW, topk_ratio 0.1, update_interval 4, overlap on), and reports per rank: the host memory
held for optimizer state (`host_state_bytes`), the CPU time of the CPU AdamW and of the accumulation (the
worker threads' CPU time, `*_thread_seconds`: with one torch thread per rank that is all of the work, and
other processes on the machine do not inflate it), the bytes each collective kind sent, and the mean step time. Ratios are against world size 1. On a
machine with fewer cores than ranks x threads the ranks share cores, so the step time is not a scaling
figure; the host memory and the CPU seconds per rank are what partitioning changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


class Stack(torch.nn.Module):
    def __init__(self, matrices: int, size: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(size, size) for _ in range(matrices))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def worker(args) -> None:
    import torch.distributed as dist

    import zenflow_compile

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{os.environ['BENCH_INIT']}", rank=rank,
                                world_size=world_size)
    torch.manual_seed(0)
    model = Stack(args.matrices, args.size)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4,
                                       overlap_step=True, pt_reserved_cores_perc=0.0)
    data = torch.Generator().manual_seed(1)
    share = args.batch // world_size
    times = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.size, generator=data)[rank * share:(rank + 1) * share]
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    opt.synchronize()
    stats = opt.stats()
    result = dict(rank=rank, world_size=world_size, threads=args.threads,
                  host_state_bytes=stats["host_state_bytes"], cpu_update_seconds=stats["cpu_update_seconds"],
                  accumulate_seconds=stats["accumulate_seconds"], cpu_updates=stats["cpu_updates"],
                  cpu_update_thread_seconds=stats["cpu_update_thread_seconds"],
                  accumulate_thread_seconds=stats["accumulate_thread_seconds"],
                  step_seconds=sum(times[2:]) / max(1, len(times) - 2),
                  comm_bytes_sent=stats.get("comm_bytes_sent", {}))
    Path(os.environ["BENCH_OUT"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    if world_size > 1:
        dist.destroy_process_group()


def run_world(world_size: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result"
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), BENCH_INIT=str(Path(tmp) / "init"),
                       BENCH_OUT=str(out), OMP_NUM_THREADS=str(args.threads))
            cmd = [sys.executable, str(HERE), "--worker", "--matrices", str(args.matrices), "--size",
                   str(args.size), "--steps", str(args.steps), "--batch", str(args.batch), "--threads",
                   str(args.threads)]
            procs.append(subprocess.Popen(cmd, env=env))
        if any(p.wait(timeout=args.timeout) for p in procs):
            raise SystemExit(f"a rank of world size {world_size} failed")
        return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    params = args.matrices * args.size * (args.size + 1)
    print(f"model: {args.matrices} x Linear({args.size}, {args.size}) = {params / 1e6:.1f}M parameters; "
          f"{args.steps} steps, global batch {args.batch}; {args.threads} torch thread(s) per rank; "
          f"{os.cpu_count()} cores on this machine (CPU, gloo)", flush=True)
    results = {int(w): run_world(int(w), args) for w in args.worlds.split(",")}
    base = results[min(results)][0]
    header = (f"{'world':>5} {'rank':>4} {'host state MB':>13} {'x world 1':>9} {'CPU AdamW s':>11} {'x world 1':>9} "
              f"{'accumulate s':>12} {'x world 1':>9} {'step ms':>8}  bytes sent per collective")
    print(header)
    print("-" * len(header))
    for world_size, ranks in results.items():
        for r in ranks:
            update, accumulate = r["cpu_update_thread_seconds"], r["accumulate_thread_seconds"]
            print(f"{world_size:>5} {r['rank']:>4} {r['host_state_bytes'] / 1e6:>13.1f} "
                  f"{r['host_state_bytes'] / base['host_state_bytes']:>9.2f} {update:>11.3f} "
                  f"{update / max(base['cpu_update_thread_seconds'], 1e-9):>9.2f} {accumulate:>12.3f} "
                  f"{accumulate / max(base['accumulate_thread_seconds'], 1e-9):>9.2f} "
                  f"{r['step_seconds'] * 1e3:>8.1f}  {r['comm_bytes_sent']}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(setup=vars(args), cores=os.cpu_count(), results=results), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
