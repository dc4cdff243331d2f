"""`offload=True` (DeepSpeed's flag): the selected columns' and the vectors' moments live in pinned host memory
and visit the device for the work that needs them (each step's device update, a reselection's move).

- Values: the same as with the moments on the device, bit for bit (the trips are fp32 copies), and equal to
  `ZenFlowReference`, eager and compiled, cpu and emulated, through warm-up, overlapped boundaries,
  reselections ("wait" and "incoming"), both accumulation placements, data parallel.
- Checkpoints: the same `state_dict`; one saved with the flag loads without it and back.
- Workflows (param-group edits, weights loaded, deep copies, a checkpoint loaded mid-run): bit for bit.
- What it costs and saves, recomputed from the shapes: 8 bytes per selected element move from the device's
  state to the host's, and each step moves them up and down once (`stats()`).
- Where the model is on the CPU the device is the host: the flag changes nothing.
"""

import copy

import pytest
import torch

import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")
from helpers import TEST_DEVICES, make_batches, loss_fn, tiny_model
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LR, WD, STEPS = 1e-2, 0.1, 8
ATOL, RTOL = 1e-6, 1e-5

CONFIGS = {
    "warmup-overlap-incoming": dict(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=1, overlap_step=True,
                                    select_strategy="step", select_interval=2, overlap_reselect="incoming",
                                    landing_lag=1, accumulate_on="device"),
    "host-sums-wait": dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                           select_interval=2, overlap_reselect="wait", accumulate_on="host"),
    "stagger-lag1": dict(topk_ratio=0.5, update_interval=3, overlap_step=True, stagger_boundaries=True,
                         landing_lag=1),
    "zen-auto": dict(topk_ratio=0.5, update_interval="auto", max_update_interval=3, overlap_step=True),
}


def _train_three(keys: dict, compiled: bool, steps: int = STEPS):
    """offload=True, offload=False and the reference on one model's copies, compared after every step."""
    models = [tiny_model() for _ in range(3)]
    opts = [ZenFlowAdamW(models[0].parameters(), lr=LR, weight_decay=WD, offload=True, **keys),
            ZenFlowAdamW(models[1].parameters(), lr=LR, weight_decay=WD, **keys),
            ZenFlowReference(models[2].parameters(), lr=LR, weight_decay=WD,
                             **{k: v for k, v in keys.items() if k != "accumulate_on"})]
    backends = ["zenflow", "zenflow", "inductor"]
    runs = [torch.compile(m, backend=b) if compiled else m for m, b in zip(models, backends)]
    for i, batch in enumerate(make_batches(steps)):
        for run, opt in zip(runs, opts):
            loss_fn(run, batch).backward()
            opt.step()
            opt.zero_grad()
        for (name, p), q, r in zip(models[0].named_parameters(), models[1].parameters(), models[2].parameters()):
            assert torch.equal(p, q), f"step {i} {name}: offload=True differs from offload=False"
            torch.testing.assert_close(p, r, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i} {name}: {m}")
    return models, opts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keys", list(CONFIGS.values()), ids=list(CONFIGS))
def test_equals_the_moments_on_the_device_and_the_reference(keys, compiled, device):
    models, opts = _train_three(keys, compiled)
    for opt in opts:
        opt.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    stats, reference = opts[0].stats(), opts[2].stats()
    assert stats["cpu_updates"] == reference["cpu_updates"] > 0
    if keys.get("select_strategy") == "step":
        assert stats["reselections"] == opts[1].stats()["reselections"] > 0


def _state_tensors(state_dict: dict) -> list[torch.Tensor]:
    return [t for entry in state_dict["state"].values() for t in entry.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("config", ["warmup-overlap-incoming", "host-sums-wait"])
def test_checkpoints_are_the_same_and_load_either_way(config, device):
    """A state_dict taken right after step() (the moments' copy down may be in flight) equals the one
    without the flag; loaded into an optimizer with the other setting, training goes on as it would have."""
    keys = CONFIGS[config]
    models, opts = _train_three(keys, compiled=False, steps=5)
    saved = [opts[0].state_dict(), opts[1].state_dict()]
    for a, b in zip(_state_tensors(saved[0]), _state_tensors(saved[1])):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    # Each checkpoint loads into a fresh optimizer with the other setting; both go on as the originals do.
    resumed = []
    for source, offload in ((0, False), (1, True)):
        model = tiny_model()
        model.load_state_dict(models[source].state_dict())
        opt = ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, offload=offload, **keys)
        opt.load_state_dict(saved[source])
        resumed.append((model, opt))
    going_on = [(models[0], opts[0]), (models[1], opts[1]), *resumed]
    for batch in make_batches(4, seed=77):
        for model, opt in going_on:
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
    for model, opt in going_on:
        opt.synchronize()
    for params in zip(*(model.parameters() for model, _ in going_on)):
        assert all(torch.equal(params[0], p) for p in params[1:])


