"""The opt-in `overlap_reselect` key (ZenFlowConfig): what a reselecting boundary does with its own CPU update
under overlap_step=True. Specified by `zenflow_compile.reference.ZenFlowReference`; `ZenFlowAdamW` implements
"incoming" (one process and FSDP2).

One 2x6 matrix, topk 0.34 (k = 2), a boundary every 2 steps, a reselection at every boundary, gradients given by
hand (they do not depend on the parameters, so every mode's masters can be predicted from the "wait" run's).
"""

import copy
import time

import pytest
import torch
from torch import nn

from zenflow_compile import ZenFlowAdamW, ZenFlowConfig
from zenflow_compile.reference import ZenFlowReference

from helpers import seeded_generator, tiny_model

P0 = torch.tensor([[0.5, -0.3, 0.8, 0.1, -0.7, 0.2], [0.4, 0.9, -0.2, -0.6, 0.3, -0.1]])
KEYS = dict(topk_ratio=0.34, update_interval=2, overlap_step=True, select_strategy="step", select_interval=2)
# Step 0 selects {0, 1}; the boundary at step 1 reselects {2, 3} (from step 1's scores), the one at step 3
# {4, 5}. Column 4 and 5 stay unselected through step 1's reselection; 0 and 1 leave the selection there.
GRADS = [(3, 2, 1, 0.5, 0.25, 0.1), (0.2, 0.1, 3, 2, 0.5, 0.4), (0.2, 0.1, 3, 2, 0.5, 0.4),
         (0.1, 0.2, 0.3, 0.4, 3, 2), (1, 1, 1, 1, 1, 1)]


def grad(i):
    return torch.tensor(GRADS[i], dtype=torch.float32).expand(2, 6).clone()


def run(mode, steps):
    """Train the matrix for `steps` steps; the device copy, the master and the selection after each."""
    p = nn.Parameter(P0.clone())
    opt = ZenFlowReference([p], lr=0.1, weight_decay=0.01, overlap_reselect=mode, **KEYS)
    history = []
    for i in range(steps):
        p.grad = grad(i)
        opt.step()
        p.grad = None
        history.append((p.detach().clone(), opt.master(p), opt.selected_columns(p).tolist(), opt.stats()))
    return history


def test_wait_applies_a_reselecting_boundarys_update_at_once():
    device, master, selected, stats = run("wait", 2)[1]
    assert selected == [2, 3] and torch.equal(device, master)
    assert stats["reselections"] == 1 and stats["overlapped_boundaries"] == 0 and not stats["pending"]


def test_incoming_keeps_the_update_of_the_columns_that_stay_unselected_in_flight():
    wait, incoming = run("wait", 4), run("incoming", 4)
    for (_, master_w, selected_w, _), (_, master_i, selected_i, _) in zip(wait, incoming):
        # Same selections, same CPU updates: the masters are the "wait" run's (the gradients are given).
        assert selected_i == selected_w and torch.equal(master_i, master_w)
    device, master, selected, stats = incoming[1]
    assert selected == [2, 3] and stats["overlapped_boundaries"] == 1 and stats["pending"]
    assert torch.equal(device[:, [0, 1, 2, 3]], master[:, [0, 1, 2, 3]])  # outgoing and incoming: current
    assert torch.equal(device[:, [4, 5]], P0[:, [4, 5]])                  # staying unselected: in flight
    assert not torch.equal(master[:, [4, 5]], P0[:, [4, 5]])
    device, master, _, _ = incoming[2]                                       # no boundary: still in flight
    assert torch.equal(device[:, [4, 5]], P0[:, [4, 5]])
    device, master, selected, stats = incoming[3]                            # next boundary: step 1's lands
    assert selected == [4, 5] and stats["overlapped_boundaries"] == 2 and stats["reselections"] == 2
    assert torch.equal(device[:, [4, 5]], master[:, [4, 5]])                 # incoming again: current
    assert torch.equal(device[:, [0, 1]], incoming[1][1][:, [0, 1]])        # step 3's update of 0, 1: in flight


