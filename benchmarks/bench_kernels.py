"""Micro-benchmarks of the compiled path's GPU kernels: is each Triton kernel worth having?

    python benchmarks/bench_kernels.py --size 1b --out kernels_1b.json     # on a GPU (default size there)
    python benchmarks/bench_kernels.py --out kernels_small.json            # CPU: torch rows only, size small
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke          # CPU: Triton rows run interpreted
    python benchmarks/bench_kernels.py --smoke --out smoke.json            # tiny sizes, seconds: checks the harness

Sections (matrices shaped like a Llama layer's 7 weights [R, C] = [out, in], bf16; k = --topk-ratio of columns):
  column_norms   per distinct shape: eager `(g.float()**2).sum(0)` (baseline) vs Inductor's fused reduction
                 vs the Triton `column_sq_norms`
  adamw_slab     all matrices, each a slab of its own (as the runtime keeps matrices this large), [1, R, k]
                 state: the torch twin `adamw_columns_torch_` (baseline) vs Inductor's kernel for the same
                 function (`torch.compile(adamw_columns_torch_, dynamic=True)`) vs the Triton `adamw_slab_`
  grad_offload   all matrices, device -> host gradient of the unselected columns into a [n_u, R] host buffer:
                 whole gradient to pinned memory + select on the host (baseline) vs gather on the device +
                 copy of the n_u columns only; "copy only" / "gather only" rows split the costs

Timing: warm-up calls, then --repeat timed calls, median reported. CUDA: events around each call, the device
synchronised (and the L2 cache flushed) before each, so a call's time includes its host-side launch cost
when the host is the bottleneck; for grad_offload the host work sits between the events and is included
(the stream is idle at both records, so they read wall time). CPU: time.perf_counter.
GB/s: bytes the variant must move (a row's `bytes_what` says which) / median time: for norms, merge and
AdamW the minimal reads + writes; for grad_offload the bytes crossing the host link (gather only: the
device read + write). `x base`: median / the baseline variant's median (lower is faster).
Triton on CPU runs only under TRITON_INTERPRET=1, once, as a correctness check: "interpreted: not a speed".
Every non-baseline row also records `max_err` against the baseline's result (a sanity check, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from zenflow_compile.triton_kernels import (HAVE_TRITON, adamw_columns_torch_, adamw_slab_, column_sq_norms,
                                            triton_available)

# Llama-shaped layers: hidden, intermediate (MLP), kv (GQA k/v projection rows), layers. 1b = TinyLlama-1.1B.
SIZES = {
    "smoke": dict(hidden=64, inter=176, kv=16, layers=2),
    "small": dict(hidden=512, inter=1408, kv=128, layers=4),
    "1b": dict(hidden=2048, inter=5632, kv=256, layers=22),
}
SECTIONS = ("column_norms", "adamw_slab", "grad_offload")
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
INTERPRETED = "interpreted: not a speed"


def layer_shapes(hidden, inter, kv, layers):
    """[R, C] of every weight matrix: q, k, v, o, gate, up, down per layer."""
    one = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
           (hidden, inter)]
    return one * layers


class Bench:
    def __init__(self, device, warmup, repeat):
        self.device, self.warmup, self.repeat = device, warmup, repeat
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None
        self.rows = []

    def time(self, fn, warmup, repeat):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            if self.cuda:
                self.flush.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def run(self, section, name, variant, shape, nbytes, bytes_what, make, *, triton=False, check=None):
        """Time one variant. `make()` builds fresh inputs and returns (fn, result): fn runs the variant once,
        result() its output (for `check(result_of_this, result_of_baseline)`). The first row of a
        (section, name) is the baseline."""
        row = dict(section=section, name=name, variant=variant, shape=shape, bytes=nbytes, bytes_what=bytes_what,
                   status="ok", note="", error=None, median_ms=None, min_ms=None, times_ms=[], gbps=None,
                   ratio=None, max_err=None)
        base = next((r for r in self.rows if r["section"] == section and r["name"] == name), None)
        interpreted = triton and not self.cuda
        if triton and not triton_available(self.device):
            row.update(status="skipped", note="triton not importable" if not HAVE_TRITON or self.cuda
                       else "Triton on CPU needs TRITON_INTERPRET=1")
            self.rows.append(row)
            return row
        try:
            fn, result = make()
            fn()  # first call: compile / autotune / correctness check
            if self.cuda:
                torch.cuda.synchronize()
            if base is not None and check is not None and base.get("_result") is not None:
                row["max_err"] = float(check(result(), base["_result"]))
            elif base is None and check is not None:
                row["_result"] = [t.clone() for t in result()]  # the timed calls below may mutate it
            times = self.time(fn, 0 if interpreted else self.warmup, 1 if interpreted else self.repeat)
        except Exception as exc:  # a row, never a crash of the benchmark
            row.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
            self.rows.append(row)
            return row
        med = statistics.median(times)
        row.update(times_ms=[round(t, 4) for t in times], median_ms=med, min_ms=min(times))
        if interpreted:
            row["note"] = INTERPRETED
        else:
            row["gbps"] = nbytes / med / 1e6
            if base is not None and base["median_ms"] and base["note"] != INTERPRETED:
                row["ratio"] = med / base["median_ms"]
        if base is None:
            row["ratio"] = 1.0
        self.rows.append(row)
        return row


def max_diff(a, b):
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b)), default=0.0)


# --------------------------------------------------------------------------------------------- sections
def bench_column_norms(b, shapes, max_shapes):
    dev = b.device
    inductor = torch.compile(lambda g: (g.float() ** 2).sum(0), dynamic=False)
    for R, C in list(dict.fromkeys(shapes))[:max_shapes]:
        torch.manual_seed(0)
        g = torch.randn(R, C, device=dev).to(torch.bfloat16)
        out = {}

        def make(f):
            def fn():
                out["r"] = f(g)
            return fn, lambda: [out["r"]]

        args = ("column_norms", f"{R}x{C}", None, f"{R}x{C} bf16", R * C * 2 + C * 4, "grad read + fp32 [C] write")
        check = lambda r, base: max_diff(r, base) / base[0].abs().max().item()  # noqa: E731  relative
        b.run(*args[:2], "eager torch", *args[3:], lambda: make(lambda x: (x.float() ** 2).sum(0)), check=check)
        b.run(*args[:2], "inductor", *args[3:], lambda: make(inductor), check=check)
        b.run(*args[:2], "triton", *args[3:], lambda: make(lambda x: column_sq_norms(x, use_triton=True)),
              triton=True, check=check)


def adamw_slabs(shapes, ratio, dev):
    """Per matrix, a slab of one: bf16 gradient and fp32 state [1, R, k], per-column counts [1, k]."""
    torch.manual_seed(0)
    slabs = []
    for R, C in shapes:
        k = max(1, round(ratio * C))
        slabs.append(dict(grad=(torch.randn(1, R, k, device=dev) * 1e-3).to(torch.bfloat16),
                          master=torch.randn(1, R, k, device=dev) * 0.02,
                          exp_avg=torch.randn(1, R, k, device=dev) * 1e-4,
                          exp_avg_sq=torch.rand(1, R, k, device=dev) * 1e-7,
                          counts=torch.full((1, k), 10.0, device=dev)))
    return slabs


def bench_adamw_slab(b, shapes, ratio, label):
    ks = [max(1, round(ratio * C)) for _, C in shapes]
    nbytes = sum(R * k * (2 + 12 + 12) + k * 8 for (R, _), k in zip(shapes, ks))
    what = "grad bf16 read, master/m/v fp32 read+write, counts read+write"
    inductor = torch.compile(adamw_columns_torch_, dynamic=True)
    for variant, fn_, triton in (("torch twin", adamw_columns_torch_, False), ("inductor", inductor, False),
                                 ("triton", lambda *a, **kw: adamw_slab_(*a, use_triton=True, **kw), True)):
        def make(fn_=fn_):
            slabs = adamw_slabs(shapes, ratio, b.device)

            def fn():
                for st in slabs:
                    fn_(st["grad"], st["master"], st["exp_avg"], st["exp_avg_sq"], st["counts"], **ADAMW)
            return fn, (lambda: [st["master"] for st in slabs])
        b.run("adamw_slab", label, variant, f"{len(shapes)} mats, k={ratio:g}C, bf16", nbytes, what, make,
              triton=triton, check=max_diff)


def bench_grad_offload(b, shapes, ratio, label):
    dev, pin = b.device, b.cuda
    ks = [max(1, round(ratio * C)) for _, C in shapes]
    full_bytes = sum(R * C * 2 for R, C in shapes)
    part_bytes = sum(R * (C - k) * 2 for (R, C), k in zip(shapes, ks))
    torch.manual_seed(0)
    grads = [(torch.randn(R, C, device=dev) * 1e-3).to(torch.bfloat16) for R, C in shapes]
    host_cols = [torch.randperm(C)[k:].sort().values for (_, C), k in zip(shapes, ks)]
    host_cols_dev = [c.to(dev) for c in host_cols]

    def empty(shape):
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin)

    def copy_full(bufs):
        for g, buf in zip(grads, bufs):
            buf.copy_(g, non_blocking=True)
        if pin:
            torch.cuda.synchronize()

    def make_full(select):
        full = [empty(g.shape) for g in grads]
        out = [torch.empty(c.numel(), g.shape[0], dtype=torch.bfloat16) for g, c in zip(grads, host_cols)]

        def fn():
            copy_full(full)
            if select:
                for f, c, o in zip(full, host_cols, out):
                    torch.index_select(f.t(), 0, c, out=o)
        return fn, (lambda: out)

    def make_gather(copy):
        out = [empty((c.numel(), g.shape[0])) for g, c in zip(grads, host_cols)]
        kept = []

        def fn():
            kept.clear()
            for g, c, o in zip(grads, host_cols_dev, out):
                rest = g.t().index_select(0, c)
                if copy:
                    o.copy_(rest, non_blocking=True)
                else:
                    kept.append(rest)
            if pin:
                torch.cuda.synchronize()
        return fn, (lambda: out)

    shape = f"{len(shapes)} mats, {full_bytes / 1e6:.4g} MB grads"
    note = "" if pin else "cpu: no host link, copies are memcpy"
    for variant, make, nbytes, what in (
            ("full->pinned + host select", lambda: make_full(True), full_bytes, "whole gradient over the link"),
            ("device gather + copy n_u", lambda: make_gather(True), part_bytes, "unselected columns over the link"),
            ("full->pinned copy only", lambda: make_full(False), full_bytes, "whole gradient over the link"),
            ("device gather only", lambda: make_gather(False), 2 * part_bytes, "device read + write of n_u cols")):
        check = max_diff if "only" not in variant else None
        row = b.run("grad_offload", label, variant, shape, nbytes, what, make, check=check)
        row["note"] = row["note"] or note


# --------------------------------------------------------------------------------------------- report
def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = None
    return v


def print_table(rows):
    head = ("section", "name", "variant", "shape", "median ms", "GB/s", "x base", "note")
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [(r["section"], r["name"], r["variant"], r["shape"], fmt(r["median_ms"], ".4f"), fmt(r["gbps"], ".2f"),
              fmt(r["ratio"], ".3f"), r["note"] or (r["status"] if r["status"] != "ok" else "")
              + (f" ({r['error']})" if r["error"] else "")) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    for line in [head, tuple("-" * w for w in widths)] + lines:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def verdicts(rows):
    """Fastest measured (not interpreted) variant per (section, name)."""
    best = {}
    for r in rows:
        if r["status"] == "ok" and r["note"] != INTERPRETED:
            key = f"{r['section']} {r['name']}"
            if "only" not in r["variant"] and (key not in best or r["median_ms"] < best[key][1]):
                best[key] = (r["variant"], r["median_ms"])
    return {k: f"{v} ({ms:.4f} ms)" for k, (v, ms) in best.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("small", "1b"), default=None, help="default: 1b on CUDA, small on CPU")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats: checks the harness")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls per row (default 10, smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before them (default 2, smoke 1)")
    ap.add_argument("--topk-ratio", type=float, default=0.05, help="fraction of columns selected (default 0.05)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list, default all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    size = "smoke" if args.smoke else args.size or ("1b" if device.type == "cuda" else "small")
    repeat = args.repeat or (3 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")

    cfg = SIZES[size]
    shapes = layer_shapes(**cfg)
    label = f"{size}: {cfg['layers']}L x 7, {sum(r * c for r, c in shapes) / 1e6:.1f}M el"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    print(f"device: {name}  size: {size}  repeat: {repeat}  warmup: {warmup}  topk_ratio: {args.topk_ratio}  "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    t0 = time.perf_counter()
    b = Bench(device, warmup, repeat)
    for section in sections:
        if section == "column_norms":
            bench_column_norms(b, shapes, 1 if args.smoke else 99)
        elif section == "adamw_slab":
            bench_adamw_slab(b, shapes, args.topk_ratio, label)
        elif section == "grad_offload":
            bench_grad_offload(b, shapes, args.topk_ratio, label)
        for r in b.rows:  # drop kept results before the next section's tensors
            r.pop("_result", None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    elapsed = time.perf_counter() - t0

    print_table(b.rows)
    best = verdicts(b.rows)
    print("\nfastest measured variant:")
    for k, v in best.items():
        print(f"  {k}: {v}")
    print(f"\ntotal {elapsed:.1f} s")
    report = dict(device=name, device_type=device.type, versions=versions(), size=size, smoke=args.smoke,
                  config=dict(cfg, topk_ratio=args.topk_ratio, repeat=repeat, warmup=warmup,
                              triton_interpret=os.environ.get("TRITON_INTERPRET", "0"), num_matrices=len(shapes)),
                  sections={s: [r for r in b.rows if r["section"] == s] for s in sections},
                  fastest=best, elapsed_s=elapsed)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    failed = [r for r in b.rows if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
