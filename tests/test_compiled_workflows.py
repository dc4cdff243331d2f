"""Compiled training in the ways torch.compile users actually write it, each against the eager reference.

`torch.compile(..., backend="zenflow")` + ZenFlowAdamW on one copy, `ZenFlowReference` on an uncompiled copy,
with reselection, overlap and boundaries inside the run (update_interval=2, select_interval=2, r=0.25,
one warm-up step), compared after every step:

- gradients asked for the input only (`torch.autograd.grad(loss, x)`, `loss.backward(inputs=[x])`: FGSM-style
  adversarial training) hand no parameter gradient to the optimizer, as eagerly (static and dynamic shapes:
  SymInt inputs have no autograd edge); `backward(inputs=[w])` hands w's only; `torch.autograd.grad` of a
  parameter through the rewritten graph is a clear error naming the fix;
- a data-dependent branch mid-forward (several forward/backward graphs per step);
- activation checkpointing with an embedding tied to the output projection (one parameter used twice),
  dynamic=True with batch and sequence lengths changing every step;
- eval()/train() switches and no_grad forwards between steps (recompiles on the training flag);
- a whole train step (forward, backward, step, zero_grad) under one torch.compile.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow" without the installed entry point)
from zenflow_compile.reference import ZenFlowReference

from helpers import seeded_generator

LR = 1e-2
KEYS = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2,
            full_warm_up_rounds=1, overlap_step=True)
ATOL, RTOL = 1e-5, 1e-4
STEPS = 8


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def train_against_reference(model, loss_of, *, steps=STEPS, compile_kwargs=None, keys=KEYS):
    """Train `model` compiled with ZenFlowAdamW and an eager copy with ZenFlowReference; `loss_of(call,
    model, step)` runs the step's forward passes (and any extra backward of its own) through `call` and
    returns the loss to train on. Parameters must agree after every step and after synchronize()."""
    reference_model = copy.deepcopy(model)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **keys)
    reference = ZenFlowReference(reference_model.parameters(), lr=LR, **keys)
    compiled = torch.compile(model, backend="zenflow", **(compile_kwargs or {}))
    for step in range(steps):
        loss_of(compiled, model, step).backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        loss_of(reference_model, reference_model, step).backward()
        reference.step()
        reference.zero_grad()
        for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step} {name}: {m}")
    opt.synchronize()
    reference.synchronize()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    for key in ("steps", "cpu_updates", "reselections"):
        assert opt.stats()[key] == reference.stats()[key], key
    return opt


class MLP(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, 24)
        self.fc2 = nn.Linear(24, dim)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def regression_batch(step, rows=8, dim=16):
    g = seeded_generator(1000 + step)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)


# --------------------------------------------------------------------------- gradients of the input only
@pytest.mark.parametrize("how,dynamic", [("autograd.grad", False), ("backward(inputs=)", False),
                                         ("autograd.grad", True)], ids=["grad", "backward-inputs", "grad-dynamic"])
def test_input_only_gradients_reach_no_optimizer(how, dynamic, device):
    """FGSM-style adversarial training: the gradient of the loss w.r.t. the input perturbs it, then the model
    trains on the perturbed input. Only the second backward's parameter gradients may reach the optimizer
    (before the fix the first one's did too: 3.6e-2 off the reference)."""

    def loss_of(call, model, step):
        x, y = regression_batch(step, rows=4 + step if dynamic else 8)  # dynamic: a new batch size each step
        x.requires_grad_(True)
        loss = ((call(x) - y) ** 2).mean()
        if how == "autograd.grad":
            (gx,) = torch.autograd.grad(loss, x)
        else:
            loss.backward(inputs=[x])
            gx = x.grad
        return ((call((x + 0.1 * gx.sign()).detach()) - y) ** 2).mean()

    torch.manual_seed(0)
    train_against_reference(MLP(), loss_of, compile_kwargs=dict(dynamic=dynamic))


def test_backward_with_inputs_hands_over_only_those_parameters(device):
    def loss_of(call, model, step):
        x, y = regression_batch(step)
        ((call(x) - y) ** 2).mean().backward(inputs=[model.fc1.weight])  # fc1.weight only
        x, y = regression_batch(100 + step)
        return ((call(x) - y) ** 2).mean()

    torch.manual_seed(0)
    train_against_reference(MLP(), loss_of)


def test_autograd_grad_of_a_parameter_is_a_clear_error():
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    compiled = torch.compile(model, backend="zenflow")
    x, y = regression_batch(0)
    with pytest.raises(RuntimeError, match=r"torch\.autograd\.grad\(\.\.\., inputs=\[\.\.\., fc2\.weight, \.\.\.\]\)"
                                           r" through a graph compiled with backend='zenflow'.*Fix: use "
                                           r"loss\.backward\(\).*backend='inductor'"):
        torch.autograd.grad(((compiled(x) - y) ** 2).mean(), [model.fc2.weight])
    # Nothing was handed over: the next step trains on its own gradient only, as the reference does.
    reference_model = MLP()
    reference_model.load_state_dict(model.state_dict())
    reference = ZenFlowReference(reference_model.parameters(), lr=LR, **KEYS)
    ((compiled(x) - y) ** 2).mean().backward()
    opt.step()
    ((reference_model(x) - y) ** 2).mean().backward()
    reference.step()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


# -------------------------------------------------------------------------------- graphs and recompiles
class BranchyMLP(MLP):
    """A data-dependent branch mid-forward: a graph break, so two forward and two backward graphs per step
    (which resume function runs depends on the data)."""

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if h.mean() > 0:
            h = h * 2
        else:
            h = h - 1
        return self.fc2(h)


def test_data_dependent_branch_mid_forward_equals_reference(device):
    def loss_of(call, model, step):
        x, y = regression_batch(step)
        return ((call(x + (0.5 if step % 3 else -0.5)) - y) ** 2).mean()  # both branches are taken

    torch.manual_seed(0)
    train_against_reference(BranchyMLP(), loss_of)


class CheckpointedTiedLM(nn.Module):
    """Embedding -> two checkpointed residual blocks -> output projection sharing the embedding's weight."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def token_batch(step, batch=4, seq=6):
    g = seeded_generator(2000 + step)
    return torch.randint(0, 32, (batch, seq + 1), generator=g)


def lm_loss(call, tokens):
    logits = call(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_checkpointing_tied_embedding_and_dynamic_shapes_equal_reference(device):
    """Activation checkpointing and a tied weight in one graph, batch and sequence lengths changing every
    step under dynamic=True."""
    shapes = [(4, 6), (2, 9), (5, 3), (3, 7), (4, 6), (6, 2), (2, 5), (3, 4)]
    torch.manual_seed(0)
    train_against_reference(CheckpointedTiedLM(), lambda call, model, step: lm_loss(call, token_batch(step, *shapes[step])),
                            compile_kwargs=dict(dynamic=True))


class DropoutFreeNet(nn.Module):
    """Training flag changes the forward (a recompile), BatchNorm buffers update in training only."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.bn = nn.BatchNorm1d(24)
        self.fc2 = nn.Linear(24, 16)

    def forward(self, x):
        h = self.bn(torch.tanh(self.fc1(x)))
        return self.fc2(h * 1.5 if self.training else h)


def test_eval_and_no_grad_forwards_between_steps_equal_reference(device):
    evaluations = {}

    def loss_of(call, model, step):
        x, y = regression_batch(step)
        if step % 3 == 1:  # evaluate: no_grad in train mode, then eval mode with and without grad
            with torch.no_grad():
                seen = [call(x)]
            model.eval()
            with torch.no_grad():
                seen.append(call(x))
            seen.append(call(x))
            model.train()
            evaluations.setdefault(step, []).append(seen)
        return ((call(x) - y) ** 2).mean()

    torch.manual_seed(0)
    train_against_reference(DropoutFreeNet(), loss_of)
    for compiled_outputs, reference_outputs in evaluations.values():
        for a, b in zip(compiled_outputs, reference_outputs):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------- a train step compiled whole
@pytest.mark.parametrize("backend", ["zenflow", "inductor"])
def test_a_train_step_compiled_whole_runs_the_optimizer_eagerly_and_equals_reference(backend, device):
    """torch.compile of a function doing forward, backward, step and zero_grad: Dynamo breaks the graph at
    step() and zero_grad(), which run as they do uncompiled."""
    torch.manual_seed(0)
    model = MLP()
    reference_model = copy.deepcopy(model)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, max_grad_norm=1.0, **KEYS)
    reference = ZenFlowReference(reference_model.parameters(), lr=LR, max_grad_norm=1.0, **KEYS)

    @torch.compile(backend=backend)
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for step in range(STEPS):
        x, y = regression_batch(step)
        loss = train_step(x, y)
        reference_loss = ((reference_model(x) - y) ** 2).mean()
        reference_loss.backward()
        reference.step()
        reference.zero_grad()
        torch.testing.assert_close(loss, reference_loss, atol=ATOL, rtol=RTOL)
    opt.synchronize()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    assert opt.stats()["steps"] == reference.stats()["steps"] == STEPS