def _selected_elements(model: torch.nn.Module, topk_ratio: float) -> int:
    """Elements whose moments the device holds without offload: k columns of every matrix, every vector."""
    total = 0
    for p in model.parameters():
        if p.dim() >= 2:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            total += rows * max(1, int(topk_ratio * cols))
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_the_moments_move_to_the_host_and_visit_the_device_each_step(accumulate_on, emulated_device):
    """stats(): with the flag, the device state is 8 bytes per selected element smaller and the host state
    that much larger; each step's update takes them up and down once."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                select_interval=1000, accumulate_on=accumulate_on)
    steps = 6
    stats = {}
    for offload in (False, True):
        model = tiny_model()
        opt = ZenFlowAdamW(model.parameters(), lr=LR, offload=offload, **keys)
        for batch in make_batches(steps):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        stats[offload] = opt.stats()
    moments = 8 * _selected_elements(model, keys["topk_ratio"])
    assert stats[False]["device_state_bytes"] - stats[True]["device_state_bytes"] == moments
    assert stats[True]["host_state_bytes"] - stats[False]["host_state_bytes"] == moments
    for way in ("bytes_host_to_device_per_step", "bytes_device_to_host_per_step"):
        assert stats[True][way] - stats[False][way] == pytest.approx(moments, rel=1e-12), way


@pytest.mark.skipif("cpu" not in TEST_DEVICES, reason="the CPU as the device")
def test_on_the_cpu_the_flag_changes_nothing():
    """The model on the CPU: the device is the host, its state is already in host memory."""
    stats = {}
    for offload in (False, True):
        model = tiny_model()
        opt = ZenFlowAdamW(model.parameters(), lr=LR, offload=offload, topk_ratio=0.25, update_interval=2)
        for batch in make_batches(3):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        stats[offload] = opt.stats()
    for key in ("device_state_bytes", "host_state_bytes", "bytes_host_to_device_per_step",
                "bytes_device_to_host_per_step"):
        assert stats[True][key] == stats[False][key], key


def _edit_groups(opt, model) -> None:
    """fc1.weight moved into the other group (another lr), fc2.bias out of the groups."""
    first, second = opt.param_groups
    first["params"] = [p for p in first["params"] if p is not model.fc1.weight and p is not model.fc2.bias]
    second["params"] = [*second["params"], model.fc1.weight]


def test_workflows_equal_the_moments_on_the_device(device):
    """One run through what users do mid-training, with and without the flag, bit for bit: param groups edited
    (a parameter moved to another group, one removed: their slabs laid out again from the moments), weights
    loaded into the model (adopted), the optimizer and model deep-copied and the copy trained on, gradient
    clipping, and a checkpoint loaded into a fresh optimizer."""
    keys = CONFIGS["warmup-overlap-incoming"]
    runs = []
    for offload in (True, False):
        model = tiny_model()
        groups = [dict(params=[p for p in model.parameters() if p is not model.fc1.bias]),
                  dict(params=[model.fc1.bias], lr=LR / 3)]
        opt = ZenFlowAdamW(groups, lr=LR, weight_decay=WD, max_grad_norm=0.5, offload=offload, **keys)
        runs.append([model, opt])
    batches = make_batches(12, seed=5)
    snapshot = None
    for i, batch in enumerate(batches):
        if i == 3:
            for run in runs:
                _edit_groups(run[1], run[0])
                run[0].fc2.bias.requires_grad_(False)
        if i == 5:
            snapshot = {k: v.clone() for k, v in runs[0][0].state_dict().items()}
        if i == 7:
            for model, _ in runs:
                model.load_state_dict(snapshot)
        if i == 8:
            runs = [list(copy.deepcopy(tuple(run))) for run in runs]
        if i == 10:
            for run in runs:
                saved, groups = run[1].state_dict(), [dict(g) for g in run[1].param_groups]
                offload = run[1].config.offload
                run[1] = None  # (dropped: its parameters are free for the new optimizer)
                run[1] = ZenFlowAdamW(groups, lr=LR, weight_decay=WD, max_grad_norm=0.5, offload=offload, **keys)
                run[1].load_state_dict(saved)
        for run in runs:
            loss_fn(run[0], batch).backward()
            run[1].step()
            run[1].zero_grad()
        for (name, p), q in zip(runs[0][0].named_parameters(), runs[1][0].parameters()):
            assert torch.equal(p, q), f"step {i} {name}"
    for run in runs:
        run[1].synchronize()
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()))
    assert runs[0][1].stats()["reselections"] == runs[1][1].stats()["reselections"] > 0
