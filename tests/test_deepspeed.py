"""zenflow_compile.deepspeed: the DeepSpeed ZenFlow user's JSON through a real DeepSpeed engine.

CPU, DeepSpeed's CPU accelerator, gloo, one rank, in this process (the two-rank data-parallel test runs under
torchrun). Every engine gets a client optimizer (ZenFlowAdamW), so DeepSpeed never JIT-builds cpu_adam; the
module fixture turns off DeepSpeed's shm_comm op (a shared-memory all-reduce for several CPU ranks, JIT-built by
`init_distributed` on the CPU accelerator, useless on one rank).

The oracle for each DeepSpeed feature is the same training written directly: ZenFlowAdamW (+ torch.compile with
backend="zenflow", DeepSpeed's own LR scheduler class, loss / gradient_accumulation_steps), or torch.optim.AdamW
where the invariants of docs/semantics.md say ZenFlow equals it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zenflow_compile
from helpers import deepspeed_on_cpu, free_port, loss_fn, make_batches, max_param_diff, snapshot, tiny_model

REPO = Path(__file__).resolve().parents[1]
TUTORIAL_CONFIG = REPO / "examples" / "deepspeed" / "ds_config.json"
MICRO_BATCH = 8


@pytest.fixture(scope="module")
def ds():
    """deepspeed on its CPU accelerator with a one-rank gloo group (helpers.deepspeed_on_cpu)."""
    yield from deepspeed_on_cpu()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def ds_config(zenflow=None, **top) -> dict:
    """A DeepSpeed ZenFlow config (the tutorial's shape) for the Tiny model; keyword args are top-level keys."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "zenflow": {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 2,
                                          "update_interval": 2, "full_warm_up_rounds": 1, "overlap_step": True,
                                          **(zenflow or {})}},
        "steps_per_print": 10**6,
    }
    config.update(top)
    return config


def direct_optimizer(model, config: dict, **overrides):
    """ZenFlowAdamW written by hand from the same DeepSpeed config (the oracle's optimizer), with DeepSpeed's
    defaults for the keys the JSON leaves out, as the JSON path has them (also in a subprocess)."""
    params = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **config["optimizer"]["params"]}
    zenflow = dict(config["zero_optimization"]["zenflow"])
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT  # (1.0: DeepSpeed clips unless told not to)
    clip = config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT) or None
    return zenflow_compile.ZenFlowAdamW(model.parameters(), **params, max_grad_norm=clip, preset="deepspeed",
                                        **{**zenflow, **overrides})


def ds_initialize(config: dict, model=None, **kwargs):
    import zenflow_compile.deepspeed as zds

    model = model if model is not None else tiny_model()
    return zds.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)


def train_engine(engine, batches) -> list[list[torch.Tensor]]:
    """DeepSpeed's loop, one engine.step() per micro-batch; parameters after every optimizer step."""
    seen = []
    for batch in batches:
        steps = engine.global_steps
        engine.backward(loss_fn(engine, batch))
        engine.step()
        if engine.global_steps > steps:
            # compiled, ZenFlow took every gradient in the backward; eagerly step() took .grad and the
            # engine's zero_grad cleared it
            assert all(p.grad is None for p in engine.module.parameters())
            seen.append(snapshot(engine.module))
    return seen


def train_direct(model, opt, batches, micro_per_step: int = 1, scheduler=None) -> list[list[torch.Tensor]]:
    seen = []
    for i in range(0, len(batches), micro_per_step):
        for batch in batches[i:i + micro_per_step]:
            (loss_fn(model, batch) / micro_per_step).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        seen.append(snapshot(model))
    return seen


def assert_same_run(a, b, atol=1e-6, rtol=1e-5):
    assert len(a) == len(b)
    for step, (pa, pb) in enumerate(zip(a, b)):
        for x, y in zip(pa, pb):
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m: f"step {step}: {m}")


def assert_moved(run, model_init, more_than=1e-3):
    assert max_param_diff(run[-1], model_init) > more_than  # the comparison is not between untrained models


