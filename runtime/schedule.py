"""When things happen (docs/semantics.md): update boundaries (an int interval, or Zen-auto's ripeness),
reselections (every `select_interval` steps, on the epoch grid, or on drift) and the columns they choose. It
keeps, per phase, what those decisions read. With stagger_boundaries, phase q runs the one-phase schedule at
step t + q."""

from __future__ import annotations

import torch

from zenflow_compile.runtime.state.layout import columns_not_in, top_k_columns
from zenflow_compile.runtime.state.members import Member


class Schedule:
    def __init__(self, config):
        self.config = config
        phases = config.num_phases
        self.selection_start = [0] * phases  # first step run under the current selection (at the phase's clock)
        self.selection_epoch = [0] * phases  # select_strategy="epoch": epoch-grid points passed at the last one
        self.steps_accumulated = [0] * phases  # steps since the phase's last update boundary

    def boundaries(self, t: int, phases: list[int], stepped_matrices: list[Member], members: list[Member],
                   mean_scores: dict[int, tuple[float, float]], coef: float) -> list[int]:
        """The `phases` in use with an update boundary at step t. Zen-auto adds the step's mean scores (of the
        clipped gradient) to the members' sums."""
        cfg = self.config
        if t < cfg.full_warm_up_rounds:
            return phases  # warm-up: a plain synchronous AdamW of every column, every step
        if not cfg.auto_update:
            return [q for q in phases if (t + q - cfg.full_warm_up_rounds + 1) % cfg.update_interval == 0]
        # Zen-auto: a matrix is ripe once its unselected columns' mean score, summed over the interval,
        # reaches the interval's average of its selected columns' mean score.
        for m in stepped_matrices:
            if m.pid in mean_scores:
                selected_mean, unselected_mean = mean_scores[m.pid]
                m.sum_selected_score += selected_mean * coef * coef
                m.sum_unselected_score += unselected_mean * coef * coef
        accumulating = [m for m in members if m.is_matrix and m.steps_accumulated > 0]
        ripe = sum(1 for m in accumulating if not m.slab.u
                   or m.sum_unselected_score >= m.sum_selected_score / m.steps_accumulated)
        boundary = (not accumulating or ripe >= cfg.auto_ratio * len(accumulating)
                    or self.steps_accumulated[0] >= cfg.max_update_interval)
        return [0] if boundary else []

    def step_accumulated(self) -> None:
        for phase in range(self.config.num_phases):
            self.steps_accumulated[phase] += 1

    def interval_started(self, phase: int, members: list[Member]) -> None:
        """A boundary of `phase` took its interval's sums: its members' counts and Zen-auto sums restart."""
        self.steps_accumulated[phase] = 0
        for m in members:
            if m.phase == phase:
                m.sum_selected_score = m.sum_unselected_score = 0.0
                m.steps_accumulated = 0

    def may_reselect(self, t: int, phase: int) -> bool:
        """Whether the boundary of step t of `phase` reselects, or ("auto") must look at the scores to decide."""
        cfg, t = self.config, t + phase
        if cfg.select_strategy == "epoch":  # the first boundary at or after each point of the epoch grid
            return self._epoch_grid_point(t) > self.selection_epoch[phase]
        if cfg.reselect_every is not None:
            return t - self.selection_start[phase] + 1 >= cfg.reselect_every
        return True

    def should_reselect(self, slabs: list, host_scores: list[torch.Tensor]) -> bool:
        """After `may_reselect`: "auto" reselects once matrices holding half of the columns kept fewer than half
        of their selection in this step's top-k (`slabs`: (slab, members with a gradient, None: all))."""
        cfg = self.config
        if cfg.select_strategy == "epoch" or cfg.reselect_every is not None:
            return True  # may_reselect decided
        drifted_columns = total_columns = 0
        for (slab, rows), scores in zip(slabs, host_scores):
            members = range(slab.n) if rows is None else rows
            top = top_k_columns(scores, slab.k)
            kept = (~columns_not_in(top, slab.selected_cpu)).sum(1)  # [n]
            for i in members:
                if 2 * int(kept[i]) < slab.k:
                    drifted_columns += slab.C
                total_columns += slab.C
        return total_columns > 0 and 2 * drifted_columns >= total_columns

    @staticmethod
    def chosen_selections(slabs: list, host_scores: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each slab's new selection ([n, k]): the top-k of this step's scores; a member without a gradient this
        step keeps its columns."""
        chosen = []
        for (slab, rows), scores in zip(slabs, host_scores):
            selected = top_k_columns(scores, slab.k)
            if rows is not None:
                keep = [i for i in range(slab.n) if i not in rows]
                selected[keep] = slab.selected_cpu[keep]
            chosen.append(selected)
        return chosen

    def reselected(self, t: int, phase: int) -> None:
        self.selection_start[phase] = t + phase + 1
        self.selection_epoch[phase] = self._epoch_grid_point(t + phase)

    def _epoch_grid_point(self, t: int) -> int:
        """How many multiples of select_interval * steps_per_epoch steps (from W) have completed by step t."""
        cfg = self.config
        if cfg.select_strategy != "epoch":
            return 0
        return (t - cfg.full_warm_up_rounds + 1) // cfg.reselect_every

    # -- checkpoints ----------------------------------------------------------------------------------------
    def export(self) -> dict:
        return dict(selection_start=list(self.selection_start), selection_epoch=list(self.selection_epoch),
                    steps_accumulated=list(self.steps_accumulated))

    def load(self, saved: dict) -> None:
        self.selection_start = per_phase(saved["selection_start"])
        self.selection_epoch = per_phase(saved.get("selection_epoch", 0))
        self.steps_accumulated = per_phase(saved["steps_accumulated"])


def per_phase(value) -> list:
    """A per-phase value of a checkpoint as a list (saved before phases: one value, the one phase's)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


__all__ = ["Schedule", "per_phase"]
