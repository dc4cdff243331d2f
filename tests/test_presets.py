"""`preset=` on ZenFlowConfig, ZenFlowAdamW and ZenFlowReference: "deepspeed" gives DeepSpeed's defaults,
None / "project" this project's, and any key given explicitly overrides the preset. The mechanism is checked
with a stand-in project preset; the project's own defaults (tests marked `project_defaults`) by their values
and by training with them, compiled and eager, against the reference."""

import pytest
import torch

from zenflow_compile import ZenFlowAdamW, ZenFlowConfig
from zenflow_compile import config as config_module
from zenflow_compile.reference import ZenFlowReference

from helpers import loss_fn, make_batches, tiny_model

DEEPSPEED_DEFAULTS = dict(topk_ratio=0.1, select_strategy="auto", select_interval="auto", update_interval="auto",
                          overlap_step=False, offload=False, auto_ratio=0.99, full_warm_up_rounds=0,
                          pt_reserved_cores_perc=0.5, steps_per_epoch=None)
STAND_IN = dict(update_interval=2, overlap_step=True, interval_aware_update=True, select_strategy="step",
                select_interval=4)


@pytest.fixture
def project_preset(monkeypatch):
    """This project's preset replaced by STAND_IN for the test (DeepSpeed's stays)."""
    monkeypatch.setitem(config_module.PRESETS, "project", dict(STAND_IN))


def test_deepspeed_preset_is_deepspeeds_defaults():
    config = ZenFlowConfig(preset="deepspeed")
    assert {k: getattr(config, k) for k in DEEPSPEED_DEFAULTS} == DEEPSPEED_DEFAULTS
    assert config.interval_aware_update is False and config.overlap_reselect == "wait"


def test_the_default_preset_is_the_projects(project_preset):
    for config in (ZenFlowConfig(), ZenFlowConfig(preset="project"), ZenFlowConfig.from_dict({})):
        assert {k: getattr(config, k) for k in STAND_IN} == STAND_IN
    deepspeed = ZenFlowConfig(preset="deepspeed")
    assert (deepspeed.update_interval, deepspeed.overlap_step) == ("auto", False)


def test_explicit_keys_override_the_preset(project_preset):
    config = ZenFlowConfig(overlap_step=False, select_strategy="auto", select_interval="auto")
    assert (config.overlap_step, config.select_strategy, config.update_interval) == (False, "auto", 2)
    config = ZenFlowConfig.from_dict(dict(overlap_step=True), preset="deepspeed")
    assert (config.overlap_step, config.update_interval) == (True, "auto")
    positional = ZenFlowConfig(0.2, "auto", "auto")  # topk_ratio, select_strategy, select_interval
    assert (positional.topk_ratio, positional.select_strategy, positional.update_interval) == (0.2, "auto", 2)
    assert ZenFlowConfig.from_dict(ZenFlowConfig(preset="deepspeed").to_dict()) == ZenFlowConfig(preset="deepspeed")


def test_the_deepspeed_json_keeps_deepspeeds_defaults(project_preset):
    config = ZenFlowConfig.from_deepspeed({"zero_optimization": {"zenflow": {"topk_ratio": 0.05}}})
    assert config == ZenFlowConfig(preset="deepspeed", topk_ratio=0.05)


@pytest.mark.parametrize("optimizer", [ZenFlowAdamW, ZenFlowReference])
def test_optimizers_take_a_preset(optimizer, project_preset):
    assert optimizer(tiny_model().parameters(), preset="deepspeed").config == ZenFlowConfig(preset="deepspeed")
    assert optimizer(tiny_model().parameters()).config == ZenFlowConfig()
    opt = optimizer(tiny_model().parameters(), preset="deepspeed", update_interval=3)
    assert opt.config == ZenFlowConfig(preset="deepspeed", update_interval=3)
    with pytest.raises(ValueError, match=r"pass either config= or preset='deepspeed', not both"):
        optimizer(tiny_model().parameters(), config=ZenFlowConfig(), preset="deepspeed")


def test_an_unknown_preset_is_an_error_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"ZenFlowConfig.preset='ds' is invalid: expected None or one of "
                                         r"\['deepspeed', 'project'\]"):
        ZenFlowConfig(preset="ds")
    with pytest.raises(ValueError, match=r"preset='fast' is invalid"):
        ZenFlowAdamW(tiny_model().parameters(), preset="fast")


PROJECT_DEFAULTS = dict(update_interval=4, overlap_step=True, interval_aware_update=True, select_strategy="step",
                        select_interval=8, overlap_reselect="incoming", landing_lag=1)


@pytest.mark.project_defaults
def test_the_project_defaults_are_the_measured_settings():
    """What README "Which settings" (benchmarks/README.md, "accuracy") measured: a CPU update every 4 steps,
    sized for the 4 steps it stands for, the selection renewed at every other one while the update runs on,
    and the update landing one step after its boundary."""
    config = ZenFlowConfig()
    assert {k: getattr(config, k) for k in PROJECT_DEFAULTS} == PROJECT_DEFAULTS
    others = {k: v for k, v in ZenFlowConfig(preset="deepspeed").to_dict().items() if k not in PROJECT_DEFAULTS}
    assert {k: v for k, v in config.to_dict().items() if k not in PROJECT_DEFAULTS} == others


