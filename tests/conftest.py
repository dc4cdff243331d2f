"""Fixtures shared by the test modules (plain helpers live in helpers.py), and the `cuda` marker's skip."""

import pytest
import torch


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: no graph compiled by another test is reused (a
    module opts in with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (`@pytest.mark.cuda`, or a `pytest.param(..., marks=pytest.mark.cuda)` case) need a
    CUDA device: without one they are skipped, so `pytest -m cuda` selects them everywhere and runs them on a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
