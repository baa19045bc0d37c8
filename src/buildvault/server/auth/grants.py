"""Who may do what where: the TOML access file and the one rule both protocols ask.

    [[grant]]
    principal = "ci"                  # a token/htpasswd name, "cert:<CN>", or "*" (any authenticated)
    permissions = ["read", "write"]   # read, write (CAS + ActionCache), execute
    instances = [""]                  # instance-name prefixes; "" is every instance

A prefix matches its own instance and those below it: "team-a" (or "team-a/") matches
`team-a` and `team-a/x`, never `team-ab`.
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass
from pathlib import Path

from buildvault.server.auth.credentials import CredentialsFileError

__all__ = ["Grant", "Grants", "Permission", "load_access_file"]


class Permission(enum.Enum):
    READ = "read"
    WRITE = "write"
    EXECUTE = "execute"


ANY_PRINCIPAL = "*"
_GRANT_KEYS = frozenset({"principal", "permissions", "instances"})


@dataclass(frozen=True, slots=True)
class Grant:
    principal: str
    permissions: frozenset[Permission]
    prefixes: tuple[str, ...]  # without trailing "/"

    def covers(self, principal: str, permission: Permission, instance: str | None) -> bool:
        """`instance` None: on any instance at all (pages such as /status)."""
        if permission not in self.permissions or self.principal not in (principal, ANY_PRINCIPAL):
            return False
        if instance is None:
            return True
        return any(p == "" or instance == p or instance.startswith(p + "/") for p in self.prefixes)


@dataclass(frozen=True, slots=True)
class Grants:
    """The access file's grants; `None` grants (no access file) mean every principal reads and writes."""

    grants: tuple[Grant, ...]

    def allows(self, principal: str, permission: Permission, instance: str | None) -> bool:
        return any(g.covers(principal, permission, instance) for g in self.grants)


def load_access_file(path: Path) -> Grants:
    """Parse and check the whole file; CredentialsFileError names the file and the grant."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CredentialsFileError(f"access file {path}: {e}") from None
    unknown = set(data) - {"grant"}
    if unknown:
        raise CredentialsFileError(f"access file {path}: unknown key {sorted(unknown)[0]!r} (want [[grant]] tables)")
    raw = data.get("grant", [])
    if not isinstance(raw, list):
        raise CredentialsFileError(f"access file {path}: 'grant' must be [[grant]] tables")
    grants = [_grant(path, number, entry) for number, entry in enumerate(raw, 1)]
    return Grants(tuple(grants))


def _grant(path: Path, number: int, entry: object) -> Grant:
    where = f"access file {path} grant {number}"
    if not isinstance(entry, dict):
        raise CredentialsFileError(f"{where}: must be a table")
    unknown = set(entry) - _GRANT_KEYS
    if unknown:
        raise CredentialsFileError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    principal = entry.get("principal")
    if not isinstance(principal, str) or not principal.strip():
        raise CredentialsFileError(f"{where}: 'principal' must be a non-empty string")
    permissions = entry.get("permissions")
    if not isinstance(permissions, list) or not permissions or not all(isinstance(p, str) for p in permissions):
        raise CredentialsFileError(f"{where}: 'permissions' must be a list of read, write, execute")
    try:
        perms = frozenset(Permission(p) for p in permissions)
    except ValueError as e:
        raise CredentialsFileError(f"{where}: {e}; use read, write, execute") from None
    instances = entry.get("instances", [""])
    if not isinstance(instances, list) or not instances or not all(isinstance(i, str) for i in instances):
        raise CredentialsFileError(f"{where}: 'instances' must be a list of instance-name prefixes")
    return Grant(principal.strip(), perms, tuple(i.rstrip("/") for i in instances))
