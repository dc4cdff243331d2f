"""Data-parallel ZenFlow with torchrun, no DeepSpeed and no DDP wrapper.

    torchrun --nproc-per-node 2 examples/data_parallel.py            # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/data_parallel.py --steps 50 --eager

Each rank trains on its own share of every batch; ZenFlowAdamW averages the gradients across ranks inside
the compiled backward, every rank makes the same column selection, and each rank keeps the host optimizer
state of a share of the matrices. At the end the ranks check that they hold identical parameters and rank 0
writes a consolidated (world-size-free) checkpoint where --checkpoint says (none without it). Base install
only (torch and this package).

How long: about 20 s with 2 ranks on a 2-core x86_64 VM (OMP_NUM_THREADS=1, 2026-11-28): the first step
~10 s (compiling), then ~15 ms a step; --eager skips the compilation.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import zenflow_compile


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.block(h)
        return self.head(self.norm(h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--eager", action="store_true", help="skip torch.compile")
    parser.add_argument("--checkpoint", default=None, help="where rank 0 saves the consolidated optimizer state")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    torch.manual_seed(rank)  # different on purpose: the optimizer broadcasts rank 0's weights
    model = TinyLM().to(device)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)  # process_group: the default
    run = model if args.eager else torch.compile(model, backend="zenflow")

    data = torch.Generator().manual_seed(0)  # the same global batches on every rank
    share = args.batch // world_size
    if rank == 0 and not args.eager:
        print("compiling forward and backward with backend='zenflow' during the first step (about a minute on 2 "
              "CPU cores; Inductor caches it for the next run) ...", flush=True)
    step_seconds = []
    for step in range(args.steps):
        start = time.perf_counter()
        # A learnable rule (next token = 5 * token + 3 mod 128), so the loss visibly falls.
        columns = [torch.randint(0, 128, (args.batch, 1), generator=data)]
        for _ in range(32):
            columns.append((columns[-1] * 5 + 3) % 128)
        tokens = torch.cat(columns, dim=1)
        tokens = tokens[rank * share:(rank + 1) * share].to(device)
        logits = run(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if use_cuda:
            torch.cuda.synchronize()  # (time the step's device work, not only its launch)
        step_seconds.append(time.perf_counter() - start)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss (rank 0's share) {loss.item():.4f}", flush=True)

    opt.synchronize()
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(device)
    gathered = [torch.empty_like(checksum) for _ in range(world_size)]
    dist.all_gather(gathered, checksum)
    agree = all(torch.equal(gathered[0], other) for other in gathered)
    full = opt.consolidated_state_dict()
    stats = opt.stats()
    if rank == 0:
        later = sorted(step_seconds[1:]) or step_seconds
        print(f"first step {step_seconds[0]:.1f} s" + (" (compiling)" if not args.eager else "")
              + f", then {later[len(later) // 2]:.3f} s per step (median)")
        print(f"ranks agree: {agree}  (world size {world_size})")
        print(f"CPU updates: {stats['cpu_updates']}, of which {stats['overlapped_boundaries']} overlapped the next "
              "steps")
        print(f"stall (rank 0's training loop waiting for ZenFlow): {stats['stall_seconds']:.2f} s")
        print(f"optimizer state on rank 0's {device.type}: {stats['device_state_bytes'] / 1e6:.2f} MB (host: "
              f"{stats['host_state_bytes'] / 1e6:.2f} MB, its share of the matrices)")
        if args.checkpoint:
            torch.save(full, args.checkpoint)
            print(f"consolidated optimizer state saved to {os.path.abspath(args.checkpoint)}")
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("ranks hold different parameters")


if __name__ == "__main__":
    main()