# ------------------------------------------------------------------------------------------- debug files
def test_debug_dir_writes_the_graphs_even_when_the_caches_are_warm(tmp_path):
    """options={"debug_dir": d} asks for the backward graphs as files; the rewrite happens only when a graph
    is compiled, so a graph served by a warm FX-graph / AOTAutograd cache left d empty without a word."""
    from torch._inductor.utils import fresh_cache

    def train_once(**options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP()
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
        x, y = regression_batch(0)
        compiled = torch.compile(model, backend="zenflow", options=options or None)
        ((compiled(x) - y) ** 2).mean().backward()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        plain = train_once()  # warms both caches
        debugged = train_once(debug_dir=str(tmp_path / "graphs"))
    written = sorted(path.name for path in (tmp_path / "graphs").glob("*.py"))
    assert len(written) == 2 and written[0].endswith("_after.py") and written[1].endswith("_before.py"), written
    assert "zenflow.accumulate_grads" in (tmp_path / "graphs" / written[0]).read_text()
    for p, q in zip(plain, debugged):
        assert torch.equal(p, q)
    with pytest.raises(Exception, match=r"debug_dir=5 is invalid: expected a directory path"):
        train_once(debug_dir=5)


def test_inductor_options_are_checked_as_torch_compile_checks_them():
    """backend="inductor" refuses a wrongly typed Inductor option and accepts "-" for "_"; so does zenflow."""
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    x, y = regression_batch(0)
    with pytest.raises(Exception, match=r"Inductor option max_autotune=3 is invalid: expected a bool"):
        torch.compile(model, backend="zenflow", options={"max_autotune": 3})(x)
    torch._dynamo.reset()
    ((torch.compile(model, backend="zenflow", options={"epilogue-fusion": False})(x) - y) ** 2).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert opt.stats()["steps"] == 1
