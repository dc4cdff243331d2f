"""The workflows of a DeepSpeed / Hugging Face user, end to end, against an oracle.

- DeepSpeed: a config shaped like DeepSpeed's ZenFlow examples (gradient clipping, accumulation, WarmupDecayLR,
  compile) through zenflow_compile.deepspeed.initialize, checkpointed mid-interval and resumed in a fresh engine,
  equals the uninterrupted run (bitwise) and ZenFlowReference; defaults DeepSpeed derives from the `optimizer`
  block equal those of the optimizer DeepSpeed's own engine builds; Hugging Face's "auto" placeholders are
  errors naming the key.
- Hugging Face Trainer (tiny random GPT-2, no download) + ZenFlowCallback: gradient accumulation, max_grad_norm,
  a warm-up schedule, a checkpoint and resume_from_checkpoint equal the uninterrupted run and the hand-written
  loop with ZenFlowReference; Trainer(deepspeed=...) with the callback is a clear error.

CPU, DeepSpeed's CPU accelerator, one gloo rank; no DeepSpeed op is ever built (shm_comm turned off, every
optimizer is ZenFlow's or torch's).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zenflow_compile
from helpers import deepspeed_on_cpu, free_port, loss_fn, make_batches, snapshot, tiny_model
from zenflow_compile.reference import ZenFlowReference

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ds():
    """deepspeed on its CPU accelerator with a one-rank gloo group (helpers.deepspeed_on_cpu).
    The Trainer tests come first in this file: under an initialized process group Trainer runs distributed."""
    yield from deepspeed_on_cpu()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def examples_config(**top) -> dict:
    """Shaped like DeepSpeed's ZenFlow fine-tuning config (sizes for helpers.Tiny)."""
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "zenflow": {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 2,
                                          "update_interval": 2, "full_warm_up_rounds": 1, "overlap_step": True,
                                          "pt_reserved_cores_perc": 0.5}},
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
        "steps_per_print": 10**6,
    }
    config.update(top)
    return config


def zf_initialize(config: dict, model=None):
    import zenflow_compile.deepspeed as zds

    model = model if model is not None else tiny_model()
    return zds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))


def engine_steps(engine, micro_batches) -> None:
    for batch in micro_batches:
        engine.backward(loss_fn(engine, batch))
        engine.step()


# ------------------------------------------------------------------------------------ Hugging Face Trainer

TRAINER_ZENFLOW = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                       select_interval=2)
LR, CLIP, BATCH, GAS, STEPS, SAVE_AT = 1e-3, 0.5, 4, 2, 6, 3


def tiny_gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def lm_rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (12,), generator=g)
        rows.append(dict(input_ids=ids, labels=ids.clone()))
    return rows


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def warmup_schedule(opt):
    import transformers

    return transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)


