"""The one rule engine: the gRPC check and the HTTP middleware both ask `Policy`.

    caller = await policy.authenticate(authorization, cert_cn)      # None: no credential sent
    policy.authorize(caller, Permission.WRITE, "team-a")            # or raises Refusal

A `Policy` is an immutable snapshot of the loaded files; a reload builds a new one and swaps
it in whole, so a request sees either the old settings or the new ones, never a mix.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from buildvault.server.auth.credentials import BadCredentials, Credentials, parse_authorization
from buildvault.server.auth.grants import Caller, Grants, Permission

if TYPE_CHECKING:
    from buildvault.server.auth.oidc import OidcVerifier

__all__ = ["ANONYMOUS", "INTERNAL_PRINCIPAL", "Caller", "Policy", "Refusal"]

# How an unauthenticated caller appears in request logs.
ANONYMOUS = "anonymous"
CERT_PREFIX = "cert:"
# The server's own local workers (they fetch inputs and upload outputs through its CAS). A token
# file's principal cannot contain ':', so no credential on disk can claim this name.
INTERNAL_PRINCIPAL = "buildvault:local-workers"
_REMEMBERED = 4096


class Refusal(Exception):
    """A request is refused. `unauthenticated`: no or bad credentials (UNAUTHENTICATED / 401);
    else the principal lacks the permission (PERMISSION_DENIED / 403). `reason` is the
    refusal metric's label: missing, malformed, unknown_scheme, bad_credentials,
    no_client_certificate, denied, or for OIDC tokens bad_token, expired_token, unknown_key."""

    def __init__(self, unauthenticated: bool, reason: str, message: str) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated
        self.reason = reason


INTERNAL_CALLER = Caller(INTERNAL_PRINCIPAL)



def looks_like_jwt(token: str) -> bool:
    """A compact JWS (three dot-separated parts): the tokens `buildvault token add` makes have no dot."""
    return token.count(".") == 2

@dataclass(frozen=True)
class Policy:
    """enabled False: nothing configured, everyone may do everything (today's open server).

    grants None (no access file): every authenticated principal may read and write (the
    settings refuse OIDC issuers without an access file)."""

    enabled: bool = False
    credentials: Credentials = field(default_factory=Credentials)
    grants: Grants | None = None
    allow_unauthenticated_reads: bool = False
    certificates_identify: bool = False
    internal_token: str | None = None  # made at start-up for the local workers, never on disk
    oidc: OidcVerifier | None = None
    _callers: dict[str, Caller] = field(default_factory=dict, compare=False, repr=False)

    async def authenticate(self, authorization: str | None, cert_cn: str | None) -> Caller | None:
        """The caller, None when it sent no credential; Refusal for a bad one.

        An `authorization` value wins over a client certificate. A bearer token shaped as a JWT
        goes to the OIDC verifier when issuers are configured, never to the token file."""
        if authorization is not None:
            if self.internal_token is not None and hmac.compare_digest(
                authorization.encode("utf-8", "replace"), f"Bearer {self.internal_token}".encode()
            ):
                return INTERNAL_CALLER
            known = self._callers.get(authorization)
            if known is not None:
                identity = known.identity
                if identity is None or (not identity.revoked and identity.expires > time.time()):
                    return known
                del self._callers[authorization]
            try:
                presented = parse_authorization(authorization)
                if self.oidc is not None and presented.scheme == "bearer" and looks_like_jwt(presented.secret):
                    identity = await self.oidc.verify(presented.secret)
                    return self._remember(authorization, Caller(identity.principal, identity))
                principal = await self.credentials.check(presented)
            except BadCredentials as e:
                raise Refusal(True, e.reason, f"unauthenticated: {e}") from None
            return self._remember(authorization, Caller(principal))
        if cert_cn is not None and self.certificates_identify:
            key = "\x00cert:" + cert_cn  # never an authorization value (those are printable)
            known = self._callers.get(key)
            return known if known is not None else self._remember(key, Caller(CERT_PREFIX + cert_cn))
        return None

    def _remember(self, key: str, caller: Caller) -> Caller:
        """Accepted credentials answer from memory next time (a dict lookup; an OIDC caller also
        until its token expires or its key is dropped)."""
        if len(self._callers) >= _REMEMBERED:
            self._callers.clear()
        self._callers[key] = caller
        return caller

    def allows(self, caller: Caller | str | None, permission: Permission, instance: str | None) -> bool:
        """`instance` None: on some instance (the /status and /metrics pages)."""
        if not self.enabled:
            return True
        if permission is Permission.READ and self.allow_unauthenticated_reads:
            return True
        if caller is None:
            return False
        principal = caller if isinstance(caller, str) else caller.principal
        if principal == INTERNAL_PRINCIPAL:
            return permission in (Permission.READ, Permission.WRITE)
        if self.grants is None:
            return permission in (Permission.READ, Permission.WRITE)
        return self.grants.allows(caller, permission, instance)

    def authorize(self, caller: Caller | str | None, permission: Permission, instance: str | None) -> None:
        if self.allows(caller, permission, instance):
            return
        if caller is None:
            raise Refusal(True, "missing", "unauthenticated: send credentials (Basic, Bearer or a client certificate)")
        principal = caller if isinstance(caller, str) else caller.principal
        where = "any instance" if instance is None else f"instance {instance!r}"
        raise Refusal(False, "denied", f"permission denied: {principal!r} lacks {permission.value} on {where}")