def test_without_a_reselection_incoming_equals_wait():
    """The key changes reselecting boundaries only."""
    mode = "incoming"
    batches = [torch.randn(4, 6, 16, generator=seeded_generator(i)) for i in range(9)]
    runs = []
    for m in ("wait", mode):
        model = tiny_model()
        opt = ZenFlowReference(model.parameters(), lr=1e-2, overlap_reselect=m,
                               **dict(KEYS, topk_ratio=0.25, select_interval=1000))
        for x in batches:
            model(torch.arange(6).expand(4, 6)).sub(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_config_validates_overlap_reselect():
    assert ZenFlowConfig().overlap_reselect == "wait"
    assert ZenFlowConfig(overlap_reselect="incoming", overlap_step=True).overlap_reselect == "incoming"
    with pytest.raises(ValueError, match=r"ZenFlowConfig.overlap_reselect='sometimes' is invalid: expected one "
                                         r"of \"wait\", \"incoming\""):
        ZenFlowConfig(overlap_reselect="sometimes", overlap_step=True)
    with pytest.raises(ValueError, match=r"overlap_reselect='incoming' needs overlap_step=True"):
        ZenFlowConfig(overlap_reselect="incoming")
    assert ZenFlowConfig.from_dict(ZenFlowConfig(overlap_reselect="incoming", overlap_step=True).to_dict()) == (
        ZenFlowConfig(overlap_reselect="incoming", overlap_step=True))


def test_zenflow_adamw_takes_wait_and_incoming_and_refuses_another_mode_by_name():
    with pytest.raises(ValueError, match=r"overlap_reselect='deferred' is invalid: expected one of \"wait\", "
                                         r"\"incoming\""):
        ZenFlowAdamW(tiny_model().parameters(), overlap_step=True, overlap_reselect="deferred")
    for mode in ("wait", "incoming"):
        ZenFlowAdamW(tiny_model().parameters(), overlap_step=True, overlap_reselect=mode)


def zenflow_run(mode, steps, device="cpu"):
    """`run` with ZenFlowAdamW (on `device`'s parameter)."""
    p = nn.Parameter(P0.clone().to(device))
    opt = ZenFlowAdamW([p], lr=0.1, weight_decay=0.01, overlap_reselect=mode, **KEYS)
    history = []
    for i in range(steps):
        p.grad = grad(i).to(device)
        opt.step()
        p.grad = None
        history.append((p.detach().cpu().clone(), opt.master(p), opt.selected_columns(p).tolist(), opt.stats()))
    return history


def test_zenflow_adamw_keeps_the_update_of_the_staying_columns_in_flight_as_the_reference(device):
    """The device copy between boundaries, column by column: the arriving columns current at once, the ones
    staying on the host one interval behind, as the reference says."""
    reference, zenflow = run("incoming", 5), zenflow_run("incoming", 5, device)
    for i, ((device_r, master_r, selected_r, stats_r), (device_z, master_z, selected_z, stats_z)) in enumerate(
            zip(reference, zenflow)):
        assert selected_z == selected_r, i
        torch.testing.assert_close(master_z, master_r, rtol=0, atol=1e-6)
        torch.testing.assert_close(device_z, device_r, rtol=0, atol=1e-6)
        assert stats_z["overlapped_boundaries"] == stats_r["overlapped_boundaries"]
        assert stats_z["update_pending"] == stats_r["pending"] and stats_z["reselections"] == stats_r["reselections"]
    assert zenflow[1][3]["update_pending"] and not torch.equal(zenflow[1][0][:, [4, 5]], zenflow[1][1][:, [4, 5]])


def test_a_reselection_in_flight_waits_for_no_cpu_update(monkeypatch):
    """A reselecting boundary waits for the step's accumulation, never for the CPU AdamW of the columns that
    stay on the host: with that update made slow, the training thread does not wait for it until the next
    boundary applies it (where "wait" waits at once)."""
    from zenflow_compile.runtime.state import update

    slow = update.update_host_columns

    def update_host_columns(*args, **kwargs):
        time.sleep(0.5)
        return slow(*args, **kwargs)

    monkeypatch.setattr(update, "update_host_columns", update_host_columns)
    for mode, waited in (("incoming", False), ("wait", True)):
        p = nn.Parameter(P0.clone())
        opt = ZenFlowAdamW([p], lr=0.1, overlap_reselect=mode, **KEYS)
        for i in range(2):
            p.grad = grad(i)
            started = time.perf_counter()
            opt.step()
        boundary = time.perf_counter() - started
        assert opt.stats()["reselections"] == 1
        assert (boundary > 0.4) == waited, (mode, boundary)
        opt.synchronize()


def train_tiny(model, opt, batches):
    for x in batches:
        model(torch.arange(6).expand(4, 6)).sub(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


INCOMING = dict(KEYS, topk_ratio=0.25, overlap_reselect="incoming")


def test_resume_from_a_checkpoint_taken_with_a_reselection_in_flight_is_exact(device):
    batches = [torch.randn(4, 6, 16, generator=seeded_generator(i)) for i in range(12)]
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **INCOMING)
    train_tiny(model, opt, batches[:6])  # the boundary of step 6 reselected with its update in flight
    assert opt.stats()["update_pending"] and opt.stats()["reselections"] == 3
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    train_tiny(model, opt, batches[6:])
    resumed = tiny_model()
    resumed.load_state_dict(saved_model)
    resumed_opt = ZenFlowAdamW(resumed.parameters(), lr=1e-2, **INCOMING)
    resumed_opt.load_state_dict(saved_opt)
    train_tiny(resumed, resumed_opt, batches[6:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert opt.stats()["reselections"] == resumed_opt.stats()["reselections"] == 6



@pytest.mark.parametrize("accumulate_on,waits", [("device", False), ("host", True)])
def test_a_reselection_in_flight_reads_the_arriving_columns_sums_not_the_whole_copy(accumulate_on, waits,
                                                                                     emulated_device, monkeypatch):
    """Summing on the device, the arriving columns' share of the update takes their sums from the device (a
    read of what moves); the training thread does not wait for the interval's whole copy to the host, which
    only the update worker needs. On the host the sums are there once the step's accumulation ended."""
    from zenflow_compile.runtime.state import columns

    waited = []
    real = columns.wait_for_accumulators
    monkeypatch.setattr(columns, "wait_for_accumulators", lambda *args: waited.append(1) or real(*args))
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, accumulate_on=accumulate_on, **INCOMING)
    train_tiny(model, opt, [torch.randn(4, 6, 16, generator=seeded_generator(i)) for i in range(4)])
    assert opt.stats()["reselections"] >= 1 and opt.stats()["accumulate_on"] == accumulate_on
    assert bool(waited) == waits


def test_a_reselection_in_flight_leaves_the_departing_state_to_the_copy_stream(emulated_device, monkeypatch):
    """The departing columns' state goes down on the copy stream, one copy per slab whose columns change,
    and is settled into its host rows once the update has finished; the arriving columns' rows go up and take
    their step on the device, from its sums: the training thread's only blocking reads are the steps' own
    (`host_reads`)."""
    from zenflow_compile.runtime import transfers
    from zenflow_compile.runtime.state import columns

    reads, copies, arrivals = [], [], []
    read, copy_down, take = transfers.Transfers.read_to_host, transfers.Transfers.copy_to_host, columns.take_arriving
    monkeypatch.setattr(transfers.Transfers, "read_to_host", lambda self, t: reads.append(1) or read(self, t))
    monkeypatch.setattr(transfers.Transfers, "copy_to_host", lambda self, t: copies.append(1) or copy_down(self, t))
    monkeypatch.setattr(columns, "take_arriving",
                        lambda *args, **kwargs: arrivals.append(take(*args, **kwargs)) or arrivals[-1])
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, accumulate_on="device", **INCOMING)
    train_tiny(model, opt, [torch.randn(4, 6, 16, generator=seeded_generator(i)) for i in range(8)])
    changed = sum(moving is not None for moving in arrivals)
    stats = opt.stats()
    assert stats["reselections"] == 4 and changed >= 4 and stats["selection_churn"] > 0
    assert len(reads) == stats["host_reads"]
    assert len(copies) == changed