# ---------------------------------------------------------------------------------------------- training
def test_tutorial_config_compiles_with_zenflow_and_equals_direct_path(ds):
    """The DeepSpeed tutorial's JSON as is (examples/deepspeed/ds_config.json): a real DeepSpeedEngine with DeepSpeed's
    dataloader, engine.compile() -> backend "zenflow", the same parameters as ZenFlowAdamW +
    torch.compile(backend="zenflow") written directly with the JSON's settings."""
    from zenflow_compile import inspect as zf_inspect

    config = json.loads(TUTORIAL_CONFIG.read_text())
    batches = make_batches(6)
    dataset = torch.utils.data.TensorDataset(torch.stack([x for b in batches for x in b[0]]),
                                             torch.stack([y for b in batches for y in b[1]]))
    engine, opt, loader, scheduler = ds_initialize(config, training_data=dataset)
    assert isinstance(engine, ds.DeepSpeedEngine) and type(opt) is zenflow_compile.ZenFlowAdamW
    assert engine.optimizer is opt and scheduler is None and len(loader) == 6
    assert opt.config.steps_per_epoch == 6 and opt.config.topk_ratio == 0.05 and opt.config.overlap_step
    assert opt.defaults["lr"] == 2e-5 and opt.defaults["weight_decay"] == 0.01
    ds_batches = [tuple(t) for t in loader]  # DeepSpeed's sampler order, fed to both sides
    init = snapshot(engine.module)
    with zf_inspect.capture() as graphs:
        engine.compile()
        assert engine.is_compiled
        ds_run = train_engine(engine, ds_batches)
    assert graphs, "engine.compile() did not compile the backward with the zenflow backend"
    opt.synchronize()
    ds_final = snapshot(engine.module)

    model = tiny_model()
    direct = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=2e-5, weight_decay=0.01,
                                          **config["zero_optimization"]["zenflow"])
    direct_run = train_direct(torch.compile(model, backend="zenflow"), direct, ds_batches)
    direct.synchronize()
    assert_same_run(ds_run, direct_run, atol=1e-7, rtol=1e-6)
    assert_same_run([ds_final], [snapshot(model)], atol=1e-7, rtol=1e-6)
    assert_moved(ds_run, init, more_than=1e-5)  # lr 2e-5: ~6 steps of ~lr each
    assert opt.stats()["steps"] == 6 and engine.global_steps == 6 and opt.stats()["cpu_updates"] == 1


def test_lr_scheduler_from_json_drives_zenflow(ds):
    """The JSON's scheduler block is DeepSpeed's scheduler over ZenFlowAdamW: the lr of every step is the one
    DeepSpeed's WarmupLR gives, and the parameters are those of ZenFlowAdamW driven by that scheduler."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 4, "warmup_type": "linear"}
    config = ds_config(scheduler={"type": "WarmupLR", "params": sched})
    batches = make_batches(6)
    engine, opt, _, scheduler = ds_initialize(config)
    assert isinstance(scheduler, WarmupLR) and scheduler.optimizer is opt
    lrs = []
    for batch in batches:
        lrs.append(engine.get_lr()[0])
        engine.backward(loss_fn(engine, batch))
        engine.step()
    ds_final = snapshot(engine.module)

    model = tiny_model()
    direct = direct_optimizer(model, config)
    direct_scheduler = WarmupLR(direct, **sched)
    expected = []
    for batch in batches:
        expected.append(direct.param_groups[0]["lr"])
        loss_fn(model, batch).backward()
        direct.step()
        direct.zero_grad()
        direct_scheduler.step()
    assert lrs == expected and lrs[0] == 0.0 and lrs[-1] == 2e-2 and len(set(lrs)) == 5
    assert_same_run([ds_final], [snapshot(model)])


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_gradient_accumulation_as_deepspeed_means_it(ds, clip):
    """gradient_accumulation_steps=3: engine.backward scales the loss by 1/3, engine.step() steps ZenFlow on
    every third micro-batch only; equals the direct path summing (loss / 3) over 3 backwards per step (with
    gradient_clipping too: ZenFlow clips the summed gradient of the step)."""
    config = ds_config(gradient_accumulation_steps=3, **({"gradient_clipping": clip} if clip else {}))
    batches = make_batches(9)
    engine, opt, _, _ = ds_initialize(config)
    assert engine.train_batch_size() == 3 * MICRO_BATCH
    ds_run, optimizer_steps = [], []
    for batch in batches:
        engine.backward(loss_fn(engine, batch))
        engine.step()
        optimizer_steps.append(opt.stats()["steps"])
    assert optimizer_steps == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    ds_final = snapshot(engine.module)

    model = tiny_model()
    direct_run = train_direct(model, direct_optimizer(model, config), batches, micro_per_step=3)
    assert_same_run([ds_final], [direct_run[-1]])
    assert_moved([ds_final], snapshot(tiny_model()))


def test_epoch_strategy_takes_the_epoch_from_training_data(ds):
    """select_strategy "epoch": one epoch = one pass of DeepSpeed's dataloader = len(loader) // gas steps."""
    config = ds_config({"select_strategy": "epoch", "select_interval": 1}, gradient_accumulation_steps=3)
    x, y = make_batches(1, batch=6 * MICRO_BATCH)[0]
    engine, opt, loader, _ = ds_initialize(config, training_data=torch.utils.data.TensorDataset(x, y))
    assert len(loader) == 6 and opt.config.steps_per_epoch == 2 and opt.config.reselect_every == 2


