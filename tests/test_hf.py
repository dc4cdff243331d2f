"""A Hugging Face `transformers` causal LM (tiny random LlamaForCausalLM, tied embeddings, no download)
trains under backend="zenflow" and matches the eager reference (docs/semantics.md, invariant 3).

The reference's copy of the model is compiled with the stock "inductor" backend, so both sides see the same
forward/backward numerics and the comparison is of the optimizers (see tests/test_backend_training.py).
Gradients are then bitwise equal; the column scores are not (Inductor sums the squares in another order than
the reference's eager `pow(2).sum`), so the clipping coefficient, computed from the scores, differs by an
ulp, which Adam's normalisation can grow to ~1e-5 on elements whose gradients cancel across steps.
"""

import pytest
import torch

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow" without the installed entry point)
from zenflow_compile.reference import ZenFlowReference

transformers = pytest.importorskip("transformers")

LR = 1e-2
ATOL, RTOL = 2e-5, 1e-4


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_llama_trains_under_zenflow_and_matches_reference():
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                select_interval=2)
    a, b = tiny_llama(), tiny_llama()
    assert a.model.embed_tokens.weight is a.lm_head.weight  # tied: one parameter, two uses
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, max_grad_norm=1.0, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, max_grad_norm=1.0, **keys)
    model_a = torch.compile(a, backend="zenflow")
    model_b = torch.compile(b, backend="inductor")

    losses = []
    for step in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = model_a(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is None for p in a.parameters())
        opt.step()
        opt.zero_grad()
        model_b(input_ids=ids, labels=ids).loss.backward()
        ref.step()
        ref.zero_grad()
        losses.append(loss.item())
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step} {name}: {m}")
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    assert opt.stats()["steps"] == 5 and opt.stats()["reselections"] == ref.stats()["reselections"] > 0

    # Training on one repeated batch must lower its loss.
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(99))
    first = None
    for _ in range(4):
        loss = model_a(input_ids=ids, labels=ids).loss
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model_a(input_ids=ids, labels=ids).loss.item() < first
