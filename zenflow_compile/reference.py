"""ZenFlow eager reference: the ORACLE every other test is checked against.

A short, plain, synchronous implementation of docs/semantics.md. Speed is irrelevant: there are no threads and
no host/device split; every parameter keeps full-size fp32 state (master, exp_avg, exp_avg_sq, per-column
update counts and, for matrices, the accumulator of the unselected columns' gradients). Over float64 parameters
all of it, the gradients and the global norm are float64: the same algorithm without fp32 rounding, which the
tests compare fp32 runs against to know how far rounding alone moves a workflow.

Its decisions in detail (the rest of the project follows them):

- t counts completed (non-skipped) steps; W = full_warm_up_rounds.
- Global norm = sqrt(sum over params with a grad of sum(g.float()**2)), in fp32 (float64 if any parameter
  is float64). Not finite: the step is
  skipped entirely (nothing changes, t and all counters stay), stats()["skipped_steps"] += 1.
- A parameter whose .grad is None is skipped for the step entirely (as torch.optim.AdamW does): no update,
  no accumulation, no scores, not counted in the Zen-auto / drift decisions. A step with no gradient at all
  does nothing (t, boundaries and counters stay). A matrix gets its first
  selection at the first step t >= W at which it has a grad.
- Clipping (max_grad_norm): coef = min(1, max_grad_norm / (norm + 1e-6)); every g is scaled by coef before
  scores, K_t / U_t and the accumulator use it.
- Scores s = (g**2).sum(0) of the [R, C] view; S = first k of a stable descending sort of s (ties: lower
  index first), kept sorted ascending; k = config.num_selected(C).
- Warm-up (t < W): plain AdamW on every parameter, no boundaries, no Zen-auto bookkeeping.
- t >= W: vectors and the columns of S get AdamW with g (device copy refreshed); the other columns U do
  acc[:, U] += g[:, U] and acc_n[U] += 1. acc_n counts, per column, the steps in its accumulator (equal to
  the global m_acc unless some grads were None). A CPU update of columns gives each column j one AdamW update with
  g = acc[:, j] / acc_n[j] (columns with acc_n 0 are left alone), then empties their acc and acc_n.
  Opt-in keys: interval_aware_update multiplies that update's lr by acc_n[j] ("sqrt": by its square root);
  interval_second_moment also accumulates acc_sq[:, U] += g[:, U]**2 and feeds exp_avg_sq acc_sq / acc_n
  instead of g * g.
  Each matrix also counts acc_steps, its steps accumulated since its last boundary, for Zen-auto.
- Zen-auto: per matrix sumK += mean(s[S]), sumU += mean(s[U]) (fp32 means summed as Python floats). Ripe
  iff sumU >= sumK / acc_steps, or U is empty. Boundary iff #ripe >= auto_ratio * #matrices or
  m_acc >= max_update_interval (#matrices: those with acc_steps > 0; none at all: every step is a boundary).
  Int update_interval S: boundary iff (t - W + 1) % S == 0.
- Reselection, only at boundaries, from this step's scores: "step": iff t - sel_start + 1 >=
  select_interval (sel_start starts at W); "epoch": at the first boundary at or after each multiple of
  E = select_interval * steps_per_epoch completed steps counted from W, i.e. iff (t - W + 1) // E has grown
  since the last selection (on the grid, never drifting). "auto": a matrix has drifted iff 2*|S & topk(s)| < k;
  reselect iff 2 * sum(C of drifted) >= sum(C) over matrices with a grad this step (no matrix: never).
- At a boundary, in order: (1) overlap and pending: device[:, U] = master[:, U] for every matrix (the
  update in flight lands); (2) CPU update of U (above), acc_steps/sums reset, cpu_updates += 1; (3) overlap
  and not reselecting: pending = True (device U stays stale until it lands: at the next boundary, at the
  end of step t + landing_lag, or at synchronize()), else device[:, U] = master[:, U]
  (stats()["overlapped_boundaries"] counts the pending ones); (4) reselecting: S = top-k(s), sel_start =
  t + 1, reselections += 1. Nothing in the state is reset on reselection (state "moves with the column").
- Switching a matrix's selection from S to S_new: the columns joining it (S_new minus S) first get the CPU
  update of what their accumulator holds (nothing at a boundary, where (2) has just emptied it), then
  device := master for them; the columns leaving it keep their state and start with an empty accumulator.
  So every step's gradient reaches every column exactly once: as a device update while the column is
  selected, or in the one CPU update that empties the accumulator it went into.
- landing_lag L (with overlap_step; None: land at the next boundary): (5) at a step t that is not a
  boundary, t == land_at (= b + L, set in (3) of a pending boundary b; cleared at every boundary, so with
  update_interval="auto" an earlier boundary lands it in (1)): after the step's updates, pending: device[:, U]
  = master[:, U], pending = False. L = S (int interval) lands at the next boundary in (1): the same as None.
  synchronize() lands early.
- overlap_reselect (with overlap_step): "wait" is the above. "incoming": in (3) a reselecting
  boundary stays pending like any other; in (4) the switch makes the columns joining S current at once, the
  others of U keep the boundary's update in flight until it lands.
- stagger_boundaries (int S): each matrix has a phase q in 0..S-1, fixed when the optimizer takes it
  (add_param_group, the constructor's groups included, in their order; floating-point matrices only): the
  phase holding the fewest elements so far, the lowest on a tie. Everything above that is global per
  boundary (m_acc, pending, land_at, sel_start, sel_epoch, the "auto" drift vote) is kept per phase, and
  phase q runs the one-phase schedule at step t + q: its boundaries are the steps with (t + q - W + 1) % S
  == 0, its reselection tests read t + q (sel_start starts at W on every phase's clock), and (1)-(5) at its
  boundary touch only its matrices. A phase holding no matrix has no boundaries (phase 0 always counts);
  stats()["current_interval"] is the longest of the phases', "pending" whether any phase's is.
- lr / betas / eps / weight_decay: the param group's values at the step the update is made.
- The parameter is the source of truth for its value: state is created from the parameter at its first
  gradient, and at every step() (and synchronize()) each element that differs from what this optimizer last
  wrote into the parameter was written by someone else, and its value becomes the master. Parameters that
  never get a gradient are never written.
- The first selection (t == W) is not counted in stats()["reselections"].
- state_dict() returns a deep copy (torch's returns live references) with the global counters under
  "zenflow"; load_state_dict() restores state tensors exactly (no cast to the param dtype).
"""