def test_bf16_block_casts_the_module_and_zenflow_keeps_fp32_masters(ds):
    """bf16: DeepSpeed casts the parameters (no FP16_UnfusedOptimizer / BF16_Optimizer wrapper), ZenFlow keeps
    fp32 masters, and the run equals ZenFlowAdamW over the same bf16 model written directly."""
    config = ds_config(bf16={"enabled": True})
    batches = make_batches(5)
    engine, opt, _, _ = ds_initialize(config)
    assert type(engine.optimizer) is zenflow_compile.ZenFlowAdamW
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    ds_run = train_engine(engine, batches)
    opt.synchronize()
    masters = [opt.master(p) for p in engine.module.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    # the device copy is the cast of the master, and the master holds more than bf16 can
    assert all(torch.equal(m.to(torch.bfloat16), p.detach()) for m, p in zip(masters, engine.module.parameters()))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)

    model = tiny_model(torch.bfloat16)
    direct_run = train_direct(model, direct_optimizer(model, config), batches)
    assert_same_run(ds_run, direct_run, atol=0, rtol=0)


def test_torch_autocast_fp16_uses_deepspeeds_grad_scaler_on_zenflow(ds):
    """torch_autocast with fp16 at stage 0: DeepSpeed autocasts the forward and scales the loss with its own
    torch.amp.GradScaler, whose step/update drive ZenFlowAdamW; equals the same written directly."""
    config = ds_config(torch_autocast={"enabled": True, "dtype": "fp16"})
    batches = make_batches(5)
    engine, opt, _, _ = ds_initialize(config)
    scaler = engine.torch_autocast_z0_gradscaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    ds_run = train_engine(engine, batches)

    model = tiny_model()
    direct = direct_optimizer(model, config)
    direct_scaler = torch.amp.GradScaler("cpu")
    direct_run = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, batch)
        direct_scaler.scale(loss).backward()
        direct_scaler.step(direct)
        direct_scaler.update()
        direct.zero_grad()
        direct_run.append(snapshot(model))
    assert scaler.get_scale() == direct_scaler.get_scale()
    assert opt.stats()["steps"] + opt.stats()["skipped_steps"] == 5
    assert_same_run(ds_run, direct_run)
    assert_moved(ds_run, snapshot(tiny_model()))


