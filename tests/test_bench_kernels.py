"""The kernel micro-benchmark (benchmarks/bench_kernels.py) runs end to end and reports all three sections.

Checks the harness, not speed: the --smoke run exits 0, its JSON has the three sections, every torch variant
has numeric timings, and every Triton row is measured on CUDA and skipped with a reason on CPU (the test
runs without TRITON_INTERPRET=1). Non-baseline results agree with the baseline's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_kernels.py"
SECTIONS = ("column_norms", "adamw_slab", "grad_offload")
TRITON_VARIANTS = {"triton"}


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_1b_size_is_a_1b_model_worth_of_matrices():
    bench = _load_bench()
    shapes = bench.layer_shapes(**bench.SIZES["1b"])
    assert len(shapes) == 7 * 22
    assert 0.9e9 < sum(r * c for r, c in shapes) < 1.0e9  # TinyLlama-1.1B minus embeddings and LM head


@pytest.mark.slow
def test_smoke_run_reports_three_sections(tmp_path):
    out = tmp_path / "tmp"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # interpreted Triton rows would only slow the smoke run down
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())

    assert report["smoke"] is True and report["device"]
    assert "torch" in report["versions"] and "triton" in report["versions"]
    assert set(report["sections"]) == set(SECTIONS)
    cuda = report["device_type"] == "cuda"
    for section in SECTIONS:
        rows = report["sections"][section]
        assert rows, section
        assert rows[0]["ratio"] == 1.0, f"{section}: first row is the baseline"
        for row in rows:
            where = f"{section} / {row['variant']}"
            if row["variant"] in TRITON_VARIANTS and not cuda:
                assert row["status"] == "skipped" and "TRITON_INTERPRET" in row["note"], where
                continue
            assert row["status"] == "ok", f"{where}: {row['error']}"
            median = row["median_ms"]
            assert isinstance(median, float) and math.isfinite(median) and median > 0, where
            assert row["times_ms"] and all(isinstance(t, (int, float)) and t >= 0 for t in row["times_ms"]), where
            assert row["gbps"] > 0 and row["ratio"] > 0, where
            if row["max_err"] is not None:
                assert row["max_err"] < 1e-3, f"{where}: result differs from the baseline by {row['max_err']}"
    # the torch variants of each section, by name: all measured
    variants = {s: {r["variant"] for r in report["sections"][s]} for s in SECTIONS}
    assert {"eager torch", "inductor"} <= variants["column_norms"]
    assert {"torch twin", "inductor"} <= variants["adamw_slab"]
    assert {"full->pinned + host select", "device gather + copy n_u"} <= variants["grad_offload"]

