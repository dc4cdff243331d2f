"""Fixtures shared by the test modules (plain helpers live in helpers.py)."""

import pytest
import torch


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: no graph compiled by another test is reused (a
    module opts in with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