def test_fp16_block_casts_the_module_and_scales_the_loss_dynamically(ds, monkeypatch):
    """The fp16 block: DeepSpeed casts the module to fp16, ZenFlow keeps fp32 masters, and DeepSpeed's dynamic
    loss scaling (initial_scale_power, loss_scale_window) runs as a torch.amp.GradScaler driving ZenFlowAdamW;
    equals the same written directly. (DeepSpeed's CPU accelerator refuses fp16 unless the CPU has AVX512-FP16;
    the test lifts that check: torch runs fp16 on any CPU.)"""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    config = ds_config(fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3})
    x, y = make_batches(1)[0]
    batches = make_batches(7)
    batches[2] = (x, torch.full_like(y, float("inf")))  # an overflow: skipped, the scale backs off
    engine, opt, _, _ = ds_initialize(config, model=tiny_model())
    scaler = engine.torch_autocast_z0_gradscaler
    assert type(engine.optimizer) is zenflow_compile.ZenFlowAdamW and scaler.get_scale() == 2.0 ** 10
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    ds_run = train_engine(engine, batches)
    assert opt.stats()["skipped_steps"] == 1 and engine.skipped_steps == 1
    assert all(opt.master(p).dtype == torch.float32 for p in engine.module.parameters())

    model = tiny_model(torch.float16)
    direct = direct_optimizer(model, config)
    direct_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    direct_run = []
    for batch in batches:
        direct_scaler.scale(loss_fn(model, batch)).backward()
        direct_scaler.step(direct)
        direct_scaler.update()
        direct.zero_grad()
        direct_run.append(snapshot(model))
    # halved at the overflow, doubled after loss_scale_window (3) clean steps
    assert scaler.get_scale() == direct_scaler.get_scale() == 2.0 ** 10
    assert_same_run(ds_run, direct_run, atol=0, rtol=0)
    assert_moved(ds_run, snapshot(tiny_model(torch.float16)))


def test_non_finite_step_is_skipped_the_deepspeed_way(ds):
    """A non-finite gradient: ZenFlow skips the step, and DeepSpeed sees it (skipped_steps, was_step_applied,
    no LR-scheduler step), as with its own fp16 optimizers."""
    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}
    engine, opt, _, scheduler = ds_initialize(ds_config(scheduler={"type": "WarmupLR", "params": sched}))
    x, y = make_batches(1)[0]
    good, bad = (x, y), (x, torch.full_like(y, float("inf")))
    train_engine(engine, [good])
    before, lr = snapshot(engine.module), engine.get_lr()
    engine.backward(loss_fn(engine, bad))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and opt.stats()["skipped_steps"] == 1
    assert engine.get_lr() == lr and scheduler.last_batch_iteration == 0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(engine.module)))
    train_engine(engine, [good])
    assert engine.was_step_applied() and opt.stats()["steps"] == 2 and engine.get_lr() != lr


