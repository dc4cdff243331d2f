"""benchmarks/accuracy.py --smoke: the real-model accuracy benchmark runs end to end (real MiniLM, cut to one
layer; real 20 Newsgroups documents), and its compiled ZenFlow curve is the reference's curve.

Checks the harness and the algorithm, not accuracy: every run finishes with a curve at the same steps,
the JSON / table / chart come out, compiled ZenFlow (with the opt-in interval_aware_update and
interval_second_moment, the recommended settings) and
ZenFlowReference give the same held-out losses, and AdamW differs from them.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "accuracy.py"


def test_accuracy_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--threads", "2", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["setup"]["smoke"] is True and report["environment"]["torch_threads"] == 2
    runs = report["runs"]
    zen = "zenflow:topk=0.1,interval=2,overlap=1,warmup=0,iau=1,sm=1"
    ref = "reference:topk=0.1,interval=2,overlap=1,warmup=0,iau=1,sm=1"
    assert set(runs) == {"adamw", zen, ref}
    for name, run in runs.items():
        assert run["status"] == "done", name
        assert [p["step"] for p in run["curve"]] == [0, 3, 6], name
        for point in run["curve"]:
            assert 0.0 <= point["accuracy"] <= 1.0 and math.isfinite(point["loss"]), (name, point)
    assert runs[zen]["stats"]["cpu_updates"] == 3
    # Same start (same seed before loading the new head), then compiled ZenFlow == the reference.
    assert len({r["curve"][0]["loss"] for r in runs.values()}) == 1
    for a, b in zip(runs[zen]["curve"], runs[ref]["curve"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a, b)
    assert not math.isclose(runs["adamw"]["curve"][-1]["loss"], runs[zen]["curve"][-1]["loss"], rel_tol=1e-4)
    assert "@6" in proc.stdout and zen in proc.stdout and "loss" in proc.stdout  # the table


def test_chart_legends_speak_words_not_run_codes():
    """The PNGs' legends name each run in words ('interval-aware update'), not by its run-name code (`iau=1`);
    the settings every ZenFlow run shares go to the title once."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import accuracy
    finally:
        sys.path.remove(str(BENCH.parent))
    shared = "topk=0.1,interval=4,overlap=1,warmup=0"
    names = ["adamw", f"zenflow:{shared},iau=0", f"zenflow:{shared},iau=1", f"zenflow:{shared},iau=1,sm=1",
             f"reference[sqrt]:{shared},iau=1"]
    labels, title = accuracy.chart_labels(names)
    assert labels == {
        "adamw": "AdamW",
        names[1]: "ZenFlow, DeepSpeed's update rule",
        names[2]: "ZenFlow, interval-aware update",
        names[3]: "ZenFlow, interval-aware update + per-step second moment",
        names[4]: "ZenFlowReference, interval-aware update, variant 'sqrt' (benchmarks/accuracy_variants.py)",
    }
    assert title == "ZenFlow: top-k ratio 0.1, CPU update every 4 steps, overlapped, no warm-up"
    labels, _ = accuracy.chart_labels(["adamw", "zenflow:interval=auto,iau=1", "zenflow:warmup=30,overlap=0"])
    assert labels["zenflow:interval=auto,iau=1"] == ("ZenFlow, interval-aware update, Zen-auto interval, overlapped, "
                                                     "no warm-up")
    assert labels["zenflow:warmup=30,overlap=0"] == ("ZenFlow, DeepSpeed's update rule, CPU update every 4 steps, "
                                                     "not overlapped, 30 warm-up steps")