def trainer_run(output_dir, rows, model, resume=None):
    import transformers

    from zenflow_compile.integrations.transformers import ZenFlowCallback

    transformers.logging.set_verbosity_error()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=0.0, **TRAINER_ZENFLOW)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GAS, train_sampling_strategy="sequential", max_grad_norm=CLIP,
        save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                   optimizers=(opt, warmup_schedule(opt)), callbacks=[ZenFlowCallback()])
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def test_trainer_accumulation_clipping_schedule_resume(tmp_path):
    """Trainer + ZenFlowCallback, gradient_accumulation_steps=2, max_grad_norm, linear warm-up: equals the
    hand-written loop with ZenFlowReference (synchronized where the callback synchronizes: at the checkpoint and
    the end), and resume_from_checkpoint in a fresh Trainer over other weights equals the uninterrupted run."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    assert not torch.distributed.is_initialized()  # Trainer would run distributed (see the ds fixture)
    rows = lm_rows(STEPS * BATCH * GAS)
    full, opt = trainer_run(tmp_path, rows, tiny_gpt2())
    assert opt.stats()["steps"] == STEPS and opt.max_grad_norm == CLIP

    resumed, _ = trainer_run(tmp_path, rows, tiny_gpt2(seed=9), resume=str(tmp_path / f"checkpoint-{SAVE_AT}"))
    assert all(torch.equal(full[n], resumed[n]) for n in full)

    model = tiny_gpt2()
    ref = ZenFlowReference(model.parameters(), lr=LR, weight_decay=0.0, max_grad_norm=CLIP, **TRAINER_ZENFLOW)
    sched = warmup_schedule(ref)
    norms = []
    for step in range(STEPS):
        for i in range(GAS):
            start = (step * GAS + i) * BATCH
            (model(**collate(rows[start:start + BATCH])).loss / GAS).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        ref.step()
        ref.zero_grad()
        sched.step()
        if step + 1 == SAVE_AT:
            ref.synchronize()
    ref.synchronize()
    assert min(norms) > CLIP  # clipping was active on every step
    hand = {n: p.detach() for n, p in model.named_parameters()}
    init = {n: p.detach() for n, p in tiny_gpt2().named_parameters()}
    # Adam turns rounding differences in near-zero gradient elements (GPT-2's key biases get none) into up to
    # ~lr per step in that element: compare to a few hundredths of one step.
    for name in full:
        torch.testing.assert_close(full[name], hand[name], atol=0.03 * LR, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert max((full[n] - init[n]).abs().max().item() for n in full) > 2 * LR


_TRAINER_REFUSALS = textwrap.dedent("""
    import os, sys, tempfile, torch, deepspeed.ops, transformers
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build
    import zenflow_compile
    from zenflow_compile.integrations.transformers import ZenFlowCallback

    def build(**args):
        model = torch.nn.Linear(4, 4)
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-3)
        args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=1, report_to="none", **args)
        try:
            transformers.Trainer(model=model, args=args, train_dataset=[], callbacks=[ZenFlowCallback()],
                                 optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
        except ValueError as error:
            print("REFUSED:", error)
        else:
            print("ACCEPTED")

    if sys.argv[1] == "deepspeed":
        build(deepspeed={"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}})
    else:
        torch.distributed.init_process_group("gloo")  # what torchrun's script does; Trainer then wraps in DDP
        build(use_cpu=True)
        torch.distributed.destroy_process_group()
""")


@pytest.mark.parametrize("case, refusal", [
    ("deepspeed", "ZenFlowCallback cannot run with DeepSpeed enabled in Trainer (TrainingArguments(deepspeed="),
    ("distributed", "ZenFlowCallback cannot run with Trainer's parallel mode 'distributed'"),
])
def test_zenflow_callback_refuses_trainer_deepspeed_and_ddp(tmp_path, case, refusal):
    """Trainer(deepspeed=...) hands ZenFlowAdamW to deepspeed.initialize, where it never steps (stage 0) or
    crashes (stage 2); a distributed Trainer wraps the model in DDP, whose hooks refill `.grad` behind ZenFlow
    (3.6e-3 off the reference after 6 steps on one rank). The callback refuses both when Trainer is built,
    naming the fix. (Subprocesses: both modes set process-wide state.)"""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    script = tmp_path / "trainer_refusals.py"
    script.write_text(_TRAINER_REFUSALS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), case], env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"REFUSED: {refusal}" in out, out[-3000:]
    assert "zenflow_compile.deepspeed.initialize" in out if case == "deepspeed" else "process_group=" in out


# ---------------------------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_checkpoint_resume_equals_uninterrupted_and_reference(ds, tmp_path):
    """Compiled engine, gradient_accumulation_steps=2, gradient_clipping (active), WarmupDecayLR: save after 3
    steps (a CPU update in flight, the schedule mid-warm-up), load into a fresh engine with other weights,
    3 more steps == the uninterrupted run, bitwise; that run == ZenFlowReference on the same micro-batches."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    sched = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "total_num_steps": 12}
    config = examples_config(gradient_accumulation_steps=2, gradient_clipping=0.05, compile={"deepcompile": True},
                             scheduler={"type": "WarmupDecayLR", "params": sched})
    config["zero_optimization"]["zenflow"]["select_interval"] = 4  # step 3 overlaps, step 5 reselects
    micro = make_batches(12)

    engine, opt, _, _ = zf_initialize(config)
    engine.compile()
    engine_steps(engine, micro[:6])
    assert opt.stats()["steps"] == 3 and opt.stats()["update_pending"]
    engine.save_checkpoint(str(tmp_path), tag="step3")
    engine_steps(engine, micro[6:])
    opt.synchronize()
    uninterrupted = snapshot(engine.module)

    fresh, fresh_opt, _, _ = zf_initialize(config, model=tiny_model(seed=7))
    fresh.compile()
    fresh.load_checkpoint(str(tmp_path))
    engine_steps(fresh, micro[6:])
    fresh_opt.synchronize()
    assert fresh.global_steps == engine.global_steps == 6 and fresh.get_lr() == engine.get_lr()
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, snapshot(fresh.module)))

    model = tiny_model()
    zenflow = config["zero_optimization"]["zenflow"]
    ref = ZenFlowReference(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                           max_grad_norm=0.05, **zenflow)
    ref_sched = WarmupDecayLR(ref, **sched)
    norms = []
    for i in range(0, 12, 2):
        for batch in micro[i:i + 2]:
            (loss_fn(model, batch) / 2).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        ref.step()
        ref.zero_grad()
        ref_sched.step()
    ref.synchronize()
    assert min(norms) > 0.05  # clipping was active on every step
    for a, b in zip(uninterrupted, snapshot(model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(uninterrupted, snapshot(tiny_model()))) > 1e-3


@pytest.mark.parametrize("optimizer", [
    {"type": "AdamW", "params": {"lr": 2e-5, "torch_adam": True}},
    {"type": "Adam", "params": {"lr": 2e-5, "torch_adam": True, "eps": 1e-6}},
], ids=["AdamW-torch_adam", "Adam-torch_adam"])
def test_optimizer_defaults_equal_the_optimizer_deepspeed_builds(ds, optimizer):
    """lr, betas, eps, weight_decay left out of `optimizer.params` take the values of the optimizer DeepSpeed's
    own engine builds from the same block (`torch_adam: true` builds torch.optim.AdamW: weight_decay 0.01)."""
    model = tiny_model()
    plain, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(),
                                   config={"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer,
                                           "steps_per_print": 10**6})
    assert type(plain.optimizer) is torch.optim.AdamW  # DeepSpeed's choice for this block, no wrapper
    _, opt, _, _ = zf_initialize(examples_config(optimizer=optimizer))
    keys = ("lr", "betas", "eps", "weight_decay")
    assert {k: opt.defaults[k] for k in keys} == {k: plain.optimizer.defaults[k] for k in keys}


@pytest.mark.parametrize("key", ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                 "gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                                 "scheduler.params.warmup_max_lr"])
def test_hugging_face_auto_placeholder_is_an_error_naming_the_key(ds, key):
    """A config written for Hugging Face's Trainer holds "auto" where Trainer fills in its arguments: here it is a
    ValueError naming the key (DeepSpeed itself fails with a TypeError from its batch arithmetic)."""
    config = examples_config(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2,
                                                                       "warmup_num_steps": 2}})
    *path, last = key.split(".")
    block = config
    for part in path:
        block = block[part]
    block[last] = "auto"
    with pytest.raises(ValueError, match=rf"{key}='auto'.*set a value"):
        zf_initialize(config)


def test_reduce_bucket_size_auto_reads_as_unset(ds):
    """DeepSpeed's zero_optimization block reads "auto" as its default: here, ZenFlow's default bucket, the run
    identical to one without the key."""
    runs = []
    for zero_extra in ({}, {"reduce_bucket_size": "auto"}):
        config = examples_config()
        config["zero_optimization"].update(zero_extra)
        engine, opt, _, _ = zf_initialize(config)
        engine_steps(engine, make_batches(3))
        opt.synchronize()
        runs.append(snapshot(engine.module))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
