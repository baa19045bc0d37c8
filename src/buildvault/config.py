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


def format_size(n: float) -> str:
    """A byte count as people read it: `512 B`, `1.5 KiB`, `20.0 GiB` (powers of 1024, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | float) -> float:
    """Seconds from `90`, `90s`, `15m`, `12h`, `7d`, `2w`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"duration must be >= 0, got {text}")
        return float(text)
    match = _DURATION.fullmatch(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 3600, 12h, 7d)")
    number, unit = match.groups()
    return float(number) * _DURATION_UNITS[unit.lower()]


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


def parse_list(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable setting: a TOML list, a repeated flag, or one string (the environment) of
    values separated by spaces or commas."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"want a list of strings, got {value!r}")
    return tuple(item.strip() for item in items if item.strip())


def _setting(default: Any, parse: Callable[[Any], Any], help: str, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"parse": parse, "help": help, "metavar": metavar})


def default_data_dir() -> Path:
    return Path(platformdirs.user_cache_dir("buildvault"))


@dataclass(frozen=True)
class Settings:
    dir: Path = _setting(None, Path, "data directory (CAS, action cache, upload journal)", "DIR")
    max_size: int = _setting(parse_size("10GiB"), parse_size, "disk cache size cap, e.g. 20GiB", "SIZE")
    eviction_hold: int = _setting(
        2, int, "seconds a just-used blob or entry is kept from eviction for a write (0: plain LRU)", "SECONDS"
    )
    chunking: bool = _setting(
        True, parse_bool, "keep large blobs as FastCDC 2020 chunks and serve SplitBlob/SpliceBlob (false: off)", "BOOL"
    )
    # The spec's published results chunk blobs from 2 MiB up; smaller ones rarely share regions.
    chunking_threshold: int = _setting(
        parse_size("2MiB"), parse_size, "blobs of at least this size are kept as chunks", "SIZE"
    )
    # Large blobs are stored whole and answered, then chunked in the background (the disk tier
    # alone): the write costs what a whole one does. Beyond this many bytes waiting, they are cut
    # as they arrive, so the whole copies never take more of the disk than this.
    chunking_backlog: int = _setting(
        parse_size("1GiB"), parse_size, "bytes of large blobs that may wait to be chunked after the write (0: none)",
        "SIZE",
    )
    grpc_address: str = _setting("127.0.0.1:9092", parse_address, "gRPC listen address (empty: off)", "HOST:PORT")
    http_address: str = _setting("127.0.0.1:8080", parse_address, "HTTP listen address (empty: off)", "HOST:PORT")
    processes: int = _setting(
        0,
        int,
        "server processes sharing the gRPC port, one store (0: one per core when execution is off, else 1)",
        "N",
    )
    log_level: str = _setting("info", str, "debug, info, warning or error (debug: one JSON line per request)", "LEVEL")
    log_format: str = _setting("json", str, "json (one object per line, for machines) or text (for people)", "FORMAT")
    # The S3/OBS tier: unset bucket means disk only.
    s3_endpoint: str = _setting("", str, "S3-compatible endpoint URL (empty: AWS default)", "URL")
    s3_bucket: str = _setting("", str, "bucket of the shared object-store tier (empty: disk only)", "NAME")
    s3_prefix: str = _setting("", str, "key prefix inside the bucket", "PREFIX")
    s3_region: str = _setting("", str, "region of the bucket", "REGION")
    s3_addressing: str = _setting("path", str, "'path' or 'virtual' host addressing", "STYLE")
    s3_read_only: bool = _setting(False, parse_bool, "read from the bucket but never write to it", "BOOL")
    s3_request_budget: float = _setting(
        0.3,
        float,
        "seconds a bucket check on a request path may take before the local answer is used",
        "SECONDS",
    )
    s3_checksums: str = _setting(
        "when_required",
        str,
        "boto3 request/response checksum mode: 'when_required' (OBS/MinIO-safe) or 'when_supported'",
        "MODE",
    )
    pins_refresh: float = _setting(
        60.0, float, "seconds between reads of the bucket's pin indexes (pins set through other servers)", "SECONDS"
    )
    # Access control and TLS (server/auth): no credential file and no client certificates keep the open server.
    htpasswd_file: str = _setting("", str, "htpasswd file of bcrypt (htpasswd -B) or apr1 entries", "FILE")
    token_file: str = _setting("", str, "bearer tokens, one 'PRINCIPAL SHA256HEX' a line", "FILE")
    access_file: str = _setting("", str, "TOML [[grant]]s of read/write/execute on instance prefixes", "FILE")
    allow_unauthenticated_reads: bool = _setting(False, parse_bool, "let callers without credentials read", "BOOL")
    metrics_require_auth: bool = _setting(True, parse_bool, "false: /metrics answers without credentials", "BOOL")
    tls_cert_file: str = _setting("", str, "PEM certificate chain of both listeners (empty: plaintext)", "FILE")
    tls_key_file: str = _setting("", str, "PEM private key of --tls-cert-file", "FILE")
    tls_client_ca_file: str = _setting("", str, "PEM CA certificates that sign client certificates", "FILE")
    tls_client_auth: str = _setting("none", str, "client certificates: none, optional (HTTP only) or require", "MODE")
    min_tls_version: str = _setting("1.2", str, "lowest TLS version accepted: 1.2 or 1.3", "VERSION")
    # -- Remote Asset (buildvault.assets, docs/asset.md) --
    asset_origins: str = _setting(
        "any",
        str,
        "where FetchBlob downloads from: 'any' public host, 'allow-list' (the allow-hosts), 'none'",
        "MODE",
    )
    asset_allow_hosts: str = _setting(
        "", str, "comma-separated hosts (as written in URLs) that may be fetched even at private addresses", "HOSTS"
    )
    asset_allow_private: bool = _setting(False, parse_bool, "let downloads reach private/loopback addresses", "BOOL")
    asset_max_size: int = _setting(parse_size("4GiB"), parse_size, "largest asset downloaded", "SIZE")
    asset_connect_timeout: float = _setting(10.0, float, "seconds to connect to an asset origin", "SECONDS")
    asset_timeout: float = _setting(600.0, float, "seconds a download from one origin may take in all", "SECONDS")
    asset_max_downloads: int = _setting(8, int, "asset downloads in flight at once", "N")
    asset_reader_downloads: str = _setting(
        "checksum", str, "when a caller without write may trigger a download: never, checksum or always", "MODE"
    )
    # OIDC identity tokens (server/auth/oidc.py, issue 36): JWTs of CI jobs, granted on their claims.
    oidc_issuer: tuple[str, ...] = _setting(
        (), parse_list, "trusted OIDC issuer URL, the token's exact iss (repeatable; needs --access-file)", "URL"
    )
    oidc_audience: str = _setting("", str, "the aud every OIDC token must hold", "AUD")
    oidc_jwks_file: str = _setting(
        "", str, "issuer keys from this JWKS file instead of the issuers' discovery documents", "FILE"
    )
    oidc_max_lifetime: float = _setting(
        86400.0, parse_duration, "OIDC tokens living longer than this (exp - iat) are refused", "DURATION"
    )
    audit_log: str = _setting(
        "", str, "append who wrote each action-cache entry, pin, artifact and asset (JSON lines)", "FILE"
    )
    # -- remote execution (buildvault.execution) --
    local_workers: str = _setting(
        "",
        str,
        "local worker pools: ';'-separated 'N' or 'N:key=value,...' (empty: one worker per core; 0: no execution)",
        "POOLS",
    )
    execution: str = _setting(
        "loopback",
        str,
        "'loopback': Execute only on loopback listeners (unless access control grants 'execute'); 'open': anywhere",
        "MODE",
    )
    sandbox: str = _setting("auto", str, "'auto' (bubblewrap when it works), 'bwrap' or 'none'", "MODE")
    action_timeout: float = _setting(600.0, float, "seconds an action may run when it sets no timeout", "SECONDS")
    max_action_timeout: float = _setting(7200.0, float, "the longest Action.timeout accepted", "SECONDS")
    execution_grace: float = _setting(
        60.0, float, "seconds a running action is kept after its last waiting client went away", "SECONDS"
    )
    queue: str = _setting(
        "", str, "redis://HOST:PORT/DB: the shared execution queue for `buildvault worker`s (empty: in-process)", "URL"
    )
    platform_exact_keys: str = _setting(
        "OSFamily,ISA,soc,cann,container-image", str, "platform keys a worker must match exactly", "KEYS"
    )
    platform_minimum_keys: str = _setting("cores", str, "numeric platform keys a worker must meet or exceed", "KEYS")
    platform_ignore_keys: str = _setting("", str, "platform keys accepted and ignored", "KEYS")
    # -- the history behind the build pages (buildvault.history) --
    history: bool = _setting(True, parse_bool, "record request metadata and build events for the build pages", "BOOL")
    history_retention: float = _setting(
        parse_duration("7d"), parse_duration, "how long the history keeps a request, e.g. 7d, 12h", "AGE"
    )
    history_max_size: int = _setting(parse_size("1GiB"), parse_size, "the history database's size cap", "SIZE")
    history_secret_patterns: str = _setting(
        "*TOKEN*,*SECRET*,*PASSWORD*,*KEY*",
        str,
        "environment variable names (shell patterns, any case) whose values the build pages mask",
        "PATTERNS",
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
        if not self.s3_request_budget > 0:
            raise ConfigError(f"s3_request_budget: {self.s3_request_budget!r} must be a positive number of seconds")
        if self.eviction_hold < 0:
            raise ConfigError(f"eviction_hold: {self.eviction_hold!r} must be 0 or more seconds")
        if self.processes < 0:
            raise ConfigError(f"processes: {self.processes!r} must be 0 (one per core) or more")
        if not self.pins_refresh > 0:
            raise ConfigError(f"pins_refresh: {self.pins_refresh!r} must be a positive number of seconds")
        if self.s3_checksums not in ("when_required", "when_supported"):
            raise ConfigError(f"s3_checksums: {self.s3_checksums!r} is not 'when_required' or 'when_supported'")
        if self.tls_client_auth not in ("none", "optional", "require"):
            raise ConfigError(f"tls_client_auth: {self.tls_client_auth!r} is not none, optional or require")
        if self.min_tls_version not in ("1.2", "1.3"):
            raise ConfigError(f"min_tls_version: {self.min_tls_version!r} is not 1.2 or 1.3")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file: set both or neither")
        if self.tls_client_auth != "none" and not (self.tls_client_ca_file and self.tls_cert_file):
            raise ConfigError(f"tls_client_auth {self.tls_client_auth}: needs tls_client_ca_file and tls_cert_file")
        if self.asset_origins not in ("any", "allow-list", "none"):
            raise ConfigError(f"asset_origins: {self.asset_origins!r} is not any, allow-list or none")
        if self.asset_reader_downloads not in ("never", "checksum", "always"):
            raise ConfigError(
                f"asset_reader_downloads: {self.asset_reader_downloads!r} is not never, checksum or always"
            )
        if not (self.asset_timeout > 0 and self.asset_connect_timeout > 0 and self.asset_max_downloads > 0):
            raise ConfigError("asset_timeout, asset_connect_timeout, asset_max_downloads: must be positive")
        if not self.oidc_max_lifetime > 0:
            raise ConfigError("oidc_max_lifetime: must be a positive duration")
        if self.oidc_issuer and not self.oidc_audience:
            raise ConfigError("oidc_issuer: needs oidc_audience (the aud your CI jobs request)")
        if self.oidc_issuer and not self.access_file:
            raise ConfigError("oidc_issuer: needs access_file (grants on claims decide what each job may do)")
        if (self.oidc_audience or self.oidc_jwks_file) and not self.oidc_issuer:
            raise ConfigError("oidc_audience, oidc_jwks_file: need oidc_issuer")
        if self.execution not in ("loopback", "open"):
            raise ConfigError(f"execution: {self.execution!r} is not 'loopback' or 'open'")
        if self.sandbox not in ("auto", "bwrap", "none"):
            raise ConfigError(f"sandbox: {self.sandbox!r} is not 'auto', 'bwrap' or 'none'")
        if self.queue and not self.queue.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"queue: {self.queue!r} is not a redis:// URL")
        if not 0 < self.action_timeout <= self.max_action_timeout:
            raise ConfigError("action_timeout: must be > 0 and at most max_action_timeout")

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
