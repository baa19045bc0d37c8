"""Who a CI job is: JWT bearer tokens signed by a trusted OpenID Connect issuer (issue 36).

A CI system (GitHub Actions, GitLab CI, ...) gives every job a short-lived token signed by its
issuer, with claims naming the job (`repository`, `ref`, `event_name`, ...). The server trusts
the issuers named by `--oidc-issuer` and verifies each token with PyJWT against the issuer's
published keys; it never parses or checks a signature by hand.

What a token must be (anything else is refused, UNAUTHENTICATED / 401):
- a JWS with `alg` RS256, PS256, ES256 or EdDSA (never `none`, never an HMAC), a `kid` the
  issuer's key set holds, a key of the type the algorithm needs (and of the algorithm the key
  names, when it names one), and no `jwk`, `jku`, `x5u`, `x5c` or `crit` header: the server
  uses only keys it fetched itself;
- `iss` exactly one of the trusted issuers, `aud` holding `--oidc-audience`, `sub` present,
  `exp` and `iat` present, `exp`/`nbf`/`iat` within `LEEWAY` seconds of the clock, and
  `exp - iat` at most `--oidc-max-lifetime`.

Keys come from the issuer's discovery document (`<issuer>/.well-known/openid-configuration`,
whose `issuer` must be the issuer exactly, then its `jwks_uri`) through aiohttp's client, never
blocking the event loop, or from `--oidc-jwks-file` (air-gapped servers). They are cached per
issuer: a token naming an unknown `kid` refreshes the set at most once per `REFRESH_LIMIT`
seconds (the first load excepted), a set in use is refreshed in the background every
`REFRESH_EVERY` seconds, and a failed fetch keeps the keys already known (an issuer outage does
not stop the jobs whose keys are known) and never lets a token in. A refresh that drops a key
forgets every token verified with that issuer's keys, so a removed key's tokens stop working as
soon as the server learns the new set.

A verified token is remembered until it expires (a build's thousands of requests pay for one
signature check). The principal in logs and metrics is `oidc:<issuer host>:<sub>`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from buildvault.server.auth.credentials import BadCredentials, CredentialsFileError

__all__ = [
    "ALGORITHMS",
    "Identity",
    "IssuerKeys",
    "OidcVerifier",
    "check_issuer_url",
    "load_jwks_file",
]

log = logging.getLogger("buildvault.auth")

ALGORITHMS = ("RS256", "PS256", "ES256", "EdDSA")
LEEWAY = 60  # seconds of clock skew allowed on exp, nbf and iat
REFRESH_LIMIT = 60.0  # at most one refresh per issuer per minute on an unknown kid
RETRY_FIRST_LOAD = 10.0  # while no key set was ever loaded, one attempt per 10 s
REFRESH_EVERY = 3600.0  # a key set in use is refreshed in the background after an hour
FETCH_TIMEOUT = 10.0
MAX_DOCUMENT = 1 << 20  # discovery document and JWKS: at most 1 MiB
MIN_RSA_BITS = 2048
_REMEMBERED = 4096  # verified tokens kept at most
_FORBIDDEN_HEADERS = ("jwk", "jku", "x5u", "x5c", "crit")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | ed448.Ed448PublicKey


def check_issuer_url(url: str) -> str | None:
    """None when `url` may be trusted as an issuer (or a jwks_uri), else why not: https, or http
    on loopback only (a test issuer), no query or fragment."""
    parts = urlsplit(url)
    secure = parts.scheme == "https" and bool(parts.hostname)
    if not secure and not (parts.scheme == "http" and parts.hostname in _LOOPBACK):
        return f"{url!r} is not an https URL (http only on loopback)"
    if parts.query or parts.fragment:
        return f"{url!r} has a query or fragment"
    return None


@dataclass(frozen=True, slots=True)
class Key:
    """One verification key: the public key and the algorithm its JWK names (None: any that fits)."""

    key: _PublicKey
    algorithm: str | None

    def fits(self, algorithm: str) -> bool:
        if self.algorithm is not None and self.algorithm != algorithm:
            return False
        if algorithm in ("RS256", "PS256"):
            return isinstance(self.key, rsa.RSAPublicKey)
        if algorithm == "ES256":
            return isinstance(self.key, ec.EllipticCurvePublicKey) and isinstance(self.key.curve, ec.SECP256R1)
        return isinstance(self.key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey)


def parse_jwks(document: object, where: str) -> dict[str, Key]:
    """kid -> Key for every usable signing key of a JWKS (`{"keys": [...]}`); symmetric keys,
    encryption keys, keys without a kid, algorithms not accepted and RSA keys under 2048 bits
    are left out. ValueError when the document is no JWKS or holds no usable key."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError(f"{where}: not a JWK set (want {{\"keys\": [...]}})")
    keys: dict[str, Key] = {}
    for entry in document["keys"]:
        if not isinstance(entry, dict):
            continue
        kid, algorithm = entry.get("kid"), entry.get("alg")
        if not isinstance(kid, str) or not kid or entry.get("kty") not in ("RSA", "EC", "OKP"):
            continue
        if entry.get("use", "sig") != "sig" or (algorithm is not None and algorithm not in ALGORITHMS):
            continue
        try:
            public = jwt.PyJWK(entry).key
        except (jwt.PyJWTError, ValueError, TypeError, KeyError):
            log.warning("%s: key %r cannot be used, left out", where, kid[:64])
            continue
        if hasattr(public, "public_key") and not isinstance(public, _PublicKey):
            public = public.public_key()  # a JWK that carries private parts: keep only the public half
        if not isinstance(public, _PublicKey):
            continue
        if isinstance(public, rsa.RSAPublicKey) and public.key_size < MIN_RSA_BITS:
            log.warning("%s: RSA key %r has %d bits, left out", where, kid[:64], public.key_size)
            continue
        if kid in keys:
            log.warning("%s: kid %r appears twice, the first is used", where, kid[:64])
            continue
        keys[kid] = Key(public, algorithm)
    if not keys:
        raise ValueError(f"{where}: no usable signing key (RS256, PS256, ES256 or EdDSA with a kid)")
    return keys


def load_jwks_file(path: Path, issuers: tuple[str, ...]) -> dict[str, dict[str, Key]]:
    """issuer -> keys from `--oidc-jwks-file` (blocking): a JWKS, when one issuer is configured,
    or an object mapping each issuer URL to its JWKS."""
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CredentialsFileError(f"oidc_jwks_file {path}: {e}") from None
    try:
        if isinstance(document, dict) and "keys" in document:
            if len(issuers) != 1:
                raise ValueError("a bare JWKS serves one issuer; map each issuer URL to its JWKS")
            return {issuers[0]: parse_jwks(document, f"oidc_jwks_file {path}")}
        if not isinstance(document, dict):
            raise ValueError("want a JWKS or an object of issuer URL -> JWKS")
        unknown = set(document) - set(issuers)
        if unknown:
            raise ValueError(f"issuer {sorted(unknown)[0]!r} is not an --oidc-issuer")
        return {issuer: parse_jwks(document[issuer], f"oidc_jwks_file {path} [{issuer}]") for issuer in document}
    except ValueError as e:
        raise CredentialsFileError(f"oidc_jwks_file {path}: {e}") from None


class IssuerKeys:
    """One issuer's key set: fetched (discovery, then jwks_uri) or fixed (a JWKS file)."""

    def __init__(
        self,
        issuer: str,
        fixed: dict[str, Key] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.issuer = issuer
        self.keys: dict[str, Key] = dict(fixed or {})
        self.fixed = fixed is not None
        self.clock = clock
        self.on_removed = on_removed
        self.loaded_at: float | None = clock() if self.fixed else None
        self.last_attempt: float | None = None
        self.last_refresh: float | None = None  # the last fetch started once a set was loaded
        self.fetches = 0  # fetch attempts (tests and the status of an outage)
        self._fetching: asyncio.Task[None] | None = None
        self._background: asyncio.Task[None] | None = None

    async def key(self, kid: str) -> Key | None:
        """The key named `kid`; an unknown kid refreshes the set when the rate limit allows."""
        found = self.keys.get(kid)
        if found is not None:
            self._refresh_if_old()
            return found
        if self.fixed:
            return None
        await self.refresh()
        return self.keys.get(kid)

    def _may_fetch(self) -> bool:
        now = self.clock()
        if self.loaded_at is None:  # never loaded: the first load, then a retry every 10 s
            return self.last_attempt is None or now - self.last_attempt >= RETRY_FIRST_LOAD
        return self.last_refresh is None or now - self.last_refresh >= REFRESH_LIMIT

    async def refresh(self, force: bool = False) -> None:
        """Fetch the set again unless one fetch is running (then wait for it) or the limit says
        no (`force`: a reload asked)."""
        if self._fetching is None:
            if not force and not self._may_fetch():
                return
            self.last_attempt = self.clock()
            if self.loaded_at is not None:
                self.last_refresh = self.last_attempt
            self._fetching = asyncio.ensure_future(self._fetch())
        await asyncio.shield(self._fetching)

    def _refresh_if_old(self) -> None:
        if self.fixed or self.loaded_at is None or self.clock() - self.loaded_at < REFRESH_EVERY:
            return
        idle = self._background is None or self._background.done()
        if idle and self._fetching is None and self._may_fetch():
            self._background = asyncio.ensure_future(self.refresh())

    async def _fetch(self) -> None:
        """Never raises: a failure is logged and the keys already known stay."""
        self.fetches += 1
        try:
            keys = await fetch_issuer_keys(self.issuer)
        except Exception as e:  # network, HTTP status, JSON, no usable key: keep what we have
            known = len(self.keys)
            log.warning("OIDC issuer %s: fetching its keys failed, keeping %d known: %s", self.issuer, known, e)
            return
        finally:
            self._fetching = None
        removed = set(self.keys) - set(keys)
        self.keys = keys
        self.loaded_at = self.clock()
        log.info("OIDC issuer %s: %d keys loaded", self.issuer, len(keys))
        if removed and self.on_removed is not None:
            self.on_removed(self.issuer)

    async def close(self) -> None:
        for task in (self._fetching, self._background):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, allow_redirects=False, headers={"Accept": "application/json"}) as response:
        if response.status != 200:
            raise ValueError(f"GET {url}: HTTP {response.status}")
        body = await response.content.read(MAX_DOCUMENT + 1)
        if len(body) > MAX_DOCUMENT:
            raise ValueError(f"GET {url}: larger than {MAX_DOCUMENT} bytes")
        try:
            return json.loads(body)
        except ValueError:
            raise ValueError(f"GET {url}: not JSON") from None


async def fetch_issuer_keys(issuer: str) -> dict[str, Key]:
    """Discovery document -> jwks_uri -> keys, with aiohttp's client (ValueError, aiohttp errors)."""
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        discovery = await _get_json(session, issuer.rstrip("/") + "/.well-known/openid-configuration")
        if not isinstance(discovery, dict) or discovery.get("issuer") != issuer:
            raise ValueError("the discovery document names another issuer")
        jwks_uri = discovery.get("jwks_uri")
        if not isinstance(jwks_uri, str):
            raise ValueError("the discovery document has no jwks_uri")
        refused = check_issuer_url(jwks_uri)
        if refused is not None:
            raise ValueError(f"jwks_uri {refused}")
        return parse_jwks(await _get_json(session, jwks_uri), jwks_uri)


@dataclass(eq=False, slots=True)
class Identity:
    """A verified token: its principal, issuer and claims, until `expires` (epoch seconds)."""

    principal: str
    issuer: str
    claims: Mapping[str, Any]
    expires: float
    # Grants matched by these claims, memoized per access-file load (grants.py).
    matched: tuple[object, tuple[Any, ...]] | None = field(default=None, repr=False)
    revoked: bool = False  # its issuer's key set dropped a key: verify the token again


def _host(issuer: str) -> str:
    parts = urlsplit(issuer)
    return parts.netloc.rpartition("@")[2]


class OidcVerifier:
    """Verifies bearer JWTs from the configured issuers; one per access-control load."""

    def __init__(
        self,
        issuers: Mapping[str, IssuerKeys],
        audience: str,
        max_lifetime: float,
        *,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.issuers = dict(issuers)
        self.audience = audience
        self.max_lifetime = max_lifetime
        self.now = now
        self._verified: dict[str, Identity] = {}
        for keys in self.issuers.values():
            keys.on_removed = self._forget_issuer

    def remembered(self, token: str) -> Identity | None:
        """A token verified before and not yet expired (a dict lookup and a clock read)."""
        identity = self._verified.get(token)
        if identity is None:
            return None
        if identity.expires <= self.now():
            self._verified.pop(token, None)
            return None
        return identity

    async def verify(self, token: str) -> Identity:
        """The token's Identity, or BadCredentials: `bad_token`, `expired_token` or `unknown_key`."""
        known = self.remembered(token)
        if known is not None:
            return known
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except (jwt.PyJWTError, ValueError, TypeError) as e:
            raise BadCredentials("bad_token", f"not a valid JWT: {_short(e)}") from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            raise BadCredentials("bad_token", f"JWT algorithm {str(algorithm)[:20]!r} is not accepted")
        for name in _FORBIDDEN_HEADERS:
            if name in header:
                raise BadCredentials("bad_token", f"JWT header {name!r} is not accepted")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise BadCredentials("bad_token", "JWT header has no kid")
        issuer = unverified.get("iss")
        keys = self.issuers.get(issuer) if isinstance(issuer, str) else None
        if keys is None or not isinstance(issuer, str):
            raise BadCredentials("bad_token", f"JWT issuer {str(issuer)[:100]!r} is not trusted")
        key = await keys.key(kid)
        if key is None:
            raise BadCredentials("unknown_key", f"JWT key {kid[:64]!r} is not in {issuer}'s key set")
        if not key.fits(algorithm):
            raise BadCredentials("bad_token", f"JWT key {kid[:64]!r} is not a {algorithm} key")
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[algorithm],
                audience=self.audience,
                issuer=issuer,
                leeway=LEEWAY,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except (jwt.ExpiredSignatureError, jwt.ImmatureSignatureError) as e:
            raise BadCredentials("expired_token", f"JWT not valid now: {_short(e)}") from None
        except (jwt.PyJWTError, ValueError, TypeError) as e:
            raise BadCredentials("bad_token", f"JWT refused: {_short(e)}") from None
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject or len(subject) > 256 or not subject.isprintable():
            raise BadCredentials("bad_token", "JWT sub must be a printable string of at most 256 characters")
        expires, issued = claims["exp"], claims["iat"]
        if not isinstance(expires, int | float) or not isinstance(issued, int | float):
            raise BadCredentials("bad_token", "JWT exp and iat must be numbers")
        if expires - issued > self.max_lifetime:
            raise BadCredentials(
                "bad_token", f"JWT lives {int(expires - issued)} s, more than the {int(self.max_lifetime)} s allowed"
            )
        identity = Identity(f"oidc:{_host(issuer)}:{subject}", issuer, claims, float(expires) + LEEWAY)
        if len(self._verified) >= _REMEMBERED:
            self._drop_expired()
        self._verified[token] = identity
        return identity

    def _drop_expired(self) -> None:
        now = self.now()
        for token in [t for t, i in self._verified.items() if i.expires <= now]:
            del self._verified[token]
        if len(self._verified) >= _REMEMBERED:
            self._verified.clear()

    def _forget_issuer(self, issuer: str) -> None:
        for token in [t for t, i in self._verified.items() if i.issuer == issuer]:
            self._verified.pop(token).revoked = True

    async def close(self) -> None:
        for keys in self.issuers.values():
            await keys.close()


def _short(error: BaseException) -> str:
    return str(error)[:200] or type(error).__name__