def test_gradient_clipping_is_zenflow_max_grad_norm(ds):
    """gradient_clipping -> max_grad_norm. With update_interval=1 and no overlap, ZenFlow equals
    clip_grad_norm_ + torch.optim.AdamW (invariant 1 of docs/semantics.md), so that is the oracle here."""
    config = ds_config({"update_interval": 1, "overlap_step": False, "select_strategy": "auto",
                        "select_interval": "auto"}, gradient_clipping=0.05)
    batches = make_batches(5)
    engine, opt, _, _ = ds_initialize(config)
    assert opt.max_grad_norm == 0.05 and engine.gradient_clipping() == 0.0  # DeepSpeed never clips `.grad`
    ds_run = train_engine(engine, batches)

    model = tiny_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms, adamw_run = [], []
    for batch in batches:
        loss_fn(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        adamw.step()
        adamw.zero_grad()
        adamw_run.append(snapshot(model))
    assert min(norms) > 0.05  # clipping was active on every step
    assert_same_run(ds_run, adamw_run)


def test_checkpoint_resume_is_exact(ds, tmp_path):
    """3 steps, engine.save_checkpoint, 3 steps == a fresh engine (other initial weights), load_checkpoint,
    the same 3 steps: bitwise. The save falls while a CPU update is in flight (overlap, interval 2) and the
    LR scheduler is mid-warm-up; both resume."""
    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"}
    config = ds_config({"full_warm_up_rounds": 0, "select_interval": 4},
                       scheduler={"type": "WarmupLR", "params": sched})
    batches = make_batches(6)
    engine, opt, _, _ = ds_initialize(config)
    train_engine(engine, batches[:3])
    assert opt.stats()["update_pending"]
    engine.save_checkpoint(str(tmp_path), tag="step3")
    assert (tmp_path / "latest").read_text() == "step3"
    assert (tmp_path / "step3" / "mp_rank_00_model_states.pt").is_file()  # DeepSpeed's layout
    continued = train_engine(engine, batches[3:])
    opt.synchronize()
    continued.append(snapshot(engine.module))

    fresh, fresh_opt, _, fresh_sched = ds_initialize(config, model=tiny_model(seed=7))
    load_path, client_state = fresh.load_checkpoint(str(tmp_path))
    assert load_path is not None and "optimizer" not in client_state
    assert fresh.global_steps == 3 and fresh_opt.stats()["steps"] == 3 and fresh_sched.last_batch_iteration == 2
    resumed = train_engine(fresh, batches[3:])
    fresh_opt.synchronize()
    resumed.append(snapshot(fresh.module))
    for step, (a, b) in enumerate(zip(continued, resumed)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"resumed run differs at step {step}"
    assert fresh.get_lr() == engine.get_lr()


def test_deepspeed_gradient_allreduce_never_runs(ds, monkeypatch):
    """DeepSpeed's own backward all-reduce (which zero-fills missing `.grad`s) stays off; the spy is shown to
    see it on a plain DeepSpeed engine first."""
    calls = []
    real_all_reduce = ds.comm.all_reduce

    def spy(*args, **kwargs):
        calls.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    monkeypatch.setattr(ds.comm, "all_reduce", spy)
    batches = make_batches(4)

    plain_model = tiny_model()
    plain, _, _, _ = ds.initialize(model=plain_model, optimizer=torch.optim.AdamW(plain_model.parameters()),
                                   config={"train_micro_batch_size_per_gpu": MICRO_BATCH,
                                           "steps_per_print": 10**6})
    plain.backward(loss_fn(plain, batches[0]))
    assert calls, "the spy does not see DeepSpeed's all-reduce"
    calls.clear()

    engine, opt, _, _ = ds_initialize(ds_config(gradient_accumulation_steps=2))
    monkeypatch.setattr(engine, "allreduce_gradients", lambda *a, **k: calls.append("allreduce_gradients"))
    monkeypatch.setattr(engine, "buffered_allreduce_fallback", lambda *a, **k: calls.append("fallback"))
    train_engine(engine, batches)
    assert calls == [] and opt.stats()["steps"] == 2


# ------------------------------------------------------------------------------------------------ errors
def test_invalid_zenflow_keys_get_deepspeeds_validation_error(ds):
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="topk_ratio"):
        ds_initialize(ds_config({"topk_ratio": 1.5}))
    with pytest.raises(pydantic.ValidationError, match="topk"):
        ds_initialize(ds_config({"topk": 0.1}))  # not a key of DeepSpeed's ZenFlowConfig
    with pytest.raises(ValueError, match='select_interval is a string, it must be "auto"'):
        ds_initialize(ds_config({"select_interval": "often"}))


@pytest.mark.parametrize("ours", [
    dict(interval_aware_update=True, interval_second_moment=True, max_update_interval=8),
    dict(overlap_reselect="incoming", landing_lag=1, stagger_boundaries=True, accumulate_on="host"),
], ids=["interval", "overlap"])
def test_project_keys_in_the_zenflow_block_reach_zenflow(ds, ours):
    """This project's keys (not DeepSpeed's, whose config class forbids unknown keys) sit in the same JSON
    block: the optimizer gets them, and the run equals ZenFlowAdamW built by hand with them."""
    config = ds_config(ours)
    batches = make_batches(6)
    engine, opt, _, _ = ds_initialize(config)
    assert {k: getattr(opt.config, k) for k in ours} == ours
    ds_run = train_engine(engine, batches)
    model = tiny_model()
    direct = direct_optimizer(model, config)
    assert_same_run(ds_run, train_direct(model, direct, batches), atol=1e-7, rtol=1e-6)
    assert opt.stats()["cpu_updates"] > 0
    if ours.get("stagger_boundaries"):
        assert len(opt._runtime.placement.phases_in_use) == 2  # (the two phases of update_interval 2 in use)
    with pytest.raises(ValueError, match="interval_second_moment=True needs interval_aware_update=True"):
        ds_initialize(ds_config(dict(interval_second_moment=True)))


@pytest.mark.project_defaults
def test_the_json_keeps_deepspeeds_defaults_unless_its_block_asks_for_the_projects(ds):
    """Keys the zenflow block leaves out take DeepSpeed's defaults (parity); `"preset": "project"` in the block
    gives them this project's instead, the keys it sets winning either way."""
    from zenflow_compile.config import ZenFlowConfig

    block = {"topk_ratio": 0.25}
    _, opt, _, _ = ds_initialize(ds_config({"preset": "deepspeed"}))
    assert opt.config == ZenFlowConfig(preset="deepspeed", **ds_config()["zero_optimization"]["zenflow"])
    config = ds_config()
    config["zero_optimization"]["zenflow"] = dict(block)
    _, opt, _, _ = ds_initialize(config)
    assert opt.config == ZenFlowConfig(preset="deepspeed", **block)
    assert ZenFlowConfig.from_deepspeed(config) == opt.config
    config["zero_optimization"]["zenflow"] = dict(block, preset="project")
    _, opt, _, _ = ds_initialize(copy.deepcopy(config))
    assert opt.config == ZenFlowConfig(preset="project", **block) == ZenFlowConfig(**block)
    assert ZenFlowConfig.from_deepspeed(config) == opt.config
    config["zero_optimization"]["zenflow"]["preset"] = "fast"
    with pytest.raises(ValueError, match=r"zero_optimization\.zenflow\.preset='fast'.*\"project\""):
        ds_initialize(config)


@pytest.mark.parametrize("change, error, match", [
    (lambda c: c["zero_optimization"].update(stage=3), ValueError,
     r"zero_optimization\.stage=3.*FSDP2.*fully_shard the model.*ZenFlowAdamW\(model\.parameters\(\)"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
     ValueError, r"zero_optimization\.offload_optimizer\.device='nvme'"),
    (lambda c: c["zero_optimization"].pop("zenflow"), ValueError, r"no 'zero_optimization\.zenflow' block"),
    (lambda c: c["optimizer"].update(type="Lamb"), ValueError, r"optimizer\.type='Lamb'"),
    (lambda c: c["optimizer"]["params"].update(amsgrad=True), ValueError, r"optimizer\.params\.amsgrad"),
    (lambda c: c.update(compile={"deepcompile": True, "offload_activation": True}), ValueError,
     r"compile\.offload_activation=True"),
    (lambda c: c.update(fp16={"enabled": True, "loss_scale": 128}), ValueError,
     r"fp16\.loss_scale=128.*static loss scale.*use 0"),
    (lambda c: c["zero_optimization"]["zenflow"].update(select_strategy="epoch", select_interval=1), ValueError,
     r"select_strategy='epoch' needs the epoch length: pass training_data"),
], ids=["stage3", "nvme", "no-zenflow-block", "not-adamw", "amsgrad", "deepcompile-pass", "fp16-static-scale",
        "epoch-without-data"])
def test_config_that_cannot_apply_is_a_clear_error(ds, change, error, match):
    config = ds_config()
    change(config)
    with pytest.raises(error, match=match):
        ds_initialize(config)


def test_client_optimizer_is_refused(ds):
    model = tiny_model()
    with pytest.raises(ValueError, match="pass optimizer=None"):
        import zenflow_compile.deepspeed as zds

        zds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds_config())


