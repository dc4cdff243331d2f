"""One rank of the FSDP2 tests (tests/test_fsdp.py): ZenFlowAdamW over `fully_shard`-ed parameters, gloo on CPU.

Launched as `python tests/fsdp_worker.py SCENARIOS.pt OUT_DIR` with RANK, WORLD_SIZE and ZENFLOW_TEST_INIT (a
FileStore path) in the environment, once per rank. For each scenario (a dict, see `run`) OUT_DIR/<name>.rank<r>.pt
gets the full (gathered) parameters and the selections after every step, the stats, and the error message if
the scenario expects one. `one_process` is what the ranks must equal: the same model and optimizer in one
process, on the concatenated batch.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zenflow_compile  # noqa: E402
import zenflow_compile.backend  # noqa: E402,F401  (registers backend="zenflow")
import zenflow_compile.inspect as zf_inspect  # noqa: E402
from helpers import Tiny, loss_fn, make_batches, run_ranks_scenarios  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 2 and 3 ranks


class TinyGated(Tiny):
    """Tiny (tests/helpers.py) with a 2-row gate and a 12-row projection. Over 3 ranks FSDP2 gives one rank no
    row of `gate`, and uneven rows of emb [32, 16] and fc2 [16, 24]; on the last rank fc2.bias and proj.bias
    have as many rows (4) as each other, on the others not (6 and 4): slabs must be grouped by global shapes
    for every rank to pack its scores alike."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 2)
        self.proj = nn.Linear(16, 12)

    def forward(self, x):
        e = self.emb(x)
        gate = torch.sigmoid(self.gate(e))
        out = self.fc2(self.norm(torch.tanh(self.fc1(e)))) * gate[..., :1] + gate[..., 1:]
        return out + torch.tanh(self.proj(e)).mean(-1, keepdim=True)


def make_model(seed: int = 0) -> TinyGated:
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return TinyGated()


def micro_batch(batch, rank: int, world_size: int):
    x, y = batch
    share = x.shape[0] // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def optimizer(scenario: dict, params, **extra):
    # DeepSpeed's defaults for the keys the scenario leaves out, as in the tests' own processes (conftest.py)
    return zenflow_compile.ZenFlowAdamW(params, lr=scenario.get("lr", 1e-2), max_grad_norm=scenario.get("clip"),
                                        preset="deepspeed", **scenario["keys"], **extra)


def loaded_weights() -> dict:
    """What a user loads into the model part-way through training (another run's weights)."""
    return {k: v.detach().clone() for k, v in make_model(seed=1).state_dict().items()}


def load_weights(scenario: dict, step: int, model: nn.Module, world_size: int = 1) -> None:
    """Before step `load_at`: the weights of `loaded_weights` into the model, as `scenario["load"]` says:
    "copy": model.load_state_dict(sd) (one process: the full tensors; ranks: DTensors of their rows);
    "assign": the same with assign=True (FSDP2 takes new parameter objects); "repad": each parameter's local
    tensor replaced the way FSDP2 does it after a parameter swap (new storage, then `reset_sharded_param`,
    which re-pads an uneven shard), so the DTensor the optimizer holds has a new local tensor; "move": no
    weights, `model.to(its device)`, which FSDP2 does by swapping each DTensor parameter's contents in place
    (`torch.utils.swap_tensors`)."""
    if scenario.get("load_at") != step:
        return
    if scenario["load"] == "move":
        model.to(next(model.parameters()).device)
        return
    full_sd = loaded_weights()
    if world_size == 1 or not hasattr(next(model.parameters()), "device_mesh"):
        model.load_state_dict(full_sd)
        return
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = next(model.parameters()).device_mesh
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_sd.items()}
    if scenario["load"] in ("copy", "assign"):
        model.load_state_dict(sd, assign=scenario["load"] == "assign")
        return
    from zenflow_compile.runtime.sharding import _fsdp_params

    params = dict(model.named_parameters())
    by_param = {id(f.sharded_param): f for f in _fsdp_params()}
    with torch.no_grad():
        for name, param in params.items():
            param._local_tensor = sd[name].to_local().clone()
            by_param[id(param)].reset_sharded_param()


