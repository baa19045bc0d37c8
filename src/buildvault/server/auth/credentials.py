"""Who is calling: htpasswd entries, bearer tokens, and the `authorization` value that names them.

Both protocols hand this module the raw `authorization` value (an HTTP header or a gRPC
metadata entry). `parse_authorization` turns it into a `Presented` credential or raises
`BadCredentials` with a reason from a fixed set (the refusal metric's label). `Credentials`
checks a presented credential against the files it was loaded from:

- htpasswd: `user:hash` lines as `htpasswd -B` (bcrypt `$2y$`/`$2b$`/`$2a$`) or plain
  `htpasswd` (`$apr1$`) write them; any other scheme is refused when the file is loaded.
- tokens: `PRINCIPAL SHA256HEX` lines; only hashes are stored, compared with
  `hmac.compare_digest` against every entry.

A password check (bcrypt is slow on purpose) runs in a worker thread; an `authorization`
value that was accepted once is remembered (in this process only), so a build's thousands of
requests pay for one check. A new `Credentials` (a reload) starts with an empty memory.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from passlib.hash import apr_md5_crypt

__all__ = [
    "BadCredentials",
    "Credentials",
    "CredentialsFileError",
    "Presented",
    "add_token",
    "load_htpasswd",
    "load_tokens",
    "parse_authorization",
]

# Longer values are refused before any decoding (Basic of a 1 KiB user:password is ~1.4 KiB).
MAX_AUTHORIZATION_LENGTH = 4096
_BCRYPT_PREFIXES = ("$2y$", "$2b$", "$2a$")
_APR1_PREFIX = "$apr1$"
_REMEMBERED = 4096
_BCRYPT_HASH = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")


class BadCredentials(Exception):
    """The caller's credential is malformed, of an unknown scheme or wrong.

    `reason` is one of "malformed", "unknown_scheme", "bad_credentials"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CredentialsFileError(ValueError):
    """An htpasswd, token or access file cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Presented:
    """A credential as sent: `scheme` is "basic" (user, password) or "bearer" (token in `secret`)."""

    scheme: str
    user: str
    secret: str
    raw: str


def parse_authorization(value: str) -> Presented:
    """`Basic <base64 user:password>` or `Bearer <token>` (scheme case-insensitive)."""
    if len(value) > MAX_AUTHORIZATION_LENGTH:
        raise BadCredentials("malformed", f"authorization value longer than {MAX_AUTHORIZATION_LENGTH} characters")
    if not value.isascii() or not value.isprintable():
        raise BadCredentials("malformed", "authorization value has non-printable or non-ASCII characters")
    scheme, _, rest = value.strip().partition(" ")
    rest = rest.strip()
    lowered = scheme.lower()
    if lowered not in ("basic", "bearer"):
        raise BadCredentials("unknown_scheme", f"unknown authorization scheme {scheme[:20]!r}: use Basic or Bearer")
    if not rest or " " in rest:
        raise BadCredentials("malformed", f"malformed {scheme[:20]} credential")
    if lowered == "bearer":
        return Presented("bearer", "", rest, value)
    try:
        decoded = base64.b64decode(rest, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BadCredentials("malformed", "malformed Basic credential: not base64 of UTF-8 user:password") from None
    user, colon, password = decoded.partition(":")
    if not colon or not user:
        raise BadCredentials("malformed", "malformed Basic credential: want user:password")
    return Presented("basic", user, password, value)


# -- files ------------------------------------------------------------------------------------


def _lines(path: Path, what: str) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CredentialsFileError(f"{what} {path}: {e}") from None
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def load_htpasswd(path: Path) -> dict[str, str]:
    """user -> hash; refuses schemes other than bcrypt and apr1 (name the line)."""
    entries: dict[str, str] = {}
    for number, line in _lines(path, "htpasswd file"):
        user, colon, hashed = line.partition(":")
        if not colon or not user or not hashed:
            raise CredentialsFileError(f"htpasswd file {path} line {number}: want user:hash")
        if not hashed.startswith((*_BCRYPT_PREFIXES, _APR1_PREFIX)):
            raise CredentialsFileError(
                f"htpasswd file {path} line {number}: user {user!r} has an unsupported hash scheme; "
                "use bcrypt (htpasswd -B) or apr1"
            )
        if hashed.startswith(_BCRYPT_PREFIXES) and not _BCRYPT_HASH.fullmatch(hashed):
            raise CredentialsFileError(f"htpasswd file {path} line {number}: invalid bcrypt hash")
        entries[user] = hashed
    return entries


def load_tokens(path: Path) -> list[tuple[str, str]]:
    """[(principal, sha256 hex)]: one `PRINCIPAL SHA256HEX` per line."""
    entries: list[tuple[str, str]] = []
    for number, line in _lines(path, "token file"):
        parts = line.split()
        if len(parts) != 2:
            raise CredentialsFileError(f"token file {path} line {number}: want PRINCIPAL SHA256HEX")
        principal, digest = parts[0], parts[1].lower()
        _check_principal(principal, f"token file {path} line {number}")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise CredentialsFileError(f"token file {path} line {number}: the hash must be 64 hex digits")
        entries.append((principal, digest))
    return entries


def _check_principal(principal: str, where: str) -> None:
    # ':' is reserved: certificate principals are "cert:<CN>" and must not be claimable by a token.
    if ":" in principal or not principal.isprintable():
        raise CredentialsFileError(f"{where}: principal {principal[:40]!r} must not contain ':'")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def add_token(principal: str, path: Path) -> str:
    """Append a new random token's hash for `principal` to the token file (created 0600); return the token."""
    _check_principal(principal, "principal")
    if not principal or any(c.isspace() for c in principal):
        raise CredentialsFileError(f"principal {principal!r} must be one word")
    if path.exists():
        load_tokens(path)  # refuse to append to a file the server could not read
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if f.tell() and not path.read_bytes().endswith(b"\n"):
            f.write("\n")
        f.write(f"{principal} {token_hash(token)}\n")
    return token


