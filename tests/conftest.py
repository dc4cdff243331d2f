"""Fixtures shared by the test modules (plain helpers live in helpers.py), and the `cuda` marker's skip.

`device`: the value suites run once per test device, as torch's device-type tests do. `ZENFLOW_TEST_DEVICE`
picks them (comma-separated): `cpu` (the device is the host: no copies), `emulated` (CPU tensors behind the
emulated asynchronous device of `emulated_device.py`: the runtime's device path, its copies, events and
double buffers, checked for ordering), `cuda`. Default: cpu and emulated, plus cuda when one is present.

The preset: a test that builds an optimizer or config without `preset=` gets DeepSpeed's defaults for the
keys it does not set (`deepspeed_defaults_unless_marked`): most tests check the mechanics against
`ZenFlowReference` or DeepSpeed's semantics and name only the keys they vary. Tests of the project's own
defaults are marked `@pytest.mark.project_defaults` and get them as a user does.
"""

import pytest
import torch

from zenflow_compile import config as config_module

from emulated_device import emulated_async_device
from helpers import TEST_DEVICES


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.cuda) if name == "cuda" else name
                        for name in TEST_DEVICES])
def device(request):
    """The device a value test runs on (a torch.device to build models on). `emulated`: CPU tensors, the
    runtime on its device path; the test fails on any ordering violation."""
    name = request.param
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("ZENFLOW_TEST_DEVICE asks for cuda, but no CUDA device is present")
        previous = torch.get_default_device()
        torch.set_default_device("cuda")  # models and tensors the test builds without naming a device
        try:
            yield torch.device("cuda")
        finally:
            torch.set_default_device(previous)
        return
    if name == "cpu":
        yield torch.device("cpu")
        return
    with emulated_async_device():
        yield torch.device("cpu")


@pytest.fixture(autouse=True)
def deepspeed_defaults_unless_marked(request):
    """No preset named: DeepSpeed's defaults, except in tests marked `project_defaults` (see the module
    docstring). Its own MonkeyPatch: a test's `monkeypatch.undo()` must not lift the pin mid-test."""
    if request.node.get_closest_marker("project_defaults") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(config_module.PRESETS, "project", dict(config_module.PRESETS["deepspeed"]))
        yield


@pytest.fixture
def emulated_device():
    """The emulated asynchronous device alone (tests of the device path itself), whatever ZENFLOW_TEST_DEVICE
    says."""
    # (a test that provokes a violation on purpose clears `violations` once it saw it)
    with emulated_async_device() as emulated:
        yield emulated


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: no graph compiled by another test is reused (a
    module opts in with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (`@pytest.mark.cuda`, a `pytest.param(..., marks=pytest.mark.cuda)` case, the `device`
    fixture's cuda leg) need a CUDA device: without one they are skipped, so `pytest -m cuda` selects them
    everywhere and runs them on a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
