"""Redis-mode priority bands: lower ExecutionPolicy.priority, more urgent band, at the documented bounds."""

from __future__ import annotations

import pytest

from buildvault.execution.executor import PRIORITY_RANGE
from buildvault.execution.redis import keys


@pytest.mark.parametrize(
    ("priority", "band"),
    [(PRIORITY_RANGE[0], 0), (-100, 0), (-99, 1), (-1, 1), (0, 2), (1, 3), (99, 3), (100, 4), (PRIORITY_RANGE[1], 4)],
)
def test_priority_maps_to_its_band(priority, band):
    assert keys.band_of(priority) == band


def test_bands_never_invert_priorities():
    bands = [keys.band_of(p) for p in range(PRIORITY_RANGE[0], PRIORITY_RANGE[1] + 1)]
    assert bands == sorted(bands) and set(bands) == set(range(keys.BANDS))


def test_each_band_and_platform_has_its_own_stream():
    names = {keys.jobs_stream(p, b) for p in ("", "soc=ascend310p") for b in range(keys.BANDS)}
    assert len(names) == 2 * keys.BANDS and keys.jobs_stream("", 2) == "bv:jobs:2:any"
