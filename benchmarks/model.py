"""The benchmark model: a Llama-shaped decoder (transformers' LlamaForCausalLM) built from a config preset,
randomly initialised (nothing is downloaded), and synthetic token batches.

Presets (vocab 32000 except `smoke`; untied embeddings, SwiGLU MLP, RMSNorm, RoPE, SDPA attention):

    smoke   ~0.12M  1 layer,  hidden 64   (CPU, seconds)
    125m    ~134M  12 layers, hidden 768
    350m    ~373M  24 layers, hidden 1024
    1b      ~1.1B  22 layers, hidden 2048, GQA 32/4 heads (TinyLlama-1.1B shape)
    3b      ~3.4B  26 layers, hidden 3200 (OpenLLaMA-3B shape)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PRESETS: dict[str, dict] = {
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
    "350m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "3b": dict(vocab_size=32000, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26,
               num_attention_heads=32, num_key_value_heads=32),
}


def llama_config(preset: str, seq_len: int):
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: expected one of {sorted(PRESETS)}")
    return LlamaConfig(**PRESETS[preset], max_position_embeddings=max(2048, seq_len), use_cache=False,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def analytic_num_params(preset: str) -> int:
    """Parameter count of a preset without building it (embeddings + layers + final norm + LM head)."""
    p = PRESETS[preset]
    h, i, v, layers = p["hidden_size"], p["intermediate_size"], p["vocab_size"], p["num_hidden_layers"]
    kv = h // p["num_attention_heads"] * p["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return 2 * v * h + layers * per_layer + h


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(preset: str, seq_len: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A freshly initialised LlamaForCausalLM, created directly on `device` in `dtype`, in train mode."""
    from transformers import LlamaForCausalLM

    config = llama_config(preset, seq_len)
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config)
    model.to(device=device, dtype=dtype)
    model.train()
    return model


def model_stats(model: torch.nn.Module) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    return dict(num_params=sum(p.numel() for p in params),
                model_bytes=sum(p.numel() * p.element_size() for p in params),
                param_dtype=str(params[0].dtype).replace("torch.", ""))


def synthetic_batches(vocab_size: int, batch: int, seq_len: int, device: torch.device, num: int = 4,
                      seed: int = 1234) -> list[torch.Tensor]:
    """`num` distinct batches of uniformly random token ids (cycled by the training loop)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num, batch, seq_len), generator=generator)
    return [t.to(device) for t in tokens]
