"""One rank of the data-parallel tests (tests/test_data_parallel.py): runs scenarios, saves what it saw.

Launched as `python tests/dp_worker.py SCENARIOS.pt OUT_DIR` with RANK, WORLD_SIZE and ZENFLOW_TEST_INIT (a
FileStore path) in the environment, once per rank. SCENARIOS.pt holds a list of scenarios (dicts, see `run`);
for each, OUT_DIR/<name>.rank<r>.pt gets the parameters and selections after every step, the stats, and the
error message if the scenario expects one. With ZENFLOW_WORKER_DEVICE=emulated the optimizers run on the
emulated asynchronous device (emulated_device.py), and an ordering violation fails the rank.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zenflow_compile  # noqa: E402
import zenflow_compile.backend  # noqa: E402,F401  (registers backend="zenflow")
from helpers import loss_fn, make_batches, model_for, run_ranks_scenarios  # noqa: E402


def micro_batch(global_batch, rank: int, world_size: int):
    """This rank's rows of one global batch (equal shares, so the mean of the ranks' mean losses is the
    global mean loss)."""
    x, y = global_batch
    share = x.shape[0] // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def mask_first_rows(model, rows: int = 8) -> None:
    """A gradient hook that freezes the embedding's first rows (row_mask scenarios, and the one-process run)."""
    mask = torch.ones(model.emb.weight.shape[0], 1)
    mask[:rows] = 0.0
    model.emb.weight.register_hook(lambda g: g * mask)


def build(scenario: dict, rank: int):
    model = model_for(scenario.get("model", "tiny"),
                      seed=scenario.get("seed", 0) + (rank if scenario.get("differ_init") else 0))
    if scenario.get("unused_param"):  # a trainable matrix the forward never uses: it never gets a gradient
        model.unused = torch.nn.Parameter(torch.ones(4, 8))
    if scenario.get("head"):  # TinyRepeated with another head width
        model.head = torch.nn.Linear(16, scenario["head"])
    if scenario.get("row_mask"):
        mask_first_rows(model)
        torch._dynamo.reset()  # the graphs compiled for the earlier scenarios' (unhooked) models would refuse it
    keys = dict(scenario["keys"])
    if scenario.get("mismatch_rank") == rank:
        keys.update(scenario["mismatch"])
    # DeepSpeed's defaults for the keys the scenario leaves out, as in the tests' own processes (conftest.py)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=scenario.get("lr", 1e-2), preset="deepspeed",
                                       max_grad_norm=scenario.get("clip"),
                                       reduce_bucket_size=scenario.get("bucket", 300), **keys)
    run_model = model
    ddp = scenario.get("ddp")  # wrapped in DistributedDataParallel (which ZenFlowAdamW refuses): "outside" the
    if ddp:                    # compiled model, torch.compile(DDP(model)), or "inside", DDP(torch.compile(model))
        torch._dynamo.reset()  # (an earlier scenario's refused compile must not decide this one's)
    if scenario["compiled"] and ddp == "inside":
        run_model = torch.compile(run_model, backend="zenflow")
    if ddp:
        run_model = torch.nn.parallel.DistributedDataParallel(run_model)
    if scenario["compiled"] and ddp != "inside":
        run_model = torch.compile(run_model, backend="zenflow")
    return model, opt, run_model


def train(scenario, model, opt, run_model, batches, rank, world_size, record, first_step=0):
    backwards = scenario.get("backwards_per_step", 1)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    for step in range(first_step, first_step + scenario["steps"]):
        for k in range(backwards):
            record["phase"] = f"forward {step}"  # (where an expected error came: the first forward compiles)
            batch = micro_batch(batches[step * backwards + k], rank, world_size)
            # (`head`: the targets have another width; the mean square of the output trains as well)
            loss = run_model(batch[0]).float().square().mean() if scenario.get("head") else loss_fn(run_model, batch)
            record["phase"] = f"backward {step}"
            loss.backward()
        if scenario.get("grad_after_backward"):  # a .grad written after the backward: refused
            model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)
        record["phase"] = f"step {step}"
        opt.step()
        opt.zero_grad()
        record["phase"] = None
        if scenario.get("die_rank") == rank and step == scenario.get("die_after_step"):
            os._exit(3)  # a rank that dies mid-run
        record["params"].append([p.detach().clone() for p in model.parameters()])
        record["selected"].append([opt.selected_columns(p) for p in matrices])


def unused_has_state(model, opt) -> bool:
    unused = getattr(model, "unused", None)
    return unused is not None and opt._runtime.has_state(opt.param_id(unused))