def poison(scenario: dict, step: int, grad: torch.Tensor) -> None:
    """The non-finite step: a NaN in the first element of emb.weight's gradient (rank 0's rows)."""
    if scenario.get("nan_step") == step:
        grad.view(-1)[0] = float("nan")


# ------------------------------------------------------------------------------------------- one process
def one_process(scenario: dict, world_size: int, compiled: bool = False):
    """The run every rank must equal: one process, no sharding, the concatenated batch (the mean of the ranks'
    mean losses). bf16: the compute is bf16 per rank's micro-batch (as FSDP2's MixedPrecisionPolicy
    param_dtype=bf16 does), the gradients summed in fp32 (reduce_dtype=fp32) and divided by the world size;
    `compiled`: that bf16 compute compiled by Inductor, as the ranks' compiled graphs are (Inductor keeps a
    bf16 graph's pointwise intermediates in fp32, so it is not the eager bf16 arithmetic)."""
    model = make_model(scenario.get("seed", 0))
    opt = optimizer(scenario, model.parameters())
    batches = make_batches(64, batch=GLOBAL_BATCH)
    params, selected = [], []
    low = copy.deepcopy(model).to(torch.bfloat16) if scenario.get("bf16") else None
    run_low = low
    if low is not None and compiled:
        for block in sharded_blocks(low):  # (the ranks' graphs end where FSDP2's hooks run: so do these)
            cut = torch.compiler.disable(lambda *args: None)
            block.register_forward_pre_hook(cut)
            block.register_forward_hook(cut)
        run_low = torch.compile(low)
    for step in range(scenario["steps"]):
        load_weights(scenario, step, model)
        if scenario.get("bf16"):
            with torch.no_grad():  # (the bf16 cast of the fp32 parameters, as FSDP2's all-gather makes it)
                for lp, p in zip(low.parameters(), model.parameters()):
                    lp.copy_(p)
            sums = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(world_size):
                loss_fn(run_low, micro_batch(batches[step], r, world_size)).backward()
                for s, p in zip(sums, low.parameters()):
                    s.add_(p.grad.float())
                low.zero_grad()
            for p, s in zip(model.parameters(), sums):
                p.grad = s / world_size
        else:
            for k in range(scenario.get("backwards_per_step", 1)):
                loss_fn(model, batches[step * scenario.get("backwards_per_step", 1) + k]).backward()
        poison(scenario, step, model.emb.weight.grad)
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        selected.append([opt.selected_columns(p) for p in model.parameters() if p.dim() >= 2])
    opt.synchronize()
    return params, selected, opt


