"""Per-parameter optimizer state, split between the device and host memory.

A *matrix* (dim >= 2, viewed as [R, C]) keeps the state of its selected columns on the device and the state
of the others in host memory; a *vector* keeps all of its state on the device. Every column owns an fp32
master, two moments and an update count; when the selection changes the state moves with its column.

Host rows are stored transposed, [columns, R], so one column is one contiguous row: the offload of a
column is one contiguous copy and the CPU AdamW runs over whole rows. Host columns are ordered by update
count, so the columns sharing a count form contiguous runs, one fused-AdamW "tensor" each (all host
columns are updated at every boundary, so the runs stay runs until the next reselection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from zenflow_compile.runtime.adamw import adamw_columns_

HostRun = tuple[int, int, torch.Tensor]  # rows [start, end) of the host buffers and their shared count


@dataclass
class CanonicalState:
    """A parameter's whole optimizer state in its natural layout, on the host (for moves and checkpoints)."""

    master: torch.Tensor  # fp32 [R, C] (vectors: [N])
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # fp32 [C] per-column update counts (vectors: [1])


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties to the lower index, returned in ascending order (on the host)."""
    order = torch.sort(scores.detach().cpu(), descending=True, stable=True).indices
    return order[:k].sort().values


def _host_buffer(shape, dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class VectorState:
    """A bias or norm weight: a full AdamW on the device every step."""

    is_matrix = False

    def __init__(self, param: torch.Tensor, pid: int, group_index: int):
        self.param, self.pid, self.group_index = param, pid, group_index
        self.master = param.detach().float().clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step = torch.zeros(1, device=param.device)
        self.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        self.score = torch.zeros(1, device=param.device)
        self.num_grads = 0

    def receive_grad(self, grad: torch.Tensor, score: Optional[torch.Tensor], grad_slot: int) -> int:
        grad = grad.detach()
        if score is None:
            score = grad.float().pow(2).sum().reshape(1)
        if self.num_grads == 0:
            self.grad.copy_(grad)
            self.score.copy_(score.reshape(1))
        else:
            self.grad.add_(grad)
        self.num_grads += 1
        return 0

    def step_sumsq(self, grad_slot: int) -> torch.Tensor:
        if self.num_grads > 1:  # the sum of squares of a sum needs the summed gradient
            self.score.copy_(self.grad.float().pow(2).sum().reshape(1))
        return self.score.sum()

    def update_on_device(self, coef: float, hp: dict) -> None:
        self.step += 1
        adamw_columns_(self.master, self.exp_avg, self.exp_avg_sq, self.grad.float() * coef, self.step, **hp)
        self.param.data.copy_(self.master)

    def canonical(self) -> CanonicalState:
        return CanonicalState(self.master.cpu().clone(), self.exp_avg.cpu().clone(),
                              self.exp_avg_sq.cpu().clone(), self.step.cpu().clone())

    def load_canonical(self, state: CanonicalState) -> None:
        device = self.param.device
        self.master.copy_(state.master.to(device))
        self.exp_avg.copy_(state.exp_avg.to(device))
        self.exp_avg_sq.copy_(state.exp_avg_sq.to(device))
        self.step.copy_(state.step.reshape(1).to(device))


class MatrixState:
    """A weight matrix: selected columns' state on the device, the rest's in (pinned) host memory."""

    is_matrix = True

    def __init__(self, param: torch.Tensor, pid: int, group_index: int):
        if not param.is_contiguous():
            raise ValueError(
                f"ZenFlowAdamW needs contiguous parameters; got one of shape {tuple(param.shape)} with strides "
                f"{param.stride()}. Make it contiguous (param.data = param.data.contiguous()) first.")
        self.param, self.pid, self.group_index = param, pid, group_index
        self.rows = param.shape[0]
        self.cols = param.numel() // self.rows
        self.device = param.device
        self.pin = param.device.type == "cuda"
        self.scores = torch.zeros(self.cols, device=self.device)
        self.num_grads = 0
        # Zen-auto: mean selected / unselected scores summed since the last CPU update.
        self.sum_selected_score = 0.0
        self.sum_unselected_score = 0.0
        self.steps_accumulated = 0  # steps whose gradient went into the accumulator since the last update
        master = param.detach().reshape(self.rows, self.cols).float().cpu()
        zeros = torch.zeros_like(master)
        self._distribute(torch.zeros(0, dtype=torch.long),
                         CanonicalState(master, zeros, zeros.clone(), torch.zeros(self.cols)))

    # -- layout -------------------------------------------------------------------------------------------
    @property
    def num_selected(self) -> int:
        return self.selected.numel()

    @property
    def num_host(self) -> int:
        return self.host_columns.numel()

    def as_columns(self) -> torch.Tensor:
        """The device parameter viewed as [R, C] (a view: writes land in the parameter)."""
        return self.param.data.view(self.rows, self.cols)

    def _distribute(self, selected: torch.Tensor, state: CanonicalState,
                    step_grad: Optional[torch.Tensor] = None) -> None:
        """Lay `state` out for selection `selected` (ascending host LongTensor); `step_grad` moves with it."""
        unselected_mask = torch.ones(self.cols, dtype=torch.bool)
        unselected_mask[selected] = False
        unselected = unselected_mask.nonzero().flatten()
        host_columns = unselected[torch.sort(state.step[unselected], stable=True).indices]

        dev, grad_dtype = self.device, self.param.dtype
        self.selected, self.selected_on_device = selected, selected.to(dev)
        self.dev_master = state.master[:, selected].to(dev)
        self.dev_exp_avg = state.exp_avg[:, selected].to(dev)
        self.dev_exp_avg_sq = state.exp_avg_sq[:, selected].to(dev)
        self.dev_step = state.step[selected].to(dev)
        self.dev_grad = torch.zeros(self.rows, selected.numel(), device=dev, dtype=grad_dtype)

        self.host_columns, self.host_columns_on_device = host_columns, host_columns.to(dev)
        shape, pin = (host_columns.numel(), self.rows), self.pin
        self.host_master = _host_buffer(shape, torch.float32, pin)
        self.host_master.copy_(state.master[:, host_columns].t())
        self.host_exp_avg = _host_buffer(shape, torch.float32, pin)
        self.host_exp_avg.copy_(state.exp_avg[:, host_columns].t())
        self.host_exp_avg_sq = _host_buffer(shape, torch.float32, pin)
        self.host_exp_avg_sq.copy_(state.exp_avg_sq[:, host_columns].t())
        self.host_runs = self._runs_of_equal_count(state.step[host_columns])
        # Double buffers: the step's offloaded gradient (by step parity) and the accumulator (by interval
        # parity), so the next step/interval fills one while the CPU worker reads the other.
        self.host_grads = [_host_buffer(shape, grad_dtype, pin) for _ in range(2)]
        self.accumulators = [_host_buffer(shape, torch.float32, pin) for _ in range(2)]

        if step_grad is not None:
            self.dev_grad.copy_(step_grad[:, selected].to(dev))
            for buffer in self.host_grads:
                buffer.copy_(step_grad[:, host_columns].t())

    @staticmethod
    def _runs_of_equal_count(counts: torch.Tensor) -> list[HostRun]:
        runs, start = [], 0
        values, lengths = torch.unique_consecutive(counts, return_counts=True)
        for value, length in zip(values.tolist(), lengths.tolist()):
            runs.append((start, start + length, torch.tensor(float(value))))
            start += length
        return runs

    def canonical(self, grad_slot: Optional[int] = None) -> tuple[CanonicalState, Optional[torch.Tensor]]:
        """The whole state in [R, C] layout on the host, plus this step's gradient if `grad_slot` is given."""
        R, C = self.rows, self.cols
        state = CanonicalState(*(torch.empty(R, C) for _ in range(3)), torch.empty(C))
        for full, dev, host in ((state.master, self.dev_master, self.host_master),
                                (state.exp_avg, self.dev_exp_avg, self.host_exp_avg),
                                (state.exp_avg_sq, self.dev_exp_avg_sq, self.host_exp_avg_sq)):
            full[:, self.selected] = dev.cpu()
            full[:, self.host_columns] = host.t()
        state.step[self.selected] = self.dev_step.cpu()
        for start, end, count in self.host_runs:
            state.step[self.host_columns[start:end]] = count
        step_grad = None
        if grad_slot is not None:
            step_grad = torch.empty(R, C, dtype=self.param.dtype)
            step_grad[:, self.selected] = self.dev_grad.cpu()
            step_grad[:, self.host_columns] = self.host_grads[grad_slot].t()
        return state, step_grad

    def select(self, selected: torch.Tensor, grad_slot: Optional[int] = None) -> int:
        """Make `selected` the device-resident columns, moving state (and this step's grad if `grad_slot`).

        Returns the number of columns that changed sides. Accumulators must be empty (they are at every
        reselection boundary, and before the first selection).
        """
        moved = selected.numel() + self.num_selected - 2 * int(torch.isin(selected, self.selected).sum())
        state, step_grad = self.canonical(grad_slot)
        self._distribute(selected, state, step_grad)
        return moved

    # -- one step -----------------------------------------------------------------------------------------
    def receive_grad(self, grad: torch.Tensor, scores: Optional[torch.Tensor], grad_slot: int) -> int:
        """Take one backward's gradient: keep selected columns on the device, offload the rest.

        Returns the bytes copied device -> host.
        """
        g = grad.detach().reshape(self.rows, self.cols)
        if scores is None:
            scores = g.float().pow(2).sum(0)
        first = self.num_grads == 0
        self.num_grads += 1
        if self.num_selected:
            chosen = g.index_select(1, self.selected_on_device)
            self.dev_grad.copy_(chosen) if first else self.dev_grad.add_(chosen)
        self.scores.copy_(scores) if first else self.scores.add_(scores)
        if not self.num_host:
            return 0
        rest = g.t().index_select(0, self.host_columns_on_device)  # [n_host, R], one row per column
        buffer = self.host_grads[grad_slot]
        if first:
            buffer.copy_(rest)
        else:
            buffer.add_(rest.to(buffer.device))
        return rest.numel() * rest.element_size()

    def step_sumsq(self, grad_slot: int) -> torch.Tensor:
        """Sum of squares of this step's gradient; makes `scores` exact when several backwards summed."""
        if self.num_grads > 1:
            exact = torch.empty(self.cols, device=self.device)
            exact[self.selected_on_device] = self.dev_grad.float().pow(2).sum(0)
            exact[self.host_columns_on_device] = self.host_grads[grad_slot].float().pow(2).sum(1).to(self.device)
            self.scores.copy_(exact)
        return self.scores.sum()

    def update_on_device(self, coef: float, hp: dict) -> None:
        if not self.num_selected:
            return
        self.dev_step += 1
        adamw_columns_(self.dev_master, self.dev_exp_avg, self.dev_exp_avg_sq, self.dev_grad.float() * coef,
                       self.dev_step, **hp)
        self.as_columns().index_copy_(1, self.selected_on_device, self.dev_master.to(self.param.dtype))

    def accumulate(self, grad_slot: int, acc_slot: int, coef: float) -> None:
        """acc += coef * g (host, worker thread)."""
        self.accumulators[acc_slot].add_(self.host_grads[grad_slot].float() * coef)

    def host_adamw_batch(self, acc_slot: int, num_steps: int):
        """Fused-AdamW arguments for the boundary update of the host columns (mean gradient), per run."""
        acc = self.accumulators[acc_slot]
        acc.div_(num_steps)
        for start, end, count in self.host_runs:
            yield (self.host_master[start:end], acc[start:end], self.host_exp_avg[start:end],
                   self.host_exp_avg_sq[start:end], count)

    def apply_host_columns(self) -> int:
        """Write the host masters of the unselected columns into the device parameter; returns bytes."""
        if not self.num_host:
            return 0
        values = self.host_master.t().to(self.device, self.param.dtype, non_blocking=True)
        self.as_columns().index_copy_(1, self.host_columns_on_device, values)
        return values.numel() * values.element_size()