from __future__ import annotations

import copy
from itertools import chain

import torch

from zenflow_compile.config import ZenFlowConfig

__all__ = ["ZenFlowReference", "adamw_", "top_k"]


def adamw_(master, exp_avg, exp_avg_sq, count, grad, lr, beta1, beta2, eps, weight_decay, grad_sq=None):
    """One torch.optim.AdamW step (single-tensor, non-fused) in place on [R, C] fp32 tensors.

    ``count`` holds the per-column update counts ([C], or [1] to broadcast) and is incremented first. Bias
    corrections are computed per column in Python floats exactly as torch does, then rounded to fp32.
    ``grad_sq`` (interval_second_moment): what exp_avg_sq takes instead of grad * grad.
    """
    count += 1
    steps = count.tolist()
    on = dict(dtype=torch.float64, device=master.device)
    step_size_neg = torch.tensor([-(lr / (1 - beta1 ** n)) for n in steps], **on).to(master.dtype)
    bc2_sqrt = torch.tensor([(1 - beta2 ** n) ** 0.5 for n in steps], **on).to(master.dtype)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    if grad_sq is None:
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    else:
        exp_avg_sq.mul_(beta2).add_(grad_sq, alpha=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.add_(step_size_neg * exp_avg / denom)  # == addcdiv_(exp_avg, denom, value=-step_size)


def _state_dtype(p):
    """fp32 state (float64 over float64 parameters: the algorithm without fp32 rounding)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _bits(dtype):
    return torch.finfo(dtype).bits


def top_k(scores, k):
    """Indices of the k largest scores (ties: lower index first), sorted ascending."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values


class ZenFlowReference(torch.optim.Optimizer):
    """Eager, synchronous ZenFlow AdamW (see the module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 max_grad_norm=None, config: ZenFlowConfig | None = None, preset: str | None = None,
                 **zenflow_keys):
        if config is not None and zenflow_keys:
            raise ValueError(f"pass either config= or ZenFlow keys, not both (got keys {sorted(zenflow_keys)})")
        if config is not None and preset is not None:
            raise ValueError(f"pass either config= or preset={preset!r}, not both (a config's keys are all set)")
        if config is None:
            config = ZenFlowConfig.from_dict(zenflow_keys, preset=preset)
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr!r} is invalid: expected >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"eps={eps!r} is invalid: expected >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas!r} is invalid: expected two floats in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay={weight_decay!r} is invalid: expected >= 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid: expected None or > 0")
        self.config = config
        # stagger_boundaries: each matrix's phase, and the elements each phase holds (add_param_group fills them)
        self._phase, self._phase_numel = {}, [0] * config.num_phases
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        W = config.full_warm_up_rounds
        self.zf = dict(t=0, phases=[dict(sel_start=W, sel_epoch=0, m_acc=0, pending=False, land_at=None)
                                    for _ in range(config.num_phases)],
                       skipped_steps=0, cpu_updates=0, reselections=0, overlapped_boundaries=0)

    def add_param_group(self, param_group):
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group = {**param_group, "params": params}
        for i, p in enumerate(params):
            p = p[1] if isinstance(p, tuple) else p
            if isinstance(p, torch.Tensor) and self._is_matrix(p) and p.numel() == 0:  # (as ZenFlowAdamW)
                raise ValueError(f"ZenFlowReference: parameter {i} of param group {len(self.param_groups)} (shape "
                                 f"{tuple(p.shape)}) is an empty matrix; ZenFlow views a matrix as [rows, columns] "
                                 "and needs at least one of each. Fix: leave empty parameters out")
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:  # (a matrix's phase is fixed when the optimizer takes it)
            if self._is_matrix(p) and p.is_floating_point() and p not in self._phase:
                phase = self._phase[p] = self._phase_numel.index(min(self._phase_numel))
                self._phase_numel[phase] += p.numel()

    # ------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _is_matrix(p):
        return p.dim() >= 2

    @staticmethod
    def _shape2d(p):
        """[R, C] view of a matrix; a vector is one column of all its elements."""
        return (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else (p.numel(), 1)

    def _init_state(self, p):
        st = self.state[p]
        R, C = self._shape2d(p)
        dtype = _state_dtype(p)
        st["master"] = p.detach().reshape(R, C).to(dtype, copy=True)
        st["exp_avg"] = torch.zeros(R, C, dtype=dtype, device=p.device)
        st["exp_avg_sq"] = torch.zeros(R, C, dtype=dtype, device=p.device)
        st["count"] = torch.zeros(C if self._is_matrix(p) else 1, dtype=torch.long, device=p.device)
        if self._is_matrix(p):
            st["acc"] = torch.zeros(R, C, dtype=dtype, device=p.device)
            st["acc_n"] = torch.zeros(C, dtype=torch.long, device=p.device)  # steps in acc, per column
            if self.config.interval_second_moment:
                st["acc_sq"] = torch.zeros(R, C, dtype=dtype, device=p.device)
            st["acc_steps"], st["sumK"], st["sumU"] = 0, 0.0, 0.0
        st["written"] = p.detach().clone()  # what this optimizer last left in the parameter
        return st

    def _adopt_external_writes(self):
        """Elements of a parameter that differ from what this optimizer last wrote become the master."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                changed = (p.detach() != st["written"]).reshape(st["master"].shape)
                if changed.any():
                    st["master"][changed] = p.detach().reshape(st["master"].shape).to(st["master"].dtype)[changed]
                    st["written"] = p.detach().clone()

    @staticmethod
    def _update_columns(st, g2d, cols, group, g2d_sq=None):
        """AdamW on the columns ``cols`` (None: all) of a parameter's state, with gradient g2d[:, cols] (and
        ``g2d_sq[:, cols]`` for the second moment, if given)."""
        beta1, beta2 = group["betas"]
        hp = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
        if cols is None:
            adamw_(st["master"], st["exp_avg"], st["exp_avg_sq"], st["count"], g2d, *hp)
            return
        parts = [st[k][:, cols] for k in ("master", "exp_avg", "exp_avg_sq")]
        n = st["count"][cols]
        adamw_(*parts, n, g2d[:, cols], *hp, grad_sq=None if g2d_sq is None else g2d_sq[:, cols])
        for k, v in zip(("master", "exp_avg", "exp_avg_sq"), parts):
            st[k][:, cols] = v
        st["count"][cols] = n

    def _write_device(self, p, cols=None):
        """Device copy := master cast to p.dtype, on the columns ``cols`` (None: everything)."""
        master = self.state[p]["master"]
        if cols is None:
            p.data.copy_(master.reshape(p.shape))
        else:
            dev = p.data.reshape(master.shape).clone()
            dev[:, cols] = master[:, cols].to(p.dtype)
            p.data.copy_(dev.reshape(p.shape))
        self.state[p]["written"] = p.detach().clone()

    def _unselected(self, p):
        st = self.state[p]
        keep = torch.ones(st["count"].numel(), dtype=torch.bool, device=p.device)
        keep[st["S"]] = False
        return keep.nonzero().flatten()

    def _matrices(self, phase=None):
        """(group, p) of the matrices with a selection (of one phase's, if given)."""
        return [(g, p) for g in self.param_groups for p in g["params"] if "S" in self.state.get(p, {})
                and (phase is None or self._phase[p] == phase)]

    def _apply_unselected(self, phase=None):
        for _, p in self._matrices(phase):
            self._write_device(p, self._unselected(p))

    def _phases_in_use(self):
        """Phase 0 and the phases holding a matrix (a phase without one has no boundaries)."""
        return sorted({0, *self._phase.values()})

    def _land(self, phase):
        """The CPU update of `phase` in flight, if any, lands: the device copy of its unselected columns."""
        zp = self.zf["phases"][phase]
        if zp["pending"]:
            self._apply_unselected(phase)
            zp["pending"] = False
        zp["land_at"] = None

    def _host_update(self, group, p, cols):
        """The CPU update of the columns ``cols`` of matrix p: one AdamW update of each column with the mean of
        the m gradients its accumulator holds (m its own count; columns with m = 0 are left alone), then their
        accumulator is emptied. Columns with the same m are updated together (at a boundary that is all of
        them, unless a column left the selection since the last one)."""
        cfg, st = self.config, self.state[p]
        n = st["acc_n"][cols]
        for m in sorted(set(n.tolist()) - {0}):
            hp = dict(group, lr=group["lr"] * cfg.interval_lr_scale(m))  # (1 unless interval_aware_update)
            mean_sq = st["acc_sq"] / m if cfg.interval_second_moment else None
            self._update_columns(st, st["acc"] / m, cols[n == m], hp, mean_sq)
        st["acc"][:, cols] = 0
        if cfg.interval_second_moment:
            st["acc_sq"][:, cols] = 0
        st["acc_n"][cols] = 0

    def _switch(self, group, p, S_new):
        """The selection of matrix p becomes S_new. The columns joining it first get what the host holds for
        them (their accumulated gradient, as one update) and are made current on the device; the columns
        leaving it start on the host with an empty accumulator."""
        st = self.state[p]
        incoming = S_new[~torch.isin(S_new, st["S"])]
        self._host_update(group, p, incoming)
        st["S"] = S_new
        self._write_device(p, incoming)

    # ---------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        z, cfg, W = self.zf, self.config, self.config.full_warm_up_rounds
        t = z["t"]
        self._adopt_external_writes()
        live = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not live:  # no gradient since the last step: nothing happens, as with torch.optim.AdamW
            return loss
        grads = {}
        total = torch.zeros((), dtype=max((_state_dtype(p) for _, p in live), key=_bits), device="cpu")
        for _, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("ZenFlowReference does not support sparse gradients")
            grads[p] = p.grad.detach().to(_state_dtype(p))
            total = total + (grads[p] ** 2).sum().cpu()
        norm = total.sqrt()
        if not torch.isfinite(norm):
            z["skipped_steps"] += 1
            return loss
        if self.max_grad_norm is not None:
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            grads = {p: g * coef.to(g.device) for p, g in grads.items()}

        for _, p in live:
            if not self.state[p]:
                self._init_state(p)
        if t < W:  # warm-up: plain AdamW everywhere
            for group, p in live:
                self._update_columns(self.state[p], grads[p].reshape(self._shape2d(p)), None, group)
                self._write_device(p)
            z["t"] = t + 1
            return loss

        scores = {}
        for group, p in live:
            st, g2d = self.state[p], grads[p].reshape(self._shape2d(p))
            if not self._is_matrix(p):
                self._update_columns(st, g2d, None, group)
                self._write_device(p)
                continue
            s = scores[p] = (g2d ** 2).sum(0)
            if "S" not in st:  # first selection, before this step's updates
                st["S"] = top_k(s, cfg.num_selected(s.numel()))
            S, U = st["S"], self._unselected(p)
            self._update_columns(st, g2d, S, group)
            self._write_device(p, S)
            st["acc"][:, U] += g2d[:, U]
            if cfg.interval_second_moment:
                st["acc_sq"][:, U] += g2d[:, U] ** 2
            st["acc_n"][U] += 1
            st["acc_steps"] += 1
            if cfg.auto_update and U.numel() > 0:
                st["sumK"] += s[S].mean().item()
                st["sumU"] += s[U].mean().item()
        for zp in z["phases"]:
            zp["m_acc"] += 1

        # Which phase's update boundary is step t? (Zen-auto and int S unstaggered: the one phase's, or none.)
        if cfg.auto_update:
            acc_mats = [p for _, p in self._matrices() if self.state[p]["acc_steps"] > 0]
            ripe = sum(1 for p in acc_mats if self._unselected(p).numel() == 0
                       or self.state[p]["sumU"] >= self.state[p]["sumK"] / self.state[p]["acc_steps"])
            boundaries = [0] if (not acc_mats or ripe >= cfg.auto_ratio * len(acc_mats)
                                 or z["phases"][0]["m_acc"] >= cfg.max_update_interval) else []
        else:  # phase q runs the one-phase schedule at step t + q
            boundaries = [q for q in self._phases_in_use() if (t + q - W + 1) % cfg.update_interval == 0]

        for q in boundaries:
            zp, tq = z["phases"][q], t + q
            phase_scores = {p: s for p, s in scores.items() if self._phase[p] == q}
            # Reselect? Decided from this step's scores.
            if cfg.select_strategy == "epoch":
                reselect = (tq - W + 1) // cfg.reselect_every > zp["sel_epoch"]
            elif cfg.reselect_every is not None:
                reselect = tq - zp["sel_start"] + 1 >= cfg.reselect_every
            else:
                total_c = drifted_c = 0
                for p, s in phase_scores.items():
                    S, k = self.state[p]["S"], cfg.num_selected(s.numel())
                    total_c += s.numel()
                    if 2 * torch.isin(S, top_k(s, k)).sum().item() < k:
                        drifted_c += s.numel()
                reselect = total_c > 0 and 2 * drifted_c >= total_c
            # (1) the previous boundary's CPU update lands, if still in flight (overlap)
            self._land(q)
            # (2) CPU update of the unselected columns with the mean accumulated gradient
            for group, p in self._matrices(q):
                st = self.state[p]
                self._host_update(group, p, self._unselected(p))
                st["acc_steps"], st["sumK"], st["sumU"] = 0, 0.0, 0.0
            zp["m_acc"] = 0
            z["cpu_updates"] += 1
            # (3) apply it now, or leave it in flight until the next boundary
            waits = reselect and cfg.overlap_reselect == "wait"
            if cfg.overlap_step and not waits:
                zp["pending"] = True
                zp["land_at"] = None if cfg.landing_lag is None else t + cfg.landing_lag
                z["overlapped_boundaries"] += 1
            else:
                self._apply_unselected(q)
            # (4) reselection: the selection decided now takes effect; the columns joining it are made current
            # on the device at once.
            if reselect:
                groups = {p: g for g, p in self._matrices(q)}
                for p, s in phase_scores.items():
                    self._switch(groups[p], p, top_k(s, cfg.num_selected(s.numel())))
                zp["sel_start"] = tq + 1
                if cfg.select_strategy == "epoch":
                    zp["sel_epoch"] = (tq - W + 1) // cfg.reselect_every
                z["reselections"] += 1
        for q, zp in enumerate(z["phases"]):
            if q not in boundaries and zp["land_at"] == t:
                self._land(q)  # (5) landing_lag: the update in flight lands at the end of step b + L.
        z["t"] = t + 1
        return loss

    @torch.no_grad()
    def synchronize(self):
        """Apply the CPU update still in flight (overlap_step), if any."""
        self._adopt_external_writes()
        for q in range(self.config.num_phases):
            self._land(q)

    # ------------------------------------------------------------------------------------ inspection
    def stats(self):
        z = self.zf
        return dict(steps=z["t"], skipped_steps=z["skipped_steps"], cpu_updates=z["cpu_updates"],
                    reselections=z["reselections"],
                    current_interval=max(z["phases"][q]["m_acc"] for q in self._phases_in_use()),
                    pending=any(zp["pending"] for zp in z["phases"]),
                    overlapped_boundaries=z.get("overlapped_boundaries", 0))

    def selected_columns(self, p):
        """Sorted LongTensor of the selected columns of matrix p, on the host (None before its first selection /
        vectors)."""
        S = self.state.get(p, {}).get("S")
        return None if S is None else S.cpu().clone()

    def master(self, p):
        """fp32 master of p (float64 over a float64 parameter), in p's shape, on the host (as
        `ZenFlowAdamW.master`)."""
        st = self.state.get(p, {})
        if "master" not in st:
            return p.detach().float().cpu().clone()
        return st["master"].reshape(p.shape).cpu().clone()

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self):
        sd = copy.deepcopy(super().state_dict())
        sd["zenflow"] = copy.deepcopy(self.zf)
        return sd

    def load_state_dict(self, state_dict):
        sd = copy.deepcopy(state_dict)
        zf, saved_state = sd.pop("zenflow"), sd["state"]
        sd["state"] = {}
        super().load_state_dict(sd)  # param groups; state restored below without dtype casts
        ids = chain.from_iterable(g["params"] for g in sd["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for i, p in zip(ids, params):
            if i in saved_state:
                self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v for k, v in saved_state[i].items()}
                st = self.state[p]
                if "acc" in st and "acc_n" not in st:  # saved before per-column counts: one count per matrix
                    st["acc_n"] = torch.zeros(st["count"].numel(), dtype=torch.long, device=p.device)
                    if "S" in st:
                        st["acc_n"][self._unselected(p)] = st["acc_steps"]
        if "phases" not in zf:  # saved before stagger_boundaries: one phase, its keys at the top
            phase = {k: zf.pop(k) for k in ("sel_start", "sel_epoch", "m_acc", "pending")}
            zf["phases"] = [dict(phase, land_at=zf.pop("land_at", None))]
        self.zf = zf
