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

import pytest

from zenflow_compile import ZenFlowConfig

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "accuracy.py"


@pytest.mark.slow
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
             f"reference[next-step]:{shared},iau=1", f"zenflow:{shared},iau=sqrt"]
    labels, title = accuracy.chart_labels(names)
    assert labels == {
        "adamw": "AdamW",
        names[1]: "ZenFlow, DeepSpeed's update rule",
        names[2]: "ZenFlow, interval-aware update",
        names[3]: "ZenFlow, interval-aware update + per-step second moment",
        names[4]: "ZenFlowReference, interval-aware update, variant 'next-step' (benchmarks/accuracy_variants.py)",
        names[5]: "ZenFlow, interval-aware update at lr x sqrt(m)",
    }
    assert title == "ZenFlow: top-k ratio 0.1, CPU update every 4 steps, overlap on, no warm-up"
    labels, _ = accuracy.chart_labels(["adamw", "zenflow:interval=auto,iau=1", "zenflow:warmup=30,overlap=0"])
    assert labels["zenflow:interval=auto,iau=1"] == ("ZenFlow, interval-aware update, Zen-auto interval, overlap on, "
                                                     "no warm-up")
    assert labels["zenflow:warmup=30,overlap=0"] == ("ZenFlow, DeepSpeed's update rule, CPU update every 4 steps, "
                                                     "overlap off, 30 warm-up steps")


def _accuracy_module():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import accuracy
    finally:
        sys.path.remove(str(BENCH.parent))
    return accuracy


def test_run_names_with_a_selection_rule_and_their_config_keys():
    """select=auto|stepN|epochN is named only when set (names of older runs still match) and becomes the
    ZenFlowConfig select keys; epochN takes the task's steps_per_epoch."""
    accuracy = _accuracy_module()
    assert accuracy.run_name(accuracy.parse_run("zenflow:iau=1")) == (
        "zenflow:topk=0.1,interval=4,overlap=1,warmup=0,iau=1")
    spec = accuracy.parse_run("reference:iau=1,select=step04")
    assert accuracy.run_name(spec) == "reference:topk=0.1,interval=4,overlap=1,warmup=0,iau=1,select=step4"
    assert accuracy.zenflow_keys(spec) == dict(
        topk_ratio=0.1, update_interval=4, overlap_step=True, full_warm_up_rounds=0, interval_aware_update=True,
        interval_second_moment=False, select_strategy="step", select_interval=4, overlap_reselect="wait",
        landing_lag=None, stagger_boundaries=False)
    spec = accuracy.parse_run("zenflow:iau=1,select=step8,reselect=incoming,lag=1,stagger=1")
    assert accuracy.run_name(spec).endswith(",iau=1,select=step8,reselect=incoming,lag=1,stagger=1")
    assert accuracy.zenflow_keys(spec)["stagger_boundaries"] is True
    keys = accuracy.zenflow_keys(accuracy.parse_run("zenflow:select=epoch1"), steps_per_epoch=342)
    assert (keys["select_strategy"], keys["select_interval"], keys["steps_per_epoch"]) == ("epoch", 1, 342)
    for bad in ("step0", "steps4", "every4", "epoch"):
        with pytest.raises(ValueError, match=rf"select='{bad}': expected auto, stepN or epochN"):
            accuracy.parse_run(f"zenflow:select={bad}")
    spec = accuracy.parse_run("reference:iau=1,select=step4,reselect=incoming")
    assert accuracy.run_name(spec).endswith(",iau=1,select=step4,reselect=incoming")
    assert accuracy.zenflow_keys(spec)["overlap_reselect"] == "incoming"
    assert accuracy.zenflow_keys(accuracy.parse_run("reference:reselect=wait"))["overlap_reselect"] == "wait"
    with pytest.raises(ValueError, match=r"reselect='later': expected one of \('wait', 'incoming'\)"):
        accuracy.parse_run("reference:reselect=later")
    labels, _ = accuracy.chart_labels(["zenflow:iau=1,select=step4", "zenflow:iau=1"])
    assert labels["zenflow:iau=1,select=step4"].endswith("reselection every 4 steps")
    assert labels["zenflow:iau=1"].endswith("reselection on drift (select 'auto')")


def test_run_names_take_the_landing_lag():
    """lag=L is named only when set and becomes the landing_lag key."""
    accuracy = _accuracy_module()
    spec = accuracy.parse_run("reference:iau=1,select=step4,reselect=incoming,lag=01")
    assert accuracy.run_name(spec) == (
        "reference:topk=0.1,interval=4,overlap=1,warmup=0,iau=1,select=step4,reselect=incoming,lag=1")
    keys = accuracy.zenflow_keys(spec)
    assert (keys["landing_lag"], keys["overlap_reselect"]) == (1, "incoming")
    assert ZenFlowConfig(**keys).landing_lag == 1
    assert accuracy.zenflow_keys(accuracy.parse_run("reference:iau=1"))["landing_lag"] is None
    for bad in ("0", "-1", "x", "1.5", ""):
        with pytest.raises(ValueError, match=rf"lag='{bad}': expected an int >= 1"):
            accuracy.parse_run(f"reference:lag={bad}")
    labels, _ = accuracy.chart_labels(["reference:iau=1,lag=1", "reference:iau=1"])
    assert labels["reference:iau=1,lag=1"].endswith("the CPU update lands 1 step after its boundary")
    assert labels["reference:iau=1"].endswith("the CPU update lands at the next boundary")