def owners(model, opt) -> list:
    """The rank holding each parameter's host state, in the model's order."""
    return [opt._runtime.owners.get(opt.param_id(p)) for p in model.parameters()]


def dcp_resume(scenario: dict, rank: int, checkpoint: str, record: dict | None = None):
    """A fresh model and optimizer loaded from a DCP checkpoint the way torchtitan does: the state_dict
    functions of torch.distributed.checkpoint give the template, `dcp.load` fills it in, set_state_dict
    applies it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, run_model = build(scenario, rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    if record is not None:  # (the template's optimizer never stepped: DCP's state_dict functions must not step it)
        record["template_steps"] = opt._runtime.step_count
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, run_model


def dcp_save(scenario, rank, world_size, model, opt, run_model, batches, record) -> None:
    """Save the model and optimizer with DCP after the scenario's steps (and each rank's opt.state_dict() with
    torch.save), train `more_steps` more, then resume the checkpoint in a fresh model and optimizer at this
    world size and train the same steps (record["resumed"])."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=scenario["dcp_save"])
    torch.save(opt.state_dict(), f"{scenario['dcp_save']}.rank{rank}.pt")
    record["consolidated"] = opt.consolidated_state_dict()
    record["owners"] = owners(model, opt)
    more = dict(scenario, steps=scenario["more_steps"])
    train(more, model, opt, run_model, batches, rank, world_size, record, first_step=scenario["steps"])
    model2, opt2, run_model2 = dcp_resume(scenario, rank, scenario["dcp_save"])
    record["resumed"] = dict(params=[], selected=[], owners=owners(model2, opt2),
                             unused_has_state=unused_has_state(model2, opt2))
    train(more, model2, opt2, run_model2, batches, rank, world_size, record["resumed"], first_step=scenario["steps"])


def run(scenario: dict, rank: int, world_size: int, out_dir: Path) -> None:
    torch.manual_seed(0)
    record: dict = dict(params=[], selected=[], error=None)
    batches = make_batches(64, batch=scenario.get("global_batch", 8))
    try:
        model, opt, run_model = build(scenario, rank)
        record["initial"] = [p.detach().clone() for p in model.parameters()]
        if "load_from" in scenario:  # a full (world-size-free) state_dict, e.g. saved by one process
            saved = torch.load(scenario["load_from"], weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        if "load_optimizer_from" in scenario:  # a model of other shapes' checkpoint: refused, then train on
            try:
                opt.load_state_dict(torch.load(scenario["load_optimizer_from"], weights_only=False))
            except ValueError as error:
                record["load_error"] = f"{type(error).__name__}: {error}"
        if "load_rank_state" in scenario:  # one rank's torch.save'd opt.state_dict() (of another world size)
            saved_rank = min(rank, scenario["saved_at"] - 1)
            opt.load_state_dict(torch.load(f"{scenario['load_rank_state']}.rank{saved_rank}.pt", weights_only=False))
        if "dcp_load" in scenario:  # a checkpoint of another launch (possibly another world size)
            model, opt, run_model = dcp_resume(scenario, rank, scenario["dcp_load"], record)
            record["consolidated"] = opt.consolidated_state_dict()
            record["unused_has_state"] = unused_has_state(model, opt)
        train(scenario, model, opt, run_model, batches, rank, world_size, record,
              first_step=scenario.get("first_step", 0))
        if "dcp_save" in scenario:
            dcp_save(scenario, rank, world_size, model, opt, run_model, batches, record)
        if "resume_steps" in scenario:
            # Copies, as torch.save would make: like torch.optim's, a state_dict may share live tensors.
            record["share"] = copy.deepcopy(opt.state_dict())
            record["consolidated"] = copy.deepcopy(opt.consolidated_state_dict())
            record["model_at_save"] = {k: v.clone() for k, v in model.state_dict().items()}
            more = dict(scenario, steps=scenario["resume_steps"])
            train(more, model, opt, run_model, batches, rank, world_size, record, first_step=scenario["steps"])
            # Resume the share in a fresh model and optimizer (same world size, same rank).
            model2, opt2, run_model2 = build(scenario, rank)
            model2.load_state_dict(record["model_at_save"])
            opt2.load_state_dict(record["share"])
            resumed = dict(params=[], selected=[])
            train(more, model2, opt2, run_model2, batches, rank, world_size, resumed,
                  first_step=scenario["steps"])
            record["resumed"] = resumed
        opt.synchronize()
        record["final"] = [p.detach().clone() for p in model.parameters()]
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
