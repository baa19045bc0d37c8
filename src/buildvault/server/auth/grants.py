"""Who may do what where: the TOML access file and the one rule both protocols ask.

    [[grant]]
    principal = "ci"                  # a token/htpasswd name, "cert:<CN>", "oidc:<host>:<sub>",
                                      # or "*" (any authenticated caller but an OIDC token)
    permissions = ["read", "write"]   # read, write (CAS + ActionCache), execute
    instances = [""]                  # instance-name prefixes; "" is every instance

    [[grant]]                         # OIDC tokens (oidc.py): by issuer and claims
    issuer = "https://token.actions.githubusercontent.com"
    claims = { repository = "org/repo", ref = "refs/heads/main", event_name = "push" }
    permissions = ["read", "write"]
    instances = ["csrc"]

A prefix matches its own instance and those below it: "team-a" (or "team-a/") matches
`team-a` and `team-a/x`, never `team-ab`. A grant names a `principal` or an `issuer`, not both.
An issuer grant matches a token from exactly that issuer whose every listed claim matches: a
string is exact or a glob where `*` stands for any run of characters (nothing else is special),
matching a string claim or any string of a list claim; a boolean or a number matches an equal
claim. `*` as a principal never matches an OIDC token: an issuer such as GitHub's signs tokens
for every repository on it, so what a token may do is said by its claims alone.
"""

from __future__ import annotations

import enum
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildvault.server.auth.credentials import CredentialsFileError

if TYPE_CHECKING:
    from buildvault.server.auth.oidc import Identity

__all__ = ["Caller", "ClaimMatch", "Grant", "Grants", "Permission", "load_access_file"]


class Permission(enum.Enum):
    READ = "read"
    WRITE = "write"
    EXECUTE = "execute"


ANY_PRINCIPAL = "*"
_GRANT_KEYS = frozenset({"principal", "issuer", "claims", "permissions", "instances"})


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: its principal, and for an OIDC token the verified identity."""

    principal: str
    identity: Identity | None = None


@dataclass(frozen=True, slots=True)
class ClaimMatch:
    """One `claims` entry: a glob (compiled) for a string, else the exact value."""

    name: str
    pattern: re.Pattern[str] | None
    value: bool | int | None

    @classmethod
    def of(cls, name: str, wanted: str | bool | int) -> ClaimMatch:
        if isinstance(wanted, str):
            return cls(name, re.compile(".*".join(re.escape(part) for part in wanted.split("*"))), None)
        return cls(name, None, wanted)

    def matches(self, claims: Any) -> bool:
        if self.name not in claims:
            return False
        actual = claims[self.name]
        if self.pattern is None:
            return type(actual) is type(self.value) and actual == self.value
        values = actual if isinstance(actual, list) else [actual]
        return any(isinstance(v, str) and self.pattern.fullmatch(v) is not None for v in values)


@dataclass(frozen=True, slots=True)
class Grant:
    principal: str | None
    permissions: frozenset[Permission]
    prefixes: tuple[str, ...]  # without trailing "/"
    issuer: str | None = None
    claims: tuple[ClaimMatch, ...] = ()

    def names(self, caller: Caller) -> bool:
        """Whether this grant is for `caller` (whatever the permission and instance)."""
        identity = caller.identity
        if self.issuer is not None:
            return (
                identity is not None
                and identity.issuer == self.issuer
                and all(c.matches(identity.claims) for c in self.claims)
            )
        return self.principal == caller.principal or (self.principal == ANY_PRINCIPAL and identity is None)

    def permits(self, permission: Permission, instance: str | None) -> bool:
        """`instance` None: on any instance at all (pages such as /status)."""
        if permission not in self.permissions:
            return False
        if instance is None:
            return True
        return any(p == "" or instance == p or instance.startswith(p + "/") for p in self.prefixes)

    def covers(self, principal: str, permission: Permission, instance: str | None) -> bool:
        return self.names(Caller(principal)) and self.permits(permission, instance)


@dataclass(frozen=True, slots=True)
class Grants:
    """The access file's grants; `None` grants (no access file) mean every principal reads and writes."""

    grants: tuple[Grant, ...]

    def allows(self, caller: Caller | str, permission: Permission, instance: str | None) -> bool:
        if isinstance(caller, str):
            caller = Caller(caller)
        identity = caller.identity
        if identity is None:
            return any(g.names(caller) and g.permits(permission, instance) for g in self.grants)
        # A token's claims are fixed: which grants name it is worked out once per access-file load.
        matched = identity.matched
        if matched is None or matched[0] is not self:
            matched = (self, tuple(g for g in self.grants if g.names(caller)))
            identity.matched = matched
        return any(g.permits(permission, instance) for g in matched[1])


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
    principal, issuer, claims = entry.get("principal"), entry.get("issuer"), entry.get("claims")
    if (principal is None) == (issuer is None):
        raise CredentialsFileError(f"{where}: name either a 'principal' or an 'issuer'")
    if principal is not None and (not isinstance(principal, str) or not principal.strip()):
        raise CredentialsFileError(f"{where}: 'principal' must be a non-empty string")
    if principal is not None and claims is not None:
        raise CredentialsFileError(f"{where}: 'claims' needs an 'issuer'")
    if issuer is not None and (not isinstance(issuer, str) or not issuer):
        raise CredentialsFileError(f"{where}: 'issuer' must be the issuer URL")
    matches: list[ClaimMatch] = []
    if claims is not None:
        if not isinstance(claims, dict):
            raise CredentialsFileError(f"{where}: 'claims' must be a table of claim = value")
        for name, wanted in claims.items():
            if not isinstance(wanted, str | bool | int) or isinstance(wanted, float):
                raise CredentialsFileError(f"{where}: claim {name!r} must be a string, a boolean or an integer")
            matches.append(ClaimMatch.of(name, wanted))
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
    prefixes = tuple(i.rstrip("/") for i in instances)
    if isinstance(issuer, str):
        return Grant(None, perms, prefixes, issuer, tuple(matches))
    assert isinstance(principal, str)
    return Grant(principal.strip(), perms, prefixes)
