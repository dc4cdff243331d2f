"""The `zenflow` backend end to end: registration, options, errors, and the training situations of the compiled path
(graph breaks, recompiles, accumulation, no_grad evaluation, tied weights, mixed compiled/eager use).

Numerics: with update_interval=1 and no overlap, ZenFlow must equal torch.optim.AdamW (invariant 1), so each
situation is checked against AdamW on an eager copy of the model.
"""

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile import backend as zf_backend
from zenflow_compile.runtime import registry

ATOL, RTOL = 1e-5, 1e-4
LR = 1e-2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class MLP(nn.Module):
    def __init__(self, d_in=6, d_hidden=8, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class BrokenMLP(MLP):
    """Two compiled graphs (and two backward graphs) per step."""

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


class TiedLM(nn.Module):
    def __init__(self, vocab=12, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # one parameter, used twice

    def forward(self, tokens):
        return self.head(torch.relu(self.mid(self.emb(tokens))))


def pair(make, **keys):
    torch.manual_seed(0)
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    keys = {"topk_ratio": 0.5, "update_interval": 1, "overlap_step": False, **keys}
    opt_a = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR)
    return a, opt_a, b, opt_b


def loss_of(out):
    return out.float().pow(2).mean()


def assert_params_close(a, b, msg=""):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"{msg} {name}: {m}")


# --------------------------------------------------------------------------------------------- registration
def test_registered_by_name_and_idempotent():
    from torch._dynamo.backends.registry import lookup_backend

    zf_backend.register()
    zf_backend.register()
    assert "zenflow" in torch._dynamo.list_backends()
    assert lookup_backend("zenflow") is zf_backend.zenflow_backend


def _entry_point_installed():
    return any(ep.name == "zenflow" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="package not installed (no entry point metadata)")
