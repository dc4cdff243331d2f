"""Tests of zenflow_compile.config.ZenFlowConfig (docs/semantics.md; the DeepSpeed tutorial's JSON)."""

import dataclasses
import importlib
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import warnings

import pytest


def _load_config_module():
    try:
        return importlib.import_module("zenflow_compile.config")
    except ImportError:
        # The package __init__ may pull in heavier parts; the config module stands alone.
        path = pathlib.Path(__file__).resolve().parents[1] / "zenflow_compile" / "config.py"
        spec = importlib.util.spec_from_file_location("_zenflow_config_under_test", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


_cfg = _load_config_module()
ZenFlowConfig = _cfg.ZenFlowConfig
ZENFLOW_KEYS = _cfg.ZENFLOW_KEYS

TUTORIAL_JSON = """\
{"train_micro_batch_size_per_gpu": 8,
 "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
   "zenflow": {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
               "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": true}},
 "compile": {"deepcompile": true}}
"""

DEFAULTS = dict(topk_ratio=0.1, select_strategy="auto", select_interval="auto", update_interval="auto",
                overlap_step=False, offload=False, auto_ratio=0.99, full_warm_up_rounds=0,
                pt_reserved_cores_perc=0.5, steps_per_epoch=None, max_update_interval=16,
                interval_aware_update=False, interval_second_moment=False, overlap_reselect="wait", landing_lag=None,
                accumulate_on="auto", stagger_boundaries=False)


# ------------------------------------------------------------------------------------------------ defaults
def test_defaults_and_keys():
    c = ZenFlowConfig()
    assert c.to_dict() == DEFAULTS
    assert ZENFLOW_KEYS == tuple(DEFAULTS)
    assert isinstance(ZENFLOW_KEYS, tuple)
    assert c.auto_update is True
    assert c.reselect_every is None


def test_frozen_and_roundtrip():
    c = ZenFlowConfig(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.topk_ratio = 0.5
    d = c.to_dict()
    assert type(d) is dict and set(d) == set(ZENFLOW_KEYS)
    assert ZenFlowConfig.from_dict(d) == c


def test_config_module_does_not_import_deepspeed():
    code = ("import sys, importlib.util;"
            f"s = importlib.util.spec_from_file_location('m', {str(pathlib.Path(_cfg.__file__))!r});"
            "m = importlib.util.module_from_spec(s); sys.modules['m'] = m; s.loader.exec_module(m);"
            "assert 'deepspeed' not in sys.modules and 'pydantic' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------- invalid values
INVALID = [
    ("topk_ratio", 0), ("topk_ratio", 0.0), ("topk_ratio", -0.1), ("topk_ratio", 1.5),
    ("topk_ratio", float("nan")), ("topk_ratio", "0.1"), ("topk_ratio", True), ("topk_ratio", None),
    ("select_strategy", "foo"), ("select_strategy", "Auto"), ("select_strategy", 1), ("select_strategy", None),
    ("select_interval", 0), ("select_interval", -3), ("select_interval", "x"), ("select_interval", 2.0),
    ("select_interval", True),
    ("update_interval", 0), ("update_interval", -1), ("update_interval", "x"), ("update_interval", "4"),
    ("update_interval", 1.5), ("update_interval", True), ("update_interval", None),
    ("overlap_step", 1), ("overlap_step", "true"), ("overlap_step", None),
    ("offload", 0), ("offload", "yes"),
    ("interval_aware_update", 1), ("interval_aware_update", "true"), ("interval_aware_update", None),
    ("interval_aware_update", "Sqrt"), ("interval_aware_update", 0.5),
    ("interval_second_moment", 1), ("interval_second_moment", "yes"),
    ("auto_ratio", 1.5), ("auto_ratio", -0.01), ("auto_ratio", float("nan")), ("auto_ratio", "0.9"),
    ("auto_ratio", False),
    ("full_warm_up_rounds", -1), ("full_warm_up_rounds", 1.0), ("full_warm_up_rounds", True),
    ("full_warm_up_rounds", "2"),
    ("pt_reserved_cores_perc", 1.01), ("pt_reserved_cores_perc", -0.5), ("pt_reserved_cores_perc", "half"),
    ("steps_per_epoch", 0), ("steps_per_epoch", -5), ("steps_per_epoch", 10.0), ("steps_per_epoch", True),
    ("max_update_interval", 0), ("max_update_interval", 2.5), ("max_update_interval", "auto"),
    ("max_update_interval", False), ("max_update_interval", None),
    ("landing_lag", 0), ("landing_lag", -1), ("landing_lag", 1.0), ("landing_lag", "1"), ("landing_lag", True),
    ("landing_lag", "auto"),
    ("accumulate_on", "gpu"), ("accumulate_on", None), ("accumulate_on", True),
    ("stagger_boundaries", 1), ("stagger_boundaries", "yes"), ("stagger_boundaries", None),
]


@pytest.mark.parametrize("key,value", INVALID, ids=[f"{k}={v!r}" for k, v in INVALID])
def test_invalid_value_raises(key, value):
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(**{key: value})
    msg = str(ei.value)
    assert key in msg
    assert repr(value) in msg
    assert "expected" in msg
    # from_dict goes through the same validation
    with pytest.raises(ValueError, match=key):
        ZenFlowConfig.from_dict({key: value})


def test_message_format():
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(topk_ratio=1.5)
    assert str(ei.value) == "ZenFlowConfig.topk_ratio=1.5 is invalid: expected a float in (0, 1]"


# ------------------------------------------------------------------------------------------- valid edges
@pytest.mark.parametrize("kwargs", [
    dict(topk_ratio=1.0), dict(topk_ratio=1), dict(topk_ratio=1e-9),
    dict(auto_ratio=0.0), dict(auto_ratio=1.0), dict(auto_ratio=0), dict(auto_ratio=1),
    dict(pt_reserved_cores_perc=0.0), dict(pt_reserved_cores_perc=1),
    dict(full_warm_up_rounds=0), dict(full_warm_up_rounds=7),
    dict(update_interval=1), dict(select_strategy="step", select_interval=1),
    dict(select_strategy="epoch", select_interval=1, steps_per_epoch=1),
    dict(max_update_interval=1), dict(steps_per_epoch=1), dict(overlap_step=True, offload=True),
    dict(interval_aware_update=True, interval_second_moment=True),
    dict(interval_aware_update="sqrt"), dict(interval_aware_update="sqrt", interval_second_moment=True),
])
def test_valid_edges(kwargs):
    c = ZenFlowConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


def test_ints_become_floats():
    c = ZenFlowConfig(topk_ratio=1, auto_ratio=0, pt_reserved_cores_perc=1)
    assert type(c.topk_ratio) is float and c.topk_ratio == 1.0
    assert type(c.auto_ratio) is float and type(c.pt_reserved_cores_perc) is float


# ------------------------------------------------------------------------------------------ cross-key rules
@pytest.mark.parametrize("strategy", ["step", "epoch"])
def test_step_epoch_need_int_select_interval(strategy):
    with pytest.raises(ValueError, match="select_interval") as ei:
        ZenFlowConfig(select_strategy=strategy, steps_per_epoch=10)
    assert "set select_interval to an int" in str(ei.value)


def test_auto_strategy_with_int_interval_warns():
    with pytest.warns(UserWarning, match="ignored"):
        c = ZenFlowConfig(select_strategy="auto", select_interval=5)
    assert c.select_interval == 5
    assert c.reselect_every is None


def test_defaults_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZenFlowConfig()
        ZenFlowConfig(select_strategy="step", select_interval=3)


def test_epoch_needs_steps_per_epoch():
    with pytest.raises(ValueError, match="steps_per_epoch"):
        ZenFlowConfig(select_strategy="epoch", select_interval=2)


def test_reselect_every_and_auto_update():
    assert ZenFlowConfig(select_strategy="step", select_interval=4).reselect_every == 4
    c = ZenFlowConfig(select_strategy="epoch", select_interval=2, steps_per_epoch=50, update_interval=5)
    assert c.reselect_every == 100
    assert c.auto_update is False
    assert ZenFlowConfig(update_interval="auto").auto_update is True


# ---------------------------------------------------------------------------------------- from_dict / keys
def test_constructor_unknown_key_is_type_error():
    with pytest.raises(TypeError):
        ZenFlowConfig(topk=0.1)


def test_from_dict_unknown_keys():
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig.from_dict({"topk_ratio": 0.2, "topk": 0.1, "bogus": 1})
    msg = str(ei.value)
    assert "topk" in msg and "bogus" in msg
    assert "topk_ratio" in msg and "max_update_interval" in msg  # lists the valid keys


def test_from_dict_valid():
    c = ZenFlowConfig.from_dict({"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True})
    assert (c.topk_ratio, c.update_interval, c.overlap_step) == (0.05, 4, True)


# ------------------------------------------------------------------------------------------ from_deepspeed
def _check_spec_block(c):
    assert c.topk_ratio == 0.05
    assert c.select_strategy == "auto" and c.select_interval == "auto"
    assert c.update_interval == 4 and c.full_warm_up_rounds == 0 and c.overlap_step is True
    assert c.offload is False and c.auto_ratio == 0.99 and c.steps_per_epoch is None


def test_from_deepspeed_dict():
    _check_spec_block(ZenFlowConfig.from_deepspeed(json.loads(TUTORIAL_JSON)))


def test_from_deepspeed_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(TUTORIAL_JSON)
    _check_spec_block(ZenFlowConfig.from_deepspeed(path))        # os.PathLike
    _check_spec_block(ZenFlowConfig.from_deepspeed(str(path)))   # str


def test_from_deepspeed_steps_per_epoch():
    ds = json.loads(TUTORIAL_JSON)
    ds["zero_optimization"]["zenflow"].update(select_strategy="epoch", select_interval=1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        ZenFlowConfig.from_deepspeed(ds)
    c = ZenFlowConfig.from_deepspeed(ds, steps_per_epoch=20)
    assert c.steps_per_epoch == 20 and c.reselect_every == 20
    ds["zero_optimization"]["zenflow"]["steps_per_epoch"] = 8   # the block's own value wins
    assert ZenFlowConfig.from_deepspeed(ds, steps_per_epoch=20).steps_per_epoch == 8


@pytest.mark.parametrize("ds", [
    {"train_micro_batch_size_per_gpu": 8},
    {"zero_optimization": {"stage": 2}},
    {"zero_optimization": {"stage": 2, "zenflow": None}},
])
def test_from_deepspeed_missing_block(ds):
    with pytest.raises(ValueError, match=r"zero_optimization\.zenflow"):
        ZenFlowConfig.from_deepspeed(ds)


def test_from_deepspeed_missing_block_file(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match=r"zero_optimization\.zenflow") as ei:
        ZenFlowConfig.from_deepspeed(path)
    assert str(path) in str(ei.value)


def test_from_deepspeed_unknown_and_invalid_keys():
    ds = json.loads(TUTORIAL_JSON)
    ds["zero_optimization"]["zenflow"]["topk"] = 0.1
    with pytest.raises(ValueError, match="topk"):
        ZenFlowConfig.from_deepspeed(ds)
    ds = json.loads(TUTORIAL_JSON)
    ds["zero_optimization"]["zenflow"]["update_interval"] = 0
    with pytest.raises(ValueError, match="update_interval"):
        ZenFlowConfig.from_deepspeed(ds)


# -------------------------------------------------------------------------------------------- num_selected
@pytest.mark.parametrize("ratio,columns,k", [
    (0.1, 100, 10), (0.1, 5, 1), (0.1, 1, 1), (0.05, 4096, 204), (0.5, 3, 1), (0.5, 7, 3),
    (1.0, 1, 1), (1.0, 37, 37), (0.3, 10, 3), (1e-6, 10, 1), (0.999, 1000, 999),
])
def test_num_selected(ratio, columns, k):
    got = ZenFlowConfig(topk_ratio=ratio).num_selected(columns)
    assert got == k == max(1, math.floor(ratio * columns))
    assert 1 <= got <= columns


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_selected_rejects_bad_columns(bad):
    with pytest.raises(ValueError):
        ZenFlowConfig().num_selected(bad)


# ---------------------------------------------------------------------------------- parity with DeepSpeed
def _ds_config_cls():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DSZenFlowConfig
    return DSZenFlowConfig


def test_deepspeed_defaults_parity():
    DS = _ds_config_cls()
    ds = DS()
    ours = ZenFlowConfig()
    shared = [k for k in ZENFLOW_KEYS if k in type(ds).model_fields]
    assert set(ZENFLOW_KEYS) - set(shared) == {"max_update_interval", "interval_aware_update",
                                               "interval_second_moment", "overlap_reselect", "landing_lag",
                                               "accumulate_on", "stagger_boundaries"}
    assert set(type(ds).model_fields) <= set(ZENFLOW_KEYS)
    for k in shared:
        assert getattr(ours, k) == getattr(ds, k), k


@pytest.mark.parametrize("key,value", [
    ("select_strategy", "foo"), ("select_interval", "x"), ("update_interval", 0), ("update_interval", "x"),
    ("update_interval", -2), ("auto_ratio", 1.5), ("auto_ratio", -0.1), ("topk_ratio", 0.0),
    ("topk_ratio", 1.5), ("pt_reserved_cores_perc", 2.0), ("full_warm_up_rounds", 1.5),
])
def test_deepspeed_rejections_are_ours_too(key, value):
    DS = _ds_config_cls()
    with pytest.raises(ValueError):   # pydantic's ValidationError is a ValueError
        DS(**{key: value})
    with pytest.raises(ValueError, match=key):
        ZenFlowConfig(**{key: value})


def test_deepspeed_accepts_the_spec_block_too():
    DS = _ds_config_cls()
    block = json.loads(TUTORIAL_JSON)["zero_optimization"]["zenflow"]
    ds = DS(**block)
    ours = ZenFlowConfig.from_dict(block)
    for k in block:
        assert getattr(ours, k) == getattr(ds, k), k


def test_second_moment_needs_interval_aware_update():
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(interval_second_moment=True)
    assert str(ei.value).startswith("ZenFlowConfig.interval_second_moment=True needs interval_aware_update=True")
    assert "Set both, or neither" in str(ei.value)


# ----------------------------------------------------------------------------------------- stagger_boundaries
def test_stagger_boundaries_deals_the_matrices_into_update_interval_phases():
    assert ZenFlowConfig().stagger_boundaries is False and ZenFlowConfig().num_phases == 1
    c = ZenFlowConfig(update_interval=4, stagger_boundaries=True)
    assert c.num_phases == 4 and ZenFlowConfig.from_dict(c.to_dict()) == c
    assert ZenFlowConfig(update_interval=4).num_phases == 1
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(update_interval="auto", stagger_boundaries=True)
    assert str(ei.value).startswith("ZenFlowConfig.stagger_boundaries=True needs an int update_interval: it deals "
                                    "the matrices into update_interval phases")


# ------------------------------------------------------------------------------------------- landing lag
def test_landing_lag_values():
    assert ZenFlowConfig().landing_lag is None and ZenFlowConfig(preset="deepspeed").landing_lag is None
    for lag in (1, 2, 4):
        c = ZenFlowConfig(overlap_step=True, update_interval=4, landing_lag=lag)
        assert c.landing_lag == lag and ZenFlowConfig.from_dict(c.to_dict()) == c
    c = ZenFlowConfig(overlap_step=True, update_interval="auto", landing_lag=16)  # max_update_interval 16
    assert c.landing_lag == 16
    np = pytest.importorskip("numpy")
    c = ZenFlowConfig(overlap_step=True, update_interval=4, landing_lag=np.int64(2))
    assert type(c.landing_lag) is int and c.landing_lag == 2


def test_landing_lag_needs_overlap_and_fits_in_an_interval():
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(overlap_step=False, update_interval=4, landing_lag=1)
    assert str(ei.value).startswith("ZenFlowConfig.landing_lag=1 needs overlap_step=True: it says when an "
                                    "overlapped CPU update lands")
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(overlap_step=True, update_interval=4, landing_lag=5)
    assert str(ei.value).startswith("ZenFlowConfig.landing_lag=5 is invalid: expected None or an int in [1, 4] "
                                    "with update_interval=4: an update lands at the latest at the next boundary")
    with pytest.raises(ValueError) as ei:
        ZenFlowConfig(overlap_step=True, update_interval="auto", max_update_interval=6, landing_lag=7)
    assert str(ei.value).startswith("ZenFlowConfig.landing_lag=7 is invalid: expected None or an int in [1, 6] "
                                    "with update_interval='auto' (max_update_interval=6, its longest interval)")
    with pytest.raises(ValueError, match=r"ZenFlowConfig.landing_lag=0 is invalid: expected None \(land at the "
                                         r"next boundary\) or an int >= 1"):
        ZenFlowConfig.from_dict(dict(overlap_step=True, update_interval=4, landing_lag=0))
