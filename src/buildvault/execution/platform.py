"""Platform properties: what an action requires, what a worker offers, and whether they match.

    rules = MatchRules.from_settings(settings)
    wanted = rules.requirements(action.platform, command.platform)   # PlatformError on a bad key
    rules.satisfies(worker_properties, wanted)                        # True / False

Key classes: *exact* keys must be equal, *minimum* keys are numbers the worker must meet or
exceed, *ignore* keys are accepted and dropped; any other key is rejected, so a typo can never
send an action to a worker that lacks its toolchain. `Action.platform` wins over the deprecated
`Command.platform`, key by key; a key whose value is empty requires nothing.
"""

from __future__ import annotations

import os
import platform as host_platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from buildvault.remote_apis import re_pb2


class PlatformError(ValueError):
    """A platform property the server cannot honour (unknown key, bad number); names the key."""


Properties = dict[str, str]


def _keys(text: str) -> frozenset[str]:
    return frozenset(k.strip() for k in text.split(",") if k.strip())


def host_properties() -> Properties:
    """The properties every worker advertises for its own machine (`OSFamily`, `ISA`)."""
    machine = host_platform.machine().lower()
    isa = {"x86_64": "x86-64", "amd64": "x86-64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine, machine)
    return {"OSFamily": host_platform.system().lower() or "linux", "ISA": isa}


def parse_properties(text: str) -> Properties:
    """`key=value,key=value` (empty: none). Raises PlatformError on a malformed pair."""
    out: Properties = {}
    for pair in text.split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise PlatformError(f"not a key=value pair: {pair!r}")
        out[key.strip()] = value.strip()
    return out


def format_properties(props: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(props.items()))


@dataclass(frozen=True)
class PoolSpec:
    """`N` workers offering `properties` (on top of the host's own)."""

    count: int
    properties: Properties = field(default_factory=dict)

    @property
    def label(self) -> str:
        return format_properties(self.properties) or "default"


def parse_pools(text: str, cores: int | None = None) -> list[PoolSpec]:
    """`--local-workers`: `;`-separated `N` or `N:key=value,...`. Empty: one worker per core; `0`: none.

    Raises PlatformError on a malformed pool."""
    text = text.strip()
    if not text:
        return [PoolSpec(cores or os.cpu_count() or 1)]
    pools: list[PoolSpec] = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        count_text, _, props = part.partition(":")
        if not count_text.strip().isdigit():
            raise PlatformError(f"local_workers: {part!r} does not start with a worker count")
        count = int(count_text)
        if count:
            pools.append(PoolSpec(count, parse_properties(props)))
    return pools


@dataclass(frozen=True)
class MatchRules:
    """Which keys are compared how (see the module docstring)."""

    exact: frozenset[str]
    minimum: frozenset[str]
    ignore: frozenset[str]

    @classmethod
    def from_settings(cls, settings: Any) -> MatchRules:
        return cls(
            exact=_keys(settings.platform_exact_keys),
            minimum=_keys(settings.platform_minimum_keys),
            ignore=_keys(settings.platform_ignore_keys),
        )

    def requirements(self, *platforms: re_pb2.Platform | None) -> Properties:
        """The merged requirements of `platforms`, later ones winning per key (pass the Command's
        platform first, the Action's last). Ignored keys are dropped; unknown keys raise."""
        merged: Properties = {}
        for platform in platforms:
            if platform is None:
                continue
            own: Properties = {}
            for prop in platform.properties:
                if prop.name in own:
                    # Repeated names are allowed by the spec but no key class here has a meaning for them.
                    raise PlatformError(f"platform property {prop.name!r} is given twice")
                own[prop.name] = prop.value
            merged.update(own)
        out: Properties = {}
        for key, value in merged.items():
            # An empty value is no requirement: Bazel's way for one target to drop a platform's key.
            if key in self.ignore or value == "":
                continue
            if key in self.minimum:
                _number(key, value)
            elif key not in self.exact:
                raise PlatformError(
                    f"unknown platform property {key!r} (known: {', '.join(sorted(self.exact | self.minimum))})"
                )
            out[key] = value
        return out

    def satisfies(self, offered: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
        """True when a worker offering `offered` meets every requirement in `wanted`."""
        for key, value in wanted.items():
            have = offered.get(key)
            if have is None:
                return False
            if key in self.minimum:
                try:
                    if float(have) < float(value):
                        return False
                except ValueError:
                    return False
            elif have != value:
                return False
        return True

    def any_satisfies(self, offers: Iterable[Mapping[str, str]], wanted: Mapping[str, str]) -> bool:
        return any(self.satisfies(offered, wanted) for offered in offers)


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise PlatformError(f"platform property {key!r} must be a number, got {value!r}") from None