def test_entry_point_works_without_importing_the_package():
    script = textwrap.dedent("""
        import sys, torch
        assert "zenflow_compile" not in sys.modules
        model = torch.nn.Linear(3, 2).requires_grad_(False)   # no optimizer needed: nothing trains
        out = torch.compile(model, backend="zenflow")(torch.randn(4, 3))
        assert out.shape == (4, 2)
        assert "zenflow_compile.backend" in sys.modules
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------- errors/options
def test_unowned_trainable_parameter_is_a_compile_time_error():
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW([model.fc1.weight, model.fc1.bias], lr=LR)
    compiled = torch.compile(model, backend="zenflow")
    with pytest.raises(Exception, match=r"parameter fc2\.weight \(shape \(4, 8\).*no ZenFlowAdamW owns it"):
        compiled(torch.randn(2, 6))
    del opt


def test_unowned_parameters_are_fine_without_grad():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="zenflow")
    with torch.no_grad():
        torch.testing.assert_close(compiled(torch.ones(2, 6)), model(torch.ones(2, 6)))
    model.requires_grad_(False)
    torch.testing.assert_close(compiled(torch.ones(2, 6)), model(torch.ones(2, 6)))


def test_options_must_agree_with_the_owning_optimizer():
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    x = torch.randn(2, 6)

    torch.compile(model, backend="zenflow", options={"topk_ratio": 0.25, "update_interval": 2})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"topk_ratio=0\.5 differs from the owning ZenFlowAdamW's config "
                                        r"\(topk_ratio=0\.25\)"):
        torch.compile(model, backend="zenflow", options={"topk_ratio": 0.5})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"update_interval=0 is invalid"):
        torch.compile(model, backend="zenflow", options={"update_interval": 0})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"unknown option 'topk'"):
        torch.compile(model, backend="zenflow", options={"topk": 0.5})(x)
    del opt


def test_inductor_options_and_mode_pass_through():
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR)
    compiled = torch.compile(model, backend="zenflow", options={"epilogue_fusion": False, "topk_ratio": 0.1})
    loss_of(compiled(torch.randn(2, 6))).backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()


# ------------------------------------------------------------------------------------------------ training
def test_grads_stay_none_and_training_equals_adamw():
    a, opt_a, b, opt_b = pair(MLP)
    compiled = torch.compile(a, backend="zenflow")
    for step in range(3):
        x = torch.randn(5, 6)
        loss_of(compiled(x)).backward()
        assert all(p.grad is None for p in a.parameters())
        opt_a.step()
        opt_a.zero_grad()
        loss_of(b(x)).backward()
        opt_b.step()
        opt_b.zero_grad()
        assert_params_close(a, b, f"step {step}")
    assert opt_a.stats()["steps"] == 3


def test_graph_breaks_accumulation_recompiles_and_no_grad_eval():
    a, opt_a, b, opt_b = pair(BrokenMLP)
    compiled = torch.compile(a, backend="zenflow")
    for step, batch in enumerate([3, 5, 7]):  # new shapes: recompiles (then dynamic)
        for micro in range(2):  # gradient accumulation: several backwards per step
            x = torch.randn(batch, 6)
            loss_of(compiled(x)).backward()
            loss_of(b(x)).backward()
        assert all(p.grad is None for p in a.parameters())
        opt_a.step()
        opt_a.zero_grad()
        opt_b.step()
        opt_b.zero_grad()
        assert_params_close(a, b, f"step {step}")
        with torch.no_grad():  # evaluation between steps: inference graphs, untouched
            x = torch.randn(2, 6)
            torch.testing.assert_close(compiled(x), b(x), atol=ATOL, rtol=RTOL)


def test_tied_embedding_gets_the_sum_of_both_uses():
    a, opt_a, b, opt_b = pair(TiedLM)
    compiled = torch.compile(a, backend="zenflow")
    for step in range(3):
        tokens = torch.randint(0, 12, (4, 5))
        loss_of(compiled(tokens)).backward()
        loss_of(b(tokens)).backward()
        opt_a.step()
        opt_a.zero_grad()
        opt_b.step()
        opt_b.zero_grad()
        assert_params_close(a, b, f"step {step}")


def test_parameters_used_outside_the_compiled_region_reach_the_runtime():
    """A compiled body plus an eager head: the body's grads are handed over in the graph (no .grad), the
    head's reach the step through .grad, as eagerly."""
    a, opt_a, b, opt_b = pair(MLP)
    body = torch.compile(a.fc1, backend="zenflow")
    for step in range(3):
        x = torch.randn(4, 6)
        loss_of(a.fc2(torch.tanh(body(x)))).backward()
        assert all(p.grad is None for p in a.fc1.parameters())
        assert all(p.grad is not None for p in a.fc2.parameters())
        loss_of(b(x)).backward()
        opt_a.step()
        opt_a.zero_grad()
        opt_b.step()
        opt_b.zero_grad()
        assert_params_close(a, b, f"step {step}")


def test_input_gradients_are_still_returned():
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR)
    x = torch.randn(3, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    loss_of(torch.compile(model, backend="zenflow")(x)).backward()
    loss_of(ref(x_ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert model.fc1.weight.grad is None
    del opt


def test_a_deleted_optimizer_leaves_an_unowned_parameter_error_not_a_misroute():
    torch.manual_seed(0)
    model = MLP()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR)
    compiled = torch.compile(model, backend="zenflow")
    loss_of(compiled(torch.randn(2, 6))).backward()
    opt.zero_grad()
    del opt
    import gc

    gc.collect()
    assert registry.param_id(model.fc1.weight) is None
    with pytest.raises(ValueError, match=r"requires grad but no ZenFlowAdamW owns it"):
        loss_of(compiled(torch.randn(2, 6))).backward()
    # A new optimizer over the compiled model: no recompile needed, its gradients arrive.
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR)
    loss_of(compiled(torch.randn(2, 6))).backward()
    opt.step()
    assert opt.stats()["steps"] == 1