# ------------------------------------------------------------------------------------------------ a rank
def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` is called on before the root (as FSDP2 users do per block)."""
    return [model.emb, model.fc1, model.fc2, model.gate, model.proj]


def shard(model: nn.Module, scenario: dict, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    kwargs = dict(mesh=init_device_mesh("cpu", (world_size,)),
                  reshard_after_forward=scenario.get("reshard_after_forward", True))
    if scenario.get("bf16"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    refuse = scenario.get("refuse")
    if refuse == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    elif refuse == "shard_dim_1":
        kwargs["shard_placement_fn"] = lambda param: Shard(1) if param.dim() >= 2 else Shard(0)
    elif refuse == "cpu_offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    blocks = [model.fc1] if refuse == "plain_beside_sharded" else sharded_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    if refuse != "plain_beside_sharded":
        fully_shard(model, **kwargs)
    return model


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor().detach().clone() if hasattr(param, "full_tensor") else param.detach().clone()


def build(scenario: dict, world_size: int):
    model = make_model(scenario.get("seed", 0))
    if scenario.get("unused_param"):  # a trainable matrix the forward never uses: it never gets a gradient
        model.unused = nn.Parameter(torch.ones(6, 8))
    model = shard(model, scenario, world_size)
    extra = dict(process_group=dist.group.WORLD) if scenario.get("refuse") == "process_group" else {}
    opt = optimizer(scenario, model.parameters(), **extra)
    if scenario.get("refuse") == "plain_added_later":
        opt.add_param_group(dict(params=[nn.Parameter(torch.zeros(4, 4))]))
    run_model = torch.compile(model, backend="zenflow") if scenario["compiled"] else model
    return model, opt, run_model


def train(scenario, model, opt, run_model, rank, world_size, record, first_step: int, steps: int) -> None:
    batches = make_batches(64, batch=GLOBAL_BATCH)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    backwards = scenario.get("backwards_per_step", 1)
    for step in range(first_step, first_step + steps):
        load_weights(scenario, step, model, world_size)
        for k in range(backwards):  # (FSDP2 sums each backward's reduce-scattered gradient into .grad)
            loss_fn(run_model, micro_batch(batches[step * backwards + k], rank, world_size)).backward()
        if rank == 0:
            poison(scenario, step, model.emb.weight.grad.to_local())
        opt.step()
        opt.zero_grad()
        if scenario.get("die_rank") == rank and step == scenario.get("die_after_step"):
            os._exit(3)  # a rank that dies mid-run
        record["params"].append([full(p) for p in model.parameters()])
        record["selected"].append([opt.selected_columns(p) for p in matrices])


def consolidated(opt) -> dict:
    """The optimizer's whole state, gathered (every rank gets it): its DTensor entries made full tensors."""
    saved = opt.state_dict()
    return dict(zenflow=saved["zenflow"], state={
        i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in entry.items()}
        for i, entry in saved["state"].items()})


def unused_state(model, opt) -> dict:
    """Whether the never-used parameter holds optimizer state, and the pinned host bytes of the optimizer."""
    return dict(has_state=opt._runtime.has_state(opt.param_id(model.unused)),
                host_state_bytes=opt.stats()["host_state_bytes"])


def dcp_resume(scenario: dict, world_size: int, checkpoint: str):
    """A fresh model and optimizer, loaded from a DCP checkpoint the way torchtitan does: the state_dict
    functions of torch.distributed.checkpoint give the template, `dcp.load` fills it in, set_state_dict
    applies it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, run_model = build(scenario, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, run_model


def run(scenario: dict, rank: int, world_size: int, out_dir: Path) -> None:
    record: dict = dict(params=[], selected=[], error=None)
    try:
        # (compiled: every backward graph is compiled and rewritten here, none served by a cache)
        with zf_inspect.capture() if scenario["compiled"] else contextlib.nullcontext([]) as graphs:
            if "dcp_load" in scenario:  # a checkpoint of another launch (possibly another world size)
                model, opt, run_model = dcp_resume(scenario, world_size, scenario["dcp_load"])
                record["consolidated"] = consolidated(opt)
                record["unused_state"] = unused_state(model, opt)
                train(scenario, model, opt, run_model, rank, world_size, record, scenario["first_step"],
                      scenario["steps"])
            else:
                model, opt, run_model = build(scenario, world_size)
                train(scenario, model, opt, run_model, rank, world_size, record, 0, scenario["steps"])
            if "dcp_save" in scenario:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict

                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=scenario["dcp_save"])
                record["consolidated"] = consolidated(opt)
                train(scenario, model, opt, run_model, rank, world_size, record, scenario["steps"],
                      scenario["resume_steps"])
                # Resume in a fresh model and optimizer at this world size.
                model2, opt2, run_model2 = dcp_resume(scenario, world_size, scenario["dcp_save"])
                record["resumed"] = dict(params=[], selected=[])
                train(scenario, model2, opt2, run_model2, rank, world_size, record["resumed"], scenario["steps"],
                      scenario["resume_steps"])
        # Which gradients each rewritten backward graph handed to the runtime itself (by parameter name).
        record["backward_graphs"] = [sorted(g.param_names.values()) for g in graphs]
        opt.synchronize()
        record["local_rows"] = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
        record["stats"] = opt.stats()
        record["device_is_host"] = opt._runtime.transfers.device_is_host
    except Exception as error:  # noqa: BLE001  (the test asserts on it)
        if not scenario.get("expect_error"):
            raise
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
    torch.save(record, out_dir / f"{scenario['name']}.rank{rank}.pt")


if __name__ == "__main__":
    run_ranks_scenarios(run)
