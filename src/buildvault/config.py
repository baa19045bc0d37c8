"""One settings object, filled from a TOML file < environment (BUILDVAULT_<NAME>) < command line.

Every setting is declared once, in `Settings`, with its parser and help text; the CLI builds
its flags from the same declarations, so a flag, a variable and a file key can never drift.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

ENV_PREFIX = "BUILDVAULT_"

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names the setting."""


def parse_size(text: str | int) -> int:
    """Bytes from `1048576`, `512MB`, `20GiB`, `1.5G` (K/M/G/T/P; `i` or not, both are powers of 1024)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 1048576, 512MiB, 20GiB)")
    number, unit, _ = match.groups()
    scale = 1024 ** ("KMGTP".index(unit.upper()) + 1) if unit else 1
    return int(float(number) * scale)


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def parse_address(text: str) -> str:
    """`host:port`, `[v6]:port`; an empty string disables the listener."""
    text = str(text).strip()
    if text == "":
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not an address: {text!r} (want host:port, e.g. 127.0.0.1:9092)")
    return text


def _setting(default: Any, parse: Callable[[Any], Any], help: str, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"parse": parse, "help": help, "metavar": metavar})


def default_data_dir() -> Path:
    return Path(platformdirs.user_cache_dir("buildvault"))


@dataclass(frozen=True)
class Settings:
    dir: Path = _setting(None, Path, "data directory (CAS, action cache, upload journal)", "DIR")
    max_size: int = _setting(parse_size("10GiB"), parse_size, "disk cache size cap, e.g. 20GiB", "SIZE")
    grpc_address: str = _setting("127.0.0.1:9092", parse_address, "gRPC listen address (empty: off)", "HOST:PORT")
    http_address: str = _setting("127.0.0.1:8080", parse_address, "HTTP listen address (empty: off)", "HOST:PORT")
    log_level: str = _setting("info", str, "debug, info, warning or error (debug: one JSON line per request)", "LEVEL")
    log_format: str = _setting("json", str, "json (one object per line, for machines) or text (for people)", "FORMAT")
    # The S3/OBS tier: unset bucket means disk only.
    s3_endpoint: str = _setting("", str, "S3-compatible endpoint URL (empty: AWS default)", "URL")
    s3_bucket: str = _setting("", str, "bucket of the shared object-store tier (empty: disk only)", "NAME")
    s3_prefix: str = _setting("", str, "key prefix inside the bucket", "PREFIX")
    s3_region: str = _setting("", str, "region of the bucket", "REGION")
    s3_addressing: str = _setting("path", str, "'path' or 'virtual' host addressing", "STYLE")
    s3_read_only: bool = _setting(False, parse_bool, "read from the bucket but never write to it", "BOOL")
    s3_checksums: str = _setting(
        "when_required",
        str,
        "boto3 request/response checksum mode: 'when_required' (OBS/MinIO-safe) or 'when_supported'",
        "MODE",
    )

    def __post_init__(self) -> None:
        if self.dir is None:
            object.__setattr__(self, "dir", default_data_dir())
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: {self.log_level!r} is not debug, info, warning or error")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: {self.log_format!r} is not text or json")
        if self.s3_addressing not in ("path", "virtual"):
            raise ConfigError(f"s3_addressing: {self.s3_addressing!r} is not 'path' or 'virtual'")
        if self.s3_checksums not in ("when_required", "when_supported"):
            raise ConfigError(f"s3_checksums: {self.s3_checksums!r} is not 'when_required' or 'when_supported'")

    @classmethod
    def fields(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Merge defaults < file < environment < flags. `flags` holds only values given on the command line."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    values: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, "rb") as stream:
                data = tomllib.load(stream)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {config_file}: {e}") from e
        known = {f.name for f in Settings.fields()}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"config file {config_file}: unknown setting {key!r}")
            values[name] = value
    for f in Settings.fields():
        variable = ENV_PREFIX + f.name.upper()
        if variable in env:
            values[f.name] = env[variable]
    for name, value in (flags or {}).items():
        if value is not None:
            values[name] = value
    parsed = {}
    for f in Settings.fields():
        if f.name in values:
            try:
                parsed[f.name] = f.metadata["parse"](values[f.name])
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{f.name}: {e}") from e
    return Settings(**parsed)
