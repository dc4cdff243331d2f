"""ZenFlowAdamW's checkpoints: `state_dict()` in torch.optim's layout (data parallel and FSDP2: the form
torch.distributed.checkpoint saves and fills), `consolidated_state_dict()`, and `load_state_dict()`, which checks
a state_dict against the optimizer before it changes anything.

`CheckpointMixin` is a base of ZenFlowAdamW and reads what the optimizer holds: its runtime (`_runtime`), its
parameter ids (`_param_ids`, `param_id`, `_params_in_order`), param groups (`_follow_param_groups` after a
load), settings (`config`, `max_grad_norm`) and how it names a parameter (`_place`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from zenflow_compile.runtime import checkpoint, sharding as sharded


class CheckpointMixin:
    """The checkpoint methods of ZenFlowAdamW (before torch.optim.Optimizer among its bases, whose own
    `state_dict` and `load_state_dict` these call for the param groups)."""

    def state_dict(self) -> dict:
        """torch.optim layout: per-parameter state in its natural shape (fp32 master, moments, per-column
        counts, selection, accumulator) keyed by index, param_groups, plus a "zenflow" entry.

        With torch.distributed initialised (data parallel, FSDP2, or one process of a launch): the form
        torch.distributed.checkpoint saves and fills, the same at every world size (docs/distributed.md, "Data
        parallel", "Sharded parameters (FSDP2)"). Data parallel: this rank's entries are those of the parameters
        whose host state it holds (the others' are empty), so every rank's state_dict together is the whole
        state; FSDP2: this rank's rows. A trainable parameter without state yet has a template entry
        (`has_state` False), so a fresh optimizer's state_dict is what `dcp.load` fills in.

        Saving never changes the run: it waits for CPU work in flight but applies nothing to the device.
        """
        self._runtime.quiesce()
        self._mark_state()  # (param groups edited since the last step)
        saved = super().state_dict()
        indexed = [(i, self._param_ids[id(p)]) for i, p in enumerate(self._params_in_order())
                   if id(p) in self._param_ids and self._runtime.has_state(self._param_ids[id(p)])]
        saved["state"] = {i: self._runtime.export_state(pid) for i, pid in indexed}
        saved["zenflow"] = self._runtime.export_globals()
        if self._runtime.sharding is not None:
            self._sharded_state_dict(saved)
        elif self._runtime.data_parallel is not None or dist.is_available() and dist.is_initialized():
            # (one process of a torchrun or DeepSpeed launch too: DCP saves and fills one form at every world size)
            self._data_parallel_state_dict(saved)
        return saved

    def _dcp_entries(self, saved: dict, owns: Callable[[int], bool]) -> dict:
        """`saved["state"]` in DCP's form (`checkpoint.dcp_form`) for the parameters `owns(pid)` says this rank
        saves, with a template for each trainable one without state; an empty entry for the others."""
        state = {}
        for i, param in enumerate(self._params_in_order()):
            pid = self._param_ids.get(id(param))
            if pid is None or not (i in saved["state"] or param.requires_grad):
                continue
            if not owns(pid):
                state[i] = {}  # (DCP writes nothing for it; get/set_optimizer_state_dict want every parameter)
            elif i in saved["state"]:
                state[i] = checkpoint.dcp_form(saved["state"][i], param.dtype, has_state=True)
            else:
                fresh = checkpoint.fresh_entry(sharded.local_shard(param), self.config.interval_second_moment)
                state[i] = checkpoint.dcp_form(fresh, param.dtype, has_state=False)
        return state

    def _data_parallel_state_dict(self, saved: dict) -> None:
        """Data parallel: the entries of the parameters this rank owns (their full state), the schedule as every
        rank holds it, also in param_groups[0] (`get_optimizer_state_dict` keeps only state and param_groups),
        and the owner of every parameter (a load checks that it has the entries of its own)."""
        runtime, params = self._runtime, self._params_in_order()
        if runtime.data_parallel is None:  # (one rank: it holds every parameter's state, and owns each entry)
            world_size = 1
            saved["state"] = self._dcp_entries(saved, lambda pid: True)
            owners = [0 if i in saved["state"] else -1 for i in range(len(params))]
        else:
            world_size = runtime.data_parallel.world_size
            owners = [runtime.owners.get(self._param_ids.get(id(p)), -1) for p in params]
            saved["state"] = self._dcp_entries(saved, lambda pid: runtime.owners.get(pid) == runtime.rank)
        saved["zenflow"] = dict(sharded.replicated_globals(saved["zenflow"]), data_parallel=dict(
            world_size=world_size, owners=torch.tensor(owners, dtype=torch.long, device="cpu")))
        saved["param_groups"][0]["zenflow"] = saved["zenflow"]

    def _sharded_state_dict(self, saved: dict) -> None:
        """FSDP2-sharded parameters: `saved` in the form torch.distributed.checkpoint expects (see
        runtime/sharding.py): per-row state as DTensors over the mesh, a template entry for every trainable
        parameter without state yet, and the "zenflow" entry also in param_groups[0]."""
        sharding, params = self._runtime.sharding, self._params_in_order()
        state = self._dcp_entries(saved, lambda pid: True)
        saved["state"] = {i: sharding.dcp_entry(entry, params[i]) for i, entry in state.items()}
        saved["zenflow"] = sharded.replicated_globals(saved["zenflow"])
        saved["param_groups"][0]["zenflow"] = saved["zenflow"]

    def _mark_state(self) -> None:
        """torch.distributed.checkpoint's get/set_optimizer_state_dict take an optimizer with an empty `state`
        for one that never stepped and make it step once with zero gradients and lr 0 (which would move
        ZenFlow's schedule and moments): `state` names the parameters whose state the runtime holds or will hold
        (the trainable ones of the param groups; one removed from them loses its name, which torch.optim's
        state_dict could not index)."""
        params = self._params_in_order()
        in_groups = set(map(id, params))
        for param in [p for p in self.state if id(p) not in in_groups]:
            del self.state[param]
        for param in params:
            pid = self._param_ids.get(id(param))
            if pid is not None and param not in self.state and (param.requires_grad or self._runtime.has_state(pid)):
                self.state[param] = {"zenflow": "held by the ZenFlow runtime: see ZenFlowAdamW.state_dict()"}

    def consolidated_state_dict(self, to_rank: int = 0) -> Optional[dict]:
        """Data parallel: gather every rank's part into one world-size-free state_dict on `to_rank` (None on
        the other ranks; a collective: call it on every rank), for `torch.save`. Without data parallelism,
        `state_dict()` in the same form. Load it on every rank at any world size, or in one process."""
        data_parallel = self._runtime.data_parallel
        parts = [self.state_dict()] if data_parallel is None else data_parallel.gather_object(self.state_dict(),
                                                                                                dst=to_rank)
        if parts is None:
            return None
        full = parts[0 if data_parallel is None else to_rank]
        if "data_parallel" not in full["zenflow"]:  # (one process without torch.distributed: already whole)
            return full
        full["zenflow"].pop("data_parallel")
        full["param_groups"][0].pop("zenflow")
        full["state"] = {i: {k: v for k, v in entry.items() if k != "has_state"}
                         for part in parts for i, entry in part["state"].items() if checkpoint.holds_state(entry)}
        full["state"] = dict(sorted(full["state"].items()))
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()`. As torch.optim restores the saved lr, betas, eps and weight_decay, the saved
        `max_grad_norm` is restored too (set `opt.max_grad_norm` after loading to change it). A state_dict that
        does not fit (other param groups, a parameter's state of another shape) is refused before anything
        changes, naming the parameter.

        Data parallel: a collective (call it on every rank together). Each rank takes the entries of the
        parameters it owns (DCP's form, this rank's own `state_dict()` at the same world size, or a full
        one such as `consolidated_state_dict()`), and their owners give every rank the selected columns'
        state."""
        groups = state_dict.get("param_groups") or [{}]
        zenflow = state_dict.get("zenflow", groups[0].get("zenflow"))  # (DCP's get_optimizer_state_dict form)
        if zenflow is None:
            raise ValueError("not a ZenFlowAdamW state_dict (no 'zenflow' entry); a torch.optim.AdamW "
                             "checkpoint cannot be resumed exactly by ZenFlow")
        groups = [{k: v for k, v in group.items() if k != "zenflow"} for group in state_dict["param_groups"]]
        if self._runtime.holds_step_grads:
            # torch.optim would keep `.grad` for the next step; here the gradients already live in the states
            # that loading re-creates, so they would be lost without a word.
            raise RuntimeError(
                "ZenFlowAdamW.load_state_dict() was called between a backward and step(): that backward's "
                "gradients were already handed to the optimizer and loading would discard them. Load the "
                "checkpoint before the backward, or after step() (or call zero_grad() first to drop them)")
        check_same_groups(groups, self.param_groups)
        # A parameter's entry is keyed as its place in the saved param groups says: its index (torch.optim's
        # state_dict) or its name (torch.distributed.checkpoint's get_optimizer_state_dict).
        keys = [key for group in groups for key in group["params"]]
        params = self._params_in_order()
        entries = {self.param_id(param): state_dict["state"][keys[i]] for i, param in enumerate(params)
                   if id(param) in self._param_ids and keys[i] in state_dict["state"]}
        # Checked before anything changes: a refused load leaves the optimizer as it was.
        self._check_entries_complete(zenflow.get("data_parallel"), entries,
                                     self._entries_problem(params, keys, entries))
        if self._runtime.failed:  # a worker failure or an interrupted step: loading replaces every state
            self._runtime.settle_after_failure()
        else:
            self._runtime.quiesce()
        super().load_state_dict({"state": {}, "param_groups": groups})
        self._runtime.import_globals({k: v for k, v in zenflow.items() if k != "data_parallel"})
        if "max_grad_norm" in zenflow:
            self.max_grad_norm = zenflow["max_grad_norm"]
        entries = {pid: entry for pid, entry in entries.items() if checkpoint.holds_state(entry)}
        if self._runtime.sharding is not None:
            entries = {pid: sharded.local_entry(entry) for pid, entry in entries.items()}
        self._runtime.import_states(entries)
        self._runtime.clear_failure()
        if self._runtime.sharding is not None or self._runtime.data_parallel is not None:
            self._groups_seen = None
            self._follow_param_groups()
        self._mark_state()

    def _entries_problem(self, params: list, keys: list, entries: dict) -> Optional[str]:
        """Why the entries cannot be loaded into these parameters (the first whose saved state has another
        shape than the parameter's, e.g. a checkpoint of a model with another classification head, or whose host
        row order is damaged), or None."""
        for i, param in enumerate(params):
            entry = entries.get(self._param_ids.get(id(param)))
            if entry is None or not checkpoint.holds_state(entry):
                continue
            local = sharded.local_shard(param)  # (sharded: this rank's rows of both)
            saved = checkpoint.saved_shape(sharded.local_entry(entry) if self._runtime.sharding else entry)
            wanted = checkpoint.expected_shape(local)
            name = f" ({keys[i]!r})" if isinstance(keys[i], str) else ""
            damaged = checkpoint.host_row_problem(entry)
            if damaged is not None:
                return (f"ZenFlowAdamW.load_state_dict: the checkpoint entry of {self._place(param)}{name} is "
                        f"damaged: {damaged}. Nothing was loaded. Fix: load an intact checkpoint; or delete the "
                        f"entry's 'host_row' (state_dict['state'][{keys[i]!r}]) to lay its rows out by update count")
            if saved is None or saved == wanted:
                continue
            layout = "" if wanted == tuple(local.shape) else f", whose state is [rows, columns] {wanted}"
            return (f"ZenFlowAdamW.load_state_dict: the checkpoint holds state of shape {saved} for "
                    f"{self._place(param)}{name}, which has shape {tuple(local.shape)} in this model{layout}: the "
                    "checkpoint was saved for a model of other shapes (another head or vocabulary?). Nothing was "
                    "loaded. Fix: load it into a model of the shapes it was saved from; or, to start that "
                    f"parameter's state afresh, drop its entry first (del state_dict['state'][{keys[i]!r}])")
        return None

    def _check_entries_complete(self, saved: Optional[dict], entries: dict, problem: Optional[str] = None) -> None:
        """A data-parallel state_dict holds only its rank's parameters' entries: each parameter this rank owns
        (every one, without data parallelism) must have its entry where the saving run had an owner for it
        (one rank's torch.save'd state_dict loaded by another rank, at another world size or in one process
        lacks them). `problem`: one found already (a shape). Data parallel: every rank learns every rank's
        verdict (a collective), so all raise."""
        if saved is not None and problem is None:
            runtime, owners = self._runtime, saved["owners"].tolist()
            for i, param in enumerate(self._params_in_order()):
                pid = self._param_ids.get(id(param))
                if pid is None or i >= len(owners) or owners[i] < 0 or runtime.owners.get(pid, runtime.rank) != runtime.rank:
                    continue
                if not entries.get(pid):
                    problem = (f"ZenFlowAdamW.load_state_dict: this state_dict has no state for parameter {i} "
                               f"(shape {tuple(param.shape)}), which rank {owners[i]} of the {saved['world_size']} "
                               "ranks that saved it held: it is one rank's state_dict of a data-parallel run, "
                               "which holds only the state of that rank's parameters. Fix: load it on the rank "
                               "that saved it, at the same world size; or save with torch.distributed.checkpoint "
                               "(dcp.save of every rank's state_dict, dcp.load into a new optimizer's: any world "
                               "size); or save opt.consolidated_state_dict() and load that anywhere")
                    break
        data_parallel = self._runtime.data_parallel
        verdicts = [problem] if data_parallel is None else data_parallel.all_gather_object(problem)
        problem = next((p for p in verdicts if p is not None), None)
        if problem is not None:
            raise ValueError(problem)


def check_same_groups(saved: list[dict], groups: list[dict]) -> None:
    """torch.optim's check that a state_dict's param groups match the optimizer's, made before anything is
    loaded."""
    if len(saved) != len(groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved)}) than the "
                         f"optimizer ({len(groups)})")
    sizes = [(len(s["params"]), len(g["params"])) for s, g in zip(saved, groups)]
    if any(a != b for a, b in sizes):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                         f"group (parameters per group: saved {[a for a, _ in sizes]}, this optimizer "
                         f"{[b for _, b in sizes]})")
