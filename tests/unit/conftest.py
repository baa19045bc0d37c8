"""Fixtures shared by the unit tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the test: only what the code under test frees is freed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