def test_initialize_outside_a_launcher_names_the_fix():
    """A script run with plain `python` and no RANK/WORLD_SIZE/...: DeepSpeed falls back to MPI discovery; without
    mpi4py the user gets an error naming the launchers and the variables, not `No module named 'mpi4py'`."""
    pytest.importorskip("deepspeed")
    program = textwrap.dedent("""
        import sys
        sys.modules["mpi4py"] = None  # as on a machine without MPI
        import torch, zenflow_compile.deepspeed as zds
        model = torch.nn.Linear(4, 4)
        zds.initialize(model=model, model_parameters=model.parameters(),
                       config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {}},
                               "zero_optimization": {"stage": 0, "zenflow": {"topk_ratio": 0.5}}})
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", program], env={**env, "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: zenflow_compile.deepspeed.initialize found no distributed environment"), \
        proc.stderr[-3000:]
    for fix in ("`deepspeed train.py`", "torchrun", "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR", "MASTER_PORT"):
        assert fix in last, fix


def test_compile_backend_other_than_zenflow_is_refused_with_deepcompile(ds):
    engine, _, _, _ = ds_initialize(ds_config(compile={"deepcompile": True}))
    with pytest.raises(ValueError, match="backend 'zenflow'"):
        engine.compile(backend="inductor")
    assert not engine.is_compiled


_TWO_RANKS = textwrap.dedent("""
    import copy, json, os, sys, torch, deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU ops
    sys.path.insert(0, {TESTS})
    import zenflow_compile, zenflow_compile.deepspeed as zds
    from helpers import loss_fn, make_batches, snapshot, tiny_model
    torch.set_num_threads(1)
    config = {CONFIG}
    steps, save_after = 6, 3
    batches = make_batches(steps, batch=8)  # global batches; each rank trains on its half

    def mine(batch):
        x, y = batch
        rank = torch.distributed.get_rank()
        return x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]

    def engine_run(ckpt=None, load=None, start=0):
        engine, opt, _, _ = zds.initialize(model=tiny_model(), model_parameters=None, config=copy.deepcopy(config))
        engine.compile()
        if load:
            engine.load_checkpoint(load)
        seen = []
        for i in range(start, steps):
            engine.backward(loss_fn(engine, mine(batches[i])))
            engine.step()
            seen.append(snapshot(engine.module))
            if ckpt and i + 1 == save_after:
                engine.save_checkpoint(ckpt, tag="t")
        return seen, opt, engine

    ds_run, ds_opt, engine = engine_run(ckpt={CKPT})
    resumed, _, _ = engine_run(load={CKPT}, start=save_after)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999),
                                       eps=1e-8, preset="deepspeed",  # as the JSON path; the default group
                                       **config["zero_optimization"]["zenflow"])
    compiled = torch.compile(model, backend="zenflow")
    direct = []
    for i in range(steps):
        loss_fn(compiled, mine(batches[i])).backward()
        opt.step()
        opt.zero_grad()
        direct.append(snapshot(model))
    diff = lambda a, b: max((x - y).abs().max().item() for s, t in zip(a, b) for x, y in zip(s, t))
    stats = ds_opt.stats()
    outcome = dict(world_size=stats.get("world_size"), engine_vs_direct=diff(ds_run, direct),
                   resume=diff(ds_run[save_after:], resumed), moved=diff(ds_run[-1:], [snapshot(tiny_model())]),
                   files=sorted(os.listdir(os.path.join({CKPT}, "t"))),
                   optimizer_files=sorted(os.listdir(os.path.join({CKPT}, "t", "zenflow_optim"))),
                   allreduce_bytes=stats["comm_bytes_sent"].get("all_reduce", 0),
                   host_state_bytes=stats["host_state_bytes"], deepspeed_allreduce=engine.enable_backward_allreduce)
    with open(os.path.join({OUT}, "rank" + os.environ["RANK"]), "w") as f:  # one file per rank
        json.dump(outcome, f)
    torch.distributed.destroy_process_group()