# -- checking ---------------------------------------------------------------------------------


class Credentials:
    """The accepted passwords and tokens, as loaded once; `check` names the caller or raises."""

    def __init__(self, htpasswd: dict[str, str] | None = None, tokens: list[tuple[str, str]] | None = None) -> None:
        self.htpasswd = htpasswd or {}
        self.tokens = tokens or []
        self._accepted: dict[str, str] = {}  # accepted authorization value -> principal

    @property
    def configured(self) -> bool:
        return bool(self.htpasswd) or bool(self.tokens)

    def remembered(self, authorization: str) -> str | None:
        """The principal of an `authorization` value accepted before (no parsing, no hashing)."""
        return self._accepted.get(authorization)

    async def check(self, presented: Presented) -> str:
        """The principal the credential proves; BadCredentials("bad_credentials") when it proves none."""
        key = presented.raw
        known = self._accepted.get(key)
        if known is not None:
            return known
        if presented.scheme == "bearer":
            principal = self._token_principal(presented.secret)
        else:
            principal = await self._password_principal(presented.user, presented.secret)
        if principal is None:
            raise BadCredentials("bad_credentials", "the credential is not valid")
        if len(self._accepted) >= _REMEMBERED:
            self._accepted.clear()
        self._accepted[key] = principal
        return principal

    def _token_principal(self, token: str) -> str | None:
        presented = token_hash(token)
        found = None
        for principal, digest in self.tokens:  # every entry, so the time does not tell which matched
            if hmac.compare_digest(presented, digest) and found is None:
                found = principal
        return found

    async def _password_principal(self, user: str, password: str) -> str | None:
        hashed = self.htpasswd.get(user)
        if hashed is None:
            return None
        ok = await asyncio.to_thread(_verify_password, password, hashed)
        return user if ok else None


def _verify_password(password: str, hashed: str) -> bool:
    if hashed.startswith(_APR1_PREFIX):
        return bool(apr_md5_crypt.verify(password, hashed))
    # Apache's bcrypt reads only the first 72 bytes; $2y$ is the same algorithm as $2b$.
    candidate = password.encode()[:72]
    try:
        return bcrypt.checkpw(candidate, ("$2b$" + hashed[4:]).encode())
    except ValueError:
        return False
