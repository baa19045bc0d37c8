"""The server's access-control state: built from Settings at start-up, swapped whole on reload.

    auth = Auth.from_settings(settings, metrics)   # AuthStartupError names the bad setting
    auth.policy                                     # the current Policy snapshot
    await auth.reload()                             # SIGHUP: reread files, refetch OIDC keys (a bad file: old state)
    auth.refused("grpc", refusal)                   # count a refusal by reason

With no credential file, no access file and no client certificates, `auth.policy.enabled` is
False and both front ends skip every check (today's open server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildvault.config import Settings
from buildvault.server.auth.audit import AuditLog
from buildvault.server.auth.credentials import Credentials, CredentialsFileError, load_htpasswd, load_tokens
from buildvault.server.auth.grants import Grants, load_access_file
from buildvault.server.auth.policy import Policy, Refusal
from buildvault.server.auth.tls import Tls, TlsError

if TYPE_CHECKING:
    from buildvault.server.auth.oidc import IssuerKeys, OidcVerifier

__all__ = ["Auth", "AuthStartupError", "load_policy"]

log = logging.getLogger("buildvault.auth")

_LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")


class AuthStartupError(RuntimeError):
    """A certificate, key or auth file cannot be used at start-up; the message names the setting."""


def load_policy(settings: Settings, oidc: OidcVerifier | None = None) -> Policy:
    """Read the htpasswd, token and access files named in `settings` (blocking)."""
    htpasswd = load_htpasswd(Path(settings.htpasswd_file)) if settings.htpasswd_file else {}
    tokens = load_tokens(Path(settings.token_file)) if settings.token_file else []
    grants: Grants | None = load_access_file(Path(settings.access_file)) if settings.access_file else None
    for grant in grants.grants if grants is not None else ():
        if grant.issuer is not None and grant.issuer not in settings.oidc_issuer:
            raise CredentialsFileError(
                f"access file {settings.access_file}: issuer {grant.issuer!r} is not an --oidc-issuer"
            )
    certificates = settings.tls_client_auth != "none"
    enabled = bool(
        settings.htpasswd_file or settings.token_file or settings.access_file or certificates or settings.oidc_issuer
    )
    return Policy(
        enabled=enabled,
        credentials=Credentials(htpasswd, tokens),
        grants=grants,
        allow_unauthenticated_reads=settings.allow_unauthenticated_reads,
        certificates_identify=certificates,
        oidc=oidc,
    )


def oidc_verifier(settings: Settings, known: Mapping[str, IssuerKeys]) -> OidcVerifier | None:
    """The verifier of `--oidc-issuer` tokens (blocking: reads `--oidc-jwks-file`); the key sets
    of issuers in `known` are kept (fetched keys outlive a reload)."""
    if not settings.oidc_issuer:
        return None
    # Imported here: PyJWT and cryptography add about 9 MiB to every server's RSS, so only a
    # server that trusts an issuer loads them.
    from buildvault.server.auth.oidc import IssuerKeys, OidcVerifier, load_jwks_file

    if settings.oidc_jwks_file:
        fixed = load_jwks_file(Path(settings.oidc_jwks_file), settings.oidc_issuer)
        keys = {issuer: IssuerKeys(issuer, fixed.get(issuer, {})) for issuer in settings.oidc_issuer}
    else:
        keys = {issuer: known.get(issuer) or IssuerKeys(issuer) for issuer in settings.oidc_issuer}
    return OidcVerifier(keys, settings.oidc_audience, settings.oidc_max_lifetime)


class Auth:
    """What the listeners share: the current Policy, the TLS state, the refusal counter."""

    def __init__(
        self, settings: Settings, policy: Policy, tls: Tls | None, metrics: Any = None, audit: AuditLog | None = None
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.audit = audit  # --audit-log: the writes of entries, recorded by the checks
        self.tls = tls
        self.metrics = metrics
        self.reloads = 0  # successful reloads (tests wait on it)
        self.failed_reloads = 0

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Any = None) -> Auth:
        if settings.oidc_issuer:
            from buildvault.server.auth.oidc import check_issuer_url  # see oidc_verifier

            for issuer in settings.oidc_issuer:
                refused = check_issuer_url(issuer)
                if refused is not None:
                    raise AuthStartupError(f"oidc_issuer: {refused}")
        try:
            policy = load_policy(settings, oidc_verifier(settings, {}))
        except CredentialsFileError as e:
            raise AuthStartupError(_setting_named(settings, str(e))) from None
        tls = None
        if settings.tls_cert_file:
            try:
                tls = Tls(
                    settings.tls_cert_file,
                    settings.tls_key_file,
                    settings.tls_client_ca_file,
                    settings.tls_client_auth,
                    settings.min_tls_version,
                )
            except TlsError as e:
                raise AuthStartupError(str(e)) from None
        audit = None
        if settings.audit_log:
            audit = AuditLog(Path(settings.audit_log))
            try:
                audit.open()
            except OSError as e:
                raise AuthStartupError(f"audit_log {settings.audit_log}: {e.strerror or e}") from None
        auth = cls(settings, policy, tls, metrics, audit)
        auth._warn_if_open()
        return auth

    @property
    def enabled(self) -> bool:
        """Whether the listeners wrap their handlers: access control or the audit log is on."""
        return self.policy.enabled or self.audit is not None

    async def close(self) -> None:
        """At shutdown: the audit log's last lines, the OIDC key fetches."""
        if self.audit is not None:
            await self.audit.close()
        if self.policy.oidc is not None:
            await self.policy.oidc.close()

    @property
    def requires_client_certificate(self) -> bool:
        return self.tls is not None and self.tls.requires_client_certificate

    def refused(self, protocol: str, refusal: Refusal) -> None:
        if self.metrics is not None:
            self.metrics.auth_refused(protocol, refusal.reason)

    def issue_internal_token(self) -> str:
        """A bearer token for the server's own local workers: read and write on every instance,
        held in memory only (kept across reloads)."""
        token = secrets.token_urlsafe(32)
        self.policy = dataclasses.replace(self.policy, internal_token=token)
        return token

    async def reload(self) -> bool:
        """Reread every file; on any error keep the old settings, log why and return False."""
        known = self.policy.oidc.issuers if self.policy.oidc is not None else {}
        try:
            oidc = await asyncio.to_thread(oidc_verifier, self.settings, known)
            policy = await asyncio.to_thread(load_policy, self.settings, oidc)
            files = await asyncio.to_thread(self.tls.read) if self.tls is not None else None
        except (CredentialsFileError, TlsError) as e:
            self.failed_reloads += 1
            log.error("reload failed, keeping the previous settings: %s", e)
            return False
        if self.tls is not None and files is not None:
            self.tls.apply(files)
        self.policy = dataclasses.replace(policy, internal_token=self.policy.internal_token)
        if self.audit is not None:
            self.audit.reopen()
        if oidc is not None:  # SIGHUP also fetches every issuer's keys again
            await asyncio.gather(*(keys.refresh(force=True) for keys in oidc.issuers.values() if not keys.fixed))
        self.reloads += 1
        log.info("reloaded access control%s", " and TLS certificates" if self.tls is not None else "")
        return True

    def _warn_if_open(self) -> None:
        if self.policy.enabled:
            return
        s = self.settings
        for name, address in (("gRPC", s.grpc_address), ("HTTP", s.http_address)):
            if address and not address.startswith(_LOOPBACK_HOSTS):
                log.warning(
                    "the %s listener binds %s with no credentials configured: anyone who can reach it "
                    "can write to the cache (set --token-file, --htpasswd-file or client certificates)",
                    name,
                    address,
                )


def _setting_named(settings: Settings, message: str) -> str:
    for name in ("htpasswd_file", "token_file", "access_file", "oidc_jwks_file"):
        path = getattr(settings, name)
        if path and path in message:
            return f"{name}: {message}"
    return message
