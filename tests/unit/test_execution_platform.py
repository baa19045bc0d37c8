"""Platform matching and the --local-workers pool syntax."""

from __future__ import annotations

import pytest

from buildvault.config import Settings
from buildvault.execution.platform import MatchRules, PlatformError, PoolSpec, parse_pools
from buildvault.remote_apis import re_pb2


def platform(**props: str) -> re_pb2.Platform:
    return re_pb2.Platform(properties=[re_pb2.Platform.Property(name=k, value=v) for k, v in sorted(props.items())])


RULES = MatchRules.from_settings(Settings(dir="/nonexistent"))


def test_pools_syntax():
    assert parse_pools("1:soc=ascend910b1,cann=8.0.RC3;1:soc=ascend310p;2") == [
        PoolSpec(1, {"soc": "ascend910b1", "cann": "8.0.RC3"}),
        PoolSpec(1, {"soc": "ascend310p"}),
        PoolSpec(2, {}),
    ]
    assert parse_pools("", cores=3) == [PoolSpec(3, {})]
    assert parse_pools("0") == []
    for bad in ("x", "1:soc", "two:soc=a"):
        with pytest.raises(PlatformError):
            parse_pools(bad)


def test_action_platform_wins_over_command_platform_per_key():
    wanted = RULES.requirements(platform(soc="ascend310p", cann="7"), platform(soc="ascend910b1"))
    assert wanted == {"soc": "ascend910b1", "cann": "7"}


def test_empty_value_requires_nothing_and_unknown_keys_are_rejected():
    assert RULES.requirements(platform(soc="a", cann="")) == {"soc": "a"}
    with pytest.raises(PlatformError, match="gpu"):
        RULES.requirements(platform(gpu="h100"))
    with pytest.raises(PlatformError, match="cores"):
        RULES.requirements(platform(cores="many"))


def test_exact_and_minimum_matching():
    offered = {"OSFamily": "linux", "soc": "ascend910b1", "cores": "8"}
    assert RULES.satisfies(offered, {})
    assert RULES.satisfies(offered, {"soc": "ascend910b1", "cores": "4"})
    assert not RULES.satisfies(offered, {"cores": "16"})
    assert not RULES.satisfies(offered, {"soc": "ascend310p"})
    assert not RULES.satisfies(offered, {"cann": "8.0.RC3"})  # a requirement the worker lacks
