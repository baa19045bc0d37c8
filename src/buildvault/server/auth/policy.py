"""The one rule engine: the gRPC check and the HTTP middleware both ask `Policy`.

    principal = await policy.authenticate(authorization, cert_cn)   # None: no credential sent
    policy.authorize(principal, Permission.WRITE, "team-a")         # or raises Refusal

A `Policy` is an immutable snapshot of the loaded files; a reload builds a new one and swaps
it in whole, so a request sees either the old settings or the new ones, never a mix.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from buildvault.server.auth.credentials import BadCredentials, Credentials, parse_authorization
from buildvault.server.auth.grants import Grants, Permission

__all__ = ["ANONYMOUS", "INTERNAL_PRINCIPAL", "Policy", "Refusal"]

# How an unauthenticated caller appears in request logs.
ANONYMOUS = "anonymous"
CERT_PREFIX = "cert:"
# The server's own local workers (they fetch inputs and upload outputs through its CAS). A token
# file's principal cannot contain ':', so no credential on disk can claim this name.
INTERNAL_PRINCIPAL = "buildvault:local-workers"


class Refusal(Exception):
    """A request is refused. `unauthenticated`: no or bad credentials (UNAUTHENTICATED / 401);
    else the principal lacks the permission (PERMISSION_DENIED / 403). `reason` is the
    refusal metric's label: missing, malformed, unknown_scheme, bad_credentials,
    no_client_certificate or denied."""

    def __init__(self, unauthenticated: bool, reason: str, message: str) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated
        self.reason = reason


@dataclass(frozen=True)
class Policy:
    """enabled False: nothing configured, everyone may do everything (today's open server).

    grants None (no access file): every authenticated principal may read and write."""

    enabled: bool = False
    credentials: Credentials = field(default_factory=Credentials)
    grants: Grants | None = None
    allow_unauthenticated_reads: bool = False
    certificates_identify: bool = False
    internal_token: str | None = None  # made at start-up for the local workers, never on disk

    async def authenticate(self, authorization: str | None, cert_cn: str | None) -> str | None:
        """The caller's principal, None when it sent no credential; Refusal for a bad one.

        An `authorization` value wins over a client certificate."""
        if authorization is not None:
            if self.internal_token is not None and hmac.compare_digest(
                authorization.encode("utf-8", "replace"), f"Bearer {self.internal_token}".encode()
            ):
                return INTERNAL_PRINCIPAL
            known = self.credentials.remembered(authorization)
            if known is not None:
                return known
            try:
                presented = parse_authorization(authorization)
                return await self.credentials.check(presented)
            except BadCredentials as e:
                raise Refusal(True, e.reason, f"unauthenticated: {e}") from None
        if cert_cn is not None and self.certificates_identify:
            return CERT_PREFIX + cert_cn
        return None

    def allows(self, principal: str | None, permission: Permission, instance: str | None) -> bool:
        """`instance` None: on some instance (the /status and /metrics pages)."""
        if not self.enabled:
            return True
        if permission is Permission.READ and self.allow_unauthenticated_reads:
            return True
        if principal is None:
            return False
        if principal == INTERNAL_PRINCIPAL:
            return permission in (Permission.READ, Permission.WRITE)
        if self.grants is None:
            return permission in (Permission.READ, Permission.WRITE)
        return self.grants.allows(principal, permission, instance)

    def authorize(self, principal: str | None, permission: Permission, instance: str | None) -> None:
        if self.allows(principal, permission, instance):
            return
        if principal is None:
            raise Refusal(True, "missing", "unauthenticated: send credentials (Basic, Bearer or a client certificate)")
        where = "any instance" if instance is None else f"instance {instance!r}"
        raise Refusal(False, "denied", f"permission denied: {principal!r} lacks {permission.value} on {where}")