@pytest.mark.project_defaults
def test_a_run_gets_the_schedule_its_name_says_under_the_project_defaults():
    """select "auto" (drift) when a run names no rule, and a reselection that waits and lands at the next
    boundary when it names neither, though the optimizer's own defaults are step 4, "incoming" and a lag of
    1: the run name is the whole configuration (DeepSpeed's semantics are `interval=auto,overlap=0`)."""
    accuracy = _accuracy_module()
    for name in ("zenflow:select=auto", "zenflow:interval=auto,overlap=0", "zenflow:iau=1"):
        config = ZenFlowConfig(**accuracy.zenflow_keys(accuracy.parse_run(name)))
        assert (config.select_strategy, config.select_interval) == ("auto", "auto"), name
        assert (config.overlap_reselect, config.landing_lag) == ("wait", None), name
    config = ZenFlowConfig()  # (what the runs would have got)
    assert (config.select_strategy, config.overlap_reselect, config.landing_lag) == ("step", "incoming", 1)


def test_eval_steps_resolve_epoch_and_steps_default_to_the_last():
    accuracy = _accuracy_module()
    assert accuracy.resolve_eval_steps(["300", "epoch", "100", "200"], 342) == [100, 200, 300, 342]
    assert accuracy.resolve_eval_steps(["100", "epoch"], 100) == [100]
    assert accuracy.resolve_eval_steps(None, 342) is None
    with pytest.raises(ValueError, match="--eval-steps 'half': expected a step number or 'epoch'"):
        accuracy.resolve_eval_steps(["half"], 342)
    args = accuracy.parse_args(["--task", "tweets", "--eval-steps", "100", "epoch", "--clip", "1"])
    assert (args.seq, args.clip, args.steps) == (48, 1.0, None)  # the task's length; steps once data is known
    accuracy.resolve_steps(args, train_documents=4577)
    assert (args.steps_per_epoch, args.eval_steps, args.steps) == (286, [100, 286], 286)
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--task", "imdb"])


def _result_file(path, seed, adamw_acc, zen_points):
    """A results file of one seed: AdamW and one ZenFlow run at step 100."""
    setup = dict(task="r8", batch=16, seed=seed, steps=100)
    zen = dict(step=100, loss=0.5, **zen_points)
    path.write_text(json.dumps(dict(setup=setup, runs={
        "adamw": dict(curve=[dict(step=100, accuracy=adamw_acc, loss=0.4)]),
        "zenflow:iau=1": dict(curve=[zen])})))
    return path


def test_aggregate_pairs_gaps_per_seed_and_averages_the_schedule(tmp_path):
    accuracy = _accuracy_module()
    files = [
        _result_file(tmp_path / "s0.json", 0, 0.90, dict(accuracy=0.88, cpu_updates=25, overlapped_boundaries=20,
                                                         reselections=5, stall_seconds=1.0, host_wait_seconds=0.5)),
        _result_file(tmp_path / "s1.json", 1, 0.80, dict(accuracy=0.83, cpu_updates=25, overlapped_boundaries=0,
                                                         reselections=25, stall_seconds=3.0, host_wait_seconds=1.5)),
    ]
    point = accuracy.aggregate(files)["runs"]["zenflow:iau=1"]["curve"][0]
    assert point["gap_points"]["per_seed"] == {0: pytest.approx(-2.0), 1: pytest.approx(3.0)}
    assert point["gap_points"]["mean"] == pytest.approx(0.5)
    assert point["overlapped_share"] == dict(mean=pytest.approx(0.4), min=0.0, max=0.8, n=2)
    assert point["stall_seconds"]["mean"] == 2.0 and point["reselections"]["max"] == 25
    assert "captured" not in point  # compiled runs have no .grad to measure it from
    text = accuracy.aggregate_table(accuracy.aggregate(files))
    assert "overlapped_share" in text and "zenflow:iau=1    @100   s0 -2.0 s1 +3.0" in text
    with pytest.raises(SystemExit, match="differ in more than the seed"):
        accuracy.aggregate([files[0], _with_setup(tmp_path / "x.json", files[1], task="tweets")])


def test_aggregate_command_writes_its_json_without_matplotlib(tmp_path, monkeypatch, capsys):
    """`--aggregate` on a base install (no matplotlib): the JSON and the table, and a note instead of the PNG."""
    accuracy = _accuracy_module()
    files = [_result_file(tmp_path / f"s{s}.json", s, 0.9, dict(accuracy=0.88)) for s in (0, 1)]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises ImportError)
    out = tmp_path / "seeds.json"
    assert accuracy.main(["--aggregate", *map(str, files), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"]["zenflow:iau=1"]["curve"][0]["gap_points"]["n"] == 2
    assert "matplotlib is not installed: no PNG" in capsys.readouterr().out
    assert not out.with_suffix(".png").exists()


def _with_setup(path, source, **change):
    data = json.loads(source.read_text())
    data["setup"].update(change)
    path.write_text(json.dumps(data))
    return path


def test_schedule_words_name_the_overlap_reselections_stall_and_capture():
    accuracy = _accuracy_module()
    assert accuracy.schedule_words(dict(cpu_updates=25, overlapped_boundaries=24, reselections=1,
                                        stall_seconds=0.421, captured=0.9134)) == (
        "overlapped 24/25, 1 reselections, stall 0.42 s, captured 0.913")
    assert accuracy.schedule_words(dict(step=100, accuracy=0.9, loss=0.3)) == ""