""")


def test_two_ranks_tutorial_config_equals_direct_data_parallel_and_resumes(ds, tmp_path):
    """Two ranks under torchrun (DS_ACCELERATOR=cpu, gloo): the tutorial-shaped JSON with deepcompile through
    DeepSpeed's engine equals ZenFlowAdamW(process_group=default) + torch.compile on the same micro-batches;
    the optimizer state goes through torch.distributed.checkpoint next to DeepSpeed's files and the engine
    resumes exactly."""
    script = tmp_path / "two_ranks.py"
    config = ds_config(train_micro_batch_size_per_gpu=4, compile={"deepcompile": True})
    script.write_text(_TWO_RANKS.replace("{CONFIG}", repr(config)).replace("{OUT}", repr(str(tmp_path)))
                      .replace("{CKPT}", repr(str(tmp_path / "ckpt"))).replace("{TESTS}", repr(str(REPO / "tests"))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script)],
                          env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    outcomes = [json.loads((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["world_size"] == 2
        assert outcome["engine_vs_direct"] <= 1e-6
        assert outcome["resume"] == 0.0
        assert outcome["moved"] > 1e-3
        assert outcome["allreduce_bytes"] > 0 and outcome["deepspeed_allreduce"] is False
        # The optimizer state went through torch.distributed.checkpoint, each rank writing its parameters'.
        assert "zenflow_optim" in outcome["files"] and ".metadata" in outcome["optimizer_files"]
        assert sum(name.endswith(".distcp") for name in outcome["optimizer_files"]) == 2
    # The host state is split between the ranks, not replicated.
    assert outcomes[0]["host_state_bytes"] > 0 and outcomes[1]["host_state_bytes"] > 0
