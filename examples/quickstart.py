"""Quick start: fine-tune a small Llama-shaped model with compiled ZenFlow on whatever device you have.

    python examples/quickstart.py [--steps 20] [--device cuda]

Base install only (torch and this package). How long: about 30 s on 2 CPU cores the first time, most of it
compiling, and about 7 s once Inductor's cache is warm (a 2-core x86_64 VM, OMP_NUM_THREADS=1, 2026-11-28).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import zenflow_compile


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda if available, else cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM().to(args.device)
    # The project's defaults; clipping through max_grad_norm (compiled, .grad stays None: clip_grad_norm_ sees none)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    compiled = torch.compile(model, backend="zenflow")
    data = torch.randint(0, 256, (64, 8, 32), device=args.device)  # a repeating synthetic corpus
    print("compiling forward and backward (the first step: about a minute on 2 CPU cores, less on a GPU)")
    step_seconds = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = compiled(data[step % 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()  # (time the step's device work, not only its launch)
        step_seconds.append(time.perf_counter() - start)
    opt.synchronize()
    later = sorted(step_seconds[1:]) or step_seconds
    print(f"first step {step_seconds[0]:.1f} s (compiling), then {1000 * later[len(later) // 2]:.1f} ms per step "
          "(median)")
    stats = opt.stats()  # (every counter: docs/stats.md)
    print(f"CPU updates: {stats['cpu_updates']}, of which {stats['overlapped_boundaries']} overlapped the next steps")
    print(f"stall (the training loop waiting for ZenFlow): {stats['stall_seconds']:.2f} s")
    print(f"optimizer state on the {args.device}: {stats['device_state_bytes'] / 1e6:.2f} MB "
          f"(host: {stats['host_state_bytes'] / 1e6:.2f} MB; gradients summed on the {stats['accumulate_on']})")


if __name__ == "__main__":
    main()
