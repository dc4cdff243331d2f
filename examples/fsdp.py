"""ZenFlow over FSDP2-sharded parameters (ZeRO-3 class), torchtitan style, with torchrun.

    pip install -e ".[examples]"                                                   # transformers (the model)
    torchrun --nproc-per-node 2 examples/fsdp.py --checkpoint-dir ckpt            # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 3 examples/fsdp.py --checkpoint-dir ckpt --resume   # resumes (resharded)
    torchrun --nproc-per-node 2 examples/fsdp.py --compile --bf16

A small causal LM from a transformers config (Llama), `fully_shard` per decoder layer and the root (each rank
holds a block of rows of every parameter), then `zenflow_compile.ZenFlowAdamW(model.parameters(), ...)` with
no extra argument: it sees the DTensor parameters and their mesh, all-reduces the per-column partial scores
so every rank selects the same columns, and updates its own rows (top-k columns on the device every step, the
others on its host every `update_interval` steps). FSDP2 does the gradient reduction. Checkpoints go through
torch.distributed.checkpoint (model and optimizer together) into --checkpoint-dir (none without it), so a
run saved at one world size resumes at another.

How long, 2 ranks on a 2-core x86_64 VM (OMP_NUM_THREADS=1, 2026-11-28): about 15 s eagerly (20 steps at
~60 ms); with --compile the first step compiles, ~55 s with a cold Inductor cache (6 steps: 68 s).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zenflow_compile

VOCAB = 128


def build_model(device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)  # the same initial weights on every rank (FSDP2 shards each rank's copy)
    return LlamaForCausalLM(config).to(device)


def batches(global_batch: int, seq: int):
    """The same global batches on every rank: a learnable rule (next token = 5 * token + 3 mod VOCAB)."""
    data = torch.Generator().manual_seed(0)
    while True:
        columns = [torch.randint(0, VOCAB, (global_batch, 1), generator=data)]
        for _ in range(seq):
            columns.append((columns[-1] * 5 + 3) % VOCAB)
        yield torch.cat(columns, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of this run (default 20)")
    parser.add_argument("--batch", type=int, default=12, help="global batch, split across ranks")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, backend='zenflow')")
    parser.add_argument("--bf16", action="store_true",
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute, fp32 masters")
    parser.add_argument("--checkpoint-dir", default=None, help="save model and optimizer here (DCP) at the end")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint-dir first (any world size)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    model = build_model(device)
    mesh = init_device_mesh(device.type, (world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # per block, then the root (embeddings, final norm, head)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    run = torch.compile(model, backend="zenflow") if args.compile else model

    first_step = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)  # the template: this world size's shards
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=args.checkpoint_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first_step = state["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {first_step} (world size {world_size})", flush=True)

    data = batches(args.batch, seq=32)
    for _ in range(first_step):  # the batches the checkpointed run already used
        next(data)
    share = args.batch // world_size
    if rank == 0 and args.compile:
        print("compiling forward and backward with backend='zenflow' during the first step (about a minute on 2 "
              "CPU cores; Inductor caches it for the next run) ...", flush=True)
    step_seconds = []
    for step in range(first_step, first_step + args.steps):
        start = time.perf_counter()
        tokens = next(data)[rank * share:(rank + 1) * share].to(device)
        loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if use_cuda:
            torch.cuda.synchronize()  # (time the step's device work, not only its launch)
        step_seconds.append(time.perf_counter() - start)
        if rank == 0 and (step % 5 == 0 or step == first_step + args.steps - 1):
            print(f"step {step:3d}  loss (rank 0's share) {loss.item():.4f}", flush=True)

    # Save first: a checkpoint keeps a CPU update in flight pending, so a resumed run goes on exactly as this
    # one would have (synchronize() would apply it early).
    if args.checkpoint_dir:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": first_step + args.steps},
                 checkpoint_id=args.checkpoint_dir)
        if rank == 0:
            where = Path(args.checkpoint_dir)
            print(f"saved model and optimizer to {where} (DCP)" + ("" if where.is_absolute() else f": {where.resolve()}"))
    opt.synchronize()  # apply the CPU update in flight (before evaluation, export, ...)
    stats = opt.stats()
    host_bytes = [None] * world_size
    dist.all_gather_object(host_bytes, stats["host_state_bytes"])
    if rank == 0:
        print(f"host optimizer state bytes per rank: {host_bytes} (world size {world_size})")
        # (their sum is what one process would hold: each rank holds the state of its rows only)
        shares = ", ".join(f"{b / sum(host_bytes):.2f}" for b in host_bytes)
        print(f"host state share of each rank: {shares} (1/N = {1 / world_size:.2f})")
        print(f"steps {stats['steps']}  reselections {stats['reselections']}")
        later = sorted(step_seconds[1:]) or step_seconds
        print(f"first step {step_seconds[0]:.1f} s" + (" (compiling)" if args.compile else "")
              + f", then {later[len(later) // 2]:.3f} s per step (median)")
        print(f"CPU updates: {stats['cpu_updates']}, of which {stats['overlapped_boundaries']} overlapped the next "
              "steps")
        print(f"stall (rank 0's training loop waiting for ZenFlow): {stats['stall_seconds']:.2f} s")
        print(f"optimizer state on rank 0's {device.type}: {stats['device_state_bytes'] / 1e6:.2f} MB (host: "
              f"{stats['host_state_bytes'] / 1e6:.2f} MB, its rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