@pytest.mark.project_defaults
def test_turning_the_overlap_off_turns_off_the_presets_overlap_keys():
    """overlap_step=False with the project's preset: its overlap_reselect and landing_lag, which need the
    overlap, fall back to no overlap's ("wait", None) instead of making the config an error; set explicitly
    they are still checked."""
    config = ZenFlowConfig(overlap_step=False)
    assert (config.overlap_step, config.overlap_reselect, config.landing_lag) == (False, "wait", None)
    assert ZenFlowAdamW(tiny_model().parameters(), overlap_step=False).config == config
    assert ZenFlowConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"landing_lag=1 needs overlap_step=True"):
        ZenFlowConfig(overlap_step=False, landing_lag=1)
    assert ZenFlowConfig(update_interval=2).landing_lag == 1  # (L 1 fits every interval)


@pytest.mark.project_defaults
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keys, overlapped", [({}, 4), (dict(select_interval=4), 4), (dict(overlap_reselect="wait"), 2),
                                               (dict(overlap_reselect="wait", select_interval=4), 0),
                                               (dict(interval_second_moment=True), 4)],
                         ids=["defaults", "select_interval=4", "wait", "wait,select_interval=4",
                              "interval_second_moment"])
def test_training_with_the_project_defaults_equals_the_reference(keys, overlapped, compiled, device):
    """A user's `ZenFlowAdamW(params, lr=..., weight_decay=...)` with no ZenFlow key (or one or two): equal
    to the reference given the same, step by step. 16 steps make 4 boundaries; with the defaults every other
    one reselects while its CPU update runs on (every one, select_interval=4) and every one overlaps; with
    "wait" each reselecting boundary waits for its own update: every other one overlaps (none, reselecting at
    each)."""
    import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")

    a, b = tiny_model(), tiny_model()
    opt = ZenFlowAdamW(a.parameters(), lr=1e-2, weight_decay=0.01, **keys)
    ref = ZenFlowReference(b.parameters(), lr=1e-2, weight_decay=0.01, **keys)
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b  # the same forward/backward numerics
    for i, batch in enumerate(make_batches(16)):
        for model, o in ((run_a, opt), (run_b, ref)):
            loss_fn(model, batch).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {i} {name}: {m}")
    ours, theirs = opt.stats(), ref.stats()
    for key in ("cpu_updates", "reselections", "overlapped_boundaries"):
        assert ours[key] == theirs[key], key
    assert (ours["cpu_updates"], ours["overlapped_boundaries"]) == (4, overlapped)
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.project_defaults
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_training_loop_around_the_defaults_equals_the_reference(compiled, device):
    """What users do around the step, with the defaults (every other boundary reselecting while its CPU update
    runs on, the update landing one step later): two models trained at once, one with weights loaded after its
    optimizer was built, global-norm clipping that bites, an lr schedule, a weight decay edited mid-run, and
    a checkpoint taken right after a reselecting boundary (its update in flight) resumed into a fresh model and
    optimizer. Each model equals the reference step by step; the resumed run equals the uninterrupted one
    bitwise."""
    import copy

    import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.1 * t))

    def make(seed, cls, model=None):
        model = model if model is not None else tiny_model(seed=seed)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.05)
        return model, opt, schedule(opt)

    def train(model, opt, sched, batch, run):
        loss_fn(run, batch).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    pretrained = tiny_model(seed=3).state_dict()
    batches, saved_at, runs = make_batches(16), 8, []
    for seed in (0, 1):
        ours, theirs = make(seed, ZenFlowAdamW), make(seed, ZenFlowReference)
        if seed == 0:  # weights loaded after the optimizer was built
            ours[0].load_state_dict(pretrained)
            theirs[0].load_state_dict(pretrained)
        compile_as = lambda model, backend: torch.compile(model, backend=backend) if compiled else model  # noqa: E731
        runs.append((ours, compile_as(ours[0], "zenflow"), theirs, compile_as(theirs[0], "inductor")))
    checkpoint = None
    for i, batch in enumerate(batches):
        if i == 6:  # a param-group edit between steps
            for ours, _, theirs, _ in runs:
                for opt in (ours[1], theirs[1]):
                    opt.param_groups[0]["weight_decay"] = 0.05
        for ours, run_ours, theirs, run_theirs in runs:
            train(*ours, batch, run_ours)
            train(*theirs, batch, run_theirs)
            assert ours[1].stats()["grad_norm"] > 0.05  # clipping bites
            for (name, p), q in zip(ours[0].named_parameters(), theirs[0].parameters()):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {i} {name}: {m}")
        if i + 1 == saved_at:
            model, opt, sched = runs[0][0]
            assert opt.stats()["update_pending"]  # (the boundary of step 8 is still in flight)
            checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    resumed = make(None, ZenFlowAdamW, model=tiny_model(seed=7))
    resumed[0].load_state_dict(checkpoint[0])
    resumed[1].load_state_dict(checkpoint[1])
    resumed[2].load_state_dict(checkpoint[2])
    run_resumed = torch.compile(resumed[0], backend="zenflow") if compiled else resumed[0]
    for batch in batches[saved_at:]:
        train(*resumed, batch, run_resumed)
    for opt in (runs[0][0][1], resumed[1]):
        opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0][0].parameters(), resumed[0].parameters()))
    for ours, _, _, _ in runs:
        stats = ours[1].stats()
        assert (stats["cpu_updates"], stats["overlapped_boundaries"], stats["reselections"]) == (4, 4, 2)
